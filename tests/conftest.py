"""Shared fixtures: the test device (``--device``), real data locations, small real Flower simulations."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
if "DPFL_CACHE_DIR" not in os.environ:  # the shared dataset/calibration cache (fedapp.state.cache): one per session,
    _CACHE = tempfile.mkdtemp(prefix="dpfl-test-cache-")  # inherited by every process the tests start
    os.environ["DPFL_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=DEVICE_CHOICES, default=os.environ.get("DPFL_TEST_DEVICE", "auto"),
                     help="device of the tests that train (env DPFL_TEST_DEVICE): auto = CUDA when available, as "
                          "run-config 'device' = 'auto'; cpu hides every GPU (also from Ray workers and subprocesses); "
                          "cuda runs them on the GPU and skips them where there is none")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "secagg_guard: keep the client-level clients' refusal of a fit outside SecAgg+ "
                                       "in this in-process test (see the fit_outside_secagg fixture)")
    if config.getoption("--device") == "cpu":  # before anything initializes CUDA; inherited by every child process
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    """The ``torch.device`` the training tests use (``--device`` / ``DPFL_TEST_DEVICE``), decided by
    ``fedapp.clients.training.resolve_device`` like every client; ``cuda`` without a GPU skips the test."""
    import torch

    from fedapp.clients.training import resolve_device

    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda (DPFL_TEST_DEVICE=cuda) but no CUDA device is available here")
    return resolve_device(name)


@pytest.fixture(autouse=True)
def _fresh_resolved_configs():
    """resolve_config memoizes per process; each test starts without the previous tests' results (their
    filesystem checks ran against folders that test may have changed)."""
    from fedapp.config import clear_cache

    clear_cache()
    yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "MNIST" / "raw").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


def run_small_simulation(overrides: dict[str, Any], num_supernodes: int = 4) -> Path:
    """Run a real in-process Flower simulation (Ray backend) and return its results folder."""
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app
    from fedapp.compat.wakeups import wake_feeder

    wake_feeder()  # as the launcher's engines do (fedapp.compat.wakeups)
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = Path(overrides["output-dir"])
    before = set(out.iterdir()) if out.exists() else set()
    run_simulation(
        build_server_app(overrides), build_client_app(overrides), num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False}},
    )
    runs = sorted(p for p in set(out.iterdir()) - before if not p.name.startswith(".")) if out.exists() else []
    assert len(runs) == 1, f"expected one new results folder under {out}, found {runs}"
    return runs[0]


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]


def client_context(cid: int = 0, n: int = 4, *, node: dict[str, Any] | None = None, run_id: int = 1,
                   node_id: int | None = None, run_config: dict[str, Any] | None = None):
    """A Flower ``Context`` of client ``cid`` of ``n`` (partition-id / num-partitions, plus ``node``) with empty
    state, as a SuperNode hands it to a ClientApp."""
    from flwr.common import Context, RecordDict

    return Context(run_id=run_id, node_id=cid + 100 if node_id is None else node_id,
                   node_config={"partition-id": cid, "num-partitions": n, **(node or {})}, state=RecordDict(),
                   run_config=dict(run_config or {}))


def ledger_rows(rounds: list[dict[str, Any]], *fields: str) -> list[tuple]:
    """(round, client_id, *fields) of every client record of ``rounds`` (rounds.jsonl rows)."""
    return [(r["round"], c["client_id"], *(c[f] for f in fields)) for r in rounds for c in r["clients"]]


def follow_process_tree(root: Any, log: Path, until: Any, timeout: float, poll: float = 0.2) -> dict[int, Any]:
    """Record every descendant of the process ``root`` (a ``Popen``; by PID, also once re-parented) until
    ``until(seen)`` holds; returns them (``psutil.Process`` by PID). Fails with the end of ``log`` when ``root``
    exits or ``timeout`` passes first."""
    import time

    import psutil

    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert root.poll() is None, log.read_text()[-3000:]
        for proc in [psutil.Process(root.pid), *list(seen.values())]:
            try:
                for child in proc.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue
        if until(seen):
            return seen
        time.sleep(poll)
    raise AssertionError(f"not reached within {timeout:g}s: {log.read_text()[-3000:]}")


def client_manager(n: int):
    """A Flower ``SimpleClientManager`` with ``n`` registered stand-in clients (node ids 1..n) that a strategy's
    ``configure_fit`` can sample; calling one of them fails."""
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.client_proxy import ClientProxy

    class Proxy(ClientProxy):
        def get_properties(self, *a):  # pragma: no cover
            raise NotImplementedError

        get_parameters = fit = evaluate = reconnect = get_properties

    cm = SimpleClientManager()
    for i in range(n):
        p = Proxy(str(i))
        p.node_id = i + 1
        cm.register(p)
    return cm


def analytic_gaussian_epsilon(multiplier: float, delta: float) -> float:
    """Reference ε of one Gaussian mechanism with σ/Δ = z (Balle & Wang 2018, Thm 8), independent of the product's
    accountants: it is (ε, δ)-DP iff Φ(1/(2z) − εz) − e^ε Φ(−1/(2z) − εz) <= δ; δ(ε) is decreasing, so bisect on ε."""
    import math

    from scipy.stats import norm

    def delta_of(eps: float) -> float:
        return float(norm.cdf(0.5 / multiplier - eps * multiplier)
                     - math.exp(eps) * norm.cdf(-0.5 / multiplier - eps * multiplier))

    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def install_user_module(tmp_path: Path, monkeypatch: Any, name: str, source: str) -> str:
    """Write ``source`` as module ``name`` in a folder outside the project and make it importable here and in the Ray
    actors a simulation starts (``sys.path`` and ``PYTHONPATH``), as a user's app folder would be; the module is
    dropped from ``sys.modules`` when the test ends. Returns ``name``."""
    import sys

    folder = tmp_path / "user_code"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.fixture(autouse=True)
def _a_simulation_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts as a simulation process: once a test imports Flower's SuperNode ClientApp runtime, it stays in
    ``sys.modules`` and would make every later in-process client believe it runs on a SuperNode
    (:func:`fedapp.compat.runtime.on_supernode`). A test that wants a SuperNode sets the module itself."""
    from fedapp.compat.runtime import SUPERNODE_CLIENTAPP_MODULE

    monkeypatch.delitem(sys.modules, SUPERNODE_CLIENTAPP_MODULE, raising=False)


@pytest.fixture(autouse=True)
def fit_outside_secagg(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests call a client-level client's ``fit`` directly, without Flower's SecAgg+ protocol around it;
    under ``secure-aggregation = true`` (the default) the client refuses such a fit
    (:func:`fedapp.privacy.secure_aggregation.outside_secagg`). Here it is let through, so that those tests check what
    they are about; tests marked ``secagg_guard`` keep the refusal, and every Flower simulation or deployment (other
    processes, real SecAgg+) runs the real check."""
    if request.node.get_closest_marker("secagg_guard"):
        return
    for module in ("fedapp.clients.client_dp", "fedapp.clients.dp2_fedsam"):
        monkeypatch.setattr(f"{module}.outside_secagg", lambda context: False)


def one_round(strategy: Any, clients: list, tmp_path: Path) -> dict:
    """Round 1 of ``strategy`` in process: its fit instructions to ``clients`` (one per stand-in node of
    :func:`client_manager`), their replies back through ``aggregate_fit``; checks the model moved and returns the round
    record its recorder wrote to ``tmp_path``."""
    import json

    import numpy as np
    from flwr.common import parameters_to_ndarrays

    cm = client_manager(len(clients))
    params = strategy.initialize_parameters(cm)
    before = parameters_to_ndarrays(params)
    instructions = strategy.configure_fit(1, params, cm)
    assert len(instructions) == len(clients)
    replies = [(proxy, clients[int(proxy.node_id) - 1].fit(ins)) for proxy, ins in instructions]
    after, _ = strategy.aggregate_fit(1, replies, [])
    strategy.flush_round()
    assert after is not None and any(np.abs(a - b).max() > 0 for a, b in zip(parameters_to_ndarrays(after), before))
    return json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])


def in_secagg_collect(context: Any) -> None:
    """Put ``context`` where Flower's secaggplus_mod has it when it calls the client for the masked vector (the
    protocol state in ``Context.state`` at the key-sharing stage): a client-level client under SecAgg+ trains then."""
    from flwr.common import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE, Stage

    context.state.config_records[RECORD_KEY_STATE] = ConfigRecord({"current_stage": Stage.SHARE_KEYS})
