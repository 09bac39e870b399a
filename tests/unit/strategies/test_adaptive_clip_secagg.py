"""Adaptive clipping (Andrew et al. 2021) under SecAgg+ with continuous Gaussian shares: each client's noised count
share is one extra coordinate of the secure sum; the server splits it off the decoded sum, never sees one bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import client_context, client_manager
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedapp.apps.privacy_plan import privacy_plan, secure_payload_dim
from fedapp.clients.client_dp import ClientLevelDPClient, secure_count_coordinate
from fedapp.clients.common import setup_client
from fedapp.clients.training import get_weights
from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism
from strategies.client_level import CFG_CLIP, CFG_ROUND_CLIENTS, CFG_SIGMA, METRIC_UNCLIPPED_SHARE
from strategies.errors import ConfigError as StrategyConfigError
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.accountants import epsilon_of
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig, round_mechanism, update_noise_multiplier
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.mechanisms import ClientLevelDP

SHAPES = [(6, 5), (5,)]
D = 35
Z, R, N, DELTA = 1.0, 4, 4, 1e-3
ADAPTIVE = AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.2, count_noise_std=1.0, initial_clip=2.0)


def strategy(ddg: bool = False) -> FedSMPStrategy:
    weights = [np.zeros(s, dtype=np.float32) for s in SHAPES]
    return FedSMPStrategy(
        initial_weights=weights, num_rounds=5, seed=0, clients_per_round=R, sparsifier="none", compression_ratio=1.0,
        clip=ADAPTIVE.initial_clip, sampling="fixed", secure_aggregation=True,
        mechanism_factory=lambda n: ClientLevelDP(Z, ADAPTIVE.initial_clip, R, n, 5, DELTA, secure_aggregation=True,
                                                  adversary="server"),
        secure_sum_factory=(lambda dp, dim: DistributedDiscreteGaussian(dp.clip, dp.noise_multiplier, R, dim, 16))
        if ddg else None,
        adaptive_clip_factory=lambda dp: ADAPTIVE)


def stated_scale(clip: float, r_t: int) -> float:
    """The documented scale: (C_t + 12 z_Δ C_t/√r_t) / (½ + 12 σ_b/√r_t), recomputed here from the formula."""
    z_delta = update_noise_multiplier(Z, ADAPTIVE.count_noise_std)
    return (clip + 12 * z_delta * clip / math.sqrt(r_t)) / (0.5 + 12 * ADAPTIVE.count_noise_std / math.sqrt(r_t))


def secure_round(s: FedSMPStrategy, rnd: int, shares: list[float], arrays_of=None):
    """A round as Flower's SecAgg+ hands it to aggregate_fit: every survivor's reply carries the dequantized mean of
    the survivors' vectors (update arrays, then the scaled count share); ``len(shares)`` survivors."""
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(N))
    clip = ins[0][1].config[CFG_CLIP]
    r_t = ins[0][1].config[CFG_ROUND_CLIENTS]
    scale = stated_scale(clip, r_t)
    updates = [[np.full(sh, 0.01 * (i + 1), dtype=np.float64) for sh in SHAPES] for i in range(len(shares))]
    vectors = [u + [np.array([scale * b])] for u, b in zip(updates, shares)]
    mean = [sum(v[k] for v in vectors) / len(vectors) for k in range(len(SHAPES) + 1)]
    payload = ndarrays_to_parameters(mean if arrays_of is None else arrays_of(mean))
    metrics = [{"client_id": i, "status": "ok", "noise_multiplier": Z, "clip_norm": clip} for i in range(len(shares))]
    results = [(p, FitRes(Status(Code.OK, ""), payload, 1, m)) for (p, _), m in zip(ins, metrics)]
    _, out = s.aggregate_fit(rnd, results, [])
    return clip, r_t, updates, out


def test_payload_is_the_update_plus_one_count_coordinate():
    s = strategy()
    assert s.payload_dim() == D + 1 and s.count_in_secure_sum


def test_server_splits_the_summed_shares_off_the_secure_sum_and_moves_the_clip():
    s = strategy()
    shares = [0.5 + 0.3, 0.5 - 0.2, -0.5 + 0.1]  # b_i − ½ + noise of 3 survivors of 4 sampled
    clip, r_t, updates, m = secure_round(s, 1, shares)
    assert clip == ADAPTIVE.initial_clip and r_t == 4 and m["clients_ok"] == 3
    fraction = sum(shares) / 3 + 0.5  # over the r' = 3 survivors whose shares are in the sum
    assert m["unclipped_fraction"] == pytest.approx(fraction, rel=1e-12) and m["count_sum_clients"] == 3
    expected = clip * math.exp(-ADAPTIVE.learning_rate * (fraction - ADAPTIVE.target_quantile))
    assert s.clip_t == pytest.approx(expected, rel=1e-12) and m["next_clip_norm"] == pytest.approx(expected)
    # the model moved by the update part only: (1/r_t) Σ Δ_i, the count coordinate is gone
    model = np.concatenate([w.ravel() for w in s.current_weights]).astype(np.float64)
    assert model == pytest.approx(np.full(D, (0.01 + 0.02 + 0.03) / r_t), abs=1e-7)
    # charged as a fixed-clip round of 3 of 4 at z: multiplier z√(3/4) (Thm 1: z_Δ and 2σ_b compose to z)
    assert m["noise_multiplier_effective"] == pytest.approx(Z * math.sqrt(3 / 4))
    assert m["epsilon"] == pytest.approx(epsilon_of([(Z * math.sqrt(3 / 4), 1.0, 1)], DELTA), rel=1e-9)
    # round 2 is clipped at C_1, and the scale follows it
    clip2, _, _, m2 = secure_round(s, 2, [-0.5] * 4)
    assert clip2 == pytest.approx(expected) and m2["unclipped_fraction"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("layout", ["no count coordinate", "two count coordinates", "count folded into a layer"])
def test_a_secure_sum_of_the_wrong_length_is_rejected_and_the_clip_kept(layout):
    s = strategy()
    wrong = {"no count coordinate": lambda m: m[:-1],
             "two count coordinates": lambda m: [*m, np.array([0.0])],
             "count folded into a layer": lambda m: [m[0], np.concatenate([m[1], m[2]])]}[layout]
    _, _, _, m = secure_round(s, 1, [0.5] * 4, arrays_of=wrong)
    assert m["clients_ok"] == 0 and m["round_withheld"]
    assert s.clip_t == ADAPTIVE.initial_clip and "unclipped_fraction" not in m
    assert all(c["status"] == "withheld" for c in s.round_log.clients()[:4])
    assert m["epsilon"] > 0  # the sum was reconstructed: charged all the same
    assert np.all(np.concatenate([w.ravel() for w in s.current_weights]) == 0)  # nothing released


def test_a_survivor_clipped_at_another_clip_stops_the_unmasking():
    s = strategy()
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(N))
    results = [(p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([]), 1,
                          {"client_id": i, "status": "ok", "noise_multiplier": Z,
                           "clip_norm": ADAPTIVE.initial_clip * (3.0 if i == 2 else 1.0)}))
               for i, (p, _) in enumerate(ins)]
    reason = s.unmask_refusal(1, results)
    assert reason is not None and "adaptive clip" in reason


def test_adaptive_clipping_with_the_discrete_gaussian_is_refused_by_the_strategy():
    s = strategy(ddg=True)
    with pytest.raises(StrategyConfigError, match="secagg-mechanism = 'ddg'"):
        s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(N))


# ---------------------------------------------------------------------------- client
BASE = {"strategy": "dp-fedavg", "dataset": "digits", "privacy-dist": "fixed", "batch-size": 16, "local-steps": 3,
        "clip-norm": 0.5, "num-server-rounds": 3, "clients-per-round": 2, "lr": 0.1, "momentum": 0.5,
        "noise-multiplier": 1.3, "secure-aggregation": True, "secagg-mechanism": "gaussian",
        "adaptive-clip-quantile": 0.5, "adaptive-clip-count-noise": 1.3}


def test_the_count_coordinate_has_the_stated_scale_and_noise_std():
    cfg = resolve_config({}, BASE)
    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 4)
    adaptive = adaptive_clip_config(cfg.client_dp, dp)
    assert adaptive is not None
    clip, r_t = 0.7, 3
    noise_dp = round_mechanism(dp, clip, update_noise_multiplier(dp.noise_multiplier, adaptive.count_noise_std))
    z_delta = noise_dp.noise_multiplier
    scale = (clip + 12 * z_delta * clip / math.sqrt(r_t)) / (0.5 + 12 * 1.3 / math.sqrt(r_t))
    rng = np.random.default_rng(7)
    config = {CFG_ROUND_CLIENTS: r_t}
    for norm, bit in ((0.1, 1.0), (5.0, 0.0)):
        draws = np.array([secure_count_coordinate(norm, noise_dp, adaptive, config, r_t, rng) for _ in range(20000)])
        shares = draws / scale
        assert abs(float(np.mean(shares)) - (bit - 0.5)) < 4 * 1.3 / math.sqrt(r_t) / math.sqrt(20000)
        assert float(np.std(shares)) == pytest.approx(1.3 / math.sqrt(r_t), rel=0.02)
        assert np.all(np.abs(draws) < clip + 12 * noise_dp.noise_std(r_t))  # inside SecAgg+'s clipping range
    # a client whose floor caps r_t at 1 adds more noise (σ_b/√1) but keeps the server's scale, so the sum decodes
    capped = np.array([secure_count_coordinate(0.1, noise_dp, adaptive, config, 1, rng) for _ in range(20000)])
    assert float(np.std(capped / scale)) == pytest.approx(1.3, rel=0.02)


def test_client_appends_the_count_coordinate_and_never_reports_the_bit():
    ctx = client_context(0, 4, run_id=0, node_id=1)
    client = ClientLevelDPClient(setup_client(ctx, BASE), resolve_config(None, BASE).client_dp, ctx, private=True)
    weights = get_weights(client.s.new_model())
    arrays, n, metrics = client.fit(weights, {"server-round": 1, CFG_SIGMA: 1.3, CFG_CLIP: 0.4, CFG_ROUND_CLIENTS: 2})
    assert metrics["status"] == "ok", metrics
    assert METRIC_UNCLIPPED_SHARE not in metrics and "update_norm" not in metrics and n == 1
    assert [a.shape for a in arrays] == [w.shape for w in weights] + [(1,)]
    # the payload's length is the one the server's strategy and the privacy plan size the secure sum for
    cfg = resolve_config({}, BASE)
    dim = secure_payload_dim(cfg, weights)
    assert sum(a.size for a in arrays) == dim == sum(w.size for w in weights) + 1
    assert privacy_plan(cfg, 4, dim)["mechanism"]["payload_dim"] == dim
    assert metrics["clip_norm"] == 0.4
    # without SecAgg+ the same client sends the bit as a metric and no extra coordinate
    plain = {k: v for k, v in BASE.items() if k != "secagg-mechanism"} | {"secure-aggregation": False}
    ctx = client_context(0, 4, run_id=0, node_id=1)
    arrays, _, metrics = ClientLevelDPClient(setup_client(ctx, plain), resolve_config(None, plain).client_dp, ctx,
                                             private=True).fit(
        weights, {"server-round": 1, CFG_SIGMA: 1.3, CFG_CLIP: 0.4})
    assert METRIC_UNCLIPPED_SHARE in metrics and [a.shape for a in arrays] == [w.shape for w in weights]


def test_the_run_config_accepts_gaussian_shares_and_refuses_the_discrete_gaussian_by_name():
    resolve_config({}, BASE)
    with pytest.raises(ConfigError, match="'secagg-mechanism' = 'ddg' with adaptive-clip-quantile = 0.5"):
        resolve_config({}, {**BASE, "secagg-mechanism": "ddg"})


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, 0.0, -1.0])
def test_client_under_secagg_refuses_a_nonsensical_clip(bad):
    ctx = client_context(0, 4, run_id=0, node_id=1)
    client = ClientLevelDPClient(setup_client(ctx, BASE), resolve_config(None, BASE).client_dp, ctx, private=True)
    cfg = {"server-round": 1, CFG_SIGMA: 1.3, CFG_ROUND_CLIENTS: 2}
    if bad is not None:
        cfg[CFG_CLIP] = bad
    arrays, n, metrics = client.fit(get_weights(client.s.new_model()), cfg)
    assert metrics["status"] == "refused" and arrays == [] and n == 0 and CFG_CLIP in metrics["reason"]
