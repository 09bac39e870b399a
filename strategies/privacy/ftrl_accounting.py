"""Privacy of DP-FTRL / the matrix mechanism, without amplification by sampling or shuffling.

The whole run releases C X + Z with Z ~ N(0, (z·clip)²) per entry, and one client moves C X by at most
clip·sens(C) in Frobenius norm (:func:`strategies.privacy.matrix_mechanism.sensitivity`). It is therefore ONE
Gaussian mechanism with multiplier z / sens(C) (Kairouz et al. 2021; Choquette-Choo et al. 2023),
whoever draws the participation pattern: the ε holds against the server. ε comes from Google dp_accounting's PLD
accountant on a ``GaussianDpEvent`` (tight for one Gaussian, within discretisation of the analytic Gaussian
mechanism of Balle & Wang 2018); :func:`zcdp_epsilon` is the looser closed form ρ + 2√(ρ log(1/δ)),
ρ = sens²/(2z²) (Bun & Steinke 2016, Prop. 1.3). Neighbours add/remove (zero out) one client's participations.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from strategies.privacy.calibration import calibrate
from strategies.privacy.matrix_mechanism import Factorization, FloatArray, sensitivity

#: PLD discretisation of the privacy-loss values (pessimistic; within 0.1 % of the analytic Gaussian for z ≤ 100)
PLD_INTERVAL = 1e-3


def _check(noise_multiplier: float, sens: float, delta: float) -> None:
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be a finite number > 0, got {noise_multiplier}")
    if not (sens > 0 and math.isfinite(sens)):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sens}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def ftrl_event(noise_multiplier: float, sens: float) -> Any:  # a dp_accounting.GaussianDpEvent (untyped package)
    """The run as one dp_accounting event, for a ledger that composes it with other mechanisms."""
    import dp_accounting as dpa

    _check(noise_multiplier, sens, 0.5)
    return dpa.GaussianDpEvent(noise_multiplier / sens)


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(effective_multiplier: float, delta: float) -> float:
    """ε at δ of one Gaussian mechanism with noise std / sensitivity = ``effective_multiplier`` (dp_accounting PLD)."""
    from dp_accounting import pld

    _check(effective_multiplier, 1.0, delta)
    accountant = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    accountant.compose(ftrl_event(effective_multiplier, 1.0))
    return max(float(accountant.get_epsilon(delta)), 0.0)


def ftrl_epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """ε of the run: Z's std is ``noise_multiplier``·clip and the encoder's sensitivity ``sens``."""
    _check(noise_multiplier, sens, delta)
    return gaussian_epsilon(noise_multiplier / sens, delta)


def zcdp_epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """The ρ-zCDP bound: ρ = sens²/(2z²), ε = ρ + 2√(ρ log(1/δ)) (≥ :func:`ftrl_epsilon`)."""
    _check(noise_multiplier, sens, delta)
    rho = sens**2 / (2.0 * noise_multiplier**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def ftrl_noise_multiplier(target_epsilon: float, delta: float, sens: float, rtol: float = 1e-3) -> float:
    """The smallest z (Z's std over the clip) whose run spends at most ``target_epsilon``: z = z_eff·sens with
    z_eff the calibrated Gaussian multiplier (:func:`strategies.privacy.calibration.calibrate`), so
    target·(1 − rtol) ≤ ε ≤ target."""
    _check(1.0, sens, delta)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    start = math.sqrt(2.0 * math.log(1.25 / delta)) / target_epsilon  # Dwork & Roth, Thm A.1
    z_eff = calibrate(lambda z: gaussian_epsilon(z, delta), target_epsilon, start=start, rtol=rtol,
                      what=f"Gaussian multiplier (delta={delta})")
    return z_eff * sens


def ledger_sensitivities(factorization: Factorization, participations: int = 1,
                         min_separation: int = 1) -> FloatArray:
    """sens_t, t = 1..T: the sensitivity of the rows released within the first t rounds (they read only the
    first t columns). Nondecreasing, sens_T = sens(C)."""
    return np.array([sensitivity(factorization.released_encoder(t), participations, min_separation)
                     for t in range(1, factorization.rounds + 1)])


def ledger_epsilons(factorization: Factorization, noise_multiplier: float, delta: float, participations: int = 1,
                    min_separation: int = 1) -> FloatArray:
    """ε_t after t of T rounds: the Gaussian mechanism with multiplier z / sens_t (:func:`ledger_sensitivities`).

    ε_t is cumulative (the released prefix of one mechanism), nondecreasing, and equals :func:`ftrl_epsilon` at
    t = T; a server ledger records ε_t as ``epsilon_vs_server`` rather than adding per-round charges. A round in
    which nothing new reaches the client's columns leaves ε_t unchanged.
    """
    sens = ledger_sensitivities(factorization, participations, min_separation)
    return np.array([ftrl_epsilon(noise_multiplier, float(s), delta) if s > 0 else 0.0 for s in sens])
