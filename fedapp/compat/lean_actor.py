"""Ray actors that load Flower's ``ClientAppActor`` without the rest of Flower's simulation package.

A simulated client runs in a Ray actor of class ``flwr.simulation.ray_transport.ray_actor.ClientAppActor``. To load
that class, a fresh Ray worker imports the package ``flwr.simulation`` first, whose ``__init__`` imports Flower's
whole simulation runtime (``run_simulation``, the SuperLink's link state with SQLAlchemy, the server's workflows):
43 MB of private memory and 0.9 s of round 1 in every actor, none of which an actor uses (``ray_actor`` itself needs
``flwr.app``, ``flwr.clientapp`` and ``flwr.supercore``; docs/benchmarks.md). :func:`defer_flower_simulation_package`
registers ``flwr.simulation`` as a package whose ``__init__`` runs on the first access to a name it defines, so
importing its submodules no longer pays for it, and code that does use ``flwr.simulation.run_simulation`` (or any
other of its names) still gets it.

It is a Ray ``worker_process_setup_hook`` (it runs in each worker before the worker loads an actor class);
:func:`fedapp.compat.lean_ray.lean_local_ray_head` sets it only for a Ray cluster this process starts, whose
workers find this project on their ``PYTHONPATH``, and only when :func:`applicable` (flwr :data:`PATCHED_FLOWER`, the
Flower whose package layout the hook was written for; ``flwr.simulation`` and its actor class are registered in
:mod:`fedapp.compat.surface`, group ``lean-actor``). The hook checks the same in the worker and never raises: any
other Flower, or another package layout, is left to load as it always did.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from typing import Any

from fedapp.compat import surface

log = logging.getLogger(__name__)

PACKAGE = "flwr.simulation"
#: the Flower minor version whose ``flwr.simulation`` layout the hook was written for
PATCHED_FLOWER = surface.releases("flwr")
#: the actor's module, relative to the package's folder: it must load without the package's ``__init__``
ACTOR_MODULE = os.path.join("ray_transport", "ray_actor.py")
#: the dotted name Ray imports the hook by
HOOK = f"{__name__}.defer_flower_simulation_package"


class _DeferredPackage(types.ModuleType):
    """A package module whose ``__init__`` has not run yet; the first missing attribute runs it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # importlib and pickle probe dunders: not a use
            raise AttributeError(name)
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # from here on an ordinary module (no recursion while __init__ runs)
        spec = self.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(self)
        return getattr(self, name)


def applicable() -> bool:
    """Whether the installed Flower is :data:`PATCHED_FLOWER` (read from ``flwr``, not ``flwr.simulation``)."""
    return surface.version_supported("flwr")


def defer_flower_simulation_package() -> None:
    """Register :data:`PACKAGE` with its ``__init__`` deferred to the first use of a name it defines (nothing happens
    when it is imported already, is not a plain package with :data:`ACTOR_MODULE`, or Flower is not
    :data:`PATCHED_FLOWER`)."""
    if PACKAGE in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(PACKAGE)  # imports the parent package, ``flwr``
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            return
        if not applicable() or not any(os.path.isfile(os.path.join(folder, ACTOR_MODULE))
                                       for folder in spec.submodule_search_locations):
            log.debug("%s left to load as usual: written for flwr %s's layout", PACKAGE, PATCHED_FLOWER)
            return
        module = importlib.util.module_from_spec(spec)
    except Exception:  # noqa: BLE001 — a worker must start whatever Flower looks like
        log.debug("%s left to load as usual", PACKAGE, exc_info=True)
        return
    module.__class__ = _DeferredPackage
    sys.modules[PACKAGE] = module
    parent, _, child = PACKAGE.rpartition(".")
    setattr(sys.modules[parent], child, module)  # what the import system does once a submodule package is loaded
