"""strategies.privacy.adaptive_clipping: quantile-tracking clip norm (Andrew et al. 2021) and its noise split."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import lognorm

from strategies.privacy import adaptive_clipping as ac


def test_config_validates_every_field_and_names_the_value():
    good = {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_std": 5.0, "initial_clip": 1.0}
    ac.AdaptiveClipConfig(**good)
    for field, bad in [("target_quantile", 0.0), ("target_quantile", 1.0), ("learning_rate", 0.0),
                       ("count_noise_std", -1.0), ("initial_clip", math.inf), ("learning_rate", math.nan)]:
        with pytest.raises(ValueError, match=f"{field} .*got {bad}"):
            ac.AdaptiveClipConfig(**{**good, field: bad})


def test_noisy_fraction_and_geometric_update():
    bits = ac.unclipped_bits(np.array([0.5, 1.0, 1.5, 2.0]), clip=1.0)
    assert bits.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert ac.noisy_unclipped_fraction(bits, 4, 0.0) == pytest.approx(0.5)
    assert ac.noisy_unclipped_fraction(bits, 4, 1.0) == pytest.approx(0.75)  # noise 1 on the count of 4
    # with r ≠ the number of replies the centred sum is what is normalised: (Σ(b − ½) + n)/r + ½
    assert ac.noisy_unclipped_fraction(bits, 8, 0.0) == pytest.approx(0.5)
    assert ac.noisy_unclipped_fraction(np.ones(3), 4, 0.0) == pytest.approx(1.5 / 4 + 0.5)
    assert ac.geometric_clip_update(2.0, 0.3, 0.3, 0.5) == 2.0
    assert ac.geometric_clip_update(2.0, 0.9, 0.5, 0.5) == pytest.approx(2.0 * math.exp(-0.2))
    assert ac.geometric_clip_update(2.0, 0.1, 0.5, 0.5) == pytest.approx(2.0 * math.exp(0.2))


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_noise_free_clip_converges_to_the_empirical_quantile(gamma):
    norms = np.random.default_rng(0).lognormal(0.0, 1.0, 200)
    clip = 0.05
    for _ in range(300):
        frac = ac.noisy_unclipped_fraction(ac.unclipped_bits(norms, clip), norms.size, 0.0)
        clip = ac.geometric_clip_update(clip, frac, gamma, 0.2)
    assert abs(float(np.mean(norms <= clip)) - gamma) <= 0.02


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_private_clip_tracks_the_quantile_of_the_norm_distribution(gamma):
    rng = np.random.default_rng(1)
    r = 200
    clipper = ac.AdaptiveClip(ac.AdaptiveClipConfig(gamma, 0.2, count_noise_std=2.0, initial_clip=20.0))
    trace = [clipper.step(rng.lognormal(0.0, 1.0, r), r, rng) for _ in range(400)]
    assert trace[-1] == clipper.clip
    reached = math.exp(float(np.mean(np.log(trace[-150:]))))
    assert abs(float(lognorm.cdf(reached, s=1.0)) - gamma) <= 0.02


def test_noise_split_is_one_gaussian_mechanism_with_the_total_multiplier():
    for z, sigma_b in [(1.0, 5.0), (0.8, 0.41), (3.0, 100.0)]:
        z_delta = ac.update_noise_multiplier(z, sigma_b)
        # the pair (update sum: sensitivity 1, std z_Δ; centred count: sensitivity ½, std σ_b) whitened is a
        # Gaussian mechanism with sensitivity √(z_Δ⁻² + (½/σ_b)²), which must be 1/z
        assert math.hypot(1 / z_delta, 0.5 / sigma_b) == pytest.approx(1 / z)
        assert z_delta > z
    assert ac.update_noise_multiplier(1.0, 1e6) == pytest.approx(1.0, rel=1e-9)


def test_noise_split_refuses_a_count_noise_that_spends_the_budget():
    for sigma_b in (0.5, 0.3):
        with pytest.raises(ValueError, match=f"count_noise_std {sigma_b} must exceed noise_multiplier/2 = 0.5"):
            ac.update_noise_multiplier(1.0, sigma_b)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number > 0, got 0.0"):
        ac.update_noise_multiplier(0.0, 1.0)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="clip must be a finite number > 0, got 0.0"):
        ac.unclipped_bits(np.ones(2), 0.0)
    with pytest.raises(ValueError, match="norms must be"):
        ac.unclipped_bits(np.array([1.0, math.nan]), 1.0)
    with pytest.raises(ValueError, match="expected_clients must be a finite number > 0, got 0"):
        ac.noisy_unclipped_fraction(np.ones(2), 0, 0.0)
    with pytest.raises(ValueError, match="bits must be"):
        ac.noisy_unclipped_fraction(np.array([0.5]), 1, 0.0)
    with pytest.raises(ValueError, match="fraction must be finite, got nan"):
        ac.geometric_clip_update(1.0, math.nan, 0.5, 0.1)
