"""``bk``'s DP-SGD step with its noise in parallel chunks against Opacus' one-thread draws, interleaved, one process.

    python -m benchmarks.noise_ab [--model resnet18-gn] [--rounds 7] [--steps 5] [--batch 64] [--threshold N]

Two copies of the model, each with a ``bk`` step (clip 1, noise 1, :func:`benchmarks.dp_step._private`), one with
:data:`fedapp.clients.noise.PARALLEL_NOISE_ELEMENTS` at its value (or ``--threshold``), one with it out of reach
(Opacus' draws); per round each arm's median step; prints each arm's median over rounds and the per-round ratio
parallel ÷ Opacus' draws. The ratio means something only with more than one torch thread and a model at or above the
threshold.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable

import torch

from benchmarks.dp_step import _private, _shape, interleaved
from fedapp.clients import noise


def ab(model: str, rounds: int, steps: int, batch: int, threshold: int | None = None) -> list[str]:
    """Markdown rows: each arm's median step and the per-round ratios."""
    from fedapp.compat.heap import reuse_freed_memory
    from fedapp.models.zoo import build_model

    warnings.filterwarnings("ignore")
    reuse_freed_memory()  # the allocator as local_train sets it
    shape, classes = _shape(model)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((batch, *shape), generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)

    def new_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(model, shape, classes)

    kept = noise.PARALLEL_NOISE_ELEMENTS

    def at(limit: int, step: Callable[[], None]) -> Callable[[], None]:
        def limited() -> None:
            noise.PARALLEL_NOISE_ELEMENTS = limit
            step()
        return limited

    arms = {"parallel chunks": at(threshold or kept, _private("bk", new_model(), x, y, 1.0)),
            "Opacus' draws": at(1 << 62, _private("bk", new_model(), x, y, 1.0))}
    try:
        times = interleaved(arms, rounds, steps)
    finally:
        noise.PARALLEL_NOISE_ELEMENTS = kept
    ratios = [p / o for p, o in zip(times["parallel chunks"], times["Opacus' draws"], strict=True)]
    rows = [f"| {model} | `bk` step, noise from {label} | {statistics.median(ts) * 1e3:.1f} ms |" for label, ts in times.items()]
    rows.append(f"| {model} | parallel ÷ Opacus' draws, per round ({torch.get_num_threads()} threads) | "
                f"median {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18-gn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threshold", type=int, default=None, help="values from which the parallel arm draws in chunks")
    args = parser.parse_args()
    print("\n".join(ab(args.model, args.rounds, args.steps, args.batch, args.threshold)))


if __name__ == "__main__":
    main()
