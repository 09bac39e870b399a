"""Process helpers shared by ``fedapp.run.launch`` and ``fedapp.run.deploy``: Flower's environment and
connection config, the SuperLink, stopping process trees by PID, signals, a parent-death watchdog,
and the run-config plumbing both entry points need.

Ownership rules: whatever a launcher starts is stopped by PID when the run ends,
fails, is interrupted (SIGINT, SIGTERM, SIGHUP) — and also when the launcher itself is killed
(``kill -9``): the SuperLink gets a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``) and a
:func:`watchdog` process in its own session stops the SuperLink and every descendant it saw once
the launcher is gone. Elsewhere the parent-death signal is skipped and only the watchdog remains.

    python -m fedapp.run.processes watchdog --parent PID --root PID   # what start_watchdog runs
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from fedapp.compat.lean_ray import SWITCH as LEAN_RAY_SWITCH
from fedapp.config import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONNECTION = "dpfl"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ----------------------------------------------------------------------------- Flower environment
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cmdline(proc: Any) -> str:
    """A ``psutil.Process``'s command line as one string ("" when it is gone or not ours to read)."""
    try:
        return " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - psutil.Error: gone, zombie or denied
        return ""


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
    """Environment for Flower processes: private FLWR_HOME, no runtime dependency installs, no update check, the
    lean Ray head switched on unless the caller's environment sets it."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault(LEAN_RAY_SWITCH, "on")  # flwr-simulation starts a lean Ray head (fedapp.compat.lean_ray)
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
        time.sleep(0.05)
    raise TimeoutError(f"nothing healthy on 127.0.0.1:{port} after {timeout:.0f}s")


def simulation_backend(num_cpus: float = 1.0, num_gpus: float = 0.0, ray_address: str = "") -> tuple[dict, dict]:
    """Flower simulation backend settings: (``backend_config`` for ``run_simulation``, extra environment).

    ``num_gpus`` < 1 shares a GPU between clients (e.g. 0.25 → four ClientApps per GPU); above 1
    it must be whole (Ray). ``ray_address`` (``auto``, ``host:port`` or ``ray://host:port``)
    attaches to an existing multi-node Ray cluster instead of starting one: it goes to
    ``ray.init(address=...)`` in process and to ``RAY_ADDRESS`` for a SuperLink's simulation runtime.
    """
    if not num_cpus > 0:
        raise ConfigError(f"client num-cpus = {num_cpus!r} must be > 0")
    if num_gpus < 0 or (num_gpus > 1 and not float(num_gpus).is_integer()):
        raise ConfigError(f"client num-gpus = {num_gpus!r} must be a fraction in [0, 1] or a whole number")
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False}
    env: dict[str, str] = {}
    if ray_address:
        if not re.fullmatch(r"auto|(ray://)?[A-Za-z0-9_.\-]+:\d{1,5}", ray_address):
            raise ConfigError(f"ray address {ray_address!r} must be 'auto', 'host:port' or 'ray://host:port'")
        init_args["address"] = ray_address
        env["RAY_ADDRESS"] = ray_address
    backend = {"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}, "init_args": init_args}
    return backend, env


# ----------------------------------------------------------------------------- run-config plumbing
def pyproject_run_config(app: Path) -> dict[str, Any]:
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(data["tool"]["flwr"]["app"]["config"])


#: one ``key=value`` of a ``--run-config`` string, as ``flwr run`` reads them (``flwr.common.config.parse_config_args``)
RUN_CONFIG_ASSIGNMENT = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_config_assignments(text: str) -> dict[str, Any]:
    """A ``--run-config`` value read as ``flwr run`` reads it: a TOML file's path, or ``key=value`` pairs whose values
    are TOML; nested tables flattened to dotted keys. The same rules as Flower's ``parse_config_args`` (a test
    compares them), without importing ``flwr.common`` (numpy, gRPC, cryptography: 45 MB kept by the launcher for
    the whole run)."""
    if text.endswith(".toml"):
        data = tomllib.loads(Path(text).expanduser().read_text(encoding="utf-8"))
    else:
        data = tomllib.loads("\n".join(f"{k} = {v}" for k, v in RUN_CONFIG_ASSIGNMENT.findall(text)))
    return _flatten(data)


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(_flatten(value, name))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif name == "input-shape" and isinstance(value, list) and all(type(v) is int for v in value):
            out[name] = str(value)  # Flower's run-config holds no arrays: the string "[1, 28, 28]" travels instead
        else:
            raise ValueError(f"the value for key {key} needs to be of type int, float, bool, str, or a table of those")
    return out


def parse_overrides(text: str | None) -> dict[str, Any]:
    """TOML assignments (``"key=value key2='x'"``) or a TOML file path; an assignment without a value is an error."""
    if not text:
        return {}
    empty = re.search(r"(?:^|\s)([A-Za-z0-9_.-]+)\s*=\s*(?=\s|$)", text) if not text.endswith(".toml") else None
    if empty:
        raise ConfigError(f"--run-config assigns no value to {empty.group(1)!r} (in {text!r}); give one or leave the "
                          "key out")
    try:
        return parse_config_assignments(text)
    except Exception as exc:  # TOML errors, a file that cannot be read, a value of another type
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


def absolutize_paths(output_dir: str, data_dir: str, overrides: dict[str, Any], app: Path) -> Path:
    """Make ``output-dir`` and ``data-dir`` absolute (relative to ``app``) in ``overrides``: the ServerApp and
    ClientApps run in other working directories. Returns the absolute output folder."""
    out = Path(output_dir)
    if not out.is_absolute():
        out = (app / out).resolve()
    overrides["output-dir"] = str(out)
    if data_dir and not Path(data_dir).is_absolute():
        overrides["data-dir"] = str((app / data_dir).resolve())
    return out


def list_runs(output_dir: Path) -> set[Path]:
    """Run folders under ``output_dir`` (hidden folders such as client state are not runs)."""
    return {p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith(".")} if output_dir.is_dir() else set()


# ----------------------------------------------------------------------------- parent death
def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (Linux only, else None).

    The kernel delivers it when the *thread* that forked exits, so start children from the thread
    that outlives them (the launchers use the main thread). If this process already died between
    ``fork`` and ``prctl``, the child signals itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


#: how often the launcher and its watchdog look for new descendants (Ray's daemons are long-lived; every look
#: reads /proc for the whole tree, ~3 % of a core each at 0.5 s on the 2-core reference machine)
WATCH_INTERVAL_S = 2.0


def start_watchdog(*roots: subprocess.Popen | int, parent_pid: int | None = None,
                   interval: float = WATCH_INTERVAL_S) -> subprocess.Popen:
    """Start :func:`watchdog` in its own session: it stops the process trees of ``roots`` once ``parent_pid``
    (default: this process) is gone, and exits by itself once those trees are gone."""
    if not roots:
        raise ValueError("start_watchdog needs at least one root")
    cmd = [sys.executable, "-m", "fedapp.run.processes", "watchdog", "--parent", str(parent_pid or os.getpid()),
           *(a for r in roots for a in ("--root", str(r if isinstance(r, int) else r.pid))), "--interval", str(interval)]
    env = os.environ.copy()
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=str(PROJECT_ROOT))


def watchdog(parent_pid: int, root_pids: Sequence[int], interval: float = WATCH_INTERVAL_S) -> int:
    """Follow ``root_pids`` and their descendants; when ``parent_pid`` dies first, stop them all by PID.

    Returns 0 when the trees ended on their own, 1 when it had to stop them. Descendants are recorded
    while they are visible, so processes reparented after an intermediate one exited are still stopped.
    """
    import psutil

    try:
        parent: Any = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        parent = None
    seen: dict[int, Any] = {}
    for pid in root_pids:
        try:
            seen[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
    if not seen:
        return 0
    while True:
        _record_descendants(seen)
        if parent is None or not _alive(parent):
            break
        if not any(_alive(p) for p in seen.values()):
            return 0
        time.sleep(interval)
    _record_descendants(seen)
    terminate_processes([p for p in seen.values() if _alive(p)])
    return 1


def _record_descendants(seen: dict[int, Any]) -> None:
    """Add every live descendant of every live process in ``seen`` (reparented ones included)."""
    import psutil

    for proc in list(seen.values()):
        if not _alive(proc):
            continue
        try:
            for child in proc.children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            continue


# ----------------------------------------------------------------------------- SuperLink
def start_superlink(flwr_home: Path, port: int, *, simulation: bool = True,
                    extra_args: list[str] | None = None, env: Mapping[str, str] | None = None,
                    isolation: str = "subprocess") -> subprocess.Popen:
    """``flower-superlink`` on loopback in a session of its own, told to stop when this process dies; ``env``: more
    environment for it and its descendants (SuperExec, the simulation runtime). A simulation SuperLink starts its
    SuperExec itself (``isolation`` ``subprocess``) or leaves it to the caller (``process``:
    :func:`superexec_args`)."""
    if isolation not in ("subprocess", "process"):
        raise ValueError(f"isolation = {isolation!r}: 'subprocess' or 'process'")
    log_path = flwr_home / f"superlink-{port}.log"
    cmd = [venv_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
           "--disable-runtime-dependency-installation", "--log-file", str(log_path)]
    if simulation:
        cmd += ["--simulation", "--isolation", isolation]
    cmd += extra_args if extra_args is not None else ["--insecure"]
    out = open(flwr_home / f"superlink-{port}.out", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env={**flower_env(flwr_home), **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=str(PROJECT_ROOT), preexec_fn=parent_death_preexec())
    out.close()  # the child holds its own descriptor
    return proc


def superexec_args(port: int, superlink_pid: int) -> list[str]:
    """``flower-superexec``'s arguments for the SuperLink on ``port`` started with ``isolation="process"``: what such a
    SuperLink passes the SuperExec it starts itself (its Runtime API on the same port, no TLS on loopback, exit when
    the SuperLink exits; no runtime dependency installation, as :func:`flower_env` asks)."""
    return ["--insecure", "--runtime-api-address", f"127.0.0.1:{port}", "--parent-pid", str(superlink_pid)]


# ----------------------------------------------------------------------------- stopping by PID
def stop_process_tree(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop ``proc`` and every descendant by PID, as :meth:`Processes.stop_all` stops a run.

    Flower's SuperLink starts ``flower-superexec`` and simulation processes in sessions of
    their own, so killing the process group is not enough: descendants are collected first.
    """
    procs = Processes()
    procs.add(proc)
    procs.stop_all(timeout)


def terminate_processes(procs: list, timeout: float = 5.0, groups: Sequence[int] = ()) -> list:
    """SIGTERM each ``psutil.Process`` and each process group in ``groups``, wait for all of them together, SIGKILL
    the survivors (and the groups, whose members may not all be in ``procs``); returns those still alive after
    that."""
    import psutil

    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=timeout)
    return still


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Processes:
    """Every process a launcher started, plus every descendant it has seen (Flower starts
    ``flower-superexec``/``flwr-serverapp``/``flwr-clientapp``/simulation children, some in own sessions)."""

    started: list[subprocess.Popen] = field(default_factory=list)
    seen: dict[int, Any] = field(default_factory=dict)  # pid -> psutil.Process
    _stop: threading.Event = field(default_factory=threading.Event)

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.started.append(proc)
        self.snapshot()
        return proc

    def snapshot(self) -> None:
        import psutil

        for proc in list(self.started):
            if proc.poll() is not None:  # exited: its PID may belong to someone else now
                continue
            try:
                self.seen.setdefault(proc.pid, psutil.Process(proc.pid))
            except psutil.NoSuchProcess:
                continue
        _record_descendants(self.seen)

    def watch(self, interval: float = WATCH_INTERVAL_S) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(interval):
                self.snapshot()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def stop_all(self, timeout: float = 10.0) -> list[int]:
        """Stop everything in one wave: SIGTERM to every started process's group and every descendant seen, one
        wait of up to ``timeout`` for all of them together, then SIGKILL. Returns PIDs still alive afterwards
        (should be empty)."""
        self._stop.set()
        self.snapshot()
        terminate_processes([p for p in self.seen.values() if _alive(p)], timeout=timeout,
                            groups=[proc.pid for proc in self.started])  # a group outlives an exited leader
        for proc in self.started:  # psutil reaped them; Popen records the exit
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        return [p.pid for p in self.seen.values() if _alive(p)]


# ----------------------------------------------------------------------------- signals
class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; ``signum`` says which (exit code ``128 + signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


STOP_SIGNALS: tuple[int, ...] = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                                      if hasattr(signal, name))


@contextmanager
def signals_as_interrupt(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Turn ``signals`` into :class:`Interrupted` (a ``KeyboardInterrupt``) so cleanup in ``finally`` runs.

    Only the first signal interrupts; later ones are ignored until the block is left, so a second
    Ctrl-C or SIGTERM cannot abort the cleanup half-way. Outside the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="process helpers; 'watchdog' stops a tree when its parent dies")
    sub = parser.add_subparsers(dest="command", required=True)
    wd = sub.add_parser("watchdog")
    wd.add_argument("--parent", type=int, required=True, help="PID whose death stops the tree")
    wd.add_argument("--root", type=int, required=True, action="append",
                    help="PID of a tree's root (the SuperLink, the SuperExec); repeatable")
    wd.add_argument("--interval", type=float, default=WATCH_INTERVAL_S)
    args = parser.parse_args(argv)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return watchdog(args.parent, args.root, args.interval)


if __name__ == "__main__":
    sys.exit(main())
