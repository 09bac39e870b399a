"""The per-round record every strategy writes (one schema, ``rounds.jsonl``) and where it goes.

:class:`RoundLog` holds the record of the round in progress: the strategy opens it in
``configure_fit``, fills client records in ``aggregate_fit`` and metrics in ``evaluate`` /
``aggregate_evaluate``, and :meth:`RoundLog.flush` hands it to a :class:`RoundRecorder`
(``fedapp.state.results.ResultsWriter`` implements one) exactly once.

Besides ``wall_seconds`` (the round's start to its record), a record's ``seconds`` says where the server's round
went: :data:`FIT_PHASE` (the round's start until the replies reach the strategy: the clients' local training, the
messages and, under SecAgg+, its stages), :data:`AGGREGATE_PHASE` (admission, accounting, decoding, aggregation and
the server step) and :data:`EVALUATE_PHASE` (the server-side evaluation of the new global model).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import numpy as np

# Per-client fields every round record carries (None when a strategy/client has no value).
CLIENT_FIELDS = (
    "client_id", "node_id", "num_examples", "batch_size", "noise_multiplier", "sample_rate", "steps",
    "epsilon_budget", "epsilon_spent", "delta", "reported_epsilon", "aggregation_weight",
    "uplink_bytes", "train_seconds", "status", "reason",
)


class RoundRecorder(Protocol):
    """Where round records go."""

    def open(self) -> None: ...

    def write_round(self, record: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


#: keys of a round record's ``seconds`` (module docstring)
FIT_PHASE, AGGREGATE_PHASE, EVALUATE_PHASE = "fit", "aggregate", "evaluate"


def jsonable(value: Any) -> Any:
    """A JSON-safe scalar: numpy scalars unwrapped, non-finite floats → None, bytes summarized."""
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def empty_client_record() -> dict[str, Any]:
    return {k: None for k in CLIENT_FIELDS}


class RoundLog:
    """The record of the round in progress; one per strategy."""

    def __init__(self, recorder: RoundRecorder | None = None) -> None:
        self.recorder = recorder
        self.current: dict[str, Any] | None = None
        self.last_round = 0  # last round whose record was flushed
        self.opened = False
        self._round_start = 0.0
        self._run_start = time.perf_counter()

    @property
    def active(self) -> bool:
        return self.current is not None

    @property
    def round(self) -> int | None:
        return None if self.current is None else int(self.current["round"])

    def open(self) -> None:
        """Open the recorder (creates the results folder) once, before round 1 trains."""
        if not self.opened and self.recorder is not None:
            self.recorder.open()
        self.opened = True

    def start(self, server_round: int) -> None:
        self.current = {"round": int(server_round), "metrics": {}, "clients": []}
        self._round_start = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Record the seconds from the round's start to now as ``seconds[phase]``, once: a later mark of the same
        phase keeps the first (no round open: nothing is recorded)."""
        if self.current is not None:
            self.current.setdefault("seconds", {}).setdefault(phase, time.perf_counter() - self._round_start)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the seconds the block takes to ``seconds[phase]`` of the round open when it ends (none open: not
        recorded; the initial model's evaluation comes before round 1 opens)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.current is not None:
                seconds = self.current.setdefault("seconds", {})
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start

    def add_metrics(self, metrics: Mapping[str, Any]) -> None:
        if self.current is not None:
            self.current["metrics"].update(metrics)

    def set_clients(self, records: list[dict[str, Any]]) -> None:
        if self.current is not None:
            self.current["clients"] = records

    def clients(self) -> list[dict[str, Any]]:
        return [] if self.current is None else self.current["clients"]

    def metrics(self) -> dict[str, Any]:
        return {} if self.current is None else self.current["metrics"]

    def flush(self, num_rounds: int) -> dict[str, Any] | None:
        """Close the current record, write it, and ``finish`` the recorder after the last round."""
        record, self.current = self.current, None
        if record is None:
            return None
        now = time.perf_counter()
        record["wall_seconds"] = now - self._round_start
        record["elapsed_seconds"] = now - self._run_start
        record["metrics"] = {k: jsonable(v) for k, v in record["metrics"].items()}
        record["clients"] = [{k: jsonable(v) for k, v in c.items()} for c in record["clients"]]
        self.last_round = max(self.last_round, int(record["round"]))
        if self.recorder is not None:
            self.recorder.write_round(record)
            if record["round"] >= num_rounds:
                self.recorder.finish()
        return record


def headline(record: Mapping[str, Any], num_rounds: int) -> tuple[Any, ...]:
    """The one log line of a written round record: (format, *arguments)."""
    eps = [c["epsilon_spent"] for c in record["clients"] if c.get("epsilon_spent") is not None]
    m = record["metrics"]
    return ("[round %d/%d] accuracy=%s loss=%s client_accuracy=%s max_epsilon=%s clients ok=%s (%.1fs)",
            record["round"], num_rounds, _fmt(m.get("accuracy")), _fmt(m.get("loss")), _fmt(m.get("client_accuracy")),
            _fmt(max(eps) if eps else None), m.get("clients_ok"), record["wall_seconds"])


def client_evaluation(results: Sequence[tuple[Any, Any, Mapping[str, Any]]]) -> tuple[float | None, dict[str, Any]]:
    """Federated evaluation from the clients' (loss, num_examples, metrics): the mean loss of clients with a
    local test split, and the mean (and spread) of their local accuracies."""
    accs, losses, val_accs, val_losses = [], [], [], []
    for loss, num_examples, m in results:
        if _is_fraction(acc := m.get("accuracy")):
            accs.append(float(acc))
        if num_examples > 0 and _is_finite(loss):  # a client without a local test split has no loss
            losses.append(float(loss))
        if _is_fraction(val_acc := m.get("val_accuracy")):  # the local validation split (tuning)
            val_accs.append(float(val_acc))
        if _is_finite(val_loss := m.get("val_loss")):
            val_losses.append(float(val_loss))
    metrics: dict[str, Any] = {}
    if accs:
        metrics["client_accuracy"] = _mean(accs)
        metrics["client_accuracy_std"] = math.sqrt(_mean([(a - metrics["client_accuracy"]) ** 2 for a in accs]))
    if val_accs:
        metrics["client_val_accuracy"] = _mean(val_accs)
    if val_losses:
        metrics["client_val_loss"] = _mean(val_losses)
    return (_mean(losses) if losses else None), metrics


def _mean(xs: Sequence[float]) -> float:
    """Mean with a correctly rounded sum, so it does not depend on the order in which clients reply."""
    return math.fsum(xs) / len(xs)


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def _is_finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and bool(np.isfinite(x))


def _is_fraction(x: object) -> TypeGuard[float]:
    return _is_finite(x) and 0 <= float(x) <= 1
