"""One round of local DP-SGD for a whole cohort: clients one after another (Opacus) vs one batched step.

    python -m benchmarks.batched_clients [--clients 20] [--samples 300] [--repeats 3] [--device cpu|cuda]

The cohort is the 20-client MNIST federation of benchmarks/speed.py (shards, batch sizes drawn from 16/32/64/128 as under
dist2, clip 3, one local epoch; ``digits`` when ../shared/data has no MNIST). Both paths start from the same
global model with the same per-client seeds; the script prints the per-round time of each path, their
ratio measured within this run, and the largest weight difference between the paths (they compute the same
DP-SGD: ``fedapp.clients.batched_dpsgd``, tests/unit/fedapp/clients/test_batched_dpsgd.py). σ does not change the work,
so it is fixed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = (REPO.parent / "shared" / "data").resolve()


def cohort(num_clients: int, samples: int):
    """(model, [(data, batch size)]) of the federation's clients, through the app's own data path."""
    from fedapp.clients.common import make_model
    from fedapp.config import resolve_config
    from fedapp.data.client_data import load_client_data
    from fedapp.privacy.profiles import sample_batch_sizes

    mnist = (DATA_DIR / "MNIST").is_dir()
    cfg = resolve_config(None, {"dataset": "mnist" if mnist else "digits", "data-dir": str(DATA_DIR) if mnist else "",
                                "partitioner": "shards", "max-samples": int(samples * num_clients / 0.8),
                                "privacy-dist": "dist2", "seed": 1})
    sizes = sample_batch_sizes([16, 32, 64, 128], num_clients, 1)
    clients = []
    for cid in range(num_clients):
        train = load_client_data(cfg.data, cfg.general.seed, cid, num_clients)[0]
        clients.append((train, int(min(sizes[cid], len(train)))))
    return make_model(cfg.model_spec, clients[0][0]), clients, cfg["dataset"]


def sequential(model, clients, seeds, mode: str, device) -> tuple[float, list[dict]]:
    from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
    from fedapp.privacy.profiles import steps_per_epoch

    start, out = time.perf_counter(), []
    for (data, b), seed in zip(clients, seeds):
        m = copy.deepcopy(model)
        local_train(m, data, LocalTraining(batch_size=b, steps=steps_per_epoch(len(data), b), lr=0.05, seed=seed,
                                           dp=PerSampleDP(1.0, 3.0, mode)), device)
        out.append({n: p.detach() for n, p in m.named_parameters()})
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def batched(model, clients, seeds, device) -> tuple[float, list[dict]]:
    from fedapp.clients.batched_dpsgd import BatchedClient, train_clients_batched
    from fedapp.privacy.profiles import steps_per_epoch

    jobs = [BatchedClient(data, b, steps_per_epoch(len(data), b), 0.05, 1.0, 3.0, torch.Generator().manual_seed(s))
            for (data, b), s in zip(clients, seeds)]
    start = time.perf_counter()
    out = train_clients_batched(copy.deepcopy(model), jobs, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--samples", type=int, default=300, help="training samples per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="hooks", help="Opacus grad-sample mode of the per-client path")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    model, clients, dataset = cohort(args.clients, args.samples)
    seeds = list(range(1000, 1000 + args.clients))
    seq, bat, diff = [], [], 0.0
    for _ in range(args.repeats + 1):  # the first pair warms up (imports, allocator, kernels) and is dropped
        t_seq, w_seq = sequential(model, clients, seeds, args.mode, device)
        t_bat, w_bat = batched(model, clients, seeds, device)
        seq.append(t_seq)
        bat.append(t_bat)
        diff = max(float((a[n].to("cpu") - b[n].to("cpu")).abs().max()) for a, b in zip(w_seq, w_bat) for n in a)
    seq, bat = seq[1:], bat[1:]
    ratios = [b / s for s, b in zip(seq, bat)]
    steps = sum(-(-len(d) // b) for d, b in clients)
    print(f"| cohort | device | threads | per-client {args.mode} (s) | batched (s) | batched ÷ per-client | "
          "max weight diff |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.clients} clients × {len(clients[0][0])} {dataset}, {steps} DP-SGD steps | {device} | "
          f"{torch.get_num_threads()} | {statistics.median(seq):.3f} ({min(seq):.3f}–{max(seq):.3f}) | "
          f"{statistics.median(bat):.3f} ({min(bat):.3f}–{max(bat):.3f}) | {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}–{max(ratios):.2f}) | {diff:.1e} |")
    print(f"median of {args.repeats} repeats (range), one warm-up pair dropped; ratios are per repeat")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
