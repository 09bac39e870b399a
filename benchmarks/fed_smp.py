"""Fed-SMP benchmark: Table I in spirit (Fed-SMP-topk/randk vs DP-FedAvg vs FedAvg at equal client-level ε).

Runs the *real* strategies (``strategies/fed_smp.py``) and clients (``fedapp/clients/client_dp.py``)
through an in-process driver: every round the strategy samples r of n clients, each sampled
client's ``fit`` runs on the global weights, its arrays are serialized with Flower's
``ndarrays_to_parameters`` into a ``FitRes`` (so ``uplink_bytes`` are real serialized bytes) and
``aggregate_fit`` decodes, validates, aggregates and writes the ledger. Only the transport (Ray
actors / gRPC) is skipped, because a Flower simulation of hundreds of supernodes does not fit the
2 shared CPU cores. ``tests/integration/strategies/test_fed_smp.py`` runs the same strategies in a real Flower
simulation.

    python benchmarks/fed_smp.py --quick            # minutes on CPU (scaled down, see the report)
    python benchmarks/fed_smp.py                    # larger: cnn-fmnist, n=2000, r=100 (hours on CPU)
    python benchmarks/fed_smp.py --dataset fmnist --data-dir ../shared/data   # when Fashion-MNIST exists

Writes docs/benchmarks/fed_smp.md and docs/benchmarks/fed_smp_*.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import Code, Context, FitRes, RecordDict, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedapp.apps.factories import build_strategy, make_client_dp_client  # noqa: E402
from fedapp.clients.client_dp import ClientLevelDPClient  # noqa: E402
from fedapp.clients.common import make_model, setup_client  # noqa: E402
from fedapp.clients.training import evaluate_model, get_weights, set_weights  # noqa: E402
from fedapp.config import resolve_config  # noqa: E402
from fedapp.data.datasets import load_dataset  # noqa: E402
from fedapp.registry import get_spec  # noqa: E402
from strategies.base import StrategyContext  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks"
PAPER_TABLE_I = {  # Fashion-MNIST, (ε, δ) = (1.01, n^-1.1), best accuracy over rounds, uplink MB per client
    "Fed-SMP-topk p=0.005": (80.76, 0.10), "Fed-SMP-randk p=0.4": (79.88, 7.98),
    "DP-FedAvg": (72.72, 19.96), "FedAvg": (86.98, 19.96),
}


class _Proxy(ClientProxy):
    """A client proxy that only names a node; the driver calls the NumPyClient directly."""

    def get_properties(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover - unused
        raise NotImplementedError


class MemoryRecorder:
    """``RoundRecorder`` keeping round records in memory."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []

    def open(self) -> None:
        pass

    def write_round(self, record: dict[str, Any]) -> None:
        self.rounds.append(record)

    def finish(self) -> None:
        pass


def subset_evaluate_fn(cfg, samples: int):
    """Centralized accuracy on a fixed random subset of the test split (``samples`` = 0: all of it)."""
    _, test = load_dataset(cfg["dataset"], cfg["data-dir"])
    if 0 < samples < len(test):
        test = test.subset(np.sort(np.random.default_rng(7).choice(len(test), samples, replace=False)))
    model = make_model(cfg.model_spec, test)

    def evaluate_fn(weights):
        set_weights(model, weights)
        loss, acc = evaluate_model(model, test, batch_size=1000)
        return float(loss), {"accuracy": float(acc)}

    return evaluate_fn


def run_in_process(overrides: dict[str, Any], num_clients: int, log_every: int = 0, eval_every: int = 1,
                   eval_samples: int = 0) -> dict[str, Any]:
    """Run one strategy for ``num-server-rounds`` rounds in-process; returns the round records."""
    cfg = resolve_config({}, overrides)
    spec = get_spec(cfg["strategy"])
    _, test = load_dataset(cfg["dataset"], cfg["data-dir"])
    recorder = MemoryRecorder()
    # In-process stand-in for SecAgg+: this loop computes the same sum the secure aggregation would (equal within
    # quantization, tests/integration/fedapp/privacy/test_secure_aggregation.py), so the paper's aggregate budget
    # applies to the utility measured here; the guarantee itself needs the real protocol (`flwr run`,
    # fedapp.privacy.secure_aggregation).
    ctx = StrategyContext(initial_weights=get_weights(make_model(cfg.model_spec, test)),
                          evaluate_fn=subset_evaluate_fn(cfg, eval_samples), recorder=recorder,
                          secure_aggregation=cfg.client_dp.secure_aggregation)
    strategy = build_strategy(cfg, ctx)
    manager = SimpleClientManager()
    proxies = {}
    for i in range(num_clients):
        proxies[i] = _Proxy(str(i))
        proxies[i].node_id = i + 1
        manager.register(proxies[i])
    private = spec.client is make_client_dp_client
    params = strategy.initialize_parameters(manager)
    strategy.evaluate(0, params)
    start = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        results = []
        for proxy, ins in strategy.configure_fit(rnd, params, manager):
            cid = int(proxy.cid)
            context = Context(run_id=0, node_id=cid + 1, node_config={"partition-id": cid, "num-partitions": num_clients},
                              state=RecordDict(), run_config={})
            client = ClientLevelDPClient(setup_client(context, overrides), cfg.client_dp, context, private=private)
            arrays, n, metrics = client.fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
        params, _ = strategy.aggregate_fit(rnd, results, [])
        if rnd % eval_every == 0 or rnd == cfg.rounds:
            strategy.evaluate(rnd, params)
        strategy.configure_evaluate(rnd, params, manager)  # fraction-evaluate 0: flushes the round record
        if log_every and (rnd % log_every == 0 or rnd == cfg.rounds):
            m = recorder.rounds[-1]["metrics"]
            print(f"  [{cfg['strategy']}] round {rnd}: acc={m.get('accuracy', float('nan')):.4f} "
                  f"eps={m.get('epsilon')} ({time.perf_counter() - start:.0f}s)", flush=True)
    return {"rounds": recorder.rounds, "seconds": time.perf_counter() - start, "cfg": dict(cfg)}


def summarize(label: str, run: dict[str, Any], num_clients: int) -> dict[str, Any]:
    rounds = run["rounds"]
    evaluated = [(i + 1, r["metrics"]["accuracy"]) for i, r in enumerate(rounds) if "accuracy" in r["metrics"]]
    accs = [a for _, a in evaluated]
    total_bytes = rounds[-1]["metrics"].get("uplink_bytes_cumulative", 0)
    clients = sum(r["metrics"].get("clients_ok", 0) for r in rounds)
    return {
        "label": label, "best_accuracy": max(accs), "final_accuracy": accs[-1],
        "eval_rounds": [i for i, _ in evaluated],
        "epsilon": rounds[-1]["metrics"].get("epsilon"), "sigma": rounds[-1]["metrics"].get("noise_multiplier"),
        # paper's "uplink cost": bytes a client sends over training, 32·k·T·(r/n) bits
        "uplink_mb_per_client": total_bytes / num_clients / 1e6,
        "bytes_per_update": total_bytes / max(clients, 1), "seconds": run["seconds"],
        "accuracy_curve": accs,
        "uplink_curve": [rounds[i - 1]["metrics"].get("uplink_bytes_cumulative", 0) for i, _ in evaluated],
    }


def combine(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean (and std) over seeds of the accuracy fields and curves; other fields from the first seed."""
    out = dict(per_seed[0])
    for key in ("best_accuracy", "final_accuracy"):
        vals = [r[key] for r in per_seed]
        out[key], out[key + "_std"], out[key + "_all"] = float(np.mean(vals)), float(np.std(vals)), vals
    out["accuracy_curve"] = list(np.mean([r["accuracy_curve"] for r in per_seed], axis=0))
    out["seconds"] = float(sum(r["seconds"] for r in per_seed))
    out["seeds"] = len(per_seed)
    return out


def _pm(row: dict[str, Any], key: str) -> str:
    text = f"{100 * row[key]:.2f}"
    return text + (f" ± {100 * row[key + '_std']:.2f}" if row.get("seeds", 1) > 1 else "")


def wire_check(base: dict[str, Any], ratio: float) -> dict[str, Any]:
    """Serialized uplink bytes of one Fed-SMP-randk update at ``ratio`` vs one dense DP-FedAvg update (cnn-fmnist)."""
    out = {}
    for strat, p in (("fed-smp-randk", ratio), ("dp-fedavg", 1.0)):
        ov = {**base, "strategy": strat, "compression-ratio": p, "model": "cnn-fmnist", "num-server-rounds": 1,
              "clients-per-round": 2, "local-steps": 1, "max-samples": 2000, "public-samples": 0}
        run = run_in_process(ov, num_clients=4)
        out[strat] = run["rounds"][0]["metrics"]["uplink_bytes_per_client"]
        out["d"] = int(sum(w.size for w in get_weights(make_model(resolve_config({}, ov).model_spec, load_dataset(ov["dataset"], ov["data-dir"])[1]))))
    out["k"] = int(round(ratio * out["d"]))
    out["ratio"] = out["fed-smp-randk"] / out["dp-fedavg"]
    return out


def plot(rows: list[dict[str, Any]], path_prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        acc = row["accuracy_curve"]
        axes[0].plot(row["eval_rounds"], acc, marker=".", label=row["label"])
        axes[1].plot(np.asarray(row["uplink_curve"]) / 1e6, acc, label=row["label"])
    axes[0].set_xlabel("round")
    axes[1].set_xlabel("cumulative uplink (MB, all clients)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = path_prefix.with_name(path_prefix.name + "_accuracy.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="scaled-down run (minutes on 2 CPU cores)")
    ap.add_argument("--dataset", default="mnist", choices=("mnist", "fmnist", "digits"))
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--seeds", default="1", help="comma-separated seeds; the table reports mean ± std over them")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--no-docs", action="store_true", help="print only; do not rewrite docs/benchmarks/fed_smp.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    if args.quick:
        scale = {"model": "cnn-mnist", "n": 500, "r": 20, "rounds": 20, "local-steps": 5, "topk_p": 0.01,
                 "randk_p": 0.4, "public": 1000, "eval_every": 4, "eval_samples": 1000}
    else:
        scale = {"model": "cnn-fmnist", "n": 2000, "r": 100, "rounds": 100, "local-steps": 30, "topk_p": 0.005,
                 "randk_p": 0.4, "public": 1000, "eval_every": 5, "eval_samples": 0}
    n = scale["n"]
    base = {
        "dataset": args.dataset, "data-dir": "" if args.dataset == "digits" else args.data_dir, "model": scale["model"],
        "num-server-rounds": scale["rounds"], "clients-per-round": scale["r"], "num-clients": n,
        "privacy-dist": "fixed", "batch-size": 10, "local-steps": scale["local-steps"], "lr": 0.125, "momentum": 0.5,
        "lr-decay": 0.99, "clip-norm": 1.0, "target-epsilon": args.epsilon, "local-test-fraction": 0.0,
        "fraction-evaluate": 0.0, "device": "cpu",
    }
    runs = [
        (f"Fed-SMP-topk p={scale['topk_p']}", {"strategy": "fed-smp-topk", "compression-ratio": scale["topk_p"],
                                              "public-samples": scale["public"]}),
        (f"Fed-SMP-randk p={scale['randk_p']}", {"strategy": "fed-smp-randk", "compression-ratio": scale["randk_p"]}),
        ("DP-FedAvg", {"strategy": "dp-fedavg"}),
        ("FedAvg (no clip, no noise)", {"strategy": "fedavg-randk", "compression-ratio": 1.0, "clip-norm": 1e6}),
    ]
    print(f"scale: {scale}  dataset={args.dataset}", flush=True)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    rows = []
    for label, extra in runs:
        per_seed = []
        for seed in seeds:
            print(f"== {label} (seed {seed})", flush=True)
            run = run_in_process({**base, **extra, "seed": seed}, n, log_every=scale["eval_every"],
                                 eval_every=scale["eval_every"], eval_samples=scale["eval_samples"])
            per_seed.append(summarize(label, run, n))
        rows.append(combine(per_seed))
    wire = wire_check({**base, "num-clients": 4, "seed": seeds[0]}, 0.01)

    header = "| algorithm | best acc. (%) | final acc. (%) | uplink MB / client | bytes / update | ε | σ | wall s |"
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        sig = "-" if r["sigma"] is None else f"{r['sigma']:.3f}"
        lines.append(f"| {r['label']} | {_pm(r, 'best_accuracy')} | {_pm(r, 'final_accuracy')} | "
                     f"{r['uplink_mb_per_client']:.4f} | {r['bytes_per_update']:.0f} | {eps} | {sig} | {r['seconds']:.0f} |")
    table = "\n".join(lines)
    wire_line = (f"Wire check (cnn-fmnist, d = {wire['d']:,}, p = 0.01, k = {wire['k']:,}): Fed-SMP-randk update "
                 f"{wire['fed-smp-randk']:.0f} B vs dense DP-FedAvg update {wire['dp-fedavg']:.0f} B → ratio "
                 f"**{wire['ratio']:.5f}** (target ≤ 0.011).")
    print(table)
    print(wire_line)
    out = {"scale": scale, "base": base, "seeds": seeds,
           "rows": [{k: v for k, v in r.items() if not k.endswith("_curve")} for r in rows],
           "wire": wire}
    if not args.no_docs:
        DOCS.mkdir(parents=True, exist_ok=True)
        prefix = DOCS / ("fed_smp_quick" if args.quick else "fed_smp_full")
        pngs = plot(rows, prefix)
        (prefix.with_suffix(".json")).write_text(json.dumps(out, indent=2))
        write_markdown(args, scale, base, table, wire_line, pngs, quick=args.quick)
    return 0


def write_markdown(args, scale, base, table, wire_line, pngs, quick: bool) -> None:
    mode = "quick" if quick else "full"
    cmd = f"python benchmarks/fed_smp.py{' --quick' if quick else ''} --dataset {args.dataset} --seeds {args.seeds}"
    nseeds = len([x for x in args.seeds.split(",") if x.strip()])
    paper = "\n".join(f"| {k} | {v[0]:.2f} | {v[1]:.2f} | 1.01 |" for k, v in PAPER_TABLE_I.items())
    section = f"""## Results ({mode} mode)

Command: `{cmd}` ({nseeds} seed(s), accuracy as mean ± std over seeds; {time.strftime('%Y-%m-%d')}).

Scale: dataset **{args.dataset}**, model `{scale['model']}`, n = {scale['n']} clients (IID, equal split),
r = {scale['r']} per round (q = {scale['r'] / scale['n']:.3f}), T = {scale['rounds']} rounds, τ = {scale['local-steps']} local
momentum-SGD steps (B = 10, momentum 0.5, η = 0.125 decaying 0.99/round), C = 1.0, δ = n^-1.1,
σ calibrated with the Opacus RDP accountant to ε = {args.epsilon} after T rounds; top-k public set
D_p = {scale['public']} training examples held out of every client's data, τ_p = τ. Accuracy: centralized,
every {scale['eval_every']} rounds on {scale['eval_samples'] or 'all'} test images (fixed subset); "best" is the max over
those evaluations (the paper reports the best over all rounds).

{table}

{wire_line}

![accuracy]({pngs[0]})

Paper, Table I (Fashion-MNIST, n = 6000, r = 100, cnn-fmnist, 5 seeds):

| algorithm | accuracy (%) | uplink MB | ε |
|---|---|---|---|
{paper}
"""
    path = DOCS / "fed_smp.md"
    head = path.read_text().split("## Results")[0] if path.exists() else "# Fed-SMP benchmark\n\n"
    sections = {}
    if path.exists():
        for chunk in path.read_text().split("## Results")[1:]:
            key = "quick" if chunk.startswith(" (quick") else "full"
            sections[key] = "## Results" + chunk
    sections[mode] = section
    body = head + "".join(sections[k] for k in ("quick", "full") if k in sections)
    path.write_text(body)


if __name__ == "__main__":
    raise SystemExit(main())
