"""Record-level DP-SGD privacy: calibration, exact persistent accounting, budget refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import client_context
from opacus.accountants import RDPAccountant

from fedapp.clients.common import setup_client
from fedapp.clients.dpsgd import STATE_KEY, DPSGDClient
from fedapp.clients.training import get_weights
from strategies.privacy.accountants import compact_history, epsilon_of
from strategies.privacy.calibration import calibrate_noise_multiplier


@pytest.mark.parametrize("eps,q,steps,kind", [(0.2, 16 / 2400, 150, "rdp"), (1.0, 1 / 38, 38 * 40, "rdp"),
                                              (5.0, 128 / 2400, 19 * 200, "rdp"), (1.0, 1 / 38, 38 * 10, "prv")])
def test_calibrated_noise_reaches_target_within_one_percent(eps, q, steps, kind):
    z = calibrate_noise_multiplier(eps, 1e-4, q, steps, kind=kind)
    spent = epsilon_of([(z, q, steps)], 1e-4, kind)
    assert eps * 0.99 <= spent <= eps
    assert epsilon_of([(z * 0.97, q, steps)], 1e-4, kind) > spent  # less noise spends more


@pytest.mark.parametrize("history", [[(1.3, 0.05, 21)], [(0.8, 1 / 38, 380), (2.5, 0.1, 7), (0.8, 1 / 38, 5)],
                                     [(4.0, 0.01, 10_000)]])
def test_cached_rdp_epsilon_equals_opacus_accountant(history):
    acc = RDPAccountant()
    acc.history = list(history)
    for delta in (1e-3, 1e-5):
        assert math.isclose(epsilon_of(history, delta, "rdp"), acc.get_epsilon(delta), rel_tol=1e-12)


def test_history_composition_matches_opacus_stepping():
    acc = RDPAccountant()
    for _ in range(3 * 7):
        acc.step(noise_multiplier=1.3, sample_rate=0.05)
    assert compact_history(acc.history) == [(1.3, 0.05, 21)]
    assert math.isclose(epsilon_of([(1.3, 0.05, 7)] * 3, 1e-5), acc.get_epsilon(1e-5), rel_tol=1e-12)


def test_accountant_persists_across_rounds_and_client_refuses_past_budget():
    """3 rounds x 1 epoch through the Flower client (state in Context) == one accountant over 3 epochs."""
    cfg = {"num-server-rounds": 3, "privacy-dist": "fixed", "epsilon": 2.0, "batch-size": 16, "local-epochs": 1}
    ctx = client_context(run_config=cfg)
    params = None
    reported = []
    for rnd in (1, 2, 3):
        client = DPSGDClient(setup_client(ctx), ctx, private=True)  # new object per round, as in Flower
        if params is None:
            params = get_weights(client.s.new_model())
        update, n, metrics = client.fit(params, {"server-round": rnd})
        assert metrics["status"] == "ok" and n == len(client.s.train)
        params = [p + u for p, u in zip(params, update)]
        reported.append(metrics["epsilon_spent"])
    z, q, steps = metrics["noise_multiplier"], metrics["sample_rate"], metrics["steps_round"]
    assert client.accountant() == "dpa-pld-replace-one"  # record-neighbours = replace-one by default
    one_shot = epsilon_of([(z, q, 3 * steps)], 1e-4, client.accountant())
    assert reported[0] < reported[1] < reported[2]
    assert math.isclose(reported[2], one_shot, rel_tol=1e-12)
    assert 2.0 * 0.99 <= reported[2] <= 2.0
    assert dict(ctx.state[STATE_KEY])["hist_steps"] == [3 * steps]
    # round 4 would exceed the budget planned for 3 rounds: refuse, send nothing, spend nothing
    client = DPSGDClient(setup_client(ctx), ctx, private=True)
    update, n, metrics = client.fit(params, {"server-round": 4})
    assert update == [] and n == 0 and metrics["status"] == "refused"
    assert "budget" in metrics["reason"] and math.isclose(metrics["epsilon_spent"], reported[2])
    assert dict(ctx.state[STATE_KEY])["hist_steps"] == [3 * steps]


def test_update_is_noisy_difference_of_weights():
    cfg = {"num-server-rounds": 1, "privacy-dist": "fixed", "epsilon": 1.0, "batch-size": 16}
    ctx = client_context(run_config=cfg, cid=1)
    client = DPSGDClient(setup_client(ctx), ctx, private=True)
    params = get_weights(client.s.new_model())
    update, _, metrics = client.fit(params, {"server-round": 1})
    assert [u.shape for u in update] == [p.shape for p in params]
    assert all(np.all(np.isfinite(u)) for u in update) and any(np.abs(u).sum() > 0 for u in update)
    assert metrics["noise_multiplier"] > 0 and metrics["epsilon_budget"] == 1.0


@pytest.mark.parametrize("seeded", [False, True])
def test_dp_noise_is_secret_unless_seeded_noise_is_requested(seeded):
    """The server knows the run seed: by default noise must not be derivable from it."""
    cfg = {"num-server-rounds": 1, "privacy-dist": "fixed", "epsilon": 1.0, "batch-size": 16, "seeded-noise": seeded}
    updates = []
    for _ in range(2):
        ctx = client_context(run_config=cfg, cid=2)
        client = DPSGDClient(setup_client(ctx), ctx, private=True)
        update, _, _ = client.fit(get_weights(client.s.new_model()), {"server-round": 1})
        updates.append(np.concatenate([u.ravel() for u in update]))
    assert np.array_equal(updates[0], updates[1]) == seeded
