"""Strategy registry: run-config ``strategy`` → (server strategy factory, client factory).

Entries name their factories as ``"module:attribute"`` and are imported lazily, so a
family's heavy dependencies load only when it is used. A server factory has signature
``(StrategyContext, EngineSettings, *, <the run-config sections it reads>) -> flwr Strategy``
(:func:`fedapp.apps.factories.build_strategy` calls it); a client factory ``(context, overrides) -> flwr Client``.

To add a strategy: write ``strategies/<family>.py`` (math + Strategy subclass), its builders in
:mod:`fedapp.apps.factories` (and a client in ``fedapp/clients/<family>.py`` if no existing one fits), then
add one :class:`StrategySpec` below (docs/architecture.md walks through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strategies.errors import ConfigError
from strategies.privacy import threat_models as tm


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
    factory: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return factory


_SPECS: list[StrategySpec] = [
    # --- foundation ------------------------------------------------------------------
    StrategySpec("fedavg", "foundation", "fedapp.apps.factories:build_fedavg", "fedapp.apps.factories:make_plain_client",
                 tm.NONE, "FedAvg, w_i ∝ N_i, plain local SGD"),
    StrategySpec("dpsgd-fedavg", "foundation", "fedapp.apps.factories:build_dpsgd_fedavg",
                 "fedapp.apps.factories:make_dpsgd_client",
                 tm.RECORD_LOCAL_DPSGD,
                 "DPFedAvg (Noble et al.): DP-SGD clients, w_i ∝ N_i"),
    # --- Robust-HDP family -------------------------------------------------------
    StrategySpec("robust-hdp", "robust-hdp", "fedapp.apps.factories:build_robust_hdp",
                 "fedapp.apps.factories:make_dpsgd_client",
                 tm.RECORD_LOCAL_DPSGD,
                 "Robust-HDP (Alg. 1): Robust PCA of the updates, w_i ∝ 1/‖S[:, i]‖²; ignores reported ε"),
    StrategySpec("weiavg", "robust-hdp", "fedapp.apps.factories:build_weiavg", "fedapp.apps.factories:make_dpsgd_client",
                 tm.RECORD_LOCAL_DPSGD,
                 "WeiAvg (Liu et al. 2021): w_i ∝ reported ε_i"),
    StrategySpec("pfa", "robust-hdp", "fedapp.apps.factories:build_pfa", "fedapp.apps.factories:make_dpsgd_client",
                 tm.RECORD_LOCAL_DPSGD,
                 "PFA (Liu et al. 2021): private updates projected on the public top-k subspace, w_i ∝ reported ε_i"),
    StrategySpec("min-eps", "robust-hdp", "fedapp.apps.factories:build_min_eps",
                 "fedapp.apps.factories:make_min_eps_client",
                 tm.RECORD_LOCAL_MIN_EPS,
                 "minimum-ε: every client trains with min_j ε_j, w_i ∝ N_i"),
    # --- Fed-SMP family ----------------------------------------------------------
    StrategySpec("dp-fedavg", "fed-smp", "fedapp.apps.factories:build_dp_fedavg",
                 "fedapp.apps.factories:make_client_dp_client",
                 tm.CLIENT_LEVEL_LOCAL_NOISE,
                 "DP-FedAvg (Fed-SMP Alg. 1): clip Δ to C, add N(0, C²σ²/r), server averages with 1/r"),
    StrategySpec("fed-smp-randk", "fed-smp", "fedapp.apps.factories:build_fed_smp_randk",
                 "fedapp.apps.factories:make_client_dp_client",
                 tm.CLIENT_LEVEL_LOCAL_NOISE,
                 "Fed-SMP rand_k (Alg. 2): seeded random mask, d/k scaling, clip, noise on k coords"),
    StrategySpec("fed-smp-topk", "fed-smp", "fedapp.apps.factories:build_fed_smp_topk",
                 "fedapp.apps.factories:make_client_dp_client",
                 tm.CLIENT_LEVEL_LOCAL_NOISE,
                 "Fed-SMP top_k (Alg. 2): mask from server SGD on a held-out public set, clip, noise on k coords"),
    StrategySpec("fedavg-randk", "fed-smp", "fedapp.apps.factories:build_fedavg_randk",
                 "fedapp.apps.factories:make_compressed_client", tm.NONE_SPARSIFIED,
                 "FedAvg-rand_k: Fed-SMP rand_k without noise (sparsify, d/k scaling, clip)"),
    StrategySpec("fedavg-topk", "fed-smp", "fedapp.apps.factories:build_fedavg_topk",
                 "fedapp.apps.factories:make_compressed_client", tm.NONE_SPARSIFIED,
                 "FedAvg-top_k: Fed-SMP top_k without noise (server public-set mask, clip)"),
    # --- DP-FTRL ------------------------------------------------------------------
    StrategySpec("dp-ftrl", "dp-ftrl", "fedapp.apps.factories:build_dp_ftrl", "fedapp.apps.factories:make_ftrl_client",
                 tm.CLIENT_LEVEL_FTRL,
                 "DP-FTRL (Kairouz et al. 2021; Choquette-Choo et al. 2023): DP-FedAvg rounds with tree or banded "
                 "correlated noise, no sampling assumption (dense only: a Fed-SMP mask breaks the noise's "
                 "cancellation, see strategies/dp_ftrl.py)"),
    # --- SoteriaFL family --------------------------------------------------------
    StrategySpec("soteriafl-sgd", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "SoteriaFL-SGD (Alg. 3 opt. I): minibatch estimator, shifted random-k compression"),
    StrategySpec("soteriafl-gd", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "SoteriaFL-GD (Alg. 3, b = m): full local gradient, shifted random-k compression"),
    StrategySpec("soteriafl-svrg", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "SoteriaFL-SVRG (Alg. 3 opt. II): loopless SVRG estimator, shifted random-k compression"),
    StrategySpec("soteriafl-saga", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "SoteriaFL-SAGA (Alg. 3 opt. III): SAGA table estimator, shifted random-k compression"),
    StrategySpec("cdp-sgd", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "CDP-SGD (Alg. 1): minibatch estimator, direct random-k compression of the noisy gradient"),
    StrategySpec("ldp-sgd", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "LDP-SGD (Sec. 6 baseline): minibatch estimator, no compression"),
    StrategySpec("ldp-svrg", "soteriafl", "fedapp.apps.factories:build_soteriafl",
                 "fedapp.apps.factories:make_soteriafl_client",
                 tm.RECORD_LOCAL_SOTERIAFL,
                 "LDP-SVRG (Sec. 6 baseline): SVRG estimator, no compression"),
    # --- DP2-FedSAM family -------------------------------------------------------
    StrategySpec("dp2-fedsam", "dp2-fedsam", "fedapp.apps.factories:build_dp2_fedsam",
                 "fedapp.apps.factories:make_dp2_fedsam_client",
                 tm.CLIENT_LEVEL_PERSONALIZED,
                 "DP2-FedSAM: shared φ (SAM, clipped + noised) and personal heads h_i kept on the clients"),
    StrategySpec("centaur", "dp2-fedsam", "fedapp.apps.factories:build_centaur",
                 "fedapp.apps.factories:make_dp2_fedsam_client",
                 tm.CLIENT_LEVEL_PERSONALIZED,
                 "CENTAUR (client-level DP variant): DP2-FedSAM with SGD instead of SAM"),
    StrategySpec("dp-fedsam", "dp2-fedsam", "fedapp.apps.factories:build_dp_fedsam",
                 "fedapp.apps.factories:make_dp2_fedsam_client", tm.CLIENT_LEVEL_LOCAL_NOISE,
                 "DP-FedSAM: full model, SAM local training, client-level DP"),
    StrategySpec("dp-fedsam-ft", "dp2-fedsam", "fedapp.apps.factories:build_dp_fedsam_ft",
                 "fedapp.apps.factories:make_dp2_fedsam_client", tm.CLIENT_LEVEL_PERSONALIZED,
                 "DP-FedSAM + local fine-tuning (ft-epochs) before evaluation"),
    StrategySpec("dp-fedavg-ft", "dp2-fedsam", "fedapp.apps.factories:build_dp_fedavg_ft",
                 "fedapp.apps.factories:make_dp2_fedsam_client", tm.CLIENT_LEVEL_PERSONALIZED,
                 "DP-FedAvg + local fine-tuning (ft-epochs) before evaluation"),
]

REGISTRY: dict[str, StrategySpec] = {s.name: s for s in _SPECS}


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy at run time (plugins, notebooks, tests); a name may be registered once."""
    if spec.name in REGISTRY and REGISTRY[spec.name] != spec:
        raise ValueError(f"strategy {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
