"""GPU checks: the 20-client MNIST round under fractional GPUs and the batched cohort step.

    python -m benchmarks.gpu round [--rounds 6] [--num-gpus 0.1 0.05] [--cuda-graphs off on] [--engine superlink]
    python -m benchmarks.gpu loader [--clients 20] [--samples 2400] [--device cuda]
    python -m benchmarks.batched_clients --clients 20 --samples 2400 --device cuda

``round`` runs the 20-client MNIST federation of benchmarks/speed.py at the Robust-HDP paper's client size
(2,400 training samples a client: ``max-samples = 60000``, 20 % of each partition kept as its local test
split), dist2, DP-SGD on every client, ``device = 'cuda'``, through the real launcher, once per
``--num-gpus`` (GPUs per simulated client: 0.1 puts ten ClientApps on one GPU) and ``--cuda-graphs`` setting
(run-config ``cuda-graphs``: each DP-SGD step one CUDA graph replay). It prints the GPU, then per
setting the wall time, round 1, the steady round (median of rounds 2..), the peak summed PSS of the process
tree and the final accuracy. Target: a steady round ≤ 1.0 s on one H100.

``loader`` trains the same cohort's clients one after another (one local epoch of DP-SGD each, Opacus ``hooks``)
three times per repeat: with the batches of Opacus' ``DPDataLoader`` (records collated on the host, each batch
copied to the device), with ``local_train``'s Poisson batches drawn on the device, and with those batches padded
and each step replayed as a CUDA graph (``cuda-graphs``); it prints the three and the ratios to the host loader.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

from benchmarks.speed import DATA_DIR, launch

FEDERATION = ("strategy='dpsgd-fedavg' dataset='mnist' data-dir='{data}' partitioner='shards' shards-per-client=8 "
              "privacy-dist='dist2' batch-size-choices='16,32,64,128' clip-norm=3.0 lr=0.05 max-samples=60000 "
              "delta=1e-4 allow-large-delta=true device='cuda' fraction-evaluate=0.0 num-server-rounds={rounds} "
              "cuda-graphs={graphs} output-dir='{out}' run-name='gpu-round'")


def describe_gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: benchmarks.gpu measures the GPU path")
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda})")


def bench_round(rounds: int, fractions: list[float], graphs: list[str], engine: str, num_cpus: float,
                keep: str | None) -> list[str]:
    rows = [f"| GPUs a client (20 clients × 2,400 MNIST samples, dist2, DP-SGD; engine {engine}) | cuda-graphs | wall | "
            "round 1 | steady round (median) | ÷ 1.0 s target | peak PSS | final accuracy |",
            "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
        out = keep or tmp  # --out keeps the launcher logs and results folders
        for frac in fractions:
            for graph in graphs:
                cfg = FEDERATION.format(data=DATA_DIR, rounds=rounds, out=out, graphs=str(graph == "on").lower())
                r = launch(cfg, 20, cache, out, engine, num_cpus, frac)
                rows.append(f"| {frac:g} | {graph} | {r['wall']:.1f} s | {r['round1']:.2f} s | {r['steady']:.2f} s | "
                            f"{r['steady']:.2f}× | {r['peak_gb']:.2f} GB | {r['accuracy']} |")
                print(rows[-1], "rounds:", " ".join(f"{t:.2f}" for t in r["round_times"]), flush=True)
    return rows


def _through_host_loader(model, data, spec, device) -> None:
    """One client's DP-SGD iterating Opacus' ``DPDataLoader`` over host tensors, each batch moved to ``device``."""
    import torch
    from opacus.data_loader import DPDataLoader
    from torch import nn
    from torch.utils.data import TensorDataset

    from fedapp.clients.training import PlainSGD, _private
    from fedapp.privacy.profiles import dpsgd_sample_rate

    model.to(device).train()
    q = dpsgd_sample_rate(len(data), spec.batch_size)
    module, optimizer = _private(model, PlainSGD(list(model.parameters()), lr=spec.lr), data, spec, q)
    loader = DPDataLoader(TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y)), sample_rate=q)
    for _ in range(-(-spec.steps // len(loader))):
        for xb, yb in loader:
            if len(yb) == 0:
                continue  # an empty batch is a noise-only step in local_train; it costs no transfer either way
            optimizer.zero_grad(set_to_none=True)
            nn.CrossEntropyLoss()(module(xb.to(device)), yb.to(device)).backward()
            optimizer.step()
    module._close()


def bench_loader(num_clients: int, samples: int, repeats: int, mode: str, device_name: str) -> list[str]:
    import torch

    from benchmarks.batched_clients import cohort
    from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
    from fedapp.privacy.profiles import steps_per_epoch

    warnings.simplefilter("ignore")
    device = torch.device(device_name)
    model, clients, dataset = cohort(num_clients, samples)

    def timed(train, graphs: bool = False) -> float:
        start = time.perf_counter()
        for cid, (data, b) in enumerate(clients):
            spec = LocalTraining(batch_size=b, steps=steps_per_epoch(len(data), b), lr=0.05, seed=1000 + cid,
                                 dp=PerSampleDP(1.0, 3.0, mode, graphs))
            train(copy.deepcopy(model), data, spec, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    host, dev, graphed = [], [], []
    for _ in range(repeats + 1):  # the first triple warms up and is dropped
        host.append(timed(_through_host_loader))
        dev.append(timed(local_train))
        graphed.append(timed(local_train, graphs=mode == "hooks" and device.type == "cuda"))
    host, dev, graphed = host[1:], dev[1:], graphed[1:]

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"

    def ratio(xs: list[float]) -> str:
        r = [x / h for h, x in zip(host, xs)]
        return f"{statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f})"

    steps = sum(-(-len(d) // b) for d, b in clients)
    return [f"| cohort (one client after another, {mode}) | device | host loader (s) | device batches (s) | "
            "CUDA graphs (s) | device ÷ host | graphs ÷ host |", "|---|---|---|---|---|---|---|",
            f"| {num_clients} clients × {len(clients[0][0])} {dataset}, {steps} DP-SGD steps | {device} | "
            f"{cell(host)} | {cell(dev)} | {cell(graphed)} | {ratio(dev)} | {ratio(graphed)} |",
            f"median of {repeats} repeats (range), one warm-up triple dropped; ratios per repeat; the graphs column "
            "is the device batches' loop where graphs do not apply (a CPU, modes other than hooks)"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("round", help="steady round time of the 20-client MNIST federation on the GPU")
    r.add_argument("--rounds", type=int, default=6)
    r.add_argument("--num-gpus", type=float, nargs="+", default=[0.1, 0.05])
    r.add_argument("--cuda-graphs", nargs="+", choices=("off", "on"), default=["off", "on"])
    r.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs a client (default: this machine's cores / 20, at most 1, so that Flower's Ray backend "
                        "keeps all 20 ClientApps at once: it keeps ⌊CPUs / num-cpus⌋)")
    r.add_argument("--engine", choices=("superlink", "run-simulation"), default="superlink")
    r.add_argument("--out", default=None, help="keep the launcher logs and results folders here")
    ld = sub.add_parser("loader", help="one client after another: Opacus' host loader vs batches on the device")
    ld.add_argument("--clients", type=int, default=20)
    ld.add_argument("--samples", type=int, default=2400, help="training samples per client")
    ld.add_argument("--repeats", type=int, default=3)
    ld.add_argument("--mode", default="hooks", help="Opacus grad-sample mode")
    ld.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.what == "loader":
        if args.device == "cuda":
            print(describe_gpu(), flush=True)
        print("\n".join(bench_loader(args.clients, args.samples, args.repeats, args.mode, args.device)))
        return 0
    print(describe_gpu(), flush=True)
    num_cpus = args.num_cpus if args.num_cpus is not None else min(1.0, (os.cpu_count() or 1) / 20)
    print(f"{num_cpus:g} CPUs a client: {int((os.cpu_count() or 1) / num_cpus)} ClientApps at once", flush=True)
    print("\n".join(bench_round(args.rounds, args.num_gpus, args.cuda_graphs, args.engine, num_cpus,
                                 args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
