"""Adaptive clipping (Andrew et al. 2021) in real Flower simulations of Fed-SMP (rand-k, under SecAgg+) and of the
DP2-FedSAM family (dp2-fedsam without SecAgg+, centaur under it): C_t moves as the recorded b̄ says, every client
clips at it, and each round is charged at the run's z."""

from __future__ import annotations

import json
import math

import pytest
from dp_accounting import dp_event, rdp

from strategies.privacy.adaptive_clipping import update_noise_multiplier

# z tiny: the noise z_Δ C_t/r on the mean must not wreck the model, or later updates outgrow any clip
Z, SIGMA_B, C0, GAMMA, ETA, N = 0.005, 0.25, 10.0, 0.5, 0.5, 4
COMMON = {"num-server-rounds": 3, "privacy-dist": "fixed", "batch-size": 16, "max-samples": 400,
          "fraction-evaluate": 0.0, "noise-multiplier": Z, "clip-norm": C0, "adaptive-clip-quantile": GAMMA,
          "adaptive-clip-lr": ETA, "adaptive-clip-count-noise": SIGMA_B, "seeded-noise": True, "num-clients": N}
SECURE = {"secure-aggregation": True, "secagg-mechanism": "gaussian"}


def check_clip_path(rounds: list[dict], secure: bool) -> None:
    """C_t follows b̄ round by round (all norms ≪ C_0: b̄ ≈ 1 > γ, so it shrinks), every client clipped at it, and
    ε is what dp_accounting gives for the update (z_Δ) and count (2σ_b, sensitivity ½) Gaussians composed."""
    assert [r["round"] for r in rounds] == [1, 2, 3]
    clip, z_delta, acc = C0, update_noise_multiplier(Z, SIGMA_B), rdp.RdpAccountant()
    per = 1.0 if secure else math.sqrt(N)  # the sum's multiplier under SecAgg+, one update's without
    for r in rounds:
        m = r["metrics"]
        assert m["clients_ok"] == N and m["secure_aggregation"] is secure
        assert m["clip_norm"] == pytest.approx(clip)
        assert all(c["clip_norm"] == pytest.approx(clip) for c in r["clients"] if c["status"] == "ok")
        assert abs(m["unclipped_fraction"] - 1.0) < 5 * SIGMA_B / N
        nxt = clip * math.exp(-ETA * (m["unclipped_fraction"] - GAMMA))
        assert m["next_clip_norm"] == pytest.approx(nxt) and nxt < clip
        clip = nxt
        assert m["noise_multiplier"] == Z and m["update_noise_multiplier"] == pytest.approx(z_delta)
        acc.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z_delta / per),
                                              dp_event.GaussianDpEvent(2 * SIGMA_B / per)]))
        assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-6)
        if secure:
            assert m["count_sum_clients"] == N and m["noise_multiplier_effective"] == pytest.approx(Z)
            assert not any("unclipped_share" in json.dumps(c) for c in r["clients"])  # no bit in the records
    assert rounds[-1]["metrics"]["next_clip_norm"] < 0.9 * C0


@pytest.mark.slow
def test_fed_smp_randk_under_secagg_moves_the_clip_with_the_summed_bits(tmp_path):
    from conftest import read_rounds, run_small_simulation

    run = run_small_simulation({**COMMON, **SECURE, "strategy": "fed-smp-randk", "compression-ratio": 0.1,
                                "local-steps": 2, "output-dir": str(tmp_path)}, num_supernodes=N)
    rounds = read_rounds(run)
    check_clip_path(rounds, secure=True)
    k = rounds[0]["metrics"]["k"]
    meta = json.loads((run / "config.json").read_text())
    assert k < meta["num_parameters"] and meta["privacy_plan"]["mechanism"]["payload_dim"] == k + 1


@pytest.mark.slow
def test_dp2_fedsam_moves_the_clip_with_the_shared_parts_bits(tmp_path):
    from conftest import read_rounds, run_small_simulation

    run = run_small_simulation({**COMMON, "strategy": "dp2-fedsam", "secure-aggregation": False,
                                "output-dir": str(tmp_path)}, num_supernodes=N)
    check_clip_path(read_rounds(run), secure=False)


@pytest.mark.slow
def test_centaur_under_secagg_moves_the_clip_with_the_summed_bits(tmp_path):
    from conftest import read_rounds, run_small_simulation

    run = run_small_simulation({**COMMON, **SECURE, "strategy": "centaur", "output-dir": str(tmp_path)},
                               num_supernodes=N)
    check_clip_path(read_rounds(run), secure=True)
    meta = json.loads((run / "config.json").read_text())
    n_phi = meta["num_parameters"] - (64 * 10 + 10)  # the head (last linear layer) never leaves the clients
    assert meta["privacy_plan"]["mechanism"]["payload_dim"] == n_phi + 1
