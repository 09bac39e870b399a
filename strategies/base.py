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

import json
import re
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
_FLOAT_DTYPES = ("float32", "float64")  # accepted dtypes of dense update arrays
LEDGER_CONFIG_KEY = "dp-ledger"  # fit-config key: JSON {client_id: ε spent so far} from the server's ledger


def metric_problem(metrics: Mapping[str, Any]) -> str | None:
    """Why a client's metrics are malformed (``None`` when they are usable).

    Checks ``client_id`` (a non-negative integer), ``status`` (a string), the numeric privacy
    fields (finite numbers, ε and δ non-negative) and that ε spent does not exceed the budget.
    """
    if "client_id" not in metrics:
        return "metrics lack 'client_id'"
    cid = metrics["client_id"]
    if isinstance(cid, bool) or not isinstance(cid, (int, np.integer)) or int(cid) < 0:
        if not (isinstance(cid, float) and cid.is_integer() and cid >= 0):
            return f"malformed metric 'client_id' = {cid!r} (expected an integer >= 0)"
    if "status" in metrics and not isinstance(metrics["status"], str):
        return f"malformed metric 'status' = {metrics['status']!r} (expected a string)"
    for key in _METRIC_FIELDS:
        if key not in metrics:
            continue
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return f"malformed metric {key!r} = {_short(value)} (expected a number)"
        if not np.isfinite(float(value)):
            return f"malformed metric {key!r} = {value!r} (not finite)"
        if float(value) < 0:
            return f"malformed metric {key!r} = {value!r} (negative)"
    spent, budget = metrics.get("epsilon_spent"), metrics.get("epsilon_budget")
    if spent is not None and budget is not None and float(spent) > float(budget) * (1 + 1e-6):
        return f"epsilon_spent {float(spent):.6g} exceeds the client's epsilon_budget {float(budget):.6g}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _client_sort_key(pair: tuple[ClientProxy, FitRes]) -> tuple[int, str]:
    cid = pair[1].metrics.get("client_id", -1)
    try:
        return (int(cid), str(pair[0].node_id))
    except (TypeError, ValueError, OverflowError):
        return (-1, str(pair[0].node_id))


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
    #: declared ℓ2 bound of a legitimate update (client-level modes: clip C plus a noise allowance);
    #: ``None`` = no bound. An update above it is rejected by :meth:`validate_update`.
    max_update_norm: float | None = None
    #: fewest acceptable updates a round needs; fewer aborts the run with a clear message (0 = none)
    min_fit_clients: int = 0

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
        self.round_offset = 0  # rounds already done before this process (resume from a checkpoint)
        self.last_round = 0  # last round whose record was flushed
        self.ledger_epsilon: dict[int, float] = {}  # client_id -> largest ε a client reported spending
        self.node_clients: dict[int, int] = {}  # node_id -> client_id, learned from the clients' reports
        self.run_fit_config: dict[str, Scalar] = {}  # run-wide fit-config keys (e.g. run-lineage for resume)

    # ------------------------------------------------------------------ Flower API
    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.current_weights)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        server_round = self._actual_round(server_round)
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
        config.update(self.run_fit_config)
        config.update(self.fit_config(server_round))
        return [(c, FitIns(parameters, self._with_ledger(config, c))) for c in clients]

    def _with_ledger(self, config: Mapping[str, Scalar], proxy: ClientProxy) -> dict[str, Scalar]:
        """The fit config for one node, with the ε the server's ledger holds for it (``dp-ledger``).

        A node whose client the server already knows gets only its own entry, so the message does not
        grow with the federation; an unknown node (first contact, or a client restarted under a new
        node id) gets the whole ledger, so a client that lost its accountant is still caught.
        """
        out = {k: v for k, v in config.items() if k != LEDGER_CONFIG_KEY}
        if not self.ledger_epsilon:
            return out
        cid = self.node_clients.get(int(proxy.node_id))
        if cid is not None and cid in self.ledger_epsilon:
            entries = {cid: self.ledger_epsilon[cid]}
        elif cid is not None:
            return out
        else:
            entries = self.ledger_epsilon
        out[LEDGER_CONFIG_KEY] = json.dumps({str(k): v for k, v in sorted(entries.items())})
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> tuple[Parameters | None, dict[str, Scalar]]:
        server_round = self._actual_round(server_round)
        accepted: list[ClientUpdate] = []
        records: list[dict[str, Any]] = []
        seen: set[int] = set()
        for proxy, res in sorted(results, key=_client_sort_key):
            metrics = dict(res.metrics)
            record = self._base_record(proxy, res, metrics)
            records.append(record)
            if record["status"] in ("ok", "refused"):  # the client's own accountant, not a server estimate
                self._ledger_update({"client_id": record["client_id"], "node_id": record.get("node_id"),
                                    "epsilon_spent": metrics.get("epsilon_spent")})
            if record["status"] != "ok":
                continue
            try:
                if record["client_id"] in seen:
                    raise RejectedUpdate(f"duplicate client_id {record['client_id']} in round {server_round}")
                seen.add(record["client_id"])
                try:
                    update = self.decode_update(server_round, res, metrics)
                except RejectedUpdate:
                    raise
                except Exception as exc:  # undecodable bytes, bad encodings: the payload is hostile or broken
                    raise RejectedUpdate(f"undecodable payload: {type(exc).__name__}: {exc}") from None
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
            cid = _failed_client_id(reason)
            if cid is not None:
                rec["client_id"] = cid
            records.append(rec)

        round_metrics: dict[str, Any] = {
            "clients_ok": len(accepted),
            "clients_refused": sum(r["status"] == "refused" for r in records),
            "clients_rejected": sum(r["status"] == "rejected" for r in records),
            "clients_failed": sum(r["status"] == "failed" for r in records),
            "uplink_bytes": int(sum(r["uplink_bytes"] or 0 for r in records)),
        }
        if len(accepted) < self.min_fit_clients:
            if self._pending is not None:
                self._pending["clients"] = records
                self._pending["metrics"].update(round_metrics, aborted=True)
                self._flush_pending()
            raise RuntimeError(
                f"round {server_round}: only {len(accepted)} acceptable client update(s) "
                f"({round_metrics['clients_failed']} failed, {round_metrics['clients_rejected']} rejected, "
                f"{round_metrics['clients_refused']} refused) < min-fit-clients = {self.min_fit_clients}; "
                "aborting the run (the global model of the previous round is the last checkpoint)")
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
        server_round = self._actual_round(server_round)
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
        server_round = self._actual_round(server_round)
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
        server_round = self._actual_round(server_round)
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
            if a.dtype.name not in _FLOAT_DTYPES:
                raise RejectedUpdate(f"array {i} has dtype {a.dtype}, expected one of {list(_FLOAT_DTYPES)}")
        return flatten(arrays)

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        """*hook*: raise :class:`RejectedUpdate` for an update that must not be aggregated."""
        if update.shape != (self.num_params,):
            raise RejectedUpdate(f"update has {update.size} entries, the model has {self.num_params}")
        if not np.all(np.isfinite(update)):
            raise RejectedUpdate("update contains NaN or Inf")
        bound = self.max_update_norm
        if bound is not None:
            norm = float(np.linalg.norm(update))
            if norm > bound * (1 + 1e-6):
                raise RejectedUpdate(f"update norm {norm:.6g} exceeds the declared bound {bound:.6g}")

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
        problem = metric_problem(metrics)
        cid = metrics.get("client_id")
        try:
            rec["client_id"] = int(cid) if cid is not None and not isinstance(cid, (str, bytes)) else None
        except (TypeError, ValueError, OverflowError):
            rec["client_id"] = None
        rec["node_id"] = int(proxy.node_id)
        rec["num_examples"] = int(res.num_examples)
        rec["uplink_bytes"] = int(sum(len(t) for t in res.parameters.tensors))
        for key in _METRIC_FIELDS:
            if key in metrics and isinstance(metrics[key], (int, float, np.integer, np.floating)):
                rec[key] = _jsonable(metrics[key])
        status = metrics.get("status", "ok")
        rec["status"] = status if status in ("ok", "refused") else "rejected"
        rec["reason"] = str(metrics.get("reason", "")) or None
        if status not in ("ok", "refused"):
            rec["reason"] = f"unknown status {_short(status)}"
        elif problem is not None and status == "ok":
            rec["status"], rec["reason"] = "rejected", problem
        elif status == "ok" and int(res.num_examples) <= 0:
            rec["status"], rec["reason"] = "rejected", f"num_examples = {int(res.num_examples)} (expected > 0)"
        return rec

    # ------------------------------------------------------------------ checkpoint / resume
    def checkpoint_state(self) -> dict[str, Any]:
        """*hook*: family server state to checkpoint (numpy arrays and JSON values, nested freely),
        e.g. SoteriaFL's shift s or Robust-HDP's frozen weights. Default: nothing."""
        return {}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """*hook*: restore what :meth:`checkpoint_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after :attr:`last_round`: global weights, ledger of ε per
        client, every ``numpy.random.Generator`` attribute's state, and the family's state."""
        rngs = {name: value.bit_generator.state for name, value in vars(self).items()
                if isinstance(value, np.random.Generator)}
        return {"round": int(self.last_round), "weights": [w.copy() for w in self.current_weights],
                "ledger_epsilon": {str(k): v for k, v in self.ledger_epsilon.items()},
                "node_clients": {str(k): v for k, v in self.node_clients.items()},
                "initial_metrics": dict(getattr(self, "initial_metrics", {}) or {}),
                "num_available": int(self.num_available), "rngs": rngs, "family": self.checkpoint_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; Flower's rounds 1, 2, … then continue at ``state['round'] + 1``."""
        weights = [np.asarray(w, dtype=np.float32) for w in state["weights"]]
        shapes = [tuple(w.shape) for w in weights]
        if shapes != self.shapes:
            raise ValueError(f"checkpoint weights have shapes {shapes}, the model has {self.shapes}")
        self.current_weights = weights
        self.round_offset = self.last_round = int(state["round"])
        self.ledger_epsilon = {int(k): float(v) for k, v in dict(state.get("ledger_epsilon", {})).items()}
        self.node_clients = {int(k): int(v) for k, v in dict(state.get("node_clients", {})).items()}
        if state.get("initial_metrics"):
            self.initial_metrics = dict(state["initial_metrics"])
        for name, rng_state in dict(state.get("rngs", {})).items():
            gen = getattr(self, name, None)
            if isinstance(gen, np.random.Generator):
                gen.bit_generator.state = rng_state
        family = state.get("family") or {}
        if family:
            self.load_checkpoint_state(family)

    def _actual_round(self, flower_round: int) -> int:
        """Flower counts rounds from 1 in every process; a resumed run continues after ``round_offset``."""
        return flower_round + self.round_offset if flower_round > 0 else flower_round

    def _ledger_update(self, rec: Mapping[str, Any]) -> None:
        cid, eps = rec.get("client_id"), rec.get("epsilon_spent")
        if cid is None or eps is None or isinstance(eps, (str, bytes, bool)):
            return
        if rec.get("node_id") is not None:
            self.node_clients[int(rec["node_id"])] = int(cid)
        try:
            value = float(eps)
        except (TypeError, ValueError):
            return
        if np.isfinite(value):
            self.ledger_epsilon[int(cid)] = max(value, self.ledger_epsilon.get(int(cid), 0.0))

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
        self.last_round = max(self.last_round, int(pending["round"]))
        if self.recorder is not None:
            self.recorder.write_round(pending)
            if pending["round"] >= self.num_rounds:
                self.recorder.finish()


def _failed_client_id(reason: str) -> int | None:
    """Client id named in a failure message (``client_id=<n>``, as :mod:`fedapp.faults` raises)."""
    match = re.search(r"client_id=(\d+)", reason)
    return int(match.group(1)) if match else None


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
