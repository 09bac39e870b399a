"""GPU checks: the 20-client MNIST round under fractional GPUs and the batched cohort step.

    python -m benchmarks.gpu round [--rounds 6] [--num-gpus 0.1 0.05] [--engine superlink]
    python -m benchmarks.batched_clients --clients 20 --samples 2400 --device cuda

``round`` runs the 20-client MNIST federation of benchmarks/speed.py at the Robust-HDP paper's client size
(2,400 training samples a client: ``max-samples = 60000``, 20 % of each partition kept as its local test
split), dist2, DP-SGD on every client, ``device = 'cuda'``, through the real launcher, once per
``--num-gpus`` (GPUs per simulated client: 0.1 puts ten ClientApps on one GPU). It prints the GPU, then per
setting the wall time, round 1, the steady round (median of rounds 2..), the peak summed PSS of the process
tree and the final accuracy. Target: a steady round ≤ 1.0 s on one H100.
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.speed import DATA_DIR, launch

FEDERATION = ("strategy='dpsgd-fedavg' dataset='mnist' data-dir='{data}' partitioner='shards' shards-per-client=8 "
              "privacy-dist='dist2' batch-size-choices='16,32,64,128' clip-norm=3.0 lr=0.05 max-samples=60000 "
              "delta=1e-4 allow-large-delta=true device='cuda' fraction-evaluate=0.0 num-server-rounds={rounds} "
              "output-dir='{out}' run-name='gpu-round'")


def describe_gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: benchmarks.gpu measures the GPU path")
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda})")


def bench_round(rounds: int, fractions: list[float], engine: str, num_cpus: float, keep: str | None) -> list[str]:
    rows = [f"| GPUs a client (20 clients × 2,400 MNIST samples, dist2, DP-SGD; engine {engine}) | wall | round 1 | "
            "steady round (median) | ÷ 1.0 s target | peak PSS | final accuracy |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
        out = keep or tmp  # --out keeps the launcher logs and results folders
        for frac in fractions:
            r = launch(FEDERATION.format(data=DATA_DIR, rounds=rounds, out=out), 20, cache, out, engine,
                       num_cpus, frac)
            rows.append(f"| {frac:g} | {r['wall']:.1f} s | {r['round1']:.2f} s | {r['steady']:.2f} s | "
                        f"{r['steady']:.2f}× | {r['peak_gb']:.2f} GB | {r['accuracy']} |")
            print(rows[-1], "rounds:", " ".join(f"{t:.2f}" for t in r["round_times"]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("round", help="steady round time of the 20-client MNIST federation on the GPU")
    r.add_argument("--rounds", type=int, default=6)
    r.add_argument("--num-gpus", type=float, nargs="+", default=[0.1, 0.05])
    r.add_argument("--num-cpus", type=float, default=1.0)
    r.add_argument("--engine", choices=("superlink", "run-simulation"), default="superlink")
    r.add_argument("--out", default=None, help="keep the launcher logs and results folders here")
    args = p.parse_args(argv)
    print(describe_gpu(), flush=True)
    print("\n".join(bench_round(args.rounds, args.num_gpus, args.engine, args.num_cpus, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
