"""Non-finite gradients and models cannot bypass clipping, and no reply tells whether a record made training fail.

The crafted model is a server's attack: a finite logistic regression whose weights on one feature are ±3·10^38, so a
record with a large value in that feature overflows its own per-sample gradient (NaN) while every other record's
gradient stays finite. Unclipped, that NaN reached the update only when the record was sampled."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from conftest import client_context
from flwr.common import Context, RecordDict

from fedapp.clients.batched_dpsgd import clipped_sums
from fedapp.clients.common import noise_seed, setup_client
from fedapp.clients.training import LocalTraining, PerSampleDP, get_weights, local_train, set_weights
from fedapp.config import resolve_config
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model
from strategies.soteriafl import ClientState, GradientOracle, client_step, fit_seed, get_method

RECORD = 7  # the crafted record's row
MODES = [("hooks", False), ("ew", False), ("functorch", False), ("bk", False), ("hooks", True)]  # (mode, padded/graphed steps)


def crafted_data(with_record: bool, n: int = 40) -> ArrayDataset:
    """``n`` records of 8 features, feature 0 zero everywhere except (with the record) row 7's 10^3."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    x[:, 0] = 0.0
    if with_record:
        x[RECORD, 0] = 1e3
    return ArrayDataset(x, rng.integers(0, 3, n).astype(np.int64), 3)


def crafted_weights(weights: list[np.ndarray]) -> list[np.ndarray]:
    """The server's model: finite, weights ±3·10^38 on feature 0."""
    out = [w.copy() for w in weights]
    out[0][:, 0] = [3e38, -3e38, 3e38]
    return out


def crafted_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("logreg", (8,), 3)
    set_weights(model, crafted_weights(get_weights(model)))
    return model


def finite(arrays: list[np.ndarray]) -> bool:
    return all(bool(np.all(np.isfinite(a))) for a in arrays)


# ---------------------------------------------------------------------------- DP-SGD's clip step
@pytest.mark.parametrize(("mode", "graphed"), MODES)
def test_dp_sgd_stays_finite_whether_or_not_the_overflowing_record_is_there(mode: str, graphed: bool):
    """z = 5, q = 0.2, 5 steps (the audit's measurement): every run finite, with the record and without it."""
    for with_record in (False, True):
        for seed in range(10):
            model = crafted_model()
            spec = LocalTraining(batch_size=8, steps=5, lr=0.1, seed=seed, dp=PerSampleDP(5.0, 1.0, mode, graphed))
            result = local_train(model, crafted_data(with_record), spec)
            assert result.steps == 5 and finite(get_weights(model)), (mode, graphed, with_record, seed)


@pytest.mark.cuda
@pytest.mark.parametrize(("mode", "graphed"), [("hooks", False), ("hooks", True)])
def test_on_a_gpu_dp_sgd_and_its_captured_steps_stay_finite_with_the_record(mode: str, graphed: bool):
    """On a GPU the clip step masks without a host sync, so the CUDA graph of a padded step captures it."""
    for seed in range(5):
        model = crafted_model()
        spec = LocalTraining(batch_size=8, steps=5, lr=0.1, seed=seed, dp=PerSampleDP(5.0, 1.0, mode, graphed))
        assert local_train(model, crafted_data(True), spec, torch.device("cuda")).steps == 5
        assert finite(get_weights(model)), (mode, graphed, seed)


@pytest.mark.parametrize(("mode", "graphed"), MODES)
def test_the_overflowing_record_counts_as_a_zero_gradient(mode: str, graphed: bool):
    """z = 0, q = 1, one step: Δ with the record (N = 40) is Δ without it (N = 39) times 39/40, the mean's divisor."""
    deltas = []
    for data in (crafted_data(True), ArrayDataset(*(np.delete(a, RECORD, 0) for a in
                                                   (crafted_data(True).x, crafted_data(True).y)), 3)):
        model = crafted_model()
        before = get_weights(model)
        spec = LocalTraining(batch_size=len(data), steps=1, lr=1.0, seed=0, dp=PerSampleDP(0.0, 1.0, mode, graphed))
        local_train(model, data, spec)
        deltas.append([a - b for a, b in zip(get_weights(model), before)])
    with_record, without = deltas
    assert finite(with_record) and np.abs(without[1]).max() > 1e-3
    for a, b in zip(with_record, without):
        np.testing.assert_allclose(a * 40, b * 39, rtol=1e-5, atol=1e-6)


def test_the_batched_path_zeroes_non_finite_per_sample_gradients_sampled_or_padding():
    g = torch.randn(2, 4, 3)
    g[0, 1, 0], g[0, 2, 2], g[1, 3, 1] = float("nan"), float("inf"), float("nan")  # row (1, 3) is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    clip = torch.tensor([0.5, 2.0])
    got = clipped_sums({"w": g}, mask, clip)["w"]
    for k in range(2):
        rows = [g[k, b] for b in range(4) if mask[k, b] and torch.isfinite(g[k, b]).all()]
        expected = sum(r * min(1.0, float(clip[k]) / (float(r.norm()) + 1e-6)) for r in rows)
        torch.testing.assert_close(got[k], expected)


# ---------------------------------------------------------------------------- the DP-SGD client's reply
_DPSGD = {"dataset": "digits", "model": "logreg", "privacy-dist": "fixed", "epsilon": 5.0, "batch-size": 40,
          "local-epochs": 5, "num-server-rounds": 1, "local-test-fraction": 0.0,
          "grad-sample-mode": "hooks"}  # q = 1: the record is in every step


def dpsgd_client(with_record: bool, **overrides: Any):
    from fedapp.clients.dpsgd import DPSGDClient

    ctx = client_context(run_config={})
    setup = setup_client(ctx, {**_DPSGD, **overrides})
    return DPSGDClient(dataclasses.replace(setup, train=crafted_data(with_record)), ctx)


def test_the_dp_sgd_reply_has_the_same_form_with_and_without_the_record():
    replies = []
    for with_record in (False, True):
        client = dpsgd_client(with_record)
        update, n, metrics = client.fit(crafted_weights(client.get_parameters({})), {"server-round": 1})
        assert metrics["status"] == "ok" and "reason" not in metrics and finite(update), with_record
        replies.append((sorted(metrics), n, [(a.shape, a.dtype) for a in update]))
    assert replies[0] == replies[1]


def test_a_dp_sgd_client_whose_training_diverges_sends_its_noise_only_steps(monkeypatch):
    """Training that still ends non-finite is replaced by the round's steps with every gradient clipped to 0 (noise
    alone, from the server's model): status ``ok`` and the fields of any reply, never ``failed``."""
    import fedapp.clients.dpsgd as dpsgd

    real = dpsgd.local_train

    def diverging(model, data, spec, device=None):
        result = real(model, data, spec, device)
        if not getattr(spec.dp, "noise_only", False):
            with torch.no_grad():
                next(model.parameters()).view(-1)[3] = float("nan")
        return result

    client = dpsgd_client(False, **{"seeded-noise": True})
    params = client.get_parameters({})
    _, _, normal = client.fit(params, {"server-round": 1})
    client = dpsgd_client(False, **{"seeded-noise": True})
    monkeypatch.setattr(dpsgd, "local_train", diverging)
    update, n, metrics = client.fit(params, {"server-round": 1})
    assert metrics["status"] == "ok" and sorted(metrics) == sorted(normal) and n == 40 and finite(update)
    # it is the noise-only run: the same q, steps, η and momentum, no record, the round's (seeded) noise seed
    model = client.s.new_model()
    z = metrics["noise_multiplier"]
    spec = LocalTraining(batch_size=40, steps=5, lr=metrics["lr"], momentum=client.s.training.momentum,
                         seed=noise_seed(client.s.general, client.s.profile.client_id, 1),
                         dp=PerSampleDP(z, client.s.training.clip_norm, "hooks", noise_only=True))
    real(model, client.s.train, spec)
    for got, new, old in zip(update, get_weights(model), params):
        np.testing.assert_allclose(got, new - old, rtol=1e-6, atol=1e-7)
    assert max(float(np.abs(u).max()) for u in update) > 0


# ---------------------------------------------------------------------------- SoteriaFL
_SOTERIA = {**_DPSGD, "clip-norm": 1.0, "delta": 1e-3, "batch-size": 8}


def test_soteriafl_clipping_counts_a_non_finite_per_sample_gradient_as_zero():
    oracle = GradientOracle(crafted_model(), crafted_data(True).x, crafted_data(True).y)
    x = np.concatenate([w.ravel() for w in get_weights(crafted_model())]).astype(np.float64)
    raw = oracle.per_sample(x, np.arange(40))
    assert not np.all(np.isfinite(raw[RECORD])) and np.all(np.isfinite(np.delete(raw, RECORD, 0)))
    clipped = oracle.clipped(x, np.arange(40), 0.5)
    assert np.all(np.isfinite(clipped)) and np.all(clipped[RECORD] == 0.0)
    assert np.linalg.norm(clipped, axis=1).max() <= 0.5 * (1 + 1e-9)
    np.testing.assert_allclose(oracle.clipped_sum(x, np.arange(40), 0.5), clipped.sum(0))


@pytest.mark.parametrize("strategy", ["soteriafl-gd", "soteriafl-sgd", "ldp-svrg"])
def test_the_soteriafl_reply_has_the_same_form_with_and_without_the_record(strategy: str):
    from fedapp.clients.soteriafl import SoteriaFLClient

    ov = {**_SOTERIA, "strategy": strategy, "soteriafl-batch-size": 40}  # q = 1 for the minibatch term too
    replies = []
    for with_record in (False, True):
        ctx = client_context(run_config={})
        setup = dataclasses.replace(setup_client(ctx, ov), train=crafted_data(with_record))
        client = SoteriaFLClient(setup, resolve_config(None, ov).soteriafl, ctx)
        values, n, metrics = client.fit(crafted_weights(client.get_parameters({})),
                                        {"server-round": 1, "round-seed": fit_seed(42, 1), "soteriafl-method": strategy})
        assert metrics["status"] == "ok" and finite(values), (strategy, with_record)
        replies.append((sorted(metrics), n, [(a.shape, a.dtype) for a in values]))
    assert replies[0] == replies[1]


def test_a_non_finite_soteriafl_estimator_sends_the_noise_alone():
    oracle = GradientOracle(crafted_model(), crafted_data(False).x, crafted_data(False).y)
    x = np.concatenate([w.ravel() for w in get_weights(crafted_model())]).astype(np.float64)
    state = ClientState(snapshot=x.copy(), snapshot_grad=np.full(oracle.dim, np.nan))  # a corrupted SVRG state
    res = client_step(get_method("ldp-svrg"), oracle, x, state, clip=1.0, batch_size=8, sigma_p=0.3, k=oracle.dim,
                      gamma=1.0, rng=np.random.default_rng(0), seed=1, refresh_snapshot=False)
    noise = np.random.default_rng(0)
    noise.random(40)  # the Poisson draw client_step takes first
    np.testing.assert_allclose(res.values, noise.normal(0.0, 0.3, size=oracle.dim).astype(np.float32))


# ---------------------------------------------------------------------------- a non-finite server model is refused
def _client(family: str, ctx: Context):
    from fedapp.clients.client_dp import ClientLevelDPClient, FTRLClient
    from fedapp.clients.dp2_fedsam import DP2FedSAMClient
    from fedapp.clients.dpsgd import DPSGDClient
    from fedapp.clients.soteriafl import SoteriaFLClient
    from strategies.dp2_fedsam import VARIANTS

    base = {"dataset": "digits", "privacy-dist": "fixed", "batch-size": 16, "num-server-rounds": 3,
            "max-samples": 400, "noise-multiplier": 1.0, "clip-norm": 0.5, "local-steps": 2}
    ov = {"dpsgd": {**base, "strategy": "dpsgd-fedavg", "epsilon": 5.0},
          "soteriafl": {**base, "strategy": "soteriafl-gd", "model": "mlp-digits", "epsilon": 5.0, "delta": 1e-4},
          "client-level": {**base, "strategy": "dp-fedavg", "secure-aggregation": False},
          "dp-ftrl": {**base, "strategy": "dp-ftrl", "secagg-mechanism": "gaussian"},
          "dp2-fedsam": {**base, "strategy": "dp2-fedsam", "secagg-mechanism": "gaussian", "clients-per-round": 2}}[family]
    setup, cfg = setup_client(ctx, ov), resolve_config(None, ov)
    if family == "dpsgd":
        return DPSGDClient(setup, ctx), ov
    if family == "soteriafl":
        return SoteriaFLClient(setup, cfg.soteriafl, ctx), ov
    if family == "client-level":
        return ClientLevelDPClient(setup, cfg.client_dp, ctx), ov
    if family == "dp-ftrl":
        return FTRLClient(setup, cfg.client_dp, ctx), ov
    return DP2FedSAMClient(setup, cfg.client_dp, cfg.dp2_fedsam, ctx, VARIANTS["dp2-fedsam"]), ov


@pytest.mark.parametrize("family", ["dpsgd", "soteriafl", "client-level", "dp-ftrl", "dp2-fedsam"])
@pytest.mark.parametrize("poison", ["nan", "inf", "float64-1e39"])
def test_every_client_refuses_a_non_finite_server_model_before_it_trains(family: str, poison: str):
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 1, "num-partitions": 4}, state=RecordDict(),
                  run_config={})
    client, ov = _client(family, ctx)
    params = [np.asarray(p).copy() for p in client.get_parameters({})]
    if poison == "float64-1e39":
        params[0] = params[0].astype(np.float64)
        params[0].flat[0] = 1e39
    else:
        params[0].flat[0] = float(poison)
    config = {"server-round": 1, "round-seed": fit_seed(42, 1), "soteriafl-method": ov["strategy"]}
    arrays, n, metrics = client.fit(params, config)
    assert metrics["status"] == "refused" and arrays == [] and n == 0, metrics
    assert "server's model is not finite" in metrics["reason"] and "array 0 of" in metrics["reason"]
    assert list(ctx.state.keys()) == []  # no accountant, stream, turn, release or state written
