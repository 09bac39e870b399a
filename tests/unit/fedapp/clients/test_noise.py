"""``bk``'s Gaussian noise: Opacus' draws value for value on one thread or a small model, parallel chunks otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from opacus.optimizers.optimizer import _generate_noise
from scipy import stats

from fedapp.clients import noise
from fedapp.clients.book_keeping import book_keeping_dp_optimizer


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sums() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(40, 30, generator=g), torch.randn(30, generator=g), torch.randn(8, 3, 5, 5, generator=g)]


@pytest.mark.parametrize("threads", [1, 2])
def test_below_the_threshold_the_draws_are_opacus_value_for_value(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sums = _sums()
        g = torch.Generator().manual_seed(9)
        opacus = [s + _generate_noise(std=1.7, reference=s, generator=g) for s in sums]
        ours = [s.clone() for s in sums]
        assert noise.add_noise_(ours, 1.7, torch.Generator().manual_seed(9)) is None
    finally:
        torch.set_num_threads(before)
    for a, b in zip(ours, opacus, strict=True):
        assert torch.equal(a, b)


def test_zero_noise_draws_nothing_and_leaves_the_sums_alone():
    sums, g = _sums(), torch.Generator().manual_seed(4)
    state, kept = g.get_state(), [s.clone() for s in sums]
    noise.add_noise_(sums, 0.0, g)
    assert torch.equal(g.get_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(kept, sums, strict=True))


def test_parallel_chunks_are_gaussian_independent_and_reproducible(monkeypatch, two_threads):
    monkeypatch.setattr(noise, "PARALLEL_NOISE_ELEMENTS", 1000)
    sums = [torch.full((300, 200), 5.0), torch.full((7,), -1.0)]

    def noised(seed: int, scratch: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        out = [s.clone() for s in sums]
        return out, noise.add_noise_(out, 2.0, torch.Generator().manual_seed(seed), scratch)

    out, scratch = noised(1)
    assert scratch is not None and scratch.numel() == 60_007
    again, reused = noised(1, scratch)
    assert reused is scratch  # the buffer is kept from step to step
    other, _ = noised(2)
    assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True))
    assert not torch.equal(out[0], other[0])
    drawn = torch.cat([(o - s).reshape(-1) for o, s in zip(out, sums, strict=True)]).double()
    assert stats.kstest((drawn / 2.0).numpy(), "norm").pvalue > 1e-3
    first, second = drawn.tensor_split(2)  # one chunk a thread
    assert abs(float(torch.corrcoef(torch.stack([first[:30_000], second[:30_000]]))[0, 1])) < 0.03
    g = torch.Generator().manual_seed(1)  # not Opacus' stream: the parallel path ran
    assert not torch.equal(out[0], sums[0] + _generate_noise(std=2.0, reference=sums[0], generator=g))


def test_the_optimizer_adds_the_parallel_noise_once_to_each_clipped_sum(monkeypatch, two_threads):
    monkeypatch.setattr(noise, "PARALLEL_NOISE_ELEMENTS", 1000)
    params = [torch.nn.Parameter(torch.zeros(120, 50)), torch.nn.Parameter(torch.zeros(50))]
    optimizer = book_keeping_dp_optimizer()(
        optimizer=torch.optim.SGD(params, lr=1.0), noise_multiplier=1.5, max_grad_norm=2.0, expected_batch_size=1,
        loss_reduction="sum", generator=torch.Generator().manual_seed(0), secure_mode=False)
    for p in params:
        p.summed_grad = torch.ones_like(p)
    optimizer.step()
    drawn = torch.cat([-p.detach().reshape(-1) - 1.0 for p in params])  # p = 0 - (1 + noise)
    assert abs(float(drawn.std()) - 3.0) < 0.1 and abs(float(drawn.mean())) < 0.1
    with pytest.raises(ValueError, match="zero_grad"):  # a clipped sum is noised once
        optimizer.step()
