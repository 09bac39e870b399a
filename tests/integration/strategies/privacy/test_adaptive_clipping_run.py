"""Adaptive clipping (Andrew et al. 2021) in real Flower simulations of dp-fedavg, without and under SecAgg+."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event, rdp

from strategies.privacy.adaptive_clipping import update_noise_multiplier

# z tiny: the noise z_Δ C_t/r on the mean must not wreck the model, or later updates outgrow any clip
Z, SIGMA_B, C0, GAMMA, ETA, N = 0.005, 0.25, 10.0, 0.5, 0.5, 4


@pytest.mark.slow
def test_a_far_too_large_initial_clip_shrinks_every_round_at_the_fixed_clip_cost(tmp_path):
    from conftest import read_rounds, run_small_simulation

    run = run_small_simulation({
        "strategy": "dp-fedavg", "num-server-rounds": 3, "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2,
        "max-samples": 400, "fraction-evaluate": 0.0, "secure-aggregation": False, "noise-multiplier": Z,
        "clip-norm": C0, "adaptive-clip-quantile": GAMMA, "adaptive-clip-lr": ETA, "adaptive-clip-count-noise": SIGMA_B,
        "seeded-noise": True, "output-dir": str(tmp_path)}, num_supernodes=N)
    rounds = read_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    clip = C0
    z_delta = update_noise_multiplier(Z, SIGMA_B)
    acc = rdp.RdpAccountant()
    for r in rounds:
        m = r["metrics"]
        assert m["clients_ok"] == N and m["clip_norm"] == pytest.approx(clip)
        assert all(c["clip_norm"] == pytest.approx(clip) for c in r["clients"])  # every client clipped at C_t
        # every update norm is far below C_t, so the noisy fraction sits near 1 > γ and the clip shrinks
        assert m["unclipped_fraction"] > GAMMA
        nxt = clip * math.exp(-ETA * (m["unclipped_fraction"] - GAMMA))
        assert m["next_clip_norm"] == pytest.approx(nxt) and nxt < clip
        clip = nxt
        # ε against the server, recomputed with dp_accounting: each client showed it one update at z_Δ/√r and one
        # count share at 2σ_b/√r (sensitivity ½) per round, unamplified (q = 1)
        acc.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z_delta / math.sqrt(N)),
                                              dp_event.GaussianDpEvent(2 * SIGMA_B / math.sqrt(N))]))
        assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-6)
        assert m["noise_multiplier"] == Z and m["update_noise_multiplier"] == pytest.approx(z_delta)
    assert rounds[-1]["metrics"]["next_clip_norm"] < 0.9 * C0


@pytest.mark.slow
def test_under_secagg_the_clip_follows_the_securely_summed_bits_at_the_fixed_clip_cost(tmp_path):
    """SecAgg+ with continuous Gaussian shares: each client's noised bit is coordinate d+1 of its masked vector, so
    the server records only b̄ = Σ/r' + ½ of the sum; C_t moves as that b̄ says and each round is charged at z, as
    the same run with a fixed clip is."""
    import json

    from conftest import read_rounds, run_small_simulation

    base = {"strategy": "dp-fedavg", "num-server-rounds": 3, "privacy-dist": "fixed", "batch-size": 16,
            "local-steps": 2, "max-samples": 400, "fraction-evaluate": 0.0, "secure-aggregation": True,
            "secagg-mechanism": "gaussian", "noise-multiplier": Z, "clip-norm": C0, "seeded-noise": True,
            "num-clients": N}  # num-clients: config.json then holds the privacy plan
    adaptive = {**base, "adaptive-clip-quantile": GAMMA, "adaptive-clip-lr": ETA,
                "adaptive-clip-count-noise": SIGMA_B, "output-dir": str(tmp_path / "adaptive")}
    run = run_small_simulation(adaptive, num_supernodes=N)
    fixed = read_rounds(run_small_simulation({**base, "output-dir": str(tmp_path / "fixed")}, num_supernodes=N))
    rounds = read_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2, 3] and [r["round"] for r in fixed] == [1, 2, 3]
    clip = C0
    z_delta = update_noise_multiplier(Z, SIGMA_B)
    acc = rdp.RdpAccountant()
    for r, f in zip(rounds, fixed):
        m = r["metrics"]
        assert m["clients_ok"] == N and m["secure_aggregation"] is True and m["count_sum_clients"] == N
        assert m["clip_norm"] == pytest.approx(clip)
        assert all(c["clip_norm"] == pytest.approx(clip) for c in r["clients"])
        assert not any(METRIC in json.dumps(c) for c in r["clients"])  # no client's bit reaches the records
        # every update norm is far below C_t: all bits are 1, and the decoded b̄ is 1 up to the count noise (std
        # σ_b/r' on b̄ here); a wrong scale of the count coordinate would move it far off
        assert abs(m["unclipped_fraction"] - 1.0) < 5 * SIGMA_B / N
        nxt = clip * math.exp(-ETA * (m["unclipped_fraction"] - GAMMA))
        assert m["next_clip_norm"] == pytest.approx(nxt) and nxt < clip
        clip = nxt
        # charged at z like the fixed-clip run: the sum showed the server z_Δ (update) and 2σ_b (count, sensitivity
        # ½), which compose to z (Thm 1), unamplified
        assert m["noise_multiplier_effective"] == pytest.approx(Z) == f["metrics"]["noise_multiplier_effective"]
        assert m["epsilon"] == pytest.approx(f["metrics"]["epsilon"], rel=1e-9)
        acc.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z_delta), dp_event.GaussianDpEvent(2 * SIGMA_B)]))
        assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-6)
    assert rounds[-1]["metrics"]["next_clip_norm"] < 0.9 * C0
    meta = json.loads((run / "config.json").read_text())
    assert "NOT covered" in meta["privacy"]["adaptive_clipping"]
    assert meta["privacy_plan"]["mechanism"]["payload_dim"] == meta["num_parameters"] + 1


METRIC = "unclipped_share"
