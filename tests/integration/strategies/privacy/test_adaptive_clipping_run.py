"""Adaptive clipping (Andrew et al. 2021) in a real Flower simulation of dp-fedavg without SecAgg+."""

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
