"""Foundation benchmarks: DP-SGD step cost, simulation overhead, peak memory, MNIST accuracy.

    python -m benchmarks.foundation step       [--quick] [--models a,b] [--batch 64]  # DP-SGD ÷ non-private step
    python -m benchmarks.foundation overhead   [--quick]   # Flower simulation wall ÷ summed client training
    python -m benchmarks.foundation memory     [--quick]   # peak PSS of all processes of a 20-client simulation
    python -m benchmarks.foundation mnist      [--rounds 30]  # dpsgd-fedavg on MNIST via flwr run
    python -m benchmarks.foundation --quick                # all of the above, small

``overhead`` and ``memory`` run Flower's simulation with its ClientApps on Ray actors and on threads of this process
(``fedapp.compat.thread_backend``).

Every ratio is measured within one run of this script. Results print as markdown rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
DATA_DIR = str((REPO.parent / "shared" / "data").resolve())


# --------------------------------------------------------------------------- simulation overhead
def _overrides(quick: bool, out: str) -> dict:
    if quick:
        return {"dataset": "digits", "num-server-rounds": 3, "output-dir": out, "fraction-evaluate": 0.0}
    return {"dataset": "mnist", "data-dir": DATA_DIR, "max-samples": 12000, "partitioner": "iid", "batch-size": 64,
            "num-server-rounds": 3, "output-dir": out, "fraction-evaluate": 0.0, "model": "cnn-mnist"}


def _plain_loop_seconds(ov: dict, n: int) -> float:
    """Summed client training time of the same run without Flower: same clients, same code, same data."""
    from flwr.common import Context, RecordDict

    from fedapp.clients.common import setup_client
    from fedapp.clients.dpsgd import DPSGDClient
    from fedapp.clients.training import get_weights

    ctxs = [Context(1, i, {"partition-id": i, "num-partitions": n}, RecordDict(), dict(ov)) for i in range(n)]
    weights = None
    total = 0.0
    for rnd in range(1, int(ov["num-server-rounds"]) + 1):
        for ctx in ctxs:
            t0 = time.perf_counter()
            client = DPSGDClient(setup_client(ctx), ctx, private=True)
            if weights is None:
                weights = get_weights(client.s.new_model())
            client.fit(weights, {"server-round": rnd})
            total += time.perf_counter() - t0
    return total


def _simulate(ov: dict, n: int, cpus_per_client: int, sample_memory: bool = False,
              backend: str = "ray") -> tuple[float, float]:
    """Wall seconds of a real Flower simulation (and peak summed PSS in GB of this process tree if asked), its
    ClientApps on Ray actors or (``backend="threads"``) on threads of this process."""
    import psutil
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app
    from fedapp.compat import thread_backend

    os.environ["PYTHONPATH"] = str(REPO)
    peak = [0.0]
    stop = threading.Event()

    def sampler():
        me = psutil.Process()
        while not stop.is_set():
            total = 0
            procs = [me] + me.children(recursive=True)
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak[0] = max(peak[0], total / 1e9)
            time.sleep(0.5)

    th = threading.Thread(target=sampler, daemon=True)
    if sample_memory:
        th.start()
    if backend == thread_backend.THREADS:
        os.environ[thread_backend.ENV] = thread_backend.THREADS
        thread_backend.install()
    try:
        t0 = time.perf_counter()
        run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=n,
                       backend_config={"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False}})
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        os.environ.pop(thread_backend.ENV, None)
        thread_backend.uninstall()
    return wall, peak[0]


def _in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a fresh spawned process: no run finds another's imports, caches (noise calibration,
    partitions) or heap in its process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _overhead_run(quick: bool, cpus_per_client: int, backend: str) -> float:
    """Wall seconds of the overhead benchmark's simulation (``backend`` ``plain``: its summed client training)."""
    n = 20
    with tempfile.TemporaryDirectory() as out:
        ov = _overrides(quick, out)
        if backend == "plain":
            return _plain_loop_seconds(ov, n)
        return _simulate(ov, n, cpus_per_client=cpus_per_client, backend=backend)[0]


def bench_overhead(quick: bool) -> list[str]:
    plain = _in_child(_overhead_run, quick, 2, "plain")
    runs = [(backend, cpus, _in_child(_overhead_run, quick, cpus, backend))
            for backend in ("ray", "threads") for cpus in (2, 1)]  # 2 CPUs a client: one at a time, as the plain loop
    data = "digits" if quick else "MNIST (12k samples, Table-5 CNN, b=64)"
    return ["| simulation (20 clients × 3 rounds, " + data + ") | wall | ÷ summed client training (plain loop) |",
            "|---|---|---|",
            f"| plain loop, no Flower | {plain:.1f} s | 1.00× |",
            *(f"| Flower + {'Ray' if backend == 'ray' else backend}, "
              f"{'1 client at a time (num-cpus=2)' if cpus == 2 else '2 clients in parallel (num-cpus=1)'} | "
              f"{wall:.1f} s | {wall / plain:.2f}× |" for backend, cpus, wall in runs)]


def _memory_run(quick: bool, backend: str) -> tuple[float, float]:
    """The memory benchmark's simulation: (wall s, peak PSS GB of this process and its children)."""
    n = 20
    with tempfile.TemporaryDirectory() as out:
        ov = _overrides(quick, out)
        ov["num-server-rounds"] = 2
        return _simulate(ov, n, cpus_per_client=1, sample_memory=True, backend=backend)


def bench_memory(quick: bool) -> list[str]:
    rows = [(backend, *_in_child(_memory_run, quick, backend)) for backend in ("ray", "threads")]
    data = "digits" if quick else "MNIST"
    return ["| peak memory, 20-client " + data + " simulation | peak PSS, all processes | wall |", "|---|---|---|",
            *(f"| Flower + {'Ray' if b == 'ray' else b}, 2 rounds | {peak:.2f} GB | {wall:.1f} s |"
              for b, wall, peak in rows)]


# --------------------------------------------------------------------------- MNIST accuracy
def bench_mnist(rounds: int, lr: float) -> list[str]:
    from fedapp.run.launch import run

    out = REPO / "benchmarks" / "out"
    cfg = (f"strategy='dpsgd-fedavg' dataset='mnist' data-dir='{DATA_DIR}' partitioner='shards' privacy-dist='dist2' "
           f"batch-size-choices='16,32,64,128' model='cnn-mnist' clip-norm=3.0 lr={lr} "
           f"num-server-rounds={rounds} output-dir='{out}' run-name='foundation-mnist'")
    t0 = time.perf_counter()
    run_dir = run(num_supernodes=20, run_config=cfg)
    wall = time.perf_counter() - t0
    s = json.loads((run_dir / "summary.json").read_text())
    return ["| MNIST dpsgd-fedavg, 20 clients, shards, dist2 | rounds | final acc | best acc | max ε | wall |",
            "|---|---|---|---|---|---|",
            f"| lr={lr}, c=3, δ=1e-4, b∈{{16,32,64,128}} | {s['rounds_completed']} | {s['final_accuracy']:.4f} | "
            f"{s['best_accuracy']:.4f} | {s['max_epsilon']:.3f} | {wall / 60:.1f} min |",
            f"results: `{run_dir.relative_to(REPO)}`"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "step", "overhead", "memory", "mnist"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--models", default="", help="step: comma-separated catalog models (default: all; --quick: "
                                                     "cnn-mnist)")
    parser.add_argument("--batch", type=int, default=64, help="step: the batch size (torch's threads: OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    print(f"# benchmarks.foundation {' '.join(sys.argv[1:])}  (torch threads={torch.get_num_threads()}, "
          f"cpus={os.cpu_count()})\n", flush=True)
    todo = ["step", "overhead", "memory"] if args.what == "all" else [args.what]
    if args.what == "all" and not args.quick:
        todo.append("mnist")
    for what in todo:
        t0 = time.perf_counter()
        if what == "step":
            from benchmarks.dp_step import bench_step

            rows = bench_step(args.quick, tuple(m for m in args.models.split(",") if m) or None, args.batch)
        elif what == "overhead":
            rows = bench_overhead(args.quick)
        elif what == "memory":
            rows = bench_memory(args.quick)
        else:
            rows = bench_mnist(args.rounds if not args.quick else 3, args.lr)
        print("\n".join(rows) + f"\n\n({what}: {time.perf_counter() - t0:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
