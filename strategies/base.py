"""Base Flower ``Strategy`` for DP-FL: sampling, update decoding/validation, weighted
aggregation of client *updates*, centralized + federated evaluation and the per-round ledger.

Protocol shared by every strategy of this library:

* the server sends the global model θ (``FitIns.parameters``) and a config dict that always
  carries ``server-round``; family strategies add their own keys (:meth:`fit_config`);
* a client returns its *update* Δ_i = θ_i − θ (or a family-specific encoding of it, decoded
  by :meth:`decode_update`) and flat scalar metrics including ``client_id`` and ``status``;
* the server validates each update (:meth:`validate_update`), computes aggregation weights
  (:meth:`aggregation_weights`), combines the updates (:meth:`aggregate_updates`) and steps
  θ ← θ + server_lr · aggregate. A rejected or refused update is recorded, never averaged.

Families override the hooks; the round record (``rounds.jsonl``) schema stays one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from strategies.aggregate import flatten, normalize_weights, unflatten, weighted_sum

# Per-client fields every round record carries (None when a strategy/client has no value).
CLIENT_FIELDS = (
    "client_id", "node_id", "num_examples", "batch_size", "noise_multiplier", "sample_rate", "steps",
    "epsilon_budget", "epsilon_spent", "delta", "reported_epsilon", "aggregation_weight",
    "uplink_bytes", "train_seconds", "status", "reason",
)
_METRIC_FIELDS = ("batch_size", "noise_multiplier", "sample_rate", "steps", "epsilon_budget", "epsilon_spent",
                  "delta", "reported_epsilon", "train_seconds")


class RoundRecorder(Protocol):
    """Where round records go (``fedapp.results.ResultsWriter`` implements it)."""

    def open(self) -> None: ...

    def write_round(self, record: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


class RejectedUpdate(Exception):
    """A client result that must not touch the global model; the message is the reason."""


@dataclass
class ClientUpdate:
    """One accepted client contribution of a round."""

    node_id: int
    client_id: int
    num_examples: int
    update: np.ndarray  # flat float64 vector, same length as the model
    metrics: dict[str, Scalar]
    uplink_bytes: int
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategyContext:
    """What the Flower app glue hands to a strategy factory."""

    initial_weights: list[np.ndarray]
    evaluate_fn: Callable[[list[np.ndarray]], tuple[float, dict[str, Scalar]]] | None = None
    recorder: RoundRecorder | None = None
    prevalidate: Callable[[int], None] | None = None  # called with the number of clients before round 1
    extras: dict[str, Any] = field(default_factory=dict)


def common_kwargs(cfg: Mapping[str, Any], ctx: StrategyContext) -> dict[str, Any]:
    """Constructor arguments of :class:`DPFLStrategy` taken from a run-config mapping."""
    return {
        "initial_weights": ctx.initial_weights,
        "num_rounds": int(cfg["num-server-rounds"]),
        "seed": int(cfg["seed"]),
        "clients_per_round": int(cfg["clients-per-round"]),
        "min_available_clients": int(cfg["min-available-clients"]),
        "fraction_evaluate": float(cfg["fraction-evaluate"]),
        "server_lr": float(cfg["server-lr"]),
        "evaluate_fn": ctx.evaluate_fn,
        "recorder": ctx.recorder,
        "prevalidate": ctx.prevalidate,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


class DPFLStrategy(Strategy):
    """Common server logic; subclasses override the hooks marked *hook*."""

    name = "base"
    #: threat model in one line (README/docs and ``config.json``)
    privacy = "no formal privacy"

    def __init__(self, *, initial_weights: Sequence[np.ndarray], num_rounds: int, seed: int = 0,
                 clients_per_round: int = 0, min_available_clients: int = 2, fraction_evaluate: float = 1.0,
                 server_lr: float = 1.0, evaluate_fn=None, recorder: RoundRecorder | None = None,
                 prevalidate: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.current_weights = [np.asarray(w, dtype=np.float32) for w in initial_weights]
        self.shapes = [tuple(w.shape) for w in self.current_weights]
        self.num_params = int(sum(w.size for w in self.current_weights))
        self.num_rounds = num_rounds
        self.seed = seed
        self.clients_per_round = clients_per_round
        self.min_available_clients = min_available_clients
        self.fraction_evaluate = fraction_evaluate
        self.server_lr = server_lr
        self.evaluate_fn = evaluate_fn
        self.recorder = recorder
        self.prevalidate = prevalidate
        self.num_available = 0
        self._pending: dict[str, Any] | None = None
        self._round_start = 0.0
        self._run_start = time.perf_counter()
        self._opened = False

    # ------------------------------------------------------------------ Flower API
    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.current_weights)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self._flush_pending()
        self.current_weights = [np.asarray(a, dtype=np.float32) for a in parameters_to_ndarrays(parameters)]
        client_manager.wait_for(self.min_available_clients)
        self.num_available = client_manager.num_available()
        if not self._opened:
            if self.num_available < 2:
                raise ValueError(f"a federation needs at least 2 clients, {self.num_available} connected")
            if self.prevalidate is not None:
                self.prevalidate(self.num_available)  # raises before any training / any file
            if self.recorder is not None:
                self.recorder.open()
            self._opened = True
        self._round_start = time.perf_counter()
        self._pending = {"round": server_round, "metrics": {}, "clients": []}
        clients = self.sample_clients(server_round, client_manager)
        config: dict[str, Scalar] = {"server-round": server_round}
        config.update(self.fit_config(server_round))
        return [(c, FitIns(parameters, dict(config))) for c in clients]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted: list[ClientUpdate] = []
        records: list[dict[str, Any]] = []
        for proxy, res in sorted(results, key=lambda pr: int(pr[1].metrics.get("client_id", -1))):
            metrics = dict(res.metrics)
            record = self._base_record(proxy, res, metrics)
            records.append(record)
            if record["status"] != "ok":
                continue
            try:
                update = self.decode_update(server_round, res, metrics)
                self.validate_update(update, metrics)
            except RejectedUpdate as exc:
                record["status"], record["reason"] = "rejected", str(exc)
                log(WARNING, "round %d: rejected update of client %s: %s", server_round, record["client_id"], exc)
                continue
            accepted.append(ClientUpdate(int(proxy.node_id), int(record["client_id"]), int(res.num_examples),
                                         update, metrics, int(record["uplink_bytes"]), record))
        for failure in failures:
            proxy = failure[0] if isinstance(failure, tuple) else None
            reason = repr(failure) if isinstance(failure, BaseException) else f"status {failure[1].status.code}"
            rec = {k: None for k in CLIENT_FIELDS}
            rec.update(node_id=int(proxy.node_id) if proxy is not None else None, status="failed", reason=reason)
            records.append(rec)

        round_metrics: dict[str, Any] = {
            "clients_ok": len(accepted),
            "clients_refused": sum(r["status"] == "refused" for r in records),
            "clients_rejected": sum(r["status"] == "rejected" for r in records),
            "clients_failed": sum(r["status"] == "failed" for r in records),
            "uplink_bytes": int(sum(r["uplink_bytes"] or 0 for r in records)),
        }
        if accepted:
            weights, round_extra = self.aggregation_weights(server_round, accepted)
            weights = normalize_weights(weights)
            aggregate = self.aggregate_updates(server_round, accepted, weights)
            if aggregate.shape != (self.num_params,) or not np.all(np.isfinite(aggregate)):
                raise RuntimeError(f"round {server_round}: aggregate is not a finite vector of {self.num_params}")
            for cu, w in zip(accepted, weights):
                cu.record["aggregation_weight"] = float(w)
            round_metrics["mean_update_norm"] = float(np.mean([np.linalg.norm(c.update) for c in accepted]))
            round_metrics.update(round_extra)
            new_flat = flatten(self.current_weights) + self.server_lr * aggregate
            self.current_weights = unflatten(new_flat, self.shapes)
            self.after_aggregate(server_round, accepted, weights)
        else:
            log(WARNING, "round %d: no acceptable client update; the global model is unchanged", server_round)
        if self._pending is not None:
            self._pending["clients"] = records
            self._pending["metrics"].update(round_metrics)
        return ndarrays_to_parameters(self.current_weights), {k: v for k, v in round_metrics.items()
                                                              if isinstance(v, (int, float, str, bool))}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        if self.evaluate_fn is None:
            return None
        loss, metrics = self.evaluate_fn(parameters_to_ndarrays(parameters))
        if server_round == 0:
            log(INFO, "initial model: loss=%.4f accuracy=%.4f", loss, metrics.get("accuracy", float("nan")))
            self.initial_metrics = {"loss": loss, **metrics}
        elif self._pending is not None:
            self._pending["metrics"].update({"loss": loss, **metrics})
        return loss, metrics

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        if self.fraction_evaluate <= 0:
            self._flush_pending()
            return []
        nodes = self._sorted_clients(client_manager)
        k = max(1, int(round(self.fraction_evaluate * len(nodes))))
        if k < len(nodes):
            rng = np.random.default_rng([self.seed, 302, server_round])
            nodes = [nodes[i] for i in sorted(rng.choice(len(nodes), size=k, replace=False))]
        config: dict[str, Scalar] = {"server-round": server_round}
        config.update(self.evaluate_config(server_round))
        return [(c, EvaluateIns(parameters, dict(config))) for c in nodes]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException]) -> tuple[float | None, dict[str, Scalar]]:
        accs = [float(r.metrics["accuracy"]) for _, r in results if "accuracy" in r.metrics]
        losses = [float(r.loss) for _, r in results]
        metrics: dict[str, Scalar] = {}
        if accs:
            metrics["client_accuracy"] = float(np.mean(accs))
            metrics["client_accuracy_std"] = float(np.std(accs))
        extra = self.evaluate_metrics(server_round, results)
        metrics.update(extra)
        if self._pending is not None:
            self._pending["metrics"].update(metrics)
        self._flush_pending()
        return (float(np.mean(losses)) if losses else None), metrics

    # ------------------------------------------------------------------ hooks
    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        """*hook*: extra keys sent to clients with the global model."""
        return {}

    def evaluate_config(self, server_round: int) -> dict[str, Scalar]:
        """*hook*: extra keys sent with federated evaluation."""
        return {}

    def decode_update(self, server_round: int, res: FitRes, metrics: Mapping[str, Scalar]) -> np.ndarray:
        """*hook*: the flat update vector of a client result. Default: dense arrays of the model's shapes."""
        arrays = parameters_to_ndarrays(res.parameters)
        if len(arrays) != len(self.shapes):
            raise RejectedUpdate(f"expected {len(self.shapes)} arrays, got {len(arrays)}")
        for i, (a, shape) in enumerate(zip(arrays, self.shapes)):
            if tuple(a.shape) != shape:
                raise RejectedUpdate(f"array {i} has shape {tuple(a.shape)}, expected {shape}")
            if a.dtype.kind != "f":
                raise RejectedUpdate(f"array {i} has dtype {a.dtype}, expected a float dtype")
        return flatten(arrays)

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        """*hook*: raise :class:`RejectedUpdate` for an update that must not be aggregated."""
        if update.shape != (self.num_params,):
            raise RejectedUpdate(f"update has {update.size} entries, the model has {self.num_params}")
        if not np.all(np.isfinite(update)):
            raise RejectedUpdate("update contains NaN or Inf")

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        """*hook*: raw weights (normalized by the caller) and extra round metrics. Default w_i ∝ N_i."""
        return np.asarray([max(u.num_examples, 0) for u in updates], dtype=np.float64), {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """*hook*: combine updates with normalized weights. Default Σ w_i Δ_i."""
        return weighted_sum([u.update for u in updates], weights)

    def after_aggregate(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> None:
        """*hook*: called after the global model moved (e.g. to update server state)."""

    def evaluate_metrics(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]]) -> dict[str, Scalar]:
        """*hook*: extra federated-evaluation metrics."""
        return {}

    def sample_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """*hook*: clients of this round; default all, or ``clients_per_round`` uniformly without replacement."""
        nodes = self._sorted_clients(client_manager)
        r = self.clients_per_round
        if 0 < r < len(nodes):
            rng = np.random.default_rng([self.seed, 301, server_round])
            nodes = [nodes[i] for i in sorted(rng.choice(len(nodes), size=r, replace=False))]
        return nodes

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _sorted_clients(client_manager: ClientManager) -> list[ClientProxy]:
        clients = client_manager.all()
        return [clients[k] for k in sorted(clients, key=str)]

    def _base_record(self, proxy: ClientProxy, res: FitRes, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        rec: dict[str, Any] = {k: None for k in CLIENT_FIELDS}
        rec["client_id"] = int(metrics["client_id"]) if "client_id" in metrics else None
        rec["node_id"] = int(proxy.node_id)
        rec["num_examples"] = int(res.num_examples)
        rec["uplink_bytes"] = int(sum(len(t) for t in res.parameters.tensors))
        for key in _METRIC_FIELDS:
            if key in metrics:
                rec[key] = _jsonable(metrics[key])
        status = metrics.get("status", "ok")
        rec["status"] = status if status in ("ok", "refused") else "rejected"
        rec["reason"] = str(metrics.get("reason", "")) or None
        if "client_id" not in metrics and rec["status"] == "ok":
            rec["status"], rec["reason"] = "rejected", "metrics lack 'client_id'"
        if status not in ("ok", "refused"):
            rec["reason"] = f"unknown status {status!r}"
        return rec

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending["wall_seconds"] = time.perf_counter() - self._round_start
        pending["elapsed_seconds"] = time.perf_counter() - self._run_start
        pending["metrics"] = {k: _jsonable(v) for k, v in pending["metrics"].items()}
        pending["clients"] = [{k: _jsonable(v) for k, v in c.items()} for c in pending["clients"]]
        eps = [c["epsilon_spent"] for c in pending["clients"] if c.get("epsilon_spent") is not None]
        m = pending["metrics"]
        log(INFO, "[round %d/%d] accuracy=%s loss=%s client_accuracy=%s max_epsilon=%s clients ok=%s (%.1fs)",
            pending["round"], self.num_rounds, _fmt(m.get("accuracy")), _fmt(m.get("loss")),
            _fmt(m.get("client_accuracy")), _fmt(max(eps) if eps else None), m.get("clients_ok"),
            pending["wall_seconds"])
        if self.recorder is not None:
            self.recorder.write_round(pending)
            if pending["round"] >= self.num_rounds:
                self.recorder.finish()


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
