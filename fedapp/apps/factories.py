"""Every builder of the app: run-config → server strategy, Flower ``Context`` → client.

The strategies of :mod:`strategies` take plain constructor arguments and never read a run-config;
this module is the one place that translates run-config keys into those arguments (and loads the
data, models and public sets a strategy needs). The registry (:mod:`fedapp.registry`) names these
functions.

Server builders have signature ``(cfg, StrategyContext) -> Strategy``; client builders
``(context, overrides) -> flwr Client``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.client import Client
from flwr.common import Context

from fedapp.clients.client_dp import ClientLevelDPClient, local_steps
from fedapp.clients.common import make_model, round_lr, setup_client
from fedapp.clients.dp2_fedsam import DP2FedSAMClient, shared_weights
from fedapp.clients.dpsgd import DPSGDClient, min_epsilon_profile
from fedapp.clients.soteriafl import SoteriaFLClient, soteriafl_params
from fedapp.clients.training import LocalTraining, get_weights, local_train, resolve_device, set_weights
from fedapp.config import ConfigError, RunConfig, resolve_config
from fedapp.data.client_data import client_train_sizes, public_dataset, training_pool
from fedapp.privacy.profiles import client_level_mechanism, secure_sum_mechanism
from strategies.aggregate import flatten
from strategies.base import StrategyContext
from strategies.dp2_fedsam import DP2FedSAMStrategy, get_variant
from strategies.fed_smp import ClientLevelStrategy, PublicUpdateFn, mask_seed
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.robust_hdp import PFA, MinEpsilon, RobustHDP, WeiAvg
from strategies.soteriafl import SAGA_TABLE_LIMIT_BYTES, GradientOracle, SoteriaFLStrategy, get_method


# ----------------------------------------------------------------------------- shared arguments
def common_kwargs(cfg: Mapping[str, Any], ctx: StrategyContext) -> dict[str, Any]:
    """Constructor arguments of :class:`strategies.base.DPFLStrategy` from the run-config.

    Client sampling is secret unless ``seeded-noise`` makes the whole run reproducible (and voids
    amplification by sampling, which the run's config.json then says).
    """
    return {
        "initial_weights": ctx.initial_weights,
        "num_rounds": int(cfg["num-server-rounds"]),
        "seed": int(cfg["seed"]),
        "clients_per_round": int(cfg["clients-per-round"]),
        "min_available_clients": int(cfg["min-available-clients"]),
        "fraction_evaluate": float(cfg["fraction-evaluate"]),
        "server_lr": float(cfg["server-lr"]),
        "evaluate_fn": ctx.evaluate_fn,
        "recorder": ctx.recorder,
        "prevalidate": _with_dataset_sizes(cfg, ctx.prevalidate),
        "secret_sampling": not bool(cfg["seeded-noise"]),
        "accountant": str(cfg["accountant"]),
        "strike_limit": int(cfg["strike-limit"]),
        "robust_norm_factor": float(cfg["robust-norm-factor"]),
    }


def _with_dataset_sizes(cfg: Mapping[str, Any], outer: Callable[[int], None] | None) -> Callable[[int], None]:
    """The strategy's pre-round-1 check, extended to give its validator every client's dataset size."""
    holder: dict[str, Any] = {}

    def prevalidate(num_clients: int) -> None:
        if outer is not None:
            outer(num_clients)
        strategy = holder.get("strategy")
        if strategy is not None and cfg["dataset"]:
            sizes = client_train_sizes(cfg, num_clients)  # type: ignore[arg-type]
            strategy.validator.max_examples = dict(enumerate(sizes))

    prevalidate.holder = holder  # type: ignore[attr-defined]
    return prevalidate


def _bind(strategy: Any) -> Any:
    """Let the prevalidate hook of :func:`common_kwargs` reach the strategy it was built for."""
    holder = getattr(strategy.prevalidate, "holder", None)
    if holder is not None:
        holder["strategy"] = strategy
    return strategy


# ----------------------------------------------------------------------------- foundation, Robust-HDP
def build_fedavg(cfg: Mapping[str, Any], ctx: StrategyContext) -> FedAvg:
    return _bind(FedAvg(**common_kwargs(cfg, ctx)))


def build_dpsgd_fedavg(cfg: Mapping[str, Any], ctx: StrategyContext) -> DPSGDFedAvg:
    return _bind(DPSGDFedAvg(clip_norm=float(cfg["clip-norm"]), **common_kwargs(cfg, ctx)))


def rpca_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Solver options of :func:`strategies.rpca.rpca` from the run-config."""
    return {"tol": float(cfg["rpca-tol"]), "max_iter": int(cfg["rpca-max-iter"]), "svd": str(cfg["rpca-svd"]),
            "backend": str(cfg["rpca-backend"]), "device": str(cfg["rpca-device"]),
            "dtype": np.float32 if cfg["rpca-float32"] else np.float64}


def build_robust_hdp(cfg: Mapping[str, Any], ctx: StrategyContext) -> RobustHDP:
    lr, decay = float(cfg["lr"]), float(cfg["lr-decay"])  # the server's η_t (round_lr), never the client's word
    return _bind(RobustHDP(rpca_options=rpca_options(cfg), chunk_rows=int(cfg["rpca-chunk-rows"]),
                           num_chunks=int(cfg["rpca-chunks"]), freeze_weights=bool(cfg["robust-hdp-freeze-weights"]),
                           clip_norm=float(cfg["clip-norm"]), momentum=float(cfg["momentum"]),
                           lr_schedule=lambda rnd: lr * decay ** (rnd - 1), **common_kwargs(cfg, ctx)))


def build_weiavg(cfg: Mapping[str, Any], ctx: StrategyContext) -> WeiAvg:
    return _bind(WeiAvg(clip_norm=float(cfg["clip-norm"]), **common_kwargs(cfg, ctx)))


def build_pfa(cfg: Mapping[str, Any], ctx: StrategyContext) -> PFA:
    return _bind(PFA(components=int(cfg["pfa-components"]), clip_norm=float(cfg["clip-norm"]),
                     **common_kwargs(cfg, ctx)))


def build_min_eps(cfg: Mapping[str, Any], ctx: StrategyContext) -> MinEpsilon:
    return _bind(MinEpsilon(clip_norm=float(cfg["clip-norm"]), **common_kwargs(cfg, ctx)))


# ----------------------------------------------------------------------------- Fed-SMP family
def public_update_fn(cfg: Mapping[str, Any]) -> PublicUpdateFn:
    """Server-side τ_p momentum-SGD steps on D_p from θ_t (the clients' optimizer, Fed-SMP Sec. 6.2); returns Δ_p."""
    if int(cfg["public-samples"]) <= 0:
        raise ConfigError(f"strategy {cfg['strategy']!r} needs run-config 'public-samples' > 0 (the server's "
                          f"public set D_p), got {cfg['public-samples']}")
    public = public_dataset(cfg)  # type: ignore[arg-type]
    batch = int(cfg["batch-size"]) or 10
    if batch > len(public):
        raise ConfigError(f"run-config 'public-samples' = {len(public)} is smaller than the batch size {batch}")
    steps = int(cfg["public-steps"]) or local_steps(cfg, len(public), batch)  # type: ignore[arg-type]
    model = make_model(cfg, public)  # type: ignore[arg-type]
    device = resolve_device(cfg["device"])

    def update(weights: list[np.ndarray], server_round: int) -> np.ndarray:
        set_weights(model, weights)
        local_train(model, public, LocalTraining(batch_size=batch, steps=steps, lr=round_lr(cfg, server_round),  # type: ignore[arg-type]
                                                 momentum=float(cfg["momentum"]),
                                                 seed=mask_seed(int(cfg["seed"]), server_round, 502)), device)
        return flatten(get_weights(model)) - flatten(weights)

    return update


def _client_level_kwargs(cfg: Mapping[str, Any], ctx: StrategyContext, private: bool) -> dict[str, Any]:
    kwargs = common_kwargs(cfg, ctx)
    kwargs["clip"] = float(cfg["clip-norm"])
    if private:
        kwargs["mechanism_factory"] = lambda n: client_level_mechanism(cfg, int(cfg["num-clients"]) or n)
        kwargs["secure_sum_factory"] = lambda dp, dim: secure_sum_mechanism(cfg, dp, dim)
    return kwargs


def _fed_smp(cfg: Mapping[str, Any], ctx: StrategyContext, *, name: str, sparsifier: str,
             private: bool) -> ClientLevelStrategy:
    strategy = ClientLevelStrategy(
        sparsifier=sparsifier, compression_ratio=float(cfg["compression-ratio"]) if sparsifier != "none" else 1.0,
        public_update_fn=public_update_fn(cfg) if sparsifier == "topk" else None,
        **_client_level_kwargs(cfg, ctx, private))
    strategy.name = name
    return _bind(strategy)


def build_dp_fedavg(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="dp-fedavg", sparsifier="none", private=True)


def build_fed_smp_randk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fed-smp-randk", sparsifier="randk", private=True)


def build_fed_smp_topk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fed-smp-topk", sparsifier="topk", private=True)


def build_fedavg_randk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fedavg-randk", sparsifier="randk", private=False)


def build_fedavg_topk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fedavg-topk", sparsifier="topk", private=False)


# ----------------------------------------------------------------------------- SoteriaFL family
def build_soteriafl(cfg: Mapping[str, Any], ctx: StrategyContext) -> SoteriaFLStrategy:
    """Every method of the family; the method is the run-config ``strategy``."""
    method = get_method(str(cfg["strategy"]))
    d = int(sum(np.asarray(w).size for w in ctx.initial_weights))
    k, _, gamma = soteriafl_params(cfg, d)
    oracle = None
    if cfg.get("soteriafl-utility", True):
        pool = training_pool(cfg)  # type: ignore[arg-type]
        oracle = GradientOracle(make_model(cfg, pool), pool.x, pool.y,  # type: ignore[arg-type]
                                device=resolve_device(cfg["device"]))
    outer = ctx.prevalidate

    def prevalidate(num_clients: int) -> None:
        if outer is not None:
            outer(num_clients)
        b = int(cfg.get("soteriafl-batch-size", 0))
        for cid, m in enumerate(client_train_sizes(cfg, num_clients)):  # type: ignore[arg-type]
            if b > m:
                raise ConfigError(f"client {cid}: run-config 'soteriafl-batch-size' = {b} > its dataset size m = {m}")
            if method.estimator == "saga" and 4 * m * d > SAGA_TABLE_LIMIT_BYTES:
                raise ConfigError(f"client {cid}: SAGA table m·d = {m}·{d} floats exceeds "
                                  f"{SAGA_TABLE_LIMIT_BYTES // 2**20} MiB; use soteriafl-svrg or fewer samples")

    kwargs = common_kwargs(cfg, dataclasses.replace(ctx, prevalidate=prevalidate))
    return _bind(SoteriaFLStrategy(method=method, eta=float(cfg["soteriafl-eta"]), k=k, gamma=gamma,
                                   clip=float(cfg["clip-norm"]), metrics_oracle=oracle, **kwargs))


# ----------------------------------------------------------------------------- DP2-FedSAM family
def build_dp2_variant(name: str, cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    variant = get_variant(name)
    kwargs = _client_level_kwargs(cfg, ctx, private=True)
    kwargs["initial_weights"] = shared_weights(cfg, ctx.initial_weights, variant.personalized)  # type: ignore[arg-type]
    if variant.personalized:
        kwargs["evaluate_fn"] = None  # no global head: accuracy is the personalized client_accuracy
    return _bind(DP2FedSAMStrategy(name=name, eval_every=int(cfg["dp2-eval-every"]), **kwargs))


def build_dp2_fedsam(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp2-fedsam", cfg, ctx)


def build_centaur(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("centaur", cfg, ctx)


def build_dp_fedsam(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp-fedsam", cfg, ctx)


def build_dp_fedsam_ft(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp-fedsam-ft", cfg, ctx)


def build_dp_fedavg_ft(cfg: Mapping[str, Any], ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp-fedavg-ft", cfg, ctx)


# ----------------------------------------------------------------------------- clients
def make_dpsgd_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Record-level DP-SGD client (Robust-HDP family, DPFedAvg)."""
    return DPSGDClient(setup_client(context, overrides), context, private=True).to_client()


def make_plain_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Non-private plain-SGD client (FedAvg)."""
    return DPSGDClient(setup_client(context, overrides), context, private=False).to_client()


def make_min_eps_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Record-level DP-SGD client that trains with the federation's minimum ε (``min-eps``)."""
    return DPSGDClient(min_epsilon_profile(setup_client(context, overrides)), context, private=True).to_client()


def make_client_dp_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """DP-FedAvg / Fed-SMP client (client-level DP)."""
    return ClientLevelDPClient(setup_client(context, overrides), context, private=True).to_client()


def make_compressed_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """FedAvg-randk / FedAvg-topk client (sparsified + clipped, no noise)."""
    return ClientLevelDPClient(setup_client(context, overrides), context, private=False).to_client()


def make_soteriafl_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every SoteriaFL-family method."""
    return SoteriaFLClient(setup_client(context, overrides), context).to_client()


def make_dp2_fedsam_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every DP2-FedSAM-family strategy; the variant comes from run-config ``strategy``."""
    cfg: RunConfig = resolve_config(context.run_config, overrides)
    return DP2FedSAMClient(setup_client(context, overrides), context, get_variant(cfg["strategy"])).to_client()
