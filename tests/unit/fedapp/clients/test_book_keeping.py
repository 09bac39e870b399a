"""grad-sample-mode = bk: book-keeping DP-SGD takes Opacus' ``hooks`` step, noise draws and Poisson batches included.

Every catalog model is checked against one-sample autograd in tests/unit/fedapp/models/test_dp_models.py; here the
layer rules the catalog does not reach (strided/dilated convolutions, a Linear over a sequence in both its ghost and
per-sample branches, Opacus' rules for GroupNorm, Conv1d and Embedding, a frozen bias), whole training runs with
noise, empty batches, non-finite records, and the models the mode refuses (among them those whose gradient its layer
rules would not reproduce, caught on the first batch against autograd).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedapp.clients import book_keeping as bk
from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
from fedapp.data.datasets import ArrayDataset


class Mixed(nn.Module):
    """Layers whose per-sample rules differ: a 3-channel first conv (slice-copy im2col), a strided, dilated, padded
    conv over 16 positions (per-sample gradients: 16·(72 + 8) > 72·8), GroupNorm (Opacus' rule), a conv over 4
    positions (ghost norm: 4·(72 + 16) < 72·16), Conv1d (Opacus' rule) and Linear layers over a sequence of 4
    positions: 3 → 40 (per-sample gradient: 4·(3 + 40) > 3·40), then 40 → 40 (ghost norm). Channels-last on a CPU."""

    CPU_MEMORY_FORMAT = torch.channels_last

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_b = nn.Conv2d(8, 8, 3, stride=2, dilation=2, padding=2)
        self.norm = nn.GroupNorm(2, 8)
        self.conv_c = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.conv1d = nn.Conv1d(16, 6, 2)
        self.seq_narrow = nn.Linear(3, 40)
        self.seq_wide = nn.Linear(40, 40, bias=False)
        self.head = nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv_b(torch.relu(self.conv_a(x)))))  # [B, 8, 4, 4]
        h = torch.relu(self.conv_c(h))  # [B, 16, 2, 2]
        h = torch.relu(self.conv1d(h.flatten(2)))  # [B, 6, 3]
        s = torch.tanh(self.seq_narrow(h[:, :4, :3]))  # [B, 4, 40]
        s = torch.tanh(self.seq_wide(s)).mean(1)
        return self.head(s)


def _data(n: int = 24, shape: tuple[int, ...] = (3, 8, 8), classes: int = 5, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, classes, n), classes)


def _trained(model: nn.Module, data: ArrayDataset, mode: str, z: float, *, clip: float = 0.5, steps: int = 8,
             noise_only: bool = False, trainable: tuple[str, ...] | None = None) -> torch.Tensor:
    model = copy.deepcopy(model)
    torch.manual_seed(11)  # the Poisson draws and the noise: the same stream for every mode
    spec = LocalTraining(batch_size=6, steps=steps, lr=0.3, momentum=0.5, seed=5, trainable=trainable,
                         dp=PerSampleDP(z, clip, mode, noise_only=noise_only))
    result = local_train(model, data, spec, torch.device("cpu"))
    assert result.steps == steps
    assert all(p.is_contiguous() for p in model.parameters())  # the layout is the default again after the loop
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_layers_take_both_branches():
    assert not bk._ghost_cheaper(4, 3, 40) and bk._ghost_cheaper(4, 40, 40)  # the sequence Linear layers
    assert not bk._ghost_cheaper(16, 72, 8) and bk._ghost_cheaper(4, 72, 16)  # conv_b, conv_c


@pytest.mark.parametrize("z", [0.0, 1.3])
def test_training_equals_opacus_hooks_step_for_step_with_noise(z: float):
    torch.manual_seed(0)
    model, data = Mixed(), _data()
    hooks, book = _trained(model, data, "hooks", z), _trained(model, data, "bk", z)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert float((hooks - start).norm()) > 1e-2  # it trained
    assert torch.allclose(book, hooks, rtol=1e-4, atol=1e-5), float((book - hooks).abs().max())


def test_the_grouped_convolution_rule_equals_hooks_on_strided_and_dilated_layers(monkeypatch):
    """oneDNN's weight gradient with a group per sample, which the catalog's CNNs take from 16 channels and 144
    positions, here for ``conv_b`` (8 channels, stride 2, dilation 2, padding 2; ``conv_c`` keeps the ghost norm)."""
    calls = []
    grouped = bk._conv2d_per_sample_grouped
    monkeypatch.setattr(bk, "_GROUPED_CHANNELS", 8)
    monkeypatch.setattr(bk, "_GROUPED_POSITIONS", 4)
    monkeypatch.setattr(bk, "_conv2d_per_sample_grouped", lambda m, a, b: calls.append(m) or grouped(m, a, b))
    torch.manual_seed(0)
    model, data = Mixed(), _data()
    hooks, book = _trained(model, data, "hooks", 1.3), _trained(model, data, "bk", 1.3)
    assert {(m.stride, m.dilation) for m in calls} == {((2, 2), (2, 2))}
    torch.testing.assert_close(book, hooks, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frozen", ["head.bias", "head.weight"])
def test_a_frozen_parameter_gets_no_gradient_and_does_not_count_in_the_norm(frozen: str):
    torch.manual_seed(0)
    model, data = Mixed(), _data()
    trainable = tuple(n for n, _ in model.named_parameters() if n != frozen)
    hooks = _trained(model, data, "hooks", 0.0, trainable=trainable)
    book = _trained(model, data, "bk", 0.0, trainable=trainable)
    assert torch.allclose(book, hooks, rtol=1e-4, atol=1e-6)
    start = 0
    for name, p in model.named_parameters():
        if name == frozen:
            assert torch.equal(book[start:start + p.numel()], p.detach().reshape(-1))
        start += p.numel()


def test_an_embedding_model_uses_opacus_rule():
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(20, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(x).mean(1))

    rng = np.random.default_rng(1)
    data = ArrayDataset(rng.integers(0, 20, (18, 5)).astype(np.int64), rng.integers(0, 3, 18), 3)
    torch.manual_seed(0)
    model = Bag()
    book, hooks = _trained(model, data, "bk", 0.7, steps=9), _trained(model, data, "hooks", 0.7, steps=9)
    assert torch.allclose(book, hooks, rtol=1e-4, atol=1e-6)


def test_empty_batches_are_the_noise_alone_as_in_hooks():
    torch.manual_seed(0)
    model, data = Mixed(), _data()
    hooks = _trained(model, data, "hooks", 1.0, noise_only=True)
    book = _trained(model, data, "bk", 1.0, noise_only=True)
    assert torch.allclose(book, hooks, rtol=1e-5, atol=1e-6)


def test_a_record_with_a_non_finite_gradient_counts_as_zero_as_in_hooks():
    class Scale(nn.Module):  # a record with an infinite feature: its output and gradient are NaN
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    x = np.ones((6, 4), np.float32)
    x[2, 1] = np.inf
    data = ArrayDataset(x, np.array([0, 1, 2, 0, 1, 2]), 3)
    torch.manual_seed(0)
    model = Scale()
    hooks = _trained(model, data, "hooks", 0.0, steps=1)
    book = _trained(model, data, "bk", 0.0, steps=1)
    assert torch.isfinite(book).all()
    assert torch.allclose(book, hooks, rtol=1e-5, atol=1e-6)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.relu(self.fc(x), inplace=True))


class NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act, self.fc = nn.PReLU(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(x))


class Tied(nn.Module):
    """``fc.weight`` also used outside ``fc``'s forward: the hooks see only part of its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x) + nn.functional.linear(x, self.fc.weight)))


class Doubled(nn.Linear):
    """A Linear subclass with its own forward: the Linear rule does not describe it (no rule is assumed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, 2 * self.weight, self.bias)


class WithDoubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = Doubled(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize(("model", "reason"), [(Twice, "'fc' ran twice"), (InPlace, "'fc' was changed in place"),
                                               (NoRule, "no per-sample rule for layer 'act'"),
                                               (Tied, r"model's gradient for \['fc.weight'\]"),
                                               (WithDoubled, "no per-sample rule for layer 'fc' \\(Doubled\\)")])
def test_models_it_cannot_run_are_refused_naming_the_layer(model: type[nn.Module], reason: str):
    data = ArrayDataset(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), np.zeros(8, np.int64), 2)
    with pytest.raises(ValueError, match=reason):
        _trained(model(), data, "bk", 1.0, steps=1)


def test_auto_leaves_out_bk_where_it_refuses_the_model():
    from fedapp.clients.grad_sample_mode import time_modes_that_run

    times = time_modes_that_run(InPlace, (4,), 2, 4, torch.device("cpu"), ("hooks", "bk"))
    assert set(times) == {"hooks"}
