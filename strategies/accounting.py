"""Privacy accounting shared by every mechanism: one interface, interchangeable accountants.

All ε values in this project come from Opacus' accountants (RDP: Mironov et al. 2019
subsampled-Gaussian RDP; PRV: Gopi et al. 2021), never from a hand formula. A *history* is
the list ``[(noise_multiplier, sample_rate, num_steps), ...]`` of subsampled Gaussian
mechanism applications, the same representation Opacus uses, so it can be persisted (Flower
``Context.state``, checkpoints) and restored exactly.

This is used for record-level DP-SGD (steps = local DP-SGD steps, q = b/N) and for
client-level DP (steps = rounds the client could be sampled in, q = r/n) alike.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.accountant import IAccountant
from opacus.accountants.analysis import rdp as rdp_analysis

History = list[tuple[float, float, int]]
ACCOUNTANTS = {"rdp": RDPAccountant, "prv": PRVAccountant}


def make_accountant(kind: str = "rdp", history: Iterable[Sequence[float]] = ()) -> IAccountant:
    """An Opacus accountant of ``kind`` pre-loaded with ``history``."""
    if kind not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {kind!r}; valid: {sorted(ACCOUNTANTS)}")
    acc = ACCOUNTANTS[kind]()
    acc.history = compact_history(history)
    return acc


def compact_history(history: Iterable[Sequence[float]]) -> History:
    """Merge consecutive entries with equal (σ, q) — exact, since steps just add up."""
    out: History = []
    for z, q, steps in history:
        z, q, steps = float(z), float(q), int(steps)
        if steps <= 0:
            continue
        if out and out[-1][0] == z and out[-1][1] == q:
            out[-1] = (z, q, out[-1][2] + steps)
        else:
            out.append((z, q, steps))
    return out


@functools.lru_cache(maxsize=8192)
def _rdp_per_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one subsampled-Gaussian step at Opacus' default orders (Opacus' own analysis)."""
    return np.asarray(rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                               orders=RDPAccountant.DEFAULT_ALPHAS))


def _rdp_epsilon(hist: History, delta: float) -> float:
    """Exactly ``RDPAccountant(history).get_epsilon(delta)``: RDP composes additively and is linear in the
    step count, so the per-(σ, q) vectors are cached and scaled (a test checks equality with Opacus)."""
    rdp = sum(steps * _rdp_per_step(z, q) for z, q, steps in hist)
    eps, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


def epsilon_of(history: Iterable[Sequence[float]], delta: float, kind: str = "rdp") -> float:
    """ε spent by ``history`` at ``delta`` (0 for an empty history)."""
    hist = compact_history(history)
    if not hist:
        return 0.0
    if any(z <= 0 for z, _, _ in hist):
        return math.inf
    if kind == "rdp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return _rdp_epsilon(hist, delta)
    with warnings.catch_warnings():  # "optimal order is the largest alpha" while bisecting tiny σ
        warnings.simplefilter("ignore", UserWarning)
        return float(make_accountant(kind, hist).get_epsilon(delta=delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               kind: str = "rdp", rtol: float = 1e-3, prior: Iterable[Sequence[float]] = ()) -> float:
    """Smallest σ (to relative precision) such that ``prior + (σ, q, steps)`` spends at most ``target_epsilon``.

    Bisection on σ; ε(σ) is decreasing. The result satisfies
    ``target·(1 − rtol) ≤ ε ≤ target`` unless even σ → ∞ cannot meet the target (error).
    """
    if not target_epsilon > 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    prior = compact_history(prior)

    def eps(z: float) -> float:
        return epsilon_of(prior + [(z, sample_rate, steps)], delta, kind)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"cannot reach epsilon {target_epsilon} at delta {delta} with {steps} steps at q={sample_rate}")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        e = eps(mid)
        if e > target_epsilon:
            lo = mid
        else:
            hi = mid
            if e >= target_epsilon * (1 - rtol):
                break
        if hi - lo < 1e-9 * hi:
            break
    return hi
