"""Start the Ray head of Flower's simulation runtime while the runtime is still loading the apps.

``flwr-simulation`` (what ``flwr run`` against a SuperLink starts) loads the ServerApp (in a thread) and the
ClientApp (in its main thread), and only then starts Ray (``vce_api.start_vce``: load the ClientApp, then
``RayBackend.init_ray``, then the actors). Ray's head takes ~2.5 s to come up on a 2-core machine (GCS, raylet,
dashboard and runtime-env agents), and the actors cannot start before it does, so round 1 waited for all of it
(docs/benchmarks.md, "Speed and memory footprint against pfl-research"). Here the import of the package
:mod:`fedapp.apps`, which whichever app module loads first triggers, starts Ray in a thread of its own, with the
arguments Flower would pass, while torch, Flower and this project load; Flower's ``init_ray`` then finds Ray up and
only builds the actors.

The arguments: Flower's backend config is not known in the runtime before ``init_ray`` is called, so the launcher
passes the ``init_args`` it gives the federation in :data:`ENV` (JSON). The patched ``init_ray`` compares them with
the ones Flower passes; if they differ (a ``flwr run`` with other federation options under the same environment),
it shuts the early Ray down and lets Flower start its own, with a warning. The runtime environment is Flower's:
``PYTHONPATH`` = this process's ``sys.path`` (which, while an app module is being imported, already holds the app's
folder) and the inherited ``PYTHONPATH``, also set in ``os.environ`` as Flower does.

The thread that calls ``ray.init`` stays alive (parked) for the life of the process: Ray starts its daemons with a
parent-death signal, which Linux ties to the *thread* that started them, and they would die with a thread that
returned.

Acts only in ``flwr-simulation``, only when :data:`ENV` is set (the project's launcher sets it unless
``DPFL_EARLY_RAY=off``; a plain ``flwr run`` starts Ray as Flower does) and only under Flower :data:`PATCHED_FLOWER`
whose ``RayBackend`` has the recorded signatures (:mod:`fedapp.compat.surface`, group ``early-ray``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from fedapp.compat import surface, switched_off

#: environment variable: the ``init_args`` (JSON) of the federation the launcher submits; unset: Flower starts Ray
ENV = "DPFL_EARLY_RAY_INIT_ARGS"
#: the user's switch: ``DPFL_EARLY_RAY=off`` keeps the launcher from setting :data:`ENV`
SWITCH = "DPFL_EARLY_RAY"
#: the Flower minor version whose ``RayBackend.init_ray`` this module replicates
PATCHED_FLOWER = surface.releases("flwr")
#: the Flower method this module replaces (registered in :mod:`fedapp.compat.surface`)
INIT_RAY = "flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend.init_ray"
SIMULATION_RUNTIME = "flwr-simulation"


class _EarlyRay:
    """The one early start of this process: its arguments, and its outcome once ``done`` is set."""

    def __init__(self, init_args: dict[str, Any]) -> None:
        self.init_args = init_args
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.used = False  # Flower's init_ray found this start and kept it


_lock = threading.Lock()
_early: _EarlyRay | None = None


def init_args_env(init_args: dict[str, Any]) -> dict[str, str]:
    """The environment that has the simulation runtime start Ray early with ``init_args`` (the launcher's); empty
    under ``DPFL_EARLY_RAY=off``."""
    if switched_off(SWITCH):
        return {}
    return {ENV: json.dumps(init_args, sort_keys=True)}


def flower_ray_kwargs(init_args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``ray.init``'s keyword arguments as Flower 1.41's ``RayBackend.init_ray`` builds them from ``init_args``, and
    the ``PYTHONPATH`` it exports."""
    kwargs = dict(init_args)
    kwargs.setdefault("include_dashboard", False)
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    return {"runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}}, **kwargs}, pythonpath


def start_in_simulation_runtime(program: str | None = None) -> bool:
    """In ``flwr-simulation`` (``program``: default ``sys.argv[0]``) with :data:`ENV` set, start Ray in a parked
    thread and make Flower's ``init_ray`` use it; returns whether an early start is (now or already) under way."""
    global _early
    if Path(program if program is not None else sys.argv[0]).name != SIMULATION_RUNTIME or not os.environ.get(ENV):
        return False
    with _lock:
        if _early is not None:
            return True
        try:
            init_args = json.loads(os.environ[ENV])
            differences = surface.problems("early-ray")  # this Flower's RayBackend against the one replicated here
        except (ValueError, ImportError) as exc:
            _flower_log(WARNING, "Ray starts as Flower starts it (%s = %r: %s)", ENV, os.environ.get(ENV), exc)
            return False
        if differences or not isinstance(init_args, dict):
            _flower_log(WARNING, "Ray starts as Flower starts it: the early start is written for Flower %s (%s)",
                        PATCHED_FLOWER, "; ".join(differences) or f"{ENV} is not a JSON object")
            return False
        early = _early = _EarlyRay(init_args)
        _patch_init_ray(early)
        threading.Thread(target=_start, args=(early,), name="dpfl-early-ray", daemon=True).start()
    return True


def _flower_log(level: int, msg: str, *args: Any) -> None:
    """Into the runtime's log (Flower's logger), which the launcher prints."""
    from flwr.common.logger import log

    log(level, msg, *args)


def _start(early: _EarlyRay) -> None:
    from fedapp.compat.lean_ray import lean_head_in_simulation_runtime

    try:
        lean_head_in_simulation_runtime()  # the lean head's patch and settings, before Ray starts
        import ray

        kwargs, pythonpath = flower_ray_kwargs(early.init_args)
        os.environ["PYTHONPATH"] = pythonpath  # what Flower's init_ray does
        if not ray.is_initialized():
            ray.init(**kwargs)
    except BaseException as exc:  # noqa: BLE001 — Flower's own init_ray then tries, and reports
        early.error = exc
    finally:
        early.done.set()
    threading.Event().wait()  # parked: Ray's daemons die with the thread that started them (module docstring)


def _patch_init_ray(early: _EarlyRay) -> None:
    original = surface.library_object(INIT_RAY)

    def init_ray(self: Any, backend_config: dict[str, Any]) -> None:
        early.done.wait()
        import ray

        wanted = dict(backend_config.get(getattr(self, "init_args_key", "init_args")) or {})
        if early.error is not None:
            _flower_log(WARNING, "the early Ray start failed (%s); Flower starts Ray", early.error)
            if ray.is_initialized():
                ray.shutdown()
        elif wanted != early.init_args:
            _flower_log(WARNING, "the simulation runtime asks Ray for %s, not the %s it was started with early: "
                       "restarting Ray", wanted, early.init_args)
            ray.shutdown()
        else:
            early.used = True
            _flower_log(INFO, "Ray started while the apps loaded (fedapp.compat.early_ray)")
        original(self, backend_config)  # a no-op when Ray is up (Flower checks ray.is_initialized())

    surface.replace(INIT_RAY, init_ray)
