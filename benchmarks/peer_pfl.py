"""Side by side with Apple's pfl-research: this project's ``dp-fedavg`` vs pfl's
FederatedAveraging + central Gaussian mechanism on the same MNIST task, in wall time and memory.

    .venv/bin/python -m benchmarks.peer_pfl [--rounds 30] [--repeats 3] [--pfl-python /work/pfl-venv/bin/python]
    .venv/bin/python -m benchmarks.peer_pfl --side ours --secure-aggregation off on [--clients-per-round 10]

1. Exports the shared inputs once to a temporary folder, through this project's own code: the MNIST
   training pool and test set (``fedapp.data.datasets``), every client's training indices for 20 clients from the
   run's partitioner (``fedapp.data.client_data`` / ``fedapp.data.partition``), the Table-5 CNN's initial weights
   for the run's seed (``fedapp.clients.common.make_model``, what the ServerApp starts from) and the
   settings.
2. Runs ``dp-fedavg`` through the real launcher (``python -m fedapp.run.launch``: SuperLink, ``flwr run``,
   Ray simulation) with σ = 1, C = 1, b = 32, 1 local epoch, Poisson sampling of 10 of 20 clients per
   round, central evaluation every round, no federated evaluation. ``secure-aggregation = false``:
   pfl's central Gaussian mechanism trusts the server with every update, so the comparison is with
   the trusted-server setting (each client adds N(0, σ²C²/r), the sum of r updates carries σC).
3. Runs ``benchmarks/pfl_side.py`` in pfl's own virtual environment on the exported inputs.
4. Measures each run from outside: wall time of the whole command, per-round times (``rounds.jsonl``;
   pfl: a timer callback), start-up and teardown (the command's output lines that begin round 1 and end the
   last round, stamped as they arrive: :class:`Phases`), and the peak of the PSS summed over the process tree
   (every descendant, also ones re-parented after they were seen), sampled every ``--interval`` seconds.

Runs alternate (ours, pfl, then pfl, ours, ...); every ratio (ours ÷ pfl) is measured within one run
of this script. Skips with a message (exit 0) when the pfl environment is absent. Set up pfl with

    python3 -m venv /work/pfl-venv
    /work/pfl-venv/bin/pip install "torch==2.13.0"          # the CPU wheel first, never a CUDA torch
    /work/pfl-venv/bin/pip install "pfl[pytorch]==0.6.0"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = (REPO.parent / "shared" / "data").resolve()
PFL_PYTHON = Path(os.environ.get("PFL_PYTHON", str(REPO.parent / "pfl-venv" / "bin" / "python")))
PFL_SIDE = REPO / "benchmarks" / "pfl_side.py"
PFL_PLAIN = REPO / "benchmarks" / "pfl_plain.py"  # the control: pfl written the plain way
#: pfl script (--pfl-scripts) -> the report's label of its runs; side-cl: the peer with channels-last weights
PFL_LABELS = {"side": "pfl", "plain": "pfl/plain", "side-cl": "pfl/channels-last"}
NUM_CLIENTS = 20
TARGET_WALL_RATIO = 1.0
TARGET_PEAK_GB = 1.5
TARGET_SECAGG_RATIO = 1.15  # a SecAgg+ round over the same round without it
QUIET_LOAD = 1.0  # 1-minute load average above which a machine is not quiet enough to time on
#: output lines that split a run's time outside its rounds into start-up (launch → round 1 begins) and teardown
#: (last round ended → exit): (round 1 begins, a round ended) per side. Ours: Flower's ``[ROUND 1]`` and the
#: server's ``[round t/T]`` summary, relayed by the launcher from the ServerApp's log (a 0.1 s poll); pfl:
#: ``RoundTimer``'s lines in benchmarks/pfl_side.py (``TRAIN_BEGINS``, ``ROUND_ENDED``)
OUR_MARKS = (re.compile(r"\[ROUND 1\]"), re.compile(r"\[round \d+/\d+\]"))
PFL_MARKS = (re.compile(r"^\[pfl_side\] round 1 begins"), re.compile(r"^\[pfl_side\] round ended:"))


def settle(limit_s: float = 150.0) -> float:
    """Wait (up to ``limit_s``) for the 1-minute load average to fall below ``QUIET_LOAD`` — back-to-back
    runs otherwise start under the previous run's own load (the average decays with a 1-minute time
    constant) — and return it."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]


# --------------------------------------------------------------------------- settings and shared inputs
def run_overrides(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """The run-config of this project's side (everything else: pyproject.toml defaults)."""
    return {
        "strategy": "dp-fedavg", "dataset": "mnist", "data-dir": str(args.data_dir), "model": "cnn-mnist",
        "partitioner": args.partitioner, "seed": args.seed, "num-server-rounds": args.rounds,
        "noise-multiplier": 1.0, "clip-norm": 1.0, "batch-size": 32, "local-epochs": 1, "lr": args.lr,
        "momentum": 0.0, "server-lr": 1.0, "clients-per-round": args.clients_per_round,
        "secure-aggregation": False,  # pfl's central mechanism is a trusted-server mechanism
        "fraction-evaluate": 0.0,  # no federated evaluation; the server evaluates centrally every round
        "local-test-fraction": 0.0,  # every client trains on its whole partition (no local test split needed)
        "eval-batch-size": 512, "output-dir": str(output_dir), "run-name": "peer-pfl",
        # client sampling from the run seed: every run of our side trains the same cohorts, so runs with and without
        # SecAgg+ do the same work (timing only; seeded noise carries no privacy guarantee)
        "seeded-noise": True,
    }


def export_inputs(folder: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """Write the data, partition, initial weights and settings both sides train on; returns the settings."""
    from fedapp.clients.common import make_model
    from fedapp.config import resolve_config
    from fedapp.data.client_data import client_partition_indices, training_pool
    from fedapp.data.datasets import load_dataset
    from fedapp.data.partition import train_test_split_local
    from fedapp.run.processes import pyproject_run_config

    cfg = resolve_config({**pyproject_run_config(REPO), **overrides, "num-clients": NUM_CLIENTS})
    pool = training_pool(cfg.data, cfg.general.seed)
    _, test = load_dataset(cfg["dataset"], cfg["data-dir"])
    seed, frac = int(cfg["seed"]), float(cfg["local-test-fraction"])
    parts = client_partition_indices(cfg.data, cfg.general.seed, NUM_CLIENTS)
    train_idx = {f"client_{i}": train_test_split_local(p, frac, seed, i)[0] for i, p in enumerate(parts)}
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "train_x.npy", pool.x)
    np.save(folder / "train_y.npy", pool.y)
    np.save(folder / "test_x.npy", test.x)
    np.save(folder / "test_y.npy", test.y)
    np.savez(folder / "clients.npz", **train_idx)
    model = make_model(cfg.model_spec, test)
    np.savez(folder / "init_weights.npz", **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    settings = {
        "num_clients": NUM_CLIENTS, "clients_per_round": int(cfg["clients-per-round"]),
        "rounds": int(cfg["num-server-rounds"]), "seed": seed, "lr": float(cfg["lr"]),
        "batch_size": int(cfg["batch-size"]), "local_epochs": int(cfg["local-epochs"]),
        "clip_norm": float(cfg["clip-norm"]), "noise_multiplier": float(cfg["noise-multiplier"]),
        "server_lr": float(cfg["server-lr"]), "eval_batch_size": int(cfg["eval-batch-size"]),
        "partitioner": cfg["partitioner"], "client_sizes": [len(v) for v in train_idx.values()],
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "cohort_sizes": our_cohort_sizes(cfg),
    }
    (folder / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    return settings


def our_cohort_sizes(cfg: Any, n: int = NUM_CLIENTS) -> list[int]:
    """The number of clients our server samples in rounds 1..T of this run: its own sampler
    (``strategies.server.sampling``), seeded from the run seed (``seeded-noise``) at the client-level rate
    q = r/n, over the n registered clients. pfl's ``paired`` side trains cohorts of these sizes; the report
    checks them against what our run's ``rounds.jsonl`` says it sampled."""
    from strategies.server.sampling import ClientSampler

    r = int(cfg["clients-per-round"])
    sampler = ClientSampler(r, "poisson", int(cfg["seed"]))
    sampler.fix_rate(r / n)
    return [len(sampler.sample(t, list(range(n)))) for t in range(1, int(cfg["num-server-rounds"]) + 1)]


def check_config(overrides: dict[str, Any], secure_aggregation: bool) -> None:
    """``python -m fedapp.run.launch --plan`` on our side's run-config: every check of a launch, nothing started.
    Its dry run passes and is remembered (``fedapp.run.dry_run_cache``), so the timed runs start as a second run
    of the same configuration does, as they already find the data cache warm."""
    from fedapp.run.processes import to_toml_assignments

    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", str(NUM_CLIENTS), "--plan", "--run-config",
           to_toml_assignments({**overrides, "secure-aggregation": secure_aggregation})]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"our run-config does not pass the launcher's checks: {done.stderr[-2000:]}")


# --------------------------------------------------------------------------- measurement
@dataclass
class TreeSample:
    """Peak summed PSS of a process tree, its per-process split at the peak, and sampled CPU seconds."""

    peak_bytes: int = 0
    peak_split: list[tuple[str, int]] = field(default_factory=list)
    cpu_seconds: float = 0.0
    processes: int = 0


class TreeSampler:
    """Samples the PSS of ``pid`` and every descendant every ``interval`` seconds in a thread.

    Descendants are remembered once seen, so a process re-parented to init (a daemonized Ray helper)
    still counts; PSS splits shared pages among the processes mapping them, so the sum is not inflated
    by shared libraries or Ray's shared-memory object store. CPU seconds are the last sampled user +
    system time of every process (a process that ends between two samples loses up to ``interval``).
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.seen: dict[int, Any] = {pid: self.root}
        self.cpu: dict[int, float] = {}
        self.result = TreeSample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.result.cpu_seconds = sum(self.cpu.values())
        self.result.processes = len(self.seen)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        import psutil

        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:
            pass
        total, split = 0, []
        for pid, proc in list(self.seen.items()):
            try:
                with proc.oneshot():
                    pss = proc.memory_full_info().pss
                    times = proc.cpu_times()
                    name = proc.name()
            except psutil.Error:  # ended (or a reused pid, which psutil refuses)
                continue
            self.cpu[pid] = times.user + times.system
            total += pss
            split.append((f"{name}[{pid}]", pss))
        if total > self.result.peak_bytes:
            self.result.peak_bytes, self.result.peak_split = total, sorted(split, key=lambda t: -t[1])


@dataclass
class Phases:
    """When, in seconds after the launch, round 1 began (first line matching ``begin``) and the last round ended
    (last line matching ``end``); None where no line matched."""

    begin: re.Pattern[str]
    end: re.Pattern[str]
    round1_begins: float | None = None
    last_round_ended: float | None = None

    def copy(self, stream: Any, out: Any, t0: float) -> None:
        """Copy ``stream``'s lines to ``out`` as they come, stamping the marker lines."""
        for line in iter(stream.readline, ""):
            now = time.perf_counter() - t0
            try:
                out.write(line)
            except ValueError:  # the log was closed: a descendant kept the pipe open past the run's end
                return
            if self.round1_begins is None and self.begin.search(line):
                self.round1_begins = now
            if self.end.search(line):
                self.last_round_ended = now
        out.flush()

    def split(self, wall: float) -> dict[str, float | None]:
        """``start_up``: launch → round 1 begins; ``teardown``: last round ended → exit."""
        return {"start_up": self.round1_begins,
                "teardown": None if self.last_round_ended is None else wall - self.last_round_ended}


def run_measured(cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path, interval: float,
                 timeout: float | None, phases: Phases | None = None) -> tuple[int, float, TreeSample]:
    """Run ``cmd`` (output to ``log``, its marker lines stamped into ``phases``) while sampling its process tree;
    (exit code, wall seconds, sample). ``timeout=None`` waits as long as it takes."""
    with open(log, "w", encoding="utf-8") as out:
        t0 = time.perf_counter()
        copier = None
        proc: subprocess.Popen[Any]
        if phases is None:
            proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=out, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            copier = threading.Thread(target=phases.copy, args=(proc.stdout, out, t0), daemon=True)
            copier.start()
        try:
            with TreeSampler(proc.pid, interval) as sampler:
                code = proc.wait(timeout=timeout)
            wall = time.perf_counter() - t0
            if copier is not None:
                copier.join(timeout=5)  # the output's end: every descendant holding the pipe has exited
        finally:
            if proc.poll() is None:  # interrupted or timed out: the launcher stops its SuperLink on SIGTERM
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return code, wall, sampler.result


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def round_stats(walls: list[float]) -> dict[str, float]:
    """Round 1, the median of the steady rounds (2..T) and the sum of all rounds, in seconds."""
    steady = walls[1:] or walls
    return {"round1": walls[0] if walls else float("nan"), "steady_median": statistics.median(steady) if steady
            else float("nan"), "rounds_sum": float(sum(walls))}


#: where a steady round goes (:func:`round_parts`, :func:`pfl_round_parts`), in the report's order
ROUND_PARTS = ("training", "messaging", "aggregation", "evaluation", "rest", "round", "train_work")


def lanes_makespan(seconds: list[float], lanes: int) -> float:
    """The wall share of a round's local trainings run ``lanes`` at a time: longest first, each on the lane that
    frees first (the clients' order inside a round is not recorded; with equal clients any order gives this)."""
    loads = [0.0] * max(1, lanes)
    for s in sorted(seconds, reverse=True):
        loads[loads.index(min(loads))] += s
    return max(loads)


def round_parts(record: dict[str, Any], lanes: int) -> dict[str, float | None] | None:
    """One of our ``rounds.jsonl`` records split into :data:`ROUND_PARTS` (seconds), or None without its timings.

    ``training``: the clients' local-training loops (``train_seconds``) packed on the ``lanes`` actors
    (:func:`lanes_makespan`); ``messaging``: the rest of the server's fit phase (``seconds.fit``: the messages,
    SecAgg+'s stages and the clients' work outside their loops); ``aggregation``: ``seconds.aggregate``;
    ``evaluation``: ``seconds.evaluate``; ``rest``: the round's wall time less the three phases (sampling, the fit
    configuration, the record); ``train_work``: the loops' sum over the clients."""
    seconds = record.get("seconds") or {}
    train = [float(c["train_seconds"]) for c in record.get("clients", []) if c.get("train_seconds") is not None]
    if not {"fit", "aggregate", "evaluate"} <= set(seconds) or not train:
        return None
    training, wall = lanes_makespan(train, lanes), float(record["wall_seconds"])
    return {"training": training, "messaging": seconds["fit"] - training, "aggregation": seconds["aggregate"],
            "evaluation": seconds["evaluate"], "rest": wall - seconds["fit"] - seconds["aggregate"] - seconds["evaluate"],
            "round": wall, "train_work": float(sum(train))}


def pfl_round_parts(record: dict[str, Any]) -> dict[str, float | None] | None:
    """One of ``pfl_side.py``'s round records split into :data:`ROUND_PARTS`, or None without its timings: pfl trains
    its users one after another in one process (``training`` = their sum), has no messages, and its aggregation
    (with the noise, the cohort's sampling and its user datasets) falls in ``rest``."""
    if record.get("train_seconds") is None or record.get("evaluate_seconds") is None:
        return None
    training, wall = float(sum(record["train_seconds"])), float(record["wall_seconds"])
    return {"training": training, "messaging": None, "aggregation": None, "evaluation": float(record["evaluate_seconds"]),
            "rest": wall - training - float(record["evaluate_seconds"]), "round": wall, "train_work": training}


def steady_parts(parts: list[dict[str, float | None] | None]) -> dict[str, float | None] | None:
    """The mean of each part over the steady rounds (2..T; every round of a 1-round run): the parts add up to the
    mean steady round. None when a round lacks its split."""
    steady = parts[1:] or parts
    if not steady or any(p is None for p in steady):
        return None
    out: dict[str, float | None] = {}
    for key in ROUND_PARTS:
        values = [p[key] for p in steady if p is not None]
        out[key] = None if any(v is None for v in values) else statistics.fmean(float(v) for v in values if v is not None)
    return out


def run_ours(overrides: dict[str, Any], work: Path, tag: str, args: argparse.Namespace,
             engine: str = "superlink", num_cpus: float = 1.0, secure_aggregation: bool = False,
             wakeups: bool = True, client_backend: str = "ray") -> dict[str, Any]:
    """This project's side through ``python -m fedapp.run.launch --engine ENGINE --num-cpus NUM_CPUS
    --client-backend CLIENT_BACKEND`` (with ``secure_aggregation``: SecAgg+ and the default secure-sum mechanism;
    without ``wakeups``: ``DPFL_WAKEUPS=off``); its record."""
    from fedapp.run.processes import to_toml_assignments

    overrides = {**overrides, "secure-aggregation": secure_aggregation}
    out_dir = Path(overrides["output-dir"])
    before = {p for p in out_dir.glob("*") if p.is_dir()} if out_dir.exists() else set()
    env = os.environ.copy()
    env.update({"FLWR_HOME": str(work / ".flwr"), "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    if not wakeups:
        env["DPFL_WAKEUPS"] = "off"  # fedapp.compat.wakeups.SWITCH
    # --verbose: the phases and the initial evaluation are read from Flower's log lines in the launcher's output
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", str(NUM_CLIENTS), "--verbose",
           "--num-cpus", str(num_cpus), "--engine", engine, "--client-backend", client_backend, "--run-config",
           to_toml_assignments(overrides)]
    log = work / (f"ours-{engine}-cpus{num_cpus:g}{'' if wakeups else '-polls'}{'-secagg' if secure_aggregation else ''}"
                  f"-{client_backend}-{tag}.log")
    phases = Phases(*OUR_MARKS)
    code, wall, mem = run_measured(cmd, env=env, cwd=REPO, log=log, interval=args.interval, timeout=args.timeout,
                                   phases=phases)
    if code != 0:
        raise RuntimeError(f"our run failed (exit {code}); log {log}:\n{_tail(log)}")
    new = sorted((p for p in out_dir.glob("*") if p.is_dir() and p not in before and (p / "summary.json").exists()),
                 key=lambda p: p.stat().st_mtime)
    if not new:
        raise RuntimeError(f"our run wrote no results folder under {out_dir}; log {log}")
    rounds = [json.loads(line) for line in (new[-1] / "rounds.jsonl").read_text(encoding="utf-8").splitlines() if line]
    rounds = [r for r in rounds if int(r.get("round", 0)) >= 1]
    summary = json.loads((new[-1] / "summary.json").read_text(encoding="utf-8"))
    initial = re.search(r"initial parameters \(loss, other metrics\): ([-\d.eE+]+), \{'accuracy': ([-\d.eE+]+)\}",
                        log.read_text(encoding="utf-8", errors="replace"))
    walls = [float(r["wall_seconds"]) for r in rounds]
    sampled = [r["metrics"].get("clients_sampled", r["metrics"].get("clients_ok")) for r in rounds]
    lanes = max(1, int((os.cpu_count() or 1) / num_cpus))  # Flower's Ray backend: ⌊CPUs / CPUs a client⌋ actors
    return {"side": our_side(engine, num_cpus, secure_aggregation, wakeups, client_backend), "tag": tag, "wall": wall, **round_stats(walls), "round_walls": walls,
            "lanes": lanes, "parts": steady_parts([round_parts(r, lanes) for r in rounds]),
            "peak_bytes": mem.peak_bytes, "peak_split": mem.peak_split, "cpu_seconds": mem.cpu_seconds,
            "processes": mem.processes, "final_accuracy": summary.get("final_accuracy"),
            "rounds": len(rounds), "mean_clients": float(np.mean([s for s in sampled if s is not None] or [np.nan])),
            "cohort_sizes": [None if s is None else int(s) for s in sampled],
            "initial": {"loss": float(initial.group(1)), "accuracy": float(initial.group(2))} if initial else {},
            "results": str(new[-1]), "log": str(log), **phases.split(wall)}


def run_pfl(inputs: Path, work: Path, tag: str, args: argparse.Namespace, seed: int | None,
            script: str = "side") -> dict[str, Any]:
    """pfl's side: ``benchmarks/pfl_side.py`` (``script = "side"``, labelled ``pfl``) or the plain control
    ``benchmarks/pfl_plain.py`` (``"plain"``, labelled ``pfl/plain``) in the pfl environment; its record."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of this repo
    env["PYTHONUNBUFFERED"] = "1"
    out = work / f"pfl-{script}-{tag}.json"
    if script in ("side", "side-cl"):
        cmd = [str(args.pfl_python), str(PFL_SIDE), "--inputs", str(inputs), "--out", str(out),
               "--sampling", args.pfl_sampling] + (["--channels-last"] if script == "side-cl" else [])
    else:
        cmd = [str(args.pfl_python), str(PFL_PLAIN), "--inputs", str(inputs), "--out", str(out)]
    cmd += [] if seed is None else ["--seed", str(seed)]
    log = work / f"pfl-{script}-{tag}.log"
    phases = Phases(*PFL_MARKS)
    code, wall, mem = run_measured(cmd, env=env, cwd=work, log=log, interval=args.interval, timeout=args.timeout,
                                   phases=phases)
    if code != 0 or not out.exists():
        raise RuntimeError(f"the pfl run failed (exit {code}); log {log}:\n{_tail(log)}")
    res = json.loads(out.read_text(encoding="utf-8"))
    walls = [float(r["wall_seconds"]) for r in res["rounds"]]
    clients = [r["clients"] for r in res["rounds"] if r.get("clients") is not None]
    return {"side": PFL_LABELS[script], "tag": tag, "wall": wall, **round_stats(walls),
            "round_walls": walls, "lanes": 1, "parts": steady_parts([pfl_round_parts(r) for r in res["rounds"]]),
            "peak_bytes": mem.peak_bytes, "peak_split": mem.peak_split, "cpu_seconds": mem.cpu_seconds,
            "processes": mem.processes, "final_accuracy": res.get("final_accuracy"), "rounds": len(walls),
            "mean_clients": float(np.mean(clients)) if clients else float("nan"),
            "cohort_sizes": [None if r.get("clients") is None else int(r["clients"]) for r in res["rounds"]],
            "versions": {"pfl": res.get("pfl_version"), "torch": res.get("torch_version"),
                         "torch_threads": res.get("torch_threads")},
            "initial": res.get("initial") or {}, "log": str(log), **phases.split(wall)}


def pfl_available(python: Path) -> str | None:
    """``"pfl X, torch Y"`` when ``python`` imports pfl, else None."""
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import pfl, torch; print(f'pfl {pfl.__version__}, torch {torch.__version__}')"],
                           capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    return probe.stdout.strip() if probe.returncode == 0 else None


# --------------------------------------------------------------------------- report
def our_side(engine: str, num_cpus: float = 1.0, secure_aggregation: bool = False, wakeups: bool = True,
             client_backend: str = "ray") -> str:
    """The report's label of this project's side on ``engine`` with ``num_cpus`` per client, ``/threads`` with the
    ClientApps on the engine's threads (``--client-backend threads``), ``/polls`` with Flower's 0.1 s message polls
    (``DPFL_WAKEUPS=off``), ``/secagg`` with SecAgg+ (plain ``ours``: the launcher's defaults, SuperLink engine, Ray
    actors and one CPU per client, no SecAgg+)."""
    label = "ours" if engine == "superlink" else f"ours/{engine}"
    label = label if client_backend == "ray" else f"{label}/{client_backend}"
    label = label if num_cpus == 1.0 else f"{label}/cpus={num_cpus:g}"
    label = label if wakeups else f"{label}/polls"
    return f"{label}/secagg" if secure_aggregation else label


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def report(runs: list[dict[str, Any]], settings: dict[str, Any], show_split: bool) -> list[str]:
    """Markdown: one row per run, medians per side, ratios ours ÷ pfl and the issue's targets."""
    rows = ["| run | wall | rounds Σ | outside rounds (start-up + teardown) | round 1 | steady round (median 2..T) | "
            "peak PSS Σ | CPU s (sampled) | clients/round | final acc |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['side']} #{r['tag']} | {r['wall']:.1f} s | {r['rounds_sum']:.1f} s | "
                    f"{r['wall'] - r['rounds_sum']:.1f} s{_phases_cell(r)} | {r['round1']:.2f} s | "
                    f"{r['steady_median']:.2f} s | "
                    f"{r['peak_bytes'] / 1e9:.2f} GB | {r['cpu_seconds']:.0f} | {r['mean_clients']:.1f} | "
                    f"{r['final_accuracy'] if r['final_accuracy'] is None else format(r['final_accuracy'], '.4f')} |")
    pfl = [r for r in runs if r["side"] == "pfl"]
    busiest = max((r.get("load_before", 0.0) for r in runs), default=0.0)
    out = rows
    pfl_cl = [r for r in runs if r["side"] == PFL_LABELS["side-cl"]]
    for label in dict.fromkeys(r["side"] for r in runs if not r["side"].startswith("pfl")):
        out += _versus_pfl([r for r in runs if r["side"] == label], pfl, label, busiest)
        out += _versus_pfl([r for r in runs if r["side"] == label], pfl_cl, label, busiest, PFL_LABELS["side-cl"])
    out += _parts_table(runs)
    out += _cohort_check(runs, settings)
    out += _secagg_cost(runs)
    out += _wakeup_gain(runs)
    out += _side_vs_plain(runs)
    if busiest > QUIET_LOAD:
        out.append(f"\nWARNING: the load average was up to {busiest:.1f} before a run (2 cores): the machine was not "
                   "quiet, so these times and ratios say nothing about the targets; rerun on a quiet machine.")
    starts = {f"{r['side']} #{r['tag']}": r.get("initial", {}) for r in runs}
    if any(starts.values()):
        out.append("\nInitial model on the test set (same weights and data give the same numbers): " + "; ".join(
            f"{k} loss {v['loss']:.4f} acc {v['accuracy']:.4f}" for k, v in starts.items() if v))
    if show_split:
        for r in runs:
            top = ", ".join(f"{name} {pss / 1e6:.0f} MB" for name, pss in r["peak_split"][:12])
            out.append(f"\npeak split, {r['side']} #{r['tag']} ({r['processes']} processes seen): {top}")
    out.append(f"\nTask: MNIST, {settings['num_clients']} clients ({settings['partitioner']}, sizes "
               f"{min(settings['client_sizes'])}–{max(settings['client_sizes'])}), Table-5 CNN "
               f"({settings['num_parameters']:,} parameters), {settings['clients_per_round']} clients per round "
               f"(expected), σ = {settings['noise_multiplier']}, C = {settings['clip_norm']}, b = "
               f"{settings['batch_size']}, {settings['local_epochs']} local epoch, lr {settings['lr']}, "
               f"{settings['rounds']} rounds.")
    return out


PART_ROWS = {
    "training": "local training, on the side's lanes",
    "messaging": "messages, SecAgg+ stages, client work outside the loop",
    "aggregation": "aggregation (admission, accounting, decoding)",
    "evaluation": "central evaluation",
    "rest": "rest",
    "round": "round",
    "train_work": "local training, summed over clients",
}


def _parts_table(runs: list[dict[str, Any]]) -> list[str]:
    """Where a steady round goes, per side: the mean of each part over rounds 2..T, median over the side's runs
    (sides whose every run has the split)."""
    sides = [label for label in dict.fromkeys(r["side"] for r in runs)
             if all(r.get("parts") for r in runs if r["side"] == label)]
    if not sides:
        return []

    def cell(label: str, key: str) -> str:
        values = [r["parts"][key] for r in runs if r["side"] == label]
        return "–" if any(v is None for v in values) else f"{statistics.median(values):.2f} s"

    lanes = {label: next(r["lanes"] for r in runs if r["side"] == label) for label in sides}
    out = ["", "Where a steady round goes (each part's mean over rounds 2..T, median over the side's runs; the first "
           "five parts add up to the round):", "", "| part | " + " | ".join(f"{s} ({lanes[s]} lane{'s' if lanes[s] > 1 else ''})"
                                                                  for s in sides) + " |",
           "|---|" + "---|" * len(sides)]
    out += [f"| {name} | " + " | ".join(cell(s, key) for s in sides) + " |" for key, name in PART_ROWS.items()]
    out.append("\nOurs: training = the clients' local-training loops packed on the actors, longest first; messages = "
               "the server's fit phase less that; rest = sampling, the fit configuration and the round record. pfl: its "
               "users train one after another in one process; its aggregation, noise, sampling and user datasets are "
               "in rest.")
    return out


def _phases_cell(run: dict[str, Any]) -> str:
    """`` (start-up + teardown)`` of a run whose marker lines were seen (:class:`Phases`), else empty."""
    if run.get("start_up") is None or run.get("teardown") is None:
        return ""
    return f" ({run['start_up']:.1f} + {run['teardown']:.1f})"


def _phase_rows(ours: list[dict[str, Any]], pfl: list[dict[str, Any]]) -> list[str]:
    """Median start-up (launch → round 1 begins) and teardown (last round ended → exit) rows, where every run has
    them."""
    rows = []
    for key, name in (("start_up", "start-up (launch → round 1)"), ("teardown", "teardown (last round → exit)")):
        if all(r.get(key) is not None for r in ours + pfl):
            a, b = _med(ours, key), _med(pfl, key)
            rows.append(f"| {name} | {a:.1f} s | {b:.1f} s | {a / b:.2f}× |" if b > 0 else
                        f"| {name} | {a:.1f} s | {b:.1f} s | – |")
    return rows


def _cohort_check(runs: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """Whether every run trained cohorts of the sizes our sampler draws for the run seed, round by round."""
    planned = list(settings.get("cohort_sizes") or [])
    differ = [f"{r['side']} #{r['tag']}" for r in runs if r.get("cohort_sizes") != planned]
    if not planned:
        return []
    if not differ:
        return ["", f"Cohorts: every run trained the same number of clients in each round as the others "
                f"({', '.join(map(str, planned))}; mean {statistics.fmean(planned):.1f})."]
    return ["", f"Cohorts: {', '.join(differ)} trained other cohort sizes than {planned} (see clients/round): the "
            "sides did not do the same work each round."]


def _secagg_cost(runs: list[dict[str, Any]]) -> list[str]:
    """Medians of each SecAgg+ side against the same side without SecAgg+ (same engine and CPUs per client)."""
    out: list[str] = []
    for label in dict.fromkeys(r["side"] for r in runs if r["side"].endswith("/secagg")):
        plain_label = label.removesuffix("/secagg")
        on = [r for r in runs if r["side"] == label]
        off = [r for r in runs if r["side"] == plain_label]
        if not off:
            continue
        steady = _med(on, "steady_median") / _med(off, "steady_median")
        out += ["", f"SecAgg+ cost, medians over {len(on)} / {len(off)} run(s), {label} ÷ {plain_label}: steady "
                f"round {_med(on, 'steady_median'):.2f} / {_med(off, 'steady_median'):.2f} s = {steady:.2f}× (target "
                f"≤ {TARGET_SECAGG_RATIO:.2f}×: {'met' if steady <= TARGET_SECAGG_RATIO else 'not met'}); wall "
                f"{_med(on, 'wall') / _med(off, 'wall'):.2f}×; peak PSS Σ "
                f"{_med(on, 'peak_bytes') / _med(off, 'peak_bytes'):.2f}×."]
    return out


def _wakeup_gain(runs: list[dict[str, Any]]) -> list[str]:
    """Medians of each side with wake-ups (the default) against the same side with Flower's 0.1 s polls."""
    out: list[str] = []
    for polls_label in dict.fromkeys(r["side"] for r in runs if "/polls" in r["side"]):
        label = polls_label.replace("/polls", "")
        on = [r for r in runs if r["side"] == label]
        off = [r for r in runs if r["side"] == polls_label]
        if not on:
            continue
        pairs = [a["steady_median"] / b["steady_median"] for a in on for b in off if a["tag"] == b["tag"]]
        out += ["", f"Wake-ups, medians over {len(on)} / {len(off)} run(s), {label} ÷ {polls_label}: steady round "
                f"{_med(on, 'steady_median'):.2f} / {_med(off, 'steady_median'):.2f} s = "
                f"{_med(on, 'steady_median') / _med(off, 'steady_median'):.2f}× (within each repeat: "
                f"{', '.join(f'{x:.2f}×' for x in pairs)}); round 1 {_med(on, 'round1'):.2f} / {_med(off, 'round1'):.2f} s; "
                f"wall {_med(on, 'wall') / _med(off, 'wall'):.2f}×; peak PSS Σ {_med(on, 'peak_bytes') / _med(off, 'peak_bytes'):.2f}×."]
    return out


def _side_vs_plain(runs: list[dict[str, Any]]) -> list[str]:
    """pfl's side of this benchmark against pfl written the plain way (``pfl_plain.py``): the same work a round?"""
    side = [r for r in runs if r["side"] == PFL_LABELS["side"]]
    plain = [r for r in runs if r["side"] == PFL_LABELS["plain"]]
    if not side or not plain:
        return []
    pairs = [(a["steady_median"] / b["steady_median"]) for a in side for b in plain if a["tag"] == b["tag"]]

    def acc(rs: list[dict[str, Any]]) -> str:
        return ", ".join("-" if r["final_accuracy"] is None else f"{r['final_accuracy']:.4f}" for r in rs)

    return ["", f"pfl side ÷ plain pfl, medians over {len(side)} / {len(plain)} run(s): steady round "
            f"{_med(side, 'steady_median'):.2f} / {_med(plain, 'steady_median'):.2f} s = "
            f"{_med(side, 'steady_median') / _med(plain, 'steady_median'):.2f}× (within each repeat: "
            f"{', '.join(f'{x:.2f}×' for x in pairs)}); round 1 {_med(side, 'round1'):.2f} / "
            f"{_med(plain, 'round1'):.2f} s; wall {_med(side, 'wall') / _med(plain, 'wall'):.2f}×; peak PSS "
            f"{_med(side, 'peak_bytes') / 1e9:.2f} / {_med(plain, 'peak_bytes') / 1e9:.2f} GB; final accuracy "
            f"{acc(side)} vs {acc(plain)}."]


def _versus_pfl(ours: list[dict[str, Any]], pfl: list[dict[str, Any]], label: str, busiest: float,
                pfl_label: str = "pfl") -> list[str]:
    """Medians of one of our sides against one of pfl's (``pfl_label``), their ratios and the issue's targets."""
    out: list[str] = []
    if ours and pfl:
        def ratio(key: str) -> str:
            return f"{_med(ours, key) / _med(pfl, key):.2f}×"

        wall_ratio = _med(ours, "wall") / _med(pfl, "wall")
        peak = _med(ours, "peak_bytes") / 1e9
        outside = statistics.median(r["wall"] - r["rounds_sum"] for r in ours), \
            statistics.median(r["wall"] - r["rounds_sum"] for r in pfl)
        out += ["", f"Medians over {len(ours)} run(s) per side, ratios {label} ÷ {pfl_label}:", "",
                f"| metric | {label} | {pfl_label} | {label} ÷ {pfl_label} |", "|---|---|---|---|",
                f"| wall | {_med(ours, 'wall'):.1f} s | {_med(pfl, 'wall'):.1f} s | {ratio('wall')} |",
                f"| steady round | {_med(ours, 'steady_median'):.2f} s | {_med(pfl, 'steady_median'):.2f} s | "
                f"{ratio('steady_median')} |",
                f"| round 1 | {_med(ours, 'round1'):.2f} s | {_med(pfl, 'round1'):.2f} s | {ratio('round1')} |",
                f"| outside rounds | {outside[0]:.1f} s | {outside[1]:.1f} s | {outside[0] / outside[1]:.2f}× |",
                *_phase_rows(ours, pfl),
                f"| peak PSS Σ | {peak:.2f} GB | {_med(pfl, 'peak_bytes') / 1e9:.2f} GB | {ratio('peak_bytes')} |",
                f"| CPU s (sampled) | {_med(ours, 'cpu_seconds'):.0f} | {_med(pfl, 'cpu_seconds'):.0f} | "
                f"{ratio('cpu_seconds')} |", "",
                f"Targets, {label}: wall ≤ {TARGET_WALL_RATIO:.1f}× {pfl_label}: "
                f"{'met' if wall_ratio <= TARGET_WALL_RATIO else 'not met'} ({wall_ratio:.2f}×"
                f"{', not meaningful: busy machine' if busiest > QUIET_LOAD else ''}); "
                f"peak summed memory ≤ {TARGET_PEAK_GB} GB: {'met' if peak <= TARGET_PEAK_GB else 'not met'} "
                f"({peak:.2f} GB)."]
        pairs = [(o["wall"] / q["wall"]) for o in ours for q in pfl if o["tag"] == q["tag"]]
        if pairs:  # each repeat runs both sides back to back: the spread of the ratio within a pair
            out.append(f"Wall ratio within each repeat ({label} ÷ {pfl_label}, same machine state): "
                       f"{', '.join(f'{x:.2f}×' for x in pairs)}.")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating (ABBA)")
    parser.add_argument("--pfl-python", type=Path, default=PFL_PYTHON, help="python of pfl's virtual environment")
    parser.add_argument("--pfl-sampling", choices=("paired", "poisson", "fixed", "random", "minimize_reuse"),
                        default="paired", help="pfl's client sampling (benchmarks/pfl_side.py): paired trains cohorts "
                                               "of the sizes our server draws for the run seed, round by round; "
                                               "poisson draws its own")
    parser.add_argument("--side", choices=("both", "ours", "pfl"), default="both")
    parser.add_argument("--pfl-scripts", nargs="+", choices=tuple(PFL_LABELS), default=["side"],
                        help="pfl's runs, once per script per repeat: side (benchmarks/pfl_side.py, the peer), "
                             "plain (benchmarks/pfl_plain.py, pfl written the plain way: the peer's control) and/or "
                             "side-cl (the peer with the CNN's weights channels-last, as our side lays them out)")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--partitioner", default="iid", choices=("iid", "shards", "pathological", "dirichlet"))
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--num-cpus", type=float, nargs="+", default=[1.0],
                        help="our side, once per value (and engine) per repeat: CPUs per simulated client (the "
                             "launcher's --num-cpus; 2 on 2 cores = one actor with 2 torch threads, as pfl runs)")
    parser.add_argument("--engines", nargs="+", default=["superlink"], choices=("superlink", "run-simulation"),
                        help="our side, once per engine per repeat: the launcher's --engine (run-simulation: no "
                             "SuperLink, SuperExec or `flwr run`)")
    parser.add_argument("--client-backends", nargs="+", default=["ray"], choices=("ray", "threads"),
                        help="our side, once per backend per repeat: the launcher's --client-backend (threads: the "
                             "ClientApps on the engine's own threads, no Ray)")
    parser.add_argument("--secure-aggregation", nargs="+", default=["off"], choices=("off", "on"),
                        help="our side, once per value (and engine, CPUs) per repeat: SecAgg+ with the default "
                             "secure-sum mechanism (on; its cost over the plain round is reported) or not (off: "
                             "the trusted-server setting pfl's central mechanism matches)")
    parser.add_argument("--wakeups", nargs="+", default=["on"], choices=("on", "off"),
                        help="our side with message wake-ups (on, the default) and/or Flower's 0.1 s polls (off)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42, help="run seed: partition and initial weights")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="memory sampling interval (s); one PSS sample of the ~17 processes of our side costs ~85 ms of CPU")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per-run limit (s)")
    parser.add_argument("--split", action="store_true", help="print each run's per-process PSS at its peak")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's record here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (inputs, logs, results)")
    parser.add_argument("--cold", action="store_true",
                        help="do not check our run-configs before the timed runs: the first run of each then does "
                             "the launcher's dry run (later ones find it cached, fedapp.run.dry_run_cache)")
    args = parser.parse_args(argv)

    version = pfl_available(args.pfl_python) if args.side != "ours" else "not used"
    if version is None:
        print(f"[peer_pfl] skipped: no pfl environment at {args.pfl_python} (create it as the module docstring "
              "says, or pass --pfl-python)")
        return 0
    work = Path(tempfile.mkdtemp(prefix="peer_pfl_"))
    print(f"# benchmarks.peer_pfl {' '.join(sys.argv[1:])}  (cpus={os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}; {version}; work folder {work})\n", flush=True)
    runs: list[dict[str, Any]] = []
    try:
        overrides = run_overrides(args, work / "results")
        t0 = time.perf_counter()
        settings = export_inputs(work / "inputs", overrides)
        print(f"[peer_pfl] inputs exported in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.side != "pfl" and not args.cold:
            t0 = time.perf_counter()
            for value in dict.fromkeys(args.secure_aggregation):
                check_config(overrides, value == "on")
            print(f"[peer_pfl] our run-configs checked (dry-run cache warm) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        config_of = {our_side(e, c, a == "on", w == "on", b): (e, c, a == "on", w == "on", b)
                     for e in args.engines for c in args.num_cpus for a in args.secure_aggregation
                     for w in args.wakeups for b in args.client_backends}
        ours = list(config_of)
        pfl_sides = [PFL_LABELS[s] for s in args.pfl_scripts]
        sides = {"both": ours + pfl_sides, "ours": ours, "pfl": pfl_sides}[args.side]
        script_of = {label: script for script, label in PFL_LABELS.items()}
        for k in range(args.repeats):
            for side in (sides if k % 2 == 0 else sides[::-1]):
                tag = str(k + 1)
                print(f"[peer_pfl] run {tag}: {side} ...", flush=True)
                load = settle()
                rec = (run_ours(overrides, work, tag, args, *config_of[side]) if side not in script_of
                       else run_pfl(work / "inputs", work, tag, args, seed=None, script=script_of[side]))
                rec["load_before"] = load
                print(f"[peer_pfl] run {tag}: {side} {rec['wall']:.1f} s, peak {rec['peak_bytes'] / 1e9:.2f} GB, "
                      f"final accuracy {rec['final_accuracy']}", flush=True)
                runs.append(rec)
        print("\n" + "\n".join(report(runs, settings, args.split)), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1), encoding="utf-8")
    finally:
        if args.keep:
            print(f"[peer_pfl] kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
