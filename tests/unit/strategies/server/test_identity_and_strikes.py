"""Identity disputes never punish the honest client, and strikes are for hostility only.

A node-bound client id stays with its first node: a later node claiming it is rejected and struck (by node),
the owner keeps training and is charged. A dispute between unbound nodes strikes nobody and charges the id
for every claim. A failure the client reports itself (DP-SGD diverged) is a failure, not a strike.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from strategies.base import DPFLStrategy

SHAPES = [(3, 2), (2,)]
UPDATE = [np.full((3, 2), 0.1, np.float32), np.full((2,), -0.1, np.float32)]


def dpsgd_reply(client_id: int, status: str = "ok", z: float = 1.0) -> FitRes:
    """A record-level DP-SGD reply: the declared (z, q, steps, δ) the server charges."""
    metrics = {"client_id": client_id, "status": status, "noise_multiplier": z, "sample_rate": 0.1,
               "steps_round": 10, "delta": 1e-5, "epsilon_spent": 0.1, "epsilon_budget": 100.0}
    arrays = UPDATE if status == "ok" else []
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 50, metrics)


def node(i: int) -> SimpleNamespace:
    return SimpleNamespace(node_id=1000 + i)


def strategy() -> DPFLStrategy:
    s = DPFLStrategy(initial_weights=[np.zeros(sh, np.float32) for sh in SHAPES], num_rounds=10, strike_limit=2)
    s.connected_nodes = {1000, 1001, 1002, 1003}
    return s


def statuses(s: DPFLStrategy) -> dict[int, str]:
    return {r["node_id"]: r["status"] for r in s.round_log.clients()}


def run_round(s: DPFLStrategy, rnd: int, replies: list[tuple[SimpleNamespace, FitRes]]) -> dict[int, str]:
    s.round_log.start(rnd)
    s.aggregate_fit(rnd, replies, [])
    out = statuses(s)
    s.flush_round()
    return out


def test_a_spoofer_arriving_later_is_struck_and_the_owner_keeps_training_and_being_charged() -> None:
    s = strategy()
    charged = []
    for rnd in range(1, 7):
        replies = [(node(0), dpsgd_reply(0)), (node(1), dpsgd_reply(1))]
        if rnd >= 3:  # node 2 claims client 0 (and, once, sends a refusal naming it)
            replies.append((node(2), dpsgd_reply(0, status="refused" if rnd == 4 else "ok", z=0.01)))
        got = run_round(s, rnd, replies)
        assert got[1000] == "ok" and got[1001] == "ok", (rnd, got)
        if rnd >= 3 and 1002 in got:
            assert got[1002] == "rejected"
        charged.append(s.ledger.epsilon(0))
    assert not s.strikes.excluded(0) and s.strikes.strikes.get(0, 0) == 0
    assert s.node_strikes.excluded(1002)  # the newcomer node, after strike-limit = 2 violations
    assert s.identity.node_of[0] == 1000
    assert all(b > a for a, b in zip(charged, charged[1:]))  # the owner's release is charged every round
    assert s.declared[0] == (1.0, 0.1)  # the spoofer's z = 0.01 never replaced the owner's declaration


def test_a_spoofer_present_from_round_one_strikes_nobody_and_the_id_is_charged_for_every_claim() -> None:
    s = strategy()
    for rnd in range(1, 5):
        got = run_round(s, rnd, [(node(0), dpsgd_reply(0)), (node(2), dpsgd_reply(0, z=5.0)),
                                 (node(1), dpsgd_reply(1))])
        assert got == {1000: "rejected", 1002: "rejected", 1001: "ok"}
    assert s.strikes.strikes == {} and s.node_strikes.strikes == {}
    assert not s.strikes.excluded(0)
    # both claims are charged every round: the honest release is always inside the ledger
    one_round = DPFLStrategy(initial_weights=[np.zeros(sh, np.float32) for sh in SHAPES], num_rounds=1)
    one_round.ledger.register(0)
    for _ in range(4):
        one_round.ledger.charge(0, [(1.0, 0.1, 10)], 1e-5)
    assert s.ledger.epsilon(0) > one_round.ledger.epsilon(0)
    assert 0 not in s.declared  # nobody's declaration was fixed by a contested claim


def test_a_client_reported_failure_is_charged_and_never_struck() -> None:
    s = strategy()
    for rnd in range(1, 5):
        got = run_round(s, rnd, [(node(0), dpsgd_reply(0, status="failed")), (node(1), dpsgd_reply(1))])
        assert got == {1000: "failed", 1001: "ok"}
    assert s.strikes.strikes == {} and not s.strikes.excluded(0)
    assert s.ledger.epsilon(0) > 0  # DP-SGD ran: the round is spent whether or not its model was finite


def test_a_contested_claim_cannot_fix_the_owners_declared_relation() -> None:
    """A spoofer that declares add/remove neighbours in the contested rounds does not get the owner's replies
    (replace-one, the default) rejected once it leaves: contested charges are provisional."""
    s = strategy()
    for rnd in (1, 2):
        spoof = dpsgd_reply(0)
        spoof.metrics["record_neighbours"] = "add-remove"
        got = run_round(s, rnd, [(node(0), dpsgd_reply(0)), (node(2), spoof), (node(1), dpsgd_reply(1))])
        assert got[1000] == got[1002] == "rejected"
    provisional = s.ledger.epsilon(0)
    assert provisional > 0 and s.ledger.relation(0) == "replace-one"
    got = run_round(s, 3, [(node(0), dpsgd_reply(0)), (node(1), dpsgd_reply(1))])  # the spoofer is gone
    assert got == {1000: "ok", 1001: "ok"} and s.strikes.strikes == {}
    assert s.ledger.relation(0) == "replace-one" and s.ledger.epsilon(0) > provisional
