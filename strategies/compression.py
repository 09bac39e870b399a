"""Sparsification shared by Fed-SMP and SoteriaFL: random-k and top-k masks and their wire format.

* rand-k (SoteriaFL Example 1; Fed-SMP Alg. 2 SelectRandk): k distinct coordinates drawn uniformly
  from a seed, so only the seed (not the index list) needs to travel. Scaled by d/k it is unbiased
  with variance parameter ω = d/k − 1.
* top-k (Fed-SMP Alg. 2 SelectTopk): the k largest |scores|.

A mask is a strictly ascending int64 index array; a sparse payload is the k kept values in mask
order as one float32 array (≈ 4k bytes), the receiver knowing the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def num_kept(num_params: int, ratio: float) -> int:
    """k = round(p·d), at least 1 and at most d."""
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio p must be in (0, 1], got {ratio}")
    return int(min(num_params, max(1, round(ratio * num_params))))


def _check_k(num_params: int, k: int) -> None:
    if not 1 <= k <= num_params:
        raise ValueError(f"k = {k} must be in 1..d = {num_params}")


def rand_k_indices(num_params: int, k: int, seed: int) -> np.ndarray:
    """k distinct coordinates of [d] drawn uniformly from ``seed``, ascending (the receiver redraws them)."""
    _check_k(num_params, k)
    rng = np.random.default_rng(int(seed))
    return np.sort(rng.choice(num_params, size=k, replace=False)).astype(np.int64)


def rand_k_omega(num_params: int, k: int) -> float:
    """ω = d/k − 1 of random-k sparsification with scaling d/k (SoteriaFL Example 1)."""
    _check_k(num_params, k)
    return num_params / k - 1.0


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The k coordinates with the largest |scores|, ascending; ties broken towards the lower index."""
    scores = np.abs(np.asarray(scores, dtype=np.float64).ravel())
    _check_k(scores.size, k)
    if k == scores.size:
        return np.arange(k, dtype=np.int64)
    order = np.lexsort((np.arange(scores.size), -scores))
    return np.sort(order[:k]).astype(np.int64)


def check_indices(indices: np.ndarray, num_params: int) -> np.ndarray:
    """Validate a received mask: a non-empty 1-d integer array, strictly ascending, inside [0, d)."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
        raise ValueError(f"mask must be a non-empty 1-d integer array, got shape {idx.shape} dtype {idx.dtype}")
    if idx[0] < 0 or idx[-1] >= num_params or (idx.size > 1 and np.any(np.diff(idx) <= 0)):
        raise ValueError(f"mask indices must be strictly ascending in [0, {num_params})")
    return idx.astype(np.int64)


def scatter(values: np.ndarray, indices: np.ndarray, num_params: int) -> np.ndarray:
    """The dense float64 vector with ``values`` on ``indices`` and zeros elsewhere."""
    dense = np.zeros(num_params, dtype=np.float64)
    dense[indices] = np.asarray(values, dtype=np.float64)
    return dense


def rand_k_compress(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The k wire values (d/k)·x[mask] of C(x) = (d/k)(ξ_k ⊙ x), float32."""
    d = x.shape[0]
    values: np.ndarray = ((d / k) * x[rand_k_indices(d, k, seed)]).astype(np.float32)
    return values


def rand_k_decompress(values: np.ndarray, num_params: int, seed: int) -> np.ndarray:
    """Dense C(x) ∈ R^d from the wire values of :func:`rand_k_compress` and the mask seed."""
    return scatter(values, rand_k_indices(num_params, len(values), seed), num_params)


def encode_sparse(values: np.ndarray) -> list[np.ndarray]:
    """Wire payload: one float32 array of the k values in mask order."""
    return [np.ascontiguousarray(values, dtype=np.float32).ravel()]


def decode_sparse(arrays: Sequence[np.ndarray], indices: np.ndarray, num_params: int) -> np.ndarray:
    """Inverse of :func:`encode_sparse` given the mask: the dense float64 update; raises ``ValueError``."""
    if len(arrays) != 1:
        raise ValueError(f"sparse payload must be exactly 1 array, got {len(arrays)}")
    values = np.asarray(arrays[0])
    if values.dtype.name not in ("float32", "float64"):
        raise ValueError(f"sparse payload has dtype {values.dtype}, expected float32 or float64")
    if values.shape != (len(indices),):
        raise ValueError(f"sparse payload has shape {values.shape}, expected ({len(indices)},) for k = {len(indices)}")
    return scatter(values, indices, num_params)
