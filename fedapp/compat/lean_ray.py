"""A local Ray head without the daemons and workers a simulation never uses.

``ray.init()`` on a machine with no cluster starts, besides the GCS and the raylet a simulation needs, the
autoscaler monitor (nothing to autoscale on one machine), the log monitor (it streams worker logs to the driver,
which Flower's ``log_to_driver=False`` turns off) and the dashboard API server (Ray's job and state HTTP APIs,
which neither Flower nor this project call) — ~50-75 MB of PSS each, measured in docs/benchmarks.md, and three
Python processes that start while round 1 does. Ray has switches for all three in ``RayParams``
(``no_monitor``, ``include_log_monitor``; a head whose API server is absent is a state Ray already runs in when
it fails to start), but ``ray.init`` does not pass them through. :func:`lean_local_ray_head` sets them on the
one ``Node`` that ``ray.init`` creates for a new local cluster, and nothing else: attaching to an existing
cluster (``ray_address``) is untouched, and so are the raylet, its dashboard agent (metrics) and its runtime-env
agent (Flower's ``runtime_env`` needs it).

These are Ray internals (``ray._private.node.Node``): the patch checks that they have the shape it was written
against (:mod:`fedapp.compat.surface`, group ``lean-ray``: Ray :data:`PATCHED_RAY` and the recorded signatures) and
otherwise leaves ``ray.init`` alone with a warning, so a Ray upgrade costs memory, not a run.

The raylet also starts one idle Python worker per CPU as soon as the first driver connects
(``prestart_worker_first_driver``). Flower's job carries a ``runtime_env`` (its ``PYTHONPATH``), which the
prestarted workers lack, so Ray never hands them a ``ClientAppActor`` and starts one worker per actor besides:
the prestarted ones only import Ray on the cores that round 1 needs. :func:`lean_ray_env` turns them off
through the ``RAY_<setting>`` environment variables from which Ray's processes read their system settings; a
value the user set is kept.

The same head gives its workers :mod:`fedapp.compat.lean_actor`'s setup hook (through the environment variable Ray
reads it from, set like the settings above): an actor loads Flower's ``ClientAppActor`` without the rest of Flower's
simulation package (43 MB and 0.9 s of round 1 per actor); only under the Flower that hook was written for
(:func:`fedapp.compat.lean_actor.applicable`).

Two places start Ray for this project's apps: the run_simulation engine's process (:func:`lean_local_ray_head`
around ``run_simulation``) and, for ``flwr run`` against a SuperLink, Flower's simulation runtime
``flwr-simulation``, which loads the ClientApp before it starts Ray (``start_vce``: load the app, then build
the backend). :mod:`fedapp.apps.client_app` therefore calls :func:`lean_head_in_simulation_runtime` when it is
imported, which acts only in that runtime and only when the environment switches it on (``DPFL_LEAN_RAY=on``,
which the project's launcher sets for the Flower processes it starts); a plain ``flwr run`` starts Ray as Flower
does. Under the launcher, :mod:`fedapp.compat.early_ray` starts that head sooner, while the apps load, and opens
the same lean settings first. ``DPFL_LEAN_RAY=off`` starts Ray with everything in both places.

The patch is written for Ray :data:`PATCHED_RAY` (``ray._private`` changes between minor versions): under any
other Ray it is not applied and a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedapp.compat import lean_actor, surface, switched_off
from fedapp.compat.lean_actor import HOOK as ACTOR_HOOK

log = logging.getLogger(__name__)

#: Ray system settings, read from the environment by the raylet a new local cluster starts
LEAN_RAY_SETTINGS = {"RAY_prestart_worker_first_driver": "0"}
#: the environment variable from which a Ray worker reads its ``worker_process_setup_hook`` (``ray_constants``), and
#: the hook: actors load ``ClientAppActor`` without the rest of Flower's simulation package (fedapp.compat.lean_actor)
ACTOR_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def lean_ray_env() -> dict[str, str]:
    """The :data:`LEAN_RAY_SETTINGS` that this process's environment does not set already."""
    return {k: v for k, v in LEAN_RAY_SETTINGS.items() if k not in os.environ}


#: the Ray minor version whose internals the ``Node`` patch was written and tested against
PATCHED_RAY = surface.releases("ray")
#: environment switch: ``on`` lets the ClientApp module start a lean head in ``flwr-simulation``; ``off`` disables all
SWITCH = "DPFL_LEAN_RAY"
#: the Ray method the lean head replaces while it starts (registered in :mod:`fedapp.compat.surface`)
NODE_INIT = "ray._private.node.Node.__init__"


def _patchable() -> Any:
    """``ray._private.node.Node`` if Ray is :data:`PATCHED_RAY` and ``Node``, its ``start_api_server``, the
    ``RayParams`` it reads and the hook's environment variable are as recorded in the surface; else None (a warning
    names what differs)."""
    try:
        found = surface.problems("lean-ray")
    except ImportError as exc:
        found = [str(exc)]
    if found:
        log.warning("the lean Ray head is written for ray %s's internals: %s; starting Ray with all of its daemons",
                    PATCHED_RAY, "; ".join(found))
        return None
    from ray._private.node import Node

    return Node


def lean_ray_wanted() -> bool:
    """False when ``DPFL_LEAN_RAY`` is ``off`` (Ray then starts with all of its daemons and workers)."""
    return not switched_off(SWITCH)


@contextlib.contextmanager
def lean_local_ray_head(*, defer_actor_package: bool = True) -> Iterator[bool]:
    """While open, a ``ray.init`` that starts a new local cluster starts it without the autoscaler monitor, the
    log monitor, the dashboard API server and prestarted idle workers, and (``defer_actor_package``) its workers
    load Flower's ``ClientAppActor`` without the rest of ``flwr.simulation`` (:mod:`fedapp.compat.lean_actor`).
    Yields whether the ``Node`` patch is in place (the environment settings apply either way); nothing is changed
    under ``DPFL_LEAN_RAY=off``."""
    if not lean_ray_wanted():
        yield False
        return
    added = lean_ray_env()
    node_cls = _patchable()  # warns when this Ray is not the one the patch was written for
    if defer_actor_package and node_cls is not None and ACTOR_HOOK_ENV not in os.environ and lean_actor.applicable():
        added[ACTOR_HOOK_ENV] = ACTOR_HOOK  # Ray's env for a worker setup hook: Ray 2.55's name, hence the check
    os.environ.update(added)  # read by the raylet when it starts; an attached cluster's raylet never sees it
    if node_cls is not None:
        original_init = surface.library_object(NODE_INIT)

        def lean_init(self: Any, ray_params: Any, head: bool = False, *args: Any, **kwargs: Any) -> None:
            if head and kwargs.get("ray_init_cluster"):
                ray_params.no_monitor = True
                ray_params.include_log_monitor = False
                self.start_api_server = lambda **_: None  # instance attribute: this head only
            original_init(self, ray_params, head, *args, **kwargs)

        previous = surface.replace(NODE_INIT, lean_init)
    try:
        yield node_cls is not None
    finally:
        if node_cls is not None:
            surface.restore(NODE_INIT, previous)
        for key in added:
            os.environ.pop(key, None)


#: Flower's simulation runtime: the process that ``flwr run`` against a SuperLink starts Ray in
SIMULATION_RUNTIME = "flwr-simulation"
_runtime_head: tuple[contextlib.ExitStack, bool] | None = None


def lean_head_in_simulation_runtime(program: str | None = None) -> bool:
    """In ``flwr-simulation`` (``program``: default ``sys.argv[0]``) started with ``DPFL_LEAN_RAY=on``, before Ray
    is up, keep :func:`lean_local_ray_head` open for the rest of the process, so that the ``ray.init`` Flower calls
    next starts a lean head. Returns whether the ``Node`` patch is in place; elsewhere False."""
    global _runtime_head
    if Path(program if program is not None else sys.argv[0]).name != SIMULATION_RUNTIME:
        return False
    if os.environ.get(SWITCH, "").strip().lower() != "on":
        return False
    if _runtime_head is None:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            return False
        stack = contextlib.ExitStack()
        _runtime_head = stack, stack.enter_context(lean_local_ray_head(defer_actor_package=True))
    return _runtime_head[1]


def end_lean_head_in_simulation_runtime() -> None:
    """Undo :func:`lean_head_in_simulation_runtime` (for tests; the runtime process simply ends)."""
    global _runtime_head
    if _runtime_head is not None:
        _runtime_head[0].close()
        _runtime_head = None
