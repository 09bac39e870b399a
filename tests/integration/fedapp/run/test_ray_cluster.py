"""Beyond one machine: a real two-node Ray cluster on loopback runs a simulation attached with ``--ray-address``.

Both nodes are ``ray start --block`` processes in sessions of their own, with a private ``--temp-dir``, so they
never meet another Ray session on this machine; they are stopped by PID (never ``ray stop``, which would stop
every Ray instance of this user). Skipped only when the head node cannot start here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

from fedapp.run.processes import free_port, stop_process_tree, terminate_processes, venv_bin

READY = "block forever"  # what `ray start --block` prints once its node is up and registered


def _start_node(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([venv_bin("ray"), "start", "--block", "--num-cpus", "1", "--num-gpus", "0",
                                 "--node-ip-address", "127.0.0.1", "--disable-usage-stats", *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> str | None:
    """None once the node is up, else why it is not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if READY in text:
            return None
        if proc.poll() is not None:
            return f"exited with {proc.returncode}: {text[-2000:]}"
        time.sleep(0.5)
    return f"not ready after {timeout:.0f} s: {log.read_text(errors='replace')[-2000:]}"


def _stop(procs: list[subprocess.Popen], temp_dir: str) -> None:
    for proc in reversed(procs):
        stop_process_tree(proc, timeout=20.0)
    # a Ray process re-parented away from its node (reaper, agents) still names our private temp dir
    strays = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in (p.info["cmdline"] or [])):
                strays.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    terminate_processes(strays)


def _simulation_workers_per_node(logs: Path) -> dict[str, set[int]]:
    """Raylet log name → PIDs of the workers it started for a driver job (not Ray's own ``ffffffff`` job)."""
    pids = {int(m.group(2)) for f in logs.glob("worker-*.out")
            if (m := re.fullmatch(r"worker-[0-9a-f]+-([0-9a-f]{8})-(\d+)\.out", f.name)) and m.group(1) != "ffffffff"}
    started = {}
    for raylet in logs.glob("raylet*.out"):
        text = raylet.read_text(errors="replace")
        started[raylet.name] = {pid for pid in pids if f"Started worker process with pid {pid} " in text}
    return started


@pytest.mark.slow
def test_simulation_attached_to_a_two_node_ray_cluster(tmp_path: Path):
    if shutil.which(venv_bin("ray")) is None and not Path(venv_bin("ray")).exists():
        pytest.skip("the ray command is not installed")
    temp_dir = tempfile.mkdtemp(prefix="dpflray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start_node(["--head", "--port", str(port), "--temp-dir", temp_dir,
                                  "--include-dashboard", "false"], tmp_path / "head.log"))
        why = _wait_ready(procs[0], tmp_path / "head.log")
        if why is not None:
            pytest.skip(f"Ray cannot start a head node here: {why}")
        procs.append(_start_node(["--address", f"127.0.0.1:{port}", "--temp-dir", temp_dir], tmp_path / "node2.log"))
        why = _wait_ready(procs[1], tmp_path / "node2.log")
        assert why is None, f"second Ray node: {why}"

        out, env = tmp_path / "results", {**os.environ, "FLWR_HOME": str(tmp_path / "flwr")}
        env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, "-m", "fedapp.run.launch", "--ray-address", f"127.0.0.1:{port}", "--num-supernodes", "2",
               "--run-config", f"strategy='dpsgd-fedavg' dataset='digits' num-server-rounds=2 max-samples=200 "
                               f"output-dir='{out}'"]
        with (tmp_path / "launch.log").open("wb") as log:
            launch = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            try:
                code = launch.wait(timeout=420)
            except subprocess.TimeoutExpired:
                stop_process_tree(launch)
                pytest.fail(f"launcher still running after 420 s: {(tmp_path / 'launch.log').read_text()[-3000:]}")
        assert code == 0, (tmp_path / "launch.log").read_text()[-3000:]
        (run_dir,) = [p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["finished"] and summary["rounds_completed"] == 2
        assert summary["client_status_counts"] == {"ok": 4}

        logs = Path(temp_dir) / "session_latest" / "logs"
        assert list(logs.glob("python-core-driver-*.log")), "the simulation did not attach to this cluster"
        per_node = _simulation_workers_per_node(logs)
        assert len(per_node) == 2 and all(per_node.values()), f"client workers per node: {per_node}"
    finally:
        _stop(procs, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
