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
    assert len(y) == 1000 and np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12)  # no padding
    assert np.allclose(unrotate(y, seed=7), x, rtol=0, atol=1e-12)
    assert not np.allclose(unrotate(y, seed=8), x)  # the signs are the round's
    spike = np.zeros(1000)
    spike[3] = 5.0
    flat = rotate(spike, seed=7)  # flattened: ‖x‖/√d per coordinate on average, at most √2 times that
    assert np.sqrt(np.mean(flat**2)) == pytest.approx(5.0 / math.sqrt(1000))
    assert np.max(np.abs(flat)) <= 5.0 * math.sqrt(2 / 1000) * (1 + 1e-12)
    for d in (1, 2, 3, 16_634):  # orthogonal for every length
        v = rng.normal(size=d)
        assert np.linalg.norm(rotate(v, seed=3)) == pytest.approx(np.linalg.norm(v), rel=1e-12)
        assert np.allclose(unrotate(rotate(v, seed=3), seed=3), v, rtol=0, atol=1e-12)


def test_a_share_has_exactly_the_payloads_coordinates() -> None:
    """The DCT needs no power of two: a share of a 1,000- or 16,634-value payload has 1,000 or 16,634 residues (the
    Hadamard rotation padded them to 1,024 and 32,768), and the sum must have as many."""
    rng = np.random.default_rng(4)
    for dim in (1000, 16_634):
        ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=1.0, max_cohort=20, dim=dim, bits=16)
        u = rng.normal(size=dim)
        share = ddg.encode(u / np.linalg.norm(u), seed=5, rng=rng, round_clients=20)
        assert ddg.rotated_dim == dim and share.shape == (dim,)
        assert len(ddg.decode(share, seed=5)) == dim
        with pytest.raises(ValueError, match=f"the mechanism {dim}"):
            ddg.decode(np.zeros(1 << (dim - 1).bit_length(), dtype=np.int64), seed=5)


def test_decode_inverts_the_rotation_of_the_sum_exactly() -> None:
    """Without noise the server's decode is the exact inverse: γ·D·DCT-III of the wrapped sum of the clients' rounded
    rotated updates equals Σ updates plus γ times the unrotated sum of their rounding errors (float64, 1e-12 of C)."""
    rng = np.random.default_rng(6)
    n, dim, seed = 20, 3001, 9
    ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=1.0, max_cohort=n, dim=dim, bits=20)
    updates = [u / np.linalg.norm(u) * rng.uniform(0.1, 1.0) for u in rng.normal(size=(n, dim))]
    scaled = [rotate(u, seed) / ddg.granularity for u in updates]
    rounded = [conditional_round(x, ddg.l2_sensitivity, rng) for x in scaled]
    modular_sum = np.mod(np.sum([np.mod(r, ddg.modulus) for r in rounded], axis=0), ddg.modulus)
    decoded = ddg.decode(modular_sum, seed)
    rounding = ddg.granularity * unrotate(np.sum([r - x for r, x in zip(rounded, scaled)], axis=0), seed)
    assert np.max(np.abs(decoded - (np.sum(updates, axis=0) + rounding))) < 1e-12
    assert np.linalg.norm(decoded - np.sum(updates, axis=0)) <= ddg.granularity * n * math.sqrt(dim)


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
    continuous = rdp_to_epsilon(ddg_rdp(1.0 / big.granularity, big.scaled_std(20), 20, big.rotated_dim, 0.0), 1e-5)
    assert rdp_to_epsilon(big.rdp(20, 20), 1e-5) >= continuous  # rounding inflates the sensitivity
    assert rdp_to_epsilon(small.rdp(20, 20), 1e-5) > rdp_to_epsilon(big.rdp(20, 20), 1e-5)  # fewer bits: coarser γ


def _hadamard_wraps(updates: np.ndarray, sigma: float, bits: int, k_stds: float, rng: np.random.Generator) -> float:
    """The fraction of wrapped coordinates of the previous mechanism's sum: zero-padding to d = 2^k, the randomized
    Hadamard rotation H·D/√d and its granularity (ρ = 1 over the padded d), randomized rounding, discrete noise."""
    n, dim = updates.shape
    d = 1 << (dim - 1).bit_length()
    room = 4.0 ** (bits - 1) - k_stds**2 * n / 4
    gamma = math.sqrt(k_stds**2 * (n**2 / d + sigma**2) / room)  # clip 1
    signs = np.where(np.random.default_rng(17).random(d) < 0.5, -1.0, 1.0)
    total = np.zeros(d, dtype=np.int64)
    for u in updates:
        y = np.zeros(d)
        y[:dim] = u
        y *= signs
        h = 1
        while h < d:  # the Walsh–Hadamard butterflies
            y = y.reshape(-1, 2, h)
            y = np.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), axis=1).reshape(d)
            h *= 2
        scaled = y / math.sqrt(d) / gamma
        total += (np.floor(scaled) + (rng.random(d) < scaled - np.floor(scaled))).astype(np.int64)
        total += discrete_gaussian(sigma / (math.sqrt(n) * gamma), d, rng)
    return float(np.mean(np.abs(total + 0.5) > 2 ** (bits - 1)))


def _dct_wraps(updates: np.ndarray, sigma: float, bits: int, k_stds: float, rng: np.random.Generator) -> float:
    n, dim = updates.shape
    ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=sigma, max_cohort=n, dim=dim, bits=bits, k_stds=k_stds)
    total = np.zeros(dim, dtype=np.int64)
    for u in updates:
        total += conditional_round(rotate(u, seed=17) / ddg.granularity, ddg.l2_sensitivity, rng)
        total += discrete_gaussian(ddg.scaled_std(n), dim, rng)
    return float(np.mean(np.abs(total + 0.5) > 2 ** (bits - 1)))


@pytest.mark.parametrize("sigma", [2.5, 0.01])
@pytest.mark.parametrize("kind", ["random", "aligned", "spike", "comb"])
def test_the_dct_wraps_no_more_coordinates_than_the_padded_hadamard(kind: str, sigma: float) -> None:
    """Utility (privacy never depends on it): the fraction of the sum's coordinates that leave [−2^(b−1), 2^(b−1)) is
    no larger with the DCT (whose coordinates have variance proxy up to 2‖x‖²/d, counted by ROTATION_SPREAD in γ) than
    with the padded Hadamard rotation. k_stds = 2 (instead of 4) makes wraps common enough to count: with the noise
    dominating (σ = 2.5) both wrap ≈ 2Φ(−2) of the coordinates; with the signal dominating (σ = 0.01) and 20 clients
    sending the same update, the Hadamard wraps a few per cent and the DCT far fewer (measured: 4.4-4.7 % against
    4.1-4.4 % at σ = 2.5; 4.5-4.7 % against 0.5-0.6 % for aligned and comb updates at σ = 0.01). At the default
    k_stds = 4, 20 clients, 16 and 20 bits and d = 16,634 (Fed-SMP's payload of the 1.66 M CNN; Hadamard: 32,768),
    independent, aligned, spike and comb updates wrapped 3.6e-5 to 1.1e-4 of the coordinates with the DCT against
    4.9e-5 to 1.0e-4 with the Hadamard at σ = 2.5 (10 rounds each: ≈ 2Φ(−4) = 6.3e-5 for both), and none against
    0 to 6.1e-5 at σ = 0.01 (4 rounds)."""
    n, dim, bits, k_stds, rounds = 20, 3000, 16, 2.0, 4
    rng = np.random.default_rng({"random": 0, "aligned": 1, "spike": 2, "comb": 3}[kind])
    hadamard, dct = [], []
    for _ in range(rounds):
        if kind == "random":
            u = rng.normal(size=(n, dim))
        elif kind == "aligned":  # every client the same direction: the sum's norm is n·C
            u = np.repeat(rng.normal(size=(1, dim)), n, axis=0)
        else:  # one coordinate, or 64 evenly spaced ones, the same for every client
            u = np.zeros((n, dim))
            idx = [3] if kind == "spike" else list(range(0, dim, dim // 64))[:64]
            u[:, idx] = rng.choice([-1.0, 1.0], size=len(idx))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        hadamard.append(_hadamard_wraps(u, sigma, bits, k_stds, rng))
        dct.append(_dct_wraps(u, sigma, bits, k_stds, rng))
    h, c = float(np.mean(hadamard)), float(np.mean(dct))
    # 3 binomial standard deviations of the two estimates (n·dim·rounds coordinates each) as slack
    slack = 3 * math.sqrt(max(h, 1e-4) / (dim * rounds) + max(h, 1e-4) / (4096 * rounds))
    assert c <= h + slack, (kind, sigma, h, c)
