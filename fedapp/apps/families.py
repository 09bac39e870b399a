"""The built-in strategy families, one :class:`~fedapp.registry.Family` object each, registered on import.

Each states the run-config sections it reads and the keys of those it ignores, its features, and per strategy the
threat model, the privacy mechanism (:mod:`fedapp.apps.mechanisms`), the server builder and the client builder
(:mod:`fedapp.apps.factories`). The registry imports this module the first time it is read.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from fedapp.apps.mechanisms import ClientLevel, CorrelatedNoise, NoPrivacy, RecordLevel
from fedapp.registry import Family, Feature, StrategySpec, register_family
from strategies.privacy.threat_models import ThreatModel as TM

FACTORIES = "fedapp.apps.factories"


class _Deferred:
    """A builder of :mod:`fedapp.apps.factories`, imported on its first call or inspection: reading the registry
    (the launcher's checks, ``resolve_config``) then loads no strategy, Flower or client stack (~110 MB the launcher
    would keep for the whole run)."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    @functools.cached_property
    def target(self) -> Any:
        return getattr(importlib.import_module(FACTORIES), self.__name__)

    @property
    def __signature__(self) -> inspect.Signature:  # what RunConfig.sections_for reads
        return inspect.signature(self.target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<deferred {FACTORIES}.{self.__name__}>"


class _Factories:
    def __getattr__(self, name: str) -> _Deferred:
        return _Deferred(name)


f = _Factories()

_BASE = frozenset({"general", "data", "privacy", "deployment"})
#: record-level keys a client-level family never reads
_CLIENT_LEVEL_IGNORES = frozenset({"privacy-dist", "epsilon-floor", "delta", "falsify-client", "falsify-epsilon",
                                   "grad-sample-mode", "cuda-graphs", "batch-size-choices", "record-neighbours",
                                   "epsilon"})
#: the features of a client-level strategy with independent Gaussian noise each round
_INDEPENDENT_NOISE = frozenset({Feature.ADAPTIVE_CLIP, Feature.DDG})

NONE, DPSGD, CLIENT = NoPrivacy(), RecordLevel(dpsgd=True), ClientLevel()

FOUNDATION = Family("foundation", _BASE, (
    StrategySpec("fedavg", TM.NONE, NONE, f.build_fedavg, f.make_plain_client, "FedAvg, w_i ∝ N_i, plain local SGD"),
    StrategySpec("dpsgd-fedavg", TM.RECORD_LOCAL_DPSGD, DPSGD, f.build_dpsgd_fedavg, f.make_dpsgd_client,
                 "DPFedAvg (Noble et al.): DP-SGD clients, w_i ∝ N_i", frozenset({Feature.DPSGD_CLIENTS})),
))

ROBUST_HDP = Family("robust-hdp", _BASE | {"robust-hdp"}, (
    StrategySpec("robust-hdp", TM.RECORD_LOCAL_DPSGD, DPSGD, f.build_robust_hdp, f.make_dpsgd_client,
                 "Robust-HDP (Alg. 1): Robust PCA of the updates, w_i ∝ 1/‖S[:, i]‖²; ignores reported ε"),
    StrategySpec("weiavg", TM.RECORD_LOCAL_DPSGD, DPSGD, f.build_weiavg, f.make_dpsgd_client,
                 "WeiAvg (Liu et al. 2021): w_i ∝ reported ε_i"),
    StrategySpec("pfa", TM.RECORD_LOCAL_DPSGD, DPSGD, f.build_pfa, f.make_dpsgd_client,
                 "PFA (Liu et al. 2021): private updates projected on the public top-k subspace, w_i ∝ reported ε_i"),
    StrategySpec("min-eps", TM.RECORD_LOCAL_MIN_EPS, DPSGD, f.build_min_eps, f.make_min_eps_client,
                 "minimum-ε: every client trains with min_j ε_j, w_i ∝ N_i"),
), features=frozenset({Feature.DPSGD_CLIENTS}))

FED_SMP = Family("fed-smp", _BASE | {"fed-smp"}, (
    StrategySpec("dp-fedavg", TM.CLIENT_LEVEL_LOCAL_NOISE, CLIENT, f.build_dp_fedavg, f.make_client_dp_client,
                 "DP-FedAvg (Fed-SMP Alg. 1): clip Δ to C, add N(0, C²σ²/r), server averages with 1/r",
                 _INDEPENDENT_NOISE),
    StrategySpec("fed-smp-randk", TM.CLIENT_LEVEL_LOCAL_NOISE, CLIENT, f.build_fed_smp_randk, f.make_client_dp_client,
                 "Fed-SMP rand_k (Alg. 2): seeded random mask, d/k scaling, clip, noise on k coords",
                 _INDEPENDENT_NOISE),
    StrategySpec("fed-smp-topk", TM.CLIENT_LEVEL_LOCAL_NOISE, CLIENT, f.build_fed_smp_topk, f.make_client_dp_client,
                 "Fed-SMP top_k (Alg. 2): mask from server SGD on a held-out public set, clip, noise on k coords",
                 _INDEPENDENT_NOISE | {Feature.PUBLIC_SET}),
    StrategySpec("fedavg-randk", TM.NONE_SPARSIFIED, NONE, f.build_fedavg_randk, f.make_compressed_client,
                 "FedAvg-rand_k: Fed-SMP rand_k without noise (sparsify, d/k scaling, clip)"),
    StrategySpec("fedavg-topk", TM.NONE_SPARSIFIED, NONE, f.build_fedavg_topk, f.make_compressed_client,
                 "FedAvg-top_k: Fed-SMP top_k without noise (server public-set mask, clip)",
                 frozenset({Feature.PUBLIC_SET})),
), ignores=_CLIENT_LEVEL_IGNORES)

DP_FTRL = Family("dp-ftrl", _BASE | {"fed-smp"}, (  # its keys live in [fed-smp]
    StrategySpec("dp-ftrl", TM.CLIENT_LEVEL_FTRL, CorrelatedNoise(), f.build_dp_ftrl, f.make_ftrl_client,
                 "DP-FTRL (Kairouz et al. 2021; Choquette-Choo et al. 2023): DP-FedAvg rounds with tree or banded "
                 "correlated noise, no sampling assumption (dense only: a Fed-SMP mask breaks the noise's "
                 "cancellation, see strategies/dp_ftrl.py)", frozenset({Feature.CORRELATED_NOISE})),
), ignores=_CLIENT_LEVEL_IGNORES)

_SOTERIAFL = RecordLevel(dpsgd=False)
SOTERIAFL = Family("soteriafl", _BASE | {"soteriafl"}, tuple(
    StrategySpec(name, TM.RECORD_LOCAL_SOTERIAFL, _SOTERIAFL, f.build_soteriafl, f.make_soteriafl_client, text)
    for name, text in (
        ("soteriafl-sgd", "SoteriaFL-SGD (Alg. 3 opt. I): minibatch estimator, shifted random-k compression"),
        ("soteriafl-gd", "SoteriaFL-GD (Alg. 3, b = m): full local gradient, shifted random-k compression"),
        ("soteriafl-svrg", "SoteriaFL-SVRG (Alg. 3 opt. II): loopless SVRG estimator, shifted random-k compression"),
        ("soteriafl-saga", "SoteriaFL-SAGA (Alg. 3 opt. III): SAGA table estimator, shifted random-k compression"),
        ("cdp-sgd", "CDP-SGD (Alg. 1): minibatch estimator, direct random-k compression of the noisy gradient"),
        ("ldp-sgd", "LDP-SGD (Sec. 6 baseline): minibatch estimator, no compression"),
        ("ldp-svrg", "LDP-SVRG (Sec. 6 baseline): SVRG estimator, no compression"))),
    ignores=frozenset({"grad-sample-mode", "cuda-graphs", "local-epochs", "lr", "momentum", "lr-decay", "batch-size",
                       "batch-size-choices"}))

DP2_FEDSAM = Family("dp2-fedsam", _BASE | {"fed-smp", "dp2-fedsam"}, (
    StrategySpec("dp2-fedsam", TM.CLIENT_LEVEL_PERSONALIZED, CLIENT, f.build_dp2_fedsam, f.make_dp2_fedsam_client,
                 "DP2-FedSAM: shared φ (SAM, clipped + noised) and personal heads h_i kept on the clients"),
    StrategySpec("centaur", TM.CLIENT_LEVEL_PERSONALIZED, CLIENT, f.build_centaur, f.make_dp2_fedsam_client,
                 "CENTAUR (client-level DP variant): DP2-FedSAM with SGD instead of SAM"),
    StrategySpec("dp-fedsam", TM.CLIENT_LEVEL_LOCAL_NOISE, CLIENT, f.build_dp_fedsam, f.make_dp2_fedsam_client,
                 "DP-FedSAM: full model, SAM local training, client-level DP"),
    StrategySpec("dp-fedsam-ft", TM.CLIENT_LEVEL_PERSONALIZED, CLIENT, f.build_dp_fedsam_ft, f.make_dp2_fedsam_client,
                 "DP-FedSAM + local fine-tuning (ft-epochs) before evaluation"),
    StrategySpec("dp-fedavg-ft", TM.CLIENT_LEVEL_PERSONALIZED, CLIENT, f.build_dp_fedavg_ft, f.make_dp2_fedsam_client,
                 "DP-FedAvg + local fine-tuning (ft-epochs) before evaluation"),
), ignores=_CLIENT_LEVEL_IGNORES | {"compression-ratio", "local-steps", "public-samples", "public-steps"},
    features=_INDEPENDENT_NOISE | {Feature.PERSONAL_HEAD})

BUILTIN: tuple[Family, ...] = (FOUNDATION, ROBUST_HDP, FED_SMP, DP_FTRL, SOTERIAFL, DP2_FEDSAM)
for _family in BUILTIN:
    register_family(_family)
