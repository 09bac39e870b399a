"""Client-level DP (DP-FedAvg / Fed-SMP clients): accountant vs Theorem 1, clipping, noise, budget refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import client_context

from fedapp.clients.client_dp import ClientLevelDPClient
from fedapp.clients.common import setup_client
from fedapp.clients.training import LocalTraining, get_weights, local_train
from fedapp.config import ConfigError, resolve_config
from fedapp.data.client_data import _public_split, public_dataset, training_pool
from fedapp.privacy.profiles import client_level_mechanism as mechanism_from_config
from strategies.client_level import CFG_SIGMA
from strategies.fed_smp import theorem1_noise_multiplier
from strategies.privacy.calibration import calibrate_noise_multiplier
from strategies.privacy.mechanisms import ClientLevelDP, default_client_delta

BASE = {"dataset": "digits", "privacy-dist": "fixed", "batch-size": 16, "local-steps": 3, "clip-norm": 0.5,
        "num-server-rounds": 3, "clients-per-round": 2, "lr": 0.1, "momentum": 0.5, "noise-multiplier": 1.3}


def make_client(overrides: dict, private: bool = True, cid: int = 0, n: int = 4) -> ClientLevelDPClient:
    """A client sending continuous Gaussian shares (the discrete Gaussian's: tests/integration/fedapp/privacy/test_ddg_secure_sum.py)."""
    if overrides.get("secure-aggregation", True):
        overrides = {"secagg-mechanism": "gaussian", **overrides}
    ctx = client_context(cid, n, run_id=0, node_id=cid + 1)
    return ClientLevelDPClient(setup_client(ctx, overrides), resolve_config(None, overrides).client_dp, ctx,
                               private=private)


@pytest.mark.parametrize("q,rounds,eps", [(100 / 6000, 200, 1.0), (0.05, 30, 1.0), (0.01, 1000, 2.0)])
def test_accountant_at_least_as_tight_as_theorem1(q, rounds, eps):
    delta = default_client_delta(int(round(1 / q * 50)))
    sigma_thm = theorem1_noise_multiplier(eps, delta, q, rounds)
    sigma_acc = calibrate_noise_multiplier(eps, delta, q, rounds, rtol=1e-2)
    assert sigma_acc <= sigma_thm  # the accountant never needs more noise than the closed form
    # and at Theorem 1's σ the accountant certifies at most ε
    dp = ClientLevelDP(sigma_thm, 1.0, 1, int(round(1 / q)), rounds, delta, adversary="release")  # the paper's
    assert dp.epsilon() <= eps


def test_theorem1_rejects_out_of_range_epsilon():
    with pytest.raises(ValueError, match="2 log"):
        theorem1_noise_multiplier(100.0, 1e-3, 0.01, 10)


def test_mechanism_from_config_calibrates_and_defaults():
    cfg = resolve_config({}, {**BASE, "noise-multiplier": 0.0, "target-epsilon": 2.0, "clients-per-round": 0,
                              "num-server-rounds": 20})
    dp = mechanism_from_config(cfg.general, cfg.training, cfg.client_dp, 50)
    assert dp.clients_per_round == 50 and dp.sample_rate == 1.0  # r = 0 means full participation
    assert dp.delta == pytest.approx(1 / (10 * 50))  # δ ≤ 1/(10 n) by default
    assert 2.0 * (1 - 2e-3) <= dp.epsilon() <= 2.0
    cfg = resolve_config({}, BASE)
    given = mechanism_from_config(cfg.general, cfg.training, cfg.client_dp, 4)
    assert given.noise_multiplier == 1.3 and given.clients_per_round == 2 and given.clip == 0.5


def test_per_client_noise_sums_to_sigma_c():
    dp = ClientLevelDP(1.5, 2.0, 10, 100, 5, 1e-3)
    rng = np.random.default_rng(0)
    total = sum(dp.privatize(np.zeros(20_000), rng)[0] for _ in range(10))
    assert np.std(total) == pytest.approx(1.5 * 2.0, rel=0.03)


def test_privatize_clips_before_noise():
    dp = ClientLevelDP(0.0, 1.0, 1, 10, 1, 1e-3)
    out, norm = dp.privatize(np.full(100, 3.0), np.random.default_rng(0))
    assert norm == pytest.approx(30.0) and np.linalg.norm(out) == pytest.approx(1.0)


def test_client_refuses_beyond_budget():
    client = make_client(BASE)
    weights = get_weights(client.s.new_model())
    cfg = {"server-round": 3, CFG_SIGMA: 1.3}
    arrays, n, metrics = client.fit(weights, cfg)
    assert metrics["status"] == "ok" and n > 0
    dp = mechanism_from_config(client.s.general, client.s.training, client.client_dp, 4)
    assert metrics["epsilon_spent"] == pytest.approx(dp.epsilon(3))
    arrays, n, metrics = client.fit(weights, {**cfg, "server-round": 4})
    assert metrics["status"] == "refused" and arrays == [] and n == 0
    assert "budget" in metrics["reason"] and metrics["epsilon_spent"] == pytest.approx(dp.epsilon(3))


def test_client_refuses_sigma_mismatch():
    client = make_client(BASE)
    _, _, metrics = client.fit(get_weights(client.s.new_model()), {"server-round": 1, CFG_SIGMA: 0.5})
    assert metrics["status"] == "refused" and "noise multiplier" in metrics["reason"]


def test_nonprivate_dense_update_is_clipped_and_private_is_noisy():
    plain = make_client({**BASE, "clip-norm": 0.01}, private=False)
    w = get_weights(plain.s.new_model())
    arrays, _, metrics = plain.fit(w, {"server-round": 1})
    flat = np.concatenate([a.ravel() for a in arrays])
    assert metrics["status"] == "ok" and metrics["update_norm"] > 0.01  # clipping was active
    assert np.linalg.norm(flat) == pytest.approx(0.01, rel=1e-5)
    private = make_client(BASE)
    arrays, _, metrics = private.fit(w, {"server-round": 1, CFG_SIGMA: 1.3})
    assert "update_norm" not in metrics and "train_loss" not in metrics  # nothing outside the mechanism leaks
    flat = np.concatenate([a.ravel() for a in arrays])
    expected = 0.5 * 1.3 / math.sqrt(2) * math.sqrt(flat.size)  # noise norm ≈ C·σ/√r · √d
    assert np.linalg.norm(flat) == pytest.approx(expected, rel=0.1)


def test_local_train_runs_exact_steps_and_is_seeded():
    client = make_client(BASE, private=False)
    results = []
    for _ in range(2):
        model = client.s.new_model()
        res = local_train(model, client.s.train, LocalTraining(batch_size=16, steps=7, lr=0.1, momentum=0.5, seed=3))
        results.append(np.concatenate([w.ravel() for w in get_weights(model)]))
        assert res.steps == 7
    np.testing.assert_array_equal(results[0], results[1])


def test_public_set_is_held_out_of_every_client():
    cfg = resolve_config({}, {**BASE, "public-samples": 100})
    base = resolve_config({}, BASE)
    full = training_pool(base.data, base.general.seed)
    assert len(public_dataset(cfg.data, cfg.general.seed)) == 100 and len(training_pool(cfg.data, cfg.general.seed)) == len(full) - 100
    pub, rest = _public_split(len(full), 100, int(cfg["seed"]))
    assert not set(pub) & set(rest) and len(pub) + len(rest) == len(full)
    np.testing.assert_array_equal(public_dataset(cfg.data, cfg.general.seed).x, full.x[pub])
    np.testing.assert_array_equal(training_pool(cfg.data, cfg.general.seed).x, full.x[rest])


@pytest.mark.parametrize("key,value", [("compression-ratio", 0.0), ("compression-ratio", 1.5), ("client-delta", 1.0),
                                       ("noise-multiplier", -1.0), ("local-steps", -2), ("public-samples", -1)])
def test_bad_config_values_rejected(key, value):
    with pytest.raises(ConfigError, match=key):
        resolve_config({}, {**BASE, key: value})


@pytest.mark.secagg_guard
@pytest.mark.parametrize("strategy", ["dp-fedavg", "dp-ftrl", "dp2-fedsam"])
def test_under_secagg_a_fit_outside_the_protocol_is_refused_and_sends_nothing(strategy):
    """A server that skips SecAgg+ and sends a plain fit would see one client's share, noised only for the sum: a
    client whose run-config turns SecAgg+ on answers it with a refusal and no arrays; inside the collect stage (the
    state Flower's secaggplus_mod keeps in Context.state) the same fit trains."""
    from conftest import in_secagg_collect

    from fedapp.privacy.secure_aggregation import OUTSIDE_SECAGG
    from fedapp.registry import get_spec

    overrides = {**BASE, "strategy": strategy, "secagg-mechanism": "gaussian", "clients-per-round": 0,
                 "model": "mlp-digits"}
    if strategy == "dp-ftrl":
        overrides.update({"ftrl-bands": 2})
    ctx = client_context(0, 4, run_id=0, node_id=1)
    client = get_spec(strategy).client(ctx, overrides).numpy_client  # type: ignore[attr-defined]
    params = client.get_parameters({})
    arrays, n, metrics = client.fit(params, {"server-round": 1, CFG_SIGMA: client_sigma(overrides)})
    assert (arrays, n, metrics["status"], metrics["reason"]) == ([], 0, "refused", OUTSIDE_SECAGG)
    in_secagg_collect(ctx)
    arrays, n, metrics = client.fit(params, {"server-round": 1, CFG_SIGMA: client_sigma(overrides)})
    assert metrics["status"] == "ok" and arrays, metrics.get("reason")


def client_sigma(overrides: dict) -> float:
    cfg = resolve_config(None, overrides)
    if cfg.general.strategy == "dp-ftrl":
        from fedapp.privacy.profiles import ftrl_mechanism

        return ftrl_mechanism(cfg.general, cfg.training, cfg.client_dp, 4).noise_multiplier
    return mechanism_from_config(cfg.general, cfg.training, cfg.client_dp, 4).noise_multiplier
