"""SoteriaFL family: compression/shift math, estimators, privacy calibration, client state, Flower run."""

from __future__ import annotations

import glob
import json
import math

import numpy as np
import pytest
import torch
from conftest import client_context
from flwr.common import Code, Context, FitRes, Status, ndarrays_to_parameters

from fedapp.apps.factories import build_strategy
from fedapp.clients.common import setup_client
from fedapp.clients.soteriafl import ARRAYS_KEY, SoteriaFLClient
from fedapp.config import ConfigError, resolve_config
from fedapp.models.zoo import build_model
from strategies.base import RejectedUpdate, StrategyContext, fit_reply
from strategies.compression import rand_k_compress, rand_k_decompress, rand_k_indices, rand_k_omega
from strategies.privacy.accountants import DPAccountingPLD, DPAccountingRDP, epsilon_of
from strategies.soteriafl import (
    METHODS,
    ClientState,
    GradientOracle,
    ServerState,
    calibrate_sigma,
    client_step,
    fit_seed,
    mask_seed,
    noise_history,
    payload_bits,
    shift_stepsize,
    shifted_message,
    theorem2_sigma,
)

# ------------------------------------------------------------------ compression and shift math


def test_shift_update_hand_computed_identity_compressor():
    g, s = np.array([1.0, 2.0, 3.0, 4.0]), np.full(4, 0.5)
    values, s_new = shifted_message(g, s, k=4, seed=0, gamma=0.5)  # k = d: C = identity, ω = 0
    np.testing.assert_allclose(values, [0.5, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(s_new, [0.75, 1.25, 1.75, 2.25])


def test_shift_update_hand_computed_random_k():
    g, s = np.array([1.0, -2.0, 3.0, 0.0]), np.array([0.0, 1.0, 1.0, 1.0])
    idx = rand_k_indices(4, 2, seed=7)
    values, s_new = shifted_message(g, s, k=2, seed=7, gamma=0.25)
    diff = g - s  # [1, -3, 2, -1]
    np.testing.assert_allclose(values, 2.0 * diff[idx])  # d/k = 2
    expected = s.copy()
    expected[idx] += 0.25 * 2.0 * diff[idx]
    np.testing.assert_allclose(s_new, expected)


def test_gamma_and_omega_formulas():
    assert rand_k_omega(124, 6) == pytest.approx(124 / 6 - 1)
    assert shift_stepsize(19.0) == pytest.approx(math.sqrt(39 / (2 * 20**3)))  # 0.049371
    assert shift_stepsize(0.0) == pytest.approx(math.sqrt(0.5))


def test_server_step_hand_computed():
    srv = ServerState(METHODS["soteriafl-sgd"], dim=2, eta=0.1, gamma=0.5, shift=np.array([1.0, 1.0]))
    x = srv.step(np.zeros(2), [np.array([2.0, 0.0]), np.array([0.0, 4.0])], num_clients=2)
    np.testing.assert_allclose(x, [-0.2, -0.3])  # v = s + mean = [2, 3]
    np.testing.assert_allclose(srv.shift, [1.5, 2.0])  # s + γ mean
    direct = ServerState(METHODS["cdp-sgd"], dim=2, eta=0.1, gamma=0.5)
    np.testing.assert_allclose(direct.step(np.zeros(2), [np.array([2.0, 0.0])], 2), [-0.2, 0.0])
    np.testing.assert_allclose(direct.shift, 0.0)


def test_random_k_unbiased_with_omega_variance():
    rng = np.random.default_rng(0)
    d, k, trials = 10, 2, 4000
    x = rng.normal(size=d)
    samples = np.stack([rand_k_decompress(rand_k_compress(x, k, s), d, s) for s in range(trials)])
    assert np.abs(samples.mean(0) - x).max() < 0.1 * np.abs(x).max()
    var = np.mean(np.sum((samples - x) ** 2, axis=1))
    assert var == pytest.approx(rand_k_omega(d, k) * x @ x, rel=0.1)  # E‖C(x) − x‖² = ω‖x‖² exactly for rand-k


def test_shifted_compression_reaches_optimum_direct_compression_stalls():
    """f_i(x) = ½‖x − c_i‖², exact gradients, no noise: the shifts learn ∇f_i(x*) ≠ 0, direct compression cannot."""
    rng = np.random.default_rng(1)
    n, d, k = 4, 20, 4
    c = rng.normal(size=(n, d)) * 3
    x_star = c.mean(0)
    omega = rand_k_omega(d, k)
    gamma = shift_stepsize(omega)
    errors = {}
    for name in ("soteriafl-gd", "cdp-sgd"):
        method = METHODS[name]
        eta = 0.1
        srv = ServerState(method, d, eta, gamma)
        shifts = [np.zeros(d) for _ in range(n)]
        x = np.zeros(d)
        for t in range(300):
            msgs = []
            for i in range(n):
                g, seed = x - c[i], t * n + i
                if method.compression == "shifted":
                    values, shifts[i] = shifted_message(g, shifts[i], k, seed, gamma)
                else:
                    values = rand_k_compress(g, k, seed)
                msgs.append(rand_k_decompress(values, d, seed))
            x = srv.step(x, msgs, n)
        errors[name] = float(np.linalg.norm(x - x_star))
    assert errors["soteriafl-gd"] < 1e-6  # linear convergence to x*
    assert errors["cdp-sgd"] > 0.5  # noise floor from ω‖∇f_i(x*)‖²


# ------------------------------------------------------------------ gradients and estimators


class CachedOracle(GradientOracle):
    """Memoizes per-sample gradients per point (the estimator tests only exercise the sampling logic)."""

    def per_sample(self, flat, idx):
        cache = self.__dict__.setdefault("_cache", {})
        key = np.asarray(flat).tobytes()
        if key not in cache:
            cache[key] = super().per_sample(flat, np.arange(self.m))
        return cache[key][idx]


def _logreg_oracle(m: int = 40, lam: float = 0.2, cls=GradientOracle) -> tuple[GradientOracle, np.ndarray, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("logreg", (12,), 2, nonconvex_lambda=lam)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(m, 12)).astype(np.float32), rng.integers(0, 2, m)
    flat = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]).astype(np.float64)
    return cls(model, x, y), flat, model


def test_oracle_per_sample_gradients_match_autograd_with_regularizer():
    oracle, flat, model = _logreg_oracle()
    loss, g = oracle.loss_and_grad(flat)
    ps = oracle.per_sample(flat, np.arange(oracle.m))
    np.testing.assert_allclose(ps.mean(0), g, atol=1e-6)
    out = torch.nn.functional.cross_entropy(model(torch.tensor(oracle.x.numpy())), oracle.y) + model.regularization()
    out.backward()
    ref = torch.cat([p.grad.ravel() for p in model.parameters()]).numpy()
    np.testing.assert_allclose(g, ref, atol=1e-6)
    assert loss == pytest.approx(float(out.detach()), abs=1e-6)
    clipped = oracle.clipped(flat, np.arange(5), 0.01)
    assert np.all(np.linalg.norm(clipped, axis=1) <= 0.01 + 1e-9)


@pytest.mark.parametrize("name", ["soteriafl-sgd", "soteriafl-svrg", "soteriafl-saga"])
def test_estimators_are_unbiased_for_the_clipped_gradient(name):
    """E[g̃] = (1/m) Σ clip(∇f_j(x)) — SVRG/SAGA corrections cancel in expectation (Assumption 3)."""
    oracle, flat, _ = _logreg_oracle(m=30, cls=CachedOracle)
    target = oracle.clipped_sum(flat, np.arange(30), 0.3) / 30
    w = flat + 0.5  # a different snapshot / table point
    est = []
    for t in range(300):
        st = ClientState()
        if name == "soteriafl-svrg":
            st.snapshot, st.snapshot_grad = w, oracle.clipped_sum(w, np.arange(30), 0.3) / 30
        if name == "soteriafl-saga":
            st.table = oracle.clipped(w, np.arange(30), 0.3).astype(np.float32)
            st.table_mean = st.table.astype(np.float64).mean(0)
        st.shift = np.zeros(oracle.dim)
        res = client_step(METHODS["ldp-sgd"] if name == "soteriafl-sgd" else
                          type(METHODS[name])(name, METHODS[name].estimator, "none"), oracle, flat, st, clip=0.3,
                          batch_size=10, sigma_p=0.0, k=oracle.dim, gamma=0.5, rng=np.random.default_rng(t), seed=t,
                          refresh_snapshot=False)
        est.append(res.message)
    assert np.abs(np.mean(est, 0) - target).max() < 0.15 * np.abs(target).max() + 1e-3


def test_svrg_and_saga_state_is_updated():
    oracle, flat, _ = _logreg_oracle(m=20)
    st = ClientState()
    client_step(METHODS["soteriafl-svrg"], oracle, flat, st, clip=1.0, batch_size=5, sigma_p=0.0, k=3, gamma=0.1,
                rng=np.random.default_rng(0), seed=1, refresh_snapshot=False)
    np.testing.assert_array_equal(st.snapshot, flat)  # w^0 = x^0
    client_step(METHODS["soteriafl-svrg"], oracle, flat + 1, st, clip=1.0, batch_size=5, sigma_p=0.0, k=3,
                gamma=0.1, rng=np.random.default_rng(1), seed=2, refresh_snapshot=True)
    np.testing.assert_array_equal(st.snapshot, flat + 1)
    st2 = ClientState()
    res = client_step(METHODS["soteriafl-saga"], oracle, flat, st2, clip=1.0, batch_size=5, sigma_p=0.0, k=3,
                      gamma=0.1, rng=np.random.default_rng(0), seed=1, refresh_snapshot=False)
    client_step(METHODS["soteriafl-saga"], oracle, flat + 1, st2, clip=1.0, batch_size=5, sigma_p=0.0, k=3,
                gamma=0.1, rng=np.random.default_rng(1), seed=2, refresh_snapshot=False)
    np.testing.assert_allclose(st2.table_mean, st2.table.astype(np.float64).mean(0))
    assert res.grads_computed == 20 + res.batch


# ------------------------------------------------------------------ privacy


def test_calibration_meets_target_with_accountant():
    for est in ("sgd", "gd"):
        sigma, split = calibrate_sigma(est, 2.0, 1e-3, 0.5, 100, 400, 10)
        eps = epsilon_of(noise_history(est, sigma, 0.5, 100, 400, 10, split), 1e-3)
        assert 2.0 * 0.99 <= eps <= 2.0


def test_svrg_history_uses_lemma1_sensitivities():
    hist = noise_history("svrg", 0.1, 0.5, 10, 1000, 50, split=0.64)
    (z1, q1, t1), (z2, q2, t2) = hist
    assert z1 == pytest.approx(0.8 * 0.1 * 10 / (2 * 0.5))  # G_A = 2G, std √split σ_p, divisor b
    assert z2 == pytest.approx(0.6 * 0.1 * 1000 / 0.5)  # G_B = G, divisor m, no subsampling
    assert (q1, q2, t1, t2) == (0.01, 1.0, 50, 50)


def test_theorem2_formula():
    # σ² = c (G_A²/4 + G_B²) T log(1/δ) / (m² ε²); SVRG: G_A = 2G, G_B = G -> 2G²
    assert theorem2_sigma("svrg", 5.0, 1e-3, 0.5, 3256, 100, c=1.0) ** 2 == pytest.approx(
        2 * 0.25 * 100 * math.log(1000) / (3256**2 * 25))
    assert theorem2_sigma("sgd", 5.0, 1e-3, 0.5, 3256, 100, c=12.0) ** 2 == pytest.approx(
        12 * 0.0625 * 100 * math.log(1000) / (3256**2 * 25))


# ------------------------------------------------------------------ client glue (Flower Context, no simulation)

_BASE = {"dataset": "digits", "model": "mlp-digits", "privacy-dist": "fixed", "epsilon": 5.0, "delta": 1e-3,
         "clip-norm": 1.0, "local-test-fraction": 0.0, "num-server-rounds": 3, "max-samples": 400}


def _fit(client_ctx: Context, ov: dict, weights, rnd: int):
    client = SoteriaFLClient(setup_client(client_ctx, ov), resolve_config(None, ov).soteriafl, client_ctx)  # a fresh object per round, as in Flower
    return client.fit(weights, {"server-round": rnd, "round-seed": fit_seed(42, rnd),
                                "soteriafl-method": ov["strategy"]})


def _context() -> Context:
    return client_context(node_id=7)


def test_client_state_persists_in_context_and_budget_is_enforced():
    ov = {**_BASE, "strategy": "soteriafl-gd", "dp-rounds": 2}
    ctx = _context()
    setup = setup_client(ctx, ov)
    weights = [w.copy() for w in __import__("fedapp.clients.training", fromlist=["get_weights"]).get_weights(setup.new_model())]
    d = sum(w.size for w in weights)
    k = d // 20
    shift = np.zeros(d)
    eps_seen = []
    for rnd in (1, 2):
        values, m, metrics = _fit(ctx, ov, weights, rnd)
        assert metrics["status"] == "ok" and len(values[0]) == k and m == len(setup.train)
        assert metrics["payload_bits"] == 32 * k + 64 == payload_bits(METHODS["soteriafl-gd"], k)
        seed = mask_seed(fit_seed(42, rnd), 0)
        assert metrics["mask_seed"] == seed
        shift = shift + shift_stepsize(rand_k_omega(d, k)) * rand_k_decompress(values[0], d, seed)
        np.testing.assert_allclose(ctx.state[ARRAYS_KEY]["shift"].numpy(), shift, rtol=1e-12)
        eps_seen.append(metrics["epsilon_spent"])
    assert eps_seen[0] < eps_seen[1] <= 5.0 and eps_seen[1] >= 5.0 * 0.99
    values, _, metrics = _fit(ctx, ov, weights, 3)
    assert values == [] and metrics["status"] == "refused" and "budget" in metrics["reason"]


def _strategy(ov: dict, weights):
    from fedapp.config import resolve_config

    cfg = resolve_config(overrides={**ov, "soteriafl-utility": False})
    return build_strategy(cfg, StrategyContext(initial_weights=weights))


def _fitres(values, metrics):
    return fit_reply(_Node(), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(values), 10, metrics))


class _Node:
    node_id = 0


def test_strategy_rejects_bad_payloads_and_config():
    weights = [np.zeros((3, 4), np.float32), np.zeros(3, np.float32)]  # d = 15 -> k = 1
    strat = _strategy({**_BASE, "strategy": "soteriafl-sgd", "soteriafl-k": 3}, weights)
    good_seed = mask_seed(fit_seed(42, 1), 2)
    dense = strat.decode_update(1, _fitres([np.ones(3, np.float32)], {"client_id": 2, "mask_seed": good_seed}),
                                {"client_id": 2, "mask_seed": good_seed})
    assert np.count_nonzero(dense) == 3
    with pytest.raises(RejectedUpdate, match="mask_seed"):
        strat.decode_update(1, _fitres([np.ones(3, np.float32)], {}), {"client_id": 2, "mask_seed": good_seed + 1})
    with pytest.raises(RejectedUpdate, match="expected 3"):
        strat.decode_update(1, _fitres([np.ones(4, np.float32)], {}), {"client_id": 2, "mask_seed": good_seed})
    with pytest.raises(RejectedUpdate, match="NaN"):
        strat.decode_update(1, _fitres([np.array([1, np.nan, 1], np.float32)], {}),
                            {"client_id": 2, "mask_seed": good_seed})
    with pytest.raises(ConfigError, match="server-lr"):
        _strategy({**_BASE, "strategy": "soteriafl-sgd", "server-lr": 0.5}, weights)
    with pytest.raises(ConfigError, match="soteriafl-k"):
        _strategy({**_BASE, "strategy": "soteriafl-sgd", "soteriafl-k": 16}, weights)
    ckpt = strat.checkpoint_state()
    strat.server.shift = np.ones(15)
    strat.load_checkpoint_state(ckpt)
    np.testing.assert_array_equal(strat.server.shift, 0.0)


# ------------------------------------------------------------------ Flower simulation


@pytest.mark.slow
def test_flower_simulation_bits_state_and_refusal(tmp_path):
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    ov = {**_BASE, "strategy": "soteriafl-gd", "output-dir": str(tmp_path), "fraction-evaluate": 0.0,
          "dp-rounds": 2, "soteriafl-eta": 0.3,
          "seeded-noise": True}  # reproducible noise: with OS entropy one round's noise can outweigh its descent
    run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=4, backend_config={
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    rounds = [json.loads(line) for line in open(f"{run_dir}/rounds.jsonl")]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    d = 64 * 32 + 32 + 32 * 10 + 10  # mlp-digits
    k = d // 20
    for r in rounds[:2]:
        assert r["metrics"]["clients_ok"] == 4
        assert r["metrics"]["payload_bits"] == 4 * (32 * k + 64)
        assert r["metrics"]["uplink_bits"] >= 4 * 32 * k  # actual serialized payload incl. npy header
        assert all(c["steps"] == r["round"] for c in r["clients"])  # ledger persisted in Context.state
        assert r["metrics"]["grad_norm_sq"] > 0 and r["metrics"]["train_loss"] > 0
    assert rounds[1]["metrics"]["payload_bits_total"] == 2 * rounds[0]["metrics"]["payload_bits"]
    assert rounds[0]["metrics"]["train_loss"] > rounds[1]["metrics"]["train_loss"]
    summary = json.loads(open(f"{run_dir}/summary.json").read())  # the paper's axes, as the sweep report reads them
    assert summary["final_train_loss"] == rounds[-1]["metrics"]["train_loss"]
    assert summary["final_utility"] == rounds[-1]["metrics"]["grad_norm_sq_avg"]
    assert all(c["status"] == "refused" for c in rounds[2]["clients"])  # dp-rounds = 2 exhausted
    assert max(c["epsilon_spent"] for c in rounds[1]["clients"]) <= 5.0
    for r in rounds:  # the server composed each client's ε itself, and it agrees with the client's accountant
        for c in r["clients"]:
            assert "epsilon_mismatch" not in c and c["epsilon_spent"] == pytest.approx(c["client_epsilon_spent"])
    # and with Google's dp_accounting for the GD estimator's mechanism (q = 1, z = σ_p m / G), two rounds, under
    # record-neighbours = replace-one (the default): a replaced record moves the full-data mean by 2G/m, so it is
    # the add/remove Gaussian at half the noise multiplier
    c = rounds[1]["clients"][0]
    assert c["epsilon_spent"] == pytest.approx(DPAccountingPLD().epsilon([(c["noise_multiplier"] / 2, 1.0, 2)],
                                                                         c["delta"]), rel=0.01)
    assert c["epsilon_spent"] > 1.8 * DPAccountingRDP().epsilon([(c["noise_multiplier"], 1.0, 2)], c["delta"])
