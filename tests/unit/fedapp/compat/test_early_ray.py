"""fedapp.compat.early_ray: the simulation runtime's Ray head, started while the apps load, with Flower's arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("ray")

from fedapp.compat.early_ray import ENV, flower_ray_kwargs, init_args_env, start_in_simulation_runtime  # noqa: E402


def test_the_arguments_are_the_ones_flowers_init_ray_passes(monkeypatch):
    """Flower 1.41's ``RayBackend.init_ray``, run against a stand-in for ``ray``, passes exactly what
    ``flower_ray_kwargs`` builds (a Flower that changes its arguments fails here, not in a run)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    class FakeRay:
        calls: list[dict] = []

        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def init(**kwargs) -> None:
            FakeRay.calls.append(kwargs)

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    init_args = {"logging_level": "ERROR", "log_to_driver": True}
    ours, exported = flower_ray_kwargs(init_args)
    monkeypatch.setattr(raybackend, "ray", FakeRay)
    backend = object.__new__(raybackend.RayBackend)
    backend.init_args_key = "init_args"
    raybackend.RayBackend.init_ray(backend, {"init_args": dict(init_args)})
    assert FakeRay.calls == [ours]
    assert os.environ["PYTHONPATH"] == exported


def test_nothing_starts_outside_the_simulation_runtime_or_without_the_launchers_switch(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"logging_level": "ERROR"}))
    assert not start_in_simulation_runtime(program="/usr/bin/python")
    monkeypatch.delenv(ENV)
    assert not start_in_simulation_runtime(program="/venv/bin/flwr-simulation")


# A stand-in for flwr-simulation: the early start, then what start_vce does (the backend, its actors, one task)
RUNTIME = r"""
import json, sys
import ray
from fedapp.compat import early_ray
starts = []
original_init = ray.init
def counting_init(*args, **kwargs):
    starts.append(kwargs)
    return original_init(*args, **kwargs)
ray.init = counting_init
assert early_ray.start_in_simulation_runtime(program="flwr-simulation")
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
backend = RayBackend({"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": json.loads(sys.argv[1])})
@ray.remote(num_cpus=1)
def where() -> str:
    import fedapp
    return fedapp.__file__
located = ray.get(where.remote())
print(json.dumps({"starts": len(starts), "used": early_ray._early.used, "located": located}))
ray.shutdown()
"""


@pytest.mark.parametrize("flower_args,starts,used", [
    ({"logging_level": "ERROR", "log_to_driver": True}, 1, True),  # the launcher's federation: one start, early
    ({"logging_level": "WARNING", "log_to_driver": True}, 2, False),  # other options: Flower starts its own
], ids=["same-arguments", "other-arguments"])
def test_flowers_backend_uses_the_early_head_only_with_its_own_arguments(flower_args, starts, used, tmp_path):
    env = {**os.environ, **init_args_env({"logging_level": "ERROR", "log_to_driver": True}),
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RUNTIME, json.dumps(flower_args)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["starts"] == starts and out["used"] is used
    assert out["located"].startswith(str(REPO))  # Ray's workers import this project (the PYTHONPATH Flower exports)


def test_the_launcher_switches_the_early_start_on_and_polls_for_runs_sooner(monkeypatch):
    """What the launcher adds to the SuperLink's environment: the early start with the init args it submits in the
    federation (none when attaching to an existing cluster), and the SuperExec's 0.1 s poll unless the caller set one."""
    from fedapp.run.launch import FEDERATION_INIT_ARGS, SUPEREXEC_POLL_ENV, runtime_env

    monkeypatch.delenv(SUPEREXEC_POLL_ENV, raising=False)
    env = runtime_env()
    assert json.loads(env[ENV]) == FEDERATION_INIT_ARGS and env[SUPEREXEC_POLL_ENV] == "0.1"
    assert ENV not in runtime_env(ray_address="auto")
    monkeypatch.setenv(SUPEREXEC_POLL_ENV, "2.0")
    assert SUPEREXEC_POLL_ENV not in runtime_env()  # the caller's value reaches Flower unchanged
    monkeypatch.setenv("DPFL_EARLY_RAY", "off")
    assert ENV not in runtime_env()


def test_a_fraction_of_a_cpu_becomes_whole_cpus_on_a_larger_logical_ray_head(monkeypatch):
    """Flower's federation config holds whole CPUs a client: 0.5 CPU a client on 16 cores is 1 CPU a client on a Ray
    head of 32 logical CPUs (32 ClientApps either way), and the early start gets those init args too."""
    from fedapp.config import ConfigError
    from fedapp.run.launch import FEDERATION_INIT_ARGS, runtime_env, superlink_cpus

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert superlink_cpus(2.0) == (2, FEDERATION_INIT_ARGS)
    cpus, init_args = superlink_cpus(0.5)
    assert cpus == 1 and init_args == {**FEDERATION_INIT_ARGS, "num_cpus": 32}
    assert superlink_cpus(0.8)[1]["num_cpus"] == 20  # all 20 of a 20-client GPU round at once
    assert json.loads(runtime_env("", init_args)[ENV]) == init_args
    with pytest.raises(ConfigError, match=r"--num-cpus 0.5: .*--ray-address 'auto'"):
        superlink_cpus(0.5, "auto")
    with pytest.raises(ConfigError, match="num-cpus = 0.0 must be > 0"):
        superlink_cpus(0.0)
