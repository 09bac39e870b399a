"""Every registered model trains with DP-SGD in every grad-sample mode, through the one training loop.

One real private step per (model x mode) through ``fedapp.clients.training.local_train`` with ``PerSampleDP``, on the
device of ``--device`` / ``DPFL_TEST_DEVICE``. With two different samples in a batch of 2 (Poisson rate 1:
both are always drawn) and noise multiplier 0, the step must equal -lr/2 (clip(g_1) + clip(g_2)) with g_i the
per-sample gradients computed one sample at a time: a batch-level clip or a missing clip gives another update.
The same step with noise multiplier z adds N(0, (lr z C / 2)^2) per coordinate: its spread is checked too.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn

from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import (
    GRAD_SAMPLE_MODES,
    MODELS,
    UNSUPPORTED_GRAD_SAMPLE_MODES,
    build_model,
    check_grad_sample_mode,
)

#: input shape (without batch) and classes of a tiny batch per registered model
SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "cnn-mnist": ((1, 28, 28), 10),
    "cnn-fmnist": ((1, 28, 28), 10),
    "cnn-cifar": ((3, 32, 32), 10),
    "mlp-sigmoid": ((1, 28, 28), 10),
    "logreg": ((123,), 2),
    "resnet18-gn": ((3, 32, 32), 10),
    "cnn-digits": ((1, 8, 8), 10),
    "mlp-digits": ((1, 8, 8), 10),
}
CLIP, LR = 1e-3, 0.5  # C far below every model's per-sample gradient norm at init: clipping is active
TOL = 2e-2  # relative; float32 per-sample conv gradients of ResNet-18 differ from one-sample autograd by ~0.6 %


def test_every_registered_model_is_covered():
    assert set(SHAPES) == set(MODELS)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _tiny_batch(name: str) -> ArrayDataset:
    shape, classes = SHAPES[name]
    x = np.random.default_rng(7).normal(size=(2, *shape)).astype(np.float32)
    return ArrayDataset(x, np.array([0, 1], dtype=np.int64), classes)


def _per_sample_grads(model: nn.Module, data: ArrayDataset, device: torch.device) -> list[torch.Tensor]:
    """Gradient of the cross-entropy of each sample alone (plain autograd, no Opacus)."""
    model = copy.deepcopy(model).to(device).train()
    grads = []
    for i in range(len(data)):
        model.zero_grad(set_to_none=True)
        x = torch.from_numpy(data.x[i:i + 1]).to(device)
        y = torch.from_numpy(data.y[i:i + 1]).to(device)
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return grads


def _private_step(model: nn.Module, data: ArrayDataset, mode: str, z: float, device: torch.device) -> torch.Tensor:
    """θ after one real DP-SGD step minus θ before, on a copy of ``model``."""
    model = copy.deepcopy(model)
    before = _flat(model).to(device)
    spec = LocalTraining(batch_size=2, steps=1, lr=LR, seed=3, dp=PerSampleDP(z, CLIP, mode))
    result = local_train(model, data, spec, device)
    assert result.steps == 1 and result.extra["sample_rate"] == 1.0
    assert all(p.device.type == device.type for p in model.parameters())
    return _flat(model) - before


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_one_private_step_clips_per_sample_and_adds_noise(name: str, mode: str, device: torch.device):
    torch.manual_seed(0)
    shape, classes = SHAPES[name]
    model = build_model(name, shape, classes)
    assert ModuleValidator.validate(model, strict=False) == []
    data = _tiny_batch(name)
    if (name, mode) in UNSUPPORTED_GRAD_SAMPLE_MODES:  # rejected at config time; and it really fails
        with pytest.raises(ValueError, match=mode):
            check_grad_sample_mode(name, mode)
        with pytest.raises(Exception):  # noqa: B017 - whatever Opacus raises
            _private_step(model, data, mode, 0.0, device)
        return
    check_grad_sample_mode(name, mode)
    grads = _per_sample_grads(model, data, device)
    norms = [float(g.norm()) for g in grads]
    assert min(norms) > 10 * CLIP, f"clipping must be active, per-sample norms {norms}"
    expected = -LR * sum(g * min(1.0, CLIP / (n + 1e-6)) for g, n in zip(grads, norms)) / 2

    delta = _private_step(model, data, mode, 0.0, device)  # noise multiplier 0: the clipped step alone
    assert torch.isfinite(delta).all()
    assert float(delta.norm()) > 0.0
    assert float(delta.norm()) <= LR * CLIP * (1 + 1e-4)  # mean of two vectors of norm <= C, times lr
    batch_clipped = -LR * CLIP * (grads[0] + grads[1]) / (grads[0] + grads[1]).norm()  # what clipping the mean gives
    assert float((batch_clipped - expected).norm()) > 10 * TOL * float(expected.norm())  # the check can tell them apart
    assert float((delta - expected).norm()) <= TOL * float(expected.norm()), "not the per-sample clipped step"

    z = 2.0
    noise = _private_step(model, data, mode, z, device) - delta  # same Poisson draw (rate 1), noise added
    assert torch.isfinite(noise).all()
    d, sd = noise.numel(), LR * z * CLIP / 2  # N(0, (zC)^2) on the sum, / expected batch size 2, times lr
    assert abs(float(noise.std()) / sd - 1) < 6 / math.sqrt(2 * d), (float(noise.std()), sd)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("name", ["cnn-digits", "mlp-digits"])
def test_empty_poisson_batches_are_noise_only_steps(name: str, mode: str, device: torch.device):
    """q = 1/16 over 16 steps: some Poisson batches are empty (ew and functorch cannot run a batch of 0)."""
    shape, classes = SHAPES[name]
    torch.manual_seed(0)
    model = build_model(name, shape, classes)
    x = np.random.default_rng(1).normal(size=(16, *shape)).astype(np.float32)
    data = ArrayDataset(x, (np.arange(16) % classes).astype(np.int64), classes)
    before = _flat(model)
    result = local_train(model, data, LocalTraining(batch_size=1, steps=16, lr=0.1, seed=5,
                                                    dp=PerSampleDP(1.0, 1.0, mode)), device)
    assert result.steps == 16 and math.isfinite(result.loss)
    after = _flat(model).cpu()
    assert torch.isfinite(after).all() and not torch.equal(after, before)


def test_check_grad_sample_mode_names_model_and_mode():
    for name in MODELS:
        for mode in GRAD_SAMPLE_MODES:
            if (name, mode) not in UNSUPPORTED_GRAD_SAMPLE_MODES:
                check_grad_sample_mode(name, mode)
    with pytest.raises(ValueError, match="'ghost'.*'resnet18-gn'"):
        check_grad_sample_mode("resnet18-gn", "ghost")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        check_grad_sample_mode("nope", "hooks")
