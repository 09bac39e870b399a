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
    StrategySpec("robust-hdp", "robust-hdp", "strategies.robust_hdp:build_robust_hdp",
                 "fedapp.clients.dpsgd:make_dpsgd_client",
                 "record-level local DP (DP-SGD per client, heterogeneous ε_i); untrusted server",
                 "Robust-HDP (Alg. 1): Robust PCA of the updates, w_i ∝ 1/‖S[:, i]‖²; ignores reported ε"),
    StrategySpec("weiavg", "robust-hdp", "strategies.robust_hdp:build_weiavg", "fedapp.clients.dpsgd:make_dpsgd_client",
                 "record-level local DP (DP-SGD per client, heterogeneous ε_i); untrusted server",
                 "WeiAvg (Liu et al. 2021): w_i ∝ reported ε_i"),
    StrategySpec("pfa", "robust-hdp", "strategies.robust_hdp:build_pfa", "fedapp.clients.dpsgd:make_dpsgd_client",
                 "record-level local DP (DP-SGD per client, heterogeneous ε_i); untrusted server",
                 "PFA (Liu et al. 2021): private updates projected on the public top-k subspace, w_i ∝ reported ε_i"),
    StrategySpec("min-eps", "robust-hdp", "strategies.robust_hdp:build_min_eps",
                 "fedapp.clients.dpsgd:make_min_eps_client",
                 "record-level local DP at the federation's minimum ε for every client; untrusted server",
                 "minimum-ε: every client trains with min_j ε_j, w_i ∝ N_i"),
    # --- Fed-SMP family (issue 4) ----------------------------------------------------
    StrategySpec("dp-fedavg", "fed-smp", "strategies.fed_smp:build_dp_fedavg",
                 "fedapp.clients.client_dp:make_client_dp_client",
                 "client-level DP, local noise C·σ/√r per client; ε for the sum (secure aggregation assumed)",
                 "DP-FedAvg (Fed-SMP Alg. 1): clip Δ to C, add N(0, C²σ²/r), server averages with 1/r"),
    StrategySpec("fed-smp-randk", "fed-smp", "strategies.fed_smp:build_fed_smp_randk",
                 "fedapp.clients.client_dp:make_client_dp_client",
                 "client-level DP, local noise on k masked coordinates; ε for the sum (secure aggregation assumed)",
                 "Fed-SMP rand_k (Alg. 2): seeded random mask, d/k scaling, clip, noise on k coords"),
    StrategySpec("fed-smp-topk", "fed-smp", "strategies.fed_smp:build_fed_smp_topk",
                 "fedapp.clients.client_dp:make_client_dp_client",
                 "client-level DP, local noise on k masked coordinates; ε for the sum (secure aggregation assumed)",
                 "Fed-SMP top_k (Alg. 2): mask from server SGD on a held-out public set, clip, noise on k coords"),
    StrategySpec("fedavg-randk", "fed-smp", "strategies.fed_smp:build_fedavg_randk",
                 "fedapp.clients.client_dp:make_compressed_client", "none (non-private baseline)",
                 "FedAvg-rand_k: Fed-SMP rand_k without noise (sparsify, d/k scaling, clip)"),
    StrategySpec("fedavg-topk", "fed-smp", "strategies.fed_smp:build_fedavg_topk",
                 "fedapp.clients.client_dp:make_compressed_client", "none (non-private baseline)",
                 "FedAvg-top_k: Fed-SMP top_k without noise (server public-set mask, clip)"),
    # --- SoteriaFL family (issue 5) --------------------------------------------------
    StrategySpec("soteriafl-sgd", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "SoteriaFL-SGD (Alg. 3 opt. I): minibatch estimator, shifted random-k compression"),
    StrategySpec("soteriafl-gd", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "SoteriaFL-GD (Alg. 3, b = m): full local gradient, shifted random-k compression"),
    StrategySpec("soteriafl-svrg", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "SoteriaFL-SVRG (Alg. 3 opt. II): loopless SVRG estimator, shifted random-k compression"),
    StrategySpec("soteriafl-saga", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "SoteriaFL-SAGA (Alg. 3 opt. III): SAGA table estimator, shifted random-k compression"),
    StrategySpec("cdp-sgd", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "CDP-SGD (Alg. 1): minibatch estimator, direct random-k compression of the noisy gradient"),
    StrategySpec("ldp-sgd", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "LDP-SGD (Sec. 6 baseline): minibatch estimator, no compression"),
    StrategySpec("ldp-svrg", "soteriafl", "strategies.soteriafl:build_soteriafl",
                 "fedapp.clients.soteriafl:make_soteriafl_client",
                 "record-level local DP (per-sample clip G + Gaussian noise on each client before compression); untrusted server",
                 "LDP-SVRG (Sec. 6 baseline): SVRG estimator, no compression"),
    # --- DP2-FedSAM family (issue 6) -------------------------------------------------
    StrategySpec("dp2-fedsam", "dp2-fedsam", "strategies.dp2_fedsam:build_dp2_fedsam",
                 "fedapp.clients.dp2_fedsam:make_dp2_fedsam_client",
                 "client-level DP (clip C, each client adds N(0, C²σ²/r), σ on the sum, q = r/N); honest-but-curious server; heads stay local",
                 "DP2-FedSAM: shared φ (SAM, clipped + noised) and personal heads h_i kept on the clients"),
    StrategySpec("centaur", "dp2-fedsam", "strategies.dp2_fedsam:build_centaur",
                 "fedapp.clients.dp2_fedsam:make_dp2_fedsam_client",
                 "client-level DP (clip C, each client adds N(0, C²σ²/r), σ on the sum, q = r/N); honest-but-curious server; heads stay local",
                 "CENTAUR (client-level DP variant): DP2-FedSAM with SGD instead of SAM"),
    StrategySpec("dp-fedsam", "dp2-fedsam", "strategies.dp2_fedsam:build_dp_fedsam",
                 "fedapp.clients.dp2_fedsam:make_dp2_fedsam_client", "client-level DP (clip C, each client adds N(0, C²σ²/r), σ on the sum, q = r/N); honest-but-curious server",
                 "DP-FedSAM: full model, SAM local training, client-level DP"),
    StrategySpec("dp-fedsam-ft", "dp2-fedsam", "strategies.dp2_fedsam:build_dp_fedsam_ft",
                 "fedapp.clients.dp2_fedsam:make_dp2_fedsam_client", "client-level DP (clip C, each client adds N(0, C²σ²/r), σ on the sum, q = r/N); honest-but-curious server; fine-tuning stays local",
                 "DP-FedSAM + local fine-tuning (ft-epochs) before evaluation"),
    StrategySpec("dp-fedavg-ft", "dp2-fedsam", "strategies.dp2_fedsam:build_dp_fedavg_ft",
                 "fedapp.clients.dp2_fedsam:make_dp2_fedsam_client", "client-level DP (clip C, each client adds N(0, C²σ²/r), σ on the sum, q = r/N); honest-but-curious server; fine-tuning stays local",
                 "DP-FedAvg + local fine-tuning (ft-epochs) before evaluation"),
]

REGISTRY: dict[str, StrategySpec] = {s.name: s for s in _SPECS}


def get_spec(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
