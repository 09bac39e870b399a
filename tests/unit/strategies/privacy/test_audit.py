"""The audit estimators against mechanisms whose ε is known: a Gaussian mechanism for the one-shot estimate (Andrew et
al. 2024), randomized response for the one-run lower bound (Steinke, Nasr, Jagielski 2023)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from strategies.privacy.audit import (
    audit_scores,
    canary_directions,
    cosines,
    gdp_epsilon,
    one_run_lower_bound,
    one_run_p_value,
    one_shot_estimate,
)
from strategies.privacy.ftrl_accounting import gaussian_epsilon


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 4.0])
def test_gdp_epsilon_is_the_gaussian_mechanisms(sigma) -> None:
    assert gdp_epsilon(1 / sigma, 1e-5) == pytest.approx(gaussian_epsilon(sigma, 1e-5), rel=1e-5)


def test_one_shot_estimate_recovers_a_gaussian_mechanisms_epsilon() -> None:
    """T rounds of a Gaussian sum: each canary adds its unit direction u_j every round, the release adds N(0, σ² I_d);
    in high dimension the final model's cosines give μ = √T/σ, the mechanism's own μ-GDP."""
    d, k, rounds, sigma, delta = 4000, 200, 4, 2.0, 1e-5
    rng = np.random.default_rng(0)
    u = canary_directions(7, k, d)
    change = rounds * u.sum(axis=0) + rng.normal(0, sigma * math.sqrt(rounds), d)
    null = canary_directions(7, 1000, d, first=k)
    est = one_shot_estimate(cosines(u, change), cosines(null, change), delta)
    true = gaussian_epsilon(sigma / math.sqrt(rounds), delta)
    assert est.low <= true <= est.high and est.epsilon == pytest.approx(true, rel=0.25)
    quiet = rounds * u.sum(axis=0) + rng.normal(0, 0.1 * sigma * math.sqrt(rounds), d)  # the noise cut tenfold
    assert one_shot_estimate(cosines(u, quiet), cosines(null, quiet), delta).low > true


def test_canary_directions_are_unit_and_the_same_for_whoever_draws_them() -> None:
    u = canary_directions(3, 5, 50)
    np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0)
    np.testing.assert_array_equal(u[2], canary_directions(3, 1, 50, first=2)[0])
    assert not np.allclose(u[0], canary_directions(4, 1, 50)[0])


def test_one_run_p_value_at_delta_zero_is_a_binomial_tail() -> None:
    p = special.expit(1.0)
    assert one_run_p_value(500, 60, 50, 1.0, 0.0) == pytest.approx(stats.binom.sf(49, 60, p))
    assert one_run_p_value(500, 60, 50, 1.0, 1e-4) > one_run_p_value(500, 60, 50, 1.0, 0.0)
    # r = 100 guesses all right with δ = 0: rejected exactly while p(ε)^100 <= 0.05
    assert one_run_lower_bound(1000, 100, 100, 0.0) == pytest.approx(special.logit(0.05 ** (1 / 100)), abs=1e-5)


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_one_run_lower_bound_never_exceeds_a_randomized_responses_epsilon_and_comes_close(epsilon) -> None:
    """ε-DP randomized response on each of m canaries: the score reports membership truthfully with probability
    e^ε/(1+e^ε). Over 40 independent runs the 95 % bound exceeds ε at most a few times, and it gets near ε."""
    m, above, bounds = 2000, 0, []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        truthful = rng.random(m) < special.expit(epsilon)
        scores = np.where(included == truthful, 1.0, -1.0) + rng.normal(0, 1e-6, m)  # ties broken at random
        result = audit_scores(scores, included, delta=0.0)
        bounds.append(float(result["epsilon_lower_bound"]))
        above += bounds[-1] > epsilon
    assert above <= 4  # ~5 % expected at most; 4 of 40 is p < 0.15 under Binomial(40, 0.05)
    assert max(bounds) > 0.5 * epsilon


def test_audit_scores_refuses_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="at least 2 canaries"):
        audit_scores([0.1, 0.2, 0.3], [True, False], 1e-5)
