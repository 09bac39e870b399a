"""SecAgg+'s masks per client and round: Flower's ``pseudo_rand_gen`` (MT19937) against fedapp.privacy.masks (AES-CTR).

    .venv/bin/python -m benchmarks.secagg_masks [--models cnn-mnist cnn-fmnist] [--neighbours 100] [--repeats 5]

A SecAgg+ client with r neighbours draws r + 1 masks of its payload's shapes a round (its self mask and one pairwise
mask a neighbour), and the server draws each survivor's self mask again to remove it. For each catalog model's
parameter shapes this times r + 1 masks from fresh 32-byte secrets with each generator, alternating which goes
first, and gives the median over ``--repeats`` and the ratio Flower ÷ ours. Both run in one process, so the ratio
holds on a loaded machine where the absolute times do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen as flowers

from fedapp.models.zoo import build_model
from fedapp.privacy.masks import pseudo_rand_gen as ours

SHAPES_OF = {"cnn-mnist": ((1, 28, 28), 10), "cnn-fmnist": ((1, 28, 28), 10), "cnn-cifar": ((3, 32, 32), 10)}


def masks_of_one_client(gen: Callable[[bytes, int, list[tuple[int, ...]]], list], shapes: list[tuple[int, ...]],
                        neighbours: int) -> float:
    """Seconds for one client's r + 1 masks (fresh secrets each)."""
    secrets = [os.urandom(32) for _ in range(neighbours + 1)]
    start = time.perf_counter()
    for secret in secrets:
        gen(secret, 2**32, shapes)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn-mnist", "cnn-fmnist"], choices=sorted(SHAPES_OF))
    parser.add_argument("--neighbours", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# benchmarks.secagg_masks {' '.join(sys.argv[1:])}  (load average {os.getloadavg()[0]:.1f})\n")
    print(f"| model | values | {args.neighbours + 1} masks, one client: Flower / ours | ÷ | a mask, ours |")
    print("|---|---|---|---|---|")
    for name in args.models:
        input_shape, classes = SHAPES_OF[name]
        shapes = [tuple(p.shape) for p in build_model(name, input_shape, classes).parameters()]
        times: dict[str, list[float]] = {"flower": [], "ours": []}
        for k in range(args.repeats):
            for which in (("flower", "ours") if k % 2 == 0 else ("ours", "flower")):
                times[which].append(masks_of_one_client(flowers if which == "flower" else ours, shapes,
                                                        args.neighbours))
        f, o = statistics.median(times["flower"]), statistics.median(times["ours"])
        values = sum(int(p.numel()) for p in build_model(name, input_shape, classes).parameters())
        print(f"| {name} | {values:,} | {f * 1e3:.1f} / {o * 1e3:.1f} ms | {f / o:.1f}× | "
              f"{o / (args.neighbours + 1) * 1e3:.3f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
