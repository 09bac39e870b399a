"""The ledger's cross-check of client-reported ε under the distributed discrete Gaussian.

Clients account the continuous plan σ; the server charges the discrete sum's Gaussian equivalent z, calibrated to
be ≥ σ for a full round. Their ε then agree up to the calibration's tolerance, from above only; a round with a
dropped client (z < σ) must still be flagged."""

from __future__ import annotations

import pytest

from strategies.privacy.accountants import epsilon_of
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ledger import PrivacyLedger

SIGMA, N, DIM, BITS, DELTA = 1.0, 20, 28_938, 20, 5e-3


@pytest.fixture(scope="module")
def ddg() -> DistributedDiscreteGaussian:
    return DistributedDiscreteGaussian.calibrated(SIGMA, clip=1.0, max_cohort=N, dim=DIM, bits=BITS)


def ledger_after(z_rounds: list[float], slack: float) -> PrivacyLedger:
    ledger = PrivacyLedger("rdp", report_slack=slack)
    ledger.charge_population([(z, 1.0, 1) for z in z_rounds], DELTA)
    ledger.register(7)
    return ledger


def test_full_rounds_agree_with_the_plan_only_with_the_slack(ddg: DistributedDiscreteGaussian) -> None:
    z = ddg.gaussian_equivalent(10, 10)  # every sampled client summed, any cohort size
    assert z > SIGMA and z == pytest.approx(ddg.gaussian_equivalent(N, N), rel=1e-12)
    slack = ddg.report_slack(SIGMA)
    assert slack == pytest.approx(2 * (z / SIGMA - 1), rel=1e-12)
    for rounds in (1, 4, 30):
        reported = epsilon_of([(SIGMA, 1.0, rounds)], DELTA, "rdp")  # what the client accounts
        assert ledger_after([z] * rounds, 0.0).mismatch(7, reported) is not None  # without slack: a false alarm
        ledger = ledger_after([z] * rounds, slack)
        assert ledger.epsilon(7) < reported
        assert ledger.mismatch(7, reported) is None


def test_a_report_below_the_ledger_or_past_the_slack_is_flagged(ddg: DistributedDiscreteGaussian) -> None:
    z = ddg.gaussian_equivalent(10, 10)
    slack = ddg.report_slack(SIGMA)
    ledger = ledger_after([z] * 4, slack)
    ours = ledger.epsilon(7)
    assert ledger.mismatch(7, ours * (1 - 1e-4)) is not None
    assert ledger.mismatch(7, ours * (1 + 2 * slack)) is not None


def test_a_dropout_round_is_flagged(ddg: DistributedDiscreteGaussian) -> None:
    """9 of 10 summed: the sum carries less noise than σ, so the ledger's ε exceeds the client's plan."""
    z_full, z_drop = ddg.gaussian_equivalent(10, 10), ddg.gaussian_equivalent(9, 10)
    assert z_drop < SIGMA
    ledger = ledger_after([z_full, z_drop], ddg.report_slack(SIGMA))
    reported = epsilon_of([(SIGMA, 1.0, 2)], DELTA, "rdp")
    assert ledger.epsilon(7) > reported
    assert ledger.mismatch(7, reported) is not None
