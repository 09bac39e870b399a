"""Flower ClientApp: builds the client of the registered strategy's family for this node."""

from __future__ import annotations

from typing import Any

from flwr.client import Client
from flwr.clientapp import ClientApp
from flwr.common import Context

from fedapp.clients.guard import RefusingClient, guard_client
from fedapp.compat.blas_threads import limit_to_allotment
from fedapp.compat.heap import trim_heap_mod
from fedapp.compat.lean_ray import lean_head_in_simulation_runtime
from fedapp.compat.server_log import log_to_file_from_env
from fedapp.compat.thread_backend import install as install_thread_backend
from fedapp.compat.wakeups import wake_feeder_in_simulation_runtime
from fedapp.config import resolve_config
from fedapp.data.node_data import NodeDataError
from fedapp.privacy.secure_aggregation import secagg_mod
from fedapp.registry import get_spec


def build_client_app(overrides: dict[str, Any] | None = None) -> ClientApp:
    """A ClientApp whose run-config is Flower's merged with ``overrides`` (used by tests)."""

    def client_fn(context: Context) -> Client:
        return node_client(context, overrides)

    # trim_heap_mod: freed memory back to the OS after each message; secagg_mod: SecAgg+ rounds only
    return ClientApp(client_fn=client_fn, mods=[trim_heap_mod, secagg_mod])


def node_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """This node's client of the run's strategy family, guarded: the node's privacy policy, faults, state persistence,
    the lost-accountant guard. A node whose own data cannot serve the run (``NodeDataError``) refuses every request,
    naming why; the others go on."""
    limit_to_allotment()  # Ray's OMP_NUM_THREADS, for the BLAS pools numpy started before Ray set it
    cfg = resolve_config(context.run_config, overrides)
    try:
        client = get_spec(cfg.general.strategy).client(context, overrides)
    except NodeDataError as exc:
        client = RefusingClient(_node_id(context), str(exc))
    return guard_client(client, context, cfg.general, cfg.data, cfg.training, cfg.deployment, cfg)


def _node_id(context: Context) -> int:
    try:
        return int(context.node_config["partition-id"])
    except (KeyError, TypeError, ValueError):
        return -1  # the guard refuses a node-config without one, naming the key


app = build_client_app()

# Flower's simulation runtime (`flwr run` against a SuperLink) imports this module before it starts its Simulation
# Engine: the compat patches that runtime needs are switched on here, and act only where the launcher's environment
# asks. First the runtime's log in the file the launcher follows (fedapp.compat.server_log), so that the file also shows
# a patch that fails; then the ClientApps on the engine's own threads (fedapp.compat.thread_backend; DPFL_CLIENT_BACKEND
# = threads, the launcher's default for its apps on CPUs), with no Ray started or imported, or else a lean Ray head
# whose actors skip flwr.simulation's __init__ (fedapp.compat.lean_ray, lean_actor); and instructions that wake the
# engine's feeder instead of its 0.1 s poll (fedapp.compat.wakeups; DPFL_WAKEUPS=off: not).
log_to_file_from_env()
if not install_thread_backend():
    lean_head_in_simulation_runtime()
wake_feeder_in_simulation_runtime()
