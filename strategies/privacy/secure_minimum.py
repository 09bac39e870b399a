"""The δ that a secure sum's minimum cohort adds to a guarantee amplified by Poisson client sampling.

SecAgg+ never unmasks a sum of fewer than k survivors (k = 3 here), so a round whose sample is smaller releases
nothing. The subsampled Gaussian accountant (Mironov et al. 2019) assumes every round releases the noisy sum. Under
amplification the sample is secret, and the threshold makes the target client's own presence decide whether a round
releases anything exactly when the other sampled clients number k − 1.

Bound (a coupling, add/remove adjacency D' = D ∪ {x}). Let M̃ release a round iff the *other* clients' sample has at
least k members, the rest as the run does. Its release decisions do not depend on x, so conditioned on them each
released round is the subsampled Gaussian pair, and M̃ is (ε, δ)-DP with the ε the ledger composes over the released
rounds (skipped rounds are charged nothing, correctly). The run M equals M̃ on D always, and on D' outside the event
B = ∪_t {x sampled in round t and exactly k − 1 others sampled}, so with η ≥ P(B):

    P[M(D') ∈ O] ≤ e^ε P[M(D) ∈ O] + δ + η,    P[M(D) ∈ O] ≤ e^ε P[M(D') ∈ O] + δ + e^ε η,

i.e. M is (ε, δ + e^ε η)-DP, with η = T · q · max_{m ∈ {n−1, n}} P[Bin(m, q) = k − 1] after T rounds (the union
bound; the others number n − 1 or n depending on which of D, D' holds n clients). Against the server that draws the
sample (q = 1) nothing is added: it knows the sample, and a skipped round tells it nothing it did not know.

The bound is loose by design (it gives the bad event away entirely); it is negligible when the expected cohort is
large (n = 5,900, r = 100: η < 1e-35) and large for small cohorts (n = 100, r = 10, T = 30: η ≈ 5e-3). Sampling a
fixed-size cohort would remove the event; that sampler and its accountant are not implemented.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strategies.privacy.mechanisms import ClientLevelDP

__all__ = ["binomial_pmf", "planned_delta", "secure_minimum_delta", "total_delta"]


def binomial_pmf(trials: int, rate: float, successes: int) -> float:
    """P[Bin(trials, rate) = successes], in log space (stable for thousands of trials)."""
    if successes < 0 or successes > trials:
        return 0.0
    if rate <= 0.0:
        return 1.0 if successes == 0 else 0.0
    if rate >= 1.0:
        return 1.0 if successes == trials else 0.0
    log_p = (math.lgamma(trials + 1) - math.lgamma(successes + 1) - math.lgamma(trials - successes + 1)
             + successes * math.log(rate) + (trials - successes) * math.log1p(-rate))
    return math.exp(log_p)


def secure_minimum_delta(num_clients: int, sample_rate: float, rounds: int, minimum: int) -> float:
    """η = T · q · max_{m ∈ {n−1, n}} P[Bin(m, q) = k − 1]: a bound on the probability that, in some of ``rounds``
    rounds sampled at ``sample_rate`` from ``num_clients``, the target's presence decides whether a sum of at least
    ``minimum`` clients is released (module docstring). 0 without amplification (q = 1) or without a minimum."""
    if not 0 < sample_rate < 1 or minimum <= 1 or rounds <= 0:
        return 0.0
    k = minimum - 1
    p = max(binomial_pmf(m, sample_rate, k) for m in (max(num_clients - 1, 0), num_clients))
    return min(1.0, rounds * sample_rate * p)


def total_delta(delta: float, epsilon: float, eta: float) -> float:
    """δ + e^ε η: the δ of the guarantee whose ε the accountant gives at ``delta`` (module docstring), at most 1."""
    if eta <= 0.0:
        return delta
    if epsilon > 700.0 or math.isinf(epsilon):  # e^ε η is then above 1 for any η the union bound yields
        return 1.0
    return min(1.0, delta + math.exp(epsilon) * eta)


def planned_delta(dp: ClientLevelDP, minimum: int) -> float:
    """The δ the budget's planned ε (all ``dp.rounds`` rounds at its accounted rate) holds at when a secure sum is
    released only from ``minimum`` clients: ``dp.delta`` plus the minimum's share; ``dp.delta`` without SecAgg+ or
    amplification. A discrete Gaussian secure sum is never amplified: its callers do not ask."""
    if not dp.secure_aggregation:
        return dp.delta
    eta = secure_minimum_delta(dp.num_clients, dp.accounted_sample_rate, dp.rounds, minimum)
    return total_delta(dp.delta, dp.epsilon(), eta) if eta > 0 else dp.delta
