"""Record-level DP under the replace-one relation (run-config ``record-neighbours``), and the δ checks.

A record-level client releases N_i (``num_examples``, and q_i and its step count are functions of N_i), so
add/remove neighbours are told apart by the release itself; replace-one is the relation that fits. These
tests check that the client's ε, its calibration and the server's ledger are dp_accounting's replace-one
ε, that it is larger than the add/remove ε of the same mechanism, and that a δ_i above 1/(10·N_i) — from
node-config or run-config, in one run or summed over a client's runs — is refused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import client_context
from flwr.client import Client
from flwr.common import Code, Context, FitIns, FitRes, RecordDict, Status, ndarrays_to_parameters

from fedapp.clients.common import setup_client
from fedapp.clients.dpsgd import DPSGDClient
from fedapp.clients.guard import guard_client
from fedapp.clients.training import get_weights
from fedapp.config import ConfigError, resolve_config
from fedapp.state.lifetime_budget import LifetimeBudget
from strategies.privacy.accountants import (
    ReplaceOnePLD,
    compact_history,
    epsilon_of,
    record_accountant,
)
from strategies.privacy.ledger import PrivacyLedger

DELTA = 1e-4


def dp_accounting_replace_one(history, delta: float, interval: float = 1e-4) -> float:
    """ε of ``history`` by dp_accounting's own PLDAccountant under REPLACE_ONE (finer grid than the project's)."""
    import dp_accounting as dpa
    from dp_accounting import pld
    from dp_accounting.privacy_accountant import NeighboringRelation

    acc = pld.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=interval)
    for z, q, steps in history:
        acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps))
    return float(acc.get_epsilon(delta))


def _train(cfg: dict, rounds: int = 1, cid: int = 0, node: dict | None = None) -> list[dict]:
    ctx = client_context(run_config=cfg, cid=cid, node=node)
    params, out = None, []
    for rnd in range(1, rounds + 1):
        client = DPSGDClient(setup_client(ctx), ctx, private=True)
        if params is None:
            params = get_weights(client.s.new_model())
        update, _, metrics = client.fit(params, {"server-round": rnd})
        out.append(metrics)
        if update:
            params = [p + u for p, u in zip(params, update)]
    return out


_CFG = {"num-server-rounds": 2, "privacy-dist": "fixed", "epsilon": 1.0, "batch-size": 16, "local-epochs": 1}


# ------------------------------------------------------------------ the accountant
def test_replace_one_is_the_default_and_maps_every_accountant():
    cfg = resolve_config(None, {})
    assert cfg["record-neighbours"] == "replace-one"
    assert record_accountant("rdp", "replace-one") == record_accountant("prv", "replace-one") == ReplaceOnePLD.name
    assert record_accountant("prv", "add-remove") == "prv"
    with pytest.raises(ValueError, match="neighbouring relation"):
        record_accountant("rdp", "add-one")
    with pytest.raises(ConfigError, match="record-neighbours"):
        resolve_config(None, {"record-neighbours": "add-one"})


@pytest.mark.parametrize("history", [[(1.1, 0.05, 200)], [(3.0, 1 / 4, 120)], [(12.3, 1 / 8, 240)],
                                     [(2.0, 1 / 38, 380), (1.5, 0.1, 7), (2.0, 1 / 38, 5)], [(40.0, 1.0, 30)]])
def test_replace_one_accountant_is_dp_accountings_pld(history):
    for delta in (1e-3, 1e-5):
        ours = epsilon_of(history, delta, ReplaceOnePLD.name)
        assert ours == pytest.approx(dp_accounting_replace_one(compact_history(history), delta, 1e-3), rel=1e-9)
        assert ours == pytest.approx(dp_accounting_replace_one(compact_history(history), delta), rel=0.01)


def test_replace_one_epsilon_exceeds_add_remove_at_the_same_mechanism():
    for z, q, steps in [(1.0, 1 / 8, 240), (6.7, 1 / 8, 240), (13.4, 1 / 2, 60), (3.0, 0.01, 1000)]:
        h = [(z, q, steps)]
        r1 = epsilon_of(h, DELTA, ReplaceOnePLD.name)
        assert r1 > epsilon_of(h, DELTA, "rdp") and r1 > epsilon_of(h, DELTA, "dpa-pld")
        assert r1 > 1.5 * epsilon_of(h, DELTA, "dpa-pld")  # about twice: the replaced record moves the sum by 2C


# ------------------------------------------------------------------ the DP-SGD client
def test_dpsgd_client_epsilon_is_dp_accountings_replace_one_epsilon():
    metrics = _train(_CFG, rounds=2)
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    m = metrics[-1]
    assert m["record_neighbours"] == "replace-one"
    z, q, steps = m["noise_multiplier"], m["sample_rate"], m["steps_round"]
    independent = dp_accounting_replace_one([(z, q, 2 * steps)], DELTA)
    assert m["epsilon_spent"] == pytest.approx(independent, rel=0.01)
    assert 0.99 <= m["epsilon_spent"] <= 1.0  # calibrated for 2 rounds under replace-one: spent exactly
    add_remove = epsilon_of([(z, q, 2 * steps)], DELTA, "rdp")
    assert m["epsilon_spent"] > add_remove  # the same (z, q, steps) under add/remove looks cheaper
    # add/remove, pinned: less noise for the same ε (what the client spent before this relation was the default)
    pinned = _train({**_CFG, "record-neighbours": "add-remove"}, rounds=2)[-1]
    assert pinned["record_neighbours"] == "add-remove" and pinned["noise_multiplier"] < z
    assert pinned["epsilon_spent"] == pytest.approx(
        epsilon_of([(pinned["noise_multiplier"], q, 2 * steps)], DELTA, "rdp"), rel=1e-12)
    # ... which, against replace-one neighbours, is well over the client's ε_i = 1 (1.41 here)
    assert epsilon_of([(pinned["noise_multiplier"], q, 2 * steps)], DELTA, ReplaceOnePLD.name) > 1.3


def test_ledger_composes_each_client_under_its_declared_relation():
    ledger = PrivacyLedger("rdp")
    h = [(5.0, 0.25, 40)]
    ledger.charge(1, h, DELTA, "replace-one")
    ledger.charge(2, h, DELTA)  # no relation: add/remove, as every existing caller (client-level DP) expects
    assert ledger.epsilon(1) == pytest.approx(epsilon_of(h, DELTA, ReplaceOnePLD.name), rel=1e-12)
    assert ledger.epsilon(2) == pytest.approx(epsilon_of(h, DELTA, "rdp"), rel=1e-12)
    with pytest.raises(ValueError, match="charged under"):
        ledger.charge(1, h, DELTA, "add-remove")
    with pytest.raises(ValueError, match="charged under"):
        ledger.declared_relation(2, "replace-one")
    assert ledger.declared_relation(3, None) == "replace-one"  # a reply that declares nothing: replace-one
    restored = PrivacyLedger("rdp")
    restored.load(ledger.state())
    assert restored.epsilons() == ledger.epsilons()


def _server_round(strategy, server_round: int, cid: int, **metrics) -> dict:
    from types import SimpleNamespace

    weights = [np.zeros(w.shape, np.float32) for w in strategy.current_weights]
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(weights), 10,
                 {"client_id": cid, "status": "ok", "noise_multiplier": 5.0, "sample_rate": 0.25, "steps_round": 40,
                  "delta": DELTA, **metrics})
    strategy.round_log.start(server_round)
    strategy.aggregate_fit(server_round, [(SimpleNamespace(node_id=1000 + cid), res)], [])
    return strategy.round_log.clients()[0]


def test_server_charges_the_declared_relation_and_fixes_it_at_first_contact():
    from strategies.base import DPFLStrategy

    strategy = DPFLStrategy(initial_weights=[np.zeros((3, 2), np.float32)], num_rounds=3)  # accountant "rdp"
    h = [(5.0, 0.25, 40)]
    rec = _server_round(strategy, 1, 1, record_neighbours="replace-one")
    assert rec["status"] == "ok" and rec["epsilon_spent"] == pytest.approx(epsilon_of(h, DELTA, ReplaceOnePLD.name))
    rec = _server_round(strategy, 1, 2, record_neighbours="add-remove")
    assert rec["status"] == "ok" and rec["epsilon_spent"] == pytest.approx(epsilon_of(h, DELTA, "rdp"))
    rec = _server_round(strategy, 2, 2, record_neighbours="replace-one")  # cannot switch once charged
    assert rec["status"] == "rejected" and "charged under" in rec["reason"]
    rec = _server_round(strategy, 2, 3, record_neighbours="add-one")
    assert rec["status"] == "rejected" and "record_neighbours" in rec["reason"]


@pytest.mark.slow
def test_client_and_server_ledger_agree_in_a_simulation(tmp_path):
    from conftest import read_rounds, run_small_simulation

    run = run_small_simulation({"strategy": "dpsgd-fedavg", "max-samples": 400, "num-server-rounds": 2,
                                "privacy-dist": "fixed", "epsilon": 1.0, "batch-size": 16, "fraction-evaluate": 0.0,
                                "output-dir": str(tmp_path / "out")}, num_supernodes=3)
    rounds = read_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["metrics"]["clients_ok"] == 3
        for c in r["clients"]:
            assert c["status"] == "ok" and "epsilon_mismatch" not in c
            assert c["epsilon_spent"] == pytest.approx(c["client_epsilon_spent"], rel=1e-9)
            expected = dp_accounting_replace_one([(c["noise_multiplier"], c["sample_rate"], c["steps"])], c["delta"])
            assert c["epsilon_spent"] == pytest.approx(expected, rel=0.01)
    assert all(0.99 <= c["epsilon_spent"] <= 1.0 for c in rounds[-1]["clients"])


# ------------------------------------------------------------------ δ_i <= 1/(10 N_i), checked by the client
def test_client_refuses_a_node_config_delta_above_the_bound():
    ctx = client_context(run_config=_CFG)
    n_i = len(setup_client(ctx).train)
    big = 2.0 / (10 * n_i)
    refused = _train(_CFG, node={"delta": big})[0]
    assert refused["status"] == "refused"
    assert "node-config 'delta'" in refused["reason"] and "1/(10 N_i)" in refused["reason"]
    assert f"{1 / (10 * n_i):.3g}" in refused["reason"]
    from_run_config = _train({**_CFG, "delta": big})[0]
    assert from_run_config["status"] == "refused" and "run-config 'delta'" in from_run_config["reason"]
    allowed = _train({**_CFG, "allow-large-delta": True}, node={"delta": big})[0]
    assert allowed["status"] == "ok" and allowed["delta"] == big


def test_soteriafl_client_refuses_a_node_config_delta_above_the_bound():
    from fedapp.clients.soteriafl import SoteriaFLClient
    from strategies.soteriafl import fit_seed

    ov = {"dataset": "digits", "model": "mlp-digits", "privacy-dist": "fixed", "epsilon": 5.0, "clip-norm": 1.0,
          "local-test-fraction": 0.0, "num-server-rounds": 1, "max-samples": 400, "strategy": "soteriafl-gd"}
    ctx = client_context(run_config={}, node={"delta": 0.05})
    setup = setup_client(ctx, ov)
    client = SoteriaFLClient(setup, resolve_config(None, ov).soteriafl, ctx)
    values, n, metrics = client.fit(get_weights(setup.new_model()),
                                    {"server-round": 1, "round-seed": fit_seed(42, 1), "soteriafl-method": ov["strategy"]})
    assert values == [] and n == 0 and metrics["status"] == "refused"
    assert "node-config 'delta'" in metrics["reason"] and "1/(10 N_i)" in metrics["reason"]


# ------------------------------------------------------------------ the lifetime δ
class RecordLevelSpender(Client):
    """A record-level client (it declares its relation and N_i) spending ε = 0.1 and δ = ``delta`` per run."""

    def __init__(self, delta: float, num_train: int = 100, record_level: bool = True) -> None:
        self.delta, self.num_train, self.record_level = delta, num_train, record_level

    def fit(self, ins: FitIns) -> FitRes:
        metrics = {"client_id": 0, "status": "ok", "epsilon_spent": 0.1, "delta": self.delta, "epsilon_budget": 1.0,
                   "num_train": self.num_train}
        if self.record_level:
            metrics["record_neighbours"] = "replace-one"
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(2, np.float32)]), self.num_train, metrics)


def _run(tmp_path, inner: Client, lineage: str, node: dict | None = None, **cfg) -> FitRes:
    config = resolve_config(None, {"output-dir": str(tmp_path / "out"), **cfg})
    node_config = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "node0"), **(node or {})}
    ctx = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    return guard_client(inner, ctx, config.general, config.data, config.training, config.deployment).fit(FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]),
                                                       {"server-round": 1, "run-lineage": lineage}))


def test_lifetime_store_refuses_when_the_runs_delta_would_exceed_the_lifetime_delta(tmp_path):
    spender = RecordLevelSpender(delta=4e-4)  # N_i = 100: default lifetime δ = 1/(10 N_i) = 1e-3
    assert _run(tmp_path, spender, "run-a").metrics["status"] == "ok"
    assert _run(tmp_path, spender, "run-b").metrics["status"] == "ok"  # Σ δ = 8e-4
    refused = _run(tmp_path, spender, "run-c")  # 1.2e-3 > 1e-3 (ε is far from its budget: 0.3 of 1.0)
    assert refused.metrics["status"] == "refused" and refused.parameters.tensors == []
    reason = refused.metrics["reason"]
    assert "lifetime delta budget" in reason and "1/(10 N_i)" in reason and "0.0012 > lifetime delta budget 0.001" in reason
    store = LifetimeBudget.for_client(tmp_path / "node0", 0)
    assert set(store.runs()) == {"run-a", "run-b"}  # the refused run is not recorded
    assert math.isclose(store.spent_elsewhere("run-c")[1], 8e-4)
    # a node-config lifetime δ replaces the default, either way (a refused run stays refused: new lineages)
    assert _run(tmp_path, spender, "run-d", node={"lifetime-delta": 2e-3}).metrics["status"] == "ok"
    refused = _run(tmp_path, spender, "run-e", node={"lifetime-delta": 1.3e-3})  # 1.2e-3 + 4e-4
    assert refused.metrics["status"] == "refused" and "node-config 'lifetime-delta'" in refused.metrics["reason"]


def test_lifetime_delta_default_is_waived_by_allow_large_delta_and_absent_for_client_level(tmp_path):
    spender = RecordLevelSpender(delta=6e-4)
    assert _run(tmp_path, spender, "a").metrics["status"] == "ok"
    assert _run(tmp_path, spender, "b").metrics["status"] == "refused"  # 1.2e-3 > 1/(10·100)
    assert _run(tmp_path, spender, "c", **{"allow-large-delta": True}).metrics["status"] == "ok"
    other = tmp_path / "client-level"
    client_level = RecordLevelSpender(delta=6e-4, record_level=False)  # its δ is about clients, not records
    assert all(_run(other, client_level, lineage).metrics["status"] == "ok" for lineage in ("a", "b", "c"))
    with pytest.raises(ConfigError, match="lifetime-delta"):
        _run(tmp_path, spender, "e", node={"lifetime-delta": 2.0})
