"""Robust-HDP, WeiAvg, PFA, min-ε and the oracle diagnostics (strategies.robust_hdp)."""

from __future__ import annotations

import glob
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from fedapp.clients.common import ClientSetup
from fedapp.clients.dpsgd import min_epsilon_profile
from fedapp.clients.training import LocalTraining, PerSampleDP, epochs_to_steps, local_train
from fedapp.config import resolve_config
from fedapp.data.datasets import ArrayDataset
from fedapp.privacy.profiles import dpsgd_sample_rate, federation_profiles
from strategies.base import ClientUpdate, RejectedUpdate
from strategies.fedavg import DPSGDFedAvg
from strategies.robust_hdp import (
    PFA,
    MinEpsilon,
    RobustHDP,
    WeiAvg,
    oracle_sigma2,
    project_onto_public_subspace,
    split_public_private,
)

P = 6000


def make_strategy(cls, **kw):
    return cls(initial_weights=[np.zeros(P, dtype=np.float32)], num_rounds=3, **kw)


def synthetic_round(sigmas, eps=None, seed=0, p=P):
    """Shared low-rank signal + N(0, s_i²) per coordinate; metrics make σ_i² = p·s_i² under Eq. 7."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(scale=0.02, size=p)
    updates = []
    for i, s in enumerate(sigmas):
        # Eq. 7 with steps=1, lr=1, c=1, b̄=1: σ² = p z² → z = s
        metrics = {"client_id": i, "noise_multiplier": float(s), "num_train": 10, "sample_rate": 0.1,
                   "steps_round": 1, "lr": 1.0, "reported_epsilon": float(eps[i] if eps is not None else 1.0)}
        u = signal * (1 + 0.1 * rng.normal()) + rng.normal(scale=s, size=p)
        updates.append(ClientUpdate(i, i, 10, u, metrics, 0, {}))
    return updates


SIGMAS = np.exp(np.random.default_rng(7).uniform(np.log(0.02), np.log(1.0), 20))


def test_robust_hdp_weights_track_inverse_noise_variance():
    strat = make_strategy(RobustHDP, clip_norm=1.0)
    updates = synthetic_round(SIGMAS)
    raw, extra = strat.aggregation_weights(1, updates)
    w = raw / raw.sum()
    oracle = 1 / SIGMAS**2 / np.sum(1 / SIGMAS**2)
    assert spearmanr(w, oracle).correlation >= 0.9
    assert extra["noise_variance"] == pytest.approx(extra["noise_variance_oracle"], rel=0.1)
    assert extra["noise_variance"] >= extra["noise_variance_oracle"] * (1 - 1e-9)  # w* is the minimum
    assert extra["rpca_iterations"] > 0 and extra["rpca_converged"]
    rec = updates[0].record
    assert rec["sigma2_oracle"] == pytest.approx(P * SIGMAS[0] ** 2)
    assert rec["oracle_weight"] == pytest.approx(oracle[0])
    assert rec["sigma2_estimated"] > 0
    # WeiAvg/DPFedAvg with uninformative ε / N are far from the oracle on the same round
    _, ext_fedavg = make_strategy(DPSGDFedAvg).aggregation_weights(1, synthetic_round(SIGMAS))
    assert ext_fedavg["noise_variance"] is None  # clip_norm unknown -> no oracle
    fedavg = make_strategy(DPSGDFedAvg)
    fedavg.clip_norm = 1.0
    _, ext_fedavg = fedavg.aggregation_weights(1, synthetic_round(SIGMAS))
    assert ext_fedavg["noise_variance"] > 3 * extra["noise_variance"]


def test_falsified_epsilon_moves_weiavg_not_robust_hdp():
    eps = np.linspace(0.5, 2.0, len(SIGMAS))
    lying = eps.copy()
    lying[3] = 50.0
    weights = {}
    for name, cls in (("rhdp", RobustHDP), ("wei", WeiAvg), ("pfa", PFA)):
        for tag, e in (("true", eps), ("lie", lying)):
            raw, _ = make_strategy(cls, clip_norm=1.0).aggregation_weights(1, synthetic_round(SIGMAS, e))
            weights[name, tag] = raw / raw.sum()
    assert np.array_equal(weights["rhdp", "true"], weights["rhdp", "lie"])
    assert weights["wei", "lie"][3] > 5 * weights["wei", "true"][3]
    assert weights["pfa", "lie"][3] > 5 * weights["pfa", "true"][3]


def test_frozen_weights_reuse_first_round():
    strat = make_strategy(RobustHDP, freeze_weights=True)
    w1, e1 = strat.aggregation_weights(1, synthetic_round(SIGMAS, seed=1))
    w2, e2 = strat.aggregation_weights(2, synthetic_round(SIGMAS[::-1], seed=2))
    assert np.array_equal(w1, w2) and e2["weights_frozen"] and e2["rpca_iterations"] == 0
    live = make_strategy(RobustHDP)
    live.aggregation_weights(1, synthetic_round(SIGMAS, seed=1))
    w3, _ = live.aggregation_weights(2, synthetic_round(SIGMAS[::-1], seed=2))
    assert not np.allclose(w1, w3)


def test_frozen_weights_survive_a_checkpoint_round_trip():
    strat = make_strategy(RobustHDP, freeze_weights=True)
    w1, _ = strat.aggregation_weights(1, synthetic_round(SIGMAS, seed=1))
    state = json.loads(json.dumps(strat.state_dict()["family"]))  # checkpoints store JSON-able family state
    resumed = make_strategy(RobustHDP, freeze_weights=True)
    resumed.load_checkpoint_state(state)
    w2, e2 = resumed.aggregation_weights(2, synthetic_round(SIGMAS[::-1], seed=2))
    assert np.array_equal(w1, w2) and e2["weights_frozen"]


def test_weiavg_rejects_bad_reported_epsilon():
    strat = make_strategy(WeiAvg)
    for bad in (0.0, -1.0, float("nan"), "high", None):
        with pytest.raises(RejectedUpdate, match="reported_epsilon"):
            strat.validate_update(np.zeros(P), {"reported_epsilon": bad})
    strat.validate_update(np.zeros(P), {"reported_epsilon": 0.5})


def test_pfa_split_and_projection():
    assert split_public_private([0.2, 0.21, 0.19, 5.0, 4.5, 1.0]).tolist() == [False, False, False, True, True, False]
    assert split_public_private([1.0, 1.0]).all()
    rng = np.random.default_rng(0)
    direction = rng.normal(size=200)
    public = [direction * a + 0.3 for a in (1.0, 2.0, -1.0)]  # affine line 0.3 + a·direction
    inside = direction * 5.0 + 0.3
    outside = inside + rng.normal(size=200)
    proj_in, proj_out = project_onto_public_subspace(public, [inside, outside], k=1)
    assert np.allclose(proj_in, inside)
    resid = proj_out - (0.3 + direction * ((outside - 0.3) @ direction) / (direction @ direction))
    assert np.allclose(resid, 0, atol=1e-9)
    single = project_onto_public_subspace([direction], [outside])[0]
    assert np.allclose(single, direction * (outside @ direction) / (direction @ direction))
    # PFA aggregate: private update replaced by its projection
    strat = make_strategy(PFA, clip_norm=1.0)
    ups = synthetic_round(SIGMAS[:6], eps=[0.2, 0.2, 0.21, 5.0, 4.8, 5.2])
    raw, extra = strat.aggregation_weights(1, ups)
    assert extra["pfa_public_clients"] == 3 and extra["noise_variance"] is None
    assert extra["noise_variance_unprojected"] > 0
    agg = strat.aggregate_updates(1, ups, raw / raw.sum())
    assert not np.allclose(agg, sum(w * u.update for w, u in zip(raw / raw.sum(), ups)))


def test_oracle_sigma2_matches_opacus_dpsgd():
    """Eq. 7 cross-checked against the variance of real Opacus DP-SGD updates (noise-dominated regime)."""
    torch.manual_seed(0)
    n, d = 64, 60
    data = ArrayDataset(np.random.default_rng(0).normal(size=(n, d)).astype(np.float32), np.zeros(n, dtype=np.int64), 2)
    lr, z, clip, b = 0.1, 2.0, 0.01, 16
    model = torch.nn.Linear(d, 100)
    p = sum(t.numel() for t in model.parameters())
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    res = local_train(model, data, LocalTraining(batch_size=b, steps=epochs_to_steps(n, b, 2), lr=lr, seed=3,
                                                 dp=PerSampleDP(z, clip)))
    delta = torch.nn.utils.parameters_to_vector(model.parameters()).detach() - before
    expected = oracle_sigma2(noise_multiplier=z, clip=clip, num_train=n, sample_rate=dpsgd_sample_rate(n, b),
                             steps=res.steps, lr=lr, num_params=p)
    assert float(delta.pow(2).sum()) == pytest.approx(expected, rel=0.1)


def test_min_epsilon_profile_uses_federation_minimum():
    cfg = resolve_config(overrides={"privacy-dist": "dist2", "strategy": "min-eps"})
    profiles = federation_profiles(cfg.general, cfg.training, cfg.data, 6)
    empty = ArrayDataset(np.zeros((0, 1), np.float32), np.zeros(0, np.int64), 2)
    setup = ClientSetup(cfg.general, cfg.data, cfg.training, cfg.model_spec, profiles[2], empty, empty,
                        torch.device("cpu"))
    out = min_epsilon_profile(setup)
    low = min(q.epsilon for q in profiles)
    assert out.profile.epsilon == low == out.profile.reported_epsilon
    assert out.profile.batch_size == profiles[2].batch_size and setup.profile.epsilon == profiles[2].epsilon
    lie = resolve_config(overrides={"privacy-dist": "dist2", "falsify-client": 2, "falsify-epsilon": 9.0})
    setup_lie = ClientSetup(lie.general, lie.data, lie.training, lie.model_spec,
                            federation_profiles(lie.general, lie.training, lie.data, 6)[2], empty, empty,
                            torch.device("cpu"))
    assert min_epsilon_profile(setup_lie).profile.reported_epsilon == 9.0


def test_min_eps_strategy_weights_by_dataset_size():
    ups = synthetic_round(SIGMAS[:3])
    for i, u in enumerate(ups):
        u.num_examples = 10 * (i + 1)
    raw, extra = make_strategy(MinEpsilon, clip_norm=1.0).aggregation_weights(1, ups)
    assert np.allclose(raw / raw.sum(), np.array([1, 2, 3]) / 6) and extra["noise_variance_oracle"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["robust-hdp", "weiavg", "pfa", "dpsgd-fedavg", "min-eps"])
def test_simulation_logs_oracle_fields(strategy, tmp_path):
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    ov = {"strategy": strategy, "num-server-rounds": 1, "output-dir": str(tmp_path), "max-samples": 400,
          "batch-size-choices": "16,32", "privacy-dist": "dist2", "fraction-evaluate": 0.0}
    run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    rounds = [json.loads(line) for line in open(f"{run_dir}/rounds.jsonl")]
    assert len(rounds) == 1
    m, clients = rounds[0]["metrics"], rounds[0]["clients"]
    assert m["clients_ok"] == 3 and m["noise_variance_oracle"] > 0
    assert (m["noise_variance"] is None) == (strategy == "pfa")
    assert all(c["sigma2_oracle"] > 0 and 0 < c["oracle_weight"] < 1 for c in clients)
    assert math.isclose(sum(c["aggregation_weight"] for c in clients), 1.0)
    if strategy == "robust-hdp":
        assert m["rpca_iterations"] > 0 and all(c["sigma2_estimated"] > 0 for c in clients)
    if strategy == "min-eps":
        assert len({c["epsilon_budget"] for c in clients}) == 1


def test_weighted_sum_is_a_float64_sum_across_blocks():
    """The blocked Σ w_i u_i equals the float64 reference for float32 updates spanning several blocks."""
    from strategies.aggregate import _SUM_BLOCK, weighted_sum

    rng = np.random.default_rng(0)
    p = 2 * _SUM_BLOCK + 123
    ups = [rng.standard_normal(p, dtype=np.float32) for _ in range(5)]
    w = rng.random(5)
    ref = sum(float(wi) * u.astype(np.float64) for wi, u in zip(w, ups))
    out = weighted_sum(ups, w)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-15)
    mats = [rng.normal(size=(3, 4)) for _ in range(3)]
    np.testing.assert_allclose(weighted_sum(mats, [1.0, 2.0, 3.0]), mats[0] + 2 * mats[1] + 3 * mats[2])
    with pytest.raises(ValueError, match="2 updates but 1 weights"):
        weighted_sum(ups[:2], [1.0])


def _declared_round(noise_scales, declared_z, seed=3):
    """20 clients declaring z_i (σ_i² = p z_i² under Eq. 7 with steps=1, η=1, c=1, b̄=1) and adding noise_scales."""
    strat = make_strategy(RobustHDP, clip_norm=1.0, lr_schedule=lambda rnd: 1.0)
    updates = synthetic_round(noise_scales, seed=seed)
    for u, z in zip(updates, declared_z):
        u.metrics["noise_multiplier"] = float(z)
        strat.declared[u.client_id] = (float(z), 0.1)
    return strat, updates


def test_honest_clients_pass_the_declared_noise_check():
    strat, updates = _declared_round(SIGMAS, SIGMAS)
    assert strat.screen(1, updates) == []
    ratios = [u.record["noise_ratio"] for u in updates]
    assert 0.7 < min(ratios) and max(ratios) < 1.5  # synthetic signal leaks into S for the least noisy


@pytest.mark.parametrize("cheat, scale, declared, side", [
    ("zero-noise", 0.0, 0.5, "below the floor"),
    ("half-noise", 0.25, 0.5, "below the floor"),
    # declares a large ε (z = 0.1) but adds the noise of a small one (std 0.5)
    ("declares-large-epsilon", 0.5, 0.1, "above the ceiling"),
])
def test_robust_hdp_cheats_are_rejected(cheat, scale, declared, side):
    scales, zs = SIGMAS.copy(), SIGMAS.copy()
    scales[5], zs[5] = scale, declared
    strat, updates = _declared_round(scales, zs)
    rejected = strat.screen(1, updates)
    assert [u.client_id for u, _ in rejected] == [5], cheat
    assert side in rejected[0][1]


def test_zero_noise_client_cannot_seize_the_aggregate_end_to_end():
    """Through aggregate_fit: the zero update is rejected and struck; the rest are weighted, none above the cap."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    p, n = 2000, 8
    strat = RobustHDP(initial_weights=[np.zeros(p, np.float32)], num_rounds=2, clip_norm=1.0,
                      lr_schedule=lambda rnd: 1.0, max_weight_share=0.3)
    strat.connected_nodes = set(range(n))
    rng = np.random.default_rng(0)
    zs = rng.uniform(0.2, 1.0, n)
    results = []
    for i in range(n):
        # Eq. 7 with steps 1, η 1, c 1, b̄ = ⌊N q⌋ = 1: σ_i² = p z_i²
        noise = np.zeros(p) if i == 0 else rng.normal(scale=zs[i], size=p)
        metrics = {"client_id": i, "status": "ok", "noise_multiplier": float(zs[i]), "sample_rate": 0.1,
                   "steps_round": 1, "delta": 1e-5, "epsilon_spent": 1.0, "epsilon_budget": 1e9}
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([(0.01 + noise).astype(np.float32)]), 10, metrics)
        results.append((SimpleNamespace(node_id=i), res))
    strat.round_log.start(1)
    strat.aggregate_fit(1, results, [])
    recs = {r["client_id"]: r for r in strat.round_log.clients()}
    assert recs[0]["status"] == "rejected" and "below the floor" in recs[0]["reason"]
    assert strat.strikes.strikes.get(0) == 1
    weights = [recs[i]["aggregation_weight"] for i in range(1, n)]
    assert sum(weights) == pytest.approx(1.0) and max(weights) <= 0.3 + 1e-9


def test_cap_shares_water_fills():
    from strategies.aggregate import cap_shares

    w = cap_shares([100.0, 1.0, 1.0, 2.0], 0.4)
    assert w[0] == pytest.approx(0.4) and w.sum() == pytest.approx(1.0)
    assert w[3] == pytest.approx(2 * w[1])  # the uncapped keep their proportions
    assert np.allclose(cap_shares([5.0, 1.0], 0.5), [0.5, 0.5])  # n·cap = 1: everyone 1/n
    assert np.allclose(cap_shares([1.0, 2.0, 3.0], 1.0), [1 / 6, 2 / 6, 3 / 6])  # no cap binds
