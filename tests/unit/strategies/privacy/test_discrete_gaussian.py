"""The distributed discrete Gaussian mechanism: exact sampler, rotation, conditional rounding, the modular
round trip and its accountant (cross-checked with dp_accounting where the two coincide)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from strategies.privacy.discrete_gaussian import (
    ORDERS,
    DistributedDiscreteGaussian,
    conditional_round,
    ddg_rdp,
    discrete_gaussian,
    rdp_to_epsilon,
    rotate,
    rounded_norm_bound,
    unrotate,
)


@pytest.mark.parametrize("sigma", [0.8, 3.7, 40.0])
def test_the_sampler_has_the_discrete_gaussian_law(sigma: float) -> None:
    rng = np.random.default_rng(0)
    y = discrete_gaussian(sigma, 200_000, rng)
    support = np.arange(-int(12 * sigma) - 2, int(12 * sigma) + 3)
    pmf = np.exp(-support**2 / (2 * sigma**2))
    pmf /= pmf.sum()
    assert y.dtype == np.int64
    assert abs(y.mean()) < 4 * math.sqrt(float(pmf @ support**2) / len(y))
    assert y.var() == pytest.approx(float(pmf @ support**2), rel=0.02)  # the discrete law's variance
    freq = np.bincount(np.abs(y))[:3] / len(y)
    expected = [pmf[support == 0][0], 2 * pmf[support == 1][0], 2 * pmf[support == 2][0]]
    assert np.allclose(freq, expected, atol=0.005)


def test_rotation_is_orthonormal_and_invertible() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=1000)
    y = rotate(x, seed=7)
    assert len(y) == 1024 and np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    assert np.allclose(unrotate(y, 1000, seed=7), x)
    spike = np.zeros(1000)
    spike[3] = 5.0
    assert np.max(np.abs(rotate(spike, seed=7))) == pytest.approx(5.0 / 32)  # flattened: ‖x‖/√d per coordinate


def test_conditional_rounding_is_unbiased_and_meets_its_bound() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(scale=3.0, size=256)
    bound = rounded_norm_bound(float(np.linalg.norm(x)), 256, beta=math.exp(-0.5))
    draws = np.stack([conditional_round(x, bound, rng) for _ in range(400)])
    assert np.all(np.linalg.norm(draws, axis=1) <= bound)
    assert np.allclose(draws.mean(axis=0), x, atol=0.15)


def test_modular_sum_decodes_to_the_noisy_sum() -> None:
    rng = np.random.default_rng(3)
    n, dim, clip, sigma = 10, 700, 1.0, 0.05 * math.sqrt(10)
    ddg = DistributedDiscreteGaussian(clip=clip, noise_multiplier=sigma, max_cohort=n, dim=dim, bits=16)
    updates = [u * min(1.0, clip / np.linalg.norm(u)) for u in rng.normal(scale=0.05, size=(n, dim))]
    encoded = [ddg.encode(u, seed=11, rng=rng, round_clients=n) for u in updates]
    assert all(np.all((0 <= e) & (e < 2**16)) for e in encoded)
    modular_sum = np.mod(np.sum(encoded, axis=0), ddg.modulus)  # what SecAgg+ reconstructs
    decoded = ddg.decode(modular_sum, seed=11)
    error = decoded - np.sum(updates, axis=0)
    # the sum's noise C·σ plus rounding (variance ≤ γ²/4 per client; ≈ γ²/6 for uniform fractions), nothing wrapped
    assert np.std(error) == pytest.approx(math.sqrt((clip * sigma) ** 2 + n * ddg.granularity**2 / 6), rel=0.15)


def test_calibration_reaches_the_planned_gaussian_and_refuses_too_few_bits() -> None:
    for bits, target in [(12, 3.0), (16, 10.0), (20, 10.0)]:
        ddg = DistributedDiscreteGaussian.calibrated(target, clip=1.0, max_cohort=100, dim=28_938, bits=bits)
        assert ddg.gaussian_equivalent(100, 100) >= target
        slightly_less = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=ddg.noise_multiplier * 0.999,
                                                    max_cohort=100, dim=28_938, bits=bits)
        assert slightly_less.gaussian_equivalent(100, 100) < target  # the least such σ (to the tolerance)
        assert ddg.gaussian_equivalent(20, 20) >= target  # smaller cohorts: same a, smaller τ
    # more bits: finer γ, the equivalent closer to σ
    ratio = [DistributedDiscreteGaussian.calibrated(3.0, clip=1.0, max_cohort=100, dim=28_938, bits=b).noise_multiplier
             / 3.0 for b in (12, 16, 20)]
    assert ratio[0] > ratio[1] > ratio[2] > 1.0 and ratio[2] < 1.001
    with pytest.raises(ValueError, match="12 bits cannot carry noise multiplier 10.*13 bits would"):
        DistributedDiscreteGaussian.calibrated(10.0, clip=1.0, max_cohort=100, dim=28_938, bits=12)


def test_the_gaussian_equivalent_bounds_the_rdp_curve_at_every_order() -> None:
    ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=2.0, max_cohort=50, dim=3000, bits=12)
    for survivors, sampled in [(50, 50), (30, 50), (1, 50)]:
        z = ddg.gaussian_equivalent(survivors, sampled)
        alphas = np.asarray(ORDERS, dtype=np.float64)
        assert np.all(ddg.rdp(survivors, sampled) <= alphas / (2 * z**2) * (1 + 1e-12))


def test_the_accountant_equals_the_continuous_gaussian_when_tau_vanishes() -> None:
    """With τ = 0 Proposition 14's first term is the Gaussian's RDP α·Δ²/(2nσ²): dp_accounting must agree."""
    sens, std, n, d, rounds, delta = 40.0, 30.0, 20, 1024, 15, 1e-5
    ours = rdp_to_epsilon(rounds * ddg_rdp(sens, std, n, d, tau=0.0), delta)
    acc = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
    acc.compose(dp_accounting.GaussianDpEvent(math.sqrt(n) * std / sens), rounds)
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=0.01)


def test_the_discrete_sum_costs_more_than_the_continuous_one_and_tau_matters_only_for_tiny_noise() -> None:
    big = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=0.2 * math.sqrt(20), max_cohort=20, dim=5000, bits=20)
    small = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=0.2 * math.sqrt(20), max_cohort=20, dim=5000, bits=8)
    assert big.tau(20, 20) < 1e-12 and big.scaled_std(20) > small.scaled_std(20)
    continuous = rdp_to_epsilon(ddg_rdp(1.0 / big.granularity, big.scaled_std(20), 20, big.padded_dim, 0.0), 1e-5)
    assert rdp_to_epsilon(big.rdp(20, 20), 1e-5) >= continuous  # rounding inflates the sensitivity
    assert rdp_to_epsilon(small.rdp(20, 20), 1e-5) > rdp_to_epsilon(big.rdp(20, 20), 1e-5)  # fewer bits: coarser γ
