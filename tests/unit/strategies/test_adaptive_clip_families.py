"""Adaptive clipping (Andrew et al. 2021, Alg. 1 / Thm 1) for Fed-SMP's private variants and the DP2-FedSAM family:
the noise split on what each family clips, the bit taken on exactly the clipped vector, the SecAgg+ payload and the
charge of an adaptive round."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conftest import client_context, client_manager
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

import fedapp.clients.client_dp as client_dp_module
import fedapp.clients.dp2_fedsam as dp2_client_module
from fedapp.apps.privacy_plan import privacy_plan, secure_payload_dim
from fedapp.clients.client_dp import ClientLevelDPClient
from fedapp.clients.common import setup_client
from fedapp.clients.dp2_fedsam import DP2FedSAMClient
from fedapp.clients.training import TrainResult, get_weights, set_weights
from fedapp.config import resolve_config
from strategies.aggregate import flatten, unflatten
from strategies.client_level import CFG_CLIP, CFG_ROUND_CLIENTS, CFG_SIGMA, METRIC_UNCLIPPED_SHARE
from strategies.compression import encode_sparse, rand_k_indices
from strategies.dp2_fedsam import DP2FedSAMStrategy, get_variant
from strategies.fed_smp import CFG_K, CFG_MASK, CFG_SEED, CFG_SPARSIFIER, FedSMPStrategy
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig, update_noise_multiplier
from strategies.privacy.mechanisms import ClientLevelDP

R = 2  # clients-per-round
COMMON = {"dataset": "digits", "privacy-dist": "fixed", "batch-size": 16, "local-steps": 1, "clip-norm": 0.5,
          "num-server-rounds": 3, "clients-per-round": R, "lr": 0.1, "momentum": 0.0, "secure-aggregation": False,
          "adaptive-clip-quantile": 0.5}
#: large noise: the applied noise std is measurable against a tiny C_t; small noise: the bit is read off the share
LOUD = {"noise-multiplier": 1.3, "adaptive-clip-count-noise": 0.7}  # z_Δ ≈ 2.7 z
QUIET = {"noise-multiplier": 0.02, "adaptive-clip-count-noise": 0.02}


class Recorder:
    """Wraps a function of :mod:`fedapp.clients.client_dp` and keeps its calls' arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------------------- Fed-SMP client
class DesignedUpdateClient(ClientLevelDPClient):
    """Its local training moves the model by a given Δ (so the test knows every norm)."""

    delta: np.ndarray

    def local_train(self, model, *, lr, seed, config):
        weights = get_weights(model)
        set_weights(model, unflatten(flatten(weights) + self.delta, [w.shape for w in weights]))
        return TrainResult(steps=1, loss=0.0, seconds=0.0)


def smp_client(strategy: str, noise: dict, secagg: bool = False) -> DesignedUpdateClient:
    overrides = {**COMMON, **noise, "strategy": strategy, "compression-ratio": 0.1}
    if strategy == "fed-smp-topk":
        overrides["public-samples"] = 50
    if secagg:
        overrides.update({"secure-aggregation": True, "secagg-mechanism": "gaussian"})
    ctx = client_context(0, 4, run_id=0, node_id=1)
    return DesignedUpdateClient(setup_client(ctx, overrides), resolve_config(None, overrides).client_dp, ctx, private=True)


def smp_round(client: DesignedUpdateClient, sparsifier: str, c_t: float, k: int, sigma: float, **extra: Any):
    d = sum(w.size for w in get_weights(client.s.new_model()))
    config: dict[str, Any] = {"server-round": 1, CFG_SIGMA: sigma, CFG_CLIP: c_t, CFG_SPARSIFIER: sparsifier,
                              CFG_K: k, **extra}
    if sparsifier == "randk":
        config[CFG_SEED] = 11
        idx = rand_k_indices(d, k, 11)
    else:
        idx = np.arange(k, dtype=np.int64)
        config[CFG_MASK] = np.asarray(idx, dtype="<i4").tobytes()
    return config, idx, d


@pytest.mark.parametrize("sparsifier", ["randk", "topk"])
def test_fed_smp_update_noise_is_z_delta_times_c_t_on_the_k_values(sparsifier):
    client = smp_client(f"fed-smp-{sparsifier}", LOUD)
    weights = get_weights(client.s.new_model())
    d = sum(w.size for w in weights)
    k = d // 2  # many values: the std is estimated to ~1/√(2k)
    c_t = 1e-4  # far below ‖Δ'‖: the clipped values (norm c_t) vanish next to the noise
    client.delta = np.full(d, 0.01)
    config, _, _ = smp_round(client, sparsifier, c_t, k, 1.3)
    arrays, _, metrics = client.fit(weights, config)
    assert metrics["status"] == "ok", metrics
    values = np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
    assert values.size == k  # the k mask values, no count coordinate without SecAgg+
    z_delta = update_noise_multiplier(1.3, 0.7)
    assert metrics["clip_norm"] == c_t and metrics["update_noise_multiplier"] == pytest.approx(z_delta)
    expected = z_delta * c_t / math.sqrt(R)
    assert float(np.std(values)) == pytest.approx(expected, rel=0.1)
    assert abs(float(np.std(values)) - 1.3 * c_t / math.sqrt(R)) > 0.5 * expected  # not z's
    assert METRIC_UNCLIPPED_SHARE in metrics and "update_norm" not in metrics


def test_fed_smp_topk_bit_is_the_sparsified_norms_not_the_full_updates(monkeypatch):
    """‖Δ⊙m‖ = 0.5 ≤ C_t = 1 < ‖Δ‖ = 2: the bit is 1 (what DP-spar clips is inside C_t)."""
    rec = Recorder(client_dp_module.noisy_centred_bit)
    monkeypatch.setattr(client_dp_module, "noisy_centred_bit", rec)
    client = smp_client("fed-smp-topk", QUIET)
    weights = get_weights(client.s.new_model())
    d = sum(w.size for w in weights)
    k = d // 10
    delta = np.full(d, math.sqrt((4.0 - 0.25) / (d - k)))
    delta[:k] = 0.5 / math.sqrt(k)
    client.delta = delta
    config, _, _ = smp_round(client, "topk", 1.0, k, 0.02)
    assert np.linalg.norm(delta) == pytest.approx(2.0)
    _, _, metrics = client.fit(weights, config)
    assert metrics["status"] == "ok", metrics
    (norm, clip, std, _), = rec.calls
    assert norm == pytest.approx(0.5, rel=1e-5) and clip == 1.0
    assert std == pytest.approx(0.02 / math.sqrt(R))  # σ_b/√r
    assert metrics[METRIC_UNCLIPPED_SHARE] == pytest.approx(0.5, abs=0.1)  # b = 1 (the full norm would give 0)


def test_fed_smp_randk_bit_is_the_scaled_sparsified_norms(monkeypatch):
    """‖Δ‖ = 0.5 ≤ C_t = 1 but the d/k-scaled k values DP-spar clips have norm 0.5·√(d/k) > 1: the bit is 0."""
    rec = Recorder(client_dp_module.noisy_centred_bit)
    monkeypatch.setattr(client_dp_module, "noisy_centred_bit", rec)
    client = smp_client("fed-smp-randk", QUIET)
    weights = get_weights(client.s.new_model())
    d = sum(w.size for w in weights)
    k = d // 10
    client.delta = np.full(d, 0.5 / math.sqrt(d))
    config, idx, _ = smp_round(client, "randk", 1.0, k, 0.02)
    _, _, metrics = client.fit(weights, config)
    assert metrics["status"] == "ok", metrics
    (norm, clip, std, _), = rec.calls
    assert norm == pytest.approx(0.5 * math.sqrt(d / len(idx)), rel=1e-5) and norm > 1.0 and clip == 1.0
    assert std == pytest.approx(0.02 / math.sqrt(R))
    assert metrics[METRIC_UNCLIPPED_SHARE] == pytest.approx(-0.5, abs=0.1)  # b = 0


def test_fed_smp_under_secagg_sends_the_k_values_and_one_count_coordinate(monkeypatch):
    rec = Recorder(client_dp_module.secure_count_coordinate)
    monkeypatch.setattr(client_dp_module, "secure_count_coordinate", rec)
    client = smp_client("fed-smp-randk", LOUD, secagg=True)
    weights = get_weights(client.s.new_model())
    d = sum(w.size for w in weights)
    cfg = resolve_config({}, {**COMMON, **LOUD, "strategy": "fed-smp-randk", "compression-ratio": 0.1,
                              "secure-aggregation": True, "secagg-mechanism": "gaussian"})
    dim = secure_payload_dim(cfg, weights)
    k = dim - 1
    client.delta = np.full(d, 0.5 / math.sqrt(d))
    config, idx, _ = smp_round(client, "randk", 0.4, k, 1.3, **{CFG_ROUND_CLIENTS: 2})
    assert len(idx) == k
    arrays, n, metrics = client.fit(weights, config)
    assert metrics["status"] == "ok", metrics
    assert [a.shape for a in arrays] == [(k,), (1,)] and n == 1
    assert METRIC_UNCLIPPED_SHARE not in metrics
    assert privacy_plan(cfg, 4, dim)["mechanism"]["payload_dim"] == k + 1
    (norm, noise_dp, adaptive, _, r_t, _), = rec.calls
    assert norm == pytest.approx(0.5 * math.sqrt(d / k), rel=1e-5)  # the scaled sparsified norm
    assert noise_dp.clip == 0.4 and noise_dp.noise_multiplier == pytest.approx(update_noise_multiplier(1.3, 0.7))
    assert adaptive.count_noise_std == 0.7 and r_t == 2


# ---------------------------------------------------------------------------- DP2-FedSAM client
def dp2_client(strategy: str, noise: dict, monkeypatch, head_step: float, shared_step: float,
               secagg: bool = False) -> DP2FedSAMClient:
    """A client whose local training adds ``head_step`` to every head entry and ``shared_step`` to every φ entry."""
    overrides = {**COMMON, **noise, "strategy": strategy}
    if secagg:
        overrides.update({"secure-aggregation": True, "secagg-mechanism": "gaussian"})
    ctx = client_context(0, 4, run_id=0, node_id=1)
    cfg = resolve_config(None, overrides)
    client = DP2FedSAMClient(setup_client(ctx, overrides), cfg.client_dp, cfg.dp2_fedsam, ctx, get_variant(strategy))
    head = set(client.head_names)

    def fake_train(model, data, spec, device):
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if name in spec.trainable:
                    t.add_(head_step if name in head else shared_step)
        return TrainResult(steps=1, loss=0.0, seconds=0.0)

    monkeypatch.setattr(dp2_client_module, "local_train", fake_train)
    return client


@pytest.mark.parametrize("strategy", ["dp2-fedsam", "dp-fedsam"])
def test_dp2_update_noise_is_z_delta_times_c_t_on_the_shared_part(strategy, monkeypatch):
    client = dp2_client(strategy, LOUD, monkeypatch, head_step=0.01, shared_step=0.01)
    shared = client.get_parameters({})
    c_t = 1e-4
    arrays, _, metrics = client.fit(shared, {"server-round": 1, CFG_SIGMA: 1.3, CFG_CLIP: c_t})
    assert metrics["status"] == "ok", metrics
    assert [a.shape for a in arrays] == [w.shape for w in shared]
    flat = np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
    z_delta = update_noise_multiplier(1.3, 0.7)
    assert metrics["clip_norm"] == c_t and metrics["update_noise_multiplier"] == pytest.approx(z_delta)
    expected = z_delta * c_t / math.sqrt(R)
    assert float(np.std(flat)) == pytest.approx(expected, rel=0.1)
    assert abs(float(np.std(flat)) - 1.3 * c_t / math.sqrt(R)) > 0.5 * expected
    assert isinstance(metrics[METRIC_UNCLIPPED_SHARE], float)


def test_dp2_bit_is_the_shared_parts_norm_not_the_whole_models(monkeypatch):
    """‖Δφ‖ = 0.5 ≤ C_t = 1 < ‖(Δφ, Δh)‖: the bit is 1 (the head's update is neither clipped nor counted)."""
    rec = Recorder(client_dp_module.noisy_centred_bit)
    monkeypatch.setattr(client_dp_module, "noisy_centred_bit", rec)
    ov = {**COMMON, **QUIET, "strategy": "dp2-fedsam"}
    cfg = resolve_config(None, ov)
    probe = DP2FedSAMClient(setup_client(client_context(0, 4), ov), cfg.client_dp, cfg.dp2_fedsam,
                            client_context(0, 4), get_variant("dp2-fedsam"))
    d_phi = sum(int(np.prod(s)) for s in probe.shared_shapes)
    d_h = sum(w.size for w, m in zip(probe.initial, probe.mask) if not m)
    client = dp2_client("dp2-fedsam", QUIET, monkeypatch, head_step=3.0 / math.sqrt(d_h),
                        shared_step=0.5 / math.sqrt(d_phi))
    arrays, _, metrics = client.fit(client.get_parameters({}), {"server-round": 1, CFG_SIGMA: 0.02, CFG_CLIP: 1.0})
    assert metrics["status"] == "ok", metrics
    (norm, clip, std, _), = rec.calls
    assert norm == pytest.approx(0.5, rel=1e-4) and clip == 1.0  # the full update's norm would be √(0.25 + 9)
    assert std == pytest.approx(0.02 / math.sqrt(R))
    assert metrics[METRIC_UNCLIPPED_SHARE] == pytest.approx(0.5, abs=0.1)


def test_dp2_under_secagg_appends_the_count_coordinate_sized_as_the_server_sizes_it(monkeypatch):
    rec = Recorder(client_dp_module.secure_count_coordinate)
    monkeypatch.setattr(client_dp_module, "secure_count_coordinate", rec)
    client = dp2_client("centaur", LOUD, monkeypatch, head_step=0.01, shared_step=0.001, secagg=True)
    shared = client.get_parameters({})
    arrays, n, metrics = client.fit(shared, {"server-round": 1, CFG_SIGMA: 1.3, CFG_CLIP: 0.4, CFG_ROUND_CLIENTS: 2})
    assert metrics["status"] == "ok", metrics
    assert [a.shape for a in arrays] == [w.shape for w in shared] + [(1,)] and n == 1
    assert METRIC_UNCLIPPED_SHARE not in metrics
    cfg = resolve_config({}, {**COMMON, **LOUD, "strategy": "centaur", "secure-aggregation": True,
                              "secagg-mechanism": "gaussian"})
    dim = secure_payload_dim(cfg, client.initial)
    assert sum(a.size for a in arrays) == dim == sum(w.size for w in shared) + 1
    assert privacy_plan(cfg, 4, dim)["mechanism"]["payload_dim"] == dim
    (norm, noise_dp, _, _, r_t, _), = rec.calls
    d_phi = sum(w.size for w in shared)
    assert norm == pytest.approx(0.001 * math.sqrt(d_phi), rel=1e-4) and noise_dp.clip == 0.4 and r_t == 2


def test_dp2_client_refuses_a_round_without_the_servers_clip(monkeypatch):
    client = dp2_client("dp-fedavg-ft", LOUD, monkeypatch, head_step=0.01, shared_step=0.01)
    arrays, n, metrics = client.fit(client.get_parameters({}), {"server-round": 1, CFG_SIGMA: 1.3})
    assert metrics["status"] == "refused" and arrays == [] and n == 0 and CFG_CLIP in metrics["reason"]


# ---------------------------------------------------------------------------- servers
SHAPES = [(6, 5), (5,)]
Z, N, DELTA = 1.0, 4, 1e-3
ADAPTIVE = AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.2, count_noise_std=1.0, initial_clip=2.0)


def family_strategy(family: str, adaptive: bool, secure: bool = False):
    kwargs: dict[str, Any] = dict(
        initial_weights=[np.zeros(s, dtype=np.float32) for s in SHAPES], num_rounds=5, seed=0,
        clients_per_round=N, clip=ADAPTIVE.initial_clip, sampling="fixed", secure_aggregation=secure,
        mechanism_factory=lambda n: ClientLevelDP(Z, ADAPTIVE.initial_clip, N, n, 5, DELTA,
                                                  secure_aggregation=secure, adversary="server"))
    if adaptive:
        kwargs["adaptive_clip_factory"] = lambda dp: ADAPTIVE
    if family == "fed-smp":
        return FedSMPStrategy(sparsifier="randk", compression_ratio=0.2, name="fed-smp-randk", **kwargs)
    return DP2FedSAMStrategy(name="dp2-fedsam", **kwargs)


def plain_round(s, rnd: int, shares: list[float]):
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(N))
    clip = ins[0][1].config.get(CFG_CLIP, 0.0)
    k = s.payload_dim()
    results = []
    for i, (p, _) in enumerate(ins):
        values = np.full(k, 0.01, dtype=np.float64)
        arrays = encode_sparse(values) if isinstance(s, FedSMPStrategy) else unflatten(values, SHAPES)
        metrics = {"client_id": i, "status": "ok", "noise_multiplier": Z, "clip_norm": clip,
                   METRIC_UNCLIPPED_SHARE: shares[i]}
        results.append((p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics)))
    _, out = s.aggregate_fit(rnd, results, [])
    return clip, out


@pytest.mark.parametrize("family", ["fed-smp", "dp2-fedsam"])
def test_an_adaptive_round_moves_the_clip_and_costs_the_fixed_clip_rounds_epsilon(family):
    adaptive, fixed = family_strategy(family, True), family_strategy(family, False)
    shares = [0.5, 0.5, -0.5, 0.7]
    sent, m_adaptive = plain_round(adaptive, 1, shares)
    _, m_fixed = plain_round(fixed, 1, [0.0] * N)
    assert sent == ADAPTIVE.initial_clip and m_adaptive["clients_ok"] == N and m_fixed["clients_ok"] == N
    fraction = sum(shares) / N + 0.5
    assert m_adaptive["unclipped_fraction"] == pytest.approx(fraction)
    assert adaptive.clip_t == pytest.approx(ADAPTIVE.initial_clip * math.exp(-0.2 * (fraction - 0.5)))
    assert m_adaptive["clip_norm"] == ADAPTIVE.initial_clip  # the round's C_t, not the next one
    assert m_adaptive["epsilon"] == m_fixed["epsilon"] > 0
    assert m_adaptive["update_noise_multiplier"] == pytest.approx(update_noise_multiplier(Z, 1.0))


@pytest.mark.parametrize("family", ["fed-smp", "dp2-fedsam"])
def test_under_secagg_the_payload_has_one_count_coordinate_and_the_sum_moves_the_clip(family):
    s = family_strategy(family, True, secure=True)
    fixed = family_strategy(family, False, secure=True)
    dim = s.payload_dim()
    assert dim == fixed.payload_dim() + 1 and s.count_in_secure_sum
    if family == "fed-smp":
        assert dim == s.k + 1
    ins = s.configure_fit(1, ndarrays_to_parameters(s.current_weights), client_manager(N))
    clip = ins[0][1].config[CFG_CLIP]
    scale = s.count_share_scale()
    bits = [0.5, 0.5, 0.5, -0.5]  # noised centred bits
    update = s.payload_arrays(np.full(dim - 1, 0.01))
    mean = [*update, np.array([scale * sum(bits) / N])]
    payload = ndarrays_to_parameters(mean)
    results = [(p, FitRes(Status(Code.OK, ""), payload, 1,
                          {"client_id": i, "status": "ok", "noise_multiplier": Z, "clip_norm": clip}))
               for i, (p, _) in enumerate(ins)]
    _, out = s.aggregate_fit(1, results, [])
    assert out["clients_ok"] == N and out["count_sum_clients"] == N
    assert out["unclipped_fraction"] == pytest.approx(sum(bits) / N + 0.5, rel=1e-5)
    assert out["next_clip_norm"] < clip
