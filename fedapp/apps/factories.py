"""Every builder of the app: run-config sections → server strategy, Flower ``Context`` → client.

The strategies of :mod:`strategies` take plain constructor arguments and never read a run-config;
this module is the one place that translates run-config sections into those arguments (and loads the
data, models and public sets a strategy needs). The families (:mod:`fedapp.apps.families`) name these
functions.

A server builder has signature ``(ctx: StrategyContext, engine: EngineSettings, *, <sections>) -> Strategy``: it
declares the run-config sections it reads as keyword parameters named after them (``general``, ``data``,
``training``, ``client_dp``, ``robust_hdp``, ``soteriafl``, ``dp2_fedsam``, ``deployment``, and ``model_spec``), and
:func:`build_strategy`, the composition root, passes exactly those. Client builders have signature
``(context, overrides) -> flwr Client``.

The clients and the torch-based strategies are imported inside the builders that use them: the families
(:mod:`fedapp.apps.families`) name these functions, and the launcher reads the families to check a run-config
without loading torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.client import Client
from flwr.common import Context

from fedapp.clients.guard import RefusingClient
from fedapp.compat.runtime import on_supernode
from fedapp.config import (
    ClientDPConfig,
    ConfigError,
    DataConfig,
    DeploymentConfig,
    DP2FedSAMConfig,
    GeneralConfig,
    RobustHDPConfig,
    SoteriaFLConfig,
    TrainingConfig,
    resolve_config,
)
from fedapp.config.run_config import record_canaries
from fedapp.data.client_data import client_train_sizes, public_dataset, training_pool
from fedapp.data.node_data import NodeDataError, is_node_local
from fedapp.models.catalog import ModelSpec
from fedapp.privacy.audit import canary_index, canary_update
from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism, ftrl_mechanism, secure_sum_mechanism
from fedapp.registry import Feature, get_spec
from strategies.aggregate import flatten
from strategies.base import StrategyContext
from strategies.dp_ftrl import DPFTRLStrategy
from strategies.fed_smp import FedSMPStrategy, PublicUpdateFn, mask_seed
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.robust_hdp import PFA, MinEpsilon, RobustHDP, WeiAvg

if TYPE_CHECKING:  # torch: the clients and two families' strategies load when a builder runs, never on import
    from fedapp.clients.client_dp import ClientLevelDPClient
    from fedapp.clients.dp2_fedsam import DP2FedSAMClient
    from strategies.dp2_fedsam import DP2FedSAMStrategy
    from strategies.soteriafl import SoteriaFLStrategy


# ----------------------------------------------------------------------------- the composition root
def build_strategy(run_config: Mapping[str, Any], ctx: StrategyContext) -> Any:
    """The run's server strategy: resolve ``run_config`` (a Flower run-config mapping or a resolved
    :class:`~fedapp.config.RunConfig`), then call the registered builder with the engine settings and the sections
    its signature declares."""
    cfg = resolve_config(run_config)
    builder = get_spec(cfg.general.strategy).build
    engine = engine_settings(cfg.general, cfg.data, cfg.training, cfg.deployment)
    return builder(ctx, engine, **cfg.sections_for(builder))


@dataclass(frozen=True)
class EngineSettings:
    """The :class:`~strategies.engine.RoundEngine` arguments every strategy of a run shares, from its sections.

    Client sampling is secret unless ``seeded-noise`` makes the whole run reproducible (and voids
    amplification by sampling, which the run's config.json then says)."""

    num_rounds: int
    seed: int
    clients_per_round: int
    min_available_clients: int
    fraction_evaluate: float
    evaluate_every: int
    server_lr: float
    secret_sampling: bool
    secure_randomness: bool
    accountant: str
    strike_limit: int
    robust_norm_factor: float
    dataset_sizes: Callable[[int], Sequence[int]] | None  # None: node-local data, each N_i known to its node only

    def kwargs(self, ctx: StrategyContext) -> dict[str, Any]:
        """Constructor arguments of :class:`strategies.base.DPFLStrategy`: these settings plus ``ctx``'s."""
        from fedapp.clients.common import csprng

        return {"initial_weights": ctx.initial_weights, "evaluate_fn": ctx.evaluate_fn, "recorder": ctx.recorder,
                "prevalidate": ctx.prevalidate, "num_rounds": self.num_rounds, "seed": self.seed,
                "clients_per_round": self.clients_per_round, "min_available_clients": self.min_available_clients,
                "fraction_evaluate": self.fraction_evaluate, "evaluate_every": self.evaluate_every,
                "server_lr": self.server_lr, "dataset_sizes": self.dataset_sizes, "secret_sampling": self.secret_sampling,
                "accountant": self.accountant, "strike_limit": self.strike_limit,
                "sampling_rng": csprng() if self.secure_randomness else None,
                "robust_norm_factor": self.robust_norm_factor}


def engine_settings(general: GeneralConfig, data: DataConfig, training: TrainingConfig,
                    deployment: DeploymentConfig) -> EngineSettings:
    return EngineSettings(
        num_rounds=general.num_server_rounds, seed=general.seed, clients_per_round=general.clients_per_round,
        min_available_clients=general.min_available_clients, fraction_evaluate=general.fraction_evaluate,
        evaluate_every=general.evaluate_every, server_lr=general.server_lr, secret_sampling=not general.seeded_noise,
        secure_randomness=general.secure_randomness and not general.seeded_noise,
        accountant=training.accountant, strike_limit=deployment.strike_limit,
        robust_norm_factor=deployment.robust_norm_factor,
        dataset_sizes=None if is_node_local(data) else lambda n: client_train_sizes(data, general.seed, n,
                                                                                  record_canaries(general)))


# ----------------------------------------------------------------------------- foundation, Robust-HDP
def build_fedavg(ctx: StrategyContext, engine: EngineSettings) -> FedAvg:
    return FedAvg(**engine.kwargs(ctx))


def build_dpsgd_fedavg(ctx: StrategyContext, engine: EngineSettings, *, training: TrainingConfig) -> DPSGDFedAvg:
    lr, decay = training.lr, training.lr_decay  # the server's η_t: the update-norm bound never takes the client's word
    return DPSGDFedAvg(clip_norm=training.clip_norm, momentum=training.momentum,
                       lr_schedule=lambda rnd: lr * decay ** (rnd - 1), **engine.kwargs(ctx))


def rpca_options(robust_hdp: RobustHDPConfig) -> dict[str, Any]:
    """Solver options of :func:`strategies.rpca.rpca` from the Robust-HDP section."""
    return {"tol": robust_hdp.rpca_tol, "max_iter": robust_hdp.rpca_max_iter, "svd": robust_hdp.rpca_svd,
            "backend": robust_hdp.rpca_backend, "device": robust_hdp.rpca_device,
            "dtype": np.float32 if robust_hdp.rpca_float32 else np.float64}


def build_robust_hdp(ctx: StrategyContext, engine: EngineSettings, *, training: TrainingConfig,
                     robust_hdp: RobustHDPConfig) -> RobustHDP:
    lr, decay = training.lr, training.lr_decay  # the server's η_t (round_lr), never the client's word
    return RobustHDP(rpca_options=rpca_options(robust_hdp), chunk_rows=robust_hdp.rpca_chunk_rows,
                     num_chunks=robust_hdp.rpca_chunks, freeze_weights=robust_hdp.robust_hdp_freeze_weights,
                     clip_norm=training.clip_norm, momentum=training.momentum,
                     lr_schedule=lambda rnd: lr * decay ** (rnd - 1), **engine.kwargs(ctx))


def build_weiavg(ctx: StrategyContext, engine: EngineSettings, *, training: TrainingConfig) -> WeiAvg:
    return WeiAvg(clip_norm=training.clip_norm, **engine.kwargs(ctx))


def build_pfa(ctx: StrategyContext, engine: EngineSettings, *, training: TrainingConfig,
              robust_hdp: RobustHDPConfig) -> PFA:
    return PFA(components=robust_hdp.pfa_components, clip_norm=training.clip_norm, **engine.kwargs(ctx))


def build_min_eps(ctx: StrategyContext, engine: EngineSettings, *, training: TrainingConfig) -> MinEpsilon:
    return MinEpsilon(clip_norm=training.clip_norm, **engine.kwargs(ctx))


# ----------------------------------------------------------------------------- Fed-SMP family
def public_update_fn(general: GeneralConfig, data: DataConfig, training: TrainingConfig, client_dp: ClientDPConfig,
                     model_spec: ModelSpec) -> PublicUpdateFn:
    """Server-side τ_p momentum-SGD steps on D_p from θ_t (the clients' optimizer, Fed-SMP Sec. 6.2); returns Δ_p."""
    from fedapp.clients.client_dp import local_steps
    from fedapp.clients.common import make_model, round_lr
    from fedapp.clients.training import LocalTraining, get_weights, local_train, resolve_device, set_weights

    if data.public_samples <= 0:
        raise ConfigError(f"strategy {general.strategy!r} needs run-config 'public-samples' > 0 (the server's "
                          f"public set D_p), got {data.public_samples}")
    public = public_dataset(data, general.seed)
    batch = training.batch_size or 10
    if batch > len(public):
        raise ConfigError(f"run-config 'public-samples' = {len(public)} is smaller than the batch size {batch}")
    steps = client_dp.public_steps or local_steps(client_dp, training, len(public), batch)
    model = make_model(model_spec, public)
    device = resolve_device(general.device)

    def update(weights: list[np.ndarray], server_round: int) -> np.ndarray:
        set_weights(model, weights)
        local_train(model, public, LocalTraining(batch_size=batch, steps=steps,
                                                 lr=round_lr(training.lr, training.lr_decay, server_round),
                                                 momentum=training.momentum,
                                                 seed=mask_seed(general.seed, server_round, 502)), device)
        return flatten(get_weights(model)) - flatten(weights)

    return update


def _client_level_kwargs(ctx: StrategyContext, engine: EngineSettings, general: GeneralConfig,
                         training: TrainingConfig, client_dp: ClientDPConfig, private: bool,
                         name: str) -> dict[str, Any]:
    kwargs = engine.kwargs(ctx)
    kwargs["clip"] = training.clip_norm
    if private:
        kwargs["mechanism_factory"] = lambda n: client_level_mechanism(general, training, client_dp,
                                                                       general.num_clients or n)
        kwargs["secure_sum_factory"] = lambda dp, dim: secure_sum_mechanism(client_dp, dp, dim)
        kwargs["secure_aggregation"] = ctx.secure_aggregation
        if get_spec(name).supports(Feature.ADAPTIVE_CLIP) and client_dp.adaptive_clip_quantile > 0:
            # given only when adaptive clipping is on: under SecAgg+ it adds the count coordinate to the payload
            kwargs["adaptive_clip_factory"] = lambda dp: adaptive_clip_config(client_dp, dp)
    return kwargs


def _fed_smp(ctx: StrategyContext, engine: EngineSettings, *, general: GeneralConfig, data: DataConfig,
             training: TrainingConfig, client_dp: ClientDPConfig, model_spec: ModelSpec, name: str, sparsifier: str,
             private: bool) -> FedSMPStrategy:
    kwargs = _client_level_kwargs(ctx, engine, general, training, client_dp, private, name)
    return FedSMPStrategy(
        sparsifier=sparsifier, compression_ratio=client_dp.compression_ratio if sparsifier != "none" else 1.0,
        public_update_fn=public_update_fn(general, data, training, client_dp, model_spec) if sparsifier == "topk"
        else None, name=name, **kwargs)


build_dp_fedavg = functools.partial(_fed_smp, name="dp-fedavg", sparsifier="none", private=True)
build_fed_smp_randk = functools.partial(_fed_smp, name="fed-smp-randk", sparsifier="randk", private=True)
build_fed_smp_topk = functools.partial(_fed_smp, name="fed-smp-topk", sparsifier="topk", private=True)
build_fedavg_randk = functools.partial(_fed_smp, name="fedavg-randk", sparsifier="randk", private=False)
build_fedavg_topk = functools.partial(_fed_smp, name="fedavg-topk", sparsifier="topk", private=False)


def build_dp_ftrl(ctx: StrategyContext, engine: EngineSettings, *, general: GeneralConfig, training: TrainingConfig,
                  client_dp: ClientDPConfig) -> DPFTRLStrategy:
    """DP-FTRL on DP-FedAvg's dense rounds (:mod:`strategies.dp_ftrl`); the server's noise stream is secret unless
    ``seeded-noise``."""
    return DPFTRLStrategy(ftrl_factory=lambda n: ftrl_mechanism(general, training, client_dp, general.num_clients or n),
                          noise_seed=general.seed if general.seeded_noise else None,
                          clip=training.clip_norm, secure_aggregation=ctx.secure_aggregation, **engine.kwargs(ctx))


# ----------------------------------------------------------------------------- SoteriaFL family
def build_soteriafl(ctx: StrategyContext, engine: EngineSettings, *, general: GeneralConfig, data: DataConfig,
                    training: TrainingConfig, soteriafl: SoteriaFLConfig, model_spec: ModelSpec) -> SoteriaFLStrategy:
    """Every method of the family; the method is the run-config ``strategy``."""
    from fedapp.clients.common import make_model
    from fedapp.clients.soteriafl import soteriafl_params
    from fedapp.clients.training import resolve_device
    from strategies.soteriafl import SAGA_TABLE_LIMIT_BYTES, GradientOracle, SoteriaFLStrategy, get_method

    method = get_method(general.strategy)
    d = int(sum(np.asarray(w).size for w in ctx.initial_weights))
    k, _, gamma = soteriafl_params(soteriafl, d)
    oracle = None
    if soteriafl.soteriafl_utility and not is_node_local(data):  # node-local: no central data to measure it on
        pool = training_pool(data, general.seed)
        oracle = GradientOracle(make_model(model_spec, pool), pool.x, pool.y, device=resolve_device(general.device))
    outer = ctx.prevalidate

    def prevalidate(num_clients: int) -> None:
        if outer is not None:
            outer(num_clients)
        b = soteriafl.soteriafl_batch_size
        if is_node_local(data):
            return  # each node checks its own m (fedapp.clients.soteriafl)
        for cid, m in enumerate(client_train_sizes(data, general.seed, num_clients, record_canaries(general))):
            if b > m:
                raise ConfigError(f"client {cid}: run-config 'soteriafl-batch-size' = {b} > its dataset size m = {m}")
            if method.estimator == "saga" and 4 * m * d > SAGA_TABLE_LIMIT_BYTES:
                raise ConfigError(f"client {cid}: SAGA table m·d = {m}·{d} floats exceeds "
                                  f"{SAGA_TABLE_LIMIT_BYTES // 2**20} MiB; use soteriafl-svrg or fewer samples")

    kwargs = engine.kwargs(ctx)
    kwargs["prevalidate"] = prevalidate
    return SoteriaFLStrategy(method=method, eta=soteriafl.soteriafl_eta, k=k, gamma=gamma, clip=training.clip_norm,
                             metrics_oracle=oracle, **kwargs)


# ----------------------------------------------------------------------------- DP2-FedSAM family
def build_dp2_variant(ctx: StrategyContext, engine: EngineSettings, *, general: GeneralConfig, data: DataConfig,
                      training: TrainingConfig, client_dp: ClientDPConfig, dp2_fedsam: DP2FedSAMConfig,
                      model_spec: ModelSpec, name: str) -> DP2FedSAMStrategy:
    from fedapp.clients.dp2_fedsam import shared_weights
    from strategies.dp2_fedsam import DP2FedSAMStrategy, get_variant

    variant = get_variant(name)
    kwargs = _client_level_kwargs(ctx, engine, general, training, client_dp, private=True, name=name)
    kwargs["initial_weights"] = shared_weights(dp2_fedsam.dp2_head, data, model_spec, ctx.initial_weights,
                                               variant.personalized)
    if variant.personalized:
        kwargs["evaluate_fn"] = None  # no global head: accuracy is the personalized client_accuracy
    return DP2FedSAMStrategy(name=name, eval_every=dp2_fedsam.dp2_eval_every, **kwargs)


build_dp2_fedsam = functools.partial(build_dp2_variant, name="dp2-fedsam")
build_centaur = functools.partial(build_dp2_variant, name="centaur")
build_dp_fedsam = functools.partial(build_dp2_variant, name="dp-fedsam")
build_dp_fedsam_ft = functools.partial(build_dp2_variant, name="dp-fedsam-ft")
build_dp_fedavg_ft = functools.partial(build_dp2_variant, name="dp-fedavg-ft")


# ----------------------------------------------------------------------------- clients
# Client builders are composition roots: each resolves the run-config (memoized per process) and hands its client
# the setup every client shares plus its family's section.
def make_dpsgd_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Record-level DP-SGD client (Robust-HDP family, DPFedAvg)."""
    from fedapp.clients.common import setup_client
    from fedapp.clients.dpsgd import DPSGDClient

    return DPSGDClient(setup_client(context, overrides), context, private=True).to_client()


def make_plain_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Non-private plain-SGD client (FedAvg)."""
    from fedapp.clients.common import setup_client
    from fedapp.clients.dpsgd import DPSGDClient

    return DPSGDClient(setup_client(context, overrides), context, private=False).to_client()


def make_min_eps_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Record-level DP-SGD client that trains with the federation's minimum ε (``min-eps``)."""
    from fedapp.clients.common import setup_client
    from fedapp.clients.dpsgd import DPSGDClient, min_epsilon_profile

    return DPSGDClient(min_epsilon_profile(setup_client(context, overrides)), context, private=True).to_client()


def make_client_dp_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """DP-FedAvg / Fed-SMP client (client-level DP)."""
    from fedapp.clients.client_dp import ClientLevelDPClient
    from fedapp.clients.common import setup_client

    cfg = resolve_config(context.run_config, overrides)
    client = ClientLevelDPClient(setup_client(context, overrides), cfg.client_dp, context, private=True)
    return with_canary(client, cfg.general)


def make_ftrl_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """DP-FTRL client: clips; under SecAgg+ adds its share of the correlated noise from its own stream."""
    from fedapp.clients.client_dp import FTRLClient
    from fedapp.clients.common import setup_client

    cfg = resolve_config(context.run_config, overrides)
    client = FTRLClient(setup_client(context, overrides), cfg.client_dp, context, private=True)
    return with_canary(client, cfg.general)


def with_canary(client: ClientLevelDPClient | DP2FedSAMClient, general: GeneralConfig) -> Client:
    """``client`` as a Flower client; one of the last ``audit-canaries`` clients becomes an audit canary
    (:mod:`fedapp.privacy.audit`) whose direction (or zero, by its coin) spans what the client sends (DP2-FedSAM: the
    shared part). On a SuperNode a canary id refuses: canaries are simulated clients."""
    p = client.s.profile
    index = canary_index(p.client_id, p.num_clients, general.audit_canaries)
    if index is not None:
        if on_supernode():
            return RefusingClient(p.client_id, f"run-config 'audit-canaries' = {general.audit_canaries} makes client "
                                               f"{p.client_id} an audit canary; canaries are simulated clients, and "
                                               "this is a SuperNode with its own data")
        dim = int(sum(np.asarray(w).size for w in client.get_parameters({})))
        client.canary = canary_update(general.audit_seed, general.audit_canaries, index, dim)
    return client.to_client()


def make_compressed_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """FedAvg-randk / FedAvg-topk client (sparsified + clipped, no noise)."""
    from fedapp.clients.client_dp import ClientLevelDPClient
    from fedapp.clients.common import setup_client

    cfg = resolve_config(context.run_config, overrides)
    return ClientLevelDPClient(setup_client(context, overrides), cfg.client_dp, context, private=False).to_client()


def make_soteriafl_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every SoteriaFL-family method."""
    from fedapp.clients.common import setup_client
    from fedapp.clients.soteriafl import SoteriaFLClient

    cfg = resolve_config(context.run_config, overrides)
    setup = setup_client(context, overrides)
    b = cfg.soteriafl.soteriafl_batch_size
    if is_node_local(cfg.data) and b > len(setup.train):  # the server could not check this node's m
        raise NodeDataError(f"run-config 'soteriafl-batch-size' = {b} exceeds this node's m = {len(setup.train)} "
                            "training examples (node-config 'data-path' after its local splits)")
    return SoteriaFLClient(setup, cfg.soteriafl, context).to_client()


def make_dp2_fedsam_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """Client of every DP2-FedSAM-family strategy; the variant comes from run-config ``strategy``."""
    from fedapp.clients.common import setup_client
    from fedapp.clients.dp2_fedsam import DP2FedSAMClient
    from strategies.dp2_fedsam import get_variant

    cfg = resolve_config(context.run_config, overrides)
    client = DP2FedSAMClient(setup_client(context, overrides), cfg.client_dp, cfg.dp2_fedsam, context,
                             get_variant(cfg.general.strategy))
    return with_canary(client, cfg.general)
