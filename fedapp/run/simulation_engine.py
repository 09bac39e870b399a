"""The launcher's lighter engine: Flower's ``run_simulation`` Python API in one child process.

``python -m fedapp.run.launch --engine run-simulation`` trains the same ServerApp and ClientApps as the
default SuperLink engine, on the same Flower Simulation Engine (one Ray actor per ``--num-cpus`` of the
machine), from the same validated run-config. What it leaves out are the three Flower processes that
stand between the launcher and the ServerApp — ``flower-superlink`` and its ``flower-superexec`` (~0.21 GB together
at the peak; the SuperLink engine's short-lived ``flwr run`` submits and exits) — and their start-up. Both engines start their Ray head lean (:mod:`fedapp.compat.lean_ray`: no
autoscaler monitor, log monitor, dashboard API server or prestarted idle workers): here around
``run_simulation``, in the SuperLink engine inside Flower's ``flwr-simulation``. Measured in docs/benchmarks.md.

What it does not give: the run is not registered in a SuperLink (no ``flwr ls`` / ``flwr log``), and the
app runs from this source tree rather than from an installed FAB. Privacy is unchanged: the strategies,
their mechanisms, SecAgg+ and the server-side ledger are the same code on the same message path.

Flower 1.41 marks ``run_simulation`` deprecated (it logs so at start) in favour of ``flwr run``, which is why
this engine is opt-in and the SuperLink engine stays the default; the tests and notebooks use the same API,
so a Flower release that removes it fails here first.

Run by the launcher as ``python -m fedapp.run.simulation_engine SPEC.json``; SPEC holds ``overrides``
(the full run-config the launcher validated), ``num_supernodes``, ``num_cpus``, ``num_gpus`` and
``ray_address``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any


def write_spec(path: Path, overrides: dict[str, Any], num_supernodes: int, num_cpus: float, num_gpus: float,
               ray_address: str) -> Path:
    """Everything the child needs, as JSON (run-config values are TOML scalars: JSON carries them exactly)."""
    path.write_text(json.dumps({"overrides": overrides, "num_supernodes": num_supernodes, "num_cpus": num_cpus,
                                "num_gpus": num_gpus, "ray_address": ray_address}), encoding="utf-8")
    return path


def run_from_spec(spec: dict[str, Any]) -> None:
    """``flwr.simulation.run_simulation`` of this project's ServerApp and ClientApp (raises what it raises)."""
    import os

    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app
    from fedapp.run.processes import simulation_backend

    backend, env = simulation_backend(float(spec["num_cpus"]), float(spec["num_gpus"]), str(spec["ray_address"]))
    os.environ.update(env)
    overrides = dict(spec["overrides"])
    from fedapp.compat import thread_backend
    from fedapp.compat.lean_ray import lean_local_ray_head
    from fedapp.compat.wakeups import wake_feeder

    # the compat patches this engine needs, each switched on here (DPFL_WAKEUPS=off / DPFL_LEAN_RAY=off keep Flower's
    # and Ray's own behaviour): instructions wake the engine's feeder (fedapp.compat.wakeups; the ServerApp wakes its
    # grid); a lean Ray head whose actors skip flwr.simulation's __init__ (fedapp.compat.lean_ray, lean_actor), unless
    # the ClientApps run on this process's threads (fedapp.compat.thread_backend, installed by the ClientApp module):
    # then Ray is neither started nor imported
    wake_feeder()
    head = (contextlib.nullcontext() if thread_backend.wanted()
            else lean_local_ray_head(defer_actor_package=True))
    with head:
        run_simulation(build_server_app(overrides), build_client_app(overrides),
                       num_supernodes=int(spec["num_supernodes"]), backend_config=backend)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fedapp.run.simulation_engine SPEC.json", file=sys.stderr)
        return 2
    run_from_spec(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
