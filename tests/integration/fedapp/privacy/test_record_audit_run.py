"""The record-level privacy audit in real runs: canary records in the clients' data go through DP-SGD and SoteriaFL's
mechanisms like every record; the summary's audit block sets the one-run lower bound (and the loss-drop estimate)
beside the largest ε of the clients holding them; a DP-SGD whose noise is cut a hundredfold (a test-only switch, the
ledger unaware) is caught: its lower bound lies above that ε."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedapp.experiments.notebook_utils import run_federation
from fedapp.privacy.audit import STATISTICS_FILE
from strategies.privacy.audit import audit_scores

SLOTS = 400
#: 4 clients of digits (≈ 360 records each, plus 100 canaries), ε = 1 each; local training strong enough that a
#: mechanism without noise memorizes its canaries within 10 rounds
BASE = {"model": "mlp-digits", "audit-canaries": SLOTS, "target-epsilon": 1.0, "fraction-evaluate": 0.0,
        "clip-norm": 1.0, "privacy-dist": "fixed", "seeded-noise": True, "local-epochs": 5, "lr": 1.0,
        "batch-size": 16}
CLIENTS = 4


def _audit(tmp: Path, monkeypatch, strategy: str, noise_scale: float | None = None, **extra) -> tuple[dict, dict]:
    if noise_scale is not None:
        monkeypatch.setenv("DPFL_TEST_NOISE_SCALE", str(noise_scale))
    run = run_federation({**BASE, "strategy": strategy, "output-dir": str(tmp), **extra}, num_clients=CLIENTS)
    return json.loads((run / "summary.json").read_text()), json.loads((run / STATISTICS_FILE).read_text())


#: one strategy of each record-level family and each of its mechanisms' shapes (DP-SGD with its weightings,
#: SoteriaFL's estimators with and without compression)
HONEST = ["dpsgd-fedavg", "robust-hdp", "min-eps", "soteriafl-sgd", "soteriafl-svrg", "ldp-sgd"]


@pytest.mark.parametrize("strategy", HONEST)
def test_no_honest_familys_lower_bound_exceeds_its_accountant(tmp_path, monkeypatch, strategy) -> None:
    """Declared before the runs: for each of the 6 strategies the bound recomputed from the raw scores at confidence
    1 − 0.05/6 (Bonferroni) must not exceed the largest ε of the clients holding canaries."""
    summary, statistics = _audit(tmp_path, monkeypatch, strategy, **{"num-server-rounds": 4})
    audit = summary["audit"]
    accountant = audit["epsilon_accountant"]
    assert audit["level"] == "record" and audit["canaries"] == SLOTS and accountant and accountant > 0
    assert accountant == pytest.approx(max(summary["max_epsilon_per_client"].values()))
    bound = audit_scores(statistics["scores"], statistics["coins"], audit["delta"])
    assert bound["epsilon_lower_bound"] == audit["final_model"]["epsilon_lower_bound"]  # the file holds the inputs
    strict = audit_scores(statistics["scores"], statistics["coins"], audit["delta"], 1 - 0.05 / len(HONEST))
    assert strict["epsilon_lower_bound"] <= accountant, (strict, accountant)
    assert sorted(int(k) for k in summary["max_epsilon_per_client"]) == list(range(CLIENTS))


def test_dp_sgd_with_a_hundredth_of_its_noise_is_caught(tmp_path, monkeypatch) -> None:
    honest, _ = _audit(tmp_path / "honest", monkeypatch, "dpsgd-fedavg", **{"num-server-rounds": 10})
    broken, _ = _audit(tmp_path / "broken", monkeypatch, "dpsgd-fedavg", noise_scale=0.01, **{"num-server-rounds": 10})
    accountant = broken["audit"]["epsilon_accountant"]
    assert accountant == pytest.approx(honest["audit"]["epsilon_accountant"])  # the ledger cannot see the fault
    assert broken["audit"]["final_model"]["epsilon_lower_bound"] > accountant
    assert broken["audit"]["final_model"]["epsilon_interval"][0] > accountant
    assert honest["audit"]["final_model"]["epsilon_lower_bound"] <= accountant
