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
from typing import Any

import numpy as np
from flwr.client import Client
from flwr.common import Context

from fedapp.clients.client_dp import ClientLevelDPClient, FTRLClient, local_steps
from fedapp.clients.common import make_model, round_lr, setup_client
from fedapp.clients.dp2_fedsam import DP2FedSAMClient, shared_weights
from fedapp.clients.dpsgd import DPSGDClient, min_epsilon_profile
from fedapp.clients.soteriafl import SoteriaFLClient, soteriafl_params
from fedapp.clients.training import LocalTraining, get_weights, local_train, resolve_device, set_weights
from fedapp.config import ADAPTIVE_CLIP_STRATEGIES, ConfigError, RunConfig, resolve_config
from fedapp.data.client_data import client_train_sizes, public_dataset, training_pool
from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism, ftrl_mechanism, secure_sum_mechanism
from strategies.aggregate import flatten
from strategies.base import StrategyContext
from strategies.dp2_fedsam import DP2FedSAMStrategy, get_variant
from strategies.dp_ftrl import DPFTRLStrategy
from strategies.fed_smp import ClientLevelStrategy, PublicUpdateFn, mask_seed
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.robust_hdp import PFA, MinEpsilon, RobustHDP, WeiAvg
from strategies.soteriafl import SAGA_TABLE_LIMIT_BYTES, GradientOracle, SoteriaFLStrategy, get_method


# ----------------------------------------------------------------------------- shared arguments
def common_kwargs(cfg: RunConfig, ctx: StrategyContext) -> dict[str, Any]:
    """Constructor arguments of :class:`strategies.base.DPFLStrategy` from the run-config.

    Client sampling is secret unless ``seeded-noise`` makes the whole run reproducible (and voids
    amplification by sampling, which the run's config.json then says).
    """
    return {
        "initial_weights": ctx.initial_weights,
        "num_rounds": cfg.general.num_server_rounds,
        "seed": cfg.general.seed,
        "clients_per_round": cfg.general.clients_per_round,
        "min_available_clients": cfg.general.min_available_clients,
        "fraction_evaluate": cfg.general.fraction_evaluate,
        "server_lr": cfg.general.server_lr,
        "evaluate_fn": ctx.evaluate_fn,
        "recorder": ctx.recorder,
        "prevalidate": ctx.prevalidate,
        "dataset_sizes": lambda n: client_train_sizes(cfg.data, cfg.general.seed, n),
        "secret_sampling": not cfg.general.seeded_noise,
        "accountant": cfg.training.accountant,
        "strike_limit": cfg.deployment.strike_limit,
        "robust_norm_factor": cfg.deployment.robust_norm_factor,
    }


# ----------------------------------------------------------------------------- foundation, Robust-HDP
def build_fedavg(cfg: RunConfig, ctx: StrategyContext) -> FedAvg:
    return FedAvg(**common_kwargs(cfg, ctx))


def build_dpsgd_fedavg(cfg: RunConfig, ctx: StrategyContext) -> DPSGDFedAvg:
    return DPSGDFedAvg(clip_norm=cfg.training.clip_norm, **common_kwargs(cfg, ctx))


def rpca_options(cfg: RunConfig) -> dict[str, Any]:
    """Solver options of :func:`strategies.rpca.rpca` from the run-config."""
    return {"tol": cfg.robust_hdp.rpca_tol, "max_iter": cfg.robust_hdp.rpca_max_iter, "svd": cfg.robust_hdp.rpca_svd,
            "backend": cfg.robust_hdp.rpca_backend, "device": cfg.robust_hdp.rpca_device,
            "dtype": np.float32 if cfg.robust_hdp.rpca_float32 else np.float64}


def build_robust_hdp(cfg: RunConfig, ctx: StrategyContext) -> RobustHDP:
    lr, decay = cfg.training.lr, cfg.training.lr_decay  # the server's η_t (round_lr), never the client's word
    return RobustHDP(rpca_options=rpca_options(cfg), chunk_rows=cfg.robust_hdp.rpca_chunk_rows,
                           num_chunks=cfg.robust_hdp.rpca_chunks, freeze_weights=cfg.robust_hdp.robust_hdp_freeze_weights,
                           clip_norm=cfg.training.clip_norm, momentum=cfg.training.momentum,
                           lr_schedule=lambda rnd: lr * decay ** (rnd - 1), **common_kwargs(cfg, ctx))


def build_weiavg(cfg: RunConfig, ctx: StrategyContext) -> WeiAvg:
    return WeiAvg(clip_norm=cfg.training.clip_norm, **common_kwargs(cfg, ctx))


def build_pfa(cfg: RunConfig, ctx: StrategyContext) -> PFA:
    return PFA(components=cfg.robust_hdp.pfa_components, clip_norm=cfg.training.clip_norm,
                     **common_kwargs(cfg, ctx))


def build_min_eps(cfg: RunConfig, ctx: StrategyContext) -> MinEpsilon:
    return MinEpsilon(clip_norm=cfg.training.clip_norm, **common_kwargs(cfg, ctx))


# ----------------------------------------------------------------------------- Fed-SMP family
def public_update_fn(cfg: RunConfig) -> PublicUpdateFn:
    """Server-side τ_p momentum-SGD steps on D_p from θ_t (the clients' optimizer, Fed-SMP Sec. 6.2); returns Δ_p."""
    if cfg.data.public_samples <= 0:
        raise ConfigError(f"strategy {cfg.general.strategy!r} needs run-config 'public-samples' > 0 (the server's "
                          f"public set D_p), got {cfg.data.public_samples}")
    public = public_dataset(cfg.data, cfg.general.seed)
    batch = cfg.training.batch_size or 10
    if batch > len(public):
        raise ConfigError(f"run-config 'public-samples' = {len(public)} is smaller than the batch size {batch}")
    steps = cfg.client_dp.public_steps or local_steps(cfg.client_dp, cfg.training, len(public), batch)
    model = make_model(cfg, public)
    device = resolve_device(cfg.general.device)

    def update(weights: list[np.ndarray], server_round: int) -> np.ndarray:
        set_weights(model, weights)
        local_train(model, public, LocalTraining(batch_size=batch, steps=steps, lr=round_lr(cfg.training.lr, cfg.training.lr_decay, server_round),
                                                 momentum=cfg.training.momentum,
                                                 seed=mask_seed(cfg.general.seed, server_round, 502)), device)
        return flatten(get_weights(model)) - flatten(weights)

    return update


def _client_level_kwargs(cfg: RunConfig, ctx: StrategyContext, private: bool) -> dict[str, Any]:
    kwargs = common_kwargs(cfg, ctx)
    kwargs["clip"] = cfg.training.clip_norm
    if private:
        kwargs["mechanism_factory"] = lambda n: client_level_mechanism(cfg, cfg.general.num_clients or n)
        kwargs["secure_sum_factory"] = lambda dp, dim: secure_sum_mechanism(cfg.client_dp, dp, dim)
        kwargs["secure_aggregation"] = ctx.secure_aggregation
    return kwargs


def _fed_smp(cfg: RunConfig, ctx: StrategyContext, *, name: str, sparsifier: str,
             private: bool) -> ClientLevelStrategy:
    kwargs = _client_level_kwargs(cfg, ctx, private)
    if private and name in ADAPTIVE_CLIP_STRATEGIES:
        kwargs["adaptive_clip_factory"] = lambda dp: adaptive_clip_config(cfg.client_dp, dp)
    strategy = ClientLevelStrategy(
        sparsifier=sparsifier, compression_ratio=cfg.client_dp.compression_ratio if sparsifier != "none" else 1.0,
        public_update_fn=public_update_fn(cfg) if sparsifier == "topk" else None,
        name=name, **kwargs)
    return strategy


def build_dp_fedavg(cfg: RunConfig, ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="dp-fedavg", sparsifier="none", private=True)


def build_fed_smp_randk(cfg: RunConfig, ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fed-smp-randk", sparsifier="randk", private=True)


def build_fed_smp_topk(cfg: RunConfig, ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fed-smp-topk", sparsifier="topk", private=True)


def build_fedavg_randk(cfg: RunConfig, ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fedavg-randk", sparsifier="randk", private=False)


def build_fedavg_topk(cfg: RunConfig, ctx: StrategyContext) -> ClientLevelStrategy:
    return _fed_smp(cfg, ctx, name="fedavg-topk", sparsifier="topk", private=False)


def build_dp_ftrl(cfg: RunConfig, ctx: StrategyContext) -> DPFTRLStrategy:
    """DP-FTRL on DP-FedAvg's dense rounds (:mod:`strategies.dp_ftrl`); the server's noise stream is secret unless
    ``seeded-noise``."""
    kwargs = common_kwargs(cfg, ctx)
    return DPFTRLStrategy(ftrl_factory=lambda n: ftrl_mechanism(cfg, cfg.general.num_clients or n),
                          noise_seed=cfg.general.seed if cfg.general.seeded_noise else None,
                          clip=cfg.training.clip_norm, secure_aggregation=ctx.secure_aggregation, **kwargs)


# ----------------------------------------------------------------------------- SoteriaFL family
def build_soteriafl(cfg: RunConfig, ctx: StrategyContext) -> SoteriaFLStrategy:
    """Every method of the family; the method is the run-config ``strategy``."""
    method = get_method(cfg.general.strategy)
    d = int(sum(np.asarray(w).size for w in ctx.initial_weights))
    k, _, gamma = soteriafl_params(cfg.soteriafl, d)
    oracle = None
    if cfg.soteriafl.soteriafl_utility:
        pool = training_pool(cfg.data, cfg.general.seed)
        oracle = GradientOracle(make_model(cfg, pool), pool.x, pool.y,
                                device=resolve_device(cfg.general.device))
    outer = ctx.prevalidate

    def prevalidate(num_clients: int) -> None:
        if outer is not None:
            outer(num_clients)
        b = cfg.soteriafl.soteriafl_batch_size
        for cid, m in enumerate(client_train_sizes(cfg.data, cfg.general.seed, num_clients)):
            if b > m:
                raise ConfigError(f"client {cid}: run-config 'soteriafl-batch-size' = {b} > its dataset size m = {m}")
            if method.estimator == "saga" and 4 * m * d > SAGA_TABLE_LIMIT_BYTES:
                raise ConfigError(f"client {cid}: SAGA table m·d = {m}·{d} floats exceeds "
                                  f"{SAGA_TABLE_LIMIT_BYTES // 2**20} MiB; use soteriafl-svrg or fewer samples")

    kwargs = common_kwargs(cfg, dataclasses.replace(ctx, prevalidate=prevalidate))
    return SoteriaFLStrategy(method=method, eta=cfg.soteriafl.soteriafl_eta, k=k, gamma=gamma,
                                   clip=cfg.training.clip_norm, metrics_oracle=oracle, **kwargs)


# ----------------------------------------------------------------------------- DP2-FedSAM family
def build_dp2_variant(name: str, cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
    variant = get_variant(name)
    kwargs = _client_level_kwargs(cfg, ctx, private=True)
    kwargs["initial_weights"] = shared_weights(cfg, ctx.initial_weights, variant.personalized)
    if variant.personalized:
        kwargs["evaluate_fn"] = None  # no global head: accuracy is the personalized client_accuracy
    return DP2FedSAMStrategy(name=name, eval_every=cfg.dp2_fedsam.dp2_eval_every, **kwargs)


def build_dp2_fedsam(cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp2-fedsam", cfg, ctx)


def build_centaur(cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("centaur", cfg, ctx)


def build_dp_fedsam(cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp-fedsam", cfg, ctx)


def build_dp_fedsam_ft(cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
    return build_dp2_variant("dp-fedsam-ft", cfg, ctx)


def build_dp_fedavg_ft(cfg: RunConfig, ctx: StrategyContext) -> DP2FedSAMStrategy:
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


def make_ftrl_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """DP-FTRL client: clips; under SecAgg+ adds its share of the correlated noise from its own stream."""
    return FTRLClient(setup_client(context, overrides), context, private=True).to_client()


def make_compressed_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """FedAvg-randk / FedAvg-topk client (sparsified + clipped, no noise)."""
    return ClientLevelDPClient(setup_client(context, overrides), context, private=False).to_client()


def make_soteriafl_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every SoteriaFL-family method."""
    return SoteriaFLClient(setup_client(context, overrides), context).to_client()


def make_dp2_fedsam_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every DP2-FedSAM-family strategy; the variant comes from run-config ``strategy``."""
    cfg: RunConfig = resolve_config(context.run_config, overrides)
    return DP2FedSAMClient(setup_client(context, overrides), context, get_variant(cfg.general.strategy)).to_client()
