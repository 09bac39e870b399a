"""Flower SecAgg+ for client-level DP: the secure sum equals the plain sum, dropouts are accounted, bytes measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedapp.state.checkpoint import load_checkpoint
from strategies.privacy.accountants import DPAccountingRDP
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian

# secure runs name their shares' mechanism (``GAUSSIAN``: continuous, through Flower's quantizer); the distributed
# discrete Gaussian has its own tests in test_ddg_secure_sum.py
BASE = {"num-server-rounds": 2, "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2, "clip-norm": 1.0,
        "noise-multiplier": 1.0, "fraction-evaluate": 0.0, "seeded-noise": True, "max-samples": 400}
GAUSSIAN = {"secure-aggregation": True, "secagg-mechanism": "gaussian"}


def simulate(tmp: Path, overrides: dict, num_supernodes: int = 4) -> Path:
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    ov = {**BASE, **overrides, "output-dir": str(tmp)}
    run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=num_supernodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    (run,) = [p for p in tmp.iterdir() if not p.name.startswith(".")]
    return run


def rounds_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_secure_sum_equals_the_plain_sum_within_quantization(tmp_path: Path) -> None:
    """Same seeds, full participation: the SecAgg+ model equals the plain one up to quantization error,
    which is negligible next to the DP noise σC = 1 (measured: a few 1e-6)."""
    secure = simulate(tmp_path / "secagg", {"strategy": "fed-smp-randk", "compression-ratio": 0.1, **GAUSSIAN})
    plain = simulate(tmp_path / "plain", {"strategy": "fed-smp-randk", "compression-ratio": 0.1,
                                          "secure-aggregation": False})
    a, b = load_checkpoint(secure)["state"]["weights"], load_checkpoint(plain)["state"]["weights"]
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    assert 0 < diff < 1e-4 * 1.0  # relative to σ·C = 1
    moved = max(float(np.max(np.abs(x))) for x in a)
    assert moved > 1e-2  # the model did move: the comparison is not between two untouched models
    meta = json.loads((secure / "config.json").read_text())
    assert meta["privacy"]["secure_aggregation"].startswith("SecAgg+")
    for rec in rounds_of(secure):
        ok = [c for c in rec["clients"] if c["status"] == "ok"]
        assert len(ok) == 4 and rec["metrics"]["secure_aggregation"] is True
        k = rec["metrics"]["k"]
        # what a client sends: k masked values as int64 plus the protocol's keys and encrypted shares
        assert all(8 * k < c["uplink_bytes"] < 8 * k + 4000 for c in ok), [c["uplink_bytes"] for c in ok]
    for rec in rounds_of(plain):
        assert all(c["uplink_bytes"] < 4 * rec["metrics"]["k"] + 256 for c in rec["clients"])


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["gaussian", "ddg"])
def test_a_dropout_is_survived_and_the_noise_left_in_the_sum_is_accounted(tmp_path: Path, mechanism: str) -> None:
    # the budget is planned for 4 rounds at σ: two rounds at σ·√(3/4) fit in it (with T = 2 they would not, and
    # the server would sample nobody in round 2: tested in test_fed_smp)
    run = simulate(tmp_path, {"strategy": "dp-fedavg", "fault-fraction": 0.25, "fault-mode": "raise",
                              "secure-aggregation": True, "dp-rounds": 4, "secagg-mechanism": mechanism,
                              "num-clients": 4})
    rounds = rounds_of(run)
    expected_z = 1.0 * math.sqrt(3 / 4)
    if mechanism == "ddg":  # 3 of 4 discrete shares: the Gaussian equivalent of the mechanism the plan built
        plan = json.loads((run / "config.json").read_text())["privacy_plan"]["mechanism"]
        ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=plan["noise_multiplier"], max_cohort=4,
                                          dim=plan["payload_dim"], bits=plan["field_bits"])
        expected_z = ddg.gaussian_equivalent(3, 4)
        assert expected_z == pytest.approx(math.sqrt(3 / 4), rel=1e-3)  # 20 bits: nearly the continuous Gaussian
    history = []
    for rec in rounds:
        m = rec["metrics"]
        assert m["clients_sampled"] == 4 and m["clients_ok"] == 3 and m["clients_failed"] == 1
        assert m["noise_multiplier_effective"] == pytest.approx(expected_z, rel=1e-9)
        history.append((m["noise_multiplier_effective"], m["sample_rate"], 1))
    expected = DPAccountingRDP().epsilon(history, rounds[-1]["metrics"]["delta"])
    assert rounds[-1]["metrics"]["epsilon"] == pytest.approx(expected, rel=0.01)  # σ·√(3/4) per round, not σ
    failed = [c for r in rounds for c in r["clients"] if c["status"] == "failed"]
    assert all("injected fault" in c["reason"] for c in failed)
    # against the server, which drew the sample and saw who replied: no amplification. Recomputed here with
    # dp_accounting directly, one Gaussian (q = 1) per round the client's update was inside the sum
    import dp_accounting

    for cid in {c["client_id"] for r in rounds for c in r["clients"]}:
        took_part = [r["metrics"]["noise_multiplier_effective"] for r in rounds for c in r["clients"]
                     if c["client_id"] == cid and c["status"] in ("ok", "withheld", "rejected")]
        stated = [c["epsilon_vs_server"] for r in rounds for c in r["clients"] if c["client_id"] == cid
                  and c.get("epsilon_vs_server") is not None]
        if not took_part:
            assert not stated
            continue
        acc = dp_accounting.rdp.RdpAccountant()
        for z in took_part:
            acc.compose(dp_accounting.GaussianDpEvent(z))
        assert stated[-1] == pytest.approx(acc.get_epsilon(rounds[-1]["metrics"]["delta"]), rel=0.01)
        assert stated[-1] >= rounds[-1]["metrics"]["epsilon"] * (1 - 1e-9)  # amplification only lowers the headline
    summary = json.loads((run / "summary.json").read_text())
    assert summary["max_epsilon_vs_server"] == max(c["epsilon_vs_server"] for r in rounds for c in r["clients"]
                                                   if c.get("epsilon_vs_server") is not None)
    if mechanism == "gaussian":  # the discrete Gaussian is not amplified: its release view is the server's
        assert summary["max_epsilon_vs_release"] == pytest.approx(rounds[-1]["metrics"]["epsilon"])
    else:
        assert summary["max_epsilon_vs_release"] == pytest.approx(summary["max_epsilon_vs_server"])


@pytest.mark.slow
def test_a_sum_the_budget_cannot_pay_for_is_never_reconstructed(tmp_path: Path) -> None:
    """Half the sampled clients drop out every round, so each sum carries σ/√2 instead of σ. The budget is planned
    for T = 3 rounds at σ (Σ 1/z² = 3): round 1 costs 2, and round 2's sum would bring it to 4 — the SecAgg+
    workflow asks the strategy before its unmask stage, which then never runs, and nothing is charged."""
    run = simulate(tmp_path, {"strategy": "dp-fedavg", "fault-fraction": 0.5, "fault-mode": "raise",
                              "num-server-rounds": 3, **GAUSSIAN}, num_supernodes=6)  # 3 survivors: unmasked
    rounds = rounds_of(run)
    first, later = rounds[0], rounds[1:]
    assert first["metrics"]["clients_ok"] == 3
    assert first["metrics"]["noise_multiplier_effective"] == pytest.approx(1.0 / math.sqrt(2))
    for rec in later:
        assert rec["metrics"].get("sum_reconstructed") is False and rec["metrics"]["round_withheld"]
        withheld = [c for c in rec["clients"] if c["status"] == "withheld"]
        assert len(withheld) == 3 and all("budget" in c["reason"] for c in withheld)
    spent = DPAccountingRDP().epsilon([(1.0 / math.sqrt(2), 1.0, 1)], first["metrics"]["delta"])
    assert rounds[-1]["metrics"]["epsilon"] == pytest.approx(spent, rel=0.01)  # round 1 only
    assert rounds[-1]["metrics"]["epsilon"] <= first["metrics"]["epsilon_budget"]
