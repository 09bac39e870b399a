"""The four privacy mechanisms a family can name (:class:`fedapp.registry.Mechanism`): none, record-level local DP
(DP-SGD or SoteriaFL's noisy estimators), client-level Gaussian noise on the sum of clipped updates, and DP-FTRL's
correlated noise. Each states its pre-run check, its plan (:func:`fedapp.apps.privacy_plan.privacy_plan`), what
``config.json`` says about it and the ε a node is planned (:mod:`fedapp.privacy.node_policy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedapp.config import ClientDPConfig, ConfigError, DataConfig, GeneralConfig, TrainingConfig, resolve_config
from fedapp.config.run_config import RunConfig, record_canaries
from strategies.privacy.threat_models import ROUNDED_SUM_CAVEAT

if TYPE_CHECKING:
    import numpy as np

    from fedapp.privacy.profiles import ClientProfile


@dataclass(frozen=True)
class NoPrivacy:
    """A non-private baseline: nothing to check, plan or claim."""

    def check(self, cfg: RunConfig, num_clients: int, profiles: list[ClientProfile], sizes: list[int] | None) -> None:
        return None

    def plan(self, cfg: RunConfig, num_clients: int, payload_dim: int | None) -> dict[str, Any]:
        return {"mechanism": {"name": "none (non-private baseline)"}}

    def meta(self, cfg: RunConfig) -> dict[str, Any]:
        return {}

    def planned_epsilon(self, cfg: RunConfig, num_clients: int, node_config: Mapping[str, Any]) -> float | None:
        return None


@dataclass(frozen=True)
class RecordLevel:
    """Record-level local DP: each client calibrates its own noise to its (ε_i, δ_i). ``dpsgd``: Opacus DP-SGD with
    Poisson batches (the plan gives q_i and the step count), else SoteriaFL's noisy estimators."""

    dpsgd: bool = True

    def check(self, cfg: RunConfig, num_clients: int, profiles: list[ClientProfile], sizes: list[int] | None) -> None:
        from fedapp.privacy.profiles import check_record_delta

        if sizes is not None:  # node-local data: every node checks its δ_i against its own N_i
            check_record_delta(cfg.general, cfg.training, profiles, sizes)

    def plan(self, cfg: RunConfig, num_clients: int, payload_dim: int | None) -> dict[str, Any]:
        return _record_level(cfg.general, cfg.training, cfg.data, num_clients, dpsgd=self.dpsgd)

    def meta(self, cfg: RunConfig) -> dict[str, Any]:
        return {}

    def planned_epsilon(self, cfg: RunConfig, num_clients: int, node_config: Mapping[str, Any]) -> float | None:
        from fedapp.privacy.profiles import client_profile

        return float(client_profile(cfg.general, cfg.training, cfg.data, node_config).epsilon)


@dataclass(frozen=True)
class ClientLevel:
    """Client-level DP: each sampled client clips its update and adds its share of independent Gaussian (or, under
    SecAgg+, distributed discrete Gaussian) noise on the round's sum."""

    def check(self, cfg: RunConfig, num_clients: int, profiles: list[ClientProfile], sizes: list[int] | None) -> None:
        from fedapp.privacy.profiles import client_level_mechanism

        client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, num_clients)  # δ, σ calibration

    def plan(self, cfg: RunConfig, num_clients: int, payload_dim: int | None) -> dict[str, Any]:
        ddg = cfg.client_dp.secure_aggregation and cfg.client_dp.secagg_mechanism == "ddg"
        if ddg and payload_dim is None:
            payload_dim = secure_payload_dim(cfg)
        return _client_level(cfg.general, cfg.training, cfg.client_dp, num_clients, payload_dim)

    def meta(self, cfg: RunConfig) -> dict[str, Any]:
        client_dp = cfg.client_dp
        out: dict[str, Any] = {
            "secure_aggregation": (
                "SecAgg+ (Flower): the server sees only the sum of each round's updates; the budget and the headline "
                "'epsilon' are the aggregate's" if client_dp.secure_aggregation else
                "off: the server sees every update; σ is calibrated so one update meets the budget, and the headline "
                "'epsilon' is one update's ('epsilon_aggregate' is for observers of the sums and the final model)"),
            "budget_holds_against": (
                "the server that draws the sample (client-dp-adversary = server): no amplification by sampling; every "
                "round is charged at q = 1, which bounds each client's epsilon_vs_server; epsilon_vs_release reports "
                "the amplified view" if client_dp.client_dp_adversary == "server" else
                "observers of the released models only (client-dp-adversary = release): amplified by secret Poisson "
                "sampling at q = r/n; against the server itself see epsilon_vs_server, which this run does not "
                "bound")}
        if client_dp.adaptive_clip_quantile > 0:
            out["adaptive_clipping"] = (
                "Andrew et al. 2021: the server sets each round's clip C_t from the noisy count of unclipped updates; "
                "update noise z_Δ and count noise σ_b compose to the budget's z (Thm 1), which each client derives "
                "from its own run-config. " + (
                    "Under SecAgg+ each client's noised bit is one extra coordinate of the secure sum: the server "
                    "learns only the sum. This holds against an honest-but-curious server that follows the protocol "
                    "(sends every client the same C_t), the assumption epsilon_vs_server already rests on; a server "
                    "that sends different C_t to different clients is NOT covered (a large C_t to one target leaves "
                    "the other clients' noise, scaled by their smaller C_j, small next to its sensitivity)"
                    if client_dp.secure_aggregation else
                    "Without SecAgg+ each client sends its noised bit as a metric, next to its noised update"))
        return out

    def planned_epsilon(self, cfg: RunConfig, num_clients: int, node_config: Mapping[str, Any]) -> float | None:
        from fedapp.privacy.profiles import client_level_mechanism
        from strategies.privacy.accountants import epsilon_of

        dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, num_clients)
        return float(epsilon_of([(dp.budget_noise_multiplier, 1.0, dp.rounds)], dp.delta, dp.accountant))


@dataclass(frozen=True)
class CorrelatedNoise:
    """DP-FTRL: clipped updates plus the correlated noise of a tree or banded factorization, no sampling assumption;
    under SecAgg+ each client adds its own stream, without it the (trusted) server adds the noise."""

    def check(self, cfg: RunConfig, num_clients: int, profiles: list[ClientProfile], sizes: list[int] | None) -> None:
        from fedapp.privacy.profiles import ftrl_mechanism

        ftrl_mechanism(cfg.general, cfg.training, cfg.client_dp, num_clients)  # factorization, z calibration

    def plan(self, cfg: RunConfig, num_clients: int, payload_dim: int | None) -> dict[str, Any]:
        return _ftrl(cfg.general, cfg.training, cfg.client_dp, num_clients)

    def meta(self, cfg: RunConfig) -> dict[str, Any]:
        secagg = cfg.client_dp.secure_aggregation
        return {
            "ledger": ("server-side: DP-FTRL's release after round t is one Gaussian mechanism (multiplier z_eff / "
                       "sens_t of the factorization), composed by dp_accounting's PLD accountant; clients' reports "
                       "are only cross-checked"),
            "secure_aggregation": (
                "SecAgg+ (Flower, continuous Gaussian shares): each client adds its own correlated noise stream, the "
                "server sees only the noisy sum" if secagg else
                "off: the server sees every clipped update and adds the correlated noise itself"),
            "budget_holds_against": (
                "the server and observers of the release: no sampling or shuffling assumption (epsilon_vs_server)"
                if secagg else
                "observers of the released models only: the server is trusted (it adds the noise); no epsilon holds "
                "against it")}

    def planned_epsilon(self, cfg: RunConfig, num_clients: int, node_config: Mapping[str, Any]) -> float | None:
        from fedapp.privacy.profiles import ftrl_mechanism

        return float(ftrl_mechanism(cfg.general, cfg.training, cfg.client_dp, num_clients).epsilon())


def secure_payload_dim(run_config: Mapping[str, Any], initial_weights: Sequence[np.ndarray] | None = None) -> int:
    """The length of the vector each client of the run's client-level strategy privatizes (the strategy's own
    :meth:`~strategies.client_level.ClientLevelDPStrategy.payload_dim`, built from the run's initial model; under
    SecAgg+ with adaptive clipping it counts the count coordinate)."""
    from fedapp.apps.factories import build_strategy
    from strategies.base import StrategyContext
    from strategies.client_level import ClientLevelDPStrategy

    cfg = resolve_config(run_config)
    if initial_weights is None:
        from fedapp.clients.common import model_for_shape
        from fedapp.clients.training import get_weights
        from fedapp.data.node_data import run_shape

        initial_weights = get_weights(model_for_shape(cfg.model_spec, *run_shape(cfg.data)))
    # built as the ServerApp builds it under SecAgg+, so that the payload includes adaptive clipping's count coordinate
    strategy = build_strategy(cfg, StrategyContext(initial_weights=list(initial_weights),
                                                   secure_aggregation=cfg.client_dp.secure_aggregation))
    if not isinstance(strategy, ClientLevelDPStrategy):
        raise ConfigError(f"strategy {cfg.general.strategy!r} sends no client-level DP payload to a secure sum")
    return strategy.payload_dim()


def _client_level(general: GeneralConfig, training: TrainingConfig, client_dp: ClientDPConfig, n: int,
                  payload_dim: int | None) -> dict[str, Any]:
    from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism, secure_sum_mechanism
    from strategies.privacy.accountants import epsilon_of
    from strategies.privacy.adaptive_clipping import update_noise_multiplier
    from strategies.privacy.secure_minimum import planned_delta, secure_minimum_delta, total_delta
    from strategies.server.secure_sum import MIN_SECURE_SURVIVORS

    dp = client_level_mechanism(general, training, client_dp, n)
    secagg = client_dp.secure_aggregation
    mechanism: dict[str, Any] = {
        "name": "Gaussian on the sum of clipped client updates (each sampled client adds its share)",
        "secure_aggregation": "Flower SecAgg+" if secagg else "off: the server sees every update",
        "noise_multiplier": dp.noise_multiplier, "clip": dp.clip, "clients_per_round": dp.clients_per_round,
        "sample_rate": dp.sample_rate, "delta": dp.delta, "accountant": dp.accountant,
        "budget_holds_against": dp.adversary,
    }
    adaptive = adaptive_clip_config(client_dp, dp)
    if adaptive is not None:  # the budget stays z's: update (z_Δ) and count (σ_b) compose to z (Andrew et al., Thm 1)
        mechanism["adaptive_clipping"] = {
            "initial_clip": adaptive.initial_clip, "target_quantile": adaptive.target_quantile,
            "learning_rate": adaptive.learning_rate, "count_noise_std": adaptive.count_noise_std,
            "update_noise_multiplier": update_noise_multiplier(dp.noise_multiplier, adaptive.count_noise_std),
            "count_noise_added_by": "each client, σ_b/√r on its centred bit" + (
                ", sent as one extra coordinate of the secure sum (the server learns only the sum; against a server "
                "that sends every client the same C_t)" if secagg else ", sent as a metric")}
        if secagg and payload_dim is not None:  # the update's coordinates and the count coordinate
            mechanism["payload_dim"] = int(payload_dim)
    ddg = secure_sum_mechanism(client_dp, dp, payload_dim) if secagg and client_dp.secagg_mechanism == "ddg" and \
        payload_dim is not None else None
    if ddg is not None:
        mechanism.update(
            name="distributed discrete Gaussian on the sum of clipped client updates (Kairouz, Liu, Steinke 2021): "
                 "each sampled client sends its rotated, scaled, conditionally rounded update plus discrete "
                 "Gaussian noise modulo 2^bits",
            field_bits=ddg.bits, payload_dim=ddg.dim, rotated_dim=ddg.rotated_dim, granularity=ddg.granularity,
            noise_multiplier=ddg.noise_multiplier, planned_gaussian_multiplier=dp.noise_multiplier,
            gaussian_equivalent=ddg.gaussian_equivalent(n, n),
            payload_bytes=ddg.rotated_dim * ddg.bits / 8)
    elif secagg:
        from fedapp.privacy.secure_aggregation import QUANTIZATION_RANGE, modulus_for  # Flower's SecAgg+: on use

        try:
            field = modulus_for(n, QUANTIZATION_RANGE)
        except ValueError as exc:
            raise ConfigError(f"run-config 'secure-aggregation' = true with {n} clients: {exc}") from None
        mechanism.update(quantization_bits=int(math.log2(QUANTIZATION_RANGE)), field_bits=int(math.log2(field)),
                         epsilon_vs_server_proven=False, epsilon_vs_server_caveat=ROUNDED_SUM_CAVEAT)
    t = dp.rounds
    r = dp.clients_per_round  # the discrete sum is charged at its Gaussian equivalent (never below σ), unamplified
    z_server = ddg.gaussian_equivalent(r, r) if ddg is not None else dp.budget_noise_multiplier
    # worst case against the server: the client takes part in all T rounds, each unamplified, at the multiplier the
    # server sees (the sum's with SecAgg+, one update's without)
    vs_server = epsilon_of([(z_server, 1.0, t)], dp.delta, dp.accountant)
    vs_release = vs_server if ddg is not None else dp.epsilon_vs_release()
    every_client: dict[str, Any] = {"epsilon_vs_server": vs_server, "epsilon_vs_release": vs_release,
                                    "delta": dp.delta}
    plan: dict[str, Any] = {"mechanism": mechanism, "epsilon_budget": dp.epsilon()}
    if secagg and ddg is None:  # amplified views: δ plus SecAgg+'s minimum cohort's share (secure_minimum)
        eta_release = secure_minimum_delta(n, dp.release_sample_rate, t, MIN_SECURE_SURVIVORS)
        if eta_release > 0:
            every_client["delta_vs_release"] = total_delta(dp.delta, vs_release, eta_release)
        if secure_minimum_delta(n, dp.accounted_sample_rate, t, MIN_SECURE_SURVIVORS) > 0:
            plan["delta_total"] = planned_delta(dp, MIN_SECURE_SURVIVORS)
    return {**plan, "every_client": every_client}


def _ftrl(general: GeneralConfig, training: TrainingConfig, client_dp: ClientDPConfig, n: int) -> dict[str, Any]:
    from fedapp.privacy.profiles import ftrl_mechanism

    m = ftrl_mechanism(general, training, client_dp, n)
    eps = m.epsilon()
    mechanism: dict[str, Any] = {
        "name": f"DP-FTRL, {m.factorization.name} factorization: round t's sum of clipped updates gets (C⁻¹Z)_t",
        "noise_added_by": "each client, its own stream (SecAgg+)" if m.secure_aggregation else "the server",
        "noise_multiplier": m.noise_multiplier, "sensitivity": m.sensitivity(),
        "effective_multiplier": m.effective_multiplier(), "clip": m.clip, "rounds": m.rounds,
        "participation": ("every client may contribute in every round (k = T, min separation 1)" if m.min_separation == 1
                          else f"client i contributes only in the rounds t with (t - 1 - i) mod {m.min_separation} = 0, "
                               f"a schedule it enforces itself (k <= ceil(T/{m.min_separation}), min separation "
                               f"{m.min_separation})") + "; no amplification",
        "min_separation": m.min_separation,
        "clients_per_round": m.clients_per_round or n, "delta": m.delta, "accountant": "dpa-pld (one Gaussian)",
        "budget_holds_against": "server" if m.secure_aggregation else "release"}
    if m.secure_aggregation:  # continuous Gaussian streams through Flower's quantizer
        mechanism.update(epsilon_vs_server_proven=False, epsilon_vs_server_caveat=ROUNDED_SUM_CAVEAT)
    return {"mechanism": mechanism, "epsilon_budget": eps,
            "every_client": {"epsilon_vs_server": eps if m.secure_aggregation else None, "epsilon_vs_release": eps,
                             "delta": m.delta}}


def _record_level(general: GeneralConfig, training: TrainingConfig, data: DataConfig, n: int,
                  dpsgd: bool) -> dict[str, Any]:
    from fedapp.data.client_data import client_train_sizes
    from fedapp.data.node_data import is_node_local
    from fedapp.privacy.profiles import dpsgd_sample_rate, federation_profiles, steps_per_epoch

    profiles = federation_profiles(general, training, data, n)
    # node-local data: N_i is each node's own (it arrives with its replies), so q_i and the step count are too
    sizes: list[int | None] = [None] * n if is_node_local(data) else list(client_train_sizes(data, general.seed, n,
                                                                                               record_canaries(general)))
    clients = []
    for p, n_i in zip(profiles, sizes):
        row: dict[str, Any] = {"client_id": p.client_id, "num_examples": n_i, "delta": p.delta,
                               # local DP: the client's own noise, so the same ε against the server and the release
                               "epsilon_vs_server": p.epsilon, "epsilon_vs_release": p.epsilon}
        if dpsgd:  # DP-SGD's Poisson batches: q_i = 1/⌈N_i/b_i⌉, K_i⌈N_i/b_i⌉ steps a round
            row.update(batch_size=p.batch_size, sample_rate=dpsgd_sample_rate(n_i, p.batch_size) if n_i else None,
                       steps_per_round=p.local_epochs * steps_per_epoch(n_i, p.batch_size) if n_i else None)
        clients.append(row)
    return {"mechanism": {"name": "local DP-SGD / noisy local estimator on each client (noise added before "
                                  "anything leaves it); each client calibrates its own noise to its ε_i over "
                                  "dp-rounds before round 1", "clip": training.clip_norm,
                          "accountant": training.accountant},
            "per_client": clients}
