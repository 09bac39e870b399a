"""Base Flower ``Strategy`` for DP-FL, composed of small collaborators.

Protocol shared by every strategy of this library:

* the server sends the global model θ (``FitIns.parameters``) and a config dict that always
  carries ``server-round``; family strategies add their own keys (:meth:`DPFLStrategy.fit_config`);
* a client returns its *update* Δ_i = θ_i − θ (or a family-specific encoding of it, decoded by
  :meth:`DPFLStrategy.decode_update`) and flat scalar metrics including ``client_id`` and ``status``;
* the server validates each update, computes aggregation weights, combines the updates and steps
  θ ← θ + server_lr · aggregate. A rejected or refused update is recorded, never averaged.

Collaborators (each in its own module, each usable alone):

* :class:`~strategies.server.sampling.ClientSampler` — who trains this round (secret randomness);
* :class:`~strategies.server.identity.IdentityBinding` — a client id belongs to one authenticated node;
* :class:`~strategies.server.validation.UpdateValidator` + :class:`~strategies.server.validation.StrikeRecord`
  — one validator for every family, strikes across rounds;
* :class:`~strategies.privacy.ledger.PrivacyLedger` — the server's own ε per client;
* :class:`~strategies.server.records.RoundLog` — the round record (``rounds.jsonl``).

Families override the hooks marked *hook*; the round record schema stays one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any, TypeGuard

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
from strategies.privacy import threat_models
from strategies.privacy.accountants import History
from strategies.privacy.ledger import PrivacyLedger
from strategies.server.identity import IdentityBinding
from strategies.server.records import CLIENT_FIELDS, RoundLog, RoundRecorder, empty_client_record, jsonable
from strategies.server.sampling import ClientSampler
from strategies.server.validation import (
    NUMERIC_METRICS,
    RejectedUpdate,
    StrikeRecord,
    UpdateValidator,
    metric_problem,
    number_metrics,
    parse_client_id,
    short_repr,
)

__all__ = ["CLIENT_FIELDS", "LEDGER_CONFIG_KEY", "ClientUpdate", "DPFLStrategy", "RejectedUpdate", "RoundRecorder",
           "StrategyContext"]

LEDGER_CONFIG_KEY = "dp-ledger"  # fit-config key: JSON {client_id: ε spent so far} from the server's ledger
#: statuses a client may report: trained (``ok``), would not train (``refused``: budget, data), or trained and
#: failed on its own (``failed``: e.g. DP-SGD diverged) — a failure, never a strike
CLIENT_STATUSES = ("ok", "refused", "failed")
#: how long configure_fit waits for ``min_available_clients`` (seconds): Flower's SimpleClientManager default
WAIT_FOR_CLIENTS_S = 86400
#: server-side evaluation: the global model's arrays -> (loss, metrics)
EvaluateFn = Callable[[list[np.ndarray]], tuple[float, dict[str, Scalar]]]


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
    """What the Flower glue hands to a strategy factory."""

    initial_weights: list[np.ndarray]
    evaluate_fn: EvaluateFn | None = None
    recorder: RoundRecorder | None = None
    prevalidate: Callable[[int], None] | None = None  # called with the number of clients before round 1
    extras: dict[str, Any] = field(default_factory=dict)


class DPFLStrategy(Strategy):
    """Common server logic; subclasses override the hooks marked *hook*."""

    name = "base"
    #: threat model in one line (README/docs and ``config.json``)
    privacy = threat_models.NONE
    #: declared ℓ2 bound of a legitimate update (None = none; see :meth:`declared_norm_bound`)
    max_update_norm: float | None = None
    #: fewest acceptable updates a round needs; fewer aborts the run with a clear message (0 = none)
    min_fit_clients: int = 0
    #: send each node the ledger's ε for it (``dp-ledger``) so a client that lost its accountant is caught
    send_ledger: bool = True

    def __init__(self, *, initial_weights: Sequence[np.ndarray], num_rounds: int, seed: int = 0,
                 clients_per_round: int = 0, min_available_clients: int = 2, fraction_evaluate: float = 1.0,
                 server_lr: float = 1.0, evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None,
                 prevalidate: Callable[[int], None] | None = None, sampling: str = "fixed",
                 secret_sampling: bool = True, accountant: str = "rdp", strike_limit: int = 3,
                 robust_norm_factor: float = 10.0, max_examples: Mapping[int, int] | None = None) -> None:
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
        self.prevalidate = prevalidate
        self.num_available = 0
        self.round_offset = 0  # rounds already done before this process (resume from a checkpoint)
        self.run_fit_config: dict[str, Scalar] = {}  # run-wide fit-config keys (e.g. run-lineage for resume)
        self.initial_metrics: dict[str, Any] = {}
        self.sampler = ClientSampler(clients_per_round, sampling, None if secret_sampling else seed)
        self.identity = IdentityBinding()
        self.validator = UpdateValidator(self.shapes, self.declared_norm_bound, robust_norm_factor,
                                         dict(max_examples or {}))
        self.strikes = StrikeRecord(strike_limit)  # per client id: its own replies were rejected
        self.node_strikes = StrikeRecord(strike_limit)  # per node: it claimed an id bound to another node
        self.ledger = PrivacyLedger(accountant)
        self.round_log = RoundLog(recorder)
        self.declared: dict[int, tuple[float, float]] = {}  # client_id -> declared (z, q) of its DP-SGD
        self.connected_nodes: set[int] = set()  # node ids connected when the round was configured

    # ------------------------------------------------------------------ collaborators as attributes
    @property
    def recorder(self) -> RoundRecorder | None:
        return self.round_log.recorder

    @recorder.setter
    def recorder(self, value: RoundRecorder | None) -> None:
        self.round_log.recorder = value

    @property
    def last_round(self) -> int:
        return self.round_log.last_round

    def declared_norm_bound(self, dim: int) -> float | None:
        """*hook*: the ℓ2 bound a legitimate update of ``dim`` coordinates stays below (None = none)."""
        return self.max_update_norm

    # ------------------------------------------------------------------ Flower API
    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.current_weights)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        server_round = self.actual_round(server_round)
        self.flush_round()
        self.current_weights = [np.asarray(a, dtype=np.float32) for a in parameters_to_ndarrays(parameters)]
        client_manager.wait_for(self.min_available_clients, timeout=WAIT_FOR_CLIENTS_S)
        self.num_available = client_manager.num_available()
        self.connected_nodes = {int(c.node_id) for c in client_manager.all().values()}
        if not self.round_log.opened:
            if self.num_available < 2:
                raise ValueError(f"a federation needs at least 2 clients, {self.num_available} connected")
            if self.prevalidate is not None:
                self.prevalidate(self.num_available)  # raises before any training / any file
            self.round_log.open()
        self.round_log.start(server_round)
        clients = self.sample_clients(server_round, client_manager)
        config: dict[str, Scalar] = {"server-round": server_round}
        config.update(self.run_fit_config)
        config.update(self.fit_config(server_round))
        ledger = self.ledger_snapshot()  # once per round, not once per sampled node
        return [(c, FitIns(parameters, self.node_fit_config(config, c, ledger))) for c in clients]

    def ledger_snapshot(self) -> dict[int, float]:
        """ε the server's ledger holds for every client that has spent some (what ``dp-ledger`` carries)."""
        return {cid: eps for cid, eps in self.ledger.epsilons().items() if eps > 0} if self.send_ledger else {}

    def node_fit_config(self, config: Mapping[str, Scalar], proxy: ClientProxy,
                        ledger: Mapping[int, float] | None = None) -> dict[str, Scalar]:
        """The fit config for one node, with the ε the server's ledger holds for it (``dp-ledger``).

        A node whose client the server already knows gets only its own entry, so the message does not
        grow with the federation; an unknown node (first contact, or a client restarted under a new
        node id) gets the whole ledger, so a client that lost its accountant is still caught.
        """
        out = {k: v for k, v in config.items() if k != LEDGER_CONFIG_KEY}
        ledger = self.ledger_snapshot() if ledger is None else ledger
        if not ledger:
            return out
        cid = self.identity.client_of.get(int(proxy.node_id))
        if cid is not None and cid in ledger:
            entries: Mapping[int, float] = {cid: ledger[cid]}
        elif cid is not None:
            return out
        else:
            entries = ledger
        out[LEDGER_CONFIG_KEY] = json.dumps({str(k): v for k, v in sorted(entries.items())})
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> tuple[Parameters | None, dict[str, Scalar]]:
        server_round = self.actual_round(server_round)
        connected = self.connected_nodes | {int(p.node_id) for p, _ in results}
        claims: dict[int, int] = {}
        for _, res in results:
            cid = parse_client_id(res.metrics.get("client_id"))
            if cid is not None:
                claims[cid] = claims.get(cid, 0) + 1
        contested = {cid for cid, n in claims.items() if n > 1}
        accepted: list[ClientUpdate] = []
        records: list[dict[str, Any]] = []
        for proxy, res in sorted(results, key=_reply_order):  # a fixed order: sums are reproducible
            update = self._admit(server_round, proxy, res, connected, contested, records)
            if update is not None:
                accepted.append(update)
        self._screen_outliers(server_round, accepted)
        accepted = [u for u in accepted if u.record["status"] == "ok"]
        for u, reason in self.screen(server_round, accepted):
            u.record["status"], u.record["reason"] = "rejected", reason
            self._strike(server_round, u.record)
        accepted = [u for u in accepted if u.record["status"] == "ok"]
        for failure in failures:
            records.append(self._failure_record(failure))

        round_metrics: dict[str, Any] = {
            "clients_ok": len(accepted),
            "clients_refused": sum(r["status"] == "refused" for r in records),
            "clients_rejected": sum(r["status"] == "rejected" for r in records),
            "clients_failed": sum(r["status"] == "failed" for r in records),
            "uplink_bytes": int(sum(r["uplink_bytes"] or 0 for r in records)),
        }
        round_metrics.update(self.population_charge(server_round, accepted, records))
        if round_metrics.get("round_withheld"):
            accepted = []  # the mechanism cannot pay for this round: nothing of it is released
            round_metrics["clients_ok"] = 0
        self._fill_ledger_fields(records)
        if len(accepted) < self.min_fit_clients:
            self.round_log.set_clients(records)
            self.round_log.add_metrics({**round_metrics, "aborted": True})
            self.flush_round()
            raise RuntimeError(
                f"round {server_round}: only {len(accepted)} acceptable client update(s) "
                f"({round_metrics['clients_failed']} failed, {round_metrics['clients_rejected']} rejected, "
                f"{round_metrics['clients_refused']} refused) < min-fit-clients = {self.min_fit_clients}; "
                "aborting the run (the global model of the previous round is the last checkpoint)")
        if accepted:
            try:
                round_metrics.update(self._step(server_round, accepted))
            except Exception as exc:  # noqa: BLE001 — an aggregation failure must not end the run
                log(ERROR, "round %d: aggregation failed (%s: %s); the global model is unchanged", server_round,
                    type(exc).__name__, exc, exc_info=True)
                round_metrics["aggregation_error"] = f"{type(exc).__name__}: {exc}"
        else:
            log(WARNING, "round %d: no acceptable client update; the global model is unchanged", server_round)
        self.round_log.set_clients(records)
        self.round_log.add_metrics(round_metrics)
        return ndarrays_to_parameters(self.current_weights), {k: v for k, v in round_metrics.items()
                                                              if isinstance(v, (int, float, str, bool))}

    def _step(self, server_round: int, accepted: list[ClientUpdate]) -> dict[str, Any]:
        """Weights, aggregate and the server step θ ← θ + server_lr · aggregate; returns round metrics."""
        weights, extra = self.aggregation_weights(server_round, accepted)
        weights = normalize_weights(weights)
        aggregate = self.aggregate_updates(server_round, accepted, weights)
        new_flat = flatten(self.current_weights) + self.server_lr * aggregate
        if aggregate.shape != (self.num_params,) or not np.all(np.isfinite(new_flat.astype(np.float32))):
            # cannot happen with validated updates; refuse to corrupt the model if it does
            log(WARNING, "round %d: the aggregate is not a finite vector of %d; the model is unchanged",
                server_round, self.num_params)
            return {"aggregate_rejected": True}
        for cu, w in zip(accepted, weights):
            cu.record["aggregation_weight"] = float(w)
        self.current_weights = unflatten(new_flat, self.shapes)
        self.after_aggregate(server_round, accepted, weights)
        return {"mean_update_norm": float(np.mean([np.linalg.norm(c.update) for c in accepted])), **extra}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        server_round = self.actual_round(server_round)
        if self.evaluate_fn is None:
            return None
        loss, metrics = self.evaluate_fn(parameters_to_ndarrays(parameters))
        if server_round == 0:
            log(INFO, "initial model: loss=%.4f accuracy=%.4f", loss, metrics.get("accuracy", float("nan")))
            self.initial_metrics.update({"loss": loss, **metrics})
        else:
            self.round_log.add_metrics({"loss": loss, **metrics})
        return loss, metrics

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        server_round = self.actual_round(server_round)
        if self.fraction_evaluate <= 0:
            self.flush_round()
            return []
        nodes = self.sorted_clients(client_manager)
        k = max(1, int(round(self.fraction_evaluate * len(nodes))))
        if k < len(nodes):
            rng = np.random.default_rng([self.seed, 302, server_round])
            nodes = [nodes[i] for i in sorted(rng.choice(len(nodes), size=k, replace=False))]
        config: dict[str, Scalar] = {"server-round": server_round}
        config.update(self.evaluate_config(server_round))
        return [(c, EvaluateIns(parameters, dict(config))) for c in nodes]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException]) -> tuple[float | None, dict[str, Scalar]]:
        server_round = self.actual_round(server_round)
        accs, losses, val_accs, val_losses = [], [], [], []
        for _, r in results:
            if _is_fraction(acc := r.metrics.get("accuracy")):
                accs.append(float(acc))
            if r.num_examples > 0 and _is_finite(r.loss):  # a client without a local test split has no loss
                losses.append(float(r.loss))
            if _is_fraction(val_acc := r.metrics.get("val_accuracy")):  # the local validation split (tuning)
                val_accs.append(float(val_acc))
            if _is_finite(val_loss := r.metrics.get("val_loss")):
                val_losses.append(float(val_loss))
        metrics: dict[str, Scalar] = {}
        if accs:
            metrics["client_accuracy"] = float(np.mean(accs))
            metrics["client_accuracy_std"] = float(np.std(accs))
        if val_accs:
            metrics["client_val_accuracy"] = float(np.mean(val_accs))
        if val_losses:
            metrics["client_val_loss"] = float(np.mean(val_losses))
        metrics.update(self.evaluate_metrics(server_round, results))
        self.round_log.add_metrics(metrics)
        self.flush_round()
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
        return self.validator.decode_dense(parameters_to_ndarrays(res.parameters))

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        """*hook*: raise :class:`RejectedUpdate` for an update that must not be aggregated (extra family checks)."""

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        """*hook*: raw weights (normalized by the caller) and extra round metrics. Default w_i ∝ N_i."""
        return np.asarray([max(u.num_examples, 0) for u in updates], dtype=np.float64), {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """*hook*: combine updates with normalized weights. Default Σ w_i Δ_i."""
        return weighted_sum([u.update for u in updates], weights)

    def screen(self, server_round: int, updates: list[ClientUpdate]) -> list[tuple[ClientUpdate, str]]:
        """*hook*: (update, reason) pairs to reject after every update was validated on its own (checks that
        need the whole round, e.g. Robust-HDP's noise estimates); the rejected are struck."""
        return []

    def after_aggregate(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> None:
        """*hook*: called after the global model moved (e.g. to update server state)."""

    def evaluate_metrics(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]]) -> dict[str, Scalar]:
        """*hook*: extra federated-evaluation metrics."""
        return {}

    def sample_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """*hook*: clients of this round (the :class:`ClientSampler`'s choice), minus excluded clients."""
        nodes = [c for c in self.sorted_clients(client_manager)
                 if not self.strikes.excluded(self.identity.client_of.get(int(c.node_id)))
                 and not self.node_strikes.excluded(int(c.node_id))]
        return self.sampler.sample(server_round, nodes)

    def client_record(self, proxy: ClientProxy, res: FitRes, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        """*hook*: the round record of one reply (families add fields)."""
        rec = empty_client_record()
        rec["client_id"] = parse_client_id(metrics.get("client_id"))
        rec["node_id"] = int(proxy.node_id)
        rec["num_examples"] = int(res.num_examples)
        rec["uplink_bytes"] = int(sum(len(t) for t in res.parameters.tensors))
        for key in NUMERIC_METRICS:
            if key in metrics and isinstance(metrics[key], (int, float, np.integer, np.floating)):
                rec[key] = jsonable(metrics[key])
        rec["client_epsilon_spent"] = rec.pop("epsilon_spent")  # the client's word; the ledger's value replaces it
        rec["epsilon_spent"] = None
        status = metrics.get("status", "ok")
        rec["status"] = status if status in CLIENT_STATUSES else "rejected"
        rec["reason"] = str(metrics.get("reason", "")) or None
        if status not in CLIENT_STATUSES:
            rec["reason"] = f"unknown status {short_repr(status)}"
        return rec

    def privacy_charge(self, server_round: int, record: Mapping[str, Any],
                       metrics: Mapping[str, Scalar]) -> tuple[History, float] | tuple[History, float, str] | None:
        """*hook*: (history, δ) or (history, δ, relation) the server charges to the client of an ``ok`` reply
        (None = nothing); ``relation`` is the record-level neighbouring relation the ledger composes it under
        (absent: add/remove).

        Default, record-level DP-SGD: the declared (z, q) and the round's steps, with z and q fixed
        for the run at first contact (a client cannot lower its noise later), under the relation the reply
        declares (``record_neighbours``, the client's run-config ``record-neighbours``) — replace-one when it
        declares none, the relation that fits a reply carrying N_i — fixed at first contact too.
        """
        values = number_metrics(metrics, "noise_multiplier", "sample_rate", "steps_round", "delta")
        if values is None:
            return None
        z, q, steps, delta = float(values[0]), float(values[1]), int(values[2]), float(values[3])
        if not (z > 0 and 0 < q <= 1 and steps > 0 and 0 < delta < 1):
            raise RejectedUpdate(f"declared mechanism (noise_multiplier={z}, sample_rate={q}, steps_round={steps}, "
                                 f"delta={delta}) is not a valid subsampled Gaussian")
        cid = int(record["client_id"])
        try:
            relation = self.ledger.declared_relation(cid, metrics.get("record_neighbours"))
        except ValueError as exc:
            raise RejectedUpdate(str(exc)) from None
        self.fix_declared(cid, (z, q), "(noise_multiplier, sample_rate)")
        return [(z, q, steps)], delta, str(relation)

    def fix_declared(self, client_id: int, mechanism: tuple[float, float], what: str) -> None:
        """Fix a client's declared mechanism at first contact; a later, different declaration is rejected
        (a client cannot declare less noise once the server has started charging it)."""
        first = self.declared.setdefault(client_id, mechanism)
        if first != mechanism:
            raise RejectedUpdate(f"declared {what} = {mechanism} differs from the {first} client {client_id} "
                                 "declared first")

    def population_charge(self, server_round: int, accepted: list[ClientUpdate],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        """*hook*: charge a round-wide mechanism to the whole population (client-level DP); returns round metrics.
        Returning ``round_withheld: True`` releases nothing of the round."""
        return {}

    # ------------------------------------------------------------------ internals
    def _admit(self, server_round: int, proxy: ClientProxy, res: FitRes, connected: set[int], contested: set[int],
               records: list[dict[str, Any]]) -> ClientUpdate | None:
        """Record one reply; decode, validate and charge it; the accepted update or None. Never raises.

        Who is struck: a node that claims a client id bound to another node (the newcomer, never the owner);
        a client whose own reply is malformed or out of bounds. Nobody is struck for a client id that several
        unbound nodes claim in one round (the server cannot tell which is honest: every claim is rejected and
        charged), for a failure the client reports itself, or for a payload that is a secure sum
        (:attr:`payload_is_shared`: it cannot be attributed to one client).
        """
        metrics = dict(res.metrics)
        node = int(proxy.node_id)
        try:
            record = self.client_record(proxy, res, metrics)
        except Exception as exc:  # a family hook choking on hostile metrics must not end the run
            record = {**empty_client_record(), "node_id": node, "status": "rejected",
                      "reason": f"unreadable reply: {type(exc).__name__}: {exc}"}
        records.append(record)
        if record["status"] == "rejected":
            self._strike(server_round, record)
            return None
        problem = metric_problem(metrics)
        cid = record["client_id"]
        if problem is None:
            reason = self.identity.check(node, cid, connected)
            if reason is not None:  # a newcomer claiming a bound id: the node is struck, the owner keeps its id
                record.update(status="rejected", reason=reason, identity_violation=True)
                self._strike_node(server_round, record)
                return None
            if cid in contested and self.identity.node_of.get(cid) != node:
                released = record["status"] in ("ok", "failed")  # the claim says it trained
                record.update(status="rejected", contested=True,
                              reason=f"client_id {cid} is claimed by several unbound nodes this round: every claim is "
                                     "rejected and charged, none is struck")
                log(WARNING, "round %d: node %d: %s", server_round, node, record["reason"])
                if released:
                    self._charge_contested(server_round, record, metrics)
                return None
        stage = "metrics"
        try:
            if problem is not None:
                raise RejectedUpdate(problem)
            if self.strikes.excluded(cid):
                raise RejectedUpdate(f"client {cid} is excluded after {self.strikes.limit} rejected updates")
            self.identity.bind(node, cid)
            self.ledger.register(cid)
            if record["status"] not in ("ok", "failed"):
                return None
            charge = self.privacy_charge(server_round, record, metrics)
            if charge is not None:  # the client trained (and released its update): charge before validating it
                self.ledger.charge(cid, *charge)
            if record["status"] == "failed":  # trained and failed on its own: charged, not struck
                return None
            self.validator.check_examples(cid, int(res.num_examples))
            stage = "payload"
            try:
                update = self.decode_update(server_round, res, metrics)
            except RejectedUpdate:
                raise
            except Exception as exc:  # undecodable bytes, bad encodings: the payload is hostile or broken
                raise RejectedUpdate(f"undecodable payload: {type(exc).__name__}: {exc}") from None
            update = np.asarray(update, dtype=np.float64)
            self.validator.check_values(update)
            self.validate_update(update, metrics)
        except Exception as exc:  # noqa: BLE001 — one client's payload never ends the run
            reason = str(exc) if isinstance(exc, RejectedUpdate) else \
                f"server error on this payload: {type(exc).__name__}: {exc}"
            record["status"], record["reason"] = "rejected", reason
            if stage == "payload" and self.payload_is_shared:
                record["attributable"] = False  # a secure sum: no single client can be blamed for it
                log(WARNING, "round %d: the secure sum failed validation (%s); nobody is struck", server_round, reason)
            else:
                self._strike(server_round, record)
            return None
        return ClientUpdate(node, cid, int(res.num_examples), update, metrics, int(record["uplink_bytes"]), record)

    @property
    def payload_is_shared(self) -> bool:
        """True when every reply carries the same secure sum instead of the client's own update."""
        return False

    def _charge_contested(self, server_round: int, record: dict[str, Any], metrics: Mapping[str, Scalar]) -> None:
        """Charge a contested claim's declared mechanism to the claimed id (one of the claims is the honest
        client's release, and the server cannot tell which), without fixing anyone's declaration."""
        cid = int(record["client_id"])
        known = cid in self.declared
        try:
            charge = self.privacy_charge(server_round, record, metrics)
        except RejectedUpdate:
            return  # differs from the declaration fixed earlier: the honest claim is the one that matches it
        finally:
            if not known:
                self.declared.pop(cid, None)
        if charge is not None:
            self.ledger.register(cid)
            if len(charge) == 3:  # (history, delta, relation)
                self.ledger.charge(cid, charge[0], charge[1], charge[2], provisional=True)
            else:  # (history, delta): the ledger's default relation
                self.ledger.charge(cid, charge[0], charge[1], provisional=True)

    def _screen_outliers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Reject updates far above the round's median norm (mechanisms without a declared bound)."""
        reasons = self.validator.robust_outliers([float(np.linalg.norm(u.update)) for u in updates])
        for u, reason in zip(updates, reasons):
            if reason is not None:
                u.record["status"], u.record["reason"] = "rejected", reason
                self._strike(server_round, u.record)

    def _strike(self, server_round: int, record: dict[str, Any]) -> None:
        log(WARNING, "round %d: rejected reply of node %s (client %s): %s", server_round, record.get("node_id"),
            record.get("client_id"), record.get("reason"))
        cid = record.get("client_id")
        owner = self.identity.node_of.get(cid) if cid is not None else None
        if owner is not None and owner != record.get("node_id"):
            self._strike_node(server_round, record)  # a spoofer's strike counts against its node, not the id
            return
        if self.strikes.add(cid, str(record.get("reason"))):
            log(WARNING, "client %s is excluded from later rounds after %d rejected updates", cid, self.strikes.limit)
            record["excluded"] = True

    def _strike_node(self, server_round: int, record: dict[str, Any]) -> None:
        node = record.get("node_id")
        log(WARNING, "round %d: node %s is struck: %s", server_round, node, record.get("reason"))
        if node is not None and self.node_strikes.add(int(node), str(record.get("reason"))):
            log(WARNING, "node %s is excluded from later rounds after %d identity violations", node,
                self.node_strikes.limit)
            record["excluded"] = True

    def _failure_record(self, failure: tuple[ClientProxy, FitRes] | BaseException) -> dict[str, Any]:
        proxy = failure[0] if isinstance(failure, tuple) else None
        reason = repr(failure) if isinstance(failure, BaseException) else f"status {failure[1].status.code}"
        rec = empty_client_record()
        rec.update(node_id=int(proxy.node_id) if proxy is not None else None, status="failed", reason=reason)
        node_cid = self.identity.client_of.get(int(proxy.node_id)) if proxy is not None else None
        rec["client_id"] = node_cid if node_cid is not None else _failed_client_id(reason)
        return rec

    def _fill_ledger_fields(self, records: list[dict[str, Any]]) -> None:
        """The server's ε into every record; a disagreeing client report is flagged."""
        for rec in records:
            cid = rec.get("client_id")
            if cid is None or not self.ledger.charged(cid):  # non-private: no ε at all, which is not ε = 0
                continue
            rec["epsilon_spent"] = self.ledger.epsilon(cid)
            note = self.ledger.mismatch(cid, rec.get("client_epsilon_spent")) if rec.get("status") == "ok" else None
            if note is not None:
                rec["epsilon_mismatch"] = note
                log(WARNING, "client %s: %s", cid, note)

    # ------------------------------------------------------------------ helpers for families
    @staticmethod
    def sorted_clients(client_manager: ClientManager) -> list[ClientProxy]:
        clients = client_manager.all()
        return [clients[k] for k in sorted(clients, key=str)]

    def actual_round(self, flower_round: int) -> int:
        """Flower counts rounds from 1 in every process; a resumed run continues after ``round_offset``."""
        return flower_round + self.round_offset if flower_round > 0 else flower_round

    def flush_round(self) -> None:
        """Write the record of the round in progress (once) and log its headline."""
        record = self.round_log.flush(self.num_rounds)
        if record is None:
            return
        eps = [c["epsilon_spent"] for c in record["clients"] if c.get("epsilon_spent") is not None]
        m = record["metrics"]
        log(INFO, "[round %d/%d] accuracy=%s loss=%s client_accuracy=%s max_epsilon=%s clients ok=%s (%.1fs)",
            record["round"], self.num_rounds, _fmt(m.get("accuracy")), _fmt(m.get("loss")),
            _fmt(m.get("client_accuracy")), _fmt(max(eps) if eps else None), m.get("clients_ok"),
            record["wall_seconds"])

    # ------------------------------------------------------------------ checkpoint / resume
    def checkpoint_state(self) -> dict[str, Any]:
        """*hook*: family server state to checkpoint (numpy arrays and JSON values, nested freely)."""
        return {}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """*hook*: restore what :meth:`checkpoint_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after :attr:`last_round`: weights, ledger, identities, strikes,
        the sampler's generator, every ``numpy.random.Generator`` attribute and the family's state."""
        rngs = {name: value.bit_generator.state for name, value in vars(self).items()
                if isinstance(value, np.random.Generator)}
        return {"round": int(self.last_round), "weights": [w.copy() for w in self.current_weights],
                "ledger": self.ledger.state(), "node_clients": self.identity.state(), "strikes": self.strikes.state(),
                "node_strikes": self.node_strikes.state(),
                "declared": {str(k): list(v) for k, v in self.declared.items()}, "sampler": self.sampler.state(),
                "initial_metrics": dict(self.initial_metrics), "num_available": int(self.num_available),
                "rngs": rngs, "family": self.checkpoint_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; Flower's rounds 1, 2, … then continue at ``state['round'] + 1``."""
        weights = [np.asarray(w, dtype=np.float32) for w in state["weights"]]
        shapes = [tuple(w.shape) for w in weights]
        if shapes != self.shapes:
            raise ValueError(f"checkpoint weights have shapes {shapes}, the model has {self.shapes}")
        self.current_weights = weights
        self.round_offset = self.round_log.last_round = int(state["round"])
        self.ledger.load(dict(state.get("ledger", {})))
        self.identity.load(dict(state.get("node_clients", {})))
        self.strikes.load(dict(state.get("strikes", {})))
        self.node_strikes.load(dict(state.get("node_strikes", {})))
        self.declared = {int(k): (float(v[0]), float(v[1])) for k, v in dict(state.get("declared", {})).items()}
        self.sampler.load(dict(state.get("sampler", {})))
        self.initial_metrics = dict(state.get("initial_metrics") or {})
        for name, rng_state in dict(state.get("rngs", {})).items():
            gen = getattr(self, name, None)
            if isinstance(gen, np.random.Generator):
                gen.bit_generator.state = rng_state
        family = state.get("family") or {}
        if family:
            self.load_checkpoint_state(family)


def _reply_order(pair: tuple[ClientProxy, FitRes]) -> tuple[int, int]:
    """Replies in claimed-client-id order (node ids change between processes; client ids do not)."""
    cid = parse_client_id(pair[1].metrics.get("client_id"))
    return (cid if cid is not None else 2**62, int(pair[0].node_id))


def _failed_client_id(reason: str) -> int | None:
    """Client id named in a failure message (``client_id=<n>``, as :mod:`fedapp.clients.guard` raises)."""
    match = re.search(r"client_id=(\d+)", reason)
    return int(match.group(1)) if match else None


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def _is_finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and bool(np.isfinite(x))


def _is_fraction(x: object) -> TypeGuard[float]:
    return _is_finite(x) and 0 <= float(x) <= 1
