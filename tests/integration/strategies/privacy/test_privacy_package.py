"""strategies.privacy and strategies.server: accountants, the one calibrator, the ledger, sampling, identity, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from strategies.privacy.accountants import (
    ACCOUNTANTS,
    DPAccountingPLD,
    DPAccountingRDP,
    OpacusRDP,
    WithoutReplacementRDP,
    epsilon_of,
    get_accountant,
)
from strategies.privacy.budget import budget_refusal, exceeds_budget
from strategies.privacy.calibration import calibrate, calibrate_noise_multiplier
from strategies.privacy.ledger import PrivacyLedger
from strategies.server.identity import IdentityBinding
from strategies.server.sampling import ClientSampler
from strategies.server.validation import RejectedUpdate, StrikeRecord, UpdateValidator

HIST = [(1.1, 0.05, 300), (0.9, 0.1, 50)]


def test_every_accountant_has_the_same_interface_and_agrees_with_opacus_rdp():
    opacus = RDPAccountant()
    opacus.history = list(HIST)
    reference = opacus.get_epsilon(1e-5)
    assert OpacusRDP().epsilon(HIST, 1e-5) == pytest.approx(reference, rel=1e-12)
    assert DPAccountingRDP().epsilon(HIST, 1e-5) == pytest.approx(reference, rel=0.02)  # other RDP orders
    pld = DPAccountingPLD().epsilon(HIST, 1e-5)
    assert pld < reference  # PLD is tighter than RDP
    assert get_accountant("prv").epsilon(HIST, 1e-5) == pytest.approx(pld, rel=0.05)
    for kind in ACCOUNTANTS:
        acc = get_accountant(kind)
        assert acc.epsilon([], 1e-5) == 0.0
        assert acc.epsilon([(0.0, 0.1, 3)], 1e-5) == math.inf


def test_sampling_without_replacement_costs_more_than_poisson_at_the_same_rate():
    """The gap the privacy issue measured: n = 10, r = 5, σ = 1, 6 rounds, δ = 1e-3."""
    hist = [(1.0, 0.5, 6)]
    poisson = epsilon_of(hist, 1e-3, "dpa-rdp")
    wor_c = WithoutReplacementRDP(10, sensitivity_factor=1.0).epsilon(hist, 1e-3)
    wor_2c = WithoutReplacementRDP(10).epsilon(hist, 1e-3)
    assert poisson == pytest.approx(6.51, abs=0.02)
    assert wor_c == pytest.approx(9.44, abs=0.05) and wor_2c == pytest.approx(25.6, abs=0.2)
    with pytest.raises(ValueError, match="r/n"):
        WithoutReplacementRDP(10).epsilon([(1.0, 0.33, 1)], 1e-3)


def test_accountant_never_returns_a_negative_epsilon_and_unreachable_targets_fail_clearly():
    for kind in ACCOUNTANTS:  # Opacus' RDP conversion goes below 0 for huge σ; the interface clamps it
        assert get_accountant(kind).epsilon([(1e5, 0.01, 10)], 1e-5) >= 0.0
    with pytest.raises(ValueError, match="cannot reach epsilon 1e-06"):
        calibrate_noise_multiplier(1e-6, 1e-5, 0.01, 10)


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_one_calibrator_meets_the_target_from_either_side(target):
    for start in (1e-3, 1.0, 1e3):  # brackets upwards or downwards
        x = calibrate(lambda s: 1.0 / s, target, start=start, rtol=1e-3)
        assert target * (1 - 1e-3) <= 1.0 / x <= target
    with pytest.raises(ValueError, match="cannot reach"):
        calibrate(lambda s: 5.0, 1.0)


def test_budget_rule_has_one_tolerance():
    assert not exceeds_budget(1.0 + 1e-12, 1.0) and exceeds_budget(1.0 + 1e-6, 1.0)
    assert budget_refusal(3, 1.2, 1.0) is not None and "round 3" in budget_refusal(3, 1.2, 1.0)
    assert budget_refusal(3, 0.9, 1.0) is None


def test_ledger_composes_its_own_charges_and_flags_disagreeing_reports():
    led = PrivacyLedger()
    led.charge(0, [(1.1, 0.05, 100)], 1e-5)
    led.charge(0, [(1.1, 0.05, 200)], 1e-5)
    assert led.epsilon(0) == pytest.approx(epsilon_of([(1.1, 0.05, 300)], 1e-5))
    assert led.mismatch(0, led.epsilon(0)) is None and "server's ledger" in led.mismatch(0, 1e6)
    led.charge_population([(2.0, 0.5, 3)], 1e-5)  # a client-level round charged to everyone
    assert led.epsilon(0) == pytest.approx(epsilon_of([(2.0, 0.5, 3), (1.1, 0.05, 300)], 1e-5))
    led.register(5)
    assert led.epsilon(5) == pytest.approx(led.population_epsilon())
    restored = PrivacyLedger()
    restored.load(led.state())
    assert restored.epsilons() == led.epsilons()


def test_sampler_is_secret_unless_seeded_and_poisson_has_rate_q():
    nodes = list(range(100))
    seeded = [ClientSampler(10, "fixed", seed=3).sample(1, nodes) for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 10
    secret = ClientSampler(10, "fixed")
    assert secret.secret and len({tuple(secret.sample(1, nodes)) for _ in range(5)}) > 1
    poisson = ClientSampler(10, "poisson")
    sizes = [len(poisson.sample(1, nodes)) for _ in range(400)]
    assert np.mean(sizes) == pytest.approx(10, rel=0.1) and len(set(sizes)) > 3
    assert ClientSampler(0, "poisson").sample(1, nodes) == nodes  # full participation


def test_identity_binding_rejects_spoofers_and_releases_departed_nodes():
    ids = IdentityBinding()
    assert ids.check(11, 1, connected={11, 12}) is None
    ids.bind(11, 1)
    assert "bound to connected node 11" in ids.check(12, 1, connected={11, 12})
    assert "claims client_id 2" in ids.check(11, 2, connected={11, 12})
    assert ids.check(13, 1, connected={12, 13}) is None  # node 11 is gone: a restarted client takes its id
    ids.bind(13, 1)
    assert ids.node_of[1] == 13 and 11 not in ids.client_of


def test_validator_rejects_beyond_float32_and_robust_outliers():
    v = UpdateValidator([(3,)])
    v.check_values(np.array([1.0, 2.0, 3.0]))
    with pytest.raises(RejectedUpdate, match="float32"):
        v.check_values(np.array([1e39, 0.0, 0.0]))  # finite in float64, inf once cast to the model dtype
    reasons = v.robust_outliers([1.0, 1.2, 0.9, 1e12])
    assert reasons[:3] == [None, None, None] and "median" in reasons[3]
    v.max_examples = {0: 50}
    with pytest.raises(RejectedUpdate, match="dataset size 50"):
        v.check_examples(0, 10**9)
    bounded = UpdateValidator([(3,)], norm_bound=lambda dim: 1.0)
    assert bounded.robust_outliers([1.0, 1.0, 1e12]) == [None, None, None]  # a declared bound replaces it
    with pytest.raises(RejectedUpdate, match="declared bound"):
        bounded.check_values(np.array([1.0, 1.0, 0.0]))


def test_strikes_exclude_after_the_limit():
    s = StrikeRecord(limit=2)
    assert not s.add(4, "nan") and s.add(4, "nan") and s.excluded(4) and not s.excluded(5)
    assert not StrikeRecord(limit=0).excluded(4)


def test_opacus_rdp_without_the_opacus_package_init_is_opacus_rdp():
    import subprocess
    import sys

    from strategies.privacy.accountants import OPACUS_RDP_ORDERS

    assert list(OPACUS_RDP_ORDERS) == RDPAccountant.DEFAULT_ALPHAS
    code = ("import sys; from strategies.privacy.accountants import OpacusRDP; "
            f"print(repr(OpacusRDP().epsilon({HIST!r}, 1e-5))); "
            "assert 'opacus' not in sys.modules and 'opacus.privacy_engine' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    opacus = RDPAccountant()
    opacus.history = list(HIST)
    assert float(out.stdout) == opacus.get_epsilon(1e-5)  # bit-for-bit: the same module's code


def test_calibrator_lands_in_the_window_for_any_power_law_and_stops_on_unreachable_targets():
    rng = np.random.default_rng(0)
    for _ in range(300):  # eps(x) = c·x^-a: slopes from flatter to steeper than the slope-(-1) first guess
        a, c, target, start = rng.uniform(0.2, 3), rng.uniform(0.01, 100), rng.uniform(0.01, 50), 10 ** rng.uniform(-3, 3)
        if not start / 1e6 < (c / target) ** (1 / a) < start * 1e6:
            continue
        x = calibrate(lambda s, a=a, c=c: c * s ** (-a), target, start=start)
        assert target * (1 - 1e-3) <= c * x ** (-a) <= target
    for start in (1e-3, 1.0, 1.517e5, 3.7):  # a floor above the target: raise, whatever start lands on the limit
        with pytest.raises(ValueError, match="cannot reach"):
            calibrate(lambda s: 0.1 + 1.0 / s, 1e-6, start=start)
