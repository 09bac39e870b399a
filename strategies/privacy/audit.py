"""Empirical privacy: what canaries inserted into a run reveal, beside the accountant's upper bound.

Two estimators, each from one training run:

* :func:`one_shot_estimate` (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy
  Estimation for Federated Learning", ICLR 2024, Alg. 1-2). Canary clients send a fixed random unit direction u_j
  (scaled to the clip norm) through the run's mechanism; the statistic of canary j is the cosine between u_j and the
  model's change (the final model's, or, for an adversary who sees every round's model, the largest cosine over the
  rounds' changes). The statistics of the inserted canaries and of directions never inserted are fitted with two
  Gaussians of one pooled variance, and the estimate is the ε at δ of telling them apart: μ-GDP with μ = the gap of
  the means over the pooled standard deviation (:func:`gdp_epsilon`). In high dimension a never-inserted direction's
  cosine is ≈ N(0, 1/d) and an inserted one's is shifted by the signal the mechanism lets through, with about the same
  spread, so for a Gaussian mechanism whose noise dominates the model's change the estimate approaches the mechanism's
  own ε. (Fitting the two variances apart lets a sampling difference of the spreads dominate at small δ.) It is an
  estimate, not a bound: a confidence interval comes from the bootstrap.
* :func:`one_run_lower_bound` (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023,
  Thm 5.2 / Prop. 5.7): m canaries, each included independently with probability ½; an auditor guesses membership for
  r of them and gets v right. If the run is (ε, δ)-DP, P[V ≥ v] ≤ β + 2mδ·α with β = P[Binomial(r, e^ε/(1+e^ε)) ≥ v]
  and α = max_{1≤i≤v} (P[Binomial(r, ·) ≥ v − i] − β)/i; the lower bound is the largest ε that this rejects at the
  chosen confidence. It is a statistically valid lower bound: an accountant ε below it means the run leaks more than
  its accountant says (at that confidence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, special, stats


# ----------------------------------------------------------------------------- canaries
def canary_directions(seed: int, count: int, dim: int, first: int = 0) -> np.ndarray:
    """``count`` independent uniformly random unit vectors in R^dim (rows), canaries ``first`` … ``first+count−1`` of
    the stream ``seed``: canary j is the same vector whoever draws it (a canary client and the auditor)."""
    out = np.empty((count, dim), dtype=np.float64)
    for row, j in enumerate(range(first, first + count)):
        v = np.random.default_rng([int(seed), 907, j]).standard_normal(dim)
        out[row] = v / np.linalg.norm(v)
    return out


def cosines(directions: np.ndarray, change: np.ndarray) -> np.ndarray:
    """cos(u_j, change) for every row u_j (unit rows); 0 when the change is zero."""
    norm = float(np.linalg.norm(change))
    if norm == 0.0:
        return np.zeros(len(directions))
    return directions @ (np.asarray(change, dtype=np.float64) / norm)


# ----------------------------------------------------------------------------- Gaussian statistics
def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP, i.e. of telling N(0, 1) from N(μ, 1): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su 2022,
    Cor. 2.13)."""
    if mu <= 0:
        return 0.0
    return float(stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with :func:`gdp_delta` (ε, μ) ≤ ``delta``: the ε of a Gaussian mechanism with multiplier
    1/μ."""
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta} must be in (0, 1)")
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2
        if hi > 1e5:
            return math.inf
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-9))


@dataclass(frozen=True)
class Estimate:
    """An empirical ε with its bootstrap interval (``low``, ``high``), from ``inserted`` and ``null`` statistics."""

    epsilon: float
    low: float
    high: float
    inserted: int
    null: int

    def as_dict(self) -> dict[str, Any]:
        return {"epsilon_estimate": self.epsilon, "epsilon_interval": [self.low, self.high],
                "canaries_inserted": self.inserted, "canaries_null": self.null}


def _fit_epsilon(inserted: np.ndarray, null: np.ndarray, delta: float) -> float:
    """ε at δ of two Gaussians fitted with one pooled variance: μ = |mean(inserted) − mean(null)| / s_pooled."""
    pooled = math.sqrt(((len(inserted) - 1) * np.var(inserted, ddof=1) + (len(null) - 1) * np.var(null, ddof=1))
                       / (len(inserted) + len(null) - 2))
    if pooled == 0.0:
        return math.inf if float(np.mean(inserted)) != float(np.mean(null)) else 0.0
    return gdp_epsilon(abs(float(np.mean(inserted)) - float(np.mean(null))) / pooled, delta)


def one_shot_estimate(inserted: Sequence[float] | np.ndarray, null: Sequence[float] | np.ndarray, delta: float, *, confidence: float = 0.95,
                      resamples: int = 200, seed: int = 0) -> Estimate:
    """Andrew et al.'s estimate from the statistics of inserted canaries and of never-inserted directions, with a
    percentile bootstrap interval at ``confidence`` (both samples resampled with replacement)."""
    a, b = np.asarray(inserted, dtype=np.float64), np.asarray(null, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"need at least 2 inserted and 2 null statistics, got {len(a)} and {len(b)}")
    point = _fit_epsilon(a, b, delta)
    rng = np.random.default_rng([int(seed), 911])
    boots = [_fit_epsilon(rng.choice(a, len(a)), rng.choice(b, len(b)), delta) for _ in range(int(resamples))]
    tail = (1 - confidence) / 2
    low, high = (float(np.quantile(boots, q)) for q in (tail, 1 - tail))
    return Estimate(point, low, high, len(a), len(b))


# ----------------------------------------------------------------------------- one run, m canaries
def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[V ≥ correct] for an (ε, δ)-DP run (Steinke et al. 2023, Thm 5.2)."""
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got {correct}, {guesses}, {m}")
    p = float(special.expit(epsilon))
    beta = float(stats.binom.sf(correct - 1, guesses, p))
    if delta == 0 or correct == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    alpha = float(np.max((stats.binom.sf(correct - i - 1, guesses, p) - beta) / i, initial=0.0))
    return min(beta + 2 * m * delta * alpha, 1.0)


def one_run_lower_bound(m: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε that ``correct`` right guesses out of ``guesses`` (``m`` canaries) reject at ``confidence``: the
    run is not (ε', δ)-DP for any ε' below it, with probability ≥ ``confidence``. 0 when nothing is rejected."""
    alpha = 1 - confidence
    if guesses == 0 or one_run_p_value(m, guesses, correct, 0.0, delta) > alpha:
        return 0.0
    hi = 1.0
    while one_run_p_value(m, guesses, correct, hi, delta) <= alpha:
        hi *= 2
        if hi > 1e3:
            return math.inf
    return float(optimize.brentq(lambda e: one_run_p_value(m, guesses, correct, e, delta) - alpha, 0.0, hi, xtol=1e-6))


#: the guess counts (fractions of m) :func:`audit_scores` tries, fixed before any run; Bonferroni over them
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2)


def audit_scores(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, delta: float,
                 confidence: float = 0.95) -> dict[str, float | int]:
    """The one-run lower bound from canary ``scores`` (higher = more likely included) and the truth ``included``:
    for each r = f·m (f in :data:`GUESS_FRACTIONS`), guess "in" for the r/2 highest and "out" for the r/2 lowest
    scores; the bound is the largest over r, each at confidence 1 − (1 − ``confidence``)/len(fractions)."""
    s, truth = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(s)
    if m < 2 or len(truth) != m:
        raise ValueError(f"need at least 2 canaries with a truth each, got {m} scores and {len(truth)} labels")
    order = np.argsort(s, kind="stable")
    level = 1 - (1 - confidence) / len(GUESS_FRACTIONS)
    best: dict[str, float | int] = {"epsilon_lower_bound": 0.0, "guesses": 0, "correct": 0, "canaries": m}
    for f in GUESS_FRACTIONS:
        half = max(1, int(round(f * m / 2)))
        if 2 * half > m:
            continue
        correct = int(np.sum(truth[order[-half:]])) + int(np.sum(~truth[order[:half]]))
        bound = one_run_lower_bound(m, 2 * half, correct, delta, level)
        if bound > float(best["epsilon_lower_bound"]) or not best["guesses"]:
            best = {"epsilon_lower_bound": bound, "guesses": 2 * half, "correct": correct, "canaries": m}
    best["confidence"] = confidence
    return best
