"""The empirical privacy audit of a simulated run: run-config ``audit-canaries = k`` (``strategies/privacy/audit.py``
has the estimators).

Clients ``n − k`` … ``n − 1`` of the federation are canaries: each holds a fixed random unit direction u_j (stream
``audit-seed``) and, in every round it is sampled, sends C·u_j through the run's mechanism exactly as a client sends its
update (the same clipping, noise share, sparsification and SecAgg+), instead of training; it evaluates nothing.
:class:`AuditRecorder` wraps the run's recorder: it marks the canaries in the round records (so that the summary's
ε per client and utility leave them out), keeps the global model after every round, and, when the run ends, adds the
``audit`` block to summary.json: Andrew et al.'s one-shot ε estimate, with its bootstrap interval, for an observer of
the final model and for one of every round's model, next to the accountant's ε for that observer (the release's).

What it measures: the mechanism as the run executes it, on the model's change, against whoever sees the released
models; the estimate holds under the paper's Gaussian fit of the statistics, it is not a bound. Canaries take part as
clients of the same federation (n counts them: the audited run is the run with n clients, k of them canaries).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.state.results import write_json_atomic
from strategies.aggregate import flatten
from strategies.privacy.audit import canary_directions, cosines, one_shot_estimate

#: the raw canary statistics of an audited run, next to its summary.json
STATISTICS_FILE = "audit_statistics.json"
#: never-inserted directions drawn for the null distribution of the statistics
NULL_DIRECTIONS = 500
_CHUNK = 100  # directions drawn at a time (memory: _CHUNK × d floats)


def canary_index(client_id: int, num_clients: int, canaries: int) -> int | None:
    """Which canary client ``client_id`` is (0 … k−1), or None for a client that trains."""
    first = num_clients - canaries
    return client_id - first if canaries > 0 and client_id >= first else None


def canary_direction(seed: int, index: int, dim: int) -> np.ndarray:
    """Canary ``index``'s unit direction in R^dim (the same for the canary client and the auditor)."""
    return canary_directions(seed, 1, dim, first=index)[0]


def _statistics(seed: int, first: int, count: int, final: np.ndarray, steps: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """(cos with the final change, max over rounds of cos with the round's change) of directions first … first+count−1."""
    out_final, out_iter = [], []
    for start in range(first, first + count, _CHUNK):
        u = canary_directions(seed, min(_CHUNK, first + count - start), final.size, first=start)
        out_final.append(cosines(u, final))
        out_iter.append(np.max(np.stack([cosines(u, s) for s in steps]), axis=0) if steps else np.zeros(len(u)))
    return np.concatenate(out_final), np.concatenate(out_iter)


def audit_block(seed: int, canaries: int, initial: np.ndarray, models: list[np.ndarray], delta: float,
                accountant: dict[str, Any], statistics: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The ``audit`` block of summary.json from the global model before round 1 and after each round; the raw
    statistics go into ``statistics`` when given (``audit_statistics.json``: recompute at another confidence)."""
    final = models[-1] - initial
    steps = [b - a for a, b in zip([initial, *models[:-1]], models)]
    ins_final, ins_iter = _statistics(seed, 0, canaries, final, steps)
    null_final, null_iter = _statistics(seed, canaries, NULL_DIRECTIONS, final, steps)
    block: dict[str, Any] = {
        "method": "one-shot empirical estimate (Andrew et al., ICLR 2024): cosines of canary directions with the "
                  "model's change, inserted vs never-inserted, fitted with Gaussians of one variance; ε at δ of "
                  "telling them apart, 95 % bootstrap interval",
        "canaries": canaries, "null_directions": NULL_DIRECTIONS, "delta": delta, "rounds": len(models),
        "adversary": "whoever sees the released models (final: the last one; all_iterates: every round's)",
        **accountant,
    }
    for name, ins, null in (("final_model", ins_final, null_final), ("all_iterates", ins_iter, null_iter)):
        if statistics is not None:
            statistics[f"{name}_inserted"], statistics[f"{name}_null"] = ins.tolist(), null.tolist()
        estimate = one_shot_estimate(ins, null, delta)
        block[name] = {**estimate.as_dict(), "mean_cosine_inserted": float(np.mean(ins)),
                       "mean_cosine_null": float(np.mean(null))}
    return block


class AuditRecorder:
    """A round recorder around ``inner`` (see the module docstring); ``strategy`` is read for its global model."""

    def __init__(self, inner: Any, strategy: Any, seed: int, canaries: int, num_clients: int) -> None:
        self.inner, self.strategy = inner, strategy
        self.seed, self.canaries, self.num_clients = int(seed), int(canaries), int(num_clients)
        self.initial = flatten(strategy.current_weights).astype(np.float64)
        self.models: list[np.ndarray] = []
        self.rounds: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:  # the writer's own attributes (run_dir, meta, …)
        return getattr(self.inner, name)

    def _n(self) -> int:
        return self.num_clients or int(getattr(self.strategy, "num_available", 0))

    def open(self) -> None:
        self.inner.open()

    def write_round(self, record: dict[str, Any]) -> None:
        n = self._n()
        for client in record.get("clients", []):
            cid = client.get("client_id")
            if isinstance(cid, int) and canary_index(cid, n, self.canaries) is not None:
                client["audit_canary"] = True
        self.models.append(flatten(self.strategy.current_weights).astype(np.float64))
        self.rounds.append(record)
        self.inner.write_round(record)

    def finish(self, amend: dict[str, Any] | None = None) -> None:
        block: dict[str, Any] = {"canaries": self.canaries, "error": "no round was recorded"}
        if self.models:
            metrics = self.rounds[-1].get("metrics", {})
            delta = float(metrics.get("delta") or 0.0) or 1e-5
            accountant = {"epsilon_accountant": _number(metrics.get("epsilon_vs_release", metrics.get("epsilon"))),
                          "epsilon_accountant_vs_server": _number(metrics.get("max_epsilon_vs_server",
                                                                              metrics.get("epsilon")))}
            statistics: dict[str, Any] = {"delta": delta}
            block = audit_block(self.seed, self.canaries, self.initial, self.models, delta, accountant, statistics)
            run_dir = getattr(self.inner, "run_dir", None)
            if run_dir is not None:
                write_json_atomic(Path(run_dir) / STATISTICS_FILE, statistics)
        self.inner.finish(amend={**(amend or {}), "audit": block})


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(float(value)) else None
