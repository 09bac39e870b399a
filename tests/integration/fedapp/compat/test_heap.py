"""fedapp.compat.heap: freed heap memory goes back to the OS after each ClientApp message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fedapp.compat import heap

_PROBE = """
import numpy as np, psutil
from fedapp.compat.heap import return_freed_memory
blocks = [np.ones(10_000) for _ in range(3_000)]  # 240 MB in 80 kB blocks: glibc serves them from the heap
keep = blocks[::50]
del blocks  # freed, but kept by the allocator for reuse
before = psutil.Process().memory_info().rss
ran = return_freed_memory()
print(ran, before, psutil.Process().memory_info().rss)
"""


def _run(script: str, switch: str, value: str) -> list[str]:
    """``script``'s printed words, run in a fresh interpreter with the environment variable ``switch`` = ``value``."""
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, switch: value},
                          capture_output=True, text=True, check=True).stdout.split()


def _probe(env_value: str) -> tuple[bool, int, int]:
    out = _run(_PROBE, "DPFL_HEAP_TRIM", env_value)
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_freed_heap_pages_and_can_be_turned_off():
    ran, before, after = _probe("")
    assert ran and before - after > 150e6, (before, after)
    ran, before, after = _probe("off")
    assert not ran and before - after < 20e6, (before, after)


_REUSE_PROBE = """
import resource, numpy as np
from fedapp.compat.heap import reuse_freed_memory
took = reuse_freed_memory()
def step():
    blocks = [np.ones(1 << 19) for _ in range(10)]  # 10 x 4 MiB, touched, then all freed: one step's tensors
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_reuse_keeps_a_steps_freed_blocks_mapped_and_can_be_turned_off():
    """Three more steps of 40 MiB: with reuse no page is faulted in again; with glibc's defaults the freed heap top is
    trimmed after each step and faulted in again (120 MiB = 30,720 pages; at least a third of them)."""
    runs = {}
    for value in ("", "off"):
        out = _run(_REUSE_PROBE, "DPFL_HEAP_REUSE", value)
        runs[value] = (out[0] == "True", int(out[1]))
    assert runs[""][0] and runs[""][1] < 500, runs
    assert not runs["off"][0] and runs["off"][1] > 10_000, runs


def test_local_training_turns_reuse_on(monkeypatch):
    import numpy as np
    import torch

    from fedapp.clients.training import LocalTraining, local_train
    from fedapp.data.datasets import ArrayDataset

    calls = []
    monkeypatch.setattr(heap, "reuse_freed_memory", lambda: calls.append(1))
    data = ArrayDataset(np.zeros((4, 3), np.float32), np.zeros(4, np.int64), 2)
    local_train(torch.nn.Linear(3, 2), data, LocalTraining(batch_size=2, steps=1, lr=0.1))
    assert calls == [1]


def test_the_mod_passes_the_reply_through():
    assert heap.trim_heap_mod("msg", "ctx", lambda m, c: (m, c, "reply")) == ("msg", "ctx", "reply")


def test_the_client_app_trims_after_every_message():
    from fedapp.apps.client_app import build_client_app

    assert heap.trim_heap_mod in build_client_app()._mods
