"""The one audited surface of Flower and Ray: every symbol this project patches, overrides or relies on being shaped
as it was when a workaround was written.

Each :class:`Symbol` names a Flower or Ray object by its dotted path, with the ``inspect.signature`` string it was
written against (None for a class or module whose attributes are the contract), the attributes a patch reads or sets,
and the group of the workaround that needs it. ``tests/unit/fedapp/compat/test_surface.py`` checks every entry
against the installed libraries, so a Flower or Ray upgrade fails there, loudly, rather than wrongly in a run: after
an upgrade, run that test first, re-read each symbol it names and re-record its signature (and :data:`TESTED`).

The workarounds check their own groups before they patch (:func:`problems`, :func:`require`) and patch through
:func:`replace`, which remembers Flower's or Ray's original, so the checks always see the library's own object.
Only the standard library is imported here: a Ray worker's setup hook uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedapp.compat import same_minor

#: the major.minor releases of each library the surface was recorded and tested against (flwr 1.41.0 and 1.42.0: every
#: symbol's signature is the same in both; ray 2.55.1)
TESTED: dict[str, tuple[str, ...]] = {"flwr": ("1.41", "1.42"), "ray": ("2.55",)}

_NDARRAY_F = "numpy.ndarray[tuple[typing.Any, ...], numpy.dtype[numpy.float64]]"
_NDARRAY_I = "numpy.ndarray[tuple[typing.Any, ...], numpy.dtype[numpy.int64]]"
_NDARRAY = "numpy.ndarray[tuple[typing.Any, ...], numpy.dtype[typing.Any]]"
_MESSAGE = "flwr.app.message.message.Message"
_CONTEXT = "flwr.app.message.context.Context"
_STAGE = ("(self, grid: flwr.serverapp.grid.grid.Grid, context: flwr.server.compat.legacy_context.LegacyContext, "
          "state: flwr.server.workflow.secure_aggregation.secaggplus_workflow.WorkflowState) -> bool")
_EXCHANGE = (f"(self, messages: collections.abc.Iterable[{_MESSAGE}], *, timeout: float | None = None) -> "
             f"collections.abc.Iterable[{_MESSAGE}]")
_PUSH = f"(self, messages: collections.abc.Iterable[{_MESSAGE}]) -> collections.abc.Iterable[str]"
_PULL = f"(self, message_ids: collections.abc.Iterable[str]) -> collections.abc.Iterable[{_MESSAGE}]"
_BACKEND_CONFIG = ("backend_config: dict[str, dict[str, int | float | str | bytes | bool | list[int] | list[float] | "
                   "list[str] | list[bytes] | list[bool]]]")
_LEGACY = "flwr.compat.common.typing"
_RECORDS = "flwr.compat.common.recorddict_compat"
_RECORDDICT = "flwr.app.message.recorddict.RecordDict"

_SECAGG_MOD = "flwr.client.mod.secure_aggregation.secaggplus_mod"
_SECAGG_WORKFLOW = "flwr.server.workflow.secure_aggregation.secaggplus_workflow"
_QUANTIZATION = "flwr.common.secure_aggregation.quantization"
_ARITHMETIC = "flwr.common.secure_aggregation.ndarrays_arithmetic"
_GRIDS = "flwr.superlink.grid"
_PROXY = "flwr.server.client_proxy.ClientProxy"
_RAY_BACKEND = "flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend"
_BACKEND = "flwr.server.superlink.fleet.vce.backend.backend"


@dataclass(frozen=True)
class Symbol:
    """One Flower or Ray object the project patches, overrides or depends on the shape of."""

    path: str  #: dotted path: module, then attributes (``flwr.x.y.Class.method``)
    signature: str | None  #: ``str(inspect.signature(obj))`` as recorded; None: not a call contract
    group: str  #: the workaround that needs it (what :func:`problems` checks together)
    why: str  #: what the project does with it
    attributes: tuple[str, ...] = ()  #: names it must have (dataclass fields, ``self.<name> =`` in ``__init__``)
    value: str | None = None  #: ``repr`` of a constant the project depends on

    @property
    def library(self) -> str:
        return self.path.split(".", 1)[0]


SURFACE: tuple[Symbol, ...] = (
    # fedapp.compat.secagg: Flower's SecAgg+ creates and combines Shamir shares with fedapp.privacy.shamir
    Symbol(f"{_SECAGG_MOD}.create_shares", "(secret: bytes, threshold: int, num: int) -> list[bytes]",
           "secagg.shamir", "replaced in the client mod's namespace by fedapp.privacy.shamir.create_shares"),
    Symbol(f"{_SECAGG_WORKFLOW}.combine_shares", "(share_list: list[bytes]) -> bytes",
           "secagg.shamir", "replaced in the workflow's namespace by fedapp.privacy.shamir.combine_shares"),
    # fedapp.compat.secagg: Flower's SecAgg+ agrees keys with fedapp.privacy.key_agreement (X25519, raw keys)
    Symbol(f"{_SECAGG_MOD}.generate_key_pairs", "() -> tuple[cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePrivateKey, cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePublicKey]",
           "secagg.keys", "replaced in the client mod's namespace by fedapp.privacy.key_agreement.generate_key_pairs"),
    Symbol(f"{_SECAGG_MOD}.private_key_to_bytes", "(private_key: cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePrivateKey) -> bytes",
           "secagg.keys", "replaced in the client mod's namespace by fedapp.privacy.key_agreement.private_key_to_bytes"),
    Symbol(f"{_SECAGG_MOD}.public_key_to_bytes", "(public_key: cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePublicKey) -> bytes",
           "secagg.keys", "replaced in the client mod's namespace by fedapp.privacy.key_agreement.public_key_to_bytes"),
    *(Symbol(f"{module}.bytes_to_private_key", "(private_key_bytes: bytes) -> cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePrivateKey", "secagg.keys",
             f"replaced in the {where}'s namespace by fedapp.privacy.key_agreement.bytes_to_private_key")
      for module, where in ((_SECAGG_MOD, "client mod"), (_SECAGG_WORKFLOW, "workflow"))),
    *(Symbol(f"{module}.bytes_to_public_key", "(public_key_bytes: bytes) -> cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePublicKey", "secagg.keys",
             f"replaced in the {where}'s namespace by fedapp.privacy.key_agreement.bytes_to_public_key")
      for module, where in ((_SECAGG_MOD, "client mod"), (_SECAGG_WORKFLOW, "workflow"))),
    *(Symbol(f"{module}.generate_shared_key", "(private_key: cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePrivateKey, public_key: cryptography.hazmat.primitives.asymmetric.ec.EllipticCurvePublicKey) -> bytes",
             "secagg.keys", f"replaced in the {where}'s namespace by fedapp.privacy.key_agreement.generate_shared_key")
      for module, where in ((_SECAGG_MOD, "client mod"), (_SECAGG_WORKFLOW, "workflow"))),
    # fedapp.compat.secagg: Flower's SecAgg+ draws its masks with fedapp.privacy.masks (AES-256-CTR)
    *(Symbol(f"{module}.pseudo_rand_gen", "(seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]) -> list[numpy.ndarray[tuple[typing.Any, ...], numpy.dtype[numpy.int64]]]",
             "secagg.masks", f"replaced in the {where}'s namespace by fedapp.privacy.masks.pseudo_rand_gen")
      for module, where in ((_SECAGG_MOD, "client mod"), (_SECAGG_WORKFLOW, "workflow"))),
    # fedapp.privacy.secure_aggregation.DPSecAggPlusWorkflow: the project's SecAgg+ adapter
    Symbol(f"{_SECAGG_WORKFLOW}.SecAggPlusWorkflow",
           "(num_shares: int | float, reconstruction_threshold: int | float, *, max_weight: float = 1000.0, "
           "clipping_range: float = 8.0, quantization_range: int = 4194304, modulus_range: int = 4294967296, "
           "timeout: float | None = None) -> None",
           "secagg.workflow", "subclassed; the three ranges its __init__ assigns are overridden by properties",
           attributes=("clipping_range", "quantization_range", "modulus_range", "max_weight")),
    Symbol(f"{_SECAGG_WORKFLOW}.SecAggPlusWorkflow.collect_masked_vectors_stage", _STAGE, "secagg.workflow",
           "overridden: a dropped client's failure recorded once"),
    Symbol(f"{_SECAGG_WORKFLOW}.SecAggPlusWorkflow.unmask_stage", _STAGE, "secagg.workflow",
           "overridden: the budget decided before unmasking; residues handed to aggregate_fit under the DDG"),
    Symbol(f"{_SECAGG_WORKFLOW}.WorkflowState", None, "secagg.workflow",
           "the stages' state the overrides read and trim", attributes=("legacy_results", "failures")),
    Symbol("flwr.server.compat.legacy_context.LegacyContext",
           f"(context: {_CONTEXT}, config: flwr.server.server_config.ServerConfig | None = None, "
           "strategy: flwr.server.strategy.strategy.Strategy | None = None, "
           "client_manager: flwr.server.client_manager.ClientManager | None = None) -> None",
           "secagg.workflow", "its strategy is swapped for the unmask stage's aggregate_fit (DDG residues)",
           attributes=("strategy", "state")),
    # the distributed discrete Gaussian's exact transport through Flower's quantizer (secure_aggregation.ddg_transport)
    Symbol(f"{_QUANTIZATION}.quantize",
           f"(parameters: list[{_NDARRAY_F}], clipping_range: float, target_range: int) -> list[{_NDARRAY_I}]",
           "secagg.transport", "maps a residue u - Q/2 onto u exactly; called directly to check a share"),
    Symbol(f"{_QUANTIZATION}.dequantize",
           f"(quantized_parameters: list[{_NDARRAY_I}], clipping_range: float, target_range: int) -> "
           f"list[{_NDARRAY_F}]", "secagg.transport", "the server's mean, inverted by residues_from_mean"),
    Symbol(f"{_ARITHMETIC}.factor_combine", f"(factor: int, parameters: list[{_NDARRAY}]) -> list[{_NDARRAY}]",
           "secagg.transport", "the weight prepended to a masked vector (weight 1 under the DDG)"),
    Symbol(f"{_ARITHMETIC}.factor_extract", f"(parameters: list[{_NDARRAY}]) -> tuple[int, list[{_NDARRAY}]]",
           "secagg.transport", "the summed weight r' the dequantized mean divides by"),
    Symbol(f"{_ARITHMETIC}.parameters_mod", f"(parameters: list[{_NDARRAY}], divisor: int) -> list[{_NDARRAY}]",
           "secagg.transport", "the sum modulo 2^b the DDG's privacy analysis assumes"),
    Symbol("flwr.client.mod.secaggplus_mod",
           f"(msg: {_MESSAGE}, ctxt: {_CONTEXT}, call_next: collections.abc.Callable[[{_MESSAGE}, {_CONTEXT}], "
           f"{_MESSAGE}]) -> {_MESSAGE}", "secagg.transport",
           "wrapped by fedapp.privacy.secure_aggregation.secagg_mod"),
    Symbol(f"{_SECAGG_MOD}.SecAggPlusState", None, "secagg.transport",
           "the client's protocol state secagg_mod reads (stage, cohort, field)",
           attributes=("current_stage", "sample_num", "share_num", "clipping_range", "target_range", "mod_range",
                       "max_weight", "public_keys_dict")),
    # fedapp.compat.wakeups
    Symbol("flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue",
           f"(state: flwr.server.superlink.linkstate.linkstate.LinkState, queue: queue.Queue[{_MESSAGE}], "
           "nodes_mapping: dict[int, int], f_stop: threading.Event) -> None",
           "wakeups.feeder", "replaced: asks only the nodes instructions were stored for; a store wakes it"),
    Symbol("flwr.server.superlink.linkstate.linkstate.LinkState.get_message_ins",
           f"(self, node_id: int, limit: int | None, *, run_id: int | None = None) -> list[{_MESSAGE}]",
           "wakeups.feeder", "called by the replacement feeder, one node at a time as Flower's"),
    Symbol("flwr.server.superlink.linkstate.linkstate.LinkState.store_message_ins",
           f"(self, message: {_MESSAGE}) -> str | None", "wakeups.linkstate", "wrapped on the one instance"),
    Symbol("flwr.server.superlink.linkstate.linkstate.LinkState.store_message_res",
           f"(self, message: {_MESSAGE}) -> str | None", "wakeups.linkstate", "wrapped on the one instance"),
    Symbol(f"{_GRIDS}.inmemory_grid.InMemoryGrid",
           "(state_factory: flwr.server.superlink.linkstate.linkstate_factory.LinkStateFactory, "
           "pull_interval: float = 0.1) -> None", "wakeups.inmemory-grid", "its state's stores wake the round loop",
           attributes=("state",)),
    Symbol(f"{_GRIDS}.inmemory_grid.InMemoryGrid.send_and_receive", _EXCHANGE, "wakeups.inmemory-grid",
           "replaced on the instance"),
    Symbol(f"{_GRIDS}.inmemory_grid.InMemoryGrid.push_messages", _PUSH, "wakeups.inmemory-grid",
           "called by the replacement"),
    Symbol(f"{_GRIDS}.inmemory_grid.InMemoryGrid.pull_messages", _PULL, "wakeups.inmemory-grid",
           "called by the replacement"),
    Symbol(f"{_GRIDS}.http_grid.HttpGrid.send_and_receive", _EXCHANGE, "wakeups.http-grid", "replaced on the instance"),
    Symbol(f"{_GRIDS}.http_grid.HttpGrid.push_messages", _PUSH, "wakeups.http-grid", "called by the replacement"),
    Symbol(f"{_GRIDS}.http_grid.HttpGrid.pull_messages", _PULL, "wakeups.http-grid", "called by the replacement"),
    # fedapp.compat.http_retry: a TLS handshake the peer cut short is retried (ServerApp grid, SuperNode connection)
    Symbol("flwr.supercore.retry.retry_invoker.RetryInvoker", None, "http-retry",
           "an instance's should_giveup and invoke are wrapped", attributes=("should_giveup", "invoke")),
    Symbol("flwr.supercore.retry.retry_invoker.RetryInvoker.invoke",
           "(self, target: collections.abc.Callable[..., typing.Any], *args: Any, **kwargs: Any) -> Any",
           "http-retry", "wrapped on the instance: handshakes cut short are counted per call"),
    Symbol(f"{_GRIDS}.http_grid.HttpGrid", "(runtime_api_address: str = '127.0.0.1:8000', insecure: bool = False, "
           "root_certificates: bytes | None = None, *, token: str) -> None", "http-retry",
           "its retry invoker is wrapped", attributes=("_retry_invoker",)),
    Symbol("flwr.supernode.fleet_http_connection.make_simple_http_retry_invoker",
           "() -> flwr.supercore.retry.retry_invoker.RetryInvoker", "http-retry",
           "replaced in the SuperNode's fleet connection's namespace by a factory whose invokers are wrapped"),
    Symbol("flwr.supernode.cli.flower_supernode.flower_supernode", "() -> None", "http-retry",
           "the SuperNode's entry point, called by fedapp.run.supernode"),
    # fedapp.compat.early_ray
    Symbol(_RAY_BACKEND, f"({_BACKEND_CONFIG}) -> None",
           "early-ray", "its init_ray finds the early Ray head", attributes=("init_args_key",)),
    Symbol(f"{_RAY_BACKEND}.init_ray", f"(self, {_BACKEND_CONFIG}) -> None",
           "early-ray", "replaced: waits for the early start, compares its arguments, then calls Flower's"),
    # fedapp.compat.thread_backend: the engine's backend_fn builds whatever raybackend.RayBackend names when it runs
    Symbol("flwr.server.superlink.fleet.vce.vce_api.start_vce",
           "(backend_name: str, backend_config_json_stream: str, app_dir: str, is_app: bool, f_stop: threading.Event, "
           "run: flwr.supercore.run.Run, metrics: flwr.server.superlink.fleet.vce.metrics.VceMetrics, "
           "client_app: flwr.clientapp.client_app.ClientApp | None = None, client_app_attr: str | None = None, "
           "num_supernodes: int | None = None, state_factory: "
           "flwr.server.superlink.linkstate.linkstate_factory.LinkStateFactory | None = None, "
           "existing_nodes_mapping: dict[int, int] | None = None) -> None", "thread-backend",
           "loads the ClientApp (which installs the thread backend), then builds RayBackend(backend_config)"),
    Symbol(f"{_BACKEND}.Backend", f"({_BACKEND_CONFIG}) -> None", "thread-backend",
           "the base of fedapp.compat.thread_backend's backend", attributes=("num_workers",)),
    Symbol(f"{_BACKEND}.Backend.build",
           "(self, app_fn: collections.abc.Callable[[], flwr.clientapp.client_app.ClientApp]) -> None",
           "thread-backend", "implemented: keeps the ClientApp loader"),
    Symbol(f"{_BACKEND}.Backend.process_message",
           f"(self, message: {_MESSAGE}, context: {_CONTEXT}) -> tuple[{_MESSAGE}, {_CONTEXT}]",
           "thread-backend", "implemented: the ClientApp on the calling engine worker thread"),
    Symbol("flwr.clientapp.client_app.ClientAppException", None, "thread-backend",
           "what a ClientApp's exception is reported as, as Flower's ClientAppActor does"),
    # fedapp.compat.lean_superexec: the launcher's SuperExec becomes a small waiter after its one launch
    Symbol("flwr.supercore.superexec.plugin.base_exec_plugin.BaseExecPlugin.launch_task",
           "(self, token: str, task: flwr.proto.task_pb2.Task) -> flwr.supercore.superexec.executor.types.LaunchResult",
           "lean-superexec", "wrapped: once a simulation task is accepted, the process execs a waiter"),
    Symbol("flwr.supercore.superexec.executor.types.LaunchResult", None, "lean-superexec",
           "the launch's outcome, read by the wrapper", attributes=("status",)),
    Symbol("flwr.supercore.superexec.executor.types.LaunchResultStatus.ACCEPTED", None, "lean-superexec",
           "the outcome after which the runtime runs", value="<LaunchResultStatus.ACCEPTED: 'accepted'>"),
    Symbol("flwr.supercore.constant.TaskType.SIMULATION", None, "lean-superexec",
           "the task whose launch the waiter follows", value="<TaskType.SIMULATION: 'flwr-simulation'>"),
    # fedapp.compat.lean_actor
    Symbol("flwr.simulation", None, "lean-actor",
           "a package whose __init__ a Ray worker defers (sys.modules) until a name it defines is used",
           attributes=("__path__", "run_simulation")),
    Symbol("flwr.simulation.ray_transport.ray_actor.ClientAppActor", None, "lean-actor",
           "the actor class a worker loads without the package's __init__ (a Ray actor class: no signature)"),
    # fedapp.experiments.notebook_utils._NodeProxy: the in-process loop's stand-in for Flower's client proxies
    Symbol(f"{_PROXY}.fit", f"(self, ins: {_LEGACY}.FitIns, timeout: float | None, group_id: int | None) -> "
           f"{_LEGACY}.FitRes", "in-process-proxy", "overridden"),
    Symbol(f"{_PROXY}.evaluate", f"(self, ins: {_LEGACY}.EvaluateIns, timeout: float | None, group_id: int | None) "
           f"-> {_LEGACY}.EvaluateRes", "in-process-proxy", "overridden"),
    Symbol(f"{_PROXY}.get_parameters", f"(self, ins: {_LEGACY}.GetParametersIns, timeout: float | None, "
           f"group_id: int | None) -> {_LEGACY}.GetParametersRes", "in-process-proxy", "overridden"),
    Symbol(f"{_PROXY}.get_properties", f"(self, ins: {_LEGACY}.GetPropertiesIns, timeout: float | None, "
           f"group_id: int | None) -> {_LEGACY}.GetPropertiesRes", "in-process-proxy", "overridden"),
    Symbol(f"{_PROXY}.reconnect", f"(self, ins: {_LEGACY}.ReconnectIns, timeout: float | None, group_id: int | None) "
           f"-> {_LEGACY}.DisconnectRes", "in-process-proxy", "overridden"),
    # fedapp.library.message_api.MessageStrategy: the round engine under Flower's Message API, with legacy records
    Symbol("flwr.server.compat.grid_client_proxy.GridClientProxy.__init__",
           "(self, node_id: int, grid: flwr.serverapp.grid.grid.Grid, run_id: int)", "message-api",
           "built per grid node: the ClientManager the engine samples from"),
    Symbol(f"{_RECORDS}.fitins_to_recorddict", f"(fitins: {_LEGACY}.FitIns, keep_input: bool) -> {_RECORDDICT}",
           "message-api", "a train message's content"),
    Symbol(f"{_RECORDS}.recorddict_to_fitres", f"(recorddict: {_RECORDDICT}, keep_input: bool) -> {_LEGACY}.FitRes",
           "message-api", "a train reply for aggregate_fit"),
    Symbol(f"{_RECORDS}.evaluateins_to_recorddict", f"(evaluateins: {_LEGACY}.EvaluateIns, keep_input: bool) -> "
           f"{_RECORDDICT}", "message-api", "an evaluate message's content"),
    Symbol(f"{_RECORDS}.recorddict_to_evaluateres", f"(recorddict: {_RECORDDICT}) -> {_LEGACY}.EvaluateRes",
           "message-api", "an evaluate reply for aggregate_evaluate"),
    # fedapp.compat.lean_ray
    Symbol("ray._private.node.Node.__init__",
           "(self, ray_params, head: bool = False, shutdown_at_exit: bool = True, spawn_reaper: bool = True, "
           "connect_only: bool = False, default_worker: bool = False, ray_init_cluster: bool = False)",
           "lean-ray", "replaced while a lean head starts: a new local cluster's head without three daemons"),
    Symbol("ray._private.node.Node.start_api_server", "(self, *, include_dashboard: Optional[bool], "
           "raise_on_failure: bool)", "lean-ray", "replaced on the lean head's instance by a no-op"),
    Symbol("ray._private.parameter.RayParams", None, "lean-ray", "two of its settings set by the lean head",
           attributes=("no_monitor", "include_log_monitor")),
    Symbol("ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR", None, "lean-ray",
           "the environment variable the lean head sets for fedapp.compat.lean_actor's worker hook",
           value="'__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR'"),
)

SYMBOLS: dict[str, Symbol] = {s.path: s for s in SURFACE}
GROUPS: tuple[str, ...] = tuple(dict.fromkeys(s.group for s in SURFACE))


def installed_version(library: str) -> str:
    """The library's ``__version__`` (imported if it is not yet); ``"not installed"`` without it."""
    try:
        return str(getattr(importlib.import_module(library), "__version__", "unknown"))
    except ImportError:
        return "not installed"


def releases(library: str) -> str:
    """The releases of ``library`` in :data:`TESTED`, for a message: ``"1.41.x or 1.42.x"``."""
    return " or ".join(f"{r}.x" for r in TESTED.get(library, ())) or "(none recorded)"


def version_supported(library: str) -> bool:
    """Whether the installed ``library`` has a major.minor release in :data:`TESTED`."""
    version = installed_version(library)
    return any(same_minor(version, tested) for tested in TESTED.get(library, ()))


def version_problem(library: str) -> str | None:
    """Why the installed ``library`` is not the release the surface was tested against (None when it is)."""
    if version_supported(library):
        return None
    return (f"{library} {installed_version(library)} is installed; fedapp.compat's patches are written and tested "
            f"for {library} {releases(library)}")


@functools.cache
def _split(path: str) -> tuple[str, tuple[str, ...]]:
    """``path`` as (the longest importable module, the attributes after it)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                    continue
                raise
        return name, tuple(parts[i:])
    raise ModuleNotFoundError(f"no module in {path!r}", name=parts[0])


def resolve(path: str) -> Any:
    """The object at ``path`` now (a patched name gives the patch); raises ImportError or AttributeError."""
    module, attributes = _split(path)
    obj: Any = sys.modules[module] if module in sys.modules else importlib.import_module(module)
    for name in attributes:
        obj = getattr(obj, name)
    return obj


def _owner(path: str) -> tuple[Any, str]:
    parent, _, name = path.rpartition(".")
    return resolve(parent), name


_lock = threading.Lock()
#: (id(owner), name) -> the library's own object, for every name :func:`replace` changed
_originals: dict[tuple[int, str], Any] = {}


def library_object(path: str) -> Any:
    """The library's own object at ``path``: its original where :func:`replace` patched it."""
    owner, name = _owner(path) if "." in path else (None, path)
    if owner is not None and (id(owner), name) in _originals:
        return _originals[(id(owner), name)]
    return resolve(path)


def replace(path: str, new: Any) -> Any:
    """Set the registered symbol ``path`` to ``new`` and return what it was (for :func:`restore`). The original is
    remembered, so the surface's checks keep seeing the library's object."""
    if path not in SYMBOLS:
        raise RuntimeError(f"{path} is not in fedapp.compat.surface.SURFACE: register it before patching it")
    owner, name = _owner(path)
    with _lock:
        previous = getattr(owner, name)
        _originals.setdefault((id(owner), name), previous)
        setattr(owner, name, new)
    return previous


def restore(path: str, previous: Any) -> None:
    """Undo :func:`replace` (``previous`` is what it returned)."""
    owner, name = _owner(path)
    with _lock:
        setattr(owner, name, previous)
        if _originals.get((id(owner), name)) is previous:
            del _originals[(id(owner), name)]


def signature_of(obj: Any) -> str | None:
    """``str(inspect.signature(obj))``, or None when Python cannot tell it."""
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def _has_attribute(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    for cls in inspect.getmro(obj):
        init = cls.__dict__.get("__init__")
        if init is None or cls is object:
            continue
        try:
            if assigned.search(inspect.getsource(init)):
                return True
        except (OSError, TypeError):
            continue
    return False


def check(symbol: Symbol) -> list[str]:
    """What differs between ``symbol`` as recorded and the installed library (empty when nothing does)."""
    try:
        obj = library_object(symbol.path)
    except (ImportError, AttributeError) as exc:
        return [f"{symbol.path} is missing ({type(exc).__name__}: {exc})"]
    found: list[str] = []
    if symbol.signature is not None:
        actual = signature_of(obj)
        if actual != symbol.signature:
            found.append(f"{symbol.path}{actual} differs from the recorded {symbol.path}{symbol.signature}")
    missing = [name for name in symbol.attributes if not _has_attribute(obj, name)]
    if missing:
        found.append(f"{symbol.path} lacks {', '.join(missing)}")
    if symbol.value is not None and repr(obj) != symbol.value:
        found.append(f"{symbol.path} = {obj!r}, not the recorded {symbol.value}")
    return found


def problems(*groups: str, symbols: Iterable[Symbol] | None = None) -> list[str]:
    """Every difference between the installed Flower/Ray and the surface of ``groups`` (or of ``symbols``): the
    libraries' versions first, then each symbol's signature, attributes and value, each naming the installed version."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"no surface group {sorted(unknown)}; known: {GROUPS}")
    chosen = list(symbols) if symbols is not None else [s for s in SURFACE if s.group in groups]
    libraries = list(dict.fromkeys(s.library for s in chosen))
    found = [p for p in (version_problem(lib) for lib in libraries) if p is not None]
    for symbol in chosen:
        found += [f"{p} ({symbol.library} {installed_version(symbol.library)} installed)" for p in check(symbol)]
    return found


def require(*groups: str, symbols: Iterable[Symbol] | None = None) -> None:
    """:func:`problems`, raised as one RuntimeError when there are any."""
    found = problems(*groups, symbols=symbols)
    if found:
        raise RuntimeError("this Flower/Ray is not the one fedapp.compat was written for (run "
                           "tests/unit/fedapp/compat/test_surface.py): " + "; ".join(found))
