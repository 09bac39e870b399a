"""Flower ServerApp: resolves the run-config, builds the registered strategy, writes results."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import Context, RecordDict, log
from flwr.server import ServerConfig
from flwr.server.compat import start_grid
from flwr.serverapp import Grid, ServerApp

from fedapp.apps.factories import build_strategy
from fedapp.apps.privacy_plan import privacy_plan
from fedapp.clients.common import make_model, model_for_shape
from fedapp.clients.training import evaluate_model, get_weights, resolve_device, set_weights
from fedapp.compat.heap import return_freed_memory
from fedapp.compat.http_retry import retry_grid_tls_eof
from fedapp.compat.server_log import RESULTS_FOLDER_LINE, RUN_END_LINE, log_to_file_from_env
from fedapp.compat.wakeups import wake_grid
from fedapp.config import (
    ConfigError,
    DataConfig,
    GeneralConfig,
    TrainingConfig,
    check_fault_config,
    resolve_config,
    unused_keys,
)
from fedapp.config.run_config import RunConfig, audits_records, record_canaries
from fedapp.data.canaries import candidates
from fedapp.data.client_data import client_train_sizes
from fedapp.data.datasets import ArrayDataset, load_dataset
from fedapp.data.node_data import is_node_local, run_schema
from fedapp.models.catalog import ModelSpec
from fedapp.privacy.audit import AuditRecorder, canary_index, client_audit
from fedapp.privacy.profiles import federation_profiles
from fedapp.privacy.record_audit import record_audit_block
from fedapp.privacy.secure_aggregation import run_with_secure_aggregation
from fedapp.registry import get_spec
from fedapp.state.cache import release_mapped_pages
from fedapp.state.checkpoint import attach as attach_checkpointing
from fedapp.state.client_state import compact_lineage, default_state_dir
from fedapp.state.results import ResultsWriter
from strategies.aggregate import unflatten
from strategies.base import DPFLStrategy, StrategyContext
from strategies.client_level import ClientLevelDPStrategy
from strategies.privacy.threat_models import Level, ThreatModel


@dataclass(frozen=True)
class ServerInputs:
    """What the server side of a run is built from, loaded once per run: the dataset's held-out test split (None for
    node-local data: there is no central test set, evaluation is federated), the model (centralized evaluation loads
    the global weights into it) and its initial weights."""

    test: ArrayDataset | None
    model: torch.nn.Module
    initial_weights: list[np.ndarray]


def load_server_inputs(data: DataConfig, model_spec: ModelSpec) -> ServerInputs:
    if is_node_local(data):  # the server never sees the nodes' data: the model comes from the run-config's schema
        schema = run_schema(data)
        model = model_for_shape(model_spec, schema.input_shape, schema.num_classes)
        return ServerInputs(test=None, model=model, initial_weights=get_weights(model))
    _, test = load_dataset(data.dataset, data.data_dir)
    model = make_model(model_spec, test)
    return ServerInputs(test=test, model=model, initial_weights=get_weights(model))


def make_evaluate_fn(general: GeneralConfig, inputs: ServerInputs):
    """Centralized evaluation of the global model on the dataset's held-out test split (None without one)."""
    model, test = inputs.model, inputs.test
    if test is None:
        return None
    device = resolve_device(general.device)
    batch = general.eval_batch_size

    def evaluate_fn(weights: list[np.ndarray]) -> tuple[float, dict[str, Any]]:
        set_weights(model, weights)
        loss, acc = evaluate_model(model, test, batch_size=batch, device=device)
        release_mapped_pages(test.x, test.y)  # the test set stays in the page cache, not in this process
        return_freed_memory()  # the batches' activations: back to the OS until the next evaluation
        return float(loss), {"accuracy": float(acc)}

    return evaluate_fn


def audit_recorder(recorder: Any, strategy: Any, general: GeneralConfig, inputs: ServerInputs) -> AuditRecorder:
    """The run's recorder wrapped by its privacy audit (run-config ``audit-canaries``): record canaries for the
    record-level families (:mod:`fedapp.privacy.record_audit`), canary clients for the client-level ones
    (:mod:`fedapp.privacy.audit`, marked in the round records)."""
    seed, k, n = general.audit_seed, general.audit_canaries, general.num_clients
    if not audits_records(general.strategy):
        return AuditRecorder(recorder, strategy, client_audit(seed, k), n,
                             canary_client=lambda cid, num: canary_index(cid, num, k) is not None)
    assert inputs.test is not None  # check_audit: a simulation's dataset, never node-local
    records = candidates(seed, k, inputs.test.input_shape, inputs.test.num_classes)
    shapes = [w.shape for w in inputs.initial_weights]
    model, device = inputs.model, resolve_device(general.device)

    def losses(flat: np.ndarray) -> np.ndarray:
        set_weights(model, unflatten(flat, shapes))
        model.to(device).eval()
        with torch.no_grad():
            out = model(torch.as_tensor(records.x, device=device))
            return torch.nn.functional.cross_entropy(out, torch.as_tensor(records.y, device=device),
                                                     reduction="none").cpu().numpy()

    def audit(initial: np.ndarray, models: list[np.ndarray], rounds: list[dict[str, Any]],
              statistics: dict[str, Any]) -> dict[str, Any]:
        return record_audit_block(seed, k, losses, initial, models[-1], rounds, n or int(strategy.num_available),
                                  statistics)

    return AuditRecorder(recorder, strategy, audit, n, every_round=False)  # the record audit reads the final model


def make_prevalidate(cfg: RunConfig):
    """Checks every simulated client's profile against its data, then the family's mechanism
    (:meth:`fedapp.registry.Mechanism.check`), before round 1."""
    general, data, training = cfg.general, cfg.data, cfg.training

    def prevalidate(num_clients: int) -> None:
        if general.num_clients and general.num_clients != num_clients:
            raise ConfigError(f"run-config 'num-clients' = {general.num_clients} but {num_clients} clients connected")
        n = general.num_clients or num_clients
        mechanism = get_spec(general.strategy).mechanism  # fedapp.apps.mechanisms
        profiles = federation_profiles(general, training, data, num_clients)
        if is_node_local(data):  # N_i is each node's own: every node checks its batch size and δ_i itself
            mechanism.check(cfg, n, profiles, None)
            return
        sizes = list(client_train_sizes(data, general.seed, num_clients, record_canaries(general)))
        for profile, n_i in zip(profiles, sizes):
            if profile.batch_size > n_i:
                raise ConfigError(f"client {profile.client_id}: batch-size {profile.batch_size} > its dataset size "
                                  f"N_i = {n_i}")
        mechanism.check(cfg, n, profiles, sizes)  # σ, δ, the factorization: fail early

    return prevalidate


def _ledger_accountant(training: TrainingConfig, threat_model: ThreatModel) -> str:
    """The accountant the ledger composes with: record-level DP under its neighbouring relation."""
    from strategies.privacy.accountants import record_accountant

    if threat_model.level is Level.RECORD:
        return record_accountant(training.accountant, training.record_neighbours)
    return training.accountant


def privacy_meta(cfg: RunConfig) -> dict[str, Any]:
    """What ``config.json`` says about the guarantee this run can claim (the family's mechanism adds its part)."""
    spec = get_spec(cfg.general.strategy)
    seeded = cfg.general.seeded_noise
    out: dict[str, Any] = {
        "threat_model": spec.privacy,
        "ledger": "server-side: the server composes every client's ε from mechanism parameters with the "
                  f"'{_ledger_accountant(cfg.training, spec.privacy)}' accountant; clients' reports are only "
                  "cross-checked",
        "client_sampling": ("seeded from the run seed: no amplification by sampling against anyone who knows it"
                            if seeded else "secret (OS entropy); participation stays in the server's records"),
        "guarantee": ("NONE: seeded-noise = true derives the DP noise from the run seed, which the server knows"
                      if seeded else "as stated by the threat model"),
    }
    out.update(spec.mechanism.meta(cfg))  # fedapp.apps.mechanisms
    return out


@dataclass(frozen=True)
class ServerParts:
    """What the ServerApp runs: the built strategy and Flower's round settings (rounds left, round timeout)."""

    strategy: DPFLStrategy
    config: ServerConfig


def build_components(run_config: Mapping[str, Any], *, transport: bool = True,
                     inputs: ServerInputs | None = None) -> ServerParts:
    """The composition root of the server: resolve ``run_config`` (a Flower run-config mapping or a resolved
    :class:`~fedapp.config.RunConfig`) and build the run's strategy, results writer, checkpointing and round settings,
    handing each part the sections it reads. ``transport``: the server runs the fit step through Flower's messages,
    so client-level DP strategies get SecAgg+ when the run-config asks for it (False for in-process loops, which
    cannot run SecAgg+). ``inputs``: already loaded (else loaded here)."""
    cfg = resolve_config(run_config)
    spec = get_spec(cfg.general.strategy)
    inputs = inputs or load_server_inputs(cfg.data, cfg.model_spec)
    initial = inputs.initial_weights
    unused = unused_keys(cfg, spec.family)
    for key in unused:
        log(WARNING, "run-config %r = %r is not read by strategy %r (family %s); it has no effect", key, cfg[key],
            spec.name, spec.family.name)
    recorder = ResultsWriter(cfg.general.output_dir, dict(cfg), meta={
        "strategy": {"name": spec.name, "family": spec.family.name, "privacy": spec.privacy,
                     "description": spec.description},
        "privacy": privacy_meta(cfg),
        "privacy_plan": None,  # below, from the built strategy
        "unused_keys": unused,
        "num_parameters": int(sum(w.size for w in initial)),
    }, on_open=lambda folder: log(INFO, "%s%s", RESULTS_FOLDER_LINE, folder))  # the launcher reads it in the log
    ctx = StrategyContext(initial_weights=initial, evaluate_fn=make_evaluate_fn(cfg.general, inputs),
                          recorder=recorder, prevalidate=make_prevalidate(cfg),
                          secure_aggregation=transport and cfg.client_dp.secure_aggregation)
    strategy = build_strategy(cfg, ctx)
    if cfg.general.num_clients:  # config.json is written when the first round opens the run folder
        payload_dim = strategy.payload_dim() if isinstance(strategy, ClientLevelDPStrategy) else None
        recorder.meta["privacy_plan"] = privacy_plan(cfg, cfg.general.num_clients, payload_dim)
    check_fault_config(cfg.deployment)
    audited: Any = recorder
    if cfg.general.audit_canaries > 0:  # the audit block added to summary.json when the run ends
        audited = audit_recorder(recorder, strategy, cfg.general, inputs)
        strategy.record_with(audited)
    journal = Path(cfg.deployment.client_state_dir or default_state_dir(cfg.general))
    remaining = attach_checkpointing(  # resume-from, checkpoints, faults; an ended run's journals on this disk
        strategy, audited, run_values=dict(cfg), general=cfg.general, deployment=cfg.deployment,
        on_end=functools.partial(compact_lineage, journal))
    return ServerParts(strategy=strategy, config=ServerConfig(
        num_rounds=remaining, round_timeout=cfg.deployment.round_timeout or None))


def dry_run(run_config: Mapping[str, Any], num_clients: int) -> list[str]:
    """Build everything a run builds — strategy, mechanism, resume state, one client — without starting a
    process or writing a file, so every configuration error surfaces before anything starts. Returns the
    keys the strategy does not read."""
    cfg = resolve_config(run_config)
    if cfg.general.min_available_clients > num_clients:
        raise ConfigError(f"run-config 'min-available-clients' = {cfg.general.min_available_clients} but only {num_clients} "
                          "clients will connect: the server would wait for them forever")
    if cfg.general.num_clients and cfg.general.num_clients != num_clients:
        raise ConfigError(f"run-config 'num-clients' = {cfg.general.num_clients} but {num_clients} clients will connect")
    inputs = load_server_inputs(cfg.data, cfg.model_spec)
    test = inputs.test
    batch = (torch.from_numpy(test.x[:2].copy()) if test is not None  # a copy: the pool is read-only
             else torch.zeros((2, *run_schema(cfg.data).input_shape)))
    try:
        inputs.model.eval()(batch)
    except Exception as exc:  # noqa: BLE001 — any shape/dtype mismatch of model and data
        raise ConfigError(f"run-config 'model' = {cfg.general.model!r} does not fit dataset {cfg.data.dataset!r} "
                          f"(inputs {tuple(batch.shape[1:])}): {type(exc).__name__}: {exc}") from None
    components = build_components(cfg, inputs=inputs)
    strategy = components.strategy
    prevalidate = getattr(strategy, "prevalidate", None)
    if callable(prevalidate):
        prevalidate(num_clients)
    setup = getattr(strategy, "setup_privacy", None)
    if callable(setup):
        setup(cfg.general.num_clients or num_clients)
    if not is_node_local(cfg.data):  # node-local data is each node's own: the deploy launcher checks it per node
        node = Context(run_id=0, node_id=0, node_config={"partition-id": 0, "num-partitions": num_clients},
                       state=RecordDict(), run_config={})
        get_spec(cfg.general.strategy).client(node, dict(cfg))  # the client side builds (model, data, head)
    return unused_keys(cfg, get_spec(cfg.general.strategy).family)


def run_server(grid: Grid, context: Context, overrides: dict[str, Any] | None = None) -> None:
    """The ServerApp's main: build the components, then run Flower's round loop — with SecAgg+ as the fit
    step for client-level DP strategies (``secure-aggregation``), the legacy loop otherwise."""
    cfg = resolve_config(context.run_config, overrides)
    components = build_components(cfg)
    strategy = components.strategy
    wake_grid(grid)  # in the simulation runtime: replies wake the round loop instead of its 0.1 s poll
    retry_grid_tls_eof(grid)  # deployed: a TLS handshake the SuperLink cut short costs no client its round
    if getattr(strategy, "secure_aggregation", False):
        log(INFO, "secure aggregation (SecAgg+) on: the server sees only the sum of each round's updates")
        run_with_secure_aggregation(grid, context, strategy, components.config, cfg.client_dp, cfg.deployment)
    else:
        start_grid(grid=grid, config=components.config, strategy=strategy)
    log(INFO, RUN_END_LINE)  # the launcher prints the log until this line (fedapp.compat.server_log)


def build_server_app(overrides: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose run-config is Flower's merged with ``overrides`` (used by tests)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, context, overrides)

    return app


app = build_server_app()
log_to_file_from_env()  # in `flwr-simulation` started by the launcher: the log it prints (fedapp.compat.server_log)
