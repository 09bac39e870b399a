"""Deployment with real processes: one ``flower-superlink`` + N ``flower-supernode`` on loopback.

    python -m fedapp.run.deploy --supernodes 3 --run-config "strategy='robust-hdp' num-server-rounds=2"

1. validates the run-config and every SuperNode's ``--node-config`` (before anything starts);
2. creates a local CA, the SuperLink's TLS certificate and one EC key pair per SuperNode
   (``scripts/make_certs.py``) unless ``--insecure``;
3. starts ``flower-superlink`` on 127.0.0.1 only (TLS, ``--enable-supernode-auth``; Flower 1.41 serves
   Fleet, Control and runtime APIs on one port, so the Control API is reachable only from this
   host) and :mod:`fedapp.run.fleet_gateway` on ``--public-host``, which forwards only the Fleet API;
   registers each SuperNode's
   public key with ``flwr supernode register`` (unless ``--no-auth``), starts the SuperNodes
   (:mod:`fedapp.run.supernode`: Flower's ``flower-supernode`` retrying TLS handshakes cut short),
   each with its own ``--node-config`` (partition-id, num-partitions, and per-node epsilon,
   delta, batch-size, local-epochs, data-path, label-column … from ``--node-config i:key=value ...``);
4. runs ``flwr run <app> dpfl --stream``, watching the processes (:func:`await_run`: a SuperLink, gateway or
   SuperNode that exits mid-run, or a run no ServerApp picks up, ends it with the logs' tails), and prints the new
   results folder;
5. stops *every* process it started and every descendant it saw (SIGTERM, then SIGKILL, by PID),
   also on Ctrl-C, SIGTERM, SIGHUP or failure.

``--unauthorized K`` also starts K SuperNodes whose keys were never registered; the SuperLink
refuses them (they exit with Flower's code 305) — a check that authentication is on.

What it protects: TLS (server authentication + encryption of the channel), SuperNode
authentication (only keys the operator registered on the SuperLink host join) and a control plane
that the SuperNodes' network cannot reach (``--outsider`` checks it). Differential privacy is the strategy's business;
the run-config decides it exactly as in simulation.

For SuperNodes on other machines see ``docs/deployment.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedapp.config import ConfigError, DataConfig, GeneralConfig, RunConfig, TrainingConfig, resolve_config
from fedapp.data.node_data import is_node_local
from fedapp.privacy.node_policy import POLICY_KEYS, node_refusal
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
    parse_overrides,
    pyproject_run_config,
    signals_as_interrupt,
    start_superlink,
    to_toml_assignments,
    venv_bin,
    write_flower_config,
)
from fedapp.state.results import run_ended


def _toml_bool(raw: str) -> bool:
    """A node-config boolean as TOML writes it."""
    if raw not in ("true", "false"):
        raise ValueError(raw)
    return raw == "true"


NODE_KEYS: dict[str, Any] = {
    "partition-id": int, "num-partitions": int, "epsilon": float, "delta": float, "batch-size": int,
    "local-epochs": int, "reported-epsilon": float, "dataset": str, "data-path": str, "label-column": str,
    "state-dir": str, "min-round-clients": int,
    "min-noise-multiplier": float, "lifetime-epsilon": float, "lifetime-delta": float,
    **{key: (_toml_bool if kind is bool else kind) for key, kind in POLICY_KEYS.items()}}
AUTH_REFUSED_EXIT = 305  # flower-supernode: "Failed to activate SuperNode" (the shell sees 305 % 256 = 49)


# ----------------------------------------------------------------------------- configuration
def parse_node_config(text: str) -> dict[str, Any]:
    """``'epsilon=0.8 batch-size=32 dataset="digits"'`` → typed dict (``ConfigError`` naming the bad part)."""
    out: dict[str, Any] = {}
    for token in shlex.split(text):
        key, sep, raw = token.partition("=")
        if not sep or not key:
            raise ConfigError(f"node-config entry {token!r} is not key=value")
        if key not in NODE_KEYS:
            raise ConfigError(f"unknown node-config key {key!r}; valid: {sorted(NODE_KEYS)}")
        try:
            out[key] = NODE_KEYS[key](raw)
        except ValueError:
            kind = "true or false" if NODE_KEYS[key] is _toml_bool else NODE_KEYS[key].__name__
            raise ConfigError(f"node-config {key!r} expects {kind}, got {raw!r}") from None
    return out


def node_configs(num: int, per_node: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One node-config per SuperNode: ``partition-id=i num-partitions=num`` plus ``i:key=value ...`` overrides."""
    if num < 2:
        raise ConfigError(f"--supernodes = {num}: a federation needs at least 2 SuperNodes")
    configs: list[dict[str, Any]] = [{"partition-id": i, "num-partitions": num} for i in range(num)]
    for item in per_node:
        match = re.fullmatch(r"\s*(\d+)\s*:(.*)", item)
        if not match:
            raise ConfigError(f"--node-config {item!r} must look like '<index>:key=value ...'")
        idx = int(match.group(1))
        if idx >= num:
            raise ConfigError(f"--node-config {item!r}: SuperNode {idx} does not exist (0..{num - 1})")
        configs[idx].update(parse_node_config(match.group(2)))
    for node in configs:  # a SuperNode runs in its own working folder: a relative data-path is the launcher's
        if "data-path" in node:
            node["data-path"] = str(Path(os.path.expanduser(str(node["data-path"]))).resolve())
    return configs


def validate_nodes(general: GeneralConfig, training: TrainingConfig, data: DataConfig,
                   configs: Sequence[Mapping[str, Any]]) -> None:
    """Each SuperNode's profile resolves and matches the run (before any process starts)."""
    from fedapp.data.client_data import client_train_sizes
    from fedapp.privacy.profiles import client_profile

    if is_node_local(data):
        validate_node_data(general, training, data, configs)
        return
    for node in configs:
        for key in ("data-path", "label-column"):
            if key in node:
                raise ConfigError(f"SuperNode {node['partition-id']}: node-config {key!r} is read only with run-config "
                                  f"'dataset' = 'node-local' (here {data.dataset!r}, a partition of one run-wide "
                                  "dataset); set dataset = 'node-local' or leave the key out")
    sizes = client_train_sizes(data, general.seed, len(configs))
    for node in configs:
        if "dataset" in node and node["dataset"] != data.dataset:
            raise ConfigError(f"SuperNode {node['partition-id']}: node-config dataset {node['dataset']!r} differs "
                              f"from run-config dataset {data.dataset!r}")
        profile = client_profile(general, training, data, node)
        if profile.batch_size > sizes[profile.client_id]:
            raise ConfigError(f"SuperNode {profile.client_id}: batch-size {profile.batch_size} > its dataset size "
                              f"N_i = {sizes[profile.client_id]}")


def validate_node_data(general: GeneralConfig, training: TrainingConfig, data: DataConfig,
                       configs: Sequence[Mapping[str, Any]]) -> None:
    """``dataset = 'node-local'`` with every SuperNode on this machine: read each node's ``data-path`` as that node
    will, and refuse (naming the node and its node-config key) what the node would refuse once started."""
    from fedapp.clients.common import node_batch
    from fedapp.data.node_data import NodeDataError, node_splits
    from fedapp.privacy.profiles import client_profile

    for node in configs:
        profile = client_profile(general, training, data, node)
        try:
            train, _, _ = node_splits(node, data, general.seed, profile.client_id)
            node_batch(profile, training, node, len(train))
        except NodeDataError as exc:
            raise ConfigError(f"SuperNode {node['partition-id']}: {exc}") from None


def check_node_policies(cfg: RunConfig, configs: Sequence[Mapping[str, Any]]) -> None:
    """Refuse, before any process starts, a run-config that a SuperNode's privacy policy would refuse on the node
    (:class:`fedapp.privacy.node_policy.NodePolicy`; the node enforces it itself whatever the launcher does)."""
    for node in configs:
        reason = node_refusal(cfg, node, on_supernode=True)
        if reason is not None:
            raise ConfigError(f"SuperNode {node['partition-id']}: {reason}; allow it in that node's --node-config "
                              "or change the run-config")


def node_config_arg(node: Mapping[str, Any]) -> str:
    """The ``--node-config`` string Flower parses (TOML values)."""
    return to_toml_assignments(dict(node))


# ----------------------------------------------------------------------------- processes
def wait_https_health(port: int, ca: Path | None, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    scheme = "https" if ca else "http"
    verify: Any = ssl.create_default_context(cafile=str(ca)) if ca else True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{scheme}://127.0.0.1:{port}/health", timeout=2.0, verify=verify).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink on 127.0.0.1:{port} not healthy after {timeout:.0f}s")


def start_supernode(work: Path, env: dict[str, str], superlink: str, node: Mapping[str, Any], name: str, *,
                    ca: Path | None, key: Path | None, max_wait: float = 60.0) -> subprocess.Popen:
    # Flower's flower-supernode, whose fleet connection retries a TLS handshake cut short (fedapp.run.supernode)
    cmd = [sys.executable, "-m", "fedapp.run.supernode", "--superlink", superlink, "--port", str(free_port()),
           "--node-config", node_config_arg(node), "--max-wait-time", str(max_wait)]
    cmd += ["--root-certificates", str(ca)] if ca else ["--insecure"]
    if key is not None:
        cmd += ["--auth-supernode-private-key", str(key)]
    out = open(work / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=str(work))


def start_gateway(work: Path, env: dict[str, str], listen: str, upstream: str,
                  paths: Mapping[str, Path] | None) -> subprocess.Popen:
    """:mod:`fedapp.run.fleet_gateway`: the public face of the SuperLink (Fleet API only)."""
    cmd = [sys.executable, "-m", "fedapp.run.fleet_gateway", "--listen", listen, "--upstream", upstream]
    if paths is not None:
        cmd += ["--ssl-certfile", str(paths["cert"]), "--ssl-keyfile", str(paths["key"]),
                "--ssl-ca-certfile", str(paths["ca"])]
    out = open(work / "fleet-gateway.log", "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=str(PROJECT_ROOT))


def probe_as_outsider(work: Path, public: str, ca: Path | None, public_key: Path, app: Path) -> dict[str, str]:
    """Play the outsider who holds only ``ca.crt`` and the public address: register a key, list runs,
    start a run. Returns ``{action: "refused" | "ACCEPTED: ..."}``."""
    home = work / "outsider-home"
    write_flower_config(home, public, root_certificates=str(ca) if ca else None)
    env = flower_env(home)
    actions = {"register": ["supernode", "register", str(public_key), CONNECTION], "ls": ["ls", CONNECTION],
               "run": ["run", str(app), CONNECTION, "--run-config", "num-server-rounds=1"]}
    out: dict[str, str] = {}
    for name, args in actions.items():
        res = subprocess.run([venv_bin("flwr"), *args], env=env, capture_output=True, text=True, timeout=120,
                             cwd=str(work))
        text = (res.stdout + res.stderr).strip()
        ok = res.returncode == 0 and not re.search(r"403|not served|error|fail", text, re.IGNORECASE)
        out[name] = f"ACCEPTED: {text[-300:]}" if ok else "refused"
        (work / f"outsider-{name}.log").write_text(f"exit {res.returncode}\n{text}\n", encoding="utf-8")
    for name, path in TRAVERSALS.items():  # the Control API behind the gateway, by path tricks
        status = raw_request_status(public, ca, "POST", path)
        out[name] = "refused" if status in (400, 403, 404, 405) else f"ACCEPTED: HTTP {status} for {path}"
    return out


#: raw request paths an outsider tries against the gateway (written byte for byte: no client normalizes them)
TRAVERSALS = {"traversal-dots": "/v1/fleet/../control/list-runs",
              "traversal-encoded": "/v1/fleet/%2e%2e/control/register-node",
              "traversal-slash": "/v1/fleet/..%2fcontrol/list-runs"}


def raw_request_status(address: str, ca: Path | None, method: str, path: str) -> int:
    """The HTTP status of one request whose request line is sent exactly as given (TLS when ``ca``)."""
    import socket

    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        conn: Any = raw
        if ca is not None:
            conn = ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname=host)
        conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\n"
                     "Connection: close\r\n\r\n".encode("latin-1"))
        head = conn.recv(64).decode("latin-1")
    return int(head.split()[1]) if head.startswith("HTTP/") else -1


def register_supernode(env: dict[str, str], public_key: Path) -> None:
    res = subprocess.run([venv_bin("flwr"), "supernode", "register", str(public_key), CONNECTION],
                         env=env, capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or "registered successfully" not in res.stdout:
        raise RuntimeError(f"flwr supernode register {public_key.name} failed: {res.stdout[-500:]}{res.stderr[-500:]}")


def _make_certs():
    """``scripts/make_certs.py:make_all`` (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dpfl_make_certs", PROJECT_ROOT / "scripts" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_all


#: how long ``flwr run`` may take to get a ServerApp process started (Flower's SuperExec picks a pending run up)
SERVER_START_TIMEOUT_S = 180.0
#: how long ``flwr run --stream`` may keep streaming after the run's summary.json said it ended
STREAM_END_WAIT_S = 15.0
#: lines of each log quoted when a deployment fails
TAIL_LINES = 15


def await_run(runner: subprocess.Popen, watched: Mapping[str, subprocess.Popen], procs: Processes, output_dir: Path,
              before: set[Path], timeout: float | None, *, poll: float = 0.5,
              start_timeout: float = SERVER_START_TIMEOUT_S, end_wait: float = STREAM_END_WAIT_S) -> int:
    """Wait for ``runner`` (``flwr run --stream``) and return its exit code, watching what a silent wait would miss:

    * a process in ``watched`` (SuperLink, gateway, SuperNodes) that exits while the run goes on: the server would
      wait for its replies for ever (``RuntimeError`` naming it);
    * no ``flwr-serverapp`` process among ``procs``' descendants ``start_timeout`` seconds after ``flwr run``: the
      run stayed pending (``RuntimeError``);
    * a new run folder under ``output_dir`` (not in ``before``) whose summary.json says the run ended while the
      stream goes on ``end_wait`` seconds more: the stream is stopped and 0 returned (the results decide);
    * ``timeout`` seconds in all: ``TimeoutError``."""
    start = time.monotonic()
    server_started = False
    ended_at: float | None = None
    while True:
        code = runner.poll()
        if code is not None:
            return code
        for name, proc in watched.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} (pid {proc.pid}) exited with code {proc.returncode} during the run; "
                                   "the server would wait for its replies for ever")
        now = time.monotonic()
        if not server_started:
            procs.snapshot()
            server_started = any("flwr-serverapp" in cmdline(p) for p in list(procs.seen.values()))
            if not server_started and now - start > start_timeout:
                raise RuntimeError(f"no ServerApp process started within {start_timeout:.0f} s of flwr run: the run "
                                   "stayed pending on the SuperLink")
        if ended_at is None and _new_run_ended(output_dir, before):
            ended_at = now
        if ended_at is not None and now - ended_at > end_wait:
            runner.terminate()
            try:
                runner.wait(10)
            except subprocess.TimeoutExpired:
                runner.kill()
            return 0
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"the run did not end within {timeout:.0f} s")
        time.sleep(poll)


def _new_run_ended(output_dir: Path, before: set[Path]) -> bool:
    """Whether a run folder new since ``before`` has a summary.json saying the run finished or stopped."""
    import json

    for folder in list_runs(output_dir) - before:
        try:
            summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if run_ended(summary):
            return True
    return False


def log_tails(work: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of every log a deployment in ``work`` writes (``flwr run``, SuperLink, gateway,
    SuperNodes), for an error message that says what happened without a trip to the work folder."""
    paths = sorted(work.glob("*.log")) + sorted((work / "flwr-home").glob("superlink-*.out"))
    parts = [f"logs in {work}:"]
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        tail = [line for line in text if line.strip()][-lines:]
        parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


@dataclass
class DeployResult:
    run_dir: Path
    work_dir: Path
    refused: list[str]  # unauthorized SuperNodes the SuperLink refused
    leftover_pids: list[int]
    pids: list[int]  # every PID started or seen
    outsider: dict[str, str] = field(default_factory=dict)  # probe_as_outsider's verdicts


def deploy(num_supernodes: int = 3, run_config: str | None = None, *, node_overrides: Sequence[str] = (),
           tls: bool = True, auth: bool = True, unauthorized: int = 0, work_dir: Path | None = None,
           app: Path = PROJECT_ROOT, timeout: float | None = None, outsider: bool = False,
           public_host: str = "127.0.0.1", log=print, check_policies: bool = True,
           check_data: bool = True) -> DeployResult:
    """Validate, start SuperLink + SuperNodes, ``flwr run`` the app, stop everything (see module doc).
    ``check_policies = False`` / ``check_data = False`` (tests only) skip the launcher's look at each node's privacy
    policy / its data, so that the SuperNodes' own enforcement can be observed."""
    app = app.resolve()
    overrides = parse_overrides(run_config)
    overrides.setdefault("num-clients", num_supernodes)
    overrides.setdefault("min-available-clients", num_supernodes)
    cfg = resolve_config({**pyproject_run_config(app), **overrides})
    if cfg.general.num_clients != num_supernodes:
        raise ConfigError(f"run-config 'num-clients' = {cfg.general.num_clients} but --supernodes = {num_supernodes}")
    if (unauthorized or outsider) and not auth:
        raise ConfigError("--unauthorized/--outsider need SuperNode authentication (drop --no-auth)")
    nodes = node_configs(num_supernodes, node_overrides)
    if check_data:
        validate_nodes(cfg.general, cfg.training, cfg.data, nodes)
    if check_policies:
        check_node_policies(cfg, nodes)
    output_dir = absolutize_paths(cfg.general.output_dir, cfg.data.data_dir, overrides, app)

    work = Path(work_dir or tempfile.mkdtemp(prefix="dpfl-deploy-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    flwr_home = work / "flwr-home"
    flwr_home.mkdir(exist_ok=True)
    env = flower_env(flwr_home)
    port = free_port()  # the SuperLink (Fleet + Control + runtime APIs): loopback only
    address = f"127.0.0.1:{port}"
    public_port = free_port()  # the fleet gateway, the only thing SuperNodes reach
    public = f"{'127.0.0.1' if public_host in ('0.0.0.0', '::') else public_host}:{public_port}"
    procs = Processes()
    verdicts: dict[str, str] = {}
    refused: list[str] = []
    before = list_runs(output_dir)
    with signals_as_interrupt():
        try:
            ca = None
            key_paths: list[tuple[Any, Any]] = []
            if tls or auth:
                # the CA key is discarded after signing: nothing on the SuperLink host can mint certificates
                paths = _make_certs()(work / "certs", ("127.0.0.1", "localhost"),
                                      num_supernodes + unauthorized + int(outsider), ca_key_dir=None)
                ca = paths["ca"] if tls else None
                key_paths = [(paths[f"supernode-{i}"], paths[f"supernode-{i}.pub"])
                             for i in range(num_supernodes + unauthorized + int(outsider))]
            extra = ["--ssl-ca-certfile", str(paths["ca"]), "--ssl-certfile", str(paths["cert"]),
                     "--ssl-keyfile", str(paths["key"])] if tls else ["--insecure"]
            if auth:
                extra.append("--enable-supernode-auth")
            write_flower_config(flwr_home, address, root_certificates=str(ca) if ca else None)
            superlink = procs.add(start_superlink(flwr_home, port, simulation=False, extra_args=extra))
            gateway = procs.add(start_gateway(work, env, f"{public_host}:{public_port}", address,
                                              paths if tls else None))
            procs.watch()
            wait_https_health(port, ca, superlink)
            wait_https_health(public_port, ca, gateway)
            log(f"[deploy] SuperLink pid {superlink.pid} on {address} (loopback: Control API), fleet gateway pid "
                f"{gateway.pid} on {public_host}:{public_port} (Fleet API only; TLS {'on' if tls else 'off'}, "
                f"auth {'on' if auth else 'off'}); work dir {work}")
            if auth:
                for i in range(num_supernodes):
                    register_supernode(env, key_paths[i][1])
            supernodes: list[subprocess.Popen] = []
            for i, node in enumerate(nodes):
                key = key_paths[i][0] if auth else None
                p = procs.add(start_supernode(work, env, public, node, f"supernode-{i}", ca=ca, key=key))
                supernodes.append(p)
                log(f"[deploy] SuperNode {i} pid {p.pid}: --node-config '{node_config_arg(node)}'")
            intruders = []
            for j in range(unauthorized):
                key = key_paths[num_supernodes + j][0]
                node = {"partition-id": 0, "num-partitions": num_supernodes}
                intruders.append(procs.add(start_supernode(work, env, public, node, f"unauthorized-{j}", ca=ca,
                                                           key=key, max_wait=10)))
            if outsider:
                spare = key_paths[-1][1]  # a key pair nobody registered
                verdicts = probe_as_outsider(work, public, ca, spare, app)
                log(f"[deploy] outsider with ca.crt against {public}: {verdicts}")
            staged = stage_app(app, work)  # what `flwr run` packs, without walking .venv (5 s)
            cmd = [venv_bin("flwr"), "run", str(staged), CONNECTION, "--stream",
                   "--run-config", to_toml_assignments(overrides)]
            log(f"[deploy] flwr run {app.name} {CONNECTION} --stream --run-config '{to_toml_assignments(overrides)}'")
            with open(work / "flwr-run.log", "w") as out:
                runner = procs.add(subprocess.Popen(cmd, env=env, cwd=str(app), stdout=out,
                                                    stderr=subprocess.STDOUT, start_new_session=True))
            watched = {"the SuperLink": superlink, "the fleet gateway": gateway,
                       **{f"SuperNode {i}": p for i, p in enumerate(supernodes)}}
            try:
                returncode = await_run(runner, watched, procs, output_dir, before, timeout)
            except (RuntimeError, TimeoutError) as exc:
                raise type(exc)(f"{exc}\n{log_tails(work)}") from None
            for j, p in enumerate(intruders):
                try:
                    code = p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    code = None
                text = (work / f"unauthorized-{j}.log").read_text(errors="replace")
                if code in (AUTH_REFUSED_EXIT, AUTH_REFUSED_EXIT % 256) or "Failed to activate SuperNode" in text:
                    refused.append(f"unauthorized-{j}")
            if returncode != 0:
                raise RuntimeError(f"flwr run exited with code {returncode}\n{log_tails(work)}")
        finally:
            leftovers = procs.stop_all()
            if leftovers:
                log(f"[deploy] WARNING: processes still alive after stop: {leftovers}")
    new_runs = sorted(list_runs(output_dir) - before, key=lambda p: p.stat().st_mtime)
    if not new_runs or not (new_runs[-1] / "summary.json").exists():
        raise RuntimeError(f"the run finished but wrote no results folder under {output_dir}; see {work}")
    return DeployResult(new_runs[-1], work, refused, leftovers, sorted(procs.seen), verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supernodes", type=int, default=3, help="number of SuperNodes (clients)")
    parser.add_argument("--run-config", default=None, help="TOML assignments, e.g. \"strategy='robust-hdp'\"")
    parser.add_argument("--node-config", action="append", default=[], metavar="I:KEY=VALUE ...",
                        help="per-SuperNode overrides, e.g. '0:epsilon=0.5 batch-size=16' (repeatable)")
    parser.add_argument("--insecure", action="store_true", help="no TLS (plain HTTP on loopback)")
    parser.add_argument("--no-auth", action="store_true", help="no SuperNode authentication")
    parser.add_argument("--unauthorized", type=int, default=0, help="also start K unregistered SuperNodes")
    parser.add_argument("--outsider", action="store_true",
                        help="also play an outsider with ca.crt: register a key, list runs, start a run (all refused)")
    parser.add_argument("--public-host", default="127.0.0.1",
                        help="interface of the fleet gateway SuperNodes connect to (the SuperLink stays on loopback)")
    parser.add_argument("--work-dir", type=Path, default=None, help="certificates, FLWR_HOME and logs")
    parser.add_argument("--app", type=Path, default=PROJECT_ROOT)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before flwr run is stopped")
    args = parser.parse_args(argv)
    try:
        res = deploy(args.supernodes, args.run_config, node_overrides=args.node_config, tls=not args.insecure,
                     auth=not args.no_auth, unauthorized=args.unauthorized, work_dir=args.work_dir, app=args.app,
                     timeout=args.timeout, outsider=args.outsider, public_host=args.public_host)
    except ConfigError as exc:
        print(f"[deploy] configuration error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, FileNotFoundError) as exc:
        print(f"[deploy] run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print("[deploy] interrupted; every started process was stopped", file=sys.stderr)
        return 128 + (exc.signum if isinstance(exc, Interrupted) else 2)
    print(f"[deploy] results: {res.run_dir}")
    if res.refused:
        print(f"[deploy] refused by the SuperLink (unregistered keys): {', '.join(res.refused)}")
    if res.outsider:
        print(f"[deploy] outsider with ca.crt: {res.outsider}")
    print((res.run_dir / "summary.json").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    sys.exit(main())
