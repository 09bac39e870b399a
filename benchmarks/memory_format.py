"""Channels-last against the default layout for every convolutional model of the zoo, on this machine's CPU.

The ratio behind each class's ``CPU_MEMORY_FORMAT`` (:mod:`fedapp.models.zoo`): CPU time of a plain-SGD step
(forward, backward, update; batch 32, one torch thread, as an actor trains) and of a forward-only evaluation
pass (batch 512), channels-last ÷ default, the two layouts alternating within one run, median over the repeats. The
channels-last copy is laid out by the training loop's own ``relayout``, so the ratio is the loop's.
CPU time rather than wall time: it is what the layout changes, and it moves less than wall time on a shared machine.

    .venv/bin/python -m benchmarks.memory_format [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fedapp.clients.training import relayout
from fedapp.models.zoo import MODELS

#: model → (input channels, side, plain-SGD steps per timing, evaluation batches per timing)
CASES: dict[str, tuple[int, int, int, int]] = {
    "cnn-mnist": (1, 28, 60, 6), "cnn-fmnist": (1, 28, 30, 3), "cnn-cifar": (3, 32, 30, 3),
    "cnn-digits": (1, 8, 200, 20), "resnet18-gn": (3, 32, 3, 1),
}


def _sgd_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    loss_fn, start = nn.CrossEntropyLoss(), time.process_time()
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)  # type: ignore[arg-type]
    return time.process_time() - start


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, batches: int) -> float:
    model.eval()
    start = time.process_time()
    for _ in range(batches):
        model(x).argmax(1)
    model.train()
    return time.process_time() - start


def _ratio(run: Callable[[nn.Module], float], default: nn.Module, channels_last: nn.Module, repeats: int) -> dict:
    ratios, base = [], []
    for _ in range(repeats):
        a, b = run(default), run(channels_last)
        ratios.append(b / a)
        base.append(a)
    return {"ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
            "default_cpu_s": statistics.median(base)}


def measure(name: str, repeats: int) -> dict:
    channels, side, steps, batches = CASES[name]
    torch.manual_seed(0)
    model = MODELS[name](channels, 10)
    fast = copy.deepcopy(model)
    relayout(fast, torch.channels_last)  # as the training loop lays the weights out
    x, y = torch.randn(32, channels, side, side), torch.randint(0, 10, (32,))
    x_eval = torch.randn(512, channels, side, side)
    return {"model": name, "declared": str(getattr(type(model), "CPU_MEMORY_FORMAT", None)),
            "sgd_step": _ratio(lambda m: _sgd_steps(m, x, y, steps), model, fast, repeats),
            "evaluation": _ratio(lambda m: _evaluate(m, x_eval, batches), model, fast, repeats)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# benchmarks.memory_format --repeats {args.repeats} (torch {torch.__version__}, one thread)")
    print("| model | declared CPU layout | SGD step, channels-last ÷ default | evaluation ÷ | default step CPU s |")
    print("|---|---|---|---|---|")
    rows = []
    for name in args.models:
        row = measure(name, args.repeats)
        rows.append(row)
        print(f"| {name} | {row['declared']} | {row['sgd_step']['ratio']:.2f}× {row['sgd_step']['ratios']} | "
              f"{row['evaluation']['ratio']:.2f}× | {row['sgd_step']['default_cpu_s'] / CASES[name][2]:.4f} |",
              flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
