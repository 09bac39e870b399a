"""``benchmarks.noise_ab``: both arms run ``bk`` and the parallel arm takes the parallel draw."""

from __future__ import annotations

import torch

from benchmarks import noise_ab
from fedapp.clients import noise


def test_both_arms_step_and_the_threshold_is_restored(monkeypatch) -> None:
    calls: list[int] = []
    fill = noise._fill
    monkeypatch.setattr(noise, "_fill", lambda chunk, std, seed: calls.append(chunk.numel()) or fill(chunk, std, seed))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = noise_ab.ab("mlp-digits", rounds=1, steps=1, batch=8, threshold=1000)
    finally:
        torch.set_num_threads(before)
    assert len(rows) == 3 and "per round (2 threads)" in rows[2]
    assert calls and noise.PARALLEL_NOISE_ELEMENTS == 1 << 22
