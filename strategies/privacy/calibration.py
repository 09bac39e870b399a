"""One noise calibrator for every family: the smallest noise whose accountant ε meets a target.

ε(x) of a mechanism is non-increasing in its noise scale x (a noise multiplier z, or a noise std
σ_p). :func:`calibrate` brackets the target in log space and narrows the bracket by safeguarded
regula falsi, always keeping the end that meets the target, so the result satisfies
``target·(1 − rtol) ≤ ε(x) ≤ target`` (unless the bracket is already that tight).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

from strategies.privacy.accountants import REPLACE_ONE, compact_history, epsilon_of, get_accountant


def calibrate(epsilon_fn: Callable[[float], float], target: float, *, start: float = 1.0, rtol: float = 1e-3,
              max_scale: float = 1e6, what: str = "noise", lower: float = 0.0) -> float:
    """Smallest x (to relative precision ``rtol``) with ``epsilon_fn(x) <= target``; raises ``ValueError``
    when even ``start · max_scale`` cannot reach it.

    ``lower`` (≤ ``start``): the caller knows ``epsilon_fn(x) > target`` for every x < ``lower``
    (e.g. :func:`noise_floor`), so ``epsilon_fn`` is never called below it.

    Root-finding on g(u) = log ε(eᵘ) − log target: expand from ``start`` with slope-(−1) steps (ε ≈ c/x
    for a Gaussian mechanism in its usual regime) until a bracket holds, then Illinois regula falsi aimed
    at the middle of the accepted window, falling back to bisection when a step does not shrink the
    bracket. Typically 4–6 accountant calls instead of bisection's ~13, and it never probes noise far
    below the answer, where some accountants are slowest (Opacus' fractional-order series)."""
    if not target > 0 or not math.isfinite(target):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target}")
    if not start > 0:
        raise ValueError(f"start must be > 0, got {start}")
    if not 0 <= lower <= start:
        raise ValueError(f"lower must be in [0, start={start}], got {lower}")
    accept = math.log1p(-rtol)  # g in [accept, 0]: target·(1 − rtol) <= ε <= target
    aim = math.log1p(-rtol / 2)

    def g(u: float) -> float:
        eps = epsilon_fn(math.exp(u))
        return math.log(eps / target) if eps > 0 else -math.inf

    u_min, u_max = math.log(start / max_scale), math.log(start * max_scale)
    if lower > 0:
        u_min = max(u_min, math.log(lower))
    u, gu = math.log(start), g(math.log(start))
    if accept <= gu <= 0:
        return start
    lo = hi = None  # (u, g): lo misses the target (g > 0), hi meets it (g <= 0)
    prev: tuple[float, float] | None = None
    while lo is None or hi is None:  # extrapolate towards the root until it is bracketed
        if gu > 0:
            lo = (u, gu)
        else:
            hi = (u, gu)
        if lo is not None and hi is not None:
            break
        slope = -1.0  # ε ≈ c/x until two points on one side give the local slope
        if prev is not None and math.isfinite(gu) and math.isfinite(prev[1]) and gu != prev[1]:
            slope = min((gu - prev[1]) / (u - prev[0]), -0.05)
        step = (aim - gu) / slope if math.isfinite(gu) else -math.log(100.0)
        step = math.copysign(min(max(abs(step), math.log(1.05)), math.log(100.0)), 1.0 if gu > 0 else -1.0)
        prev, u = (u, gu), u + step
        if u > u_max:
            if prev[0] >= u_max:  # already probed the largest allowed noise
                raise ValueError(f"cannot reach epsilon {target}: even {what} {math.exp(u_max):.3g} spends more")
            u = u_max
        if u < u_min:
            if prev[0] <= u_min:
                if hi is None:  # u only moves down from a point that meets the target, which set hi
                    raise RuntimeError(f"calibrating {what}: stepped down without a point that meets the target")
                return math.exp(hi[0])
            u = u_min
        gu = g(u)
        if accept <= gu <= 0:
            return math.exp(u)
    side = 0  # Illinois: halve the stale end's g when the same end moves twice
    glo, ghi = lo[1], hi[1]
    for _ in range(200):
        if hi[0] - lo[0] < rtol / 4:
            break
        width = hi[0] - lo[0]
        if math.isfinite(ghi) and glo - ghi > 0:
            u = lo[0] + (glo - aim) / (glo - ghi) * width
        else:
            u = lo[0] + width / 2
        u = min(max(u, lo[0] + 0.01 * width), hi[0] - 0.01 * width)
        gu = g(u)
        if accept <= gu <= 0:
            return math.exp(u)
        if gu > 0:
            lo, glo = (u, gu), gu
            if side == -1:
                ghi = aim + (ghi - aim) / 2
            side = -1
        else:
            hi, ghi = (u, gu), gu
            if side == 1:
                glo = aim + (glo - aim) / 2
            side = 1
    return math.exp(hi[0])


def gaussian_delta(epsilon: float, noise_multiplier: float) -> float:
    """Exact δ(ε) of one Gaussian mechanism with noise std / sensitivity = z (Balle & Wang 2018, Thm 8):
    Φ(1/(2z) − εz) − e^ε Φ(−1/(2z) − εz), in log space so that neither term underflows."""
    from scipy import special

    a = float(special.log_ndtr(0.5 / noise_multiplier - epsilon * noise_multiplier))
    b = epsilon + float(special.log_ndtr(-0.5 / noise_multiplier - epsilon * noise_multiplier))
    return math.exp(a) * -math.expm1(min(b - a, 0.0)) if a > -math.inf else 0.0


def delta_lower_bound(epsilon: float, noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """A lower bound on the true δ(ε) of ``steps`` Poisson-subsampled Gaussian steps (z, q), any neighbouring
    relation that contains add/remove-one (replace-one does: swap a record for one whose clipped contribution is 0).

    q = 1: the T steps are one Gaussian mechanism with multiplier z/√T (exact). q < 1: the first step alone,
    removal direction, where subsampling amplifies by an identity (Balle, Barthe, Gaboardi 2018):
    (1 − q)μ₀ + qμ₁ − e^ε μ₀ = q(μ₁ − e^ε′ μ₀) with e^ε′ = 1 + (e^ε − 1)/q, so δ = q·δ_Gauss(ε′).
    Composition never lowers δ(ε), and every accountant of
    :mod:`strategies.privacy.accountants` reports an ε at least the true one, so δ > δ_target here means the
    accountant's ε exceeds ε_target."""
    if sample_rate >= 1:
        return gaussian_delta(epsilon, noise_multiplier / math.sqrt(steps))
    eps_inner = math.log1p(math.expm1(epsilon) / sample_rate)
    return sample_rate * gaussian_delta(eps_inner, noise_multiplier)


def noise_floor(unit_history: Iterable[Sequence[float]], target: float, delta: float) -> float:
    """A noise scale x₀ such that every x ≤ x₀ spends more than ``target`` at ``delta``, given the history at
    x = 1 (each z proportional to x, as for σ_p in SoteriaFL's ``noise_history``); 0 when none is found.

    Each entry alone bounds the composition from below (:func:`delta_lower_bound`), so x₀ is the largest of
    the entries' floors. Closed form only: no accountant call. A calibration that starts from x₀ never asks
    an accountant about tiny noise, where dp_accounting's PLD grid grows like 1/z² (3 GB at z = q = 0.016, 100 steps)."""
    floor = 0.0
    for z1, q, steps in compact_history(unit_history):
        if not z1 > 0:
            continue

        def misses(z: float, q: float = q, steps: int = steps) -> bool:  # true ε at z certainly > target
            return delta_lower_bound(target, z, q, steps) > delta

        lo, hi = 1e-6, 1e6  # in z; keep lo with misses(lo)
        if not misses(lo):
            continue
        if misses(hi):
            return math.inf
        while hi / lo > 1.0 + 1e-6:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if misses(mid) else (lo, mid)
        floor = max(floor, lo / z1)
    return floor


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               kind: str = "rdp", rtol: float = 1e-3, prior: Iterable[Sequence[float]] = ()) -> float:
    """Smallest z such that ``prior + [(z, q, steps)]`` spends at most ``target_epsilon`` at ``delta``.

    ``kind`` names the accountant, and with it the neighbouring relation: record-level callers pass
    :func:`~strategies.privacy.accountants.record_accountant` of the run's ``accountant`` and
    ``record-neighbours`` (the client's ``epsilon_spent`` and the server's ledger compose with the same name);
    the client-level families pass ``accountant`` itself (zero-out of a whole client: sensitivity C, the same
    subsampled-Gaussian analysis as add/remove).

    Memoized per process: clients of one simulation actor with the same (ε, δ, q, steps) — e.g. every
    client under ``privacy-dist = fixed`` with one batch size — calibrate once."""
    return _calibrate_z(float(target_epsilon), float(delta), float(sample_rate), int(steps), str(kind), float(rtol),
                        tuple(tuple(float(v) for v in h) for h in compact_history(prior)))


@functools.lru_cache(maxsize=1024)
def _calibrate_z(target_epsilon: float, delta: float, sample_rate: float, steps: int, kind: str, rtol: float,
                 prior: tuple[tuple[float, ...], ...]) -> float:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    base = compact_history(prior)
    # moments-accountant estimate z ≈ q·√(2T·log(1/δ))/ε (Abadi et al. 2016, Thm 1): starts the search
    # within a few percent of the answer, away from small z where Opacus' series converge slowly
    start = max(sample_rate * math.sqrt(2.0 * steps * math.log(1.0 / delta)) / target_epsilon, 0.05)
    if get_accountant(kind).relation == REPLACE_ONE:
        start *= 1.8  # a swapped record moves the sum by 2C: ~1.8x the add/remove z (docs/privacy.md's table)
    return calibrate(lambda z: epsilon_of(base + [(z, sample_rate, steps)], delta, kind), target_epsilon,
                     start=start, rtol=rtol, what=f"noise multiplier (delta={delta}, {steps} steps at q={sample_rate})")
