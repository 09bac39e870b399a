"""Results folder and privacy ledger of one run.

Layout (one new subfolder of ``output-dir`` per run)::

    config.json    resolved run-config, seed, strategy threat model, package versions
    rounds.jsonl   one JSON object per round: round, wall_seconds, elapsed_seconds, seconds{fit, aggregate,
                   evaluate}, metrics{accuracy, loss, client_accuracy, ...}, clients[{client_id, ...}]
    summary.json   final/best accuracy, max ε per client, total uplink bytes, wall time
    accuracy.png   global test accuracy and mean client accuracy vs round
    privacy.png    ε spent by each client vs round
    tensorboard/   TensorBoard event files of the round scalars (only with run-config tensorboard = true)
    flower.log     Flower's whole log of the run: written by the launcher (:mod:`fedapp.run.console`), not here

Nothing is created until :meth:`ResultsWriter.open` (called once the run has been fully
validated); ``summary.json`` is rewritten atomically after every round.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("flwr", "torch", "opacus", "numpy", "scipy", "scikit-learn", "dp-accounting", "ray",
            "flwr-datasets", "datasets", "tensorboardX")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    from fedapp import __version__

    out["dpfl-flower"] = __version__
    return out


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (nested in dicts, lists, tuples) replaced by None, as JSON allows."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(json_safe(payload), fh, indent=2, sort_keys=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ResultsWriter:
    """Implements ``strategies.base.RoundRecorder`` for the Flower app."""

    def __init__(self, root: str | os.PathLike, config: dict[str, Any], meta: dict[str, Any] | None = None,
                 on_open: Callable[[Path], None] | None = None) -> None:
        """``on_open``: called with the new results folder once it exists (the ServerApp logs it)."""
        self.root = Path(root)
        self.on_open = on_open
        self.config = dict(config)
        self.meta = dict(meta or {})
        self.run_dir: Path | None = None
        self.rounds: list[dict[str, Any]] = []
        self.started = time.time()
        self.tensorboard: Any = None  # fedapp.state.tensorboard_log.TensorBoardWriter once a round is written

    def _new_run_dir(self) -> Path:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        prefix = f"{self.config.get('run-name')}_" if self.config.get("run-name") else ""
        dataset = re.sub(r"[^\w.-]+", "-", str(self.config.get("dataset"))).strip("-")  # hf:org/name -> hf-org-name
        base = f"{prefix}{stamp}_{self.config.get('strategy')}_{dataset}_s{self.config.get('seed')}"
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(1000):
            candidate = self.root / (base if i == 0 else f"{base}-{i}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
        raise RuntimeError(f"could not create a unique run folder under {self.root}")

    def open(self) -> None:
        if self.run_dir is not None:
            return
        self.run_dir = self._new_run_dir()
        write_json_atomic(self.run_dir / "config.json", {
            "config": self.config, "seed": self.config.get("seed"),
            "started": datetime.now(timezone.utc).isoformat(), "versions": package_versions(), **self.meta,
        })
        (self.run_dir / "rounds.jsonl").touch()
        if self.on_open is not None:
            self.on_open(self.run_dir)

    def write_round(self, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            self.open()
        assert self.run_dir is not None
        self.rounds.append(record)
        with open(self.run_dir / "rounds.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_json_atomic(self.run_dir / "summary.json", summarize(self.rounds, time.time() - self.started))
        if self.config.get("tensorboard"):
            if self.tensorboard is None:
                from fedapp.state.tensorboard_log import TensorBoardWriter

                self.tensorboard = TensorBoardWriter(self.run_dir)
            self.tensorboard.write_round(record)

    def finish(self, amend: Mapping[str, Any] | None = None) -> None:
        """The plots, then the run's final summary (``amend``: keys that replace what the rounds give)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.run_dir is None:
            return
        try:
            plot_run(self.run_dir, self.rounds, (amend or {}).get("audit"))
        finally:  # the last file written: a summary of a run that ended says so (the launcher stops on it)
            write_json_atomic(self.run_dir / "summary.json",
                              {**summarize(self.rounds, time.time() - self.started, done=True), **(amend or {})})


def run_ended(summary: Mapping[str, Any]) -> bool:
    """Whether ``summary`` (a summary.json) is the last one of a run that ended: it finished, or says why it stopped
    (:meth:`ResultsWriter.finish` writes it last)."""
    return bool(summary.get("finished") or summary.get("stopped_reason"))


def summarize(rounds: list[dict[str, Any]], wall_seconds: float, done: bool = False) -> dict[str, Any]:
    accs = [(r["round"], r["metrics"].get("accuracy")) for r in rounds if r["metrics"].get("accuracy") is not None]
    max_eps: dict[str, float] = {}
    statuses: dict[str, int] = {}
    for r in rounds:
        for c in r["clients"]:
            if c.get("audit_canary"):  # an audit canary (fedapp.privacy.audit) is not a client of the federation's
                continue
            statuses[c["status"]] = statuses.get(c["status"], 0) + 1
            cid, eps = c.get("client_id"), c.get("epsilon_spent")
            if cid is not None and eps is not None:
                max_eps[str(cid)] = max(eps, max_eps.get(str(cid), 0.0))
    best = max(accs, key=lambda t: t[1]) if accs else (None, None)
    last = rounds[-1]["metrics"] if rounds else {}
    trained = sum(1 for r in rounds if (r["metrics"].get("clients_ok") or 0) > 0)
    budget_stopped = [r["round"] for r in rounds if (r["metrics"].get("clients_ok") or 0) == 0 and _budget_round(r)]
    unsampled = [r["round"] for r in rounds if (r["metrics"].get("clients_ok") or 0) == 0 and _unsampled_round(r)
                 and r["round"] not in budget_stopped]
    untrained = [r["round"] for r in rounds if (r["metrics"].get("clients_ok") or 0) == 0
                 and r["round"] not in budget_stopped and r["round"] not in unsampled]
    individual = [r["metrics"]["epsilon_individual"] for r in rounds if r["metrics"].get("epsilon_individual") is not None]
    out_of_model = {}
    if individual:  # client-level: the aggregate ε needs secure aggregation; this one does not
        out_of_model["max_epsilon_individual_update"] = max(individual)
    vs_server = [c["epsilon_vs_server"] for r in rounds for c in r["clients"] if c.get("epsilon_vs_server") is not None]
    vs_release = [r["metrics"]["epsilon_vs_release"] for r in rounds if r["metrics"].get("epsilon_vs_release") is not None]
    if vs_server:  # client-level: against the server that draws the sample (no amplification)
        out_of_model["max_epsilon_vs_server"] = max(vs_server)
    proven = [r["metrics"]["epsilon_vs_server_proven"] for r in rounds if "epsilon_vs_server_proven" in r["metrics"]]
    if proven:  # under SecAgg+: False when a rounded continuous Gaussian sum carried any round
        out_of_model["epsilon_vs_server_proven"] = all(proven)
        caveat = next((r["metrics"].get("epsilon_vs_server_caveat") for r in rounds
                       if r["metrics"].get("epsilon_vs_server_caveat")), None)
        if caveat:
            out_of_model["epsilon_vs_server_caveat"] = caveat
    if vs_release:  # client-level: against whoever sees only the released models
        out_of_model["max_epsilon_vs_release"] = max(vs_release)
    for key in ("delta_total", "delta_vs_release"):  # an amplified secure sum's δ, with its minimum cohort's share
        values = [r["metrics"][key] for r in rounds if r["metrics"].get(key) is not None]
        if values:
            out_of_model[key] = max(values)
    return {
        "rounds_completed": len(rounds), "rounds_trained": trained,
        "rounds_untrained": untrained, "rounds_refused_by_budget": budget_stopped, "rounds_unsampled": unsampled,
        # a run "finishes" when it ran all its rounds, at least one aggregated an update, and every round that
        # neither a budget refused nor Poisson sampling left with fewer than 2 clients trained
        "finished": bool(done and trained > 0 and not untrained),
        "stopped_reason": _stopped_reason(done, trained, untrained, budget_stopped, len(rounds), unsampled),
        "evaluation": _evaluation(rounds),
        "final_accuracy": last.get("accuracy"), "final_loss": last.get("loss"),
        "final_client_accuracy": last.get("client_accuracy"),
        "final_client_val_accuracy": last.get("client_val_accuracy"),
        "final_client_val_loss": last.get("client_val_loss"),
        # SoteriaFL's own axes (Sec. 6): f(x_T) on the training data and the running mean of ‖∇f(x_t)‖²
        **({"final_train_loss": last["train_loss"], "final_utility": last.get("grad_norm_sq_avg")}
           if last.get("train_loss") is not None else {}),
        "best_accuracy": best[1], "best_round": best[0],
        "max_epsilon_per_client": dict(sorted(max_eps.items(), key=lambda kv: int(kv[0]))),
        "max_epsilon": max(max_eps.values()) if max_eps else None,
        "total_uplink_bytes": int(sum(c.get("uplink_bytes") or 0 for r in rounds for c in r["clients"])),
        "client_status_counts": statuses,
        "wall_seconds": wall_seconds,
        **out_of_model,
    }


def _evaluation(rounds: list[dict[str, Any]]) -> str:
    """How the run measured its model: on the server's held-out test set, or only on the clients' local test splits
    (node-local data and the personalized DP2-FedSAM variants have no central test set)."""
    if any("accuracy" in r["metrics"] for r in rounds):
        return "centralized (the server's held-out test set: final_accuracy) and federated (final_client_accuracy)"
    if any("client_accuracy" in r["metrics"] for r in rounds):
        return "federated only, no central test set: final_client_accuracy is the mean over clients of their local " \
               "test accuracy"
    return "none"


def plot_run(run_dir: Path, rounds: list[dict[str, Any]], audit: Mapping[str, Any] | None = None) -> None:
    """accuracy.png and privacy.png from the round records (and the audit's estimates, when the run had canaries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("accuracy", "global model, held-out test"), ("client_accuracy", "mean client local test")):
        ys = [r["metrics"].get(key) for r in rounds]
        if any(y is not None for y in ys):
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=120)
    plt.close(fig)

    per_client: dict[int, list[tuple[int, float]]] = {}
    budgets: dict[int, float] = {}
    refusals: dict[int, list[tuple[int, float]]] = {}
    for r in rounds:
        for c in r["clients"]:
            if c.get("client_id") is not None and c.get("epsilon_spent") is not None and not c.get("audit_canary"):
                cid = int(c["client_id"])
                per_client.setdefault(cid, []).append((r["round"], c["epsilon_spent"]))
                if c.get("epsilon_budget") is not None:
                    budgets[cid] = float(c["epsilon_budget"])
                if c.get("status") in ("refused", "withheld"):
                    refusals.setdefault(cid, []).append((r["round"], c["epsilon_spent"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for cid, pts in sorted(per_client.items()):
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"client {cid}")
        if cid in budgets:  # each client's budget ε_i in its own colour, dashed
            ax.axhline(budgets[cid], color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.7)
        if cid in refusals:
            ax.plot([p[0] for p in refusals[cid]], [p[1] for p in refusals[cid]], "x", color=line.get_color(),
                    markersize=8)
    keys: list[Any] = []  # legend entries explaining the markers, shown even when there are too many clients to list
    if audit and rounds:  # the audit's estimates at the last round, with their intervals (fedapp.privacy.audit)
        last = rounds[-1]["round"]
        for offset, (name, marker) in enumerate((("final_model", "D"), ("all_iterates", "s"))):
            est = audit.get(name) or {}
            if est.get("epsilon_estimate") is not None:
                low, high = est["epsilon_interval"]  # a percentile interval need not contain the point estimate
                point = est["epsilon_estimate"]
                keys.append(ax.errorbar([last + 0.15 * (offset + 1)], [point],
                                        yerr=[[max(point - low, 0.0)], [max(high - point, 0.0)]],
                                        fmt=marker, color="k", capsize=3, label=f"audit estimate ({name})"))
            if est.get("epsilon_lower_bound") is not None:  # a record-level audit's one-run bound (95 %)
                keys += ax.plot([last + 0.15 * (offset + 1)], [est["epsilon_lower_bound"]], "^", color="tab:red",
                                label=f"audit lower bound ({name})")
        if audit.get("epsilon_accountant") is not None:
            who = "largest ε_i of the canaries' clients" if audit.get("level") == "record" else "release"
            keys.append(ax.axhline(audit["epsilon_accountant"], color="k", linestyle=":", linewidth=1,
                                   label=f"accountant ε ({who})"))
    if refusals:
        keys += ax.plot([], [], "kx", label="refused / withheld")
    if budgets:
        keys += ax.plot([], [], "k--", linewidth=0.8, label="budget ε_i")
    ax.set_xlabel("round")
    ax.set_ylabel("ε spent (cumulative)")
    if not per_client:
        ax.text(0.5, 0.5, "no privacy accounting (non-private run)", ha="center", va="center", transform=ax.transAxes)
    elif len(per_client) <= 20 and not audit:
        ax.legend(fontsize=6, ncol=2)
    elif keys:
        ax.legend(handles=keys, fontsize=7, loc="upper left")  # "best" scans every line: slow for 1,000s
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "privacy.png", dpi=120)
    plt.close(fig)


def _budget_round(record: dict[str, Any]) -> bool:
    """A round a privacy budget refused: nobody was sampled for it, or every client refused for its budget."""
    if record["metrics"].get("budget_exhausted"):
        return True
    clients = record["clients"]
    return bool(clients) and all(c.get("status") == "refused" and str(c.get("reason") or "").startswith("budget")
                                 for c in clients)


def _unsampled_round(record: dict[str, Any]) -> bool:
    """A round whose Poisson sample had too few clients to run (none or one; under SecAgg+ fewer than a secure sum is
    ever unmasked for, ``below_secure_minimum``): nothing was sent, nothing released, by the sampling design rather
    than by a failure."""
    sampled = record["metrics"].get("clients_sampled")
    if record["clients"] or sampled is None:
        return False
    return int(sampled) < 2 or bool(record["metrics"].get("below_secure_minimum"))


def _stopped_reason(done: bool, trained: int, untrained: list[int], budget_stopped: list[int],
                    completed: int, unsampled: list[int] | None = None) -> str | None:
    """Why a run that ran all its rounds did not train in every one (None when it did)."""
    if not done:
        return None
    if not trained:
        return "no client update was aggregated in any round"
    reasons = []
    if untrained:
        reasons.append(f"{len(untrained)} of {completed} rounds aggregated no client update (rounds {_rounds(untrained)})")
    if budget_stopped:
        reasons.append(f"the privacy budget refused {len(budget_stopped)} of {completed} rounds "
                       f"(rounds {_rounds(budget_stopped)})")
    if unsampled:
        reasons.append(f"client sampling drew too few clients to run {len(unsampled)} of {completed} rounds "
                       f"(rounds {_rounds(unsampled)})")
    return "; ".join(reasons) or None


def _rounds(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:10])) + (", ..." if len(numbers) > 10 else "")
