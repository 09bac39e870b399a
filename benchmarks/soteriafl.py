"""SoteriaFL benchmark (paper Sec. 6, Figures 1-8): utility / loss / accuracy vs rounds and vs uplink bits.

Compares CDP-SGD, SoteriaFL-SGD, SoteriaFL-SVRG (compressed, random-k with k = ⌊d/20⌋) and
LDP-SGD, LDP-SVRG (uncompressed) under record-level local DP, n = 10 clients, label-sorted split
(``shards`` with one shard per client = the reference code's ``sort=True``).

It drives the framework-free core of ``strategies/soteriafl.py`` (``client_step``, ``ServerState``,
``GradientOracle``, ``calibrate_sigma``) in-process — the very functions the Flower client and
strategy call (their glue is covered by ``tests/integration/strategies/test_soteriafl.py``) — because 10 clients × 100+
rounds × 5 methods × several ε through a Flower simulation would not fit the 2 shared CPU cores.

    python benchmarks/soteriafl.py --quick     # a9a ε ∈ {1, 5, 10} (T = 100) + MNIST ε = 4 (T = 100, 20k samples)
    python benchmarks/soteriafl.py             # full: η tuned on the whole Sec. 6 grid per method and ε, MNIST T = 200, all data

Writes docs/benchmarks/soteriafl_tables.md, the plots soteriafl_<task>_eps<ε>.png and soteriafl_results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedapp.clients.common import make_model  # noqa: E402
from fedapp.clients.training import evaluate_model, get_weights, set_weights  # noqa: E402
from fedapp.config import resolve_config  # noqa: E402
from fedapp.data.client_data import load_client_data, training_pool  # noqa: E402
from fedapp.data.datasets import load_dataset  # noqa: E402
from strategies.aggregate import unflatten  # noqa: E402
from strategies.compression import rand_k_omega  # noqa: E402
from strategies.soteriafl import (  # noqa: E402
    METHODS,
    ClientState,
    GradientOracle,
    ServerState,
    calibrate_sigma,
    client_step,
    default_batch_size,
    default_k,
    mask_seed,
    payload_bits,
    shift_stepsize,
    snapshot_coin,
    theorem2_sigma,
)

DOCS = ROOT / "docs" / "benchmarks"
GRID = (0.01, 0.03, 0.06, 0.1, 0.3, 0.6, 1.0)  # Sec. 6
ORDER = ("cdp-sgd", "soteriafl-sgd", "soteriafl-svrg", "ldp-sgd", "ldp-svrg")
# η of the reference notebooks (MNIST ε = 2), used where the quick mode does not tune
REF_ETA_MNIST = {"cdp-sgd": 0.3, "soteriafl-sgd": 0.6, "soteriafl-svrg": 0.3, "ldp-sgd": 1.0, "ldp-svrg": 1.0}
TASKS = {
    "a9a": {"dataset": "a9a", "model": "logreg", "nonconvex-lambda": 0.2, "clip-norm": 0.5, "sgd_batch": 0},
    "mnist": {"dataset": "mnist", "model": "mlp-sigmoid", "nonconvex-lambda": 0.0, "clip-norm": 1.0, "sgd_batch": 128},
}


class Task:
    """Clients' data and gradient oracles, the server's full-data oracle and test set."""

    def __init__(self, name: str, data_dir: str, n: int, seed: int, max_samples: int) -> None:
        spec = TASKS[name]
        self.name, self.n, self.seed = name, n, seed
        self.cfg = resolve_config(overrides={
            "dataset": spec["dataset"], "data-dir": data_dir, "model": spec["model"], "seed": seed,
            "nonconvex-lambda": spec["nonconvex-lambda"], "clip-norm": spec["clip-norm"], "partitioner": "shards",
            "shards-per-client": 1, "local-test-fraction": 0.0, "max-samples": max_samples,
            "strategy": "soteriafl-sgd", "privacy-dist": "fixed", "delta": 1e-3})
        self.clip = float(spec["clip-norm"])
        self.sgd_batch = int(spec["sgd_batch"])
        self.clients = [load_client_data(self.cfg.data, self.cfg.general.seed, i, n)[0] for i in range(n)]
        pool = training_pool(self.cfg.data, self.cfg.general.seed)
        self.model = make_model(self.cfg.model_spec, pool)
        self.x0 = np.concatenate([w.ravel().astype(np.float64) for w in get_weights(self.model)])
        self.shapes = [w.shape for w in get_weights(self.model)]
        self.d = self.x0.size
        self.oracles = [GradientOracle(make_model(self.cfg.model_spec, c), c.x, c.y) for c in self.clients]
        self.server_oracle = GradientOracle(make_model(self.cfg.model_spec, pool), pool.x, pool.y, chunk=2048)
        self.test = load_dataset(spec["dataset"], data_dir)[1] if name == "mnist" else None

    def batch_size(self, estimator: str, m: int, eps: float, omega: float) -> int:
        if estimator == "sgd" and self.sgd_batch:
            return min(self.sgd_batch, m)
        return default_batch_size(estimator, m, epsilon=eps, delta=1e-3, clip=self.clip, d=self.d, omega=omega,
                                  n=self.n)

    def metrics(self, x: np.ndarray) -> dict[str, float]:
        loss, g = self.server_oracle.loss_and_grad(x)
        out = {"train_loss": loss, "grad_norm_sq": float(g @ g)}
        if self.test is not None:
            set_weights(self.model, unflatten(x, self.shapes))
            out["test_accuracy"] = evaluate_model(self.model, self.test, batch_size=2048)[1]
        return out


def run(task: Task, name: str, eps: float, eta: float, rounds: int, eval_every: int) -> dict[str, Any]:
    """One training run of ``rounds`` rounds; metrics every ``eval_every`` rounds (and at 0 and the end)."""
    method = METHODS[name]
    k = default_k(task.d) if method.compression != "none" else task.d
    omega = rand_k_omega(task.d, default_k(task.d))
    gamma = shift_stepsize(omega)
    clients = []
    for i, orc in enumerate(task.oracles):
        b = task.batch_size(method.estimator, orc.m, eps, omega)
        sigma, split = calibrate_sigma(method.estimator, eps, 1e-3, task.clip, b, orc.m, rounds)
        clients.append({"b": b, "sigma": sigma, "split": split, "state": ClientState(),
                        "rng": np.random.default_rng([task.seed, 77, i])})
    srv = ServerState(method, task.d, eta, gamma)
    x = task.x0.copy()
    bits_round = task.n * payload_bits(method, k)
    hist: dict[str, list] = {"round": [], "bits": [], "train_loss": [], "grad_norm_sq": [], "grad_norm_sq_avg": [],
                             "test_accuracy": []}
    gsum, gcount = 0.0, 0

    def record(t: int) -> None:
        nonlocal gsum, gcount
        met = task.metrics(x)
        gsum, gcount = gsum + met["grad_norm_sq"], gcount + 1
        hist["round"].append(t)
        hist["bits"].append(t * bits_round)
        hist["train_loss"].append(met["train_loss"])
        hist["grad_norm_sq"].append(met["grad_norm_sq"])
        hist["grad_norm_sq_avg"].append(gsum / gcount)
        hist["test_accuracy"].append(met.get("test_accuracy"))

    t0 = time.perf_counter()
    record(0)
    for t in range(1, rounds + 1):
        rseed = int(np.random.SeedSequence([task.seed, 502, t]).generate_state(1)[0] >> 1)
        msgs = []
        for i, (c, orc) in enumerate(zip(clients, task.oracles)):
            res = client_step(method, orc, x, c["state"], clip=task.clip, batch_size=c["b"], sigma_p=c["sigma"], k=k,
                              gamma=gamma, rng=c["rng"], seed=mask_seed(rseed, i),
                              refresh_snapshot=snapshot_coin(rseed, i, c["b"] / orc.m))
            msgs.append(res.message)
        x = srv.step(x, msgs, task.n)
        if not np.all(np.isfinite(x)):
            break
        if t % eval_every == 0 or t == rounds:
            record(t)
    c0 = clients[0]
    return {"method": name, "epsilon": eps, "eta": eta, "rounds": rounds, "k": k, "gamma": gamma,
            "batch_size": c0["b"], "m": task.oracles[0].m, "sigma_p": c0["sigma"], "noise_split": c0["split"],
            "sigma_theorem2_c1": theorem2_sigma(method.estimator, eps, 1e-3, task.clip, task.oracles[0].m, rounds),
            "bits_per_round": bits_round, "seconds": time.perf_counter() - t0, "diverged": not np.all(np.isfinite(x)),
            "history": hist}


def score(res: dict[str, Any]) -> float:
    """Tuning criterion: final training loss (∞ if diverged)."""
    loss = res["history"]["train_loss"][-1]
    return math.inf if res["diverged"] or not math.isfinite(loss) else loss


def value_at_bits(res: dict[str, Any], key: str, budget: float) -> float | None:
    """Last recorded ``key`` with cumulative bits ≤ budget."""
    h = res["history"]
    vals = [v for b, v in zip(h["bits"], h[key]) if b <= budget and v is not None]
    return vals[-1] if vals else None


def plot(results: list[dict[str, Any]], task: str, eps: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    second = "test_accuracy" if task == "mnist" else "train_loss"
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    budget = min(r["history"]["bits"][-1] for r in results) * 2.1  # shows the first uncompressed point on MNIST
    for r in results:
        h = r["history"]
        style = "-" if METHODS[r["method"]].compression != "none" else "--"
        label = f"{r['method']} (η={r['eta']})"
        axes[0, 0].plot(h["round"], h["grad_norm_sq_avg"], style, label=label)
        axes[1, 0].plot(h["round"], h[second], style, label=label)
        mask = np.asarray(h["bits"]) <= budget
        axes[0, 1].plot(np.asarray(h["bits"])[mask], np.asarray(h["grad_norm_sq_avg"])[mask], style, label=label)
        axes[1, 1].plot(np.asarray(h["bits"])[mask], np.asarray(h[second], dtype=float)[mask], style, label=label)
    for ax in axes[0]:
        ax.set_yscale("log")
        ax.set_ylabel("utility: mean_t ‖∇f(x_t)‖²")
    for ax in axes[1]:
        ax.set_ylabel(second.replace("_", " "))
    for ax in axes[:, 0]:
        ax.set_xlabel("communication rounds")
    for ax in axes[:, 1]:
        ax.set_xlabel("uplink bits (all clients)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"SoteriaFL benchmark: {task}, ε = {eps}, δ = 1e-3, n = 10")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--tasks", default="a9a,mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DOCS))
    ap.add_argument("--rounds", type=int, default=0, help="override T (smoke tests)")
    ap.add_argument("--render", action="store_true", help="only re-render tables/plots from soteriafl_results.json")
    args = ap.parse_args()
    if args.render:
        render(Path(args.out))
        return
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = []
    if "a9a" in args.tasks:
        plans.append(("a9a", (5.0, 1.0, 10.0), args.rounds or 100, 5, 0, (0.1, 0.3, 1.0) if args.quick else GRID, "tune@5" if args.quick else "tune"))
    if "mnist" in args.tasks:
        plans.append(("mnist", (4.0,) if args.quick else (1.0, 2.0, 4.0, 8.0, 16.0), args.rounds or (100 if args.quick else 200),
                      10, 20000 if args.quick else 0, None if args.quick else GRID, "ref" if args.quick else "tune"))
    all_results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "runs": []}
    lines = []
    for task_name, epsilons, rounds, eval_every, max_samples, grid, policy in plans:
        t0 = time.perf_counter()
        task = Task(task_name, args.data_dir, 10, args.seed, max_samples)
        print(f"[{task_name}] d={task.d}, m={[o.m for o in task.oracles]}, setup {time.perf_counter() - t0:.1f}s", flush=True)
        chosen: dict[str, float] = {}
        for eps in epsilons:
            results = []
            for name in ORDER:
                if policy == "ref":
                    etas = (REF_ETA_MNIST[name],)
                elif policy == "tune@5" and name in chosen:
                    etas = (chosen[name],)
                else:
                    etas = grid
                best = None
                for eta in etas:
                    res = run(task, name, eps, eta, rounds, eval_every if len(etas) == 1 else rounds)
                    if len(etas) > 1:
                        print(f"  tune {task_name} ε={eps} {name} η={eta}: loss {score(res):.4f}", flush=True)
                    if best is None or score(res) < score(best):
                        best = res
                assert best is not None
                if len(etas) > 1:  # rerun the winner with the full metric trace
                    best = run(task, name, eps, best["eta"], rounds, eval_every)
                    chosen.setdefault(name, best["eta"])
                best["task"], best["tuned_over"] = task_name, list(etas)
                results.append(best)
                h = best["history"]
                print(f"[{task_name} ε={eps}] {name:15s} η={best['eta']:<5} σ_p={best['sigma_p']:.4g} "
                      f"b={best['batch_size']} loss={h['train_loss'][-1]:.4f} util={h['grad_norm_sq_avg'][-1]:.4g} "
                      f"acc={h['test_accuracy'][-1]} bits={h['bits'][-1]:.3g} ({best['seconds']:.0f}s)", flush=True)
            plot_path = out / f"soteriafl_{task_name}_eps{eps:g}.png"
            plot(results, task_name, eps, plot_path)
            for r in results:
                r["history"] = {k: [None if (isinstance(v, float) and not math.isfinite(v)) else v for v in vals]
                                for k, vals in r["history"].items()}
            all_results["runs"].extend(results)
            lines.append(section(task_name, eps, results, plot_path.name))
            (out / "soteriafl_results.json").write_text(json.dumps(all_results, indent=1))  # after every group
    cmd = "python benchmarks/soteriafl.py" + (" --quick" if args.quick else "")
    (out / "soteriafl_tables.md").write_text(f"<!-- generated by `{cmd}` -->\n" + "\n".join(lines))
    print("\n".join(lines))


def render(out: Path) -> None:
    """Rewrite soteriafl_tables.md and the plots from soteriafl_results.json."""
    data = json.loads((out / "soteriafl_results.json").read_text())
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in data["runs"]:
        groups.setdefault((r["task"], r["epsilon"]), []).append(r)
    lines = []
    for (task, eps), results in groups.items():
        name = f"soteriafl_{task}_eps{eps:g}.png"
        plot(results, task, eps, out / name)
        lines.append(section(task, eps, results, name))
    cmd = "python benchmarks/soteriafl.py" + (" --quick" if data["mode"] == "quick" else "")
    (out / "soteriafl_tables.md").write_text(f"<!-- generated by `{cmd}` -->\n" + "\n".join(lines))
    print("\n".join(lines))


def _f(v: float | None) -> str:
    return "n/a (diverged)" if v is None or not math.isfinite(v) else f"{v:.4f}"


def section(task: str, eps: float, results: list[dict[str, Any]], plot_name: str) -> str:
    second = "test_accuracy" if task == "mnist" else "train_loss"
    budget = min(r["history"]["bits"][-1] for r in results if METHODS[r["method"]].compression != "none")
    rows = [f"### {task}, ε = {eps:g} (δ = 1e-3)", "",
            f"| method | η (tuned over) | b | σ_p accountant | σ_p Thm 2 (c=1) | rounds | {second} at round T/4 | "
            f"final {second} | final utility mean‖∇f‖² | Mbits total | {second} at {budget / 4e6:.3g} Mbit | "
            f"{second} at {budget / 1e6:.3g} Mbit |", "|---" * 12 + "|"]
    for r in results:
        h = r["history"]
        quarter = [v for t, v in zip(h["round"], h[second]) if t <= r["rounds"] // 4][-1]
        at4, at = value_at_bits(r, second, budget / 4), value_at_bits(r, second, budget)
        rows.append(f"| {r['method']} | {r['eta']} ({', '.join(map(str, r['tuned_over']))}) | {r['batch_size']} | "
                    f"{r['sigma_p']:.4g} | {r['sigma_theorem2_c1']:.3g} | {h['round'][-1]} | {_f(quarter)} | "
                    f"{_f(h[second][-1])} | {_f(h['grad_norm_sq_avg'][-1])} | {h['bits'][-1] / 1e6:.3g} | "
                    f"{_f(at4)} | {_f(at)} |")
    rows += ["", f"![{task} ε={eps:g}]({plot_name})", ""]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
