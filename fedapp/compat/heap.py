"""Give freed heap memory back to the OS after each message a ClientApp handles.

A client's fit allocates and frees tens of MB (its data copy, batches, activations, Opacus' per-sample
gradients). glibc keeps freed chunks in the process's heap for reuse, and a long-lived Ray actor that has
trained many clients keeps the high-water mark of all of them resident. ``malloc_trim(0)`` returns every free
page of the heap to the kernel (``madvise``), which is what a process that exits would have done; the next fit
faults in what it needs again. On other C libraries (macOS, musl) it is a no-op, and ``DPFL_HEAP_TRIM=off`` turns
it off (to measure what it costs: docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if os.environ.get("DPFL_HEAP_TRIM", "").lower() == "off":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
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
