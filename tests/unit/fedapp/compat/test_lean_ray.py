"""fedapp.compat.lean_ray: a local Ray head without the autoscaler monitor, log monitor, dashboard API server and
prestarted idle workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO

ray = pytest.importorskip("ray")

from fedapp.compat.lean_ray import ACTOR_HOOK_ENV, LEAN_RAY_SETTINGS, lean_local_ray_head, lean_ray_env  # noqa: E402


def _lean_env() -> dict[str, str | None]:
    """This process's values of the settings fedapp.compat.lean_ray may set (None: unset)."""
    return {k: os.environ.get(k) for k in (*LEAN_RAY_SETTINGS, ACTOR_HOOK_ENV)}


def _idle_workers(raylet_pid: int) -> list[str]:
    """The raylet's worker processes that run nothing (Ray titles them ``ray::IDLE``)."""
    return [p.name() for p in psutil.Process(raylet_pid).children() if p.name() == "ray::IDLE"]


def test_the_lean_head_runs_tasks_without_the_unused_daemons_and_the_patch_is_undone():
    from ray._private import ray_constants
    from ray._private.node import Node

    original = Node.__init__
    before = _lean_env()
    assert not ray.is_initialized()
    try:
        with lean_local_ray_head() as patched:
            assert patched  # this Ray (pinned by flwr) has the internals the patch sets
            # as Flower's backend starts it: two CPUs, a job runtime_env that prestarted workers would not have
            ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                     runtime_env={"env_vars": {"DPFL_TEST": "1"}})
        assert Node.__init__ is original and _lean_env() == before
        node = ray._private.worker._global_node
        started = set(node.all_processes)
        assert {ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET} <= started
        assert not started & {ray_constants.PROCESS_TYPE_MONITOR, ray_constants.PROCESS_TYPE_LOG_MONITOR,
                              ray_constants.PROCESS_TYPE_DASHBOARD}, started
        # Ray prestarts one worker per CPU within a second of the driver's registration; here none comes
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        time.sleep(3.0)
        assert _idle_workers(raylet) == []

        @ray.remote
        def square(v: int) -> int:
            return v * v

        assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]

        @ray.remote
        def load_actor_class() -> tuple[str, bool, bool]:
            """What a worker that loads Flower's ClientAppActor imports (fedapp.compat.lean_actor's setup hook)."""
            import sys

            import flwr.simulation.ray_transport.ray_actor  # noqa: F401

            package = type(sys.modules["flwr.simulation"]).__name__
            return package, "sqlalchemy" in sys.modules, "flwr.simulation.run_simulation" in sys.modules

        # the hook ran in the worker: the package's __init__ (Flower's server runtime, SQLAlchemy) is not loaded
        assert ray.get(load_actor_class.remote()) == ("_DeferredPackage", False, False)
    finally:
        ray.shutdown()


def test_a_deferred_flower_simulation_package_loads_its_init_on_first_use():
    """In a fresh interpreter: the actor module loads without the package's __init__; the first use of a name the
    __init__ defines runs it, and then everything Flower's package offers is there."""
    code = """
import sys
from fedapp.compat.lean_actor import defer_flower_simulation_package
defer_flower_simulation_package()
from flwr.simulation.ray_transport.ray_actor import ClientAppActor
print("sqlalchemy" in sys.modules, type(sys.modules["flwr.simulation"]).__name__)
import flwr.simulation
print(flwr.simulation.ray_transport.ray_actor.ClientAppActor is ClientAppActor)
from flwr.simulation import run_simulation, start_simulation
print(type(sys.modules["flwr.simulation"]).__name__, callable(run_simulation), callable(start_simulation))
defer_flower_simulation_package()  # imported already: left alone
print(type(sys.modules["flwr.simulation"]).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO),
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == ["False _DeferredPackage", "True", "module True True", "module"], out.stdout


def test_lean_ray_env_keeps_what_the_user_set(monkeypatch):
    for key in LEAN_RAY_SETTINGS:
        monkeypatch.delenv(key, raising=False)
    assert lean_ray_env() == LEAN_RAY_SETTINGS
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    assert "RAY_prestart_worker_first_driver" not in lean_ray_env()


def test_the_simulation_runtime_hook_applies_only_in_flwr_simulation_and_is_undone(monkeypatch):
    from ray._private.node import Node

    from fedapp.compat import lean_ray

    monkeypatch.delenv(lean_ray.SWITCH, raising=False)
    assert lean_ray.lean_head_in_simulation_runtime("/venv/bin/flwr-simulation") is False  # not switched on
    monkeypatch.setenv(lean_ray.SWITCH, "on")  # as the launcher's Flower processes have it

    original = Node.__init__
    before = _lean_env()
    assert not ray.is_initialized()
    assert lean_ray.lean_head_in_simulation_runtime("/venv/bin/python") is False  # the launcher, tests, notebooks
    assert Node.__init__ is original
    try:
        assert lean_ray.lean_head_in_simulation_runtime("/venv/bin/flwr-simulation") is True
        assert lean_ray.lean_head_in_simulation_runtime("/venv/bin/flwr-simulation") is True  # once per process
        assert Node.__init__ is not original
        assert all(os.environ.get(k) == (before[k] or v) for k, v in LEAN_RAY_SETTINGS.items())
    finally:
        lean_ray.end_lean_head_in_simulation_runtime()
    assert Node.__init__ is original and _lean_env() == before


def test_dpfl_lean_ray_off_leaves_ray_alone(monkeypatch):
    from ray._private.node import Node

    monkeypatch.setenv("DPFL_LEAN_RAY", "off")
    original = Node.__init__
    before = _lean_env()
    with lean_local_ray_head() as patched:
        assert patched is False and Node.__init__ is original
        assert _lean_env() == before


def test_the_patch_is_not_applied_to_another_ray_version(monkeypatch):
    """The Node patch is written for one Ray minor version; any other keeps Ray's own start-up."""
    from ray._private.node import Node


    original = Node.__init__
    monkeypatch.setattr(ray, "__version__", "9.99.0")
    with lean_local_ray_head() as patched:
        assert patched is False and Node.__init__ is original


def test_the_launchers_flower_processes_switch_the_lean_head_on(monkeypatch, tmp_path):
    from fedapp.compat import lean_ray
    from fedapp.run.processes import flower_env

    monkeypatch.delenv(lean_ray.SWITCH, raising=False)
    assert flower_env(tmp_path)[lean_ray.SWITCH] == "on"
    monkeypatch.setenv(lean_ray.SWITCH, "off")  # the user's choice wins
    assert flower_env(tmp_path)[lean_ray.SWITCH] == "off"
