"""Padded DP-SGD steps (``cuda-graphs = true``, ``fedapp.clients.graphed_dpsgd``) against the unpadded loop.

Padding a Poisson batch with rows of weight 0 must leave the step unchanged: same records, same clipped sum,
same noise law and division by the expected batch size. On the test device the padded steps run as CUDA
graphs (a GPU) or eagerly (a CPU); without noise they must reproduce the unpadded loop's weights.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedapp.clients.graphed_dpsgd import PAD_MULTIPLE, padded_poisson_epochs
from fedapp.clients.training import LocalTraining, PerSampleDP, _poisson_batches, get_weights, local_train
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model


def _data(n: int, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.standard_normal((n, 1, 28, 28)).astype(np.float32),
                        rng.integers(0, 10, n).astype(np.int64), 10)


def test_padded_batches_are_the_poisson_batches_with_zero_weight_padding():
    x = torch.arange(20, dtype=torch.float32).reshape(20, 1)
    y = torch.arange(20)
    torch.manual_seed(5)
    expected = [(xb.clone(), yb.clone()) for xb, yb in _poisson_batches(x, y, 0.05, 10, 2)]
    after_expected = torch.rand(3)
    torch.manual_seed(5)
    xs, ys, ms, counts = padded_poisson_epochs(x, y, 0.05, 10, 2)
    assert torch.equal(torch.rand(3), after_expected)  # the generator is left where the unpadded draws leave it
    assert len(ys) == 20 and xs.shape[1] % PAD_MULTIPLE == 0 and xs.shape[1] >= int(counts.max())
    for (xb, yb), xp, yp, mp, k in zip(expected, xs, ys, ms, counts.tolist()):
        assert k == len(yb)
        assert torch.equal(xp[:k], xb) and torch.equal(yp[:k], yb)
        assert mp[:k].eq(1).all() and mp[k:].eq(0).all()
    assert (counts == 0).any()  # an empty batch is kept as a step (noise only)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_padded_steps_without_noise_reproduce_the_unpadded_loop(device, momentum, monkeypatch):
    """On a GPU in float32 (cuDNN without TF32; matmuls are float32 by default): padding changes the convolutions' shapes and so their summation order,
    which momentum carries from step to step (seen: 7.7e-6 apart after 24 steps on an H100)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    atol = 1e-6 if device.type == "cpu" else 5e-5
    data, model = _data(96), build_model("cnn-mnist", (1, 28, 28), 10)
    spec = LocalTraining(batch_size=8, steps=24, lr=0.05, momentum=momentum, seed=7, dp=PerSampleDP(0.0, 0.5))
    plain, padded = copy.deepcopy(model), copy.deepcopy(model)
    r1 = local_train(plain, data, spec, device)
    r2 = local_train(padded, data, LocalTraining(**{**spec.__dict__, "dp": PerSampleDP(0.0, 0.5, "hooks", True)}),
                     device)
    assert r1.steps == r2.steps == 24 and r1.extra == r2.extra
    assert r2.loss == pytest.approx(r1.loss, rel=1e-4)
    for a, b in zip(get_weights(plain), get_weights(padded)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=atol)
    assert not any(np.array_equal(a, b) for a, b in zip(get_weights(model), get_weights(padded)))  # it trained


def test_padded_steps_add_the_noise_of_the_unpadded_loop(device):
    """With lr·σ·c/b large against the data's gradients, an update is the noise: its spread must be σ·c·η/b a
    coordinate per step (η = 1, one step, c = 1, b = E|B|)."""
    data = _data(64)
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    spec = LocalTraining(batch_size=8, steps=8, lr=1.0, seed=3, dp=PerSampleDP(1e4, 1.0, "hooks", True))
    before = np.concatenate([w.ravel() for w in get_weights(model)])
    local_train(model, data, spec, device)
    delta = np.concatenate([w.ravel() for w in get_weights(model)]) - before
    expected = 1e4 * 1.0 / 8 * np.sqrt(8)  # 8 steps of N(0, (σc/b)²) each
    assert np.std(delta) == pytest.approx(expected, rel=0.02)
    assert abs(np.mean(delta)) < 0.02 * expected


def test_graphed_training_refuses_sam_and_other_modes():
    from fedapp.clients.training import SAM

    data = _data(16)
    for dp, sam in ((PerSampleDP(1.0, 1.0, "functorch", True), None), (PerSampleDP(1.0, 1.0, "hooks", True), SAM(0.1))):
        with pytest.raises(ValueError, match="CUDA-graphed DP-SGD"):
            local_train(build_model("cnn-mnist", (1, 28, 28), 10), data, LocalTraining(batch_size=4, steps=2, lr=0.1, dp=dp, sam=sam))
