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


def _probe(env_value: str) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, "DPFL_HEAP_TRIM": env_value},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_freed_heap_pages_and_can_be_turned_off():
    ran, before, after = _probe("")
    assert ran and before - after > 150e6, (before, after)
    ran, before, after = _probe("off")
    assert not ran and before - after < 20e6, (before, after)


def test_the_mod_passes_the_reply_through():
    assert heap.trim_heap_mod("msg", "ctx", lambda m, c: (m, c, "reply")) == ("msg", "ctx", "reply")


def test_the_client_app_trims_after_every_message():
    from fedapp.apps.client_app import build_client_app

    assert heap.trim_heap_mod in build_client_app()._mods
