"""strategies.privacy.matrix_mechanism: factorizations of the prefix-sum workload, sensitivity, streaming noise."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest

from strategies.privacy import matrix_mechanism as mm


def _factorizations(t: int) -> list[mm.Factorization]:
    out = [mm.identity_factorization(t), mm.tree_aggregation(t), mm.tree_aggregation(t, restart_every=5)]
    return out + [mm.banded_factorization(t, b) for b in (1, 2, 4) if b <= t]


def _patterns(t: int, k: int, sep: int) -> list[tuple[int, ...]]:
    return [p for size in range(1, k + 1) for p in itertools.combinations(range(t), size)
            if all(b - a >= sep for a, b in itertools.pairwise(p))]


def _brute_force_sens2(c: np.ndarray, k: int, sep: int) -> float:
    """max over patterns of ‖C u‖² with u the pattern's 0/1 vector, on |CᵀC| (exact when CᵀC >= 0)."""
    g = np.abs(c.T @ c)
    return max(float(g[np.ix_(p, p)].sum()) for p in _patterns(c.shape[1], k, sep))


@pytest.mark.parametrize("t", [1, 7, 12, 64])
def test_every_factorization_reproduces_the_prefix_sum_workload(t):
    a = mm.prefix_sum_workload(t)
    rng = np.random.default_rng(0)
    for f in _factorizations(t):
        assert np.max(np.abs(f.decoder @ f.encoder - a)) < 1e-9, f.name
        z = rng.standard_normal((f.encoder.shape[0], 3))
        assert np.allclose(np.cumsum(f.per_round_noise(z), axis=0), f.decoder @ z, atol=1e-9), f.name


def test_tree_sensitivity_matches_kairouz_et_al():
    # a leaf of a complete tree over 2^h rounds lies in h + 1 nodes
    for h in range(7):
        assert mm.sensitivity(mm.tree_aggregation(2**h).encoder) ** 2 == pytest.approx(h + 1)
    # restarts every L: one participation per tree; participations >= L apart fall in different trees
    tree = mm.tree_aggregation(64, restart_every=16)
    assert mm.sensitivity(tree.encoder) ** 2 == pytest.approx(5)
    assert mm.sensitivity(tree.encoder, participations=4, min_separation=16) ** 2 == pytest.approx(4 * 5)
    # every round: ‖C·1‖² = Σ_levels (T/2^ℓ)·(2^ℓ)² = T(2T − 1)
    for t in (8, 64):
        assert mm.sensitivity(mm.tree_aggregation(t).encoder, t, 1) ** 2 == pytest.approx(t * (2 * t - 1))


@pytest.mark.parametrize("t", [6, 9, 12])
def test_sensitivity_equals_brute_force_over_all_participation_patterns(t):
    cases = [(1, 1), (2, 1), (2, 3), (3, 2), (3, 4), (t, 1), (4, 3)]
    for f in [mm.tree_aggregation(t), mm.tree_aggregation(t, restart_every=4), mm.banded_factorization(t, 3)]:
        assert np.all(f.encoder.T @ f.encoder >= -1e-12), f.name  # the case where 0/1 patterns are exact
        for k, sep in cases:
            expected = _brute_force_sens2(f.encoder, k, sep)
            assert mm.sensitivity(f.encoder, k, sep) ** 2 == pytest.approx(expected, rel=1e-12), (f.name, k, sep)
            # the relaxation used past the enumeration limit never undercuts the exact value
            assert mm.sensitivity(f.encoder, k, sep, max_patterns=0) ** 2 >= expected * (1 - 1e-12), (f.name, k, sep)


def test_banded_sensitivity_is_exact_for_any_signs_when_separation_covers_the_band():
    t, b = 11, 3
    rng = np.random.default_rng(1)
    c = np.tril(rng.standard_normal((t, t))) * (np.abs(np.subtract.outer(np.arange(t), np.arange(t))) < b)
    for k in (2, 3, 4):
        expected = max(float(np.sum(np.sum(c[:, p] ** 2, axis=0))) for p in _patterns(t, k, b))
        assert mm.sensitivity(c, k, b) ** 2 == pytest.approx(expected, rel=1e-12)
        assert _brute_force_sens2(c, k, b) == pytest.approx(expected, rel=1e-12)  # orthogonal columns


def test_no_contribution_exceeds_the_sensitivity():
    t, d = 10, 4
    rng = np.random.default_rng(2)
    c = np.tril(rng.standard_normal((t, t)))  # mixed signs: the bound, not necessarily exact
    for k, sep in [(2, 1), (3, 2), (10, 1)]:
        sens = mm.sensitivity(c, k, sep)
        for p in _patterns(t, k, sep)[::7]:
            u = rng.standard_normal((len(p), d))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            assert np.linalg.norm(c[:, list(p)] @ u) <= sens + 1e-9


def test_pattern_sensitivity_of_a_known_pattern():
    tree = mm.tree_aggregation(16)
    assert mm.pattern_sensitivity(tree.encoder, [0]) == pytest.approx(mm.sensitivity(tree.encoder))
    ones = np.zeros(16)
    ones[[0, 5, 9]] = 1.0
    assert mm.pattern_sensitivity(tree.encoder, [9, 0, 5]) == pytest.approx(np.linalg.norm(tree.encoder @ ones))


def _stream(noise: mm.BandedNoise | mm.TreeNoise, rounds: int) -> np.ndarray:
    return np.stack([noise.next() for _ in range(rounds)])


def test_banded_stream_equals_the_dense_inverse():
    t, d, std, seed = 20, 3, 0.7, 11
    c = mm.optimal_banded_coefficients(t, 4)
    noise = mm.BandedNoise(c, d, std, np.random.default_rng(seed))
    out = _stream(noise, t)
    z = std * np.random.default_rng(seed).standard_normal((t, d))
    encoder = mm.toeplitz_encoder(c, t)
    assert np.allclose(out, np.linalg.solve(encoder, z), atol=1e-10)
    assert np.allclose(out, mm.from_encoder(encoder).per_round_noise(z), atol=1e-10)
    assert len(noise.state_dict()["memory"]) == 3  # b − 1 vectors
    # a general (non-Toeplitz) banded C, given row by row
    rng = np.random.default_rng(3)
    general = np.tril(rng.uniform(0.5, 1.5, (t, t))) * (np.subtract.outer(np.arange(t), np.arange(t)) < 3)
    band = np.array([[general[i, i - j] if i >= j else 0.0 for j in range(3)] for i in range(t)])
    out = _stream(mm.BandedNoise(band, d, std, np.random.default_rng(seed)), t)
    assert np.allclose(out, np.linalg.solve(general, z), atol=1e-10)


@pytest.mark.parametrize("restart", [None, 8, 5])
def test_tree_stream_equals_the_dense_online_estimate(restart):
    t, d, std, seed = 23, 2, 1.3, 5
    tree = mm.tree_aggregation(t, restart)
    noise = mm.TreeNoise(d, std, np.random.default_rng(seed), restart_every=restart)
    out = []
    for _ in range(t):
        out.append(noise.next())
        assert len(noise.state_dict()["memory"]) <= math.floor(math.log2(restart or t)) + 1
    z = std * np.random.default_rng(seed).standard_normal((tree.encoder.shape[0], d))
    assert np.allclose(np.stack(out), tree.per_round_noise(z), atol=1e-10)
    assert np.allclose(np.cumsum(out, axis=0), tree.decoder @ z, atol=1e-10)


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_a_resumed_stream_repeats_the_uninterrupted_noise(kind):
    def build(seed: int) -> mm.BandedNoise | mm.TreeNoise:
        rng = np.random.default_rng(seed)
        if kind == "banded":
            return mm.BandedNoise(mm.optimal_banded_coefficients(32, 5), 6, 0.5, rng)
        return mm.TreeNoise(6, 0.5, rng, restart_every=8)

    straight = _stream(build(42), 30)
    first = build(42)
    head = _stream(first, 13)
    saved = pickle.dumps(first.state_dict())
    resumed = build(999)  # a different seed: everything must come from the state
    resumed.load_state_dict(pickle.loads(saved))
    assert np.array_equal(np.vstack([head, _stream(resumed, 17)]), straight)
    with pytest.raises(ValueError, match="dim 7"):
        mm.TreeNoise(7, 0.5, np.random.default_rng(0)).load_state_dict(pickle.loads(saved))


def test_correlated_noise_beats_independent_noise_for_one_participation():
    t = 64
    errors = {}
    for f in [mm.identity_factorization(t), mm.tree_aggregation(t), mm.tree_aggregation(t, 16),
              *(mm.banded_factorization(t, b) for b in (2, 4, 8))]:
        errors[f.name] = mm.prefix_sum_rmse(f, mm.sensitivity(f.encoder))  # same multiplier: same ε
    assert errors["identity"] == pytest.approx(math.sqrt((t + 1) / 2))  # ‖A‖_F² = T(T+1)/2, sens 1
    for name, err in errors.items():
        if name != "identity":
            assert err < errors["identity"], name
    assert errors["banded-8"] < errors["banded-4"] < errors["banded-2"] < errors["tree"]


def test_rmse_matches_simulated_streaming_noise():
    t, d = 64, 4000
    tree = mm.tree_aggregation(t)
    sens = mm.sensitivity(tree.encoder)
    out = _stream(mm.TreeNoise(d, sens, np.random.default_rng(8)), t)  # z_eff = 1: std = sens
    empirical = math.sqrt(float(np.mean(np.cumsum(out, axis=0) ** 2)))
    assert empirical == pytest.approx(mm.prefix_sum_rmse(tree, sens), rel=0.03)


def test_full_participation_can_make_the_tree_worse_than_independent_noise():
    t = 64
    ident, tree = mm.identity_factorization(t), mm.tree_aggregation(t)
    id_err = mm.prefix_sum_rmse(ident, mm.sensitivity(ident.encoder, t, 1))
    assert mm.sensitivity(ident.encoder, t, 1) ** 2 == pytest.approx(t)
    assert mm.prefix_sum_rmse(tree, mm.sensitivity(tree.encoder, t, 1)) > id_err


def test_banded_coefficients_are_a_local_optimum_of_their_objective():
    t, b = 48, 5
    for objective in ("total", "max"):
        c = mm.optimal_banded_coefficients(t, b, objective)
        assert np.linalg.norm(c) == pytest.approx(1.0)

        def loss(coef: np.ndarray, objective: str = objective) -> float:
            dec = mm.from_encoder(mm.toeplitz_encoder(coef, t)).decoder
            rows = np.sum(dec**2, axis=1)
            return float(rows.sum() if objective == "total" else rows.max()) * float(coef @ coef)

        rng = np.random.default_rng(4)
        for _ in range(20):
            assert loss(c) <= loss(c + 1e-3 * rng.standard_normal(b)) * (1 + 1e-9)
    total, worst = mm.optimal_banded_coefficients(t, b, "total"), mm.optimal_banded_coefficients(t, b, "max")
    row_max = [np.max(np.sum(mm.from_encoder(mm.toeplitz_encoder(c, t)).decoder ** 2, axis=1)) for c in (total, worst)]
    assert row_max[1] <= row_max[0]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="rounds must be an integer >= 1, got 0"):
        mm.prefix_sum_workload(0)
    with pytest.raises(ValueError, match="restart_every must be an integer >= 1, got 0"):
        mm.tree_aggregation(8, 0)
    with pytest.raises(ValueError, match="bands must be <= rounds"):
        mm.optimal_banded_coefficients(4, 5)
    with pytest.raises(ValueError, match="'mean'"):
        mm.optimal_banded_coefficients(8, 2, "mean")
    with pytest.raises(ValueError, match="participations must be an integer >= 1, got 0"):
        mm.sensitivity(np.eye(3), 0)
    with pytest.raises(ValueError, match="min_separation must be an integer >= 1, got -1"):
        mm.sensitivity(np.eye(3), 2, -1)
    with pytest.raises(ValueError, match="lower-triangular"):
        mm.from_encoder(np.triu(np.ones((3, 3))))
    with pytest.raises(ValueError, match="reads a round after its release"):
        mm.Factorization("bad", np.ones((2, 2)), np.eye(2), np.arange(2))
    with pytest.raises(ValueError, match="nonzero diagonal"):
        mm.BandedNoise(np.array([0.0, 1.0]), 2, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="std must be a finite number >= 0, got -1.0"):
        mm.TreeNoise(2, -1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="round 2 was asked for"):
        noise = mm.BandedNoise(np.ones((2, 1)), 2, 1.0, np.random.default_rng(0))
        _stream(noise, 3)
    with pytest.raises(ValueError, match="rounds must lie in"):
        mm.pattern_sensitivity(np.eye(3), [3])
