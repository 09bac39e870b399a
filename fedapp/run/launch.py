"""Run the app with ``flwr run`` against a private local SuperLink, and stop it afterwards.

``flwr run . local`` would start a *detached* SuperLink on fixed ports that outlives the
command. This launcher instead starts ``flower-superlink --simulation`` itself on a free loopback port, and the
SuperExec next to it (``--isolation process``), writes a Flower config (``$FLWR_HOME/config.toml``, default
``./.flwr``) naming the SuperLink, and submits the run with ``flwr run <app> dpfl`` (on a staged copy of the app's
packages and ``pyproject.toml``, :mod:`fedapp.run.fab`); the SuperExec and ``flwr run`` import Flower while the
SuperLink starts (:mod:`fedapp.run.cli_preload`). It follows the ServerApp's log while the run goes on (from a file,
not through a ``flwr run --stream`` process held for the whole run: :mod:`fedapp.compat.server_log`), copies it to
``flower.log`` in the run's results folder and prints one line a round (``--verbose`` or ``DPFL_VERBOSE=1``: the whole
log), ends with a one-screen summary of the results (:mod:`fedapp.run.console`), and stops the SuperLink, the SuperExec and their children by PID as soon as the ServerApp has
logged its last line (or its process has ended), when the run fails, on SIGINT (Ctrl-C), SIGTERM or SIGHUP (exit
code 128 + signal), and — through a parent-death signal and a watchdog process — when the launcher itself is
killed.

    python -m fedapp.run.launch --num-supernodes 20 --run-config "strategy='robust-hdp' num-server-rounds=5"

The run-config is validated here first, so bad input fails before anything starts: the keys and values in
process (with the client counts and indices they give against ``--num-supernodes``), then a dry run that builds
the strategy, its mechanism (the noise calibration included) and one client in a spawned child — skipped when the
same run-config passed it before with the same code, libraries and data (:mod:`fedapp.run.dry_run_cache`).

``--engine run-simulation`` runs the same apps on Flower's ``run_simulation`` Python API in one child
process instead (:mod:`fedapp.run.simulation_engine`): no SuperLink, SuperExec or ``flwr run``, so less
memory and start-up; the same validation, the same results folder, the same stop-by-PID guarantees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from fedapp.compat import lean_superexec
from fedapp.compat.early_ray import init_args_env as early_ray_env
from fedapp.compat.server_log import ENV as SERVER_LOG_ENV
from fedapp.compat.server_log import RESULTS_FOLDER_LINE, RUN_END_LINE, LogFollower
from fedapp.compat.thread_backend import BACKENDS as CLIENT_BACKENDS
from fedapp.compat.thread_backend import ENV as CLIENT_BACKEND_ENV
from fedapp.compat.thread_backend import THREADS
from fedapp.config import SCHEMA, ConfigError, RunConfig, check_fault_config, check_federation_size, resolve_config
from fedapp.config.keys import NODE_LOCAL
from fedapp.run.cli_preload import PreloadedCommand
from fedapp.run.console import FLOWER_LOG, PREFIX, display_path, echo, echo_all, plain, summary_lines, verbose_from_env
from fedapp.run.dry_run_cache import dry_run_fields, passed_before, remember_pass
from fedapp.run.fab import stage_app
from fedapp.run.processes import (
    CONNECTION,
    PROJECT_ROOT,
    Interrupted,
    Processes,
    absolutize_paths,
    cmdline,
    flower_env,
    free_port,
    list_runs,
    parent_death_preexec,
    parse_overrides,
    pyproject_run_config,
    signals_as_interrupt,
    simulation_backend,
    start_superlink,
    start_watchdog,
    superexec_args,
    to_toml_assignments,
    venv_bin,
    wait_http_health,
    write_flower_config,
)
from fedapp.state.results import run_ended


def resolve_flwr_home(app: Path, flwr_home: Path | None = None) -> Path:
    """Flower's home for this launch: ``flwr_home``, else ``$FLWR_HOME``, else ``<app>/.flwr``."""
    chosen = flwr_home or (Path(os.environ["FLWR_HOME"]) if os.environ.get("FLWR_HOME") else app / ".flwr")
    return Path(chosen).expanduser().resolve()


def dry_run_in_child(run_config: Mapping[str, Any], num_clients: int) -> list[str]:
    """:func:`fedapp.apps.server_app.dry_run` in a freshly spawned child process, so the dataset, model, accountant
    and client it builds (and torch itself) are freed when it exits instead of staying resident in the
    launcher for the whole run (~230 MB of the run's peak). Its errors (``ConfigError`` …) are raised here
    unchanged. ``spawn``, not ``fork``: the launcher already runs threads (importing flwr starts one), and
    forking a multi-threaded process can deadlock the child."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_dry_run_child, args=(send, run_config, num_clients), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(DRY_RUN_TIMEOUT_S):
            child.kill()
            raise RuntimeError(f"the configuration check (dry run) did not finish within {DRY_RUN_TIMEOUT_S:.0f} s")
        ok, value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the configuration check (dry run) died with exit code {child.exitcode}") from None
    child.join()
    if not ok:
        raise value
    return value


DRY_RUN_TIMEOUT_S = 900.0


def _dry_run_child(send, run_config: Mapping[str, Any], num_clients: int) -> None:
    from fedapp.apps.server_app import dry_run

    try:
        send.send((True, dry_run(run_config, num_clients)))
    except BaseException as exc:  # noqa: BLE001 — every failure goes back to the launcher
        try:
            send.send((False, exc))
        except Exception:  # an exception that does not pickle: its text still names the value
            send.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


def run(num_supernodes: int = 20, run_config: str | None = None, app: Path = PROJECT_ROOT,
        flwr_home: Path | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
        timeout: float | None = None, port: int | None = None, ray_address: str = "",
        engine: str = "superlink", verbose: bool = False, client_backend: str = "auto") -> Path:
    """Validate, run the app on ``engine``, stop everything; returns the new results folder.

    ``engine``: ``superlink`` (a private SuperLink and ``flwr run``) or ``run-simulation`` (Flower's
    ``run_simulation`` in one child process, :mod:`fedapp.run.simulation_engine`). ``client_backend``: where the
    engine runs the ClientApps, ``ray`` (Flower's actors) or ``threads`` (the engine's own threads,
    :mod:`fedapp.compat.thread_backend`: CPU only, on this machine); ``auto`` (:func:`resolve_client_backend`):
    threads for this project's apps on this machine's CPUs, else Ray. Flower's whole log goes to
    ``flower.log`` in the results folder; ``verbose`` also prints it, else only one line a round and Flower's
    warnings and errors are printed (:mod:`fedapp.run.console`)."""
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: valid engines are {', '.join(ENGINES)}")
    app = app.resolve()
    if engine == "run-simulation" and app != PROJECT_ROOT.resolve():
        raise ConfigError(f"--engine run-simulation runs this project's apps from {PROJECT_ROOT}; --app {app} needs "
                          "--engine superlink")
    if engine != "run-simulation":
        superlink_cpus(num_cpus, ray_address)  # a fraction it cannot pass: refused before anything starts
    check_client_backend(client_backend, num_gpus, ray_address)
    client_backend = resolve_client_backend(client_backend, num_gpus, ray_address, app)
    cfg, overrides, merged = checked_config(num_supernodes, run_config, app)
    print(f"[dpfl] ClientApps on {CLIENT_BACKEND_NAMES[client_backend]} (--client-backend {client_backend})", flush=True)
    output_dir = absolutize_paths(cfg.general.output_dir, cfg.data.data_dir, overrides, app)
    before = list_runs(output_dir)
    results = NewRun(announce=not verbose)
    if engine == "run-simulation":
        log_hint = f"{FLOWER_LOG} in the results folder, or the engine's log named above"
        _run_python_engine({**merged, **overrides}, num_supernodes, num_cpus, num_gpus, timeout, ray_address,
                           results, verbose, client_backend)
    else:
        flwr_home = resolve_flwr_home(app, flwr_home)
        port = port or free_port()
        log_hint = f"{server_log_path(flwr_home, port)} and {flwr_home}/superlink-{port}.log"
        _run_superlink_engine(app, overrides, flwr_home, port, num_supernodes, num_cpus, num_gpus, timeout,
                              ray_address, results, verbose, client_backend)
    folder = results.folder  # named by this run's ServerApp in its log
    if folder is None:
        new_runs = sorted(list_runs(output_dir) - before, key=lambda p: p.stat().st_mtime)
        folder = new_runs[-1] if new_runs else None
    if folder is None or not (folder / "summary.json").exists():
        raise RuntimeError(f"the run finished but wrote no results folder under {output_dir}; see "
                           f"{log_hint}")
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    if not summary.get("finished"):
        why = f" ({summary['stopped_reason']})" if summary.get("stopped_reason") else ""
        raise RuntimeError(f"{summary.get('rounds_trained')} of {cfg.rounds} rounds trained{why}; partial "
                           f"results in {folder}, server log: {log_hint}")
    return folder


class NewRun:
    """The results folder this launch's ServerApp names in its log (:data:`RESULTS_FOLDER_LINE`: another launch
    into the same output folder cannot be mistaken for it) and what its ``summary.json`` says. A summary with
    ``finished`` or a ``stopped_reason`` is the ServerApp's last file of a run that ended
    (:meth:`fedapp.state.results.ResultsWriter.finish`).

    Every line it reads also goes to ``flower.log`` in that folder (:data:`~fedapp.run.console.FLOWER_LOG`; the lines
    read before the folder was named are written once it is), without terminal colour codes; ``announce`` prints
    where the folder and that log are as soon as the folder is named."""

    def __init__(self, announce: bool = False) -> None:
        self.folder: Path | None = None
        #: the log's last line (:data:`RUN_END_LINE`) was read: the ServerApp logs nothing more of the run
        self.log_complete = False
        self.announce = announce
        self._pending: list[str] = []
        self._log: IO[str] | None = None

    def saw(self, line: str) -> None:
        """Read a line of the ServerApp's log."""
        if self.folder is None and RESULTS_FOLDER_LINE in line:
            self.folder = Path(plain(line).split(RESULTS_FOLDER_LINE, 1)[1].strip())
            self._open_log()
        elif RUN_END_LINE in line:
            self.log_complete = True
        if self._log is not None:
            self._log.write(plain(line) + "\n")
            self._log.flush()
        else:
            self._pending.append(plain(line))

    def _open_log(self) -> None:
        assert self.folder is not None
        try:
            self._log = open(self.folder / FLOWER_LOG, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as exc:  # the run goes on; only the copy of its log is missing
            print(f"{PREFIX} WARNING: cannot write {self.folder / FLOWER_LOG}: {exc}", file=sys.stderr, flush=True)
            self._pending.clear()
            return
        self._log.writelines(line + "\n" for line in self._pending)
        self._log.flush()
        self._pending.clear()
        if self.announce:
            shown = display_path(self.folder)
            print(f"{PREFIX} results folder: {shown}{os.sep} (Flower's log: {shown / FLOWER_LOG})", flush=True)

    def close(self) -> None:
        """Close ``flower.log``."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def summary(self) -> dict[str, Any]:
        try:
            return json.loads((self.folder / "summary.json").read_text(encoding="utf-8")) if self.folder else {}
        except (OSError, ValueError):
            return {}

    def ended(self, summary: dict[str, Any] | None = None) -> bool:
        """Whether the run ended, from ``summary`` (one already read) or a fresh read of summary.json."""
        summary = self.summary() if summary is None else summary
        return run_ended(summary)


def checked_config(num_supernodes: int, run_config: str | None, app: Path) -> tuple[RunConfig, dict, dict]:
    """Every check before a process starts: the run-config, the federation size, fault options and the dry run
    (strategy, mechanism and one client built); returns (config, the overrides the run gets, the merged
    run-config). ``num-clients`` is set from ``num_supernodes``: the server waits for every SuperNode before
    round 1, so client-level DP is set up for the real n (q = r/n), not for whoever registered first."""
    overrides = parse_overrides(run_config)
    merged = {**pyproject_run_config(app), **overrides}
    cfg = resolve_config(merged)  # raises ConfigError before anything starts
    if cfg.data.dataset == NODE_LOCAL:
        raise ConfigError(f"run-config 'dataset' = {NODE_LOCAL!r} trains each SuperNode on its own node-config "
                          "'data-path', which a simulation's nodes do not have; deploy SuperNodes "
                          "(python -m fedapp.run.deploy --supernodes N --node-config '0:data-path=...' ..., "
                          "docs/deployment.md) or simulate with a dataset that is partitioned among the clients")
    if num_supernodes >= 2:  # before num-clients is set from it below, so that the error names --num-supernodes
        check_federation_size(cfg.general, cfg.training, num_supernodes, f"--num-supernodes {num_supernodes}")
    if num_supernodes >= 2 and not cfg.general.num_clients:
        overrides["num-clients"] = num_supernodes
        if cfg.general.min_available_clients == SCHEMA["min-available-clients"].default:
            overrides["min-available-clients"] = num_supernodes
        cfg = resolve_config({**merged, **overrides})
    check_fault_config(cfg.deployment)
    if num_supernodes < 2:
        raise ConfigError(f"--num-supernodes = {num_supernodes}: a federation needs at least 2 clients")
    fields = dry_run_fields(cfg, num_supernodes, app)
    unused = passed_before(fields)
    if unused is None:
        unused = dry_run_in_child(cfg, num_supernodes)
        remember_pass(fields, unused)
    else:
        print("[dpfl] configuration check: this run-config passed the dry run before with the same code, libraries "
              "and data (fedapp.run.dry_run_cache)", flush=True)
    for key in unused:
        print(f"[dpfl] WARNING: run-config {key!r} = {cfg[key]!r} is not read by strategy {cfg.general.strategy!r}; "
              "it has no effect", file=sys.stderr, flush=True)
    return cfg, overrides, merged


def plan(num_supernodes: int = 20, run_config: str | None = None, app: Path = PROJECT_ROOT) -> dict:
    """Every check :func:`run` makes before it starts a process (:func:`checked_config`), then the run's privacy
    plan (:mod:`fedapp.apps.privacy_plan`); nothing is started and nothing is written."""
    from fedapp.apps.privacy_plan import privacy_plan

    cfg, _, _ = checked_config(num_supernodes, run_config, app.resolve())
    return privacy_plan(cfg, num_supernodes)


ENGINES = ("superlink", "run-simulation")


def _run_python_engine(overrides: dict, num_supernodes: int, num_cpus: float, num_gpus: float,
                       timeout: float | None, ray_address: str, results: NewRun | None = None,
                       verbose: bool = True, client_backend: str = "ray") -> None:
    """Flower's ``run_simulation`` in a child process of its own session (its Ray daemons and actors are its
    descendants), watched like the SuperLink engine's tree and stopped by PID when it ends, fails or is
    interrupted. Its output goes to a file that is followed like the SuperLink engine's ServerApp log (each line to
    ``results``, printed when ``verbose``, else only the progress lines); the file is removed after a run that
    ended well, kept (and its last lines printed) after one that did not."""
    import tempfile

    from fedapp.run.simulation_engine import write_spec

    results = results or NewRun()
    simulation_backend(num_cpus, num_gpus, ray_address)  # the same checks as the SuperLink engine's
    fd, name = tempfile.mkstemp(prefix="dpfl-run-simulation-", suffix=".json")
    os.close(fd)
    spec = write_spec(Path(name), overrides, num_supernodes, num_cpus, num_gpus, ray_address)
    output = spec.with_suffix(".log")
    procs = Processes()
    watchdog = None
    ok = False
    env = os.environ.copy()
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"  # its lines reach the file, and the terminal, as they are written
    env[CLIENT_BACKEND_ENV] = client_backend
    show = echo(verbose)
    follower = LogFollower(output)

    def follow(final: bool = False) -> None:
        for line in follower.new_lines(final=final):
            show(line)
            results.saw(line)

    with signals_as_interrupt():
        try:
            with open(output, "wb") as sink:
                child = procs.add(subprocess.Popen([sys.executable, "-m", "fedapp.run.simulation_engine", str(spec)],
                                                   env=env, cwd=str(PROJECT_ROOT), start_new_session=True,
                                                   stdout=sink, stderr=subprocess.STDOUT,
                                                   preexec_fn=parent_death_preexec()))
            watchdog = start_watchdog(child)  # stops the child's tree (Ray included) if this process is killed
            print(f"{PREFIX} run_simulation engine pid {child.pid}: {num_supernodes} clients, "
                  f"{overrides.get('num-server-rounds')} rounds; its log: {output}", flush=True)
            procs.watch()
            start = time.monotonic()
            while child.poll() is None:
                follow()
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"the run did not finish within {timeout:.0f}s")
                time.sleep(0.1)
            follow(final=True)
            if child.returncode != 0:
                raise RuntimeError(f"the run_simulation engine exited with code {child.returncode}; its log: "
                                   f"{output}")
            ok = True
        finally:
            leftovers = procs.stop_all()
            follow(final=True)
            results.close()
            spec.unlink(missing_ok=True)
            if ok:
                output.unlink(missing_ok=True)
            elif not verbose:
                print_tail(output)
            if watchdog is not None:
                _stop_watchdog(watchdog)
            if leftovers:
                print(f"{PREFIX} WARNING: processes still alive after stop: {leftovers}", file=sys.stderr)


#: lines of Flower's log the launcher prints after a run that failed, when it printed only its progress
FAILURE_TAIL_LINES = 40


def print_tail(path: Path, lines: int = FAILURE_TAIL_LINES) -> None:
    """The last ``lines`` lines of ``path`` to stderr, named as such."""
    try:
        tail = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    except OSError:
        return
    if tail:
        print(f"{PREFIX} the last {len(tail)} lines of {path}:", file=sys.stderr, flush=True)
        print("\n".join(plain(line) for line in tail), file=sys.stderr, flush=True)


def _run_superlink_engine(app: Path, overrides: dict, flwr_home: Path, port: int, num_supernodes: int,
                          num_cpus: float, num_gpus: float, timeout: float | None, ray_address: str,
                          results: NewRun, verbose: bool = True, client_backend: str = "ray") -> None:
    """A private SuperLink on ``port``; the staged app submitted with ``flwr run``; the ServerApp's log
    (:mod:`fedapp.compat.server_log`) followed until ``results`` says the run ended or the ServerApp's process
    ends (printed when ``verbose``, else only its progress lines); everything stopped by PID. A run that did not
    finish gets the SuperLink's whole log of it printed before the SuperLink stops."""
    write_flower_config(flwr_home, f"127.0.0.1:{port}")
    if ray_address:  # attach the simulation runtime to an existing (multi-node) Ray cluster
        os.environ.update(simulation_backend(num_cpus, num_gpus, ray_address)[1])
    server_log = server_log_path(flwr_home, port)
    server_log.unlink(missing_ok=True)
    procs = Processes()
    watchdog = None
    staged: Path | None = None
    grace = STOP_GRACE_S
    with signals_as_interrupt():
        # the SuperExec and `flwr run` import Flower while the SuperLink starts (fedapp.run.cli_preload)
        cli = PreloadedCommand("flwr", flower_env(flwr_home), app)
        superexec: PreloadedCommand | None = None
        try:
            client_cpus, init_args = superlink_cpus(num_cpus, ray_address)
            flower = {**flower_env(flwr_home), SERVER_LOG_ENV: str(server_log), CLIENT_BACKEND_ENV: client_backend,
                      **runtime_env(ray_address, init_args, ray=client_backend != THREADS)}
            superlink = procs.add(start_superlink(flwr_home, port, env=flower, isolation="process"))
            superexec = PreloadedCommand("flower-superexec", {**flower, **lean_superexec_env(superlink.pid)},
                                         PROJECT_ROOT, superexec_args(port, superlink.pid),
                                         output=flwr_home / f"superexec-{port}.out", new_session=True)
            procs.add(superexec.proc)
            watchdog = start_watchdog(superlink, superexec.proc)  # stops both trees if this process is killed
            wait_http_health(port, proc=superlink)
            started = superexec.start()  # now that the SuperLink's Runtime API answers: no connection retries
            if started not in procs.started:  # the script, when the preloaded child could not import Flower
                procs.add(started)
            federation = (f"num-supernodes={num_supernodes} client-resources-num-cpus={client_cpus} "
                          f"client-resources-num-gpus={num_gpus} "
                          + " ".join(f"init-args-{k.replace('_', '-')}={json.dumps(v)}" for k, v in init_args.items()))
            staged = stage_app(app, flwr_home / "staged")  # what `flwr run` packs, without walking .venv (5 s)
            print(f"[dpfl] SuperLink pid {superlink.pid} on 127.0.0.1:{port} (FLWR_HOME {flwr_home}); running: "
                  f"flwr run {app.name} {CONNECTION}", flush=True)
            run_id = submit_run(staged, cli, overrides, federation)
            print(f"[dpfl] run {run_id} started; ServerApp log: {server_log}", flush=True)
            procs.watch()
            server = follow_run(procs, server_log, timeout, results, echo=echo(verbose))
            summary = results.summary()
            if results.ended(summary):
                grace = ENDED_STOP_GRACE_S  # its results are written: nothing left for a graceful shutdown to save
            if not summary.get("finished"):
                print(f"[dpfl] the ServerApp process {server} ended and the run did not finish; the SuperLink's "
                      f"log of run {run_id}:", file=sys.stderr, flush=True)
                print_flower_log(run_id, flwr_home, app)
        finally:
            results.close()
            cli.close()
            if superexec is not None:
                superexec.close()  # a SuperExec never told to start (it started: nothing left to close)
            leftovers = procs.stop_all(grace)
            if staged is not None and staged != app:
                shutil.rmtree(staged, ignore_errors=True)
            if watchdog is not None:
                _stop_watchdog(watchdog)
            if leftovers:
                print(f"[dpfl] WARNING: processes still alive after stop: {leftovers}", file=sys.stderr)


#: the launcher's Ray ``init_args`` for the federation it submits (``--federation-config`` ``init-args-*``)
FEDERATION_INIT_ARGS = {"logging_level": "ERROR", "log_to_driver": True}
#: how often the SuperExec asks the SuperLink for a run to start (Flower's default: every 1 s)
SUPEREXEC_POLL_S = 0.1
SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"


def superlink_cpus(num_cpus: float, ray_address: str = "") -> tuple[int, dict[str, Any]]:
    """(CPUs a client, Ray's ``init_args``) of the federation the SuperLink engine submits.

    Flower's federation config holds whole CPUs a client (``client-resources-num-cpus`` is an integer in its
    protocol; a fraction fails inside ``flwr run``). A fraction f becomes one CPU a client on a Ray head started
    with ⌊cores / f⌋ logical CPUs: Flower's Ray backend keeps ⌊CPUs / CPUs a client⌋ ClientApps, so as many as f
    would give (Ray counts CPUs; it does not pin them). An attached cluster (``ray_address``) has the CPUs it has:
    there a fraction is refused."""
    if not num_cpus > 0:
        raise ConfigError(f"client num-cpus = {num_cpus!r} must be > 0")
    if float(num_cpus).is_integer():
        return int(num_cpus), dict(FEDERATION_INIT_ARGS)
    if ray_address:
        raise ConfigError(f"--num-cpus {num_cpus!r}: the SuperLink engine gives Flower whole CPUs a client, and the Ray "
                          f"cluster at --ray-address {ray_address!r} has the CPUs it has; use a whole number, or "
                          "--engine run-simulation")
    return 1, {**FEDERATION_INIT_ARGS, "num_cpus": max(1, int((os.cpu_count() or 1) / num_cpus))}


def runtime_env(ray_address: str = "", init_args: dict[str, Any] | None = None, ray: bool = True) -> dict[str, str]:
    """Environment for the SuperLink and what it starts: the SuperExec asks for new runs every
    :data:`SUPEREXEC_POLL_S` (Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; a value the caller set is kept), and
    the simulation runtime starts Ray while it loads the apps with the federation's ``init_args``
    (:mod:`fedapp.compat.early_ray`; default :data:`FEDERATION_INIT_ARGS`), except when it attaches to an existing
    cluster (``ray_address``) or starts no Ray (``ray`` False: the thread backend)."""
    env = {} if SUPEREXEC_POLL_ENV in os.environ else {SUPEREXEC_POLL_ENV: str(SUPEREXEC_POLL_S)}
    if not ray_address and ray:
        env.update(early_ray_env(FEDERATION_INIT_ARGS if init_args is None else init_args))
    return env


#: the launcher's ``--client-backend`` default: :func:`resolve_client_backend` picks one of the backends
AUTO = "auto"
#: how the launcher names each backend when it starts
CLIENT_BACKEND_NAMES = {THREADS: "threads of the simulation engine's process", "ray": "Ray actors"}


def check_client_backend(client_backend: str, num_gpus: float = 0.0, ray_address: str = "") -> None:
    """Refuse, before anything starts, a client backend that is unknown or cannot do what the launch asks."""
    if client_backend not in (AUTO, *CLIENT_BACKENDS):
        raise ConfigError(f"--client-backend {client_backend!r}: valid backends are "
                          f"{', '.join((AUTO, *CLIENT_BACKENDS))}")
    if client_backend == THREADS and num_gpus > 0:
        raise ConfigError(f"--client-backend threads trains on the CPU; --num-gpus {num_gpus:g} needs --client-backend "
                          "ray")
    if client_backend == THREADS and ray_address:
        raise ConfigError(f"--client-backend threads runs every client in one process of this machine; --ray-address "
                          f"{ray_address!r} needs --client-backend ray")


def resolve_client_backend(client_backend: str, num_gpus: float = 0.0, ray_address: str = "",
                           app: Path = PROJECT_ROOT) -> str:
    """The backend ``auto`` stands for: ``threads`` (:mod:`fedapp.compat.thread_backend`: no Ray head, daemons or
    actors; half the memory of Ray's on the pfl task, docs/benchmarks.md) for this project's apps on this machine's
    CPUs, whose ClientApp module installs it; ``ray`` with GPUs (the thread backend trains on the CPU), a Ray cluster
    to attach to, or another app (which may not install the thread backend). Any other value is returned as it is."""
    if client_backend != AUTO:
        return client_backend
    ours = app.resolve() == PROJECT_ROOT.resolve()
    return THREADS if ours and num_gpus <= 0 and not ray_address else "ray"


def lean_superexec_env(superlink_pid: int) -> dict[str, str]:
    """The SuperExec's extra environment: hand over to a small waiter once it has started the run
    (:mod:`fedapp.compat.lean_superexec`), unless this process's environment sets it ``off``."""
    if os.environ.get(lean_superexec.ENV, "").strip().lower() == "off":
        return {lean_superexec.ENV: ""}
    return {lean_superexec.ENV: str(superlink_pid)}


def server_log_path(flwr_home: Path, port: int) -> Path:
    """The file the ServerApp of the launch on ``port`` logs to (:mod:`fedapp.compat.server_log`)."""
    return flwr_home / f"serverapp-{port}.log"


#: how long stopping waits after SIGTERM before SIGKILL: after a failure or an interrupt, and after a run whose results
#: are all written (Flower's simulation runtime takes ~4 s to shut Ray down on SIGTERM, nothing of the run needs it;
#: the SuperLink and its SuperExec exit within ~0.2 s)
STOP_GRACE_S = 10.0
ENDED_STOP_GRACE_S = 0.25
#: how long the launcher goes on printing the log of a run whose summary.json says it ended, waiting for the
#: ServerApp's last line (the last round's line and Flower's summary come after that file)
LOG_END_WAIT_S = 5.0
#: how long the launcher waits for ``flwr run`` to submit, and for Flower's simulation runtime to start after that
SUBMIT_TIMEOUT_S = 120.0
SERVER_START_TIMEOUT_S = 120.0


def submit_run(staged: Path, cli: PreloadedCommand, overrides: dict, federation: str) -> int:
    """``flwr run`` without ``--stream`` (in ``cli``: :mod:`fedapp.run.cli_preload`): it returns once the SuperLink
    has started the run; returns the run ID.

    A process of its own, stopped when this one is interrupted."""
    args = ["run", str(staged), CONNECTION, "--format", "json", "--run-config", to_toml_assignments(overrides),
            "--federation-config", federation]
    try:
        done = cli.run(args, timeout=SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"flwr run did not submit the run within {SUBMIT_TIMEOUT_S:.0f} s") from None
    try:
        reply = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        reply = {}
    if done.returncode != 0 or not reply.get("success") or not reply.get("run-id"):
        raise RuntimeError(f"flwr run exited with code {done.returncode} without starting the run: "
                           f"{(done.stdout + done.stderr).strip()[-2000:]}")
    return int(reply["run-id"])


def follow_run(procs: Processes, server_log: Path, timeout: float | None, results: NewRun, poll: float = 0.1,
               start_timeout: float = SERVER_START_TIMEOUT_S, echo: Callable[[str], None] = echo_all) -> int:
    """Print ``server_log`` as it grows (each line to ``echo``, default every line; each also to ``results``) until the ServerApp logs its last line
    (:data:`RUN_END_LINE`) or the process that runs it (Flower's simulation runtime, a child of the SuperExec)
    has ended; returns that process's PID. This lets the launcher stop the run as soon as it is over, not seconds
    later when Flower's runtime has shut Ray down and exited. A run whose ``summary.json`` says it ended gets at most
    :data:`LOG_END_WAIT_S` more for that line (a ServerApp that failed after its results were written). Raises
    ``TimeoutError`` after ``timeout`` and ``RuntimeError`` when no such process appears within ``start_timeout``."""
    import psutil

    follower = LogFollower(server_log)
    start = time.monotonic()
    server: psutil.Process | None = None
    ended_at: float | None = None  # when summary.json first said the run ended

    def show(lines: list[str]) -> None:
        for line in lines:
            echo(line)
            results.saw(line)

    while True:
        show(follower.new_lines())
        if server is None:
            procs.snapshot()  # the tree is small until Ray starts, and the runtime starts within seconds
            server = next((p for p in list(procs.seen.values())
                           if any(m in cmdline(p) for m in SERVER_APP_MARKERS)), None)
            if server is None and time.monotonic() - start > start_timeout:
                raise RuntimeError(f"the SuperLink started no ServerApp process within {start_timeout:.0f} s")
        else:
            if ended_at is None and results.ended():
                ended_at = time.monotonic()
            if (results.log_complete or not _running(server)
                    or (ended_at is not None and time.monotonic() - ended_at > LOG_END_WAIT_S)):
                show(follower.new_lines(final=True))
                return server.pid
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"the run did not finish within {timeout:.0f}s")
        time.sleep(poll)


def print_flower_log(run_id: int, flwr_home: Path, app: Path) -> None:
    """``flwr log RUN_ID --show``: everything the SuperLink holds of the run's log (Flower's own messages from
    before the ServerApp's module was loaded included), to stderr."""
    try:
        done = subprocess.run([venv_bin("flwr"), "log", str(run_id), CONNECTION, "--show"], env=flower_env(flwr_home),
                              cwd=str(app), capture_output=True, text=True, timeout=60,
                              preexec_fn=parent_death_preexec())
        print((done.stdout + done.stderr).rstrip(), file=sys.stderr, flush=True)
    except subprocess.TimeoutExpired:
        print("[dpfl] flwr log did not answer within 60 s", file=sys.stderr, flush=True)


#: command-line markers of the process that runs the ServerApp (simulation runtime, or a deployed ServerApp)
SERVER_APP_MARKERS = ("flwr-simulation", "flwr-serverapp")


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_watchdog(proc: subprocess.Popen) -> None:
    """Stop the watchdog by PID once the tree it guards has been stopped (on its own it notices only at its next
    look, up to ``WATCH_INTERVAL_S`` later)."""
    proc.terminate()
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-supernodes", type=int, default=20)
    parser.add_argument("--run-config", default=None, help="TOML assignments, e.g. \"strategy='fedavg' seed=1\"")
    parser.add_argument("--app", type=Path, default=PROJECT_ROOT)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per simulated client")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per simulated client (fractional ok)")
    parser.add_argument("--ray-address", default="", help="attach to an existing Ray cluster: auto, host:port, ray://host:port")
    parser.add_argument("--engine", default="superlink", choices=ENGINES,
                        help="superlink: a private SuperLink + `flwr run` (default); run-simulation: Flower's "
                             "run_simulation (deprecated by Flower in favour of `flwr run`) in one process, without "
                             "SuperLink and SuperExec: less memory and start-up (docs/benchmarks.md)")
    parser.add_argument("--client-backend", default=AUTO, choices=(AUTO, *CLIENT_BACKENDS),
                        help="where the engine runs the ClientApps: threads (the engine's own threads in one process, "
                             "CPU only: half the memory and a shorter start, but a client that crashes the process "
                             "ends the run; fedapp.compat.thread_backend), ray (Flower's actors, one process each) or "
                             "auto (default: threads for this project's apps without GPUs or --ray-address, else ray)")
    parser.add_argument("--verbose", action="store_true", default=verbose_from_env(),
                        help="print Flower's whole log while the run goes on (default: one line a round; the whole "
                             "log is in flower.log in the results folder either way); also DPFL_VERBOSE=1")
    parser.add_argument("--plan", action="store_true",
                        help="validate and build everything, print the privacy plan (mechanism, σ, q, rounds, planned "
                             "epsilon_vs_server / epsilon_vs_release per client) and start nothing")
    args = parser.parse_args(argv)
    if args.plan:
        try:
            print(json.dumps(plan(args.num_supernodes, args.run_config, args.app), indent=1, ensure_ascii=False))
        except ConfigError as exc:
            print(f"[dpfl] configuration error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        run_dir = run(args.num_supernodes, args.run_config, args.app, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                      ray_address=args.ray_address, engine=args.engine, verbose=args.verbose,
                      client_backend=args.client_backend)
    except ConfigError as exc:
        print(f"[dpfl] configuration error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"[dpfl] run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else 2
        print(f"[dpfl] interrupted by signal {signum}; every process it started was stopped", file=sys.stderr)
        return 128 + signum
    print("\n".join(summary_lines(run_dir, display_path(run_dir))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
