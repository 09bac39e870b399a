"""Robust PCA (strategies.rpca): recovery of planted low-rank + sparse matrices, blocks, weights, errors."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.rpca import column_noise_variances, inverse_variance_weights, row_blocks, rpca, thin_right_svd


def planted(p: int = 1500, n: int = 30, rank: int = 2, density: float = 0.05, seed: int = 0):
    rng = np.random.default_rng(seed)
    low = rng.normal(size=(p, rank)) @ rng.normal(size=(rank, n))
    sparse = np.zeros((p, n))
    mask = rng.random((p, n)) < density
    sparse[mask] = rng.normal(scale=10.0, size=int(mask.sum()))
    return low, sparse


@pytest.mark.parametrize("svd", ["gram", "qr"])
def test_recovers_planted_low_rank_plus_sparse(svd):
    low, sparse = planted()
    res = rpca(low + sparse, svd=svd)
    assert res.converged and res.relative_residual <= 1e-7
    assert np.linalg.norm(res.low_rank - low) / np.linalg.norm(low) < 1e-2
    assert np.linalg.norm(res.sparse - sparse) / np.linalg.norm(sparse) < 1e-2
    assert res.rank == 2


def test_torch_backend_and_float32_match_numpy():
    low, sparse = planted(p=800, n=20, seed=1)
    ref = rpca(low + sparse)
    t64 = rpca(low + sparse, backend="torch")
    f32 = rpca(low + sparse, dtype=np.float32, tol=1e-6)
    assert np.allclose(t64.sparse, ref.sparse, atol=1e-6)
    assert np.linalg.norm(f32.sparse - ref.sparse) / np.linalg.norm(ref.sparse) < 1e-3


def test_not_a_low_rank_plus_sparse_matrix_fails_recovery():
    """A dense full-rank perturbation is not recovered: the test above can fail."""
    low, _ = planted(p=600, n=20)
    dense = np.random.default_rng(3).normal(scale=3.0, size=low.shape)
    res = rpca(low + dense)
    assert np.linalg.norm(res.low_rank - low) / np.linalg.norm(low) > 0.05


def test_thin_svd_matches_numpy():
    x = np.random.default_rng(0).normal(size=(500, 7))
    for method in ("gram", "qr"):
        s, v = thin_right_svd(x, method)
        _, s_ref, vh = np.linalg.svd(x, full_matrices=False)
        assert np.allclose(s, s_ref)
        assert np.allclose(np.abs(v.T @ vh.T), np.eye(7), atol=1e-6)


def test_row_blocks_cover_all_rows():
    assert row_blocks(10, 0) == [(0, 10)]
    assert row_blocks(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert row_blocks(10, 20) == [(0, 10)]


def test_blocked_estimates_match_unblocked_weights():
    rng = np.random.default_rng(4)
    p, n = 20_000, 12
    sig = np.exp(rng.uniform(np.log(0.05), np.log(1.0), n))
    signal = rng.normal(scale=0.05, size=p)
    m = signal[:, None] * (1 + 0.1 * rng.normal(size=n)) + rng.normal(size=(p, n)) * sig
    full = inverse_variance_weights(column_noise_variances(m).sigma2)
    blocks = column_noise_variances(list(m.T), chunk_rows=5000)
    first = column_noise_variances(m, chunk_rows=5000, num_chunks=1)
    assert blocks.blocks == 4 and first.blocks == 1 and first.rows_per_block == 5000
    for est in (blocks, first):
        w = inverse_variance_weights(est.sigma2)
        assert np.max(np.abs(w - full) / full) < 0.05


def test_inverse_variance_weights():
    w = inverse_variance_weights(np.array([1.0, 2.0, 4.0]))
    assert np.allclose(w, np.array([4, 2, 1]) / 7)
    assert np.allclose(inverse_variance_weights(np.zeros(3)), 1 / 3)
    assert inverse_variance_weights(np.array([0.0, 1.0]))[0] > 0.999
    with pytest.raises(ValueError, match="finite"):
        inverse_variance_weights(np.array([1.0, np.nan]))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="NaN"):
        rpca(np.array([[1.0, np.nan], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="2-d"):
        rpca(np.zeros(5))
    with pytest.raises(ValueError, match="svd"):
        rpca(np.ones((4, 2)), svd="lu")
    with pytest.raises(ValueError, match="backend"):
        rpca(np.ones((4, 2)), backend="jax")
    zero = rpca(np.zeros((6, 3)))
    assert zero.converged and not zero.sparse.any()


def _heterogeneous_updates(p: int = 6000, n: int = 20, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sigma2 = np.exp(rng.uniform(0.0, np.log(100.0), n))
    g = rng.normal(size=p)
    g *= 5.0 / np.linalg.norm(g)
    cols = [g * (1 + 0.1 * rng.normal()) + rng.normal(scale=np.sqrt(s / p), size=p) for s in sigma2]
    return np.stack(cols, axis=1), sigma2


def test_run_config_default_solver_gives_the_pcp_optimum_weights():
    """Robust-HDP's defaults (float32, rpca-tol) stay within 1 % of the weights of a slow-μ (ρ = 1.01), tol 1e-10
    float64 solve, which reaches the PCP optimum (not the same solver at a tighter tolerance: a fast μ growth
    stops early at a non-optimal point however small tol is)."""
    from fedapp.apps.factories import rpca_options
    from fedapp.config import resolve_config

    m, _ = _heterogeneous_updates()
    opts = rpca_options(resolve_config().robust_hdp)
    assert opts["dtype"] == np.float32
    optimum = inverse_variance_weights(column_noise_variances(m, tol=1e-10, max_iter=5000, rho=1.01).sigma2)
    fast = column_noise_variances(m, **opts)
    assert fast.converged
    w = inverse_variance_weights(fast.sigma2)
    assert np.max(np.abs(w - optimum) / optimum) < 1e-2
    # the check can fail: the former default rho = 1.5 converged to tol 1e-7 at weights 33 % away
    rushed = inverse_variance_weights(column_noise_variances(m, **{**opts, "rho": 1.5}).sigma2)
    assert np.max(np.abs(rushed - optimum) / optimum) > 0.1
