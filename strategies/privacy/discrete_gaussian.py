"""The distributed discrete Gaussian mechanism (Kairouz, Liu, Steinke, ICML 2021) and its accountant.

What it protects: client-level DP (one client's whole update, sensitivity = its clip norm), distributed: each
client adds its share of the noise, and the guarantee holds against whoever sees only the modular sum (the
server under secure aggregation, and observers of the released model), no amplification by sampling assumed.

Secure aggregation sums integers modulo 2^b, so continuous Gaussian noise followed by rounding is not the
mechanism whose privacy is proved. The distributed discrete Gaussian (DDG) is: each of the n clients

1. clips its update to ‖x‖₂ ≤ c,
2. rotates it by a randomized orthonormal DCT, y = DCT-II(D·x) (D: random ±1 signs from a public per-round
   seed, so the server can invert it; :func:`rotate`), which keeps its d = ``dim`` coordinates (no padding)
   and flattens it so that few bits per coordinate suffice,
3. scales it by 1/γ and rounds each coordinate randomly to a neighbouring integer, repeating until the
   rounded vector's norm is at most Δ₂ (conditional randomized rounding, Proposition 22; a retry happens
   with probability ≤ β),
4. adds discrete Gaussian noise N_Z(0, σ²/γ²) to every coordinate (exact sampler: Canonne, Kamath,
   Steinke 2020, Algorithm 3, on float64 probabilities),
5. reduces modulo 2^b (a residue in [0, 2^b): secure aggregation adds residues modulo 2^b, and the server reads
   the sum's residue in [−2^(b−1), 2^(b−1))).

The server sums modulo 2^b (secure aggregation), multiplies by γ and undoes the rotation. The sum of n
discrete Gaussians is not a discrete Gaussian; Theorem 1 bounds the difference with
τ = 10·Σ_{k=1}^{n−1} exp(−2π²(σ/γ)²·k/(k+1)), and Proposition 14 gives the Rényi DP of the resulting
mechanism (:func:`ddg_rdp`), composed over rounds and converted to (ε, δ) as for any RDP curve.

The rotation. Kairouz et al. use the randomized Hadamard transform H·D/√d, which needs d = 2^k and so a zero-padded
vector: up to twice the coordinates on the wire (Fed-SMP's k = 16,634 values of the 1.66 M CNN became 32,768). Any
orthogonal map that the server can invert and that flattens the vector does; the orthonormal DCT-II C (scipy.fft.dct,
``norm="ortho"``, float64; inverse D·DCT-III) is orthogonal for every length, so the shares have exactly ``dim``
coordinates (:attr:`DistributedDiscreteGaussian.rotated_dim`) and every d below is that dimension.

* Privacy does not rest on the rotation's flatness nor on its float arithmetic. Δ₂ = :func:`rounded_norm_bound`
  (c/γ, d, β) is enforced on the rounded integer vector itself: :func:`conditional_round` redraws until its norm
  is at most Δ₂, so a float error of the DCT (relative ~1e-16, one that lifts ‖y‖ above c/γ) can at most make a
  redraw more likely, never let a share exceed the checked bound. The released vector has d = ``dim``
  coordinates, each with its own discrete Gaussian, so Proposition 14 (τ·d, τ²·d, τ·√d and Δ₁ ≤ √d·Δ₂) holds
  with d = ``dim``; a smaller d only tightens it.
* Flattening (utility only: a coordinate of the sum that leaves [−2^(b−1), 2^(b−1)) wraps). Row j of C has entries
  of absolute value at most √(2/d) (√(1/d) for j = 0) and unit norm, so a rotated coordinate y_j = Σ_i C_ji s_i x_i
  with Rademacher s_i has variance Σ_i C_ji² x_i² ≤ 2‖x‖²/d and is sub-Gaussian with that variance proxy
  (Hoeffding), against exactly ‖x‖²/d for every coordinate of the Hadamard rotation; averaged over j it is ‖x‖²/d
  for both. The granularity (:attr:`DistributedDiscreteGaussian.granularity`) therefore counts the sum's signal
  at :data:`ROTATION_SPREAD` = 2 times ‖x‖²/d, so its "k standard deviations of every coordinate" and the tail
  bound 2·exp(−k²/2) it implies stay what they were for Hadamard. The cost, against counting it once, is a γ up
  to √2 coarser where the signal dominates the noise (n·c ≫ Cσ·√d, aligned updates); where the noise dominates, as
  in the calibrated plans measured, γ moves by under 1 % (tests/unit/strategies/privacy/test_discrete_gaussian.py
  compares the wrapped fractions with the padded Hadamard mechanism's: never more).
* The server inverts it: decode multiplies the wrapped sum by γ and applies D·DCT-III, the exact inverse (the
  rotation is linear, so the rotated sum is the sum of the rotated updates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.fft import dct, idct

#: the least per-client std (integer units) of the discrete Gaussian shares: Kairouz et al. (2021) Theorem 1, which
#: bounds how far a sum of discrete Gaussians is from one, assumes each has s >= 1/2
MIN_SCALED_STD = 0.5
class ShareStdTooSmall(ValueError):
    """Each client's discrete Gaussian std is below :data:`MIN_SCALED_STD` (outside Theorem 1's hypothesis)."""


#: Rényi orders the accountant evaluates (integers: Proposition 14 and the conversion hold for any α > 1)
ORDERS = tuple(range(2, 129)) + (160, 192, 256)


# ---------------------------------------------------------------------------- sampling
def discrete_laplace(scale: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Samples of the discrete Laplace law P(y) ∝ exp(−|y|/scale): a difference of two geometric variables."""
    p = 1.0 - math.exp(-1.0 / scale)
    return (rng.geometric(p, size) - rng.geometric(p, size)).astype(np.int64)


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` samples of N_Z(0, σ²), P(y) ∝ exp(−y²/(2σ²)) on the integers (rejection from a discrete
    Laplace of scale ⌊σ⌋ + 1, accepted with probability exp(−(|y| − σ²/t)²/(2σ²)))."""
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    t = math.floor(sigma) + 1
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        batch = max(2 * (size - filled), 64)
        y = discrete_laplace(t, batch, rng)
        accept = rng.random(batch) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        take = y[accept][: size - filled]
        out[filled:filled + len(take)] = take
        filled += len(take)
    return out


# ---------------------------------------------------------------------------- rotation
#: max over a rotated coordinate j and an input coordinate i of d·C_ji² for the orthonormal DCT-II C (rows j ≥ 1:
#: √(2/d)·cos(π(2i+1)j/(2d))): a rotated coordinate's variance proxy is at most this times ‖x‖²/d (1 for Hadamard)
ROTATION_SPREAD = 2.0


def random_signs(dim: int, seed: int) -> np.ndarray:
    """The public ±1 diagonal D of a round (every client and the server derive it from the same seed)."""
    return np.where(np.random.default_rng([int(seed), 907]).random(dim) < 0.5, -1.0, 1.0)


def rotate(x: np.ndarray, seed: int) -> np.ndarray:
    """The randomized orthonormal DCT y = DCT-II(D·x) of a vector of any length d (orthogonal: ‖y‖ = ‖x‖, len d)."""
    v = np.asarray(x, dtype=np.float64)
    y: np.ndarray = dct(random_signs(len(v), seed) * v, type=2, norm="ortho")
    return y


def unrotate(y: np.ndarray, seed: int) -> np.ndarray:
    """The inverse of :func:`rotate`: D·DCT-III(y)."""
    v = np.asarray(y, dtype=np.float64)
    x: np.ndarray = random_signs(len(v), seed) * idct(v, type=2, norm="ortho")
    return x


# ---------------------------------------------------------------------------- rounding and bounds
def rounded_norm_bound(norm: float, dim: int, beta: float) -> float:
    """Δ₂: the norm conditional randomized rounding guarantees for a vector of norm ≤ ``norm`` in d dims.

    Always ‖round(x)‖ ≤ ‖x‖ + √d; with β > 0 the rounding is repeated until
    ‖round(x)‖² ≤ ‖x‖² + d/4 + √(2 log(1/β))·(‖x‖ + √d/2), which one draw meets with probability ≥ 1 − β
    (Kairouz et al., Proposition 22).
    """
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    plain = norm + math.sqrt(dim)
    if beta == 0:
        return plain
    conditional = math.sqrt(norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(dim) / 2))
    return min(plain, conditional)


def conditional_round(x: np.ndarray, bound: float, rng: np.random.Generator, max_tries: int = 1000) -> np.ndarray:
    """Round each coordinate to ⌊x⌋ or ⌈x⌉ (unbiased) until the result's norm is at most ``bound``."""
    floor = np.floor(x)
    frac = x - floor
    for _ in range(max_tries):
        rounded: np.ndarray = floor + (rng.random(len(x)) < frac)
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded.astype(np.int64)
    raise RuntimeError(f"conditional rounding did not meet the norm bound {bound:.4g} in {max_tries} tries")


def wrap(values: np.ndarray, bits: int) -> np.ndarray:
    """Reduce integers modulo 2^b into [−2^(b−1), 2^(b−1))."""
    m = 1 << bits
    return ((values + m // 2) % m) - m // 2


# ---------------------------------------------------------------------------- the mechanism
#: Flower's SecAgg+ quantizer rounds through int32: a field of at most 2^31 residues
MAX_BITS = 31
MIN_BITS = 8


@dataclass(frozen=True)
class DistributedDiscreteGaussian:
    """The distributed discrete Gaussian of one run (Kairouz, Liu, Steinke 2021, Algorithm 1).

    ``noise_multiplier`` σ is the continuous noise the *sum* carries, in units of ``clip``: in a round with r_t
    sampled clients each adds N_Z(0, (Cσ/(√r_t γ))²) in integer units, so the sum of r_t shares has variance
    (Cσ/γ)². ``dim`` is the vector's length (a share has as many coordinates: :attr:`rotated_dim`), ``bits`` the
    field of the modular sum (2^b residues), ``max_cohort`` the most clients a sum can have (the granularity γ
    leaves room for all of them), ``beta`` the conditional rounding parameter and ``k_stds`` how many standard
    deviations of a sum coordinate fit in the field.
    Every client and the server build the same object from the run's plan, so γ and the rotation agree.
    """

    clip: float
    noise_multiplier: float
    max_cohort: int
    dim: int
    bits: int
    beta: float = math.exp(-0.5)
    k_stds: float = 4.0

    def __post_init__(self) -> None:
        if self.clip <= 0 or self.noise_multiplier <= 0 or self.max_cohort < 1 or self.dim < 1:
            raise ValueError(f"invalid distributed discrete Gaussian parameters: {self}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in {MIN_BITS}..{MAX_BITS}, got {self.bits}")
        if self.max_cohort >= 1 << self.bits:
            raise ValueError(f"a field of 2^{self.bits} cannot count a cohort of {self.max_cohort}")
        if (s := self.scaled_std(self.max_cohort)) < MIN_SCALED_STD:
            raise ShareStdTooSmall(f"each client's discrete Gaussian std s = {s:.3g} (integer units, a cohort of "
                             f"{self.max_cohort}) is below {MIN_SCALED_STD}: Theorem 1's bound on a sum of discrete "
                             f"Gaussians assumes s >= 1/2; more bits than {self.bits} give a finer granularity")

    @property
    def rotated_dim(self) -> int:
        """d: the coordinates of a rotated update, of a share and of the sum (the DCT keeps ``dim``, no padding)."""
        return self.dim

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def granularity(self) -> float:
        """γ such that ``k_stds`` standard deviations of each coordinate of the sum fit in [−2^(b−1), 2^(b−1)).

        A rotated coordinate of the sum of n = ``max_cohort`` clipped updates (norm ≤ n·c, aligned updates) has
        variance proxy at most ρ(n c)²/d, ρ = :data:`ROTATION_SPREAD` (the DCT's rows have entries up to √(2/d):
        module docstring), rounding adds variance ≤ n/4 in integer units and the noise (Cσ/γ)²:
        k²·(ρ(n c)²/d + (Cσ)²)/γ² + k²n/4 ≤ 4^(b−1) gives γ (Kairouz et al., Sec. 5, with their k = 4 and ρ = 1
        for their Hadamard rotation).
        """
        n, d, k = self.max_cohort, self.rotated_dim, self.k_stds
        room = 4.0 ** (self.bits - 1) - k**2 * n / 4
        if room <= 0:
            raise ValueError(f"{self.bits} bits cannot hold the rounding noise of {n} clients at {k:g} stds")
        signal = ROTATION_SPREAD * (n * self.clip) ** 2 / d
        return math.sqrt(k**2 * (signal + (self.clip * self.noise_multiplier) ** 2) / room)

    def scaled_std(self, round_clients: int) -> float:
        """Each client's discrete Gaussian std in integer units in a round of r_t clients: Cσ/(√r_t γ)."""
        if round_clients < 1:
            raise ValueError(f"a round needs at least 1 client, got {round_clients}")
        return self.clip * self.noise_multiplier / (math.sqrt(round_clients) * self.granularity)

    def noise_std(self, round_clients: int) -> float:
        """A bound on the std of one client's noise per coordinate in real units: its discrete Gaussian (Cσ/√r_t)
        plus randomized rounding (at most γ/2)."""
        return math.hypot(self.clip * self.noise_multiplier / math.sqrt(round_clients), self.granularity / 2)

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ in integer units: the norm bound of a clipped, scaled, conditionally rounded update (Prop. 22)."""
        return rounded_norm_bound(self.clip / self.granularity, self.rotated_dim, self.beta)

    def encode(self, update: np.ndarray, seed: int, rng: np.random.Generator, round_clients: int) -> np.ndarray:
        """One client's share: rotate, scale by 1/γ, round conditionally, add N_Z noise, reduce to [0, 2^b).

        ``update`` must be clipped to ``clip`` already; ``seed`` is the round's public rotation seed."""
        if len(update) != self.dim:
            raise ValueError(f"the update has {len(update)} coordinates, the mechanism {self.dim}")
        if not float(np.linalg.norm(update)) <= self.clip * (1 + 1e-9):
            raise ValueError("the update must be clipped to the mechanism's clip norm first")
        scaled = rotate(np.asarray(update, dtype=np.float64), seed) / self.granularity
        rounded = conditional_round(scaled, self.l2_sensitivity, rng)
        noisy = rounded + discrete_gaussian(self.scaled_std(round_clients), len(rounded), rng)
        share: np.ndarray = np.mod(noisy, self.modulus)
        return share

    def decode(self, modular_sum: np.ndarray, seed: int) -> np.ndarray:
        """The real-valued sum of the clients' noisy updates from their sum modulo 2^b."""
        if len(modular_sum) != self.rotated_dim:
            raise ValueError(f"the sum has {len(modular_sum)} coordinates, the mechanism {self.rotated_dim}")
        return unrotate(wrap(np.asarray(modular_sum, dtype=np.int64), self.bits) * self.granularity, seed)

    def tau(self, survivors: int, round_clients: int) -> float:
        """τ of Theorem 1 for the sum of ``survivors`` discrete Gaussians, each of std Cσ/(√r_t γ)."""
        s2 = self.scaled_std(round_clients) ** 2
        return 10.0 * sum(math.exp(-2 * math.pi**2 * s2 * k / (k + 1)) for k in range(1, int(survivors)))

    def rdp(self, survivors: int, round_clients: int) -> np.ndarray:
        """Rényi DP of one round at :data:`ORDERS` (:func:`ddg_rdp`)."""
        return ddg_rdp(self.l2_sensitivity, self.scaled_std(round_clients), int(survivors), self.rotated_dim,
                       self.tau(survivors, round_clients))

    def gaussian_equivalent(self, survivors: int, round_clients: int) -> float:
        """z with RDP(α) ≤ α/(2z²) at every order: 1/(a + τ√d), the third bound of Proposition 14.

        A round charged to an RDP ledger as a Gaussian of multiplier z (sampling rate 1) therefore never claims
        less ε than the mechanism's own RDP curve gives."""
        a = self.l2_sensitivity / (math.sqrt(survivors) * self.scaled_std(round_clients))
        return 1.0 / (a + self.tau(survivors, round_clients) * math.sqrt(self.rotated_dim))

    def report_slack(self, plan_multiplier: float) -> float:
        """How far (relative) a client's ε on the continuous plan ``plan_multiplier`` may exceed a ledger charged this
        mechanism's full-round equivalent z ≥ σ (:meth:`calibrated`'s tolerance): 2(z/σ − 1), as ε falls as z⁻¹ to
        z⁻² (:attr:`strategies.privacy.ledger.PrivacyLedger.report_slack`)."""
        z = self.gaussian_equivalent(self.max_cohort, self.max_cohort)
        return max(2.0 * (z / plan_multiplier - 1.0), 0.0)

    @classmethod
    def calibrated(cls, target_multiplier: float, *, clip: float, max_cohort: int, dim: int, bits: int,
                   rel_tol: float = 1e-4) -> DistributedDiscreteGaussian:
        """The least σ whose full round (every one of ``max_cohort`` clients summed) has a Gaussian equivalent of
        at least ``target_multiplier``: the continuous plan's ε then bounds the discrete mechanism's.

        The equivalent grows with σ but saturates (rounding noise of √d/2 per client is the floor of Δ₂), so a
        field too narrow for the model raises ``ValueError`` naming the bits that would do."""
        def build(sigma: float) -> DistributedDiscreteGaussian:
            return cls(clip=clip, noise_multiplier=sigma, max_cohort=max_cohort, dim=dim, bits=bits)

        def z(sigma: float) -> float:
            try:
                return build(sigma).gaussian_equivalent(max_cohort, max_cohort)
            except ShareStdTooSmall:  # s < 1/2 at this σ: no guarantee is claimed for it
                return 0.0

        lo, hi = target_multiplier, target_multiplier
        for _ in range(60):
            if z(hi) >= target_multiplier:
                break
            lo, hi = hi, hi * 2
        else:
            need = next((b for b in range(bits + 1, MAX_BITS + 1)
                         if _reaches(clip, target_multiplier, max_cohort, dim, b)), None)
            raise ValueError(f"{bits} bits cannot carry noise multiplier {target_multiplier:.4g} for {dim} coordinates "
                             f"and {max_cohort} clients: rounding dominates the sensitivity"
                             + (f"; {need} bits would" if need else ""))
        while hi - lo > rel_tol * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if z(mid) >= target_multiplier else (mid, hi)
        return build(hi)


def _reaches(clip: float, target: float, cohort: int, dim: int, bits: int) -> bool:
    """Whether ``bits`` reach a Gaussian equivalent of ``target`` at any σ (the saturated limit, σ = 10⁶·target)."""
    try:
        ddg = DistributedDiscreteGaussian(clip=clip, noise_multiplier=1e6 * target, max_cohort=cohort, dim=dim, bits=bits)
        return ddg.gaussian_equivalent(cohort, cohort) >= target
    except ValueError:
        return False


def ddg_rdp(l2_sensitivity: float, scaled_std: float, summands: int, dim: int, tau: float) -> np.ndarray:
    """Rényi DP at :data:`ORDERS` of the sum of ``summands`` discrete Gaussians N_Z(0, s²) on a query of ℓ₂
    sensitivity Δ₂ (integer units) in ``dim`` coordinates (Kairouz et al., Proposition 14 with Theorem 1):

        ε(α) = min{ α/2·a² + τd,  α/2·(a² + 2bτ + τ²d),  α/2·(a + τ√d)² }

    with a = Δ₂/(√n s), b = Δ₁/(√n s) and Δ₁ = Δ₂·min(√d, Δ₂) (an integer vector's ℓ₁ norm is at most
    its squared ℓ₂ norm)."""
    total = math.sqrt(summands) * scaled_std
    a = l2_sensitivity / total
    b = l2_sensitivity * min(math.sqrt(dim), l2_sensitivity) / total
    alphas = np.asarray(ORDERS, dtype=np.float64)
    rdp: np.ndarray = np.minimum.reduce([alphas / 2 * a**2 + tau * dim,
                                         alphas / 2 * (a**2 + 2 * b * tau + tau**2 * dim),
                                         alphas / 2 * (a + tau * math.sqrt(dim)) ** 2])
    return rdp


def rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """(ε, δ) from an RDP curve at :data:`ORDERS` (the conversion of Canonne, Kamath, Steinke 2020)."""
    alphas = np.asarray(ORDERS, dtype=np.float64)
    eps = rdp + np.log1p(-1 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1)
    return float(max(np.min(eps), 0.0))
