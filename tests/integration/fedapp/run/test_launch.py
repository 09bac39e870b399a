"""`flwr run` through the launcher (the `make run` path): real SuperLink, stopped by PID afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

from fedapp.config import ConfigError
from fedapp.run.launch import resolve_flwr_home, run
from fedapp.run.processes import free_port


def _flower_processes(marker: str = "") -> set[int]:
    """Flower server-side processes (optionally only those whose command line mentions ``marker``)."""
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(n in cmd for n in ("flower-superlink", "flower-superexec", "flwr-simulation")) and marker in cmd:
            out.add(p.info["pid"])
    return out


def _ray_processes(marker: str) -> set[int]:
    """Ray's daemons (GCS, raylet) and actors whose command line mentions ``marker`` (their binaries live in
    this project's virtual environment)."""
    return {p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(n in " ".join(p.info["cmdline"] or []) for n in ("raylet", "gcs_server", "ray::"))
            and marker in " ".join(p.info["cmdline"] or [])}


def _ray_sessions() -> set[Path]:
    """Ray's session folders on this machine (on Linux under $RAY_TMPDIR, else $TMPDIR, else /tmp)."""
    root = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"
    return {p for p in root.glob("session_2*") if p.is_dir()} if root.is_dir() else set()


def _assert_lean_ray_session(session: Path) -> None:
    """What fedapp.compat.lean_ray leaves out of a local head: no autoscaler monitor, log monitor or dashboard API server
    wrote a log, no worker was prestarted for Ray's own job (``ffffffff``)."""
    logs = {p.name for p in (session / "logs").iterdir()}
    assert "raylet.out" in logs and "gcs_server.out" in logs, sorted(logs)
    assert not logs & {"monitor.log", "log_monitor.log", "dashboard.log"}, sorted(logs)
    assert not [n for n in logs if n.startswith("worker-") and "-ffffffff-" in n], sorted(logs)


def _round_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_both_engines_end_to_end_same_results_and_nothing_left_running(tmp_path, capsys):
    """The SuperLink engine (``flwr run``) and the run_simulation engine train the same apps on Ray: same rounds,
    same central loss/accuracy and uplink, and each leaves no Flower or Ray process behind. The SuperLink
    engine prints the ServerApp's log from the file it writes (no ``flwr run --stream`` process)."""
    config = "num-server-rounds=2 strategy='fedavg' max-samples=300 seed=7 output-dir='{out}'"
    port = free_port()
    sessions = _ray_sessions()
    superlink_dir = run(num_supernodes=3, run_config=config.format(out=tmp_path / "superlink"),
                        flwr_home=tmp_path / "flwr-home", timeout=300, port=port, client_backend="ray")
    leftovers = _flower_processes(f"127.0.0.1:{port}") | _flower_processes(f"--port {port}")
    assert not leftovers, f"processes left running: {leftovers}"
    printed = capsys.readouterr().out
    server_log = (tmp_path / "flwr-home" / f"serverapp-{port}.log").read_text()
    flower_log = (superlink_dir / "flower.log").read_text()  # the ServerApp's whole log, in the results folder
    for line in ("[round 1/2] accuracy=", "[round 2/2] accuracy=", "[SUMMARY]"):
        assert line in server_log and line in flower_log, flower_log[-3000:]
    for line in ("[dpfl] [round 1/2] accuracy=", "[dpfl] [round 2/2] accuracy="):  # one progress line a round
        assert line in printed, printed[-3000:]
    assert "[SUMMARY]" not in printed and "configure_fit" not in printed  # the rest stays in flower.log
    assert "Ray started while the apps loaded" in server_log  # fedapp.compat.early_ray, with Flower's arguments
    python_dir = run(num_supernodes=3, run_config=config.format(out=tmp_path / "python"), timeout=300,
                     engine="run-simulation", client_backend="ray")
    printed = capsys.readouterr().out
    flower_log = (python_dir / "flower.log").read_text()  # the engine's whole output, without its colour codes
    assert "[round 2/2] accuracy=" in flower_log and "[SUMMARY]" in flower_log and "\x1b[" not in flower_log
    assert "[dpfl] [round 2/2] accuracy=" in printed and "[SUMMARY]" not in printed, printed[-3000:]
    # both engines started one lean Ray head each: flwr-simulation early, from the import of fedapp.apps (a restart
    # with other arguments would add a session), ours in process
    new_sessions = _ray_sessions() - sessions
    assert len(new_sessions) == 2, new_sessions
    for session in new_sessions:
        _assert_lean_ray_session(session)
    for run_dir, out in ((superlink_dir, "superlink"), (python_dir, "python")):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds_completed"] == 2 and summary["finished"]
        assert run_dir.parent == tmp_path / out
        config_used = json.loads((run_dir / "config.json").read_text())["config"]
        # the launcher knows the federation's size: the server waits for all of it (client-level DP needs the real n)
        assert config_used["num-clients"] == 3 and config_used["min-available-clients"] == 3
    time.sleep(1.0)
    assert not _ray_processes(str(REPO)), "Ray daemons left running"
    assert not any("fedapp.run.simulation_engine" in " ".join(p.info["cmdline"] or [])
                   for p in psutil.process_iter(["cmdline"]))
    ours, theirs = _round_records(python_dir), _round_records(superlink_dir)
    assert [r["round"] for r in ours] == [r["round"] for r in theirs] == [1, 2]
    for a, b in zip(ours, theirs):
        assert a["metrics"]["accuracy"] == pytest.approx(b["metrics"]["accuracy"], abs=1e-9)
        assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], rel=1e-5)
        assert a["metrics"]["uplink_bytes"] == b["metrics"]["uplink_bytes"]
        assert a["metrics"]["clients_ok"] == b["metrics"]["clients_ok"] == 3


@pytest.mark.slow
def test_the_command_line_shows_one_line_a_round_and_a_summary_and_keeps_flowers_log(tmp_path):
    """``python -m fedapp.run.launch`` as ``make run`` starts it: the terminal gets one progress line a round and a
    one-screen summary (accuracy, ε against each budget, threat model, where the files are); Flower's whole log is
    ``flower.log`` in the results folder."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    env.pop("DPFL_VERBOSE", None)
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", "3", "--run-config",
           f"strategy='dpsgd-fedavg' num-server-rounds=2 max-samples=300 seed=3 output-dir='{tmp_path / 'out'}'"]
    done = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    out = done.stdout
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir() and not p.name.startswith(".")]
    flower_log = (run_dir / "flower.log").read_text()
    for line in ("[ROUND 1]", "configure_fit", "[round 2/2] accuracy=", "[SUMMARY]"):
        assert line in flower_log, flower_log[-3000:]
    assert "[ROUND 1]" not in out and "configure_fit" not in out and "[SUMMARY]" not in out, out
    assert "[dpfl] [round 1/2] accuracy=" in out and "[dpfl] [round 2/2] accuracy=" in out, out
    assert len(out.splitlines()) <= 40, out
    summary = out[out.index("[dpfl] ---- dpsgd-fedavg on digits, 3 clients, 2 rounds, seed 3"):].splitlines()
    text = "\n".join(summary)
    assert len(summary) <= 25, text
    assert "test accuracy of the global model:" in text
    assert "ε spent / budget per client, δ = 1e-04 each, replace-one neighbours: 3 of 3 within budget" in text
    assert "threat model: record-level local DP" in text
    assert f"results: {run_dir}" in text and "flower.log" in text and "privacy.png" in text


@pytest.mark.slow
def test_the_thread_backend_trains_what_ray_trains_under_secagg_without_ray(tmp_path):
    """The default backend (``auto``) for this project's apps on CPUs is ``threads``: the same ClientApps, SecAgg+
    with the distributed discrete Gaussian included, on the engine's own threads. With seeded noise the rounds equal
    the Ray backend's exactly, and no Ray daemon or actor starts (fedapp.compat.thread_backend)."""
    config = ("strategy='dp-fedavg' num-server-rounds=2 max-samples=300 seed=5 seeded-noise=true "
              "output-dir='{out}'")
    sessions = _ray_sessions()
    threads_dir = run(num_supernodes=4, run_config=config.format(out=tmp_path / "threads"),
                      flwr_home=tmp_path / "home-threads", timeout=300)
    assert _ray_sessions() == sessions, "the thread backend started Ray"
    flower_log = (threads_dir / "flower.log").read_text()
    assert f"ClientApps on {os.cpu_count()} threads of this process (thread backend)" in flower_log, flower_log
    assert "Ray started while the apps loaded" not in flower_log
    ray_dir = run(num_supernodes=4, run_config=config.format(out=tmp_path / "ray"), flwr_home=tmp_path / "home-ray",
                  timeout=300, client_backend="ray")
    ours, theirs = _round_records(threads_dir), _round_records(ray_dir)
    assert [r["round"] for r in ours] == [r["round"] for r in theirs] == [1, 2]
    for a, b in zip(ours, theirs):
        assert a["metrics"]["secure_aggregation"] and a["metrics"]["secure_sum"] == "distributed discrete Gaussian"
        assert a["metrics"]["clients_ok"] == b["metrics"]["clients_ok"] == 4
        for key in ("accuracy", "loss", "uplink_bytes", "epsilon", "mean_update_norm"):
            assert a["metrics"][key] == b["metrics"][key], key
    time.sleep(1.0)
    assert not _ray_processes(str(REPO)), "Ray daemons left running"


def test_the_thread_backend_is_refused_with_gpus_or_a_ray_cluster_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--client-backend threads trains on the CPU; --num-gpus 0.5"):
        run(num_supernodes=3, run_config=f"output-dir='{tmp_path}/out'", num_gpus=0.5, client_backend="threads",
            flwr_home=tmp_path / "h")
    with pytest.raises(ConfigError, match="--ray-address 'auto' needs --client-backend ray"):
        run(num_supernodes=3, run_config=f"output-dir='{tmp_path}/out'", ray_address="auto", client_backend="threads",
            flwr_home=tmp_path / "h")
    with pytest.raises(ConfigError, match="--client-backend 'dask': valid backends are auto, ray, threads"):
        run(num_supernodes=3, run_config=f"output-dir='{tmp_path}/out'", client_backend="dask",
            flwr_home=tmp_path / "h")
    assert not (tmp_path / "out").exists() and not (tmp_path / "h").exists()


def test_auto_picks_threads_for_this_projects_apps_on_cpus_else_ray(tmp_path):
    from fedapp.run.launch import PROJECT_ROOT, resolve_client_backend

    assert resolve_client_backend("auto") == "threads"
    assert resolve_client_backend("auto", app=PROJECT_ROOT / "fedapp" / "..") == "threads"
    assert resolve_client_backend("auto", num_gpus=0.5) == "ray"  # the thread backend trains on the CPU
    assert resolve_client_backend("auto", ray_address="auto") == "ray"
    assert resolve_client_backend("auto", app=tmp_path) == "ray"  # another app may not install the thread backend
    assert resolve_client_backend("ray") == "ray" and resolve_client_backend("threads", app=tmp_path) == "threads"


def test_run_simulation_engine_refuses_another_app_and_unknown_engines(tmp_path):
    with pytest.raises(ConfigError, match="--app .* needs --engine superlink"):
        run(num_supernodes=3, run_config=f"output-dir='{tmp_path}/out'", app=tmp_path, engine="run-simulation")
    with pytest.raises(ConfigError, match="--engine 'thread'"):
        run(num_supernodes=3, run_config=f"output-dir='{tmp_path}/out'", engine="thread")
    assert not (tmp_path / "out").exists()


def test_bad_config_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="'delta' = 2.0"):
        run(num_supernodes=3, run_config=f"delta=2.0 output-dir='{tmp_path}/out'", flwr_home=tmp_path / "h")
    with pytest.raises(ConfigError, match="batch-size 400 > its dataset size"):
        run(num_supernodes=3, run_config=f"batch-size=400 output-dir='{tmp_path}/out'", flwr_home=tmp_path / "h")
    assert not (tmp_path / "out").exists() and not (tmp_path / "h").exists()
    assert _flower_processes(str(tmp_path)) == set()


# ----------------------------------------------------------------------------- the launcher owns its run
def test_empty_data_dir_is_a_clear_error_and_nothing_is_downloaded_or_created(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"dataset 'mnist' not found under run-config 'data-dir'.*nothing is downloaded"):
        run(num_supernodes=2, run_config=f"dataset='mnist' data-dir='{empty}' output-dir='{tmp_path}/out'",
            flwr_home=tmp_path / "h")
    assert list(empty.iterdir()) == []  # no MNIST/raw folder
    assert not (tmp_path / "h").exists() and not (tmp_path / "out").exists()


def test_flwr_home_comes_from_the_environment_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    assert resolve_flwr_home(REPO) == (tmp_path / "home").resolve()
    assert resolve_flwr_home(REPO, tmp_path / "explicit") == (tmp_path / "explicit").resolve()
    monkeypatch.delenv("FLWR_HOME")
    assert resolve_flwr_home(REPO) == REPO / ".flwr"


def _start_launcher(tmp_path: Path, rounds: int) -> subprocess.Popen:
    """``python -m fedapp.run.launch`` as a user starts it, with its own FLWR_HOME (2 clients, fedavg on digits)."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", "2", "--run-config",
           f"strategy='fedavg' num-server-rounds={rounds} max-samples=300 output-dir='{tmp_path / 'out'}'"]
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115 - closed with the test
    return subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _rounds_done(out: Path) -> int:
    files = list(out.glob("*/rounds.jsonl")) if out.is_dir() else []
    return max((sum(1 for line in f.read_text().splitlines() if '"round"' in line) for f in files), default=0)


def _follow_until_training(launcher: subprocess.Popen, tmp_path: Path, timeout: float = 240) -> dict[int, psutil.Process]:
    """Record every descendant of the launcher (by PID + start time) until a round is recorded."""
    from conftest import follow_process_tree

    return follow_process_tree(launcher, tmp_path / "launcher.log",
                               lambda seen: _rounds_done(tmp_path / "out") >= 1 and len(seen) >= 4, timeout)


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _names(procs) -> str:
    return ", ".join(f"{p.pid}:{_cmd(p)[:100]}" for p in procs)


def _alive(procs) -> list[psutil.Process]:
    live = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.NoSuchProcess:
            continue
    return live


def _kill_recorded(procs) -> None:
    for p in _alive(procs):  # the test stops what it started, by PID, whatever happened
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_launcher_stops_the_superlink_and_all_its_children(tmp_path, sig):
    launcher = _start_launcher(tmp_path, rounds=200)
    seen: dict[int, psutil.Process] = {}
    try:
        seen = _follow_until_training(launcher, tmp_path)
        superlinks = [p for p in seen.values() if "flower-superlink" in _cmd(p)]
        assert len(superlinks) == 1
        # the SuperExec became the small waiter once it had started the run (fedapp.compat.lean_superexec)
        (waiter,) = [p for p in seen.values() if " -S -I -c " in _cmd(p)]
        assert waiter.memory_info().rss < 30e6 and not [p for p in seen.values() if "flower-superexec" in _cmd(p)]
        assert next(p for p in seen.values() if "flwr-simulation" in _cmd(p)).ppid() == waiter.pid
        home = tmp_path / "home"  # $FLWR_HOME honoured: connection config and SuperLink logs are there
        assert "127.0.0.1:" in (home / "config.toml").read_text() and list(home.glob("superlink-*.log"))
        launcher.send_signal(sig)
        code = launcher.wait(timeout=90)
        assert code == 128 + sig, (tmp_path / "launcher.log").read_text()[-3000:]
        assert f"interrupted by signal {int(sig)}" in (tmp_path / "launcher.log").read_text()
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        alive = _alive(alive)
        assert not alive, f"left running after signal {sig}: {_names(alive)}"
        assert _rounds_done(tmp_path / "out") < 200  # the run did not go on without the launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _kill_recorded(seen.values())


@pytest.mark.slow
def test_superlink_stops_when_the_launcher_is_killed(tmp_path):
    launcher = _start_launcher(tmp_path, rounds=200)
    seen: dict[int, psutil.Process] = {}
    try:
        seen = _follow_until_training(launcher, tmp_path)
        superlink = next(p for p in seen.values() if "flower-superlink" in _cmd(p))
        launcher.kill()  # SIGKILL: no handler, no finally
        launcher.wait()
        _, alive = psutil.wait_procs([superlink], timeout=10)
        assert not _alive(alive), "the SuperLink outlived its launcher"
        _, alive = psutil.wait_procs(list(seen.values()), timeout=20)  # the watchdog stops the rest by PID
        alive = _alive(alive)
        assert not alive, f"left running after kill -9 of the launcher: {_names(alive)}"
    finally:
        _kill_recorded(seen.values())


@pytest.mark.slow
def test_a_dead_server_app_is_noticed_within_seconds(tmp_path):
    """kill -9 of the process running the ServerApp: the launcher stops everything and fails, without waiting
    for Flower's own ~45 s timeout."""
    launcher = _start_launcher(tmp_path, rounds=200)
    seen: dict[int, psutil.Process] = {}
    try:
        seen = _follow_until_training(launcher, tmp_path)
        server = next(p for p in seen.values() if "flwr-simulation" in _cmd(p))
        server.kill()
        start = time.monotonic()
        code = launcher.wait(timeout=60)
        took = time.monotonic() - start
        log = (tmp_path / "launcher.log").read_text()
        assert code != 0 and "ServerApp process" in log, log[-3000:]
        assert took < 25, f"noticed after {took:.0f}s"
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        assert not _alive(alive), f"left running: {_names(_alive(alive))}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _kill_recorded(seen.values())
