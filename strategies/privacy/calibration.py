"""One noise calibrator for every family: the smallest noise whose accountant ε meets a target.

ε(x) of a mechanism is non-increasing in its noise scale x (a noise multiplier z, or a noise std
σ_p). :func:`calibrate` brackets the target geometrically and bisects in log space, always keeping
the end that meets the target, so the result satisfies ``target·(1 − rtol) ≤ ε(x) ≤ target``
(unless the bracket is already that tight).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

from strategies.privacy.accountants import compact_history, epsilon_of


def calibrate(epsilon_fn: Callable[[float], float], target: float, *, start: float = 1.0, rtol: float = 1e-3,
              max_scale: float = 1e6, what: str = "noise") -> float:
    """Smallest x (to relative precision ``rtol``) with ``epsilon_fn(x) <= target``; raises ``ValueError``
    when even ``start · max_scale`` cannot reach it."""
    if not target > 0 or not math.isfinite(target):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target}")
    if not start > 0:
        raise ValueError(f"start must be > 0, got {start}")
    hi = start
    while epsilon_fn(hi) > target:
        hi *= 2.0
        if hi > start * max_scale:
            raise ValueError(f"cannot reach epsilon {target}: even {what} {hi:.3g} spends more")
    lo = hi / 2.0
    while epsilon_fn(lo) <= target:  # shrink until lo misses the target (bracket [lo, hi])
        hi, lo = lo, lo / 2.0
        if lo < start / max_scale:
            return hi
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        e = epsilon_fn(mid)
        if e > target:
            lo = mid
        else:
            hi = mid
            if e >= target * (1 - rtol):
                break
        if hi / lo < 1 + rtol / 4:
            break
    return hi


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               kind: str = "rdp", rtol: float = 1e-3, prior: Iterable[Sequence[float]] = ()) -> float:
    """Smallest z such that ``prior + [(z, q, steps)]`` spends at most ``target_epsilon`` at ``delta``.

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
    return calibrate(lambda z: epsilon_of(base + [(z, sample_rate, steps)], delta, kind), target_epsilon,
                     rtol=rtol, what=f"noise multiplier (delta={delta}, {steps} steps at q={sample_rate})")
