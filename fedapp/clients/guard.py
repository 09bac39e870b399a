"""Client wrapper: fault injection, client-state persistence and the lost-accountant guard.

:class:`GuardedClient` wraps every family's Flower ``Client`` (``fedapp/apps/client_app.py``). On
``fit`` it, in order:

1. restores ``Context.state`` from the client's journal when this process starts a resumed run
   with an empty state, commits the journal up to the server's ``committed-round``, and looks for
   a reply already released for this very request before a crash
   (:class:`fedapp.state.client_state.ClientStateStore`; journal folder ``state-dir`` (node-config),
   else ``client-state-dir``, else ``<output-dir>/.client-state``);
2. refuses if this node's privacy policy does not accept the run-config (:mod:`fedapp.privacy.node_policy`: seeded
   noise, the release adversary, a large δ, add/remove neighbours, a planned ε above ``max-epsilon``), or if this
   client already detected lost privacy state in this run;
3. injects a fault when this client is among the ``fault-fraction`` failing this round:
   ``raise`` raises *before* training (no ε spent, the server records ``status="failed"``);
   ``timeout`` sleeps ``fault-delay`` seconds, then trains (ε is spent and counted by the
   client's accountant; the server, past ``round-timeout``, records ``failed``);
4. returns the replayed reply, if any (a repeat of a released output costs no privacy), else
   runs the wrapped client's ``fit``;
5. withholds the update and refuses when the reported cumulative ε is not above the server
   ledger's value for this client (the accountant was lost and restarted; see
   :func:`fedapp.state.client_state.lost_accountant_reason`) — nothing computed on un-accounted state
   leaves the client, and every later round of this run is refused too; likewise when the ε (or δ) of
   earlier runs plus this run's would exceed the client's lifetime budget (:mod:`fedapp.state.lifetime_budget`);
6. journals the state after the round, the reply and the request digest (pending until committed).

Privacy: the wrapper adds no mechanism; it guarantees that a failure or a restart never
makes a client's reported (and enforced) ε smaller than what it actually spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.client import Client
from flwr.common import (
    Code,
    ConfigRecord,
    Context,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Parameters,
    Status,
    log,
)

from fedapp.compat.runtime import on_supernode
from fedapp.config import ConfigError, DataConfig, DeploymentConfig, GeneralConfig, RunConfig, TrainingConfig
from fedapp.privacy.node_policy import node_refusal
from fedapp.state.client_state import (
    COMMITTED_ROUND_KEY,
    LINEAGE_CONFIG_KEY,
    ClientStateStore,
    default_state_dir,
    fit_digest,
    ledger_epsilon,
    lost_accountant_reason,
)
from fedapp.state.lifetime_budget import LifetimeBudget
from strategies.errors import ClientFailure
from strategies.privacy.mechanisms import max_delta

TAINT_KEY = "dpfl-privacy-state-lost"


class InjectedFault(ClientFailure):
    """A failure injected by ``fault-fraction`` (typed ``client_id``; the message names ``client_id=<n>``)."""

    kind = "injected fault"


def failing_clients(seed: int, server_round: int, num_clients: int, fraction: float) -> set[int]:
    """Client ids that fail in ``server_round``: round(fraction·n) of them, a seeded permutation prefix."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fault fraction must be in [0, 1), got {fraction}")
    k = int(round(fraction * num_clients))
    if k == 0:
        return set()
    perm = np.random.default_rng([int(seed), 701, int(server_round)]).permutation(num_clients)
    return {int(i) for i in perm[:k]}


def _refusal(metrics: dict[str, Any]) -> FitRes:
    return FitRes(status=Status(Code.OK, "refused"), parameters=Parameters(tensors=[], tensor_type="numpy.ndarray"),
                  num_examples=0, metrics=metrics)


class RefusingClient(Client):
    """A node that cannot take part (its own data does not fit the run, :class:`fedapp.data.node_data.NodeDataError`):
    it answers every training and evaluation request with a refusal naming why, and computes nothing on its data."""

    def __init__(self, client_id: int, reason: str) -> None:
        self.client_id, self.reason = client_id, reason
        log(WARNING, "client %d refuses this run: %s", client_id, reason)

    def fit(self, ins: FitIns) -> FitRes:
        return _refusal({"client_id": self.client_id, "status": "refused", "reason": self.reason})

    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        return EvaluateRes(status=Status(Code.OK, "refused"), loss=0.0, num_examples=0,
                           metrics={"client_id": self.client_id, "status": "refused", "reason": self.reason})


class GuardedClient(Client):
    """Wraps a family's ``Client``; see the module docstring for what ``fit`` adds."""

    def __init__(self, inner: Client, context: Context, deployment: DeploymentConfig, seed: int, client_id: int,
                 num_clients: int, state_dir: str = "", best_effort: bool = False, allow_large_delta: bool = False,
                 lifetime: LifetimeBudget | None = None, lifetime_epsilon: float | None = None,
                 lifetime_delta: float | None = None, policy_refusal: str | None = None) -> None:
        self.policy_refusal = policy_refusal  # why this node's privacy policy refuses the run (None: it accepts it)
        self.lifetime = lifetime
        self.lifetime_epsilon = lifetime_epsilon  # None: the client's per-run budget
        self.lifetime_delta = lifetime_delta  # None: 1/(10·N_i) for record-level replies (lifetime_delta_budget)
        self.inner = inner
        self.best_effort = best_effort  # a default state dir that cannot be written disables the journal
        self.ctx = context
        self.faults = deployment  # fault-fraction, fault-mode, fault-delay
        self.seed = seed  # the run seed: which clients an injected fault hits
        self.allow_large_delta = allow_large_delta
        self.client_id = client_id
        self.num_clients = num_clients
        self.store = ClientStateStore(Path(state_dir), client_id) if state_dir else None

    # ---- delegation ----------------------------------------------------------------
    def get_properties(self, ins: GetPropertiesIns) -> GetPropertiesRes:
        return self.inner.get_properties(ins)

    def get_parameters(self, ins: GetParametersIns) -> GetParametersRes:
        return self.inner.get_parameters(ins)

    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        return self.inner.evaluate(ins)

    # ---- fit -------------------------------------------------------------------------
    def fit(self, ins: FitIns) -> FitRes:
        config = dict(ins.config)
        rnd = int(config.get("server-round", 0))
        lineage = str(config.get(LINEAGE_CONFIG_KEY, ""))
        journal = self.store if self.store is not None and lineage else None
        replay = digest = None
        if journal is not None:
            committed = config.get(COMMITTED_ROUND_KEY)
            journal.commit(lineage, int(committed) if committed is not None else rnd - 1)
            journal.restore(self.ctx.state, lineage)
            digest = fit_digest(ins)
            replay = journal.replay(self.ctx.state, lineage, rnd, digest)
        ledger = ledger_epsilon(config, self.client_id)
        if replay is None and TAINT_KEY in self.ctx.state:
            taint = str(self.ctx.state[TAINT_KEY].get("reason", "privacy state lost earlier in this run"))
            return _refusal({"client_id": self.client_id, "status": "refused", "reason": taint,
                             **({"epsilon_spent": ledger} if ledger is not None else {})})
        if self.policy_refusal is not None:
            log(WARNING, "client %d: %s", self.client_id, self.policy_refusal)
            return _refusal({"client_id": self.client_id, "status": "refused", "reason": self.policy_refusal})
        fraction = self.faults.fault_fraction
        if fraction > 0 and self.client_id in failing_clients(self.seed, rnd, self.num_clients, fraction):
            if self.faults.fault_mode == "raise":
                raise InjectedFault(self.client_id, f"round={rnd} (fault-fraction={fraction})")
            time.sleep(self.faults.fault_delay)
        if replay is not None:
            return replay  # the very reply released for this request before a crash: no new privacy loss
        res = self.inner.fit(ins)
        metrics = dict(res.metrics)
        if metrics.get("status", "ok") == "ok":
            reason = lost_accountant_reason(metrics.get("epsilon_spent"), ledger) or self._lifetime_refusal(
                lineage, metrics)
            if reason is not None:
                self.ctx.state[TAINT_KEY] = ConfigRecord({"reason": reason, "round": rnd})
                res = _refusal({"client_id": self.client_id, "status": "refused", "reason": reason,
                                "epsilon_spent": float(ledger or 0.0)})
        if journal is not None:
            self._record(journal, lineage, rnd, digest or "", res)
        return res

    def _lifetime_refusal(self, lineage: str, metrics: Mapping[str, Any]) -> str | None:
        """Check (and record) this run's ε against the lifetime budget; the update is withheld when over it (the
        accountant has counted the round already: it over-counts, never under-counts)."""
        eps, delta = metrics.get("epsilon_spent"), metrics.get("delta")
        if self.lifetime is None or not lineage or not isinstance(eps, (int, float)) or not isinstance(delta, (int, float)):
            return None
        budget = self.lifetime_epsilon if self.lifetime_epsilon is not None else metrics.get("epsilon_budget")
        if not isinstance(budget, (int, float)):
            return None
        delta_budget, source = lifetime_delta_budget(self.lifetime_delta, metrics, self.allow_large_delta)
        reason = self.lifetime.refusal(lineage, float(eps), float(budget), float(delta), delta_budget, source)
        if reason is None:
            self.lifetime.record(lineage, float(eps), float(delta))
        return reason

    def _record(self, journal: ClientStateStore, lineage: str, rnd: int, digest: str, res: FitRes) -> None:
        try:
            journal.record(self.ctx.state, lineage, rnd, digest, res)
        except OSError as exc:
            if not self.best_effort:
                raise
            log(WARNING, "client %d: cannot persist client state under %s (%s); continuing without it",
                self.client_id, journal.root, exc)
            self.store = None


def guard_client(inner: Client, context: Context, general: GeneralConfig, data: DataConfig, training: TrainingConfig,
                 deployment: DeploymentConfig, cfg: RunConfig | None = None) -> Client:
    """Wrap ``inner`` (a family's client) with :class:`GuardedClient` for this node; with the run's ``cfg``, the
    node's privacy policy (:class:`fedapp.privacy.node_policy.NodePolicy`) decides whether it trains at all."""
    node = context.node_config
    policy_refusal = node_refusal(cfg, node, on_supernode()) if cfg is not None else None
    try:
        cid = int(node["partition-id"])
        n = int(node["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"node-config needs integer 'partition-id' and 'num-partitions', got {dict(node)}") from None
    if "dataset" in node and str(node["dataset"]) != data.dataset:
        raise ConfigError(f"node-config dataset {node['dataset']!r} differs from run-config dataset {data.dataset!r}")
    state_dir = str(node.get("state-dir", "")) or deployment.client_state_dir
    lifetime = None
    if "state-dir" in node or deployment.lifetime_budget:  # on by default for deployed SuperNodes
        lifetime = LifetimeBudget.for_client(state_dir or default_state_dir(general), cid)
    cap = float(node["lifetime-epsilon"]) if "lifetime-epsilon" in node else None
    delta_cap = None
    if "lifetime-delta" in node:
        try:
            delta_cap = float(node["lifetime-delta"])
        except (TypeError, ValueError):
            delta_cap = math.nan
        if not 0 < delta_cap < 1:
            raise ConfigError(f"node-config 'lifetime-delta' = {node['lifetime-delta']!r} must be a number in (0, 1)")
    return GuardedClient(inner, context, deployment, general.seed, cid, n, state_dir or default_state_dir(general),
                         best_effort=not state_dir, allow_large_delta=training.allow_large_delta, lifetime=lifetime,
                         lifetime_epsilon=cap, lifetime_delta=delta_cap, policy_refusal=policy_refusal)


def lifetime_delta_budget(node_cap: float | None, metrics: Mapping[str, Any],
                          allow_large_delta: bool) -> tuple[float | None, str]:
    """(lifetime δ budget, where it comes from) for a reply: node-config ``lifetime-delta`` when given; else, for a
    record-level reply (it declares ``record_neighbours`` and its ``num_train`` N_i), 1/(10·N_i) unless
    ``allow-large-delta``; else (None, '') — no δ check (see :mod:`fedapp.state.lifetime_budget`)."""
    if node_cap is not None:
        return node_cap, "node-config 'lifetime-delta'"
    n_i = metrics.get("num_train")
    if allow_large_delta or "record_neighbours" not in metrics or isinstance(n_i, bool) or not isinstance(n_i, int) \
            or n_i < 1:
        return None, ""
    return max_delta(n_i), (f"default 1/(10 N_i) for N_i = {n_i} records; set node-config 'lifetime-delta' to "
                            "choose another")
