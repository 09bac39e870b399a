"""The plain CNNs train and evaluate channels-last on a CPU: the same numbers as the default layout, weights handed
back contiguous, and never under per-sample gradients (Opacus' conv grad-samplers assume the default layout)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedapp.clients.training import (
    LocalTraining,
    PerSampleDP,
    default_strides,
    evaluate_model,
    get_weights,
    local_train,
)
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import CifarCNN, DigitsCNN, FmnistCNN, MnistCNN, ResNet18GN


class DefaultLayoutCNN(MnistCNN):
    CPU_MEMORY_FORMAT = None


def _data(n: int = 96, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.standard_normal((n, 1, 28, 28)).astype(np.float32),
                        rng.integers(0, 10, n).astype(np.int64), 10)


def _channels_last_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` has exactly the strides of channels-last (``is_contiguous(memory_format=channels_last)`` is also
    true of the default strides when a dimension has size 1, as the first conv's one input channel does, and oneDNN
    then runs that conv in the default layout)."""
    return t.stride() == torch.empty_like(t, memory_format=torch.channels_last).stride()


def _record_weight_layouts(model: torch.nn.Module) -> list[bool]:
    """Per forward call: whether both convs' weights had channels-last strides and the first conv's output was
    channels-last, i.e. the whole network ran in that layout."""
    seen: list[bool] = []
    first, second = model.features[0], model.features[3]
    outputs: list[torch.Tensor] = []
    first.register_forward_hook(lambda m, _, out: outputs.append(out))
    second.register_forward_pre_hook(lambda m, _: seen.append(
        _channels_last_strides(first.weight) and _channels_last_strides(m.weight)
        and _channels_last_strides(outputs.pop())))
    return seen


def test_the_plain_cnns_declare_channels_last_and_the_others_do_not() -> None:
    assert all(cls.CPU_MEMORY_FORMAT is torch.channels_last for cls in (MnistCNN, FmnistCNN, CifarCNN, DigitsCNN))
    assert getattr(ResNet18GN, "CPU_MEMORY_FORMAT", None) is None  # slower so (1.16x CPU time, module docstring)


def test_plain_training_runs_channels_last_and_matches_the_default_layout() -> None:
    torch.manual_seed(0)
    fast = MnistCNN()
    slow = DefaultLayoutCNN()
    slow.load_state_dict(fast.state_dict())
    seen_fast, seen_slow = _record_weight_layouts(fast), _record_weight_layouts(slow)
    spec = LocalTraining(batch_size=16, steps=6, lr=0.1, momentum=0.5, seed=3)
    a, b = local_train(fast, _data(), spec), local_train(slow, _data(), spec)
    assert seen_fast == [True] * 6 and seen_slow == [False] * 6
    assert a.steps == b.steps == 6 and a.loss == pytest.approx(b.loss, rel=1e-5)
    for wa, wb in zip(get_weights(fast), get_weights(slow)):
        np.testing.assert_allclose(wa, wb, rtol=1e-4, atol=1e-6)
    assert all(p.is_contiguous() for p in fast.parameters())  # handed back in the default layout
    assert all(w.flags["C_CONTIGUOUS"] for w in get_weights(fast))


def test_evaluation_runs_channels_last_and_matches_the_default_layout() -> None:
    torch.manual_seed(1)
    fast = MnistCNN()
    slow = DefaultLayoutCNN()
    slow.load_state_dict(fast.state_dict())
    seen = _record_weight_layouts(fast)
    loss_a, acc_a = evaluate_model(fast, _data(200, seed=2), batch_size=64)
    loss_b, acc_b = evaluate_model(slow, _data(200, seed=2), batch_size=64)
    assert seen == [True] * 4
    assert loss_a == pytest.approx(loss_b, rel=1e-5) and acc_a == acc_b
    assert all(p.is_contiguous() for p in fast.parameters())


def test_per_sample_gradients_keep_the_default_layout() -> None:
    torch.manual_seed(2)
    model = MnistCNN()
    before = copy.deepcopy(model)
    seen = _record_weight_layouts(model)
    spec = LocalTraining(batch_size=16, steps=6, lr=0.1, seed=3, dp=PerSampleDP(1.0, 1.0, "hooks"))
    local_train(model, _data(), spec)
    assert seen and not any(seen)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


def test_opacus_per_sample_gradients_are_wrong_with_channels_last_weights_so_dp_sgd_refuses_them() -> None:
    """Why the layout stays default under DP-SGD: Opacus' hooks give per-sample gradients that differ from each
    sample's own gradient when the conv weights are channels-last; the private loop refuses such weights."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = MnistCNN()
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    reference = []
    for i in range(4):
        single = copy.deepcopy(model)
        torch.nn.CrossEntropyLoss()(single(x[i:i + 1]), y[i:i + 1]).backward()
        reference.append([p.grad for p in single.parameters()])
    first_only = copy.deepcopy(model)  # only the one-input-channel conv: its weight still passes is_contiguous()
    weight = first_only.features[0].weight
    weight.data = torch.empty_like(weight.data, memory_format=torch.channels_last).copy_(weight.data)
    assert weight.is_contiguous()
    layouts = {"default": copy.deepcopy(model), "channels-last": copy.deepcopy(model).to(memory_format=torch.channels_last),
               "first conv channels-last": first_only}
    errors = {}
    for name, variant in layouts.items():
        gsm = GradSampleModule(copy.deepcopy(variant))
        torch.nn.CrossEntropyLoss()(gsm(x), y).backward()
        errors[name] = max(float((p.grad_sample[i] - reference[i][k]).abs().max())
                           for k, p in enumerate(gsm.parameters()) for i in range(4))
    assert errors["default"] < 1e-5
    assert errors["channels-last"] > 1e-2 and errors["first conv channels-last"] > 1e-2
    spec = LocalTraining(batch_size=16, steps=2, lr=0.1, seed=3, dp=PerSampleDP(1.0, 1.0, "hooks"))
    with pytest.raises(ValueError, match="features.3.weight"):
        local_train(layouts["channels-last"], _data(), spec)
    with pytest.raises(ValueError, match="features.0.weight"):
        local_train(first_only, _data(), spec)


@pytest.mark.parametrize("shape", [(32, 1, 5, 5), (64, 32, 5, 5), (10, 1024), (7,), (), (3, 0, 4), (0, 2)])
def test_default_strides_are_the_strides_torch_gives_a_contiguous_tensor(shape):
    """The DP-SGD guard compares each weight's strides with these; torch's own, from an allocated tensor, agree."""
    assert default_strides(shape) == torch.empty(shape).stride()
