"""Flower ClientApp: builds the client of the registered strategy's family for this node."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from flwr.client import Client
from flwr.clientapp import ClientApp
from flwr.common import Context

from fedapp.config import resolve_config
from fedapp.faults import guard_client
from fedapp.heap import trim_heap_mod
from fedapp.lean_ray import lean_head_in_simulation_runtime
from fedapp.registry import get_spec
from fedapp.secure_aggregation import secagg_mod


def build_client_app(overrides: dict[str, Any] | None = None) -> ClientApp:
    """A ClientApp whose run-config is Flower's merged with ``overrides`` (used by tests)."""

    def client_fn(context: Context) -> Client:
        _torch_threads_as_assigned()
        cfg = resolve_config(context.run_config, overrides)
        client = get_spec(cfg["strategy"]).client_factory()(context, overrides)
        return guard_client(client, context, cfg)  # faults, state persistence, lost-accountant guard (issue 7)

    # trim_heap_mod: freed memory back to the OS after each message; secagg_mod: SecAgg+ rounds only
    return ClientApp(client_fn=client_fn, mods=[trim_heap_mod, secagg_mod])


def _torch_threads_as_assigned() -> None:
    """Torch's thread pool sized to ``OMP_NUM_THREADS``, which Ray sets when it assigns an actor its CPUs —
    after :func:`import_client_stack` imported torch, which then sized the pool to the whole machine."""
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and wanted.isdigit() and int(wanted) > 0 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))


def import_client_stack() -> None:
    """Ray ``worker_process_setup_hook`` (:mod:`fedapp.lean_ray`): import what a ClientApp's first message needs
    (torch, Opacus, every client family) when a Ray worker starts, before any actor runs on it. A failure here
    only costs the head start: the first message imports again and reports what is wrong."""
    try:
        import opacus  # noqa: F401

        import fedapp.factories  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a worker whose hook raises never starts
        logging.getLogger(__name__).warning("importing the client stack ahead of round 1 failed: %s", exc)


app = build_client_app()

# Flower's simulation runtime (`flwr run` against a SuperLink) imports this module before it starts Ray: a lean head
lean_head_in_simulation_runtime()
