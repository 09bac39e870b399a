"""SoteriaFL-SAGA's subsampled term is charged without amplification: its table's hidden state
breaks the amplification argument, while SVRG's shared snapshot does not."""

from __future__ import annotations

import pytest

from strategies.privacy.accountants import epsilon_of
from strategies.soteriafl import calibrate_sigma, noise_history


def test_saga_charges_its_subsampled_term_at_q_1_and_svrg_amplifies():
    saga = noise_history("saga", 0.02, 1.0, 54, 3256, 100, split=0.9)
    svrg = noise_history("svrg", 0.02, 1.0, 54, 3256, 100, split=0.9)
    assert [q for _, q, _ in saga] == [1.0, 1.0]
    assert [q for _, q, _ in svrg] == [pytest.approx(54 / 3256), 1.0]
    assert [z for z, _, _ in saga] == [z for z, _, _ in svrg]  # same noise, only the charge differs
    assert epsilon_of(saga, 1e-3) > 10 * epsilon_of(svrg, 1e-3)


def test_saga_is_calibrated_for_the_unamplified_charge():
    sigma, split = calibrate_sigma("saga", 5.0, 1e-3, 1.0, 54, 3256, 100)
    assert epsilon_of(noise_history("saga", sigma, 1.0, 54, 3256, 100, split), 1e-3) <= 5.0
    assert sigma > 5 * calibrate_sigma("svrg", 5.0, 1e-3, 1.0, 54, 3256, 100)[0]
