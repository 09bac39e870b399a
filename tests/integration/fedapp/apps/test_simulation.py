"""A real Flower simulation (Ray backend) of DP-SGD clients: results files and their consistency."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_rounds, run_small_simulation

from strategies.privacy.accountants import DPAccountingRDP, epsilon_of


def _dp_accounting_replace_one(history, delta: float) -> float:
    import dp_accounting as dpa
    from dp_accounting import pld
    from dp_accounting.privacy_accountant import NeighboringRelation

    acc = pld.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    for z, q, steps in history:
        acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps))
    return float(acc.get_epsilon(delta))


@pytest.mark.slow
def test_dpsgd_fedavg_simulation_writes_consistent_results(tmp_path):
    overrides = {"strategy": "dpsgd-fedavg", "num-server-rounds": 2, "output-dir": str(tmp_path),
                 "privacy-dist": "dist3", "partitioner": "dirichlet", "lr": 0.3}
    run_dir = run_small_simulation(overrides, num_supernodes=5)
    for name in ("config.json", "rounds.jsonl", "summary.json", "accuracy.png", "privacy.png"):
        assert (run_dir / name).stat().st_size > 0, name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["strategy"] == "dpsgd-fedavg" and config["versions"]["flwr"].startswith("1.41")
    assert "record-level" in config["strategy"]["privacy"]
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert {"accuracy", "loss", "client_accuracy"} <= set(r["metrics"]) and r["wall_seconds"] > 0
        # where the server's round went: clients (training, messages), aggregation, central evaluation
        assert set(r["seconds"]) == {"fit", "aggregate", "evaluate"} and min(r["seconds"].values()) > 0
        assert sum(r["seconds"].values()) <= r["wall_seconds"]
        clients = r["clients"]
        assert sorted(c["client_id"] for c in clients) == list(range(5))
        assert all(c["status"] == "ok" for c in clients)
        total_n = sum(c["num_examples"] for c in clients)
        assert math.isclose(sum(c["aggregation_weight"] for c in clients), 1.0)
        for c in clients:  # DPFedAvg: w_i = N_i / sum N
            assert math.isclose(c["aggregation_weight"], c["num_examples"] / total_n, rel_tol=1e-9)
            assert c["epsilon_spent"] <= c["epsilon_budget"] * (1 + 1e-9)
            history = [(c["noise_multiplier"], c["sample_rate"], c["steps"])]
            assert math.isclose(c["epsilon_spent"], epsilon_of(history, c["delta"], "dpa-pld-replace-one"), rel_tol=1e-9)
            # the server's ledger (epsilon_spent) agrees with the client's own accountant and with Google's
            # dp_accounting for the Poisson sampling Opacus ran, under replace-one neighbours (record-neighbours'
            # default), composed by its own PLD accountant on a finer grid
            assert math.isclose(c["epsilon_spent"], c["client_epsilon_spent"], rel_tol=1e-9) and "epsilon_mismatch" not in c
            assert math.isclose(c["epsilon_spent"], _dp_accounting_replace_one(history, c["delta"]), rel_tol=0.01)
            assert c["epsilon_spent"] > DPAccountingRDP().epsilon(history, c["delta"])  # add/remove: less
            assert c["uplink_bytes"] > 4 * 6058  # dense float32 update of the digits CNN + framing
    last = {c["client_id"]: c for c in rounds[-1]["clients"]}
    first = {c["client_id"]: c for c in rounds[0]["clients"]}
    for cid, c in last.items():  # planned for 2 rounds: the full budget is spent at round 2, not before
        assert c["epsilon_spent"] > first[cid]["epsilon_spent"]
        assert c["epsilon_spent"] >= 0.99 * c["epsilon_budget"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["finished"] is True
    assert summary["final_accuracy"] == rounds[-1]["metrics"]["accuracy"]
    assert summary["total_uplink_bytes"] == sum(c["uplink_bytes"] for r in rounds for c in r["clients"])
    assert summary["max_epsilon_per_client"] == {str(k): v["epsilon_spent"] for k, v in sorted(last.items())}
