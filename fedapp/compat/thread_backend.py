"""Flower's simulation runtime with its ClientApps on threads of the runtime's own process instead of Ray actors.

Flower's Simulation Engine (``vce_api``) hands each instruction to a backend, and its one backend is Ray's: a pool
of actor processes, each with its own torch, Flower and client stack, beside Ray's four daemons. On a 2-core machine
those are 0.74 GB of the default path's 1.44 GB peak and ~3 s of its start (docs/benchmarks/peer_pfl.md).
:class:`ThreadBackend` runs the same ClientApp, with the same mods (SecAgg+ included) and the same message path
through the engine's LinkState, on the engine's own worker threads: as many as Ray's pool would hold actors
(⌊CPUs / CPUs a client⌋), each running torch with the client's CPUs as its threads (torch's OpenMP thread count is
per thread), every BLAS pool of the process limited to that count. The Message and the node's Context are handed
to the ClientApp as copies, as Ray's serialization does: the ServerApp's grid gives every node the same content object
(SecAgg+'s client mod pops its stage from it), and a ClientApp that raises leaves the node's state as it was.

What it does not give: isolation between clients. They share one process, so one client that crashes the process
(a segfault, running out of memory) ends the run, where under Ray only that actor's process dies and its messages
fail; a client's Python code holds the GIL against the others' (torch's kernels release it). It trains on the CPU only
(``num_gpus`` > 0 is refused).
Privacy is unchanged: the same ClientApp, noise and SecAgg+ messages. Each client draws its DP-SGD batches and noise
from its own generator (:func:`fedapp.clients.training.local_train`), so two clients training at once neither share
nor reseed one another's stream.

Switched on by :data:`ENV` = ``threads`` (the launcher's ``--client-backend threads``) in the process that runs
Flower's engine (``flwr-simulation``, or the caller of ``run_simulation``): :func:`install` then replaces the
``RayBackend`` that the engine's ``start_vce`` builds (``backend_fn``: ``RayBackend(backend_config)``, imported from
its module when the engine starts, after the ClientApp module, which calls :func:`install`, was imported). In a process
that has not imported that module yet, :func:`install` registers a stand-in for it (:class:`RayFreeModule`), so the
engine's process never imports Ray. Checked against the installed Flower (:mod:`fedapp.compat.surface`, group
``thread-backend``).
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from fedapp.compat import surface

#: environment variable naming the simulation backend of the ClientApps: ``threads`` (this module), else Ray
ENV = "DPFL_CLIENT_BACKEND"
THREADS = "threads"
BACKENDS = ("ray", THREADS)
#: the name the engine's ``backend_fn`` builds its backend by (registered in :mod:`fedapp.compat.surface`)
RAY_BACKEND = "flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend"
RAY_BACKEND_MODULE = RAY_BACKEND.rpartition(".")[0]
_PACKAGE, _, _MODULE_NAME = RAY_BACKEND_MODULE.rpartition(".")
GROUP = "thread-backend"


def wanted() -> bool:
    """Whether this process's environment asks for the thread backend."""
    return os.environ.get(ENV, "").strip().lower() == THREADS


def _backend_base() -> type:
    from flwr.server.superlink.fleet.vce.backend import Backend

    return Backend


def workers_and_threads(backend_config: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(ClientApps at once, torch threads each) for Flower's ``backend_config``: ⌊CPUs / CPUs a client⌋ workers, as
    Ray's pool holds actors (CPUs: ``init_args.num_cpus``, else the machine's cores), each with ⌊CPUs a client⌋ ≥ 1
    threads. Raises ValueError for GPUs or a non-positive CPU count."""
    resources = backend_config.get("client_resources") or {}
    init_args = backend_config.get("init_args") or {}
    per_client = float(resources.get("num_cpus", 1) or 1)
    gpus = float(resources.get("num_gpus", 0) or 0) + float(init_args.get("num_gpus", 0) or 0)
    if gpus > 0:
        raise ValueError(f"the thread backend trains on the CPU; client_resources/init_args ask for {gpus:g} GPUs")
    cpus = float(init_args.get("num_cpus") or os.cpu_count() or 1)
    if per_client <= 0 or cpus <= 0:
        raise ValueError(f"CPUs a client {per_client!r} and CPUs {cpus!r} must be > 0")
    return max(1, int(cpus // per_client)), max(1, int(per_client))


class ThreadBackend:
    """A Flower simulation ``Backend`` (built as a subclass by :func:`backend_class`) whose workers are the engine's
    own threads: ``process_message`` runs the ClientApp in the calling worker thread."""

    def __init__(self, backend_config: dict[str, dict[str, Any]]) -> None:
        self.workers, self.threads = workers_and_threads(backend_config)
        self.app_fn: Callable[[], Any] | None = None
        self._local = threading.local()
        self._busy = 0
        self._lock = threading.Lock()

    def build(self, app_fn: Callable[[], Any]) -> None:
        from flwr.common.logger import log as flower_log
        from threadpoolctl import threadpool_limits

        self.app_fn = app_fn
        threadpool_limits(limits=self.threads, user_api="blas")  # numpy's pools, shared by the process
        flower_log(logging.INFO, "ClientApps on %d threads of this process (thread backend), %d torch thread(s) each",
                   self.workers, self.threads)

    @property
    def num_workers(self) -> int:
        return self.workers

    def is_worker_idle(self) -> bool:
        with self._lock:
            return self._busy < self.workers

    def terminate(self) -> None:
        self.app_fn = None

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

        if self.app_fn is None:
            raise ValueError("the thread backend was not built: call build() before process_message()")
        if not getattr(self._local, "ready", False):  # this worker thread's first ClientApp
            import torch

            torch.set_num_threads(self.threads)  # OpenMP's thread count is this thread's own
            self._local.ready = True
        # copies, as Ray's serialization gives an actor: a ServerApp hands every node the same content object (SecAgg+'s
        # mod pops its stage key from it), and a node's state changes only when its ClientApp returns
        message, context = copy.deepcopy(message), copy.deepcopy(context)
        with self._lock:
            self._busy += 1
        try:
            app = self.app_fn()
            reply = app(message=message, context=context)
        except LoadClientAppError:
            raise
        except (Exception, SystemExit) as exc:  # as Flower's ClientAppActor reports it; an exit ends no run
            raise ClientAppException(f"{type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self._busy -= 1
        return reply, context


def backend_class() -> type:
    """:class:`ThreadBackend` as a subclass of Flower's ``Backend`` (imported only when used)."""
    base = _backend_base()
    return type("ThreadBackend", (ThreadBackend, base), {"__doc__": ThreadBackend.__doc__,
                                                         "__abstractmethods__": frozenset()})


class RayFreeModule(types.ModuleType):
    """What :func:`install` puts in ``sys.modules`` for Flower's ``raybackend`` module when the process has not
    imported it: its ``RayBackend`` is the thread backend, so the engine's ``from .backend.raybackend import
    RayBackend`` finds it without importing Ray (28 MB and its import time in the engine's process). Any other name
    of the module is an error that says why."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self.__name__}.{name}: this process runs its ClientApps on threads "
                             "(fedapp.compat.thread_backend) and has not imported Flower's Ray backend")


def install() -> bool:
    """With :data:`ENV` = ``threads``, make the engine build the thread backend; True when in place. Raises
    RuntimeError when asked for under a Flower whose engine differs from the one this module was written for (the
    run would otherwise silently use Ray)."""
    if not wanted():
        return False
    module = sys.modules.get(RAY_BACKEND_MODULE)
    if module is not None and getattr(getattr(module, "RayBackend", None), "dpfl_threads", False):
        return True
    surface.require(GROUP)
    cls = backend_class()
    cls.dpfl_threads = True  # type: ignore[attr-defined]
    if module is None:  # Flower's module not imported yet: a stand-in, so that Ray is never imported
        stand_in = RayFreeModule(RAY_BACKEND_MODULE, RayFreeModule.__doc__)
        stand_in.RayBackend = cls  # type: ignore[attr-defined]
        package = importlib.import_module(_PACKAGE)
        sys.modules[RAY_BACKEND_MODULE] = stand_in
        setattr(package, _MODULE_NAME, stand_in)
        return True
    surface.replace(RAY_BACKEND, cls)
    return True


def uninstall() -> None:
    """Give the engine Ray's backend back (for tests that install in their own process)."""
    module = sys.modules.get(RAY_BACKEND_MODULE)
    if isinstance(module, RayFreeModule):
        del sys.modules[RAY_BACKEND_MODULE]
        package = sys.modules.get(_PACKAGE)
        if package is not None and getattr(package, _MODULE_NAME, None) is module:
            delattr(package, _MODULE_NAME)
        return
    current = surface.resolve(RAY_BACKEND)
    if getattr(current, "dpfl_threads", False):
        surface.restore(RAY_BACKEND, surface.library_object(RAY_BACKEND))
