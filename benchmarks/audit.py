"""The privacy audit per family: accountant ε against the empirical estimate and the one-run lower bound, and what the
canaries cost in accuracy.

In-process (``fedapp.experiments.notebook_utils.run_federation``), so without SecAgg+. Per strategy and target ε, one
run with ``audit-canaries`` and one without, same seed; DP noise from OS entropy.

* ``client`` (DP-FedAvg, Fed-SMP rand-k, DP-FTRL, DP2-FedSAM): MNIST, logistic regression (DP2-FedSAM: the MNIST
  CNN, a body to share), 500 clients of which 100 are heads-or-tails canaries, every client every round, 5 rounds.
  Without SecAgg+ DP-FedAvg, Fed-SMP and DP2-FedSAM calibrate σ so that one update meets the target ε against the
  server, so the released mean, which the statistic models, is charged the smaller ``epsilon_vs_release``; DP-FTRL,
  whose server adds the noise without SecAgg+, plans for the release. Estimates for the final model and all iterates.
* ``record`` (DP-SGD: DPFedAvg, Robust-HDP; SoteriaFL-SGD): sklearn digits, the digits MLP, 4 clients with 400 canary
  slots (100 each), every client at ε_i = the target, 10 rounds of the default local training (1 epoch, lr 0.05) at
  batch 16; the accountant ε is the largest of the clients'.

    .venv/bin/python -m benchmarks.audit --data-dir ../shared/data --seeds 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CLIENT_LEVEL = ("dp-fedavg", "fed-smp-randk", "dp-ftrl", "dp2-fedsam")
RECORD_LEVEL = ("dpsgd-fedavg", "robust-hdp", "soteriafl-sgd")
CLIENT_BASE = {"dataset": "mnist", "model": "logreg", "num-server-rounds": 5, "clip-norm": 1.0, "local-steps": 2,
               "batch-size": 16, "fraction-evaluate": 0.0, "lr": 0.1}
RECORD_BASE = {"dataset": "digits", "model": "mlp-digits", "num-server-rounds": 10, "clip-norm": 1.0,
               "batch-size": 16, "fraction-evaluate": 0.0, "privacy-dist": "fixed"}
RECORD_CLIENTS, RECORD_SLOTS = 4, 400


def one(base: dict[str, Any], strategy: str, target: float, canaries: int, clients: int, seed: int, out: Path,
        data_dir: str) -> dict[str, Any]:
    from fedapp.experiments.notebook_utils import run_federation

    extra: dict[str, Any] = {"client-dp-adversary": "release"} if strategy == "dp-ftrl" else {}  # see the docstring
    if strategy == "dp2-fedsam":  # a body to share; its accuracy is the clients' personalized one (no global model)
        extra.update({"model": "cnn-mnist", "fraction-evaluate": 0.2})
    budget = "epsilon" if base is RECORD_BASE else "target-epsilon"  # record-level: every client's ε_i
    run = run_federation({**base, **extra, "strategy": strategy, budget: target, "seed": seed,
                          "audit-canaries": canaries, "output-dir": str(out), "data-dir": data_dir}, num_clients=clients)
    return json.loads((run / "summary.json").read_text())


def _accuracy(summary: dict[str, Any]) -> str:
    """The final centralized test accuracy, or (DP2-FedSAM) the mean of the clients' personalized ones, marked *."""
    if summary.get("final_accuracy") is not None:
        return f"{summary['final_accuracy']:.3f}"
    client = summary.get("final_client_accuracy")
    return "n/a" if client is None else f"{client:.3f}*"


def _cell(stat: dict[str, Any]) -> str:
    low, high = stat["epsilon_interval"]
    return f"{stat['epsilon_estimate']:.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--data-dir", default="../shared/data", help="folder holding MNIST (torchvision's layout)")
    parser.add_argument("--level", choices=("client", "record", "both"), default="both")
    parser.add_argument("--clients", type=int, default=500, help="client-level federation (canaries included)")
    parser.add_argument("--canaries", type=int, default=100, help="client-level canaries")
    parser.add_argument("--targets", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--strategies", nargs="+", default=None, help="a subset of the level's strategies")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.level in ("client", "both"):
            print("| strategy | target ε | seed | accountant ε (release) | estimate, final model [95 % CI] | lower "
                  "bound, final | estimate, all iterates [95 % CI] | lower bound, all | accuracy with canaries | "
                  "without | s |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for strategy, target, seed, a, cells in _rows(args, CLIENT_BASE, args.strategies or CLIENT_LEVEL,
                                                          args.canaries, args.clients, Path(tmp)):
                f, it = a["final_model"], a["all_iterates"]
                print(f"| {strategy} | {target:g} | {seed} | {a['epsilon_accountant']:.3f} | {_cell(f)} | "
                      f"{f['epsilon_lower_bound']:.2f} | {_cell(it)} | {it['epsilon_lower_bound']:.2f} | {cells}",
                      flush=True)
        if args.level in ("record", "both"):
            print("\n| strategy | target ε | seed | accountant ε (largest ε_i) | lower bound [guesses right] | "
                  "estimate [95 % CI] | accuracy with canaries | without | s |")
            print("|---|---|---|---|---|---|---|---|---|")
            for strategy, target, seed, a, cells in _rows(args, RECORD_BASE, args.strategies or RECORD_LEVEL,
                                                          RECORD_SLOTS, RECORD_CLIENTS, Path(tmp)):
                f = a["final_model"]
                print(f"| {strategy} | {target:g} | {seed} | {a['epsilon_accountant']:.3f} | "
                      f"{f['epsilon_lower_bound']:.2f} [{f['correct']}/{f['guesses']}] | {_cell(f)} | {cells}",
                      flush=True)


def _rows(args: argparse.Namespace, base: dict[str, Any], strategies: Sequence[str], canaries: int, clients: int,
          tmp: Path) -> Iterator[tuple[str, float, int, dict[str, Any], str]]:
    """Per strategy, target and seed: the audited run's audit block and the row's last cells (accuracy with and
    without canaries, seconds of both runs)."""
    for strategy in strategies:
        for target in args.targets:
            for seed in args.seeds:
                start = time.perf_counter()
                audited = one(base, strategy, target, canaries, clients, seed, tmp / "a", args.data_dir)
                plain = one(base, strategy, target, 0, clients, seed, tmp / "p", args.data_dir)
                yield (strategy, target, seed, audited["audit"],
                       f"{_accuracy(audited)} | {_accuracy(plain)} | {time.perf_counter() - start:.0f} |")

if __name__ == "__main__":
    main()
