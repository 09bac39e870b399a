"""Run the app with ``flwr run`` against a private local SuperLink, and stop it afterwards.

``flwr run . local`` would start a *detached* SuperLink on fixed ports that outlives the
command. This launcher instead starts ``flower-superlink --simulation`` itself on a free
loopback port, writes a Flower config (``$FLWR_HOME/config.toml``) naming it, runs
``flwr run <app> dpfl --stream``, prints where the results are, and always stops the
SuperLink and its children by PID (also on Ctrl-C or failure).

    python -m fedapp.launch --num-supernodes 20 --run-config "strategy='robust-hdp' num-server-rounds=5"

The run-config is validated here first, so bad input fails before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomllib

from fedapp.config import ConfigError, resolve_config

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONNECTION = "dpfl"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def venv_bin(name: str) -> str:
    """An executable next to this interpreter (the project venv), else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} not found next to {sys.executable} or on PATH")
    return found


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private FLWR_HOME, no runtime dependency installs, no update check."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # flower-superexec etc.
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + path if path else "")
    return env


def write_flower_config(flwr_home: Path, address: str, *, root_certificates: str | None = None) -> Path:
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]", f'address = "{address}"']
    lines.append(f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true")
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def wait_http_health(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"nothing healthy on 127.0.0.1:{port} after {timeout:.0f}s")


def stop_process_tree(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop ``proc`` and every descendant by PID: SIGTERM, then SIGKILL.

    Flower's SuperLink starts ``flower-superexec`` and simulation processes in sessions of
    their own, so killing the process group is not enough: descendants are collected first.
    """
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _stop_leader(proc, timeout)
    terminate_processes(descendants)


def terminate_processes(procs: list, timeout: float = 5.0) -> list:
    """SIGTERM each ``psutil.Process``, wait, SIGKILL the survivors; returns those still alive after that."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=timeout)
    return still


def _stop_leader(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # reap leftovers of an exited leader's group
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_superlink(flwr_home: Path, port: int, *, simulation: bool = True,
                    extra_args: list[str] | None = None) -> subprocess.Popen:
    log_path = flwr_home / f"superlink-{port}.log"
    cmd = [venv_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
           "--disable-runtime-dependency-installation", "--log-file", str(log_path)]
    if simulation:
        cmd += ["--simulation", "--isolation", "subprocess"]
    cmd += extra_args if extra_args is not None else ["--insecure"]
    out = open(flwr_home / f"superlink-{port}.out", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=flower_env(flwr_home), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=str(PROJECT_ROOT))
    return proc


def pyproject_run_config(app: Path) -> dict[str, Any]:
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(data["tool"]["flwr"]["app"]["config"])


def parse_overrides(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args([text]))
    except Exception as exc:  # flwr raises ValueError/TOML errors
        raise ConfigError(f"cannot parse --run-config {text!r}: {exc}") from None


def to_toml_assignments(values: dict[str, Any]) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, str):
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'{key}="{escaped}"')
        else:
            parts.append(f"{key}={value!r}")
    return " ".join(parts)


def absolutize_paths(cfg: dict[str, Any], overrides: dict[str, Any], app: Path) -> Path:
    """Make ``output-dir`` and ``data-dir`` absolute (relative to ``app``) in ``overrides``: the ServerApp and
    ClientApps run in other working directories. Returns the absolute output folder."""
    output_dir = Path(cfg["output-dir"])
    if not output_dir.is_absolute():
        output_dir = (app / output_dir).resolve()
    overrides["output-dir"] = str(output_dir)
    if cfg["data-dir"] and not Path(cfg["data-dir"]).is_absolute():
        overrides["data-dir"] = str((app / cfg["data-dir"]).resolve())
    return output_dir


def list_runs(output_dir: Path) -> set[Path]:
    return {p for p in output_dir.iterdir() if p.is_dir()} if output_dir.is_dir() else set()


def run(num_supernodes: int = 20, run_config: str | None = None, app: Path = PROJECT_ROOT,
        flwr_home: Path | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
        timeout: float | None = None, port: int | None = None, ray_address: str = "") -> Path:
    """Validate, start a SuperLink, ``flwr run`` the app, stop everything; returns the new results folder."""
    app = app.resolve()
    overrides = parse_overrides(run_config)
    merged = {**pyproject_run_config(app), **overrides}
    cfg = resolve_config(merged)  # raises ConfigError before anything starts
    if num_supernodes < 2:
        raise ConfigError(f"--num-supernodes = {num_supernodes}: a federation needs at least 2 clients")
    from fedapp.server_app import make_prevalidate

    make_prevalidate(cfg)(num_supernodes)  # every client's profile vs its data, before anything starts
    output_dir = absolutize_paths(cfg, overrides, app)
    flwr_home = (flwr_home or app / ".flwr").resolve()
    before = list_runs(output_dir)
    port = port or free_port()
    write_flower_config(flwr_home, f"127.0.0.1:{port}")
    if ray_address:  # attach the simulation runtime to an existing (multi-node) Ray cluster
        from fedapp.deploy import simulation_backend

        os.environ.update(simulation_backend(num_cpus, num_gpus, ray_address)[1])
    superlink = start_superlink(flwr_home, port)
    try:
        wait_http_health(port, proc=superlink)
        cpus = int(num_cpus) if float(num_cpus).is_integer() else num_cpus
        federation = (f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus} "
                      f"client-resources-num-gpus={num_gpus} init-args-logging-level=\"ERROR\"")
        cmd = [venv_bin("flwr"), "run", str(app), CONNECTION, "--stream",
               "--run-config", to_toml_assignments(overrides), "--federation-config", federation]
        print(f"[dpfl] SuperLink pid {superlink.pid} on 127.0.0.1:{port}; running: flwr run {app.name} {CONNECTION}",
              flush=True)
        result = subprocess.run(cmd, env=flower_env(flwr_home), cwd=str(app), timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"flwr run exited with code {result.returncode}")
    finally:
        stop_process_tree(superlink)
    new_runs = sorted(list_runs(output_dir) - before, key=lambda p: p.stat().st_mtime)
    if not new_runs or not (new_runs[-1] / "summary.json").exists():
        raise RuntimeError(f"the run finished but wrote no results folder under {output_dir}; see "
                           f"{flwr_home}/superlink-{port}.log")
    summary = json.loads((new_runs[-1] / "summary.json").read_text(encoding="utf-8"))
    if not summary.get("finished"):
        raise RuntimeError(f"the run stopped after {summary.get('rounds_completed')} of {cfg.rounds} rounds; partial "
                           f"results in {new_runs[-1]}, server log {flwr_home}/superlink-{port}.log")
    return new_runs[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-supernodes", type=int, default=20)
    parser.add_argument("--run-config", default=None, help="TOML assignments, e.g. \"strategy='fedavg' seed=1\"")
    parser.add_argument("--app", type=Path, default=PROJECT_ROOT)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per simulated client")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per simulated client (fractional ok)")
    parser.add_argument("--ray-address", default="", help="attach to an existing Ray cluster: auto, host:port, ray://host:port")
    args = parser.parse_args(argv)
    try:
        run_dir = run(args.num_supernodes, args.run_config, args.app, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                      ray_address=args.ray_address)
    except ConfigError as exc:
        print(f"[dpfl] configuration error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"[dpfl] run failed: {exc}", file=sys.stderr)
        return 1
    summary = (run_dir / "summary.json").read_text(encoding="utf-8")
    print(f"[dpfl] results: {run_dir}\n[dpfl] summary.json:\n{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
