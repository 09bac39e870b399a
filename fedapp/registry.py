"""Strategy registry: run-config ``strategy`` → (server strategy factory, client factory).

Entries name their factories as ``"module:attribute"`` and are imported lazily, so a
family's heavy dependencies load only when it is used. A server factory has signature
``(cfg, StrategyContext) -> flwr Strategy``; a client factory ``(context, cfg) -> flwr Client``.

To add a strategy: write ``strategies/<family>.py`` (math + Strategy subclass + factory),
a client in ``fedapp/clients/<family>.py``, then add one :class:`StrategySpec` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedapp.config import ConfigError


@dataclass(frozen=True)
class StrategySpec:
    name: str
    family: str
    strategy: str  # "module:factory" for the server side
    client: str  # "module:factory" for the client side
    privacy: str  # threat model in one line: level (record/client), local/central, server trust
    description: str

    def strategy_factory(self) -> Callable[..., Any]:
        return _resolve(self.strategy)

    def client_factory(self) -> Callable[..., Any]:
        return _resolve(self.client)


def _resolve(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_SPECS: list[StrategySpec] = [
    # --- foundation ------------------------------------------------------------------
    StrategySpec("fedavg", "foundation", "strategies.fedavg:build_fedavg", "fedapp.clients.dpsgd:make_plain_client",
                 "none (non-private baseline)", "FedAvg, w_i ∝ N_i, plain local SGD"),
    StrategySpec("dpsgd-fedavg", "foundation", "strategies.fedavg:build_dpsgd_fedavg",
                 "fedapp.clients.dpsgd:make_dpsgd_client",
                 "record-level local DP (DP-SGD per client, heterogeneous ε_i); untrusted server",
                 "DPFedAvg (Noble et al.): DP-SGD clients, w_i ∝ N_i"),
    # --- Robust-HDP family (issue 3) -------------------------------------------------
    # --- Fed-SMP family (issue 4) ----------------------------------------------------
    # --- SoteriaFL family (issue 5) --------------------------------------------------
    # --- DP2-FedSAM family (issue 6) -------------------------------------------------
]

REGISTRY: dict[str, StrategySpec] = {s.name: s for s in _SPECS}


def get_spec(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
