"""Fed-SMP: masks, DP-spar, compact payload, server aggregation and ledger, one real Flower simulation."""

from __future__ import annotations

import glob
import json
import math

import numpy as np
import pytest
from conftest import client_manager
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedapp.apps.factories import build_strategy
from fedapp.config import ConfigError, resolve_config
from fedapp.models.zoo import FmnistCNN
from strategies.base import StrategyContext
from strategies.compression import check_indices, decode_sparse, encode_sparse, num_kept, rand_k_indices, top_k_indices
from strategies.fed_smp import CFG_MASK, FedSMPStrategy, dp_spar, mask_from_config
from strategies.privacy.accountants import DPAccountingRDP, epsilon_of
from strategies.privacy.mechanisms import ClientLevelDP

SHAPES = [(4, 5), (5,), (3, 5), (3,)]  # d = 43
D = sum(int(np.prod(s)) for s in SHAPES)


def strategy(sparsifier="randk", private=True, ratio=0.2, clip=1.0, sigma=1.0, r=3, n=4, secagg=False,
             adversary="release", **kw) -> FedSMPStrategy:
    """A server strategy fed plain replies (``secagg=True`` pretends they came through SecAgg+). The arithmetic
    tests account as the papers do (amplified by sampling, ``adversary="release"``) unless they say otherwise."""
    weights = [np.zeros(s, dtype=np.float32) for s in SHAPES]
    factory = (lambda n_: ClientLevelDP(sigma, clip, r, n_, 5, 1e-3, secure_aggregation=secagg,
                                        adversary=adversary)) if private else None
    kw.setdefault("sampling", "fixed")  # exact r per round: these tests check the server's arithmetic
    s = FedSMPStrategy(initial_weights=weights, num_rounds=5, seed=0, clients_per_round=r,
                            sparsifier=sparsifier, compression_ratio=ratio, clip=clip,
                            mechanism_factory=factory, secure_aggregation=secagg, **kw)
    return s


def fit_res(arrays, cid, sigma=1.0, status="ok"):
    metrics = {"client_id": cid, "status": status, "noise_multiplier": sigma}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 10, metrics)


# ---------------------------------------------------------------------------- masks
def test_rand_k_mask_is_shared_and_reproducible_from_the_seed():
    s = strategy()
    cm = client_manager(4)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), cm)
    assert len(ins) == 3
    masks = [mask_from_config(dict(fi.config), D)[1] for _, fi in ins]
    assert all(np.array_equal(m, masks[0]) for m in masks)  # identical for every sampled client
    assert len(masks[0]) == num_kept(D, 0.2) == 9
    assert CFG_MASK not in ins[0][1].config  # rand-k sends the seed, not the mask
    np.testing.assert_array_equal(masks[0], rand_k_indices(D, 9, int(ins[0][1].config["smp-mask-seed"])))
    np.testing.assert_array_equal(masks[0], s.round_mask(1))
    ins2 = s.configure_fit(2, ndarrays_to_parameters(s.current_weights), cm)
    assert not np.array_equal(mask_from_config(dict(ins2[0][1].config), D)[1], masks[0])  # fresh mask each round


def test_rand_k_is_unbiased():
    rng = np.random.default_rng(0)
    delta = rng.normal(size=50)
    draws = 5_000
    mean = np.zeros(50)
    for seed in range(draws):
        idx = rand_k_indices(50, 5, seed)
        vals, _ = dp_spar(delta, idx, "randk", clip=None, dp=None, rng=rng)
        mean += decode_sparse(encode_sparse(vals), idx, 50) / draws
    # per-coordinate std of the estimator is |Δ_j|·sqrt(d/k − 1) = 3|Δ_j|, so the mean is within ~5 std errors
    assert np.max(np.abs(mean - delta) / (3 * np.abs(delta) / math.sqrt(draws))) < 5.5
    # whereas without the d/k scale the mean would be k/d · Δ
    assert np.linalg.norm(mean - delta) < 0.1 * np.linalg.norm(delta)


def test_top_k_picks_largest_magnitudes_in_ascending_order():
    scores = np.array([0.1, -5.0, 2.0, 0.0, 3.0, -0.2])
    np.testing.assert_array_equal(top_k_indices(scores, 3), [1, 2, 4])
    np.testing.assert_array_equal(top_k_indices(np.ones(5), 2), [0, 1])  # deterministic ties


def test_topk_mask_comes_from_public_update_and_travels_as_bytes():
    target = np.arange(D, dtype=np.float64)[::-1].copy()  # largest |Δ_p| at the lowest indices
    s = strategy("topk", ratio=0.1, public_update_fn=lambda w, rnd: target)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(4))
    sparsifier, idx = mask_from_config(dict(ins[0][1].config), D)
    assert sparsifier == "topk"
    np.testing.assert_array_equal(idx, np.arange(num_kept(D, 0.1)))


def test_client_rejects_malformed_mask():
    with pytest.raises(ValueError):
        check_indices(np.array([3, 1, 2]), 10)
    with pytest.raises(ValueError):
        check_indices(np.array([1, 10]), 10)
    with pytest.raises(ValueError, match="bytes"):
        mask_from_config({"smp-sparsifier": "topk", CFG_MASK: "0,1"}, 10)


# ---------------------------------------------------------------------------- DP-spar
@pytest.mark.parametrize("sparsifier", ["randk", "topk"])
def test_noise_touches_only_masked_coordinates(sparsifier):
    d, k = 50_000, 5_000
    idx = rand_k_indices(d, k, 1)
    dp = ClientLevelDP(2.0, 1.0, 4, 100, 1, 1e-3)
    vals, _ = dp_spar(np.zeros(d), idx, sparsifier, clip=1.0, dp=dp, rng=np.random.default_rng(0))
    dense = decode_sparse(encode_sparse(vals), idx, d)
    assert np.all(dense[np.setdiff1d(np.arange(d), idx)] == 0)
    assert np.count_nonzero(dense[idx]) == k
    assert np.std(vals) == pytest.approx(dp.per_client_std, rel=0.05)  # C·σ/√r = 1.0


def test_clipping_bound_and_randk_scaling():
    d, k = 1000, 10
    idx = rand_k_indices(d, k, 2)
    delta = np.full(d, 0.01)
    vals, norm = dp_spar(delta, idx, "randk", clip=None, dp=None, rng=np.random.default_rng(0))
    np.testing.assert_allclose(vals, 0.01 * d / k)
    assert norm == pytest.approx(np.linalg.norm(vals))
    vals, norm = dp_spar(delta, idx, "randk", clip=0.5, dp=None, rng=np.random.default_rng(0))
    assert norm == pytest.approx(math.sqrt(k) * 1.0) and np.linalg.norm(vals) == pytest.approx(0.5)
    vals, _ = dp_spar(delta, idx, "topk", clip=0.5, dp=None, rng=np.random.default_rng(0))
    np.testing.assert_allclose(vals, 0.01)  # top-k: no d/k scaling, already inside the bound


# ---------------------------------------------------------------------------- wire payload
def test_uplink_payload_is_about_4k_bytes():
    for k in (10, 1_000, 16_634):
        size = sum(len(t) for t in ndarrays_to_parameters(encode_sparse(np.ones(k))).tensors)
        assert 4 * k <= size <= 4 * k + 256
    shapes = [tuple(p.shape) for p in FmnistCNN().state_dict().values()]
    d = sum(int(np.prod(s)) for s in shapes)
    dense = sum(len(t) for t in ndarrays_to_parameters([np.zeros(s, np.float32) for s in shapes]).tensors)
    sparse = sum(len(t) for t in ndarrays_to_parameters(encode_sparse(np.zeros(num_kept(d, 0.01)))).tensors)
    assert sparse / dense <= 0.011


# ---------------------------------------------------------------------------- server
def test_server_averages_with_one_over_r_and_rejects_bad_payloads():
    s = strategy("randk", ratio=0.2, sigma=1.0, r=4, n=5)
    cm = client_manager(5)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), cm)
    idx = s.round_mask(1)
    proxies = [p for p, _ in ins]
    good = [np.full(len(idx), 0.1 * (i + 1), dtype=np.float32) for i in range(2)]
    results = [
        (proxies[0], fit_res([good[0]], 0)),
        (proxies[1], fit_res([good[1]], 1)),
        (proxies[2], fit_res([np.ones(len(idx) + 1, np.float32)], 2)),  # wrong length
        (proxies[3], fit_res([], 3, status="refused")),
    ]
    _, metrics = s.aggregate_fit(1, results, [])
    new = np.concatenate([w.ravel() for w in s.current_weights])
    expected = np.zeros(D)
    expected[idx] = (0.1 + 0.2) / 4  # Σ over accepted / r sampled (Alg. 2 line 16)
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    assert metrics["clients_ok"] == 2 and metrics["clients_rejected"] == 1 and metrics["clients_refused"] == 1
    records = s.round_log.clients()
    assert [r["status"] for r in records] == ["ok", "ok", "rejected", "refused"]
    assert "shape" in records[2]["reason"]
    # without secure aggregation the headline is one update's ε (multiplier σ/√r), for every client;
    # 2 of the 4 sampled updates were aggregated, so the sum carried σ·√(2/4), and the server's ledger says so;
    # without SecAgg+ the released mean's noise reveals the count, so the release is charged unamplified (q = 1)
    eps_ind = epsilon_of([(1.0 / math.sqrt(4), 1.0, 1)], 1e-3)
    eps_sum = epsilon_of([(1.0 * math.sqrt(2 / 4), 1.0, 1)], 1e-3)
    assert all(r["epsilon_spent"] == pytest.approx(eps_ind) for r in records)  # server ledger for every client
    assert metrics["epsilon"] == pytest.approx(eps_ind) and metrics["epsilon_individual"] == pytest.approx(eps_ind)
    assert metrics["epsilon_aggregate"] == pytest.approx(eps_sum) and eps_sum < eps_ind
    assert metrics["noise_multiplier_effective"] == pytest.approx(math.sqrt(0.5))


def test_server_rejects_out_of_bound_norm_and_wrong_sigma():
    s = strategy("randk", private=False, ratio=0.5, clip=1.0)
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(4))
    k = len(s.round_mask(1))
    results = [(ins[0][0], fit_res([np.full(k, 10.0, np.float32)], 0))]
    s.aggregate_fit(1, results, [])
    assert s.round_log.clients()[0]["status"] == "rejected" and "declared bound" in s.round_log.clients()[0]["reason"]
    assert all(np.all(w == 0) for w in s.current_weights)  # the global model is untouched
    p = strategy("randk", ratio=0.5, sigma=1.0)
    ins = p.configure_fit(1, ndarrays_to_parameters(p.current_weights), client_manager(4))
    p.aggregate_fit(1, [(ins[0][0], fit_res([np.zeros(k, np.float32)], 0, sigma=0.1))], [])
    assert "noise multiplier" in p.round_log.clients()[0]["reason"]


def test_topk_needs_public_samples():
    cfg = resolve_config({}, {"strategy": "fed-smp-topk"})
    weights = [np.zeros(s, np.float32) for s in SHAPES]
    with pytest.raises(ConfigError, match="public-samples"):
        build_strategy(cfg, StrategyContext(initial_weights=weights))


# ---------------------------------------------------------------------------- Flower simulation
@pytest.mark.slow
def test_fed_smp_topk_flower_simulation(tmp_path):
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    ov = {"strategy": "fed-smp-topk", "num-server-rounds": 2, "output-dir": str(tmp_path), "compression-ratio": 0.05,
          "public-samples": 100, "privacy-dist": "fixed", "batch-size": 16, "local-steps": 3, "clip-norm": 1.0,
          "clients-per-round": 3, "noise-multiplier": 1.0, "fraction-evaluate": 0.0,
          "secure-aggregation": False,  # the plain wire format (SecAgg+: tests/integration/fedapp/privacy/test_secure_aggregation.py)
          # without SecAgg+ the released mean's noise reveals the count, so no amplification is claimed (release
          # with secure-aggregation = false is refused): charged at q = 1, as recomputed below
          "client-dp-adversary": "server",
          "seeded-noise": True}  # reproducible draws: a secret Poisson draw of 0 of 4 (1/256 a round) left a round unsampled
    run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    (path,) = glob.glob(str(tmp_path / "*" / "rounds.jsonl"))
    rounds = [json.loads(line) for line in open(path)]
    assert [r["round"] for r in rounds] == [1, 2]
    cfg = resolve_config({}, ov)
    from fedapp.privacy.profiles import client_level_mechanism

    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 4)
    k = rounds[0]["metrics"]["k"]
    assert rounds[0]["metrics"]["compression_ratio"] == pytest.approx(0.05, rel=0.01)
    for r in rounds:
        ok = [c for c in r["clients"] if c["status"] == "ok"]
        assert len(ok) == r["metrics"]["clients_sampled"]  # Poisson sampling with q = 3/4
        assert all(4 * k <= c["uplink_bytes"] <= 4 * k + 256 for c in ok)
        assert r["metrics"]["accuracy"] is not None
    # recompute the ledger from rounds.jsonl with Google's dp_accounting, unamplified (q = 1: the server drew the
    # Poisson sample, q = 3/4). Without secure aggregation the server sees each update, noised with the fixed
    # C·σ/√r: the headline ε composes multiplier σ/√r per released round; the sum of r' updates had σ·√(r'/r)
    released = [r for r in rounds if r["metrics"].get("clients_ok")]
    assert dp.sample_rate == 0.75 and dp.accounted_sample_rate == 1.0
    expected = DPAccountingRDP().epsilon([(1.0 / math.sqrt(3), 1.0, len(released))], dp.delta)
    aggregate = DPAccountingRDP().epsilon([(math.sqrt(r["metrics"]["clients_ok"] / 3), 1.0, 1)
                                           for r in released], dp.delta)
    assert rounds[1]["metrics"]["epsilon"] == pytest.approx(expected, rel=0.01) and dp.noise_multiplier == 1.0
    assert rounds[1]["metrics"]["epsilon_aggregate"] == pytest.approx(aggregate, rel=0.01)
    assert all(c["epsilon_spent"] == pytest.approx(expected, rel=0.01) for c in rounds[1]["clients"])
    assert all(c["noise_multiplier"] == 1.0 for c in rounds[1]["clients"])
    assert rounds[1]["metrics"]["uplink_bytes_cumulative"] == sum(r["metrics"]["uplink_bytes"] for r in rounds)


def test_server_samples_nobody_past_the_planned_rounds():
    s = strategy("randk", ratio=0.2, sigma=1.0, r=3, n=4)  # dp planned for T = 5 rounds
    ins = s.configure_fit(7, ndarrays_to_parameters(s.current_weights), client_manager(4))
    assert ins == [] and s.budget_exhausted and s.round_log.metrics()["budget_exhausted"]


def test_dropouts_never_push_the_ledger_over_the_budget():
    s = strategy("randk", ratio=0.2, sigma=1.0, r=4, n=5, secagg=True)
    statuses = []
    for rnd in range(1, 6):
        ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(5))
        if ins:  # three survivors of four every round: each round costs more than a planned one (less noise, and
            # unamplified: the sum's noise σ·√(3/4) reveals the count)
            results = [(p, fit_res([np.zeros(9, np.float32)], int(p.node_id) - 1)) for p, _ in ins[:3]]
            reason = s.unmask_refusal(rnd, results)  # what the SecAgg+ workflow asks before unmasking
            if reason is None:
                s.aggregate_fit(rnd, results, [])
            else:
                s.record_unreconstructed(rnd, results, [], reason)
            statuses += [r["status"] for r in s.round_log.clients()]
        s.flush_round()
    planned = ClientLevelDP(1.0, 1.0, 4, 5, 5, 1e-3, secure_aggregation=True, adversary="release").epsilon()
    # the first rounds are paid at the higher (dropout) cost; the round the budget cannot pay is refused before
    # its sum is reconstructed (withheld, not charged), and every reconstructed sum is charged
    assert statuses[0] == "ok" and "withheld" in statuses
    assert s.ledger.population_epsilon() <= planned < s.accounting.epsilon_after(s.ledger.population * 2)


def test_a_resume_that_recalibrates_sigma_is_composed_exactly_and_stopped_at_the_budget():
    """T = 3 interrupted after 2 rounds and resumed to T = 4 must not report ε(σ_new, 4 rounds)
    for rounds that ran at σ_old. The ledger (checkpointed) composes each round at the σ it had; the resumed
    server samples nobody once the budget cannot pay for a planned round."""
    target, q, delta = 1.0, 3 / 4, 1e-3
    old = ClientLevelDP.calibrated(target, clip=1.0, clients_per_round=3, num_clients=4, rounds=3, delta=delta,
                                   secure_aggregation=True, adversary="release")
    new = ClientLevelDP.calibrated(target, clip=1.0, clients_per_round=3, num_clients=4, rounds=4, delta=delta,
                                   secure_aggregation=True, adversary="release")
    assert new.noise_multiplier > old.noise_multiplier
    first = strategy("randk", sigma=old.noise_multiplier, r=3, n=4, secagg=True)
    first.accounting.bind(old, None)
    for rnd in (1, 2):
        ins = first.configure_fit(rnd, ndarrays_to_parameters(first.current_weights), client_manager(4))
        first.aggregate_fit(rnd, [(p, fit_res([np.zeros(9, np.float32)], int(p.node_id) - 1,
                                              sigma=old.noise_multiplier)) for p, _ in ins], [])
        first.flush_round()
    resumed = strategy("randk", sigma=new.noise_multiplier, r=3, n=4, secagg=True)
    resumed.load_state_dict(first.state_dict())
    resumed.accounting.bind(new, None)  # what the resumed run's mechanism factory returns for num-server-rounds = 4
    eps_two_old = epsilon_of([(old.noise_multiplier, q, 2)], delta)
    assert resumed.ledger.population_epsilon() == pytest.approx(eps_two_old)  # not ε(σ_new, 2)
    ran = 0
    for rnd in (3, 4):
        ins = resumed.configure_fit(rnd, ndarrays_to_parameters(resumed.current_weights), client_manager(4))
        if ins:
            ran += 1
            resumed.aggregate_fit(rnd, [(p, fit_res([np.zeros(9, np.float32)], int(p.node_id) - 1,
                                                    sigma=new.noise_multiplier)) for p, _ in ins], [])
        resumed.flush_round()
    composed = epsilon_of([(old.noise_multiplier, q, 2), (new.noise_multiplier, q, ran)], delta)
    assert resumed.ledger.population_epsilon() == pytest.approx(composed) and composed <= target * (1 + 1e-9)
    assert ran < 2  # the old, less noisy rounds used up more of the budget than the new plan assumed


def test_against_the_server_every_round_is_charged_unamplified_and_the_release_view_is_reported():
    """Default adversary: the server drew the sample, so the ledger charges q = 1 every round (a bound on every
    client's epsilon_vs_server); the amplified ε of the released sums is reported as epsilon_vs_release."""
    s = strategy("none", sigma=2.0, r=3, n=6, secagg=True, adversary="server")
    for rnd in (1, 2):
        ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(6))
        results = [(p, fit_res([np.zeros(sh, np.float32) for sh in SHAPES], int(p.node_id) - 1, sigma=2.0))
                   for p, _ in ins]
        assert s.unmask_refusal(rnd, results) is None
        _, metrics = s.aggregate_fit(rnd, results, [])
        clients = s.round_log.clients()
        s.flush_round()
    delta = 1e-3
    assert metrics["epsilon"] == pytest.approx(epsilon_of([(2.0, 1.0, 2)], delta))
    assert metrics["epsilon_vs_release"] == pytest.approx(epsilon_of([(2.0, 0.5, 2)], delta))
    assert metrics["epsilon_vs_release"] < metrics["epsilon"]
    assert s.sampler.fixed_rate == 0.5  # q = r/n of the registered clients, whoever is available
    vs_server = [c["epsilon_vs_server"] for c in clients if c.get("epsilon_vs_server") is not None]
    assert vs_server and max(vs_server) <= metrics["epsilon"] * (1 + 1e-9)
