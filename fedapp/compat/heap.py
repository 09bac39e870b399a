"""Give freed heap memory back to the OS after each message a ClientApp handles.

A client's fit allocates and frees tens of MB (its data copy, batches, activations, Opacus' per-sample
gradients). glibc keeps freed chunks in the process's heap for reuse, and a long-lived Ray actor that has
trained many clients keeps the high-water mark of all of them resident. ``malloc_trim(0)`` returns every free
page of the heap to the kernel (``madvise``), which is what a process that exits would have done; the next fit
faults in what it needs again. On other C libraries (macOS, musl) it is a no-op, and ``DPFL_HEAP_TRIM=off`` turns
it off (to measure what it costs: docs/benchmarks.md).

Within a training the opposite holds: a DP-SGD step allocates and frees the same few MB-sized tensors (im2col
windows, per-sample gradients, activations) every step. glibc hands such a block back to the kernel when it is freed
(an ``mmap`` above its threshold, or a heap top beyond its trim threshold), so the next step faults the same pages in
again (a ``bk`` step of the Table-5 CNN at batch 64: 16.3 ms, 11.5 ms without the faults).
:func:`reuse_freed_memory` raises both thresholds (``mallopt``), once per process, so freed blocks of up to 32 MiB stay
in the heap for the next step; the trim after each message still returns them between messages.
``DPFL_HEAP_REUSE=off`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Any

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
REUSE_BLOCK_BYTES = 32 << 20  # the largest mmap threshold glibc accepts on a 64-bit machine
REUSE_TRIM_BYTES = 256 << 20  # free memory a heap keeps at its top before giving it back on its own


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep freed blocks of up to 32 MiB in glibc's heap for reuse instead of returning each to the kernel on free
    (``mallopt``: mmap threshold 32 MiB, trim threshold 256 MiB), once per process; whether it took effect. A no-op
    on other C libraries and with ``DPFL_HEAP_REUSE=off``."""
    if os.environ.get("DPFL_HEAP_REUSE", "").lower() == "off":
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, REUSE_BLOCK_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, REUSE_TRIM_BYTES))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if os.environ.get("DPFL_HEAP_TRIM", "").lower() == "off":
        return None
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """``malloc_trim(0)`` where glibc has it; whether it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def trim_heap_mod(msg: Any, ctx: Any, call_next: Callable[[Any, Any], Any]) -> Any:
    """Flower ClientApp mod: handle the message, then return the heap's free pages to the OS."""
    reply = call_next(msg, ctx)
    return_freed_memory()
    return reply
