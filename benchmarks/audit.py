"""The privacy audit per client-level family: accountant ε against the one-shot empirical estimate (Andrew et al.
2024), and what the canaries cost in accuracy.

In-process (``fedapp.experiments.notebook_utils.run_federation``), so without SecAgg+: DP-FedAvg and Fed-SMP then
calibrate σ so that one update, which the server sees, spends the target ε against it, and the released mean carries
the noise of all the round's updates; DP-FTRL, whose server adds the noise without SecAgg+, plans for the release.
Per strategy and target ε, one run with ``audit-canaries`` = k of the federation's n clients and one with none, same
seed: the accountant's ε for an observer of the released models (``epsilon_vs_release``, what the canary statistic
models), the estimate for the final model and for all iterates with their 95 % bootstrap intervals, and the test
accuracy of both runs.

    .venv/bin/python -m benchmarks.audit --data-dir ../shared/data --seeds 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

STRATEGIES = ("dp-fedavg", "fed-smp-randk", "dp-ftrl")
BASE = {"dataset": "mnist", "model": "logreg", "num-server-rounds": 5, "clip-norm": 1.0, "local-steps": 2, "batch-size": 16,
        "fraction-evaluate": 0.0, "lr": 0.1}


def one(strategy: str, target: float, canaries: int, clients: int, seed: int, out: Path,
        data_dir: str) -> dict[str, Any]:
    from fedapp.experiments.notebook_utils import run_federation

    extra = {"client-dp-adversary": "release"} if strategy == "dp-ftrl" else {}  # see the module docstring
    run = run_federation({**BASE, **extra, "strategy": strategy, "target-epsilon": target, "seed": seed,
                          "audit-canaries": canaries, "output-dir": str(out), "data-dir": data_dir}, num_clients=clients)
    return json.loads((run / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--data-dir", default="../shared/data", help="folder holding MNIST (torchvision's layout)")
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--canaries", type=int, default=100)
    parser.add_argument("--targets", type=float, nargs="+", default=[2.0, 8.0])
    args = parser.parse_args()
    print("| strategy | target ε | seed | accountant ε (release) | estimate, final model "
          "[95 % CI] | estimate, all iterates [95 % CI] | accuracy with canaries | without | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            for target in args.targets:
                for seed in args.seeds:
                    start = time.perf_counter()
                    audited = one(strategy, target, args.canaries, args.clients, seed, Path(tmp) / "a", args.data_dir)
                    plain = one(strategy, target, 0, args.clients, seed, Path(tmp) / "p", args.data_dir)
                    a = audited["audit"]
                    cells = [f"{a[k]['epsilon_estimate']:.3f} [{a[k]['epsilon_interval'][0]:.3f}, "
                             f"{a[k]['epsilon_interval'][1]:.3f}]" for k in ("final_model", "all_iterates")]
                    print(f"| {strategy} | {target:g} | {seed} | {a['epsilon_accountant']:.3f} | {cells[0]} | "
                          f"{cells[1]} | {audited['final_accuracy']:.3f} | {plain['final_accuracy']:.3f} | "
                          f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
