"""Adaptive clipping wired into dp-fedavg (Andrew et al. 2021): the server's C_t, its checkpoint, the clients'
checks and noise, the charge of the noise split, and the run-config's refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import client_context, client_manager
from dp_accounting import dp_event, rdp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedapp.apps.privacy_plan import privacy_plan
from fedapp.clients.client_dp import ClientLevelDPClient
from fedapp.clients.common import setup_client
from fedapp.clients.training import get_weights
from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism
from fedapp.state.checkpoint import load_checkpoint, save_checkpoint
from strategies.client_level import CFG_CLIP, CFG_SIGMA, METRIC_UNCLIPPED_SHARE
from strategies.fed_smp import FedSMPStrategy
from strategies.privacy.accountants import epsilon_of
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig, update_noise_multiplier
from strategies.privacy.mechanisms import ClientLevelDP

SHAPES = [(6, 5), (5,)]
Z, R, N, DELTA = 1.0, 4, 4, 1e-3
ADAPTIVE = AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.2, count_noise_std=1.0, initial_clip=2.0)


def strategy(adaptive: AdaptiveClipConfig | None = ADAPTIVE) -> FedSMPStrategy:
    weights = [np.zeros(s, dtype=np.float32) for s in SHAPES]
    return FedSMPStrategy(
        initial_weights=weights, num_rounds=5, seed=0, clients_per_round=R, sparsifier="none", compression_ratio=1.0,
        clip=ADAPTIVE.initial_clip, sampling="fixed", secure_aggregation=False,
        mechanism_factory=lambda n: ClientLevelDP(Z, ADAPTIVE.initial_clip, R, n, 5, DELTA, secure_aggregation=False,
                                                  adversary="server"),
        adaptive_clip_factory=(lambda dp: adaptive))


def reply(cid: int, clip: float, share: float, norm: float = 0.1) -> FitRes:
    update = [np.full(s, norm / math.sqrt(35), dtype=np.float32) for s in SHAPES]
    metrics = {"client_id": cid, "status": "ok", "noise_multiplier": Z, "clip_norm": clip,
               METRIC_UNCLIPPED_SHARE: share}
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), 1, metrics)


def run_round(s: FedSMPStrategy, rnd: int, shares: list[float], clip: float | None = None):
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(N))
    sent = ins[0][1].config[CFG_CLIP]
    results = [(p, reply(i, sent if clip is None else clip, shares[i])) for i, (p, _) in enumerate(ins)]
    _, metrics = s.aggregate_fit(rnd, results, [])
    return sent, metrics


def test_server_sends_c_t_and_updates_it_geometrically_from_the_noisy_shares():
    s = strategy()
    shares = [0.5, 0.5, -0.5, 0.7]  # b_i − ½ + noise, as the clients sent them
    sent, metrics = run_round(s, 1, shares)
    assert sent == ADAPTIVE.initial_clip and metrics["clients_ok"] == 4
    fraction = sum(shares) / R + 0.5
    expected = ADAPTIVE.initial_clip * math.exp(-ADAPTIVE.learning_rate * (fraction - ADAPTIVE.target_quantile))
    assert metrics["unclipped_fraction"] == pytest.approx(fraction)
    assert metrics["clip_norm"] == ADAPTIVE.initial_clip and s.clip_t == pytest.approx(expected)
    assert metrics["next_clip_norm"] == pytest.approx(expected)
    sent2, _ = run_round(s, 2, [-0.5] * 4)
    assert sent2 == pytest.approx(expected)  # round 2 is clipped at C_1
    # all clipped: b̄ = 0 < γ, so the clip grows by exp(η γ)
    assert s.clip_t == pytest.approx(expected * math.exp(ADAPTIVE.learning_rate * ADAPTIVE.target_quantile))


def test_clip_survives_a_checkpoint_round_trip(tmp_path):
    s = strategy()
    run_round(s, 1, [0.5] * 4)
    moved = s.clip_t
    assert moved is not None and moved < ADAPTIVE.initial_clip
    path = save_checkpoint(tmp_path / "checkpoint.npz", {"state": s.state_dict()})
    resumed = strategy()
    resumed.load_state_dict(load_checkpoint(path)["state"])
    ins = resumed.configure_fit(2, ndarrays_to_parameters(resumed.current_weights), client_manager(N))
    assert ins[0][1].config[CFG_CLIP] == moved  # the resumed run continues at C_1, not C_0
    state = s.state_dict()
    state["family"]["clip_norm"] = math.nan
    with pytest.raises(ValueError, match="clip_norm nan"):
        strategy().load_state_dict(state)


def test_server_rejects_another_clip_and_an_out_of_range_share():
    s = strategy()
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(N))
    results = [(ins[0][0], reply(0, 9.0, 0.5)), (ins[1][0], reply(1, ADAPTIVE.initial_clip, 50.0)),
               (ins[2][0], reply(2, ADAPTIVE.initial_clip, 0.5))]
    s.aggregate_fit(1, results, [])
    records = s.round_log.clients()
    assert [r["status"] for r in records[:3]] == ["rejected", "rejected", "ok"]
    assert "adaptive clip" in records[0]["reason"] and METRIC_UNCLIPPED_SHARE in records[1]["reason"]


def test_an_adaptive_round_costs_what_a_fixed_clip_round_costs_at_z():
    adaptive, fixed = strategy(), strategy(adaptive=None)
    _, m_adaptive = run_round(adaptive, 1, [0.5] * 4)
    ins = fixed.configure_fit(1, ndarrays_to_parameters(fixed.current_weights), client_manager(N))
    _, m_fixed = fixed.aggregate_fit(1, [(p, reply(i, 0.0, 0.0)) for i, (p, _) in enumerate(ins)], [])
    assert m_adaptive["epsilon"] == m_fixed["epsilon"]
    # independently: what one update shows the server is a Gaussian of multiplier z_Δ/√r (sensitivity C_t) and one
    # of 2σ_b/√r (the centred bit, sensitivity ½); dp_accounting composes the two, unamplified (server adversary)
    z_delta = update_noise_multiplier(Z, ADAPTIVE.count_noise_std)
    assert m_adaptive["update_noise_multiplier"] == pytest.approx(z_delta) and z_delta > Z
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(z_delta / math.sqrt(R)),
                                          dp_event.GaussianDpEvent(2 * ADAPTIVE.count_noise_std / math.sqrt(R))]))
    assert m_adaptive["epsilon"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    assert m_adaptive["epsilon"] == pytest.approx(epsilon_of([(Z / math.sqrt(R), 1.0, 1)], DELTA), rel=1e-9)


# ---------------------------------------------------------------------------- client
BASE = {"strategy": "dp-fedavg", "dataset": "digits", "privacy-dist": "fixed", "batch-size": 16, "local-steps": 3, "clip-norm": 0.5,
        "num-server-rounds": 3, "clients-per-round": 2, "lr": 0.1, "momentum": 0.5, "noise-multiplier": 1.3,
        "secure-aggregation": False, "adaptive-clip-quantile": 0.5, "adaptive-clip-count-noise": 1.3}


def make_client(overrides: dict, cid: int = 0) -> ClientLevelDPClient:
    ctx = client_context(cid, 4, run_id=0, node_id=cid + 1)
    return ClientLevelDPClient(setup_client(ctx, overrides), resolve_config(None, overrides).client_dp, ctx, private=True)


def test_client_noise_std_is_z_delta_times_the_servers_clip_and_it_reports_a_noisy_bit():
    client = make_client(BASE)
    weights = get_weights(client.s.new_model())
    c_t = 1e-4  # far below ‖Δ‖: the clipped update (norm c_t) is negligible next to the noise
    arrays, _, metrics = client.fit(weights, {"server-round": 1, CFG_SIGMA: 1.3, CFG_CLIP: c_t})
    assert metrics["status"] == "ok", metrics
    flat = np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
    z_delta = update_noise_multiplier(1.3, 1.3)
    assert metrics["update_noise_multiplier"] == pytest.approx(z_delta) and metrics["clip_norm"] == c_t
    expected = z_delta * c_t / math.sqrt(2)  # z_Δ C_t/√r, r = clients-per-round (no SecAgg+)
    assert float(np.std(flat)) == pytest.approx(expected, rel=0.05)
    assert abs(float(np.std(flat)) - 1.3 * c_t / math.sqrt(2)) > 0.1 * expected  # not the fixed-clip z C_t/√r
    share = metrics[METRIC_UNCLIPPED_SHARE]
    assert isinstance(share, float) and share != -0.5  # noised: the bit itself is never sent
    assert "update_norm" not in metrics


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, 0.0, -1.0, True])
def test_client_refuses_a_nonsensical_clip_from_the_server(bad):
    client = make_client(BASE)
    cfg = {"server-round": 1, CFG_SIGMA: 1.3}
    if bad is not None:
        cfg[CFG_CLIP] = bad
    arrays, n, metrics = client.fit(get_weights(client.s.new_model()), cfg)
    assert metrics["status"] == "refused" and arrays == [] and n == 0
    assert CFG_CLIP in metrics["reason"]


# ---------------------------------------------------------------------------- run-config
def test_adaptive_clipping_is_refused_where_it_is_not_supported():
    with pytest.raises(ConfigError, match="'adaptive-clip-quantile' = 0.5 with strategy 'fedavg-randk'.*dp-fedavg"):
        resolve_config({}, {**BASE, "strategy": "fedavg-randk"})  # non-private: nothing to adapt
    with pytest.raises(ConfigError, match="'dp-ftrl'.*fixed clip across rounds: a changing C_t breaks the prefix-sum"):
        resolve_config({}, {**BASE, "strategy": "dp-ftrl", "client-dp-adversary": "release", "clients-per-round": 0})
    with pytest.raises(ConfigError, match="'secagg-mechanism' = 'ddg' with adaptive-clip-quantile = 0.5"):
        resolve_config({}, {**BASE, "strategy": "dp-fedavg", "secure-aggregation": True, "secagg-mechanism": "ddg"})
    assert resolve_config({}, {**BASE, "strategy": "dp-fedavg", "secure-aggregation": True}).client_dp \
        .secagg_mechanism == "gaussian"  # the default follows adaptive clipping
    with pytest.raises(ConfigError, match="'adaptive-clip-lr' = 0.5 would have no effect"):
        resolve_config({}, {**BASE, "strategy": "dp-fedavg", "adaptive-clip-quantile": 0.0, "adaptive-clip-lr": 0.5,
                            "adaptive-clip-count-noise": 0.0})
    with pytest.raises(ConfigError, match="adaptive-clip-quantile"):
        resolve_config({}, {**BASE, "strategy": "dp-fedavg", "adaptive-clip-quantile": 1.0})


def test_a_count_noise_that_would_spend_the_budget_is_refused_before_the_run():
    cfg = resolve_config({}, {**BASE, "strategy": "dp-fedavg", "adaptive-clip-count-noise": 0.6})
    with pytest.raises(ConfigError, match=r"'adaptive-clip-count-noise' = 0.6 must exceed z/2 = 0.65"):
        privacy_plan(cfg, 4)
    # r/20 = 0.1 is far too small for z = 1.3 at r = 2: the default then takes σ_b = z
    cfg = resolve_config({}, {**BASE, "strategy": "dp-fedavg", "adaptive-clip-count-noise": 0.0})
    default = adaptive_clip_config(cfg.client_dp, client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 4))
    assert default is not None and default.count_noise_std == pytest.approx(1.3)
    ok = resolve_config({}, {**BASE, "strategy": "dp-fedavg"})
    plan = privacy_plan(ok, 4)["mechanism"]["adaptive_clipping"]
    assert plan["update_noise_multiplier"] == pytest.approx(2 * 1.3 / math.sqrt(3))
