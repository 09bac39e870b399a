"""The round engine: one federated round as sample → admit → charge → validate → aggregate → record.

Framework-free: it reads :class:`~strategies.server.admission.Reply` objects and weight arrays, never a
Flower type (:mod:`strategies.base` adapts Flower to it). Collaborators, each usable alone:
:class:`~strategies.server.sampling.ClientSampler` (who trains), :class:`~strategies.server.identity.IdentityBinding`
(a client id belongs to one node), :class:`~strategies.server.validation.UpdateValidator` and
:class:`~strategies.server.validation.StrikeRecord`, :class:`~strategies.privacy.ledger.PrivacyLedger` (the
server's ε per client), :class:`~strategies.server.records.RoundLog` (``rounds.jsonl``) and
:mod:`~strategies.server.admission` (one reply's fate). A family overrides the hooks of :mod:`strategies.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from logging import ERROR, INFO, WARNING
from typing import Any

import numpy as np

from strategies.aggregate import flatten, normalize_weights, unflatten
from strategies.hooks import CLIENT_STATUSES, FamilyHooks
from strategies.privacy.ledger import PrivacyLedger
from strategies.server import admission as adm
from strategies.server.admission import ClientUpdate, Failure, Reply, log
from strategies.server.identity import IdentityBinding
from strategies.server.records import EVALUATE_PHASE, RoundLog, RoundRecorder, client_evaluation, headline
from strategies.server.sampling import ClientSampler
from strategies.server.validation import StrikeRecord, UpdateValidator, parse_client_id

EvaluateFn = Callable[[list[np.ndarray]], tuple[float, dict[str, Any]]]  # global arrays -> (loss, metrics)
FitConfigFn = Callable[[], Mapping[str, Any]]  # run-wide fit-config keys (e.g. a checkpointer's lineage)


class RoundEngine(FamilyHooks):
    """Server state and the round; families override the hooks of :class:`FamilyHooks`."""

    def __init__(self, *, initial_weights: Sequence[np.ndarray], num_rounds: int, seed: int = 0,
                 clients_per_round: int = 0, min_available_clients: int = 2, fraction_evaluate: float = 1.0,
                 evaluate_every: int = 1, server_lr: float = 1.0, evaluate_fn: EvaluateFn | None = None,
                 recorder: RoundRecorder | None = None,
                 prevalidate: Callable[[int], None] | None = None, sampling: str = "fixed",
                 secret_sampling: bool = True, accountant: str = "rdp", strike_limit: int = 3,
                 robust_norm_factor: float = 10.0, max_examples: Mapping[int, int] | None = None,
                 dataset_sizes: Callable[[int], Sequence[int]] | None = None, min_fit_clients: int = 0,
                 sampling_rng: np.random.Generator | None = None) -> None:
        self.current_weights = [np.asarray(w, dtype=np.float32) for w in initial_weights]
        self.shapes = [tuple(w.shape) for w in self.current_weights]
        self.num_params = int(sum(w.size for w in self.current_weights))
        self.num_rounds, self.seed, self.server_lr = num_rounds, seed, server_lr
        self.clients_per_round, self.min_available_clients = clients_per_round, min_available_clients
        self.fraction_evaluate, self.evaluate_fn, self.prevalidate = fraction_evaluate, evaluate_fn, prevalidate
        self.evaluate_every = max(1, int(evaluate_every))
        self.min_fit_clients = min_fit_clients  # fewer acceptable updates in a round abort the run (0 = none)
        self.dataset_sizes = dataset_sizes  # n -> every client's N_i, read before round 1 (bounds num_examples)
        self.num_available = 0
        self.round_offset = 0  # rounds already done before this process (resume from a checkpoint)
        self.fit_config_sources: list[FitConfigFn] = []  # run-wide fit-config keys, asked every round
        self.initial_metrics: dict[str, Any] = {}
        self.sampler = ClientSampler(clients_per_round, sampling, None if secret_sampling else seed, sampling_rng)
        self.identity = IdentityBinding()
        self.validator = UpdateValidator(self.shapes, self.declared_norm_bound, robust_norm_factor,
                                         dict(max_examples or {}))
        self.strikes = StrikeRecord(strike_limit)  # per client id: its own replies were rejected
        self.node_strikes = StrikeRecord(strike_limit)  # per node: a spoofed or unestablished claim was rejected
        self.ledger = PrivacyLedger(accountant)
        self.round_log = RoundLog(recorder)
        self.declared: dict[int, tuple[float, float]] = {}
        self.connected_nodes: set[int] = set()  # node ids connected when the round was configured

    # ------------------------------------------------------------------ what the run attaches, explicitly
    @property
    def recorder(self) -> RoundRecorder | None:
        return self.round_log.recorder

    @property
    def last_round(self) -> int:
        return self.round_log.last_round

    def record_with(self, recorder: RoundRecorder | None, fit_config: FitConfigFn | None = None) -> None:
        """Write round records through ``recorder`` (e.g. a checkpointer wrapping :attr:`recorder`);
        ``fit_config`` adds run-wide keys to every later fit config."""
        self.round_log.recorder = recorder
        if fit_config is not None:
            self.fit_config_sources.append(fit_config)

    def require_fit_clients(self, count: int) -> None:
        """Abort the run when a round has fewer than ``count`` acceptable updates."""
        self.min_fit_clients = int(count)

    # ------------------------------------------------------------------ the round
    def actual_round(self, flower_round: int) -> int:
        """A framework counts rounds from 1 in every process; a resumed run continues after ``round_offset``."""
        return flower_round + self.round_offset if flower_round > 0 else flower_round

    def open_round(self, server_round: int, num_available: int, connected: set[int]) -> None:
        """Start the record of ``server_round``; before round 1, check the federation (raises before any file)."""
        self.num_available, self.connected_nodes = num_available, connected
        if not self.round_log.opened:
            if num_available < 2:
                raise ValueError(f"a federation needs at least 2 clients, {num_available} connected")
            if self.prevalidate is not None:
                self.prevalidate(num_available)
            if self.dataset_sizes is not None:
                self.validator.max_examples = dict(enumerate(self.dataset_sizes(num_available)))
            self.round_log.open()
        self.round_log.start(server_round)

    def round_fit_config(self, server_round: int) -> dict[str, Any]:
        config: dict[str, Any] = {"server-round": server_round}
        for source in self.fit_config_sources:
            config.update(source())
        return {**config, **self.fit_config(server_round)}

    def run_round(self, server_round: int, replies: list[Reply], failures: list[Failure]) -> dict[str, Any]:
        """Admit, charge and validate every reply, aggregate the accepted ones, record the round; its metrics."""
        connected = self.connected_nodes | {r.node_id for r in replies}
        contested = adm.contested_ids(replies, CLIENT_STATUSES)
        records: list[dict[str, Any]] = []
        accepted = [u for r in sorted(replies, key=_reply_order)  # a fixed order: sums are reproducible
                    if (u := adm.admit(self, server_round, r, connected, contested, records)) is not None]
        adm.screen_outliers(self, server_round, accepted)
        accepted = [u for u in accepted if u.record["status"] == "ok"]
        for u, reason in self.screen(server_round, accepted):
            u.record["status"], u.record["reason"] = "rejected", reason
            adm.strike(self, server_round, u.record)
        accepted = [u for u in accepted if u.record["status"] == "ok"]
        records += [adm.failure_record(self, f) for f in failures]
        count = {s: sum(r["status"] == s for r in records) for s in ("refused", "rejected", "failed")}
        metrics: dict[str, Any] = {"clients_ok": len(accepted), **{f"clients_{s}": n for s, n in count.items()},
                                   "uplink_bytes": int(sum(r["uplink_bytes"] or 0 for r in records))}
        metrics.update(self.population_charge(server_round, accepted, records))
        if metrics.get("round_withheld"):
            accepted, metrics["clients_ok"] = [], 0  # the mechanism cannot pay for this round: nothing is released
        adm.fill_ledger_fields(self.ledger, records)
        self.round_log.set_clients(records)
        if len(accepted) < self.min_fit_clients:
            self.round_log.add_metrics({**metrics, "aborted": True})
            self.flush_round()
            raise RuntimeError(
                f"round {server_round}: only {len(accepted)} acceptable client update(s) ({count['failed']} failed, "
                f"{count['rejected']} rejected, {count['refused']} refused) < min-fit-clients = {self.min_fit_clients}; "
                "aborting the run (the global model of the previous round is the last checkpoint)")
        if accepted:
            try:
                metrics.update(self.step(server_round, accepted))
            except Exception as exc:  # noqa: BLE001 — an aggregation failure must not end the run
                log(ERROR, "round %d: aggregation failed (%s: %s); the global model is unchanged", server_round,
                    type(exc).__name__, exc, exc_info=True)
                metrics["aggregation_error"] = f"{type(exc).__name__}: {exc}"
        else:
            log(WARNING, "round %d: no acceptable client update; the global model is unchanged", server_round)
        self.round_log.add_metrics(metrics)
        return metrics

    def step(self, server_round: int, accepted: list[ClientUpdate]) -> dict[str, Any]:
        """Weights, aggregate and the server step θ ← θ + server_lr · aggregate; returns round metrics."""
        weights, extra = self.aggregation_weights(server_round, accepted)
        weights = normalize_weights(weights)
        aggregate = self.aggregate_updates(server_round, accepted, weights)
        new_flat = flatten(self.current_weights) + self.server_lr * aggregate
        if aggregate.shape != (self.num_params,) or not np.all(np.isfinite(new_flat.astype(np.float32))):
            log(WARNING, "round %d: the aggregate is not a finite vector of %d; the model is unchanged",
                server_round, self.num_params)  # cannot happen with validated updates; never corrupt the model
            return {"aggregate_rejected": True}
        for cu, w in zip(accepted, weights):
            cu.record["aggregation_weight"] = float(w)
        self.current_weights = unflatten(new_flat, self.shapes)
        self.after_aggregate(server_round, accepted, weights)
        return {"mean_update_norm": float(np.mean([np.linalg.norm(c.update) for c in accepted])), **extra}

    def evaluate_model(self, server_round: int, weights: list[np.ndarray]) -> tuple[float, dict[str, Any]] | None:
        """Server-side evaluation of the global model into the round record (round 0: the initial model)."""
        out = None
        if self.evaluate_fn is not None and (server_round == 0 or self.evaluation_round(server_round)):
            with self.round_log.timed(EVALUATE_PHASE):
                loss, metrics = out = self.evaluate_fn(weights)
            if server_round == 0:
                log(INFO, "initial model: loss=%.4f accuracy=%.4f", loss, metrics.get("accuracy", float("nan")))
            self._add_metrics(server_round, {"loss": loss, **metrics})
        self._add_metrics(server_round, self.model_metrics(weights))
        return out

    def _add_metrics(self, server_round: int, metrics: Mapping[str, Any]) -> None:
        if metrics and server_round == 0:
            self.initial_metrics.update(metrics)
        elif metrics:
            self.round_log.add_metrics(metrics)

    def record_client_evaluation(self, results: Sequence[tuple[float, int, Mapping[str, Any]]]) -> tuple[float | None, dict[str, Any]]:
        """Clients' (loss, num_examples, metrics) into the round record, which is then written; (mean loss, metrics)."""
        loss, metrics = client_evaluation(results)
        self.round_log.add_metrics(metrics)
        self.flush_round()
        return loss, metrics

    def evaluation_sample(self, server_round: int, num_nodes: int) -> list[int]:
        """Indices of the ``num_nodes`` sorted nodes that evaluate: round(fraction_evaluate · n), seeded per round."""
        k = max(1, int(round(self.fraction_evaluate * num_nodes)))
        if k >= num_nodes:
            return list(range(num_nodes))
        return sorted(int(i) for i in np.random.default_rng([self.seed, 302, server_round]).choice(num_nodes, k, False))

    def flush_round(self) -> None:
        """Write the record of the round in progress (once) and log its headline."""
        record = self.round_log.flush(self.num_rounds)
        if record is not None:
            log(INFO, *headline(record, self.num_rounds))

    def ledger_snapshot(self) -> dict[int, float]:
        """ε the server's ledger holds for every client that has spent some (what ``dp-ledger`` carries)."""
        return {cid: eps for cid, eps in self.ledger.epsilons().items() if eps > 0} if self.send_ledger else {}

    # ------------------------------------------------------------------ checkpoint / resume
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after :attr:`last_round`: weights, ledger, identities, strikes, the
        validator's reference norms, the sampler's generator, the family's generators and its state."""
        return {"round": int(self.last_round), "weights": [w.copy() for w in self.current_weights],
                "ledger": self.ledger.state(), "node_clients": self.identity.state(), "strikes": self.strikes.state(),
                "node_strikes": self.node_strikes.state(), "validator": self.validator.state(),
                "declared": {str(k): list(v) for k, v in self.declared.items()}, "sampler": self.sampler.state(),
                "initial_metrics": dict(self.initial_metrics), "num_available": int(self.num_available),
                "rngs": {name: gen.bit_generator.state for name, gen in self.random_generators().items()},
                "family": self.checkpoint_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: rounds 1, 2, … of this process continue at ``state['round'] + 1``."""
        weights = [np.asarray(w, dtype=np.float32) for w in state["weights"]]
        if (shapes := [tuple(w.shape) for w in weights]) != self.shapes:
            raise ValueError(f"checkpoint weights have shapes {shapes}, the model has {self.shapes}")
        self.current_weights = weights
        self.round_offset = self.round_log.last_round = int(state["round"])
        self.ledger.load(dict(state.get("ledger", {})))
        self.identity.load(dict(state.get("node_clients", {})))
        self.strikes.load(dict(state.get("strikes", {})))
        self.node_strikes.load(dict(state.get("node_strikes", {})))
        self.validator.load(dict(state.get("validator", {})))
        self.declared = {int(k): (float(v[0]), float(v[1])) for k, v in dict(state.get("declared", {})).items()}
        self.sampler.load(dict(state.get("sampler", {})))
        self.initial_metrics = dict(state.get("initial_metrics") or {})
        generators = self.random_generators()
        for name, rng_state in dict(state.get("rngs", {})).items():
            if name in generators:
                generators[name].bit_generator.state = rng_state
        if family := state.get("family") or {}:
            self.load_checkpoint_state(family)


def _reply_order(reply: Reply) -> tuple[int, int]:
    """Replies in claimed-client-id order (node ids change between processes; client ids do not)."""
    cid = parse_client_id(reply.metrics.get("client_id"))
    return (cid if cid is not None else 2**62, reply.node_id)
