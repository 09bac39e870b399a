"""The Flower side of a client-level SecAgg+ round: every detail of Flower's fit messages the secure sum touches.

Flower's SecAgg+ workflow hands the strategy, after the masked vectors arrived and before the unmask stage, the
survivors' replies; once unmasked, each reply's ``parameters`` is the survivors' *mean* (Flower divides the modular
sum by their count). :class:`SecureSumAdapter` reads and rewrites those messages for a client-level strategy:

* :meth:`~SecureSumAdapter.unusable_survivor`: why a survivor's reply makes the sum unusable (its update is inside
  the sum and could not be taken out), checked before anything is reconstructed;
* :meth:`~SecureSumAdapter.decode_ddg`: the distributed discrete Gaussian's residue → the survivors' mean update;
* :meth:`~SecureSumAdapter.split_count`: adaptive clipping's count coordinate split off the mean;
* :meth:`~SecureSumAdapter.withhold_unreleased`, :meth:`~SecureSumAdapter.withhold_rejected`: the round's records
  when nothing of it may be released.

The mechanism's arithmetic (rotation, γ, wrap) is :mod:`strategies.privacy.discrete_gaussian`'s and the count's
:mod:`strategies.privacy.adaptive_clipping`'s; this module only moves arrays in and out of Flower's messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import FitRes, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from strategies.errors import ConfigError
from strategies.privacy.adaptive_clipping import split_count_coordinate
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.server.identity import IdentityBinding
from strategies.server.validation import RejectedUpdate, StrikeRecord, metric_problem, parse_client_id

#: the fewest survivors whose secure sum is unmasked: with two, either survivor (or a server colluding with it) reads
#: the other's update off the sum
MIN_SECURE_SURVIVORS = 3

SecureResults = list[tuple[ClientProxy, FitRes]]
#: a flat vector of the payload's length → the arrays a client sends
ToArrays = Callable[[np.ndarray], list[np.ndarray]]


def check_cohort(clients_per_round: int) -> None:
    """Refuse a plan whose rounds have fewer clients than a secure sum is ever unmasked for."""
    if clients_per_round < MIN_SECURE_SURVIVORS:
        raise ConfigError(f"secure aggregation with {clients_per_round} client(s) a round (clients-per-round, else "
                          f"every client): a secure sum of fewer than {MIN_SECURE_SURVIVORS} survivors is never "
                          f"unmasked, so no round would release; run at least {MIN_SECURE_SURVIVORS} clients a round "
                          "or set secure-aggregation = false")


def withhold_records(records: list[dict[str, Any]], reason: str, *, drop_attributable: bool) -> None:
    """Mark every record whose update reached the sum (``ok``, or not attributable to its node) ``withheld``."""
    for r in records:
        if r.get("status") == "ok" or r.get("attributable") is False:
            r["status"], r["reason"] = "withheld", reason
            if drop_attributable:
                r.pop("attributable", None)


class SecureSumAdapter:
    """One client-level strategy's view of its SecAgg+ rounds (the state of the round being aggregated)."""

    def __init__(self) -> None:
        self.contributors = 0  #: replies inside this round's secure sum
        self.unreleased: str | None = None  #: why this round's secure sum was not reconstructed
        #: with adaptive clipping: Σ of the survivors' count shares (from the sum's last coordinate) ...
        self.count_sum: float | None = None
        self.problem: str | None = None  #: ... or why the sum could not be split

    def open(self, results: SecureResults) -> None:
        """Start aggregating a round whose sum holds ``results``."""
        self.contributors = len(results)
        self.count_sum, self.problem = None, None

    def rejection(self) -> str | None:
        """Why every reply of this round is rejected (the sum was not reconstructed, or could not be split)."""
        if self.unreleased is not None:
            return f"not reconstructed: {self.unreleased}"
        return self.problem

    def withhold_unreleased(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mark a round whose sum was never reconstructed: every record that reached it is ``withheld``."""
        assert self.unreleased is not None
        withhold_records(records, self.unreleased, drop_attributable=True)
        return {"round_withheld": True, "sum_reconstructed": False}

    @staticmethod
    def withhold_rejected(server_round: int, records: list[dict[str, Any]]) -> bool:
        """Withhold a reconstructed sum that contains a rejected reply (whether it does: True): its update is inside
        the sum and cannot be taken out, so nothing of the round is released (the sum is still charged)."""
        bad = [r for r in records if r.get("status") == "rejected"]
        if not bad:
            return False
        reason = (f"secure aggregation: the sum contains the reply of node {bad[0].get('node_id')}, rejected "
                  f"({bad[0].get('reason')}); round withheld")
        log(WARNING, "round %d: %s", server_round, reason)
        withhold_records(records, reason, drop_attributable=False)
        return True

    @staticmethod
    def unusable_survivor(results: SecureResults, *, identity: IdentityBinding, strikes: StrikeRecord,
                          connected: set[int], check: Callable[[Mapping[str, Any]], None]) -> str | None:
        """Why the sum of these survivors must not be reconstructed (None: it may): a client id claimed twice,
        unusable metrics, a node not bound to the client it names, an excluded client, a status other than ``ok``,
        a reply ``check`` rejects, or fewer than :data:`MIN_SECURE_SURVIVORS` survivors."""
        nodes = connected | {int(p.node_id) for p, _ in results}
        claims = [parse_client_id(res.metrics.get("client_id")) for _, res in results]
        twice = sorted({c for c in claims if c is not None and claims.count(c) > 1})
        if twice:
            return f"secure aggregation: client_id {twice[0]} is claimed by several survivors"
        for proxy, res in results:
            metrics = dict(res.metrics)
            cid = parse_client_id(metrics.get("client_id"))
            problem = metric_problem(metrics)
            if problem is None and cid is not None:
                problem = identity.check(int(proxy.node_id), cid, nodes)
                if problem is None and strikes.excluded(cid):
                    problem = f"client {cid} is excluded"
                if problem is None and metrics.get("status", "ok") != "ok":
                    problem = f"status {metrics.get('status')!r} inside the sum"
                if problem is None:
                    try:
                        check(metrics)
                    except RejectedUpdate as exc:
                        problem = str(exc)
            if problem is not None:
                return f"secure aggregation: node {int(proxy.node_id)}'s reply is unusable ({problem})"
        if results and len(results) < MIN_SECURE_SURVIVORS:
            return (f"secure aggregation: only {len(results)} survivor(s); a sum of fewer than {MIN_SECURE_SURVIVORS} "
                    "is never unmasked (with two, either survivor, or a server colluding with it, learns the "
                    "other's update from the sum)")
        return None

    @staticmethod
    def decode_ddg(server_round: int, results: SecureResults, ddg: DistributedDiscreteGaussian, seed: int,
                   to_arrays: ToArrays) -> None:
        """Replace the reconstructed sum modulo 2^b (one array of the rotated length, every reply carries it) by
        the survivors' mean update in the clients' wire format: wrap, scale by γ, undo the rotation, divide by r'."""
        arrays = parameters_to_ndarrays(results[0][1].parameters)
        if len(arrays) != 1 or arrays[0].shape != (ddg.rotated_dim,):
            shapes = [tuple(a.shape) for a in arrays]
            raise RuntimeError(f"round {server_round}: the secure sum has shapes {shapes}, the distributed discrete "
                               f"Gaussian ({ddg.rotated_dim},)")
        mean = ndarrays_to_parameters(to_arrays(ddg.decode(arrays[0], seed) / len(results)))
        for _, res in results:
            res.parameters = mean

    def split_count(self, results: SecureResults, update_dim: int, scale: float, to_arrays: ToArrays) -> None:
        """Take the count coordinate off the survivors' mean (under SecAgg+ with adaptive clipping) and keep
        Σ_i (b_i − ½ + N(0, σ_b²/r_t)) in :attr:`count_sum`; the replies then carry the update part only. A mean of
        any other layout than the update's arrays plus one (1,) array is not split: :attr:`problem` says why, and
        every reply is then rejected (the round withheld)."""
        arrays = parameters_to_ndarrays(results[0][1].parameters)
        update_shapes = [tuple(a.shape) for a in to_arrays(np.zeros(update_dim))]
        shapes = [tuple(a.shape) for a in arrays]
        if shapes != update_shapes + [(1,)]:
            self.problem = (f"the secure sum has shapes {shapes}, expected the update's {update_shapes} and one "
                            "count coordinate (1,)")
            return
        flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
        try:
            update_mean, count_mean = split_count_coordinate(flat, update_dim, scale)
        except ValueError as exc:
            self.problem = str(exc)
            return
        if not math.isfinite(count_mean):
            self.problem = f"the secure sum's count coordinate is not finite ({count_mean})"
            return
        self.count_sum = count_mean * len(results)
        mean = ndarrays_to_parameters(to_arrays(update_mean))
        for _, res in results:
            res.parameters = mean
