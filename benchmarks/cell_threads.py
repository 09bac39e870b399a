"""Two in-process sweep cells side by side, with and without the cell process's BLAS limit.

    .venv/bin/python -m benchmarks.cell_threads [--rounds 10] [--pairs 2] [--json out.json]

``--engine inprocess --parallel 2`` runs each cell in a spawned process with cores/2 torch threads
(:func:`fedapp.experiments.sweep._limit_threads`), and limits numpy's BLAS pools to as many. This runs one cell of
Fed-SMP's ``mid`` federation (5,900 clients, about 100 a round, rand-k at p = 0.4, seed 1, ``--rounds`` rounds) twice
at once, as two such processes: arm ``limited`` with the limit, arm ``torch-only`` with the torch threads alone (what
the sweep did before). The arms alternate (A B B A ...), ``--pairs`` times each; a cell's time is its federation's
wall time (set-up included, the same in both arms). Prints each arm's seconds per cell and the ratio of the medians,
both measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedapp.experiments.sweep import _child, _limit_threads, load_sweep

REPO = Path(__file__).resolve().parent.parent


def _torch_only(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _cell(rounds: int, out: str) -> float:
    from fedapp.experiments.notebook_utils import run_federation

    sweep = load_sweep(REPO / "configs/papers/fed_smp_table1.toml", "mid")
    cell = {**sweep.cells()[0], "strategy": "fed-smp-randk", "compression-ratio": 0.4}
    overrides = {**sweep.config, **cell, "num-server-rounds": rounds, "evaluate-every": rounds,
                 "output-dir": out, "run-name": "cell-threads", "data-dir": str(REPO / "../shared/data")}
    start = time.perf_counter()
    run_federation(overrides, num_clients=sweep.num_supernodes)
    return time.perf_counter() - start


def _side_by_side(arm: str, rounds: int, threads: int) -> list[float]:
    """Two cells at once, each in its own spawned process started as ``arm`` says; their seconds."""
    init = _limit_threads if arm == "limited" else _torch_only
    with tempfile.TemporaryDirectory() as tmp:
        pools = [_child(threads, init) for _ in range(2)]
        try:
            futures = [pool.submit(_cell, rounds, os.path.join(tmp, str(i))) for i, pool in enumerate(pools)]
            return [f.result() for f in futures]
        finally:
            for pool in pools:
                pool.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads = max(1, (os.cpu_count() or 1) // 2)
    order = [arm for i in range(args.pairs) for arm in
             (("limited", "torch-only") if i % 2 == 0 else ("torch-only", "limited"))]
    seconds: dict[str, list[float]] = {"limited": [], "torch-only": []}
    for arm in order:
        got = _side_by_side(arm, args.rounds, threads)
        seconds[arm] += got
        print(f"{arm:10s} {' '.join(f'{s:.1f}' for s in got)} s", flush=True)
    medians = {arm: statistics.median(v) for arm, v in seconds.items()}
    result: dict[str, Any] = {"rounds": args.rounds, "threads_per_cell": threads, "seconds": seconds,
                              "median": medians, "ratio_limited_over_torch_only":
                                  medians["limited"] / medians["torch-only"]}
    print(f"median s a cell of {args.rounds} rounds: limited {medians['limited']:.1f}, torch-only "
          f"{medians['torch-only']:.1f}; ratio {result['ratio_limited_over_torch_only']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
