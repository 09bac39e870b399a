"""Robust PCA by Principal Component Pursuit, inexact augmented Lagrangian (framework-free).

Solves  min ‖L‖_* + λ‖S‖_1  s.t.  M = L + S  (Candès et al. 2009, "PCP") with the inexact
ALM method of Lin, Chen & Ma (2010, Algorithm 5): alternate singular-value thresholding of
L, soft-thresholding of S and a dual ascent step, with μ growing geometrically (ρ). Default
λ = 1/√max(p, n); stop when ‖M − L − S‖_F ≤ tol·‖M‖_F or after ``max_iter`` iterations.

Built for the tall matrices of Robust-HDP (p model parameters × n clients, p ≫ n): the SVD
of a p × n matrix X is never formed; we only need its right singular vectors V and values s,
from the n × n Gram matrix XᵀX (``svd="gram"``, fastest) or from the R factor of a thin QR
(``svd="qr"``, more accurate), and then SVT(X) = X · V diag(max(s − τ, 0)/s) Vᵀ. No p × p
object exists. Memory: five p × n buffers (M, S, E, T, C).

:func:`column_noise_variances` returns the Robust-HDP noise estimates σ̂_i² = ‖S[:, i]‖²
(Algorithm 1, line 10), optionally on row blocks of p' rows (Section 3.6), each block's
estimate scaled by p / p'_b and the blocks averaged (``num_chunks = 1`` uses the first block
only, as the paper's CIFAR experiments do).

Backends: ``numpy`` (default) or ``torch`` (CPU or CUDA, ``device=``), same algorithm.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

SVD_METHODS = ("gram", "qr")
BACKENDS = ("numpy", "torch")


@dataclass
class RPCAResult:
    """Decomposition M ≈ L + S with solver diagnostics."""

    low_rank: np.ndarray | None  # L (None when not requested)
    sparse: np.ndarray  # S
    iterations: int
    converged: bool
    relative_residual: float  # ‖M − L − S‖_F / ‖M‖_F at exit
    rank: int  # number of singular values of L above the last threshold
    seconds: float


@dataclass
class NoiseEstimate:
    """Per-column noise variances σ̂_i² = ‖S[:, i]‖² (scaled to the full row count p)."""

    sigma2: np.ndarray
    iterations: int  # summed over blocks
    seconds: float
    blocks: int
    rows_per_block: int
    converged: bool


class _Ops:
    """The few array operations the solver needs, for numpy or torch."""

    def __init__(self, backend: str, device: str | None, dtype: Any) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown RPCA backend {backend!r}; valid: {list(BACKENDS)}")
        self.backend = backend
        self.dtype: Any  # torch.dtype for the torch backend, np.dtype for numpy
        if backend == "torch":
            import torch

            self.torch = torch
            self.device = torch.device(device or "cpu")
            self.dtype = {np.float32: torch.float32, np.float64: torch.float64}[np.dtype(dtype).type]
        else:
            if device not in (None, "cpu"):
                raise ValueError(f"the numpy RPCA backend runs on the CPU, got device={device!r}")
            self.dtype = np.dtype(dtype)
            from scipy.linalg import blas  # imported here, once, not in the iteration loop

            self.gemm = blas.sgemm if self.dtype == np.float32 else blas.dgemm

    def asarray(self, m: np.ndarray) -> Any:
        if self.backend == "torch":
            return self.torch.as_tensor(np.asarray(m), device=self.device).to(self.dtype)
        return np.asarray(m, dtype=self.dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        return a.detach().cpu().numpy().astype(np.float64) if self.backend == "torch" else np.asarray(a, np.float64)

    def empty_like(self, a: Any) -> Any:
        return self.torch.empty_like(a) if self.backend == "torch" else np.empty_like(a)

    def fro(self, a: Any) -> float:
        return float(self.torch.linalg.vector_norm(a)) if self.backend == "torch" else float(np.linalg.norm(a))

    def spectral(self, a: Any) -> float:
        s, _ = self.right_svd(a, "gram")
        return float(s.max()) if len(s) else 0.0

    def absmax(self, a: Any) -> float:
        return float(a.abs().max()) if self.backend == "torch" else float(np.abs(a).max())

    def right_svd(self, x: Any, method: str) -> tuple[np.ndarray, np.ndarray]:
        """Singular values s (descending) and right singular vectors V (n × n) of the tall ``x``."""
        if self.backend == "torch":
            t = self.torch
            xd = x.to(t.float64)
            if method == "qr":
                r = t.linalg.qr(xd, mode="r")[1]
                _, s, vh = t.linalg.svd(r)
                return s.cpu().numpy(), vh.T.cpu().numpy()
            evals, v = t.linalg.eigh(xd.T @ xd)
            evals, v = evals.cpu().numpy(), v.cpu().numpy()
        else:
            if method == "qr":
                # numpy's stub types every mode's result as QRResult; mode="r" returns the R array alone
                r = cast(np.ndarray, np.linalg.qr(x, mode="r"))
                _, s, vh = np.linalg.svd(r.astype(np.float64))
                return s, vh.T
            g = (x.T @ x).astype(np.float64)
            evals, v = np.linalg.eigh(g)
        order = np.argsort(evals)[::-1]
        return np.sqrt(np.maximum(evals[order], 0.0)), v[:, order]

    def gemm_accumulate(self, x: Any, w: np.ndarray, out: Any) -> None:
        """out ← out + x·w in one pass over ``out`` (BLAS gemm with β = 1; no p × n temporary)."""
        if self.backend == "torch":
            out.addmm_(x, self.torch.as_tensor(w, device=self.device, dtype=self.dtype))
            return
        # C-contiguous p × n arrays are Fortran-contiguous n × p: outᵀ ← wᵀ·xᵀ + outᵀ, in place.
        res = self.gemm(1.0, np.ascontiguousarray(w.T, dtype=self.dtype), x.T, beta=1.0, c=out.T, overwrite_c=1)
        if not np.shares_memory(res, out):  # pragma: no cover - only if the array is not contiguous
            out[...] = res.T

    def sub_into(self, x: Any, y: Any, out: Any) -> None:
        """out = x − y."""
        if self.backend == "torch":
            self.torch.sub(x, y, out=out)
        else:
            np.subtract(x, y, out=out)

    def scale_into(self, x: Any, alpha: float, out: Any) -> None:
        """out = alpha·x."""
        if self.backend == "torch":
            self.torch.mul(x, alpha, out=out)
        else:
            np.multiply(x, alpha, out=out)

    def clip_into(self, a: Any, tau: float, out: Any) -> None:
        if self.backend == "torch":
            self.torch.clamp(a, -tau, tau, out=out)
        else:
            np.clip(a, -tau, tau, out=out)


def _svt_matrix(s: np.ndarray, v: np.ndarray, tau: float) -> tuple[np.ndarray, int]:
    """W such that X·W = U·shrink_τ(Σ)·Vᵀ (singular value thresholding of X), and the rank kept."""
    keep = s > tau
    if not np.any(keep):
        return np.zeros((v.shape[0], v.shape[0])), 0
    factor = (s[keep] - tau) / s[keep]
    vk = v[:, keep]
    return (vk * factor) @ vk.T, int(keep.sum())


def rpca(m: np.ndarray, *, lam: float | None = None, tol: float = 1e-7, max_iter: int = 500, rho: float = 1.1,
         mu: float | None = None, svd: str = "gram", backend: str = "numpy", device: str | None = None,
         dtype: Any = np.float64, return_low_rank: bool = True) -> RPCAResult:
    """Principal Component Pursuit of ``m`` (p × n) by inexact ALM (Lin, Chen & Ma 2010, Alg. 5).

    Iteration (E = Y/μ, the scaled dual)::

        L ← SVT_{1/μ}(M − S + E);  S ← shrink_{λ/μ}(M − L + E);  Y ← Y + μ(M − L − S);  μ ← min(ρμ, μ̄)

    with Y₀ = M / max(‖M‖₂, ‖M‖_∞/λ), μ₀ = 1.25/‖M‖₂ (or ``mu``), μ̄ = 10⁷·μ₀.

    ρ = 1.1: a faster μ growth meets ``tol`` early at a point that is *not* the PCP optimum (ρ = 1.5 stopped
    0.2 % above the optimal objective with per-client weights 33 % off on tests/unit/strategies/test_rpca.py's matrix,
    the noisiest clients' variance under-recovered); ρ = 1.1 is within 0.4 % of a ρ = 1.01 solve in ~3× the
    iterations (docs/benchmarks/reference_comparison.md compares it with the paper's published solver).
    """
    if svd not in SVD_METHODS:
        raise ValueError(f"unknown svd method {svd!r}; valid: {list(SVD_METHODS)}")
    arr = np.asarray(m) if backend == "numpy" else m
    if getattr(arr, "ndim", 0) != 2 or min(arr.shape) < 1:
        raise ValueError(f"RPCA needs a non-empty 2-d matrix, got shape {getattr(arr, 'shape', None)}")
    if not tol > 0 or max_iter < 1 or not rho > 1:
        raise ValueError(f"need tol > 0, max_iter >= 1, rho > 1; got tol={tol}, max_iter={max_iter}, rho={rho}")
    start = time.perf_counter()
    ops = _Ops(backend, device, dtype)
    mm = ops.asarray(arr)
    p, n = mm.shape
    lam = 1.0 / math.sqrt(max(p, n)) if lam is None else float(lam)
    if not lam > 0:
        raise ValueError(f"lambda must be > 0, got {lam}")
    norm_m = ops.fro(mm)
    if not math.isfinite(norm_m):
        raise ValueError("RPCA input contains NaN or Inf")
    sparse = ops.empty_like(mm)
    sparse[...] = 0
    if norm_m == 0.0:
        low = ops.to_numpy(sparse) if return_low_rank else None
        return RPCAResult(low, ops.to_numpy(sparse), 0, True, 0.0, 0, time.perf_counter() - start)

    spec = ops.spectral(mm)
    mu_k = 1.25 / spec if mu is None else float(mu)
    mu_bar = mu_k * 1e7
    dual_scale = max(spec, ops.absmax(mm) / lam)
    # Buffers (four p × n besides M): S, E = Y/μ, T (iterate, then the residual Z) and C = clip(R, ±λ/μ).
    # One iteration is ~9 passes over p × n: T = M − S + E (2), Gram(T), R = S + T(I − W) in place of S
    # (one gemm with β = 1), C (clip), S = R − C, Z = C − E, ‖Z‖, E ← (μ/μ')·C.
    e = ops.empty_like(mm)
    ops.scale_into(mm, 1.0 / (dual_scale * mu_k), e)  # E₀ = Y₀/μ₀
    t = ops.empty_like(mm)
    c = ops.empty_like(mm)
    eye = np.eye(n)
    it, err, rank, converged = 0, math.inf, 0, False
    while it < max_iter:
        it += 1
        ops.sub_into(mm, sparse, t)
        t += e  # T = M − S + E
        s_vals, v = ops.right_svd(t, svd)
        w, rank = _svt_matrix(s_vals, v, 1.0 / mu_k)
        ops.gemm_accumulate(t, eye - w, sparse)  # R = S + T − SVT_{1/μ}(T) = M − L + E, in place of S
        ops.clip_into(sparse, lam / mu_k, c)
        sparse -= c  # S = shrink_{λ/μ}(R) = R − clip(R, ±λ/μ)
        ops.sub_into(c, e, t)  # Z = M − L − S = clip(R) − E
        err = ops.fro(t) / norm_m
        mu_next = min(rho * mu_k, mu_bar)
        ops.scale_into(c, mu_k / mu_next, e)  # E ← (Y + μZ)/μ' = (μ/μ')·clip(R)
        mu_k = mu_next
        if err <= tol:
            converged = True
            break
    low_np = None
    if return_low_rank:
        ops.sub_into(mm, sparse, c)
        c -= t  # L = M − S − Z exactly
        low_np = ops.to_numpy(c)
    return RPCAResult(low_np, ops.to_numpy(sparse), it, converged, float(err), rank, time.perf_counter() - start)


def row_blocks(p: int, rows: int) -> list[tuple[int, int]]:
    """Q = ⌊p/p'⌋ contiguous row blocks covering 0..p (the remainder joins the last block)."""
    if rows <= 0 or rows >= p:
        return [(0, p)]
    q = p // rows
    bounds = [(k * rows, (k + 1) * rows) for k in range(q)]
    bounds[-1] = (bounds[-1][0], p)
    return bounds


def column_noise_variances(m: np.ndarray | list[np.ndarray], *, chunk_rows: int = 0, num_chunks: int = 0,
                           **rpca_kwargs: Any) -> NoiseEstimate:
    """σ̂_i² = ‖S[:, i]‖² of the RPCA of ``m`` (Robust-HDP Alg. 1 line 10; Sec. 3.6 blocks).

    ``m`` is a p × n matrix or a list of n flat columns (blocks are then stacked lazily, so a
    p × n copy is only made for the rows used). ``chunk_rows`` = p' (0: one block of all p
    rows); ``num_chunks`` = how many blocks to use, from the top (0: all Q blocks). Each
    block's estimate is scaled by p / rows_b; the estimates are averaged.
    """
    columns = m if isinstance(m, list) else None
    if columns is not None:
        if not columns:
            raise ValueError("need at least one column")
        p = int(np.asarray(columns[0]).shape[0])
        if any(np.asarray(col).shape != (p,) for col in columns):
            raise ValueError("all columns must be flat vectors of the same length")
    else:
        m = np.asarray(m)
        if m.ndim != 2:
            raise ValueError(f"need a p × n matrix, got shape {m.shape}")
        p = m.shape[0]
    if chunk_rows < 0 or num_chunks < 0:
        raise ValueError(f"chunk_rows and num_chunks must be >= 0, got {chunk_rows}, {num_chunks}")
    blocks = row_blocks(p, chunk_rows)
    if num_chunks:
        blocks = blocks[:num_chunks]
    dtype = rpca_kwargs.get("dtype", np.float64)
    start = time.perf_counter()
    total: np.ndarray | None = None
    iters, converged = 0, True
    for lo, hi in blocks:
        if columns is not None:
            block = np.empty((hi - lo, len(columns)), dtype=dtype)
            for j, col in enumerate(columns):
                block[:, j] = col[lo:hi]
        else:
            block = np.asarray(m)[lo:hi]  # m is already an array here: no copy
        res = rpca(block, return_low_rank=False, **rpca_kwargs)
        est = np.sum(res.sparse**2, axis=0) * (p / (hi - lo))
        total = est if total is None else total + est
        iters += res.iterations
        converged = converged and res.converged
    if total is None:  # row_blocks always returns at least one block
        raise ValueError("no row block to estimate the noise variances on")
    sigma2 = total / len(blocks)
    return NoiseEstimate(sigma2, iters, time.perf_counter() - start, len(blocks), blocks[0][1] - blocks[0][0],
                         converged)


def inverse_variance_weights(sigma2: np.ndarray, floor: float = 1e-12) -> npt.NDArray[np.float64]:
    """w_i ∝ 1/σ_i² normalized (Eq. 8's optimum). σ² ≤ floor·max σ² is raised to that floor."""
    s = np.asarray(sigma2, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0 or not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError(f"noise variances must be a non-empty vector of finite values >= 0, got {s}")
    top = float(s.max())
    if top == 0.0:
        return np.full(len(s), 1.0 / len(s))
    inv = 1.0 / np.maximum(s, floor * top)
    weights: npt.NDArray[np.float64] = inv / inv.sum()
    return weights


def thin_right_svd(x: np.ndarray, method: str = "gram") -> tuple[np.ndarray, np.ndarray]:
    """Singular values (descending) and right singular vectors of a tall p × n matrix, via n × n work."""
    if method not in SVD_METHODS:
        raise ValueError(f"unknown svd method {method!r}; valid: {list(SVD_METHODS)}")
    return _Ops("numpy", None, np.float64).right_svd(np.asarray(x, dtype=np.float64), method)
