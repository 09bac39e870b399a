"""strategies.privacy.ftrl_accounting: ε of DP-FTRL as one Gaussian mechanism, its calibration and ledger view."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from conftest import analytic_gaussian_epsilon
from dp_accounting import rdp

from strategies.privacy import ftrl_accounting as fa
from strategies.privacy import matrix_mechanism as mm


@pytest.mark.parametrize(("z", "sens", "delta"), [(1.0, 1.0, 1e-5), (3.0, math.sqrt(7), 1e-6), (25.0, 2.0, 1e-4),
                                                  (0.7, 1.0, 1e-3), (10.0, 4.0, 1e-5)])
def test_epsilon_agrees_with_an_independent_analytic_gaussian(z, sens, delta):
    eps = fa.ftrl_epsilon(z, sens, delta)
    exact = analytic_gaussian_epsilon(z / sens, delta)
    assert eps == pytest.approx(exact, rel=0.01)
    assert eps >= exact * (1 - 1e-6)  # the PLD discretisation is pessimistic
    assert fa.zcdp_epsilon(z, sens, delta) >= eps


def test_the_event_composes_in_other_accountants():
    event = fa.ftrl_event(6.0, 3.0)
    assert isinstance(event, dpa.GaussianDpEvent) and event.noise_multiplier == pytest.approx(2.0)
    acc = rdp.RdpAccountant()
    acc.compose(event)
    assert acc.get_epsilon(1e-5) >= fa.ftrl_epsilon(6.0, 3.0, 1e-5)


@pytest.mark.parametrize(("target", "delta"), [(0.5, 1e-5), (2.0, 1e-6), (8.0, 1e-4)])
def test_calibration_round_trips(target, delta):
    sens = math.sqrt(5.0)
    z = fa.ftrl_noise_multiplier(target, delta, sens)
    assert target * (1 - 1e-3) <= fa.ftrl_epsilon(z, sens, delta) <= target
    assert analytic_gaussian_epsilon(z / sens, delta) == pytest.approx(target, rel=0.01)
    assert fa.ftrl_noise_multiplier(target, delta, 2 * sens) == pytest.approx(2 * z, rel=2e-3)


def test_ledger_is_monotone_and_ends_at_the_run_epsilon():
    t, z, delta = 16, 4.0, 1e-5
    tree = mm.tree_aggregation(t)
    # by round t the first leaf lies in the complete nodes of levels 0..⌊log₂ t⌋
    sens = fa.ledger_sensitivities(tree)
    assert np.allclose(sens**2, [math.floor(math.log2(r)) + 1 for r in range(1, t + 1)])
    for f, k, sep in [(tree, 1, 1), (tree, 3, 4), (mm.banded_factorization(t, 3), 2, 3),
                      (mm.tree_aggregation(t, restart_every=4), 4, 4)]:
        eps = fa.ledger_epsilons(f, z, delta, k, sep)
        assert np.all(np.diff(eps) >= 0), f.name
        assert eps[-1] == pytest.approx(fa.ftrl_epsilon(z, mm.sensitivity(f.encoder, k, sep), delta)), f.name
    ident = fa.ledger_epsilons(mm.identity_factorization(t), z, delta)
    assert np.allclose(ident, fa.ftrl_epsilon(z, 1.0, delta))  # one participation: spent at once
    full = fa.ledger_epsilons(mm.identity_factorization(t), z, delta, t, 1)  # every round: sens_t = √t
    assert np.allclose(full, [fa.ftrl_epsilon(z, math.sqrt(r), delta) for r in range(1, t + 1)])


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="delta must be in \\(0, 1\\), got 1.5"):
        fa.ftrl_epsilon(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="noise multiplier must be a finite number > 0, got 0.0"):
        fa.ftrl_epsilon(0.0, 1.0, 1e-5)
    with pytest.raises(ValueError, match="sensitivity must be a finite number > 0, got -2.0"):
        fa.zcdp_epsilon(1.0, -2.0, 1e-5)
    with pytest.raises(ValueError, match="target epsilon must be a finite number > 0, got 0.0"):
        fa.ftrl_noise_multiplier(0.0, 1e-5, 1.0)
