"""Speed and footprint: start-up, per-mode DP-SGD step cost, federations of 100 and 1,000 clients.

    python -m benchmarks.speed startup [--rounds 5]          # round-1 start-up, cold vs warm shared cache
    python -m benchmarks.speed modes   [--batch 64]          # per model: each Opacus mode, auto's pick, DP ÷ plain
    python -m benchmarks.speed scale   [--clients 100 1000] [--fraction 0.1]  # per round, per trained client, peak memory

Every figure is measured within one run of this script, every federation through the real launcher
(SuperLink + ``flwr run`` + Ray). Peak memory is the summed PSS of the launcher and all its descendants
(SuperLink, ServerApp, Ray's daemons and actors, also once re-parented; ``benchmarks.peer_pfl.run_measured``),
sampled every 2 s (one sample of ~17 processes costs ~85 ms of CPU). Results print as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = str((REPO.parent / "shared" / "data").resolve())
STARTUP_TARGET_S = 5.0

# the 20-client MNIST federation: shards, dist2, heterogeneous batch sizes, 300 training samples a client
MNIST_FEDERATION = ("strategy='dpsgd-fedavg' dataset='mnist' data-dir='{data}' partitioner='shards' "
                    "privacy-dist='dist2' batch-size-choices='16,32,64,128' clip-norm=3.0 lr=0.05 max-samples=7500 "
                    "fraction-evaluate=0.0 num-server-rounds={rounds} output-dir='{out}' run-name='{name}'")


def launch(run_config: str, num_supernodes: int, cache_dir: str, out: str, engine: str = "superlink",
           num_cpus: float = 1.0, num_gpus: float = 0.0) -> dict:
    """One federation through ``python -m fedapp.run.launch`` (a child process, as a user runs it): wall, peak
    memory of its whole process tree, and the per-round times from rounds.jsonl. The launcher's output goes
    to ``<out>/launch-<n>.log``."""
    import sys

    from benchmarks.peer_pfl import run_measured  # samples the tree, Ray's re-parented daemons included

    env = {**os.environ, "DPFL_CACHE_DIR": cache_dir, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "MPLBACKEND": "Agg"}
    before = set(Path(out).glob("*"))
    log = Path(out) / f"launch-{len(before)}.log"
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", str(num_supernodes), "--run-config", run_config,
           "--engine", engine, "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus)]
    # one PSS sample of ~17 processes costs ~85 ms of CPU: every 2 s
    code, wall, mem = run_measured(cmd, env=env, cwd=REPO, log=log, interval=2.0, timeout=None)
    if code != 0:
        raise RuntimeError(f"the launch exited with code {code}; see {log}")
    [run_dir] = [p for p in set(Path(out).glob("*")) - before if (p / "summary.json").is_file()]
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
    times = [float(r["wall_seconds"]) for r in rounds]
    steady = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    trained = [int(r["metrics"].get("clients_ok", 0)) for r in rounds]
    per_client = [t / n for t, n in zip(times[1:], trained[1:]) if n]
    return {"wall": wall, "peak_gb": mem.peak_bytes / 1e9, "round_times": times, "round1": times[0], "steady": steady,
            "trained": trained, "per_client": statistics.median(per_client) if per_client else float("nan"),
            "startup": times[0] - steady, "outside": wall - sum(times),
            "accuracy": json.loads((run_dir / "summary.json").read_text()).get("final_accuracy")}


def bench_startup(rounds: int, engine: str = "superlink", repeats: int = 1) -> list[str]:
    """Round-1 start-up of the 20-client MNIST federation: without the cache, on an empty cache, then ``repeats``
    warm-cache runs and their median (the warm start-up spreads by seconds from run to run on this VM)."""
    rows = [f"| run (20 clients × 300 MNIST samples, dist2, dpsgd-fedavg; engine {engine}) | wall | outside rounds | round 1 | "
            "steady round (median) | round-1 start-up = round 1 − steady | ÷ 5 s target | peak PSS |",
            "|---|---|---|---|---|---|---|---|"]
    plan = [("no cache (DPFL_CACHE_DIR=off)", "off"), ("first run, empty cache", "")]
    plan += [(f"warm cache #{i + 1}", "") for i in range(repeats)]
    warm: list[dict] = []
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        for label, cache_dir in plan:
            cfg = MNIST_FEDERATION.format(data=DATA_DIR, rounds=rounds, out=out, name="startup")
            r = launch(cfg, 20, cache_dir or cache, out, engine)
            rows.append(_startup_row(label, r))
            if label.startswith("warm"):
                warm.append(r)
    if len(warm) > 1:
        rows.append(_startup_row(f"**median of {len(warm)} warm runs**",
                                 {k: statistics.median(r[k] for r in warm) for k in _TIMED}))
    return rows


_TIMED = ("wall", "outside", "round1", "steady", "startup", "peak_gb")


def _startup_row(label: str, r: dict) -> str:
    return (f"| {label} | {r['wall']:.1f} s | {r['outside']:.1f} s | {r['round1']:.1f} s | {r['steady']:.2f} s | "
            f"{r['startup']:.1f} s | {r['startup'] / STARTUP_TARGET_S:.2f}× | {r['peak_gb']:.2f} GB |")


def bench_modes(batch: int, models: list[str]) -> list[str]:
    """Seconds per step of each supported Opacus mode and of plain SGD, per model, and what ``auto`` picks."""
    import torch

    from fedapp.clients.grad_sample_mode import supported_modes, time_modes
    from fedapp.clients.training import LocalTraining, local_train
    from fedapp.data.datasets import load_dataset
    from fedapp.models.zoo import DEFAULT_MODEL, build_model

    shapes = {name: dataset for dataset, name in DEFAULT_MODEL.items()}
    rows = [f"| model (batch {batch}, CPU, {torch.get_num_threads()} threads) | plain SGD step | " +
            " | ".join(f"DP `{m}`" for m in ("hooks", "ew", "functorch")) + " | auto picks | best DP ÷ plain |",
            "|---|---|---|---|---|---|---|"]
    for name in models:
        dataset = shapes.get(name, "mnist" if name.startswith("cnn") else "digits")
        if dataset in ("cifar10", "cifar100"):
            shape, classes = (3, 32, 32), (100 if dataset == "cifar100" else 10)
        elif dataset == "a9a":
            shape, classes = (123,), 2
        elif dataset == "digits":
            shape, classes = (1, 8, 8), 10
        else:
            train, _ = load_dataset(dataset, DATA_DIR)
            shape, classes = train.input_shape, train.num_classes

        def new_model(name: str = name, shape: tuple = shape, classes: int = classes):
            torch.manual_seed(0)
            return build_model(name, shape, classes)

        modes = supported_modes(name)
        dp = time_modes(new_model, shape, classes, batch, torch.device("cpu"), modes, steps=6, repeats=3)
        plain = _plain_step(new_model, shape, classes, batch, LocalTraining, local_train)
        best = min(dp, key=dp.__getitem__)
        cells = " | ".join(f"{dp[m] * 1e3:.1f} ms" if m in dp else "—" for m in ("hooks", "ew", "functorch"))
        rows.append(f"| {name} | {plain * 1e3:.1f} ms | {cells} | `{best}` | {dp[best] / plain:.2f}× |")
    return rows


def _plain_step(new_model, shape, classes, batch, LocalTraining, local_train, steps: int = 6) -> float:
    import numpy as np
    import torch

    from fedapp.data.datasets import ArrayDataset

    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.standard_normal((batch * steps, *shape)).astype(np.float32),
                        rng.integers(0, classes, batch * steps).astype(np.int64), classes)
    spec = LocalTraining(batch_size=batch, steps=steps, lr=0.0)
    times = []
    for rep in range(4):
        start = time.perf_counter()
        local_train(new_model(), data, spec, torch.device("cpu"))
        if rep:
            times.append((time.perf_counter() - start) / steps)
    return min(times)


def bench_scale(clients: list[int], rounds: int, secure_aggregation: bool = True, engine: str = "superlink",
                num_cpus: float = 1.0, fraction: float = 0.1) -> list[str]:
    """Client-level DP-FedAvg on MNIST (all 60,000 images split evenly) with n clients, ``fraction`` of them
    Poisson-sampled a round, through the launcher. Per trained client: the median over rounds 2.. of a round's wall
    over the clients it trained."""
    mode = "SecAgg+ with the discrete Gaussian" if secure_aggregation else "trusted server, no SecAgg+"
    rows = [f"| clients ({fraction:.0%} a round, MNIST, dp-fedavg, {mode}; engine {engine}, {num_cpus:g} CPU a "
            "client) | samples a client | wall | outside rounds | round 1 | steady round (median) | trained a round | "
            "per trained client (median, rounds 2..) | peak PSS |", "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        for n in clients:
            cfg = (f"strategy='dp-fedavg' dataset='mnist' data-dir='{DATA_DIR}' max-samples=60000 "
                   f"clients-per-round={max(2, round(n * fraction))} target-epsilon=5.0 clip-norm=1.0 lr=0.05 "
                   f"fraction-evaluate=0.0 num-server-rounds={rounds} secure-aggregation={str(secure_aggregation).lower()} "
                   f"output-dir='{out}' run-name='scale-{n}'")
            r = launch(cfg, n, cache, out, engine, num_cpus)
            rows.append(f"| {n:,} | {60000 // n} | {r['wall']:.1f} s | {r['outside']:.1f} s | {r['round1']:.1f} s | "
                        f"{r['steady']:.2f} s | {min(r['trained'])}-{max(r['trained'])} | {r['per_client']:.3f} s | "
                        f"{r['peak_gb']:.2f} GB |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("startup")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="warm-cache runs")
    p.add_argument("--engine", default="superlink", choices=("superlink", "run-simulation"), help="the launcher's")
    p = sub.add_parser("modes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--models", nargs="*", default=["cnn-mnist", "cnn-cifar", "cnn-digits", "mlp-digits", "logreg",
                                                   "resnet18-gn"])
    p = sub.add_parser("scale")
    p.add_argument("--clients", type=int, nargs="*", default=[100, 1000])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-secure-aggregation", action="store_true",
                   help="trusted-server DP-FedAvg (Flower's SecAgg+ protocol dominates rounds of 100 clients)")
    p.add_argument("--engine", default="superlink", choices=("superlink", "run-simulation"), help="the launcher's")
    p.add_argument("--num-cpus", type=float, default=1.0,
                   help="the launcher's CPUs per client (2 on 2 cores: one actor with 2 threads)")
    p.add_argument("--fraction", type=float, default=0.1, help="clients Poisson-sampled a round, as a fraction")
    args = parser.parse_args(argv)
    if args.what == "scale" and not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    if args.what == "startup":
        rows = bench_startup(args.rounds, args.engine, args.repeats)
    elif args.what == "modes":
        rows = bench_modes(args.batch, args.models)
    else:
        rows = bench_scale(args.clients, args.rounds, not args.no_secure_aggregation, args.engine, args.num_cpus,
                           args.fraction)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
