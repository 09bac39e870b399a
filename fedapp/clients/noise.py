"""DP-SGD's Gaussian noise for ``grad-sample-mode = "bk"``: Opacus' draws, and on a multi-threaded CPU one draw per thread.

DP-SGD adds N(0, σ²C²) to every coordinate of the clipped sum (Abadi et al. 2016, Alg. 1). Opacus' ``DPOptimizer``
draws it parameter by parameter with ``torch.normal`` on one generator; torch's CPU Gaussian kernel runs on one thread
(3-4 ns a value here), so for ResNet-18's 11.2 M parameters the draw alone is 52 ms, 0.43× a plain 2-thread step
(docs/benchmarks/dp_step.md). :func:`add_noise_` keeps Opacus' draws value for value below
:data:`PARALLEL_NOISE_ELEMENTS` values a step or on one torch thread (a simulation's client), and otherwise fills a
flat buffer the optimizer keeps from step to step in ``torch.get_num_threads()`` contiguous chunks at once (the
calling thread chunk 0, a shared pool the others), chunk k from its own generator seeded each step by an int64 drawn
from the optimizer's generator. Every coordinate is still one N(0, σ²C²) draw, independent of the others to the
generators' quality (torch's Mersenne Twister, as Opacus' own non-secure noise); the stream differs from Opacus' and
depends on the thread count. Opacus' ``secure_mode`` noise is not replaced (the caller keeps it).
No library offers a multi-threaded Gaussian fill for torch tensors: numpy's generator is one thread as well and
slower here (docs/benchmarks/dp_step.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

#: values a step from which a multi-threaded CPU draws the noise in parallel chunks: ResNet-18's 11.2 M do (its `bk`
#: step 0.89× with them, median of 7 interleaved rounds, 2 threads); cnn-fmnist's 1.66 M showed no gain (1.00×), so it,
#: the Table-5 CNN and the MLPs keep Opacus' draws
PARALLEL_NOISE_ELEMENTS = 1 << 22

_SEED_HIGH = (1 << 63) - 1


_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One pool for the process (clients on threads share it; each call makes its own generators)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="dp-noise")
        return _EXECUTOR


def _fill(chunk: torch.Tensor, std: float, seed: int) -> None:
    chunk.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def add_noise_(sums: Sequence[torch.Tensor], std: float, generator: torch.Generator | None,
               scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """Add N(0, std²) to every clipped sum in ``sums`` in place; returns the flat noise buffer to pass back next time.

    ``std = 0`` draws nothing, as Opacus. Parallel chunks (module docstring) on a CPU with more than one torch thread
    and at least :data:`PARALLEL_NOISE_ELEMENTS` values of one dtype; otherwise, per tensor in order,
    ``torch.normal(0, std, s.shape, generator=generator)``: Opacus' ``_generate_noise`` value for value. The noise is
    drawn into ``scratch`` (reused when it has the sums' size and dtype on the CPU, else made): a fresh 45 MB buffer a
    step costs ResNet-18 more in page faults than the second thread saves.
    """
    if std == 0:
        return scratch
    threads = torch.get_num_threads()
    total = sum(s.numel() for s in sums)
    if (threads < 2 or total < PARALLEL_NOISE_ELEMENTS or len({s.dtype for s in sums}) != 1
            or any(s.device.type != "cpu" for s in sums)):
        for s in sums:
            s.add_(torch.empty(s.shape, dtype=s.dtype, device=s.device).normal_(0.0, std, generator=generator))
        return scratch
    if scratch is None or scratch.numel() != total or scratch.dtype != sums[0].dtype or scratch.device.type != "cpu":
        scratch = torch.empty(total, dtype=sums[0].dtype)
    seeds = torch.randint(_SEED_HIGH, (threads,), generator=generator, dtype=torch.int64).tolist()
    chunks = scratch.tensor_split(threads)
    futures = [_executor().submit(_fill, chunk, std, seed) for chunk, seed in zip(chunks[1:], seeds[1:], strict=True)]
    _fill(chunks[0], std, seeds[0])  # the calling thread draws the first chunk
    for future in futures:
        future.result()
    start = 0
    for s in sums:
        s.add_(scratch[start:start + s.numel()].view(s.shape))
        start += s.numel()
    return scratch
