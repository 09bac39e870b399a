"""Matrix mechanism of DP-FTRL: factorizations A = B C of the prefix-sum workload, their sensitivity under a
participation pattern, and streaming correlated noise.

Round t = 0..T−1 contributes a sum x_t of clipped updates (in units of the clip, so one participation moves a row
by ≤ 1). The mechanism releases C X + Z, Z with i.i.d. N(0, σ²) entries, and the prefix sums are decoded as
B(C X + Z) = A X + B Z (Denisov et al. 2022; Choquette-Choo et al. 2023). The form used here is the
*per-round noise*: round t's sum receives w_t = (A⁻¹ B Z)_t, which is (C⁻¹ Z)_t for square C, and the prefix
sums of w are B Z. The whole run is one Gaussian mechanism with multiplier σ / sens(C)
(:mod:`strategies.privacy.ftrl_accounting`). Sensitivities here are for zero-out / add-remove of a client's
participations (each changes its row by ≤ 1); replace-one doubles them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
#: patterns enumerated exactly by :func:`sensitivity` before it falls back to its dynamic-programming bound
MAX_ENUMERATED_PATTERNS = 20_000


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def prefix_sum_workload(rounds: int) -> FloatArray:
    """A: the T×T lower-triangular matrix of ones, (A X)_t = x_0 + … + x_t."""
    return np.tril(np.ones((_positive_int("rounds", rounds),) * 2))


@dataclass(frozen=True, eq=False)
class Factorization:
    """A = decoder · encoder. ``encoder`` C is (m, T); row i is released after round ``row_round[i]`` (0-based,
    nondecreasing) and may read only x_0..x_{row_round[i]}; ``decoder`` B is (T, m)."""

    name: str
    encoder: FloatArray
    decoder: FloatArray
    row_round: IntArray

    def __post_init__(self) -> None:
        m, t = self.encoder.shape
        if self.decoder.shape != (t, m) or self.row_round.shape != (m,):
            raise ValueError(f"{self.name}: encoder {self.encoder.shape}, decoder {self.decoder.shape} and "
                             f"row_round {self.row_round.shape} do not fit together")
        if np.any(np.diff(self.row_round) < 0) or np.any(self.row_round >= t) or np.any(self.row_round < 0):
            raise ValueError(f"{self.name}: row_round must be nondecreasing rounds in [0, {t}), got {self.row_round}")
        future = np.arange(t)[None, :] > self.row_round[:, None]
        if np.any(self.encoder[future] != 0):
            raise ValueError(f"{self.name}: a row of the encoder reads a round after its release")

    @property
    def rounds(self) -> int:
        return int(self.encoder.shape[1])

    def per_round_noise(self, z: FloatArray) -> FloatArray:
        """W = A⁻¹ B Z (rows: rounds), the noise each round's sum receives; its prefix sums are B Z."""
        bz = self.decoder @ z
        return np.diff(bz, axis=0, prepend=np.zeros((1,) + bz.shape[1:]))

    def released_encoder(self, rounds: int) -> FloatArray:
        """C restricted to the rows released within the first ``rounds`` rounds (and the columns they read)."""
        if not 0 <= rounds <= self.rounds:
            raise ValueError(f"rounds must be in [0, {self.rounds}], got {rounds}")
        return self.encoder[self.row_round < rounds][:, :rounds]


def from_encoder(encoder: FloatArray, name: str = "custom") -> Factorization:
    """The factorization of a square lower-triangular invertible C: B = A C⁻¹ (row t released after round t)."""
    c = np.asarray(encoder, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1] or np.any(np.triu(c, 1) != 0) or np.any(np.diag(c) == 0):
        raise ValueError(f"encoder must be square lower-triangular with a nonzero diagonal, got shape {c.shape}")
    t = c.shape[0]
    decoder = np.asarray(np.linalg.solve(c.T, prefix_sum_workload(t).T).T, dtype=np.float64)
    return Factorization(name, c, decoder, np.arange(t, dtype=np.int64))


def identity_factorization(rounds: int) -> Factorization:
    """C = I, B = A: independent Gaussian noise every round (DP-FedAvg without sampling)."""
    return from_encoder(np.eye(_positive_int("rounds", rounds)), "identity")


def _trailing_zeros(s: int) -> int:
    return (s & -s).bit_length() - 1


def tree_aggregation(rounds: int, restart_every: int | None = None) -> Factorization:
    """Binary-tree aggregation with the online ("honest") estimator and restarts (Kairouz et al., ICML 2021).

    C has one row per complete dyadic node: the level-ℓ node ending at local round s (ℓ ≤ trailing zeros of s)
    sums the 2^ℓ rounds before it; rows are ordered by release round, then level. The prefix sum at local round s
    adds the nodes of the binary expansion of s, all complete by then. ``restart_every`` = L starts an independent
    tree every L rounds (C is block diagonal); a prefix sum adds the earlier trees' final estimates.
    """
    t_total = _positive_int("rounds", rounds)
    block = t_total if restart_every is None else _positive_int("restart_every", restart_every)
    rows: list[tuple[int, int, int]] = []  # (start round of the block, local end s, level)
    for start in range(0, t_total, block):
        for s in range(1, min(block, t_total - start) + 1):
            rows += [(start, s, level) for level in range(_trailing_zeros(s) + 1)]
    index = {row: i for i, row in enumerate(rows)}
    encoder = np.zeros((len(rows), t_total))
    for i, (start, s, level) in enumerate(rows):
        encoder[i, start + s - (1 << level):start + s] = 1.0
    decoder = np.zeros((t_total, len(rows)))
    carried = np.zeros(len(rows))  # the estimates of the finished trees
    for t in range(t_total):
        start, s = t - t % block, t % block + 1
        decoder[t] = carried
        for level in range(s.bit_length()):
            if s >> level & 1:
                decoder[t, index[(start, (s >> level) << level, level)]] = 1.0
        if s == block:
            carried = decoder[t].copy()
    row_round = np.array([start + s - 1 for start, s, _ in rows], dtype=np.int64)
    return Factorization("tree" if restart_every is None else f"tree-restart-{block}", encoder, decoder, row_round)


def toeplitz_encoder(coefficients: FloatArray, rounds: int) -> FloatArray:
    """The T×T lower-triangular banded Toeplitz C with C[t, t−j] = c_j for j < b."""
    c = np.asarray(coefficients, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or c[0] == 0 or not np.all(np.isfinite(c)):
        raise ValueError(f"coefficients must be a finite 1-D array with c[0] != 0, got {c}")
    t = _positive_int("rounds", rounds)
    out = np.zeros((t, t))
    for j, cj in enumerate(c[:t]):
        out += cj * np.eye(t, k=-j)
    return out


def _toeplitz_loss(c: FloatArray, weights: FloatArray) -> tuple[float, FloatArray]:
    """Σ_n w_n s_n² for s = the series of 1/((1−x) C(x)) (the Toeplitz coefficients of A C⁻¹) and its gradient
    in c: ∂s_n/∂c_j = −q_{n−j}, q the series of 1/((1−x) C(x)²)."""
    from scipy.signal import lfilter

    impulse = np.zeros(weights.size)
    impulse[0] = 1.0
    r = np.asarray(lfilter([1.0], c, impulse), dtype=np.float64)  # 1/C(x)
    s, q = np.cumsum(r), np.cumsum(np.asarray(lfilter([1.0], c, r), dtype=np.float64))
    u = weights * s
    grad = np.array([-2.0 * float(u[j:] @ q[:weights.size - j]) for j in range(c.size)])
    return float(u @ s), grad


def optimal_banded_coefficients(rounds: int, bands: int, objective: str = "total") -> FloatArray:
    """Band coefficients c (‖c‖ = 1) of the b-banded Toeplitz C minimising the prefix-sum error at sensitivity 1.

    Minimises L(c)·‖c‖²: L = ‖A C⁻¹‖_F² (``"total"``) or the last (largest) row's ‖(A C⁻¹)_{T−1}‖² (``"max"``);
    ‖c‖² is sens² for one participation and k‖c‖² for k participations ≥ b rounds apart, so the minimiser is the
    same (the banded loss of Choquette-Choo et al., NeurIPS 2023, restricted to Toeplitz C). L-BFGS-B, exact
    gradient, started from the truncated square root of A (coefficients of (1−x)^(−1/2)).
    """
    from scipy.optimize import minimize

    t, b = _positive_int("rounds", rounds), _positive_int("bands", bands)
    if b > t:
        raise ValueError(f"bands must be <= rounds ({t}), got {b}")
    if objective not in ("total", "max"):
        raise ValueError(f"objective must be 'total' or 'max', got {objective!r}")
    weights = np.arange(t, 0, -1, dtype=np.float64) if objective == "total" else np.ones(t)
    start = np.cumprod(np.r_[1.0, (2 * np.arange(1, b) - 1) / (2 * np.arange(1, b))])

    def fun(tail: FloatArray) -> tuple[float, FloatArray]:
        c = np.r_[1.0, tail]
        with np.errstate(over="ignore", invalid="ignore"):
            loss, grad = _toeplitz_loss(c, weights)
        if not (math.isfinite(loss) and np.all(np.isfinite(grad))):
            return 1e300, np.zeros_like(tail)
        norm2 = float(c @ c)
        return math.log(loss) + math.log(norm2), (grad / loss + 2.0 * c / norm2)[1:]

    best = np.r_[1.0, minimize(fun, start[1:], jac=True, method="L-BFGS-B").x] if b > 1 else np.ones(1)
    return np.asarray(best / np.linalg.norm(best), dtype=np.float64)


def banded_factorization(rounds: int, bands: int, objective: str = "total") -> Factorization:
    """The b-banded Toeplitz factorization of :func:`optimal_banded_coefficients` (b = 1 is C ∝ I)."""
    c = optimal_banded_coefficients(rounds, bands, objective)
    return from_encoder(toeplitz_encoder(c, rounds), f"banded-{bands}")


def _best_separated_sums(weights: FloatArray, k: int, sep: int) -> FloatArray:
    """Per row of nonnegative ``weights`` (n, T): max over π ⊆ [0, T), |π| ≤ k, gaps ≥ sep, of Σ_{j∈π} w_j.
    P_m[j] (best over the first j positions with ≤ m picks) = max(P_m[j−1], w_{j−1} + P_{m−1}[j−sep])."""
    n, t = weights.shape
    best = np.zeros((n, t + 1))
    back = np.maximum(np.arange(1, t + 1) - sep, 0)
    for _ in range(min(k, (t - 1) // sep + 1)):
        best = np.maximum.accumulate(np.concatenate([np.zeros((n, 1)), weights + best[:, back]], axis=1), axis=1)
    return best[:, t]


def _enumerate_patterns(gram: FloatArray, k: int, sep: int, limit: int) -> float | None:
    """max over patterns of Σ_{i,j∈π} gram_ij by depth-first enumeration; None past ``limit`` patterns."""
    t, best, visited = gram.shape[0], 0.0, 0
    stack: list[tuple[int, tuple[int, ...], float]] = [(-sep, (), 0.0)]
    while stack:
        last, members, value = stack.pop()
        best, visited = max(best, value), visited + 1
        if visited > limit:
            return None
        if len(members) < k:
            for j in range(max(last + sep, 0), t):
                stack.append((j, members + (j,), value + gram[j, j] + 2.0 * float(gram[j, list(members)].sum())))
    return best


def sensitivity(encoder: FloatArray, participations: int = 1, min_separation: int = 1,
                max_patterns: int = MAX_ENUMERATED_PATTERNS) -> float:
    """ℓ2 sensitivity of X ↦ C X when a client takes part in ≤ k rounds, any two ≥ ``min_separation`` apart.

    sens² = max over patterns π and rows ‖u_i‖ ≤ 1 of ‖Σ_{i∈π} C_{:,i} u_iᵀ‖² ≤ max_π Σ_{i,j∈π} |G_ij|, G = CᵀC
    (Choquette-Choo et al., "Multi-Epoch Matrix Factorization", ICML 2023, and "(Amplified) Banded Matrix
    Factorization", NeurIPS 2023). What is computed:

    * k = 1: the largest column norm. Exact.
    * G_ij = 0 whenever |i−j| ≥ min_separation (a b-banded C with min_separation ≥ b): a pattern's columns are
      orthogonal, sens² = max_π Σ_{i∈π} G_ii, maximised by dynamic programming. Exact, for any signs.
    * otherwise max_π Σ_{i,j∈π} |G_ij| (π's 0/1 vector u maximises ‖C u‖ when G ≥ 0, so this is exact when
      G ≥ 0 and an upper bound otherwise): by enumeration when at most ``max_patterns`` patterns exist (every
      round, min_separation = 1 and k ≥ T, has the single maximal pattern 1: sens² = 1ᵀ|G|1); past that the
      relaxation max_π Σ_{i∈π} max_{π'∋i} Σ_{j∈π'} |G_ij| (two dynamic programs), an upper bound only.
    """
    c = np.asarray(encoder, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"encoder must be a 2-D matrix, got shape {c.shape}")
    k, sep = _positive_int("participations", participations), _positive_int("min_separation", min_separation)
    t = c.shape[1]
    gram = c.T @ c
    if k == 1 or t == 0:
        return float(np.sqrt(np.max(np.diag(gram), initial=0.0)))
    offsets = np.abs(np.subtract.outer(np.arange(t), np.arange(t)))
    tol = 1e-12 * float(np.max(np.abs(gram), initial=0.0))
    if np.all(np.abs(gram[offsets >= sep]) <= tol):
        return float(np.sqrt(_best_separated_sums(np.diag(gram)[None, :], k, sep)[0]))
    absg = np.abs(gram)
    if sep == 1 and k >= t:
        return float(np.sqrt(absg.sum()))
    exact = _enumerate_patterns(absg, k, sep, max_patterns)
    if exact is not None:
        return math.sqrt(exact)
    masked = np.where(offsets < sep, 0.0, absg)  # partners of i lie ≥ sep away from i
    top = np.diag(absg) + _best_separated_sums(masked, k - 1, sep)
    return float(np.sqrt(_best_separated_sums(top[None, :], k, sep)[0]))


def pattern_sensitivity(encoder: FloatArray, rounds: Sequence[int]) -> float:
    """sens for one known participation pattern: √(Σ_{i,j∈π} |G_ij|), exact when G_π ≥ 0."""
    c = np.asarray(encoder, dtype=np.float64)
    idx = sorted(set(rounds))
    if any(not 0 <= i < c.shape[1] for i in idx):
        raise ValueError(f"rounds must lie in [0, {c.shape[1]}), got {rounds}")
    return float(np.sqrt(np.abs(c[:, idx].T @ c[:, idx]).sum()))


def prefix_sum_rmse(factorization: Factorization, sensitivity: float, effective_multiplier: float = 1.0) -> float:
    """Root-mean-squared prefix-sum error per coordinate, in units of the clip, of a run calibrated to the Gaussian
    mechanism with multiplier ``effective_multiplier`` (so equal ε for every factorization): σ = z_eff · sens,
    RMSE = σ ‖B‖_F / √T."""
    if not sensitivity > 0 or not effective_multiplier > 0:
        raise ValueError(f"sensitivity and effective_multiplier must be > 0, got {sensitivity}, {effective_multiplier}")
    frob = float(np.linalg.norm(factorization.decoder))
    return effective_multiplier * sensitivity * frob / math.sqrt(factorization.rounds)


class _NoiseStream:
    """Per-round noise w_t in R^d drawn from a numpy Generator, with a resumable state."""

    def __init__(self, dim: int, std: float, rng: np.random.Generator) -> None:
        self.dim = _positive_int("dim", dim)
        if not (std >= 0 and math.isfinite(std)):
            raise ValueError(f"std must be a finite number >= 0, got {std}")
        self.std, self.rng, self.round = float(std), rng, 0
        self._memory: list[FloatArray] = []

    def _draw(self) -> FloatArray:
        return self.std * self.rng.standard_normal(self.dim)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints, a float64 array and the Generator's bit_generator state."""
        memory = np.stack(self._memory) if self._memory else np.zeros((0, self.dim))
        return {"round": self.round, "memory": memory, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        memory = np.asarray(state["memory"], dtype=np.float64)
        if memory.ndim != 2 or memory.shape[1] != self.dim:
            raise ValueError(f"state holds noise of shape {memory.shape}, this stream draws dim {self.dim}")
        kind = str(state["rng"].get("bit_generator"))
        if kind.rsplit(".", 1)[-1] != type(self.rng.bit_generator).__name__:  # "PCG64", "randomgen.chacha.ChaCha"
            raise ValueError(f"state's bit generator {kind!r} differs from {type(self.rng.bit_generator).__name__}")
        self.rng.bit_generator.state = state["rng"]
        self.round, self._memory = int(state["round"]), [row.copy() for row in memory]


class BandedNoise(_NoiseStream):
    """w = C⁻¹ Z for a b-banded lower-triangular C, by forward substitution:
    w_t = (z_t − Σ_{j=1}^{b−1} C[t, t−j] w_{t−j}) / C[t, t]; keeps the last b−1 outputs.

    ``band``: shape (b,) for Toeplitz C (C[t, t−j] = band[j], any number of rounds) or (T, b) with row t holding
    C[t, t], C[t, t−1], …; C = I is ``band = [1.0]``.
    """

    def __init__(self, band: FloatArray, dim: int, std: float, rng: np.random.Generator) -> None:
        super().__init__(dim, std, rng)
        self.band = np.asarray(band, dtype=np.float64)
        if self.band.ndim not in (1, 2) or self.band.shape[-1] == 0 or np.any(self.band[..., 0] == 0):
            raise ValueError(f"band must have shape (b,) or (T, b) with nonzero diagonal entries, got {band}")

    def next(self) -> FloatArray:
        if self.band.ndim == 2 and self.round >= self.band.shape[0]:
            raise ValueError(f"the band defines {self.band.shape[0]} rounds; round {self.round} was asked for")
        row = self.band if self.band.ndim == 1 else self.band[self.round]
        acc = self._draw()
        for j, past in enumerate(self._memory[:row.size - 1], start=1):
            acc -= float(row[j]) * past
        w = acc / float(row[0])
        self._memory = ([w] + self._memory)[:row.size - 1] if row.size > 1 else []
        self.round += 1
        return w


class TreeNoise(_NoiseStream):
    """The per-round noise of :func:`tree_aggregation`: at local round s it draws the nodes ending at s (levels
    0..tz(s), in the encoder's row order) and returns the new level-tz(s) node minus the stored nodes of lower
    levels it replaces in the binary expansion of s; it keeps one node per set bit of s (≤ log₂ L + 1)."""

    def __init__(self, dim: int, std: float, rng: np.random.Generator, restart_every: int | None = None) -> None:
        super().__init__(dim, std, rng)
        self.restart_every = None if restart_every is None else _positive_int("restart_every", restart_every)

    def next(self) -> FloatArray:
        s = self.round + 1 if self.restart_every is None else self.round % self.restart_every + 1
        if s == 1:
            self._memory = []
        level = _trailing_zeros(s)
        nodes = [self._draw() for _ in range(level + 1)]
        # memory[i] is the node of the i-th set bit of s − 1 counted from the lowest; bits 0..level−1 are set
        w = nodes[level].copy()
        for node in self._memory[:level]:
            w -= node
        self._memory = [nodes[level]] + self._memory[level:]
        self.round += 1
        return w
