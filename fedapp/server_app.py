"""Flower ServerApp: resolves the run-config, builds the registered strategy, writes results."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import Context
from flwr.server import ServerAppComponents, ServerConfig
from flwr.serverapp import ServerApp

from fedapp.checkpoint import attach as attach_checkpointing
from fedapp.client_data import client_train_sizes
from fedapp.clients.common import make_model
from fedapp.config import ConfigError, RunConfig, resolve_config
from fedapp.data import load_dataset
from fedapp.privacy_profiles import federation_profiles
from fedapp.registry import get_spec
from fedapp.results import ResultsWriter
from fedapp.training import evaluate_model, get_weights, resolve_device, set_weights
from fedapp.tv_compat import guard_state
from strategies.base import StrategyContext


def make_evaluate_fn(cfg: RunConfig):
    """Centralized evaluation of the global model on the dataset's held-out test split."""
    _, test = load_dataset(cfg["dataset"], cfg["data-dir"])
    model = make_model(cfg, test)
    device = resolve_device(cfg["device"])
    batch = int(cfg["eval-batch-size"])

    def evaluate_fn(weights: list[np.ndarray]) -> tuple[float, dict[str, Any]]:
        set_weights(model, weights)
        loss, acc = evaluate_model(model, test, batch_size=batch, device=device)
        return float(loss), {"accuracy": float(acc)}

    return evaluate_fn


def make_prevalidate(cfg: RunConfig):
    """Checks every simulated client's profile against its data before round 1."""

    def prevalidate(num_clients: int) -> None:
        if cfg["num-clients"] and cfg["num-clients"] != num_clients:
            raise ConfigError(f"run-config 'num-clients' = {cfg['num-clients']} but {num_clients} clients connected")
        sizes = client_train_sizes(cfg, num_clients)
        for profile, n_i in zip(federation_profiles(cfg, num_clients), sizes):
            if profile.batch_size > n_i:
                raise ConfigError(f"client {profile.client_id}: batch-size {profile.batch_size} > its dataset size "
                                  f"N_i = {n_i}")

    return prevalidate


def build_components(cfg: RunConfig) -> ServerAppComponents:
    spec = get_spec(cfg["strategy"])
    _, test = load_dataset(cfg["dataset"], cfg["data-dir"])
    initial = get_weights(make_model(cfg, test))
    recorder = ResultsWriter(cfg["output-dir"], dict(cfg), meta={
        "strategy": {"name": spec.name, "family": spec.family, "privacy": spec.privacy,
                     "description": spec.description},
        "num_parameters": int(sum(w.size for w in initial)),
        "torchvision_guard": {k: v for k, v in guard_state().items()},
    })
    ctx = StrategyContext(initial_weights=initial, evaluate_fn=make_evaluate_fn(cfg), recorder=recorder,
                          prevalidate=make_prevalidate(cfg))
    strategy = spec.strategy_factory()(cfg, ctx)
    remaining = attach_checkpointing(strategy, cfg, recorder)  # resume-from, checkpoints, faults (issue 7)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(
        num_rounds=remaining, round_timeout=float(cfg["round-timeout"]) or None))


def build_server_app(overrides: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose run-config is Flower's merged with ``overrides`` (used by tests)."""

    def server_fn(context: Context) -> ServerAppComponents:
        return build_components(resolve_config(context.run_config, overrides))

    return ServerApp(server_fn=server_fn)


app = build_server_app()
