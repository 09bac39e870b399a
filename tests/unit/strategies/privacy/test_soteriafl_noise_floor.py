"""SoteriaFL's σ_p calibration never asks an accountant about tiny noise (strategies.privacy.calibration.noise_floor).

Starting at σ_p = G/m put SVRG's subsampled term at z ≈ 0.007 (a9a client, m = 2930, b = m^{2/3}/4), where one
dp_accounting PLD call allocated more than 6 GB; the search now starts at a closed-form floor below which ε
certainly exceeds the target.
"""

from __future__ import annotations

import math

import pytest
from conftest import analytic_gaussian_epsilon

import strategies.soteriafl as sfl
from strategies.privacy.accountants import epsilon_of
from strategies.privacy.calibration import calibrate, gaussian_delta, noise_floor

A9A = {"epsilon": 5.0, "delta": 1e-3, "clip": 0.5, "m": 2930, "rounds": 100}


@pytest.mark.parametrize(("z", "delta"), [(0.5, 1e-3), (1.0, 1e-5), (4.0, 1e-6)])
def test_gaussian_delta_inverts_the_analytic_gaussian(z, delta):
    assert gaussian_delta(analytic_gaussian_epsilon(z, delta), z) == pytest.approx(delta, rel=1e-3)


@pytest.mark.parametrize("accountant", ["rdp", "dpa-pld", "dpa-pld-replace-one"])
@pytest.mark.parametrize(("estimator", "b", "split"), [("sgd", 46, 1.0), ("svrg", 51, 2 / 3), ("svrg", 51, 0.97),
                                                       ("gd", 2930, 1.0)])
def test_the_floor_misses_the_target(accountant, estimator, b, split):
    a = A9A
    unit = sfl.noise_history(estimator, 1.0, a["clip"], b, a["m"], a["rounds"], split)
    floor = noise_floor(unit, a["epsilon"], a["delta"])
    assert floor > a["clip"] / a["m"] / 10
    hist = sfl.noise_history(estimator, floor, a["clip"], b, a["m"], a["rounds"], split)
    assert epsilon_of(hist, a["delta"], accountant) > a["epsilon"]


def test_calibrate_never_probes_below_lower():
    probed: list[float] = []

    def eps(x: float) -> float:
        probed.append(x)
        return 1.0 / x

    x = calibrate(eps, 2.0, start=0.6, lower=0.6, rtol=1e-3)  # ε(0.6) = 1.67 meets the target: the floor itself
    assert x == 0.6 and min(probed) >= 0.6
    probed.clear()
    x = calibrate(eps, 2.0, start=0.1, lower=0.1, rtol=1e-3)
    assert 0.5 <= x <= 0.5 / (1 - 1e-3) and min(probed) >= 0.1


@pytest.mark.parametrize("estimator", ["sgd", "svrg"])
def test_a9a_calibration_never_probes_tiny_noise(monkeypatch, estimator):
    """Fails at once on the old start σ_p = G/m (first probe at z ≈ 0.007), before any large allocation."""
    a = A9A
    b = sfl.default_batch_size(estimator, a["m"], epsilon=a["epsilon"], delta=a["delta"], clip=a["clip"], d=123,
                               omega=19.5, n=10)
    calls: list[list[tuple[float, float, int]]] = []

    def guarded(history, delta, kind="rdp"):
        calls.append(list(history))
        assert min(z for z, q, _ in history if q < 1) > 0.25, f"accountant probed tiny noise: {history}"
        return epsilon_of(history, delta, kind)

    monkeypatch.setattr(sfl, "epsilon_of", guarded)
    sigma, split = sfl.calibrate_sigma.__wrapped__(estimator, a["epsilon"], a["delta"], a["clip"], b, a["m"],
                                                   a["rounds"], "rdp")
    assert len(calls) <= 8 * (1 if estimator == "sgd" else 3)
    eps = epsilon_of(sfl.noise_history(estimator, sigma, a["clip"], b, a["m"], a["rounds"], split), a["delta"])
    assert a["epsilon"] * 0.99 <= eps <= a["epsilon"]


def test_unreachable_target_is_refused():
    assert math.isinf(noise_floor([(1.0, 1.0, 1)], 1e-12, 1e-12))  # even z = 1e6 spends more than ε = 1e-12
    assert noise_floor([], 1.0, 1e-3) == 0.0
    with pytest.raises(ValueError, match="cannot reach"):
        sfl.calibrate_sigma.__wrapped__("gd", 1e-12, 1e-12, 0.5, 100, 100, 10)
