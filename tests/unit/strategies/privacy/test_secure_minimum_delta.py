"""SecAgg+'s minimum cohort under amplification by secret Poisson sampling: a round whose other sampled clients number
exactly k − 1 releases a sum only if the target is sampled. The subsampled Gaussian accountant does not model that;
:mod:`strategies.privacy.secure_minimum` bounds what it adds to δ, and the accounting reports the guarantee's δ."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from strategies.privacy.accountants import epsilon_of
from strategies.privacy.ledger import PrivacyLedger
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.privacy.secure_minimum import binomial_pmf, secure_minimum_delta, total_delta
from strategies.server.client_accounting import ClientLevelAccounting
from strategies.server.secure_sum import MIN_SECURE_SURVIVORS


def test_binomial_pmf_matches_scipy_in_small_and_large_federations() -> None:
    for trials, rate in ((4, 0.5), (99, 0.1), (5899, 100 / 5900)):
        for j in (0, 1, 2, 7):
            assert binomial_pmf(trials, rate, j) == pytest.approx(binom.pmf(j, trials, rate), rel=1e-9, abs=1e-300)
    assert binomial_pmf(3, 0.2, 4) == 0.0 and binomial_pmf(3, 1.0, 3) == 1.0


def test_the_bound_is_zero_without_amplification_and_grows_with_rounds() -> None:
    assert secure_minimum_delta(100, 1.0, 30, MIN_SECURE_SURVIVORS) == 0.0  # against the server: q = 1
    assert secure_minimum_delta(100, 0.1, 30, 1) == 0.0  # no minimum
    one = secure_minimum_delta(100, 0.1, 1, MIN_SECURE_SURVIVORS)
    assert one == pytest.approx(0.1 * max(binom.pmf(2, 99, 0.1), binom.pmf(2, 100, 0.1)))
    assert secure_minimum_delta(100, 0.1, 30, MIN_SECURE_SURVIVORS) == pytest.approx(30 * one)
    assert secure_minimum_delta(5900, 100 / 5900, 100, MIN_SECURE_SURVIVORS) < 1e-35  # large cohorts: negligible
    assert total_delta(1e-5, 2.0, 0.0) == 1e-5 and total_delta(1e-5, 1e4, 1e-9) == 1.0


def _hockey_stick(p_bot: float, p_mix: list[tuple[float, float]], q_bot: float, q_mix: list[tuple[float, float]],
                  eps: float, sigma: float) -> float:
    """sup_O P(O) − e^ε Q(O) for two laws on {⊥} ∪ ℝ: a point mass at ⊥ and mixtures of N(μ, σ²) (weight, μ)."""
    y = np.linspace(-12 * sigma, 1 + 12 * sigma, 200_001)
    dens_p = sum(w * norm.pdf(y, mu, sigma) for w, mu in p_mix)
    dens_q = sum(w * norm.pdf(y, mu, sigma) for w, mu in q_mix)
    continuous = float(np.trapezoid(np.maximum(dens_p - math.exp(eps) * dens_q, 0.0), y))
    return continuous + max(p_bot - math.exp(eps) * q_bot, 0.0)


@pytest.mark.parametrize("others,q", [(9, 0.3), (19, 0.25)])
def test_one_threshold_round_stays_within_the_bound_and_costs_more_than_the_accountant_says(others: int, q: float) -> None:
    """One round, sensitivity 1, σ = 1, the other clients' updates zero: the exact δ(ε) of the thresholded release
    (⊥ below k sampled) in both directions is at most the subsampled Gaussian's δ(ε) plus e^ε η, and above the
    subsampled Gaussian's alone at some ε (the threshold is a real cost, not an artefact of the bound)."""
    sigma, k = 1.0, MIN_SECURE_SURVIVORS
    at_most = {j: float(binom.cdf(j, others, q)) for j in (k - 2, k - 1)}
    # D: the others alone. D': the others and the target x (update 1), sampled with probability q.
    d_bot, d_mix = at_most[k - 1], [(1 - at_most[k - 1], 0.0)]
    d2_bot = (1 - q) * at_most[k - 1] + q * at_most[k - 2]
    d2_mix = [((1 - q) * (1 - at_most[k - 1]), 0.0), (q * (1 - at_most[k - 2]), 1.0)]
    sg_d, sg_d2 = [(1.0, 0.0)], [(1 - q, 0.0), (q, 1.0)]
    eta = q * binom.pmf(k - 1, others, q)
    assert secure_minimum_delta(others + 1, q, 1, k) >= eta * (1 - 1e-12)
    excess = []
    for eps in (0.1, 0.5, 1.0, 2.0):
        for (pb, pm, qb, qm), (sp, sq) in (((d2_bot, d2_mix, d_bot, d_mix), (sg_d2, sg_d)),
                                           ((d_bot, d_mix, d2_bot, d2_mix), (sg_d, sg_d2))):
            exact = _hockey_stick(pb, pm, qb, qm, eps, sigma)
            accountant = _hockey_stick(0.0, sp, 0.0, sq, eps, sigma)
            assert exact <= accountant + math.exp(eps) * eta + 1e-6
            excess.append(exact - accountant)
    assert max(excess) > 1e-4


def _accounting(adversary: str) -> ClientLevelAccounting:
    dp = ClientLevelDP(1.5, 1.0, 10, 100, 30, 0.01, secure_aggregation=True, adversary=adversary)
    acc = ClientLevelAccounting(PrivacyLedger("rdp"))
    acc.bind(dp, None)  # continuous Gaussian shares: the release is amplified at q = r/n
    return acc


def _run_rounds(acc: ClientLevelAccounting, rounds: int) -> dict:
    out: dict = {}
    for t in range(1, rounds + 1):
        records = [{"client_id": i, "status": "ok"} for i in range(10)]
        out = acc.round_record(t, [], records, 10, secure=_Secure(), clip=None, count_in_sum=False)
    return out


class _Secure:
    """The secure sum's state of a round every sampled client survived."""
    unreleased = None
    contributors = 10
    count_sum = None

    def withhold_rejected(self, server_round: int, records: list) -> bool:
        return False


def test_the_release_adversarys_budget_reports_the_delta_its_epsilon_holds_at() -> None:
    acc = _accounting("release")
    out = _run_rounds(acc, 5)
    eta = secure_minimum_delta(100, 0.1, 5, MIN_SECURE_SURVIVORS)
    eps = epsilon_of([(1.5, 0.1, 5)], 0.01, "rdp")
    assert out["epsilon"] == pytest.approx(eps)
    assert out["delta_secure_minimum"] == pytest.approx(eta)
    assert out["delta_total"] == pytest.approx(0.01 + math.exp(eps) * eta)
    assert out["delta_vs_release"] == pytest.approx(0.01 + math.exp(out["epsilon_vs_release"]) * eta)


def test_against_the_server_the_budget_needs_no_extra_delta_but_the_release_view_does() -> None:
    out = _run_rounds(_accounting("server"), 5)
    assert "delta_total" not in out and "delta_secure_minimum" not in out
    assert out["delta_vs_release"] > 0.01


def test_the_discrete_gaussian_is_never_amplified_so_it_adds_nothing() -> None:
    acc = _accounting("server")
    acc.ddg = object()  # type: ignore[assignment]  # only its presence is read here
    assert acc.minimum_cohort_delta(0.1, 30) == 0.0


def test_a_release_budget_whose_delta_the_minimum_cohort_voids_is_refused_before_the_run() -> None:
    """Through the run-config: the δ with the minimum cohort's share above 1/(10 n) is refused, naming the keys,
    unless allow-large-delta; the same federation against the server, or with a larger cohort, is not."""
    from fedapp.config import ConfigError, resolve_config
    from fedapp.privacy.profiles import client_level_mechanism

    base = {"strategy": "dp-fedavg", "num-server-rounds": 10, "target-epsilon": 2.0, "secagg-mechanism": "gaussian",
            "client-dp-adversary": "release"}

    def mechanism(**extra: object) -> ClientLevelDP:
        cfg = resolve_config(None, {**base, **extra})
        return client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 20)

    with pytest.raises(ConfigError, match="'client-dp-adversary' = 'release' with clients-per-round = 5 of 20.*"
                                          "allow-large-delta"):
        mechanism(**{"clients-per-round": 5})
    assert mechanism(**{"clients-per-round": 5, "allow-large-delta": True}).adversary == "release"
    assert mechanism(**{"clients-per-round": 5, "client-dp-adversary": "server"}).adversary == "server"
    big = mechanism(**{"clients-per-round": 18})  # q = 0.9: P[Bin(19, 0.9) = 2] is negligible
    assert secure_minimum_delta(20, big.sample_rate, 10, MIN_SECURE_SURVIVORS) < 1e-12
