"""Per-client privacy profiles (ε_i, δ_i, b_i, K_i) for heterogeneous DP-FL, and the run's client-level mechanism.

In simulation every profile is a deterministic function of the run-config and the seed
(the server can therefore validate all of them before round 1); in deployment a SuperNode's
``--node-config`` overrides any field, e.g.
``partition-id=3 num-partitions=20 epsilon=0.8 delta=1e-4 batch-size=32``.

ε distributions are Robust-HDP Table 7. The paper writes N(μ, s); we read s as the
*standard deviation* (numpy's ``normal(loc, scale)``). Normal draws can be ≤ 0 (Dist1 has
N(2, 1)); any draw below ``epsilon-floor`` (default 0.05) is *redrawn* from the same
distribution (rejection sampling), so the sampled law is the Table-7 law truncated at the
floor — never a clipped point mass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fedapp.config import (
    ClientDPConfig,
    ConfigError,
    DataConfig,
    GeneralConfig,
    TrainingConfig,
    check_federation_size,
    parse_int_list,
)
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig, default_count_noise
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ftrl_accounting import FTRLMechanism
from strategies.privacy.mechanisms import ClientLevelDP, default_client_delta, max_delta
from strategies.privacy.secure_minimum import planned_delta
from strategies.server.secure_sum import MIN_SECURE_SURVIVORS


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """⌈N/b⌉: DP-SGD steps in one local epoch (Robust-HDP: E_i = K_i·⌈N_i/b_i⌉ per round)."""
    return math.ceil(num_examples / batch_size)


def dpsgd_sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson sampling rate Opacus uses for a loader of ⌈N/b⌉ batches: q = 1/⌈N/b⌉ (≈ b/N)."""
    return 1.0 / steps_per_epoch(num_examples, batch_size)


# (weights, means, stds) for mixtures of normals; ("uniform", low, high) otherwise.
DISTRIBUTIONS: dict[str, tuple] = {
    "dist1": ((1.0,), (2.0,), (1.0,)),
    "dist2": ((0.2, 0.6, 0.2), (0.2, 1.0, 5.0), (0.01, 0.1, 1.0)),
    "dist3": ("uniform", 0.2, 5.0),
    "dist4": ((0.2, 0.6, 0.2), (0.2, 0.5, 2.0), (0.01, 0.1, 1.0)),
    "dist5": ("uniform", 0.2, 2.0),
    "dist6": ((0.3, 0.5, 0.2), (0.2, 0.5, 1.0), (0.01, 0.1, 0.1)),
    "dist7": ("uniform", 0.2, 1.0),
    "dist8": ((0.6, 0.4), (0.2, 0.5), (0.01, 0.1)),
    "dist9": ("uniform", 0.2, 0.5),
}


def _spec(dist: str) -> tuple:
    """Table-7 distribution ``dist``'s specification, or a ``ConfigError`` naming the valid ones."""
    if dist not in DISTRIBUTIONS:
        raise ConfigError(f"unknown privacy-dist {dist!r}; valid: {sorted(DISTRIBUTIONS)} or 'fixed'")
    return DISTRIBUTIONS[dist]


def distribution_mean(dist: str) -> float:
    """The mean ε_i of Table-7 distribution ``dist`` as specified (Σ_k w_k μ_k, or (low + high)/2), before
    :func:`sample_epsilons` redraws values below its floor: dist2 1.64, dist4 0.74, dist6 0.51, dist8 0.32."""
    spec = _spec(dist)
    if spec[0] == "uniform":
        return (float(spec[1]) + float(spec[2])) / 2
    return float(sum(w * mu for w, mu in zip(spec[0], spec[1])))


def sample_epsilons(dist: str, num_clients: int, seed: int, floor: float = 0.05) -> np.ndarray:
    """Draw ε_1..ε_n from Table-7 distribution ``dist``; draws below ``floor`` are redrawn. Memoized per
    process (every client's profile draws all n to take its own: O(n²) at n = 1,000 otherwise)."""
    _spec(dist)
    return np.array(_epsilon_draws(dist, int(num_clients), int(seed), float(floor)))


@functools.lru_cache(maxsize=16)
def _epsilon_draws(dist: str, num_clients: int, seed: int, floor: float) -> tuple[float, ...]:
    rng = np.random.default_rng([seed, 201])
    spec = DISTRIBUTIONS[dist]
    out = np.empty(num_clients)
    for i in range(num_clients):
        for _ in range(10_000):
            if spec[0] == "uniform":
                value = rng.uniform(spec[1], spec[2])
            else:
                weights, means, stds = spec
                c = rng.choice(len(weights), p=np.asarray(weights))
                value = rng.normal(means[c], stds[c])
            if value >= floor:
                break
        else:  # pragma: no cover - floor above the support
            raise ConfigError(f"privacy-dist {dist!r} never draws ε >= epsilon-floor {floor}")
        out[i] = value
    return tuple(float(v) for v in out)


def sample_batch_sizes(choices: list[int], num_clients: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 202])
    return rng.choice(np.asarray(choices), size=num_clients)


@dataclass(frozen=True)
class ClientProfile:
    """What client ``client_id`` trains with and what it tells the server."""

    client_id: int
    num_clients: int
    epsilon: float
    delta: float
    batch_size: int
    local_epochs: int
    reported_epsilon: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _node_value(node_config: Mapping[str, Any], key: str, kind: type) -> Any:
    raw = node_config[key]
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"node-config {key!r} expects {kind.__name__}, got {raw!r}") from None
    return value


def _train_size(data: DataConfig, seed: int, num_clients: int, client_id: int) -> int | None:
    """N_i of a client (None when the dataset cannot be read here; the pre-round check still applies)."""
    from fedapp.data.client_data import client_train_sizes
    from fedapp.data.node_data import is_node_local

    if is_node_local(data):
        return None  # the node's own data: it caps a drawn b_i itself (fedapp.clients.common.node_batch)
    try:
        return int(client_train_sizes(data, seed, num_clients)[client_id])
    except (ConfigError, OSError):
        return None


def federation_profiles(general: GeneralConfig, training: TrainingConfig, data: DataConfig,
                        num_clients: int) -> list[ClientProfile]:
    """Profiles of all clients of a simulated federation (no node-config overrides). The run-config keys that
    count or name clients (clients-per-round, falsify-client) must fit the federation's ``num_clients``."""
    check_federation_size(general, training, num_clients)
    return [client_profile(general, training, data, {"partition-id": i, "num-partitions": num_clients})
            for i in range(num_clients)]


def client_profile(general: GeneralConfig, training: TrainingConfig, data: DataConfig,
                   node_config: Mapping[str, Any]) -> ClientProfile:
    """Resolve client profile from run-config (simulation) and node-config (deployment overrides)."""
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ConfigError(f"node-config needs 'partition-id' and 'num-partitions', got {dict(node_config)}")
    cid = _node_value(node_config, "partition-id", int)
    n = _node_value(node_config, "num-partitions", int)
    if n < 2:
        raise ConfigError(f"node-config 'num-partitions' = {n}: a federation needs at least 2 clients")
    if not 0 <= cid < n:
        raise ConfigError(f"node-config 'partition-id' = {cid} is outside 0..{n - 1}")
    seed = general.seed
    if training.privacy_dist == "fixed":
        epsilon = training.epsilon
    else:
        epsilon = float(sample_epsilons(training.privacy_dist, n, seed, training.epsilon_floor)[cid])
    if training.batch_size > 0:
        batch = training.batch_size
    else:
        batch = int(sample_batch_sizes(parse_int_list("batch-size-choices", training.batch_size_choices), n, seed)[cid])
        batch = min(batch, _train_size(data, seed, n, cid) or batch)  # a drawn b_i never exceeds N_i
    delta = training.delta
    epochs = training.local_epochs
    if "epsilon" in node_config:
        epsilon = _node_value(node_config, "epsilon", float)
    if "delta" in node_config:
        delta = _node_value(node_config, "delta", float)
    if "batch-size" in node_config:
        batch = _node_value(node_config, "batch-size", int)
    if "local-epochs" in node_config:
        epochs = _node_value(node_config, "local-epochs", int)
    reported = epsilon
    if training.falsify_client == cid:
        reported = training.falsify_epsilon
    if "reported-epsilon" in node_config:
        reported = _node_value(node_config, "reported-epsilon", float)
    if not (epsilon > 0 and np.isfinite(epsilon)):
        raise ConfigError(f"client {cid}: epsilon = {epsilon!r} must be > 0")
    if not 0 < delta < 1:
        raise ConfigError(f"client {cid}: delta = {delta!r} must be in (0, 1)")
    if batch <= 0:
        raise ConfigError(f"client {cid}: batch-size = {batch!r} must be > 0")
    if epochs <= 0:
        raise ConfigError(f"client {cid}: local-epochs = {epochs!r} must be > 0")
    return ClientProfile(cid, n, epsilon, delta, batch, epochs, reported)


def _client_level_setting(general: GeneralConfig, training: TrainingConfig, client_dp: ClientDPConfig,
                          num_clients: int) -> tuple[int, int, float]:
    """(n, T, δ) of a client-level mechanism, checked: n ≥ 2, r ≤ n, T = ``dp-rounds`` (0 → ``num-server-rounds``),
    δ = ``client-delta`` (0 → 1/(10 n); larger than that only with ``allow-large-delta``)."""
    n = int(num_clients)
    if n < 2:
        raise ConfigError(f"client-level DP needs at least 2 clients, got {n}")
    if general.clients_per_round > n:
        raise ConfigError(f"run-config 'clients-per-round' = {general.clients_per_round} exceeds the {n} clients of this "
                          f"federation: set it to at most {n} (0 = every client every round)")
    given = client_dp.client_delta
    if given > max_delta(n) and not training.allow_large_delta:
        raise ConfigError(f"run-config 'client-delta' = {given:g} is above 1/(10 n) = {max_delta(n):.3g} for n = {n} "
                          "clients; set 'allow-large-delta' = true to run with it anyway")
    return n, training.dp_rounds or general.num_server_rounds, given or default_client_delta(n)


def client_level_mechanism(general: GeneralConfig, training: TrainingConfig, client_dp: ClientDPConfig,
                           num_clients: int) -> ClientLevelDP:
    """The run's client-level mechanism (DP-FedAvg, Fed-SMP, DP2-FedSAM) from its run-config keys.

    r = ``clients-per-round`` (0 → all n), T = ``dp-rounds`` (0 → ``num-server-rounds``), δ =
    ``client-delta`` (0 → 1/(10 n); larger than that only with ``allow-large-delta``), σ = ``noise-multiplier`` or,
    when 0, calibrated by the accountant so that T rounds spend ``target-epsilon`` — of the aggregate under
    ``secure-aggregation``, of one update without it (the server then sees every update); unamplified (q = 1)
    against the server (``client-dp-adversary = "server"``), amplified at q = r/n against observers of the
    release. Server and clients call this with the same
    inputs, so they agree on σ (the server also sends it and clients cross-check).
    """
    n, rounds, delta = _client_level_setting(general, training, client_dp, num_clients)
    r = general.clients_per_round or n
    try:
        dp = _client_level(client_dp.noise_multiplier, client_dp.target_epsilon, training.clip_norm,
                           r, n, rounds, delta, training.accountant,
                           client_dp.secure_aggregation, client_dp.client_dp_adversary)
    except ValueError as exc:
        raise ConfigError(f"client-level DP: cannot set up σ for target-epsilon={client_dp.target_epsilon}, "
                          f"noise-multiplier={client_dp.noise_multiplier}, client-delta={client_dp.client_delta}, "
                          f"clients-per-round={general.clients_per_round} of {n}: {exc}") from None
    _check_secure_minimum(dp, training.allow_large_delta)
    return dp


def _check_secure_minimum(dp: ClientLevelDP, allow_large_delta: bool) -> None:
    """Refuse an amplified budget under SecAgg+ whose δ, with the minimum cohort's share
    (:mod:`strategies.privacy.secure_minimum`), is more than 1 % above 1/(10 n) (or the run's δ, if larger) unless
    ``allow-large-delta``."""
    total = planned_delta(dp, MIN_SECURE_SURVIVORS)
    if total > 1.01 * max(dp.delta, max_delta(dp.num_clients)) and not allow_large_delta:
        raise ConfigError(
            f"run-config 'client-dp-adversary' = 'release' with clients-per-round = {dp.clients_per_round} of "
            f"{dp.num_clients}: SecAgg+ unmasks no sum of fewer than {MIN_SECURE_SURVIVORS} clients, and under secret "
            f"sampling that leaves the release's ε {dp.epsilon():.4g} at δ {total:.3g}, above 1/(10 n) = "
            f"{max_delta(dp.num_clients):.3g} (strategies/privacy/secure_minimum.py); raise clients-per-round, set "
            "client-dp-adversary = 'server', or set 'allow-large-delta' = true to run with it anyway")


@functools.lru_cache(maxsize=64)
def _client_level(sigma: float, target: float, clip: float, r: int, n: int, rounds: int, delta: float,
                  accountant: str, secure_aggregation: bool, adversary: str) -> ClientLevelDP:
    if sigma > 0:
        return ClientLevelDP(sigma, clip, r, n, rounds, delta, accountant, secure_aggregation, adversary)
    return ClientLevelDP.calibrated(target, clip=clip, clients_per_round=r, num_clients=n, rounds=rounds,
                                    delta=delta, accountant=accountant, secure_aggregation=secure_aggregation,
                                    adversary=adversary)


def adaptive_clip_config(cd: ClientDPConfig, dp: ClientLevelDP) -> AdaptiveClipConfig | None:
    """The run's adaptive clipping (Andrew et al. 2021) for mechanism ``dp``, or None when
    ``adaptive-clip-quantile`` = 0: γ, η_C, C_0 = ``clip-norm`` and σ_b = ``adaptive-clip-count-noise`` (0 → r/20,
    the paper's choice, or z where r/20 does not exceed z/2: the update noise is then z_Δ = 2z/√3 ≈ 1.155 z).
    σ_b must exceed z/2 (z = ``dp``'s σ) for the update multiplier z_Δ to exist; a value the user sets below it is
    refused. Server and clients call this with the same inputs, so each client derives z_Δ itself."""
    if cd.adaptive_clip_quantile == 0:
        return None
    given = cd.adaptive_clip_count_noise
    count_noise = given or default_count_noise(dp.clients_per_round)
    if not given and count_noise <= dp.noise_multiplier / 2:
        count_noise = dp.noise_multiplier
    if count_noise <= dp.noise_multiplier / 2:
        source = (f"run-config 'adaptive-clip-count-noise' = {given:g}" if given else
                  f"run-config 'adaptive-clip-count-noise' = 0 (r/20 = {count_noise:g} for r = {dp.clients_per_round})")
        raise ConfigError(f"{source} must exceed z/2 = {dp.noise_multiplier / 2:.4g} (z = {dp.noise_multiplier:.4g}, "
                          "the sum's noise multiplier): the count alone would spend the round's whole budget "
                          "(Andrew et al. 2021, Thm 1); set it above that, e.g. σ_b = z = "
                          f"{dp.noise_multiplier:.4g} (the update noise is then z_Δ = 2z/√3 ≈ 1.155 z)")
    return AdaptiveClipConfig(cd.adaptive_clip_quantile, cd.adaptive_clip_lr, count_noise, dp.clip)


def ftrl_mechanism(general: GeneralConfig, training: TrainingConfig, client_dp: ClientDPConfig,
                   num_clients: int) -> FTRLMechanism:
    """DP-FTRL's mechanism of the run (``dp-ftrl``): the factorization of ``ftrl-mechanism`` for T = ``dp-rounds``
    (0 → ``num-server-rounds``), δ as :func:`client_level_mechanism`, z = ``noise-multiplier`` or, when 0,
    calibrated so that the whole run (no amplification) spends ``target-epsilon`` with each client contributing by
    the ``ftrl-min-separation`` schedule (every round when it is 1). Server and clients call this with the same
    inputs, so they agree on z, C, the band and the participation pattern."""
    n, rounds, delta = _client_level_setting(general, training, client_dp, num_clients)
    kwargs: dict[str, Any] = {
        "kind": client_dp.ftrl_mechanism, "rounds": rounds, "clip": training.clip_norm, "num_clients": n,
        "delta": delta, "bands": client_dp.ftrl_bands,
        "restart_every": client_dp.ftrl_restart_every, "clients_per_round": general.clients_per_round,
        "secure_aggregation": client_dp.secure_aggregation, "min_separation": client_dp.ftrl_min_separation}
    try:
        if client_dp.noise_multiplier > 0:
            return FTRLMechanism(noise_multiplier=client_dp.noise_multiplier, **kwargs)
        return _ftrl_calibrated(client_dp.target_epsilon, tuple(sorted(kwargs.items())))
    except ValueError as exc:
        raise ConfigError(f"dp-ftrl: cannot set up the mechanism for ftrl-mechanism={client_dp.ftrl_mechanism!r}, "
                          f"ftrl-bands={client_dp.ftrl_bands}, rounds={rounds}, target-epsilon="
                          f"{client_dp.target_epsilon}, noise-multiplier={client_dp.noise_multiplier}: "
                          f"{exc}") from None


@functools.lru_cache(maxsize=16)
def _ftrl_calibrated(target: float, items: tuple[tuple[str, Any], ...]) -> FTRLMechanism:
    return FTRLMechanism.calibrated(target, **dict(items))


def secure_sum_mechanism(client_dp: ClientDPConfig, dp: ClientLevelDP, dim: int) -> DistributedDiscreteGaussian | None:
    """The distributed discrete Gaussian the run's secure sums carry (``secagg-mechanism = 'ddg'`` under SecAgg+), or
    None (continuous Gaussian shares, or no secure aggregation). Server and clients build it from the same plan:
    the sum's multiplier is raised from σ until its Gaussian equivalent reaches σ (for a sum of all n clients),
    at ``secagg-bits`` bits for payloads of ``dim`` values; too few bits raise ``ConfigError`` naming the key."""
    if not (dp.secure_aggregation and client_dp.secure_aggregation and client_dp.secagg_mechanism == "ddg"):
        return None
    bits = client_dp.secagg_bits
    try:
        return _ddg(dp.noise_multiplier, dp.clip, dp.num_clients, int(dim), bits)
    except ValueError as exc:
        raise ConfigError(f"run-config 'secagg-bits' = {bits}: {exc} (σ = {dp.noise_multiplier:.4g}, "
                          f"clip = {dp.clip:g}; or set secagg-mechanism = 'gaussian')") from None


@functools.lru_cache(maxsize=64)
def _ddg(sigma: float, clip: float, cohort: int, dim: int, bits: int) -> DistributedDiscreteGaussian:
    return DistributedDiscreteGaussian.calibrated(sigma, clip=clip, max_cohort=cohort, dim=dim, bits=bits)


def check_record_delta(general: GeneralConfig, training: TrainingConfig, profiles: list[ClientProfile],
                       sizes: list[int]) -> None:
    """Record-level DP before round 1: every client's δ_i must be at most 1/(10·N_i) unless ``allow-large-delta``,
    and the noise calibration of DP-SGD clients must reach their ε_i (:func:`check_dpsgd_calibration`)."""
    if not training.allow_large_delta:
        for profile, n_i in zip(profiles, sizes):
            if n_i > 0 and profile.delta > max_delta(n_i):
                raise ConfigError(f"client {profile.client_id}: delta = {profile.delta:g} is above 1/(10 N_i) = "
                                  f"{max_delta(n_i):.3g} for its N_i = {n_i} records (run-config 'delta' or node-config); "
                                  "set 'allow-large-delta' = true to run with it anyway")
    check_dpsgd_calibration(general, training, profiles, sizes)


def check_dpsgd_calibration(general: GeneralConfig, training: TrainingConfig, profiles: list[ClientProfile],
                            sizes: list[int]) -> None:
    """Refuse an ε_i that no noise multiplier achieves, before any client starts.

    A DP-SGD client calibrates z_i on its first round (``DPSGDClient.calibrate``); a target below what the
    accountant can certify at δ_i makes that calibration fail only once the run is up (as the noise grows, the
    accountant's ε falls to a floor set by δ and the accountant, not by q or the step count). This runs the very
    same calibration (:func:`fedapp.state.cache.calibrated_noise_multiplier`, the client's arguments and cache, so the
    client then finds its z_i cached) for the client with the hardest target, the smallest ε_i (ties: the
    smallest δ_i), which stands for all: calibrating all n clients here would cost ~0.2 s each (minutes at
    n = 1,000)."""
    from fedapp.registry import Feature, get_spec

    if not get_spec(general.strategy).supports(Feature.DPSGD_CLIENTS) or not profiles:
        return
    from fedapp.state.cache import calibrated_noise_multiplier
    from strategies.privacy.accountants import record_accountant

    rounds = training.dp_rounds or general.num_server_rounds
    hardest = min(range(len(profiles)), key=lambda i: (profiles[i].epsilon, profiles[i].delta))
    p, n_i = profiles[hardest], int(sizes[hardest])
    if n_i <= 0:
        return
    b = p.batch_size
    q, steps = dpsgd_sample_rate(n_i, b), rounds * p.local_epochs * steps_per_epoch(n_i, b)
    try:
        calibrated_noise_multiplier(p.epsilon, p.delta, q, steps,
                                    record_accountant(training.accountant, training.record_neighbours))
    except (ValueError, ArithmeticError) as exc:
        if training.privacy_dist == "fixed":
            source, fix = f"run-config 'epsilon' = {p.epsilon:g}", "a larger 'epsilon'"
        else:
            source = (f"client {p.client_id}'s ε_i = {p.epsilon:g} (drawn from run-config 'privacy-dist' = "
                      f"{training.privacy_dist!r}, at least 'epsilon-floor' = {training.epsilon_floor:g})")
            fix = "a privacy-dist with larger ε_i or a larger 'epsilon-floor'"
        raise ConfigError(f"{source} cannot be reached: no noise multiplier achieves ε = {p.epsilon:g} at δ = "
                          f"{p.delta:g} (client {p.client_id}: N_i = {n_i} records, batch {b}, {steps} DP-SGD steps over "
                          f"{rounds} rounds, {training.accountant} accountant; the run's noise calibration: {exc}); "
                          f"choose {fix} (or a larger 'delta')") from None
