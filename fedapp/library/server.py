"""Strategies of :mod:`strategies` built from typed arguments, for a user's own ServerApp.

Each builder returns the library's own Flower ``Strategy`` (run it with ``flwr.server.compat.start_grid`` from a
``ServerApp``'s ``@app.main()``); its threat model is the strategy's ``privacy`` attribute. The clients must be the
matching ones of :mod:`fedapp.library.clients`: record-level DP-SGD clients (:func:`~fedapp.library.clients.dpsgd_client`)
for :func:`robust_hdp`, :func:`dpsgd_fedavg`, :func:`weiavg`, :func:`pfa` and :func:`min_eps`; client-level clients
(:func:`~fedapp.library.clients.client_level_client`) for :func:`dp_fedavg`, :func:`fed_smp` and
:func:`sparse_fedavg`; :func:`~fedapp.library.clients.ftrl_client` for :func:`dp_ftrl`,
:func:`~fedapp.library.clients.soteriafl_client` for :func:`soteriafl` and
:func:`~fedapp.library.clients.dp2_fedsam_client` for :func:`dp2_fedsam`. None runs SecAgg+.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import Context
from flwr.server import ServerConfig
from flwr.serverapp import Grid
from torch import nn

from fedapp.clients.soteriafl import soteriafl_params
from fedapp.clients.training import LocalTraining, get_weights, local_train, resolve_device, set_weights
from fedapp.compat.http_retry import retry_grid_tls_eof
from fedapp.compat.wakeups import wake_grid
from fedapp.config import ClientDPConfig, DeploymentConfig, SoteriaFLConfig
from fedapp.library.data import UserData, as_array_dataset
from fedapp.library.evaluation import Loss, ModelProblem, evaluate_user_model
from fedapp.library.settings import DP2FedSAMSettings, DPSGDSettings, Rounds, SecAggSettings, SoteriaFLSettings
from fedapp.privacy.profiles import secure_sum_mechanism
from fedapp.privacy.secure_aggregation import run_with_secure_aggregation
from strategies.aggregate import flatten
from strategies.client_level import MIN_SECURE_SURVIVORS
from strategies.dp2_fedsam import DP2FedSAMStrategy, get_variant, shared_mask
from strategies.dp_ftrl import DPFTRLStrategy
from strategies.engine import EvaluateFn
from strategies.errors import ConfigError
from strategies.fed_smp import FedSMPStrategy, PublicUpdateFn, mask_seed
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ftrl_accounting import FTRLMechanism
from strategies.privacy.mechanisms import ClientLevelDP, default_client_delta, max_delta
from strategies.robust_hdp import PFA, MinEpsilon, RobustHDP, WeiAvg
from strategies.server.records import RoundRecorder
from strategies.soteriafl import SoteriaFLStrategy, get_method

Weights = Sequence[np.ndarray] | nn.Module


def _engine(initial: Weights, rounds: Rounds, evaluate_fn: EvaluateFn | None, recorder: RoundRecorder | None,
            accountant: str) -> dict[str, Any]:
    weights = get_weights(initial) if isinstance(initial, nn.Module) else [np.asarray(w) for w in initial]
    sizes = rounds.client_sizes
    return {"initial_weights": weights, "evaluate_fn": evaluate_fn, "recorder": recorder,
            "num_rounds": rounds.num_rounds, "seed": rounds.seed, "clients_per_round": rounds.clients_per_round,
            "min_available_clients": rounds.min_available_clients, "fraction_evaluate": rounds.fraction_evaluate,
            "evaluate_every": rounds.evaluate_every, "server_lr": rounds.server_lr, "secret_sampling": True,
            "accountant": accountant, "strike_limit": rounds.strike_limit,
            "robust_norm_factor": rounds.robust_norm_factor,
            "dataset_sizes": (lambda n: list(sizes)) if sizes is not None else None}


def fedavg(initial: Weights, rounds: Rounds, *, evaluate_fn: EvaluateFn | None = None,
           recorder: RoundRecorder | None = None) -> FedAvg:
    """FedAvg (w_i ∝ N_i) over non-private updates: no privacy. Clients: ``dpsgd_client(..., private=False)``."""
    return FedAvg(**_engine(initial, rounds, evaluate_fn, recorder, "rdp"))


def dpsgd_fedavg(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
                 recorder: RoundRecorder | None = None) -> DPSGDFedAvg:
    """DP-FedAvg over record-level DP-SGD clients (w_i ∝ N_i); an update above what the client's declared DP-SGD and
    ``dpsgd``'s clip, schedule and momentum produce is rejected. Privacy: each client's records, (ε_i, δ_i) against
    anyone who sees its updates, the server included."""
    return DPSGDFedAvg(clip_norm=dpsgd.clip_norm, momentum=dpsgd.momentum, lr_schedule=dpsgd.lr_schedule(),
                       **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def robust_hdp(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
               recorder: RoundRecorder | None = None, max_weight_share: float = 0.5, freeze_weights: bool = False,
               rpca_tol: float = 1e-4) -> RobustHDP:
    """Robust-HDP (Malekmohammadi et al. 2024, Alg. 1): weights w_i ∝ 1/σ̂_i² from Robust PCA of the round's
    updates, never from a client's reported ε; an update whose estimated noise is outside the band its declared DP-SGD
    implies is rejected. Same privacy as :func:`dpsgd_fedavg` (record-level, local, untrusted server)."""
    return RobustHDP(rpca_options={"tol": rpca_tol}, freeze_weights=freeze_weights, clip_norm=dpsgd.clip_norm,
                     max_weight_share=max_weight_share, lr_schedule=dpsgd.lr_schedule(), momentum=dpsgd.momentum,
                     **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def weiavg(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
           recorder: RoundRecorder | None = None) -> WeiAvg:
    """WeiAvg (Liu et al. 2021; Robust-HDP Alg. 2): w_i ∝ the ε_i each client reports (a reply without a finite
    ε > 0 is rejected). Clients: :func:`~fedapp.library.clients.dpsgd_client`, which reports the ε it trains with.
    Same privacy as :func:`dpsgd_fedavg`; the weights trust the reports (a client that overstates ε gains weight)."""
    return WeiAvg(clip_norm=dpsgd.clip_norm, **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def pfa(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, components: int = 1,
        evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None) -> PFA:
    """PFA (Liu et al. 2021): clients split by reported ε into public (larger ε) and private; private updates are
    projected on the top-``components`` principal subspace of the public ones; w_i ∝ reported ε_i. Clients:
    :func:`~fedapp.library.clients.dpsgd_client`. Same privacy as :func:`dpsgd_fedavg`."""
    return PFA(components=components, clip_norm=dpsgd.clip_norm,
               **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def min_eps(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
            recorder: RoundRecorder | None = None) -> MinEpsilon:
    """The minimum-ε baseline: every client trains at the federation's smallest budget min_j ε_j, w_i ∝ N_i.
    The minimum is the clients' side: each ClientApp passes ``dpsgd_client(..., epsilon=min_j ε_j)`` (the project's
    app computes it from the run-config's ε_i; a user's app knows its clients' budgets and must do the same); the
    server charges each client from its declared DP-SGD as for :func:`dpsgd_fedavg`."""
    return MinEpsilon(clip_norm=dpsgd.clip_norm, **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def client_level_mechanism(*, num_clients: int, rounds: int, clip: float, target_epsilon: float | None = None,
                           noise_multiplier: float | None = None, delta: float | None = None,
                           clients_per_round: int = 0, accountant: str = "rdp", allow_large_delta: bool = False,
                           secure_aggregation: bool = False) -> ClientLevelDP:
    """The client-level Gaussian mechanism of :func:`dp_fedavg` / :func:`fed_smp`.

    ``secure_aggregation=False`` (default): the server sees every update, so σ is calibrated for one update's ε (each
    client adds N(0, C²σ²/r)). ``secure_aggregation=True``: the strategy runs under SecAgg+ (``secagg=`` of
    :func:`dp_fedavg` / :func:`fed_smp`, :func:`run_secure_aggregation`), the server sees only the sum of each round's
    updates, and σ is calibrated for the sum (each client adds N(0, C²σ²/r_t), r_t the round's sampled count): the
    run-config's ``secure-aggregation = true``, with √r times less noise per client for the same ε.

    Exactly one of ``target_epsilon`` (σ calibrated so ``rounds`` rounds spend it) and ``noise_multiplier`` (σ given).
    ``delta`` defaults to 1/(10 n); a larger one is refused unless ``allow_large_delta``. ε holds against the server,
    which draws the sample and sees who replies: every round is charged unamplified (q = 1), the project's default
    adversary (no amplification by sampling is claimed). Server and clients must build it from the same arguments: a
    client refuses a round whose σ differs from its own."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of target_epsilon and noise_multiplier")
    r = clients_per_round or num_clients
    delta = default_client_delta(num_clients) if delta is None else delta
    if delta > max_delta(num_clients) and not allow_large_delta:
        raise ValueError(f"delta = {delta:g} is above 1/(10 n) = {max_delta(num_clients):.3g} for n = {num_clients} "
                         "clients; pass allow_large_delta=True to use it anyway")
    secure = bool(secure_aggregation)
    if noise_multiplier is not None:
        return ClientLevelDP(noise_multiplier, clip, r, num_clients, rounds, delta, accountant, secure, "server")
    assert target_epsilon is not None
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon = {target_epsilon} must be a finite number > 0")
    return ClientLevelDP.calibrated(target_epsilon, clip=clip, clients_per_round=r, num_clients=num_clients,
                                    rounds=rounds, delta=delta, accountant=accountant, secure_aggregation=secure,
                                    adversary="server")


def secagg_client_dp(secagg: SecAggSettings) -> ClientDPConfig:
    """The project's client-level DP section that says SecAgg+ with ``secagg``'s mechanism, bits, shares and threshold:
    what :func:`fedapp.privacy.profiles.secure_sum_mechanism`, the project's client and its SecAgg+ workflow read."""
    return ClientDPConfig(secure_aggregation=True, secagg_mechanism=secagg.mechanism, secagg_bits=secagg.bits,
                          secagg_num_shares=secagg.num_shares, secagg_threshold=secagg.reconstruction_threshold)


def secure_sum(mechanism: ClientLevelDP, secagg: SecAggSettings, dim: int) -> DistributedDiscreteGaussian | None:
    """The distributed discrete Gaussian the secure sums of ``dim``-value payloads carry under ``secagg`` (None for
    ``mechanism = "gaussian"``), as the strategy and every client derive it
    (:func:`fedapp.privacy.profiles.secure_sum_mechanism`): its σ is the least whose full round has a Gaussian
    equivalent of at least ``mechanism.noise_multiplier``, so the continuous plan's ε bounds it. ``dim``: the model's
    number of parameters (:func:`dp_fedavg`), or k = round(p·d) (:func:`fed_smp`). Too few ``bits`` for ``dim`` raise
    ``ValueError``."""
    if not mechanism.secure_aggregation:
        raise ValueError("the mechanism has secure_aggregation = False: no secure sum (client_level_mechanism(..., "
                         "secure_aggregation=True))")
    try:
        return secure_sum_mechanism(secagg_client_dp(secagg), mechanism, int(dim))
    except ConfigError as exc:
        raise ValueError(f"SecAggSettings.bits = {secagg.bits}: {exc}") from None


def _client_level_factory(rounds: Rounds, mechanism: ClientLevelDP, secagg: SecAggSettings | None = None) -> Any:
    """The strategy's ``mechanism_factory``: ``mechanism`` for exactly its n clients; refuses a mechanism whose
    ``secure_aggregation`` disagrees with ``secagg`` (SecAgg+ on exactly when given) or planned for another r than
    ``rounds``."""
    if mechanism.secure_aggregation and secagg is None:
        raise ValueError("mechanism.secure_aggregation = True: pass secagg=SecAggSettings(...) and run the strategy "
                         "with fedapp.library.run_secure_aggregation (SecAgg+); without SecAgg+ build the mechanism "
                         "with client_level_mechanism(..., secure_aggregation=False)")
    if secagg is not None and not mechanism.secure_aggregation:
        raise ValueError("secagg given but mechanism.secure_aggregation = False: σ would be calibrated for one update "
                         "while the server sees only sums; build it with client_level_mechanism(..., "
                         "secure_aggregation=True)")
    if secagg is not None:
        if mechanism.clients_per_round < MIN_SECURE_SURVIVORS:
            raise ValueError(f"SecAgg+ with r = {mechanism.clients_per_round} client(s) a round: a secure sum of fewer "
                             f"than {MIN_SECURE_SURVIVORS} survivors is never unmasked")
        if secagg.mechanism == "ddg" and (mechanism.accountant != "rdp" or mechanism.adversary != "server"):
            raise ValueError(f"SecAggSettings.mechanism = 'ddg' needs accountant = 'rdp' and adversary 'server' (the "
                             f"discrete Gaussian's bound is a Rényi DP bound without amplification); got accountant = "
                             f"{mechanism.accountant!r}: use 'rdp' or mechanism = 'gaussian'")
    if (rounds.clients_per_round or mechanism.num_clients) != mechanism.clients_per_round:
        raise ValueError(f"rounds.clients_per_round = {rounds.clients_per_round} but the mechanism is planned for "
                         f"r = {mechanism.clients_per_round} of n = {mechanism.num_clients}")
    num_clients = mechanism.num_clients

    def factory(n: int) -> ClientLevelDP:
        if n != num_clients:
            raise ValueError(f"{n} clients connected; the client-level mechanism is planned for n = {num_clients}")
        return mechanism

    return factory


class SecureClientLevelStrategy(FedSMPStrategy):
    """:class:`~strategies.fed_smp.FedSMPStrategy` built for SecAgg+ (``secure_aggregation = True``, the secure
    sum of ``secagg``), unchanged except that it refuses to configure a round outside
    :func:`run_secure_aggregation`: run by ``start_grid`` it would receive every update in the clear, each with noise
    sized for a sum of r_t (the ε would not hold)."""

    def __init__(self, *, secagg: SecAggSettings, **kwargs: Any) -> None:
        super().__init__(secure_aggregation=True, **kwargs)
        self.secagg = secagg
        #: set by :func:`run_secure_aggregation` before the first round
        self.under_secure_aggregation = False

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
        if not self.under_secure_aggregation:
            raise RuntimeError(f"{self.name} was built with secagg= (SecAgg+): run it with "
                               "fedapp.library.run_secure_aggregation(grid, context, strategy), not start_grid")
        return super().configure_fit(server_round, parameters, client_manager)


def _client_level_strategy(initial: Weights, rounds: Rounds, mechanism: ClientLevelDP, secagg: SecAggSettings | None,
                           evaluate_fn: EvaluateFn | None, recorder: RoundRecorder | None,
                           **kwargs: Any) -> FedSMPStrategy:
    factory = _client_level_factory(rounds, mechanism, secagg)
    engine = _engine(initial, rounds, evaluate_fn, recorder, mechanism.accountant)
    if secagg is None:
        return FedSMPStrategy(mechanism_factory=factory, clip=mechanism.clip, secure_aggregation=False,
                                   **kwargs, **engine)
    client_dp = secagg_client_dp(secagg)
    return SecureClientLevelStrategy(
        secagg=secagg, mechanism_factory=factory, clip=mechanism.clip,
        secure_sum_factory=lambda dp, dim: secure_sum_mechanism(client_dp, dp, dim), **kwargs, **engine)


def dp_fedavg(initial: Weights, rounds: Rounds, mechanism: ClientLevelDP, *, secagg: SecAggSettings | None = None,
              evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None) -> FedSMPStrategy:
    """DP-FedAvg with client-level DP (McMahan et al. 2018; Fed-SMP's dense case): clients clip their update to C and
    add their noise share; the server samples clients by secret Poisson sampling at q = r/n, averages and keeps its own
    ledger of each client's ε. ``rounds.clients_per_round`` must equal the mechanism's r (0 when r = n).

    ``secagg=None``: without SecAgg+, ``mechanism`` must have ``secure_aggregation = False``; run the strategy with
    ``start_grid``. ``secagg=SecAggSettings(...)``: under SecAgg+ (a :class:`SecureClientLevelStrategy`), ``mechanism``
    built with ``secure_aggregation=True`` and r >= 3; run it with :func:`run_secure_aggregation`, clients
    ``client_level_client(..., secagg=...)`` behind the ``secagg_mod``."""
    return _client_level_strategy(initial, rounds, mechanism, secagg, evaluate_fn, recorder, name="dp-fedavg")


def run_secure_aggregation(grid: Grid, context: Context, strategy: FedSMPStrategy, *,
                           num_rounds: int | None = None, secagg: SecAggSettings | None = None) -> None:
    """Run a strategy built with ``secagg=`` (:func:`dp_fedavg`, :func:`fed_smp`) from a ``ServerApp``'s
    ``@app.main()``: the project's SecAgg+ round loop (:func:`fedapp.privacy.secure_aggregation.
    run_with_secure_aggregation`, Flower's ``DefaultWorkflow`` with the project's ``DPSecAggPlusWorkflow`` as the fit
    step: quantizer range and field from the round's mechanism, the budget checked before a sum is unmasked, the
    discrete Gaussian's residues decoded) with the strategy's :class:`SecAggSettings` (``num_shares``,
    ``reconstruction_threshold``, ``round_timeout``). ``num_rounds`` defaults to the strategy's ``rounds.num_rounds``;
    ``secagg``, when given, must equal the strategy's. Evaluation runs as in ``start_grid``."""
    if not isinstance(strategy, SecureClientLevelStrategy):
        raise ValueError(f"{type(strategy).__name__} was not built for SecAgg+: build it with dp_fedavg(..., "
                         "secagg=SecAggSettings(...)) or fed_smp(..., secagg=...), or run it with start_grid")
    if secagg is not None and secagg != strategy.secagg:
        raise ValueError(f"secagg = {secagg} differs from the strategy's {strategy.secagg}")
    settings = strategy.secagg
    rounds = strategy.num_rounds if num_rounds is None else int(num_rounds)
    config = ServerConfig(num_rounds=rounds, round_timeout=settings.round_timeout or None)
    wake_grid(grid)  # in Flower's simulation runtime: replies wake the round loop instead of its 0.1 s poll
    retry_grid_tls_eof(grid)  # deployed: a TLS handshake the SuperLink cut short costs no client its round
    strategy.under_secure_aggregation = True
    try:
        run_with_secure_aggregation(grid, context, strategy, config, secagg_client_dp(settings),
                                    DeploymentConfig(round_timeout=settings.round_timeout))
    finally:
        strategy.under_secure_aggregation = False


def _sparsifier(sparsifier: str, public_update: PublicUpdateFn | None) -> None:
    if sparsifier not in ("randk", "topk"):
        raise ValueError(f"sparsifier = {sparsifier!r} must be 'randk' or 'topk' (dense: dp_fedavg / fedavg)")
    if sparsifier == "topk" and public_update is None:
        raise ValueError("sparsifier = 'topk' needs public_update: the server's update on its public data D_p, whose "
                         "k largest coordinates are the round's mask (fedapp.library.public_update(...) builds one)")
    if sparsifier == "randk" and public_update is not None:
        raise ValueError("public_update is used by sparsifier = 'topk' only")


def fed_smp(initial: Weights, rounds: Rounds, mechanism: ClientLevelDP, *, sparsifier: str = "randk",
            compression_ratio: float = 0.01, public_update: PublicUpdateFn | None = None,
            secagg: SecAggSettings | None = None, evaluate_fn: EvaluateFn | None = None,
            recorder: RoundRecorder | None = None) -> FedSMPStrategy:
    """Fed-SMP (Hu, Guo & Gong; Alg. 2): client-level DP on a sparsified update. Each round the server picks a mask
    of k = round(``compression_ratio``·d) coordinates and sends it in the fit config; the clients
    (:func:`~fedapp.library.clients.client_level_client`, unchanged: the mask comes with the round) sparsify (rand-k:
    scaled by d/k), clip to C and noise the k values only. ``sparsifier = "randk"``: the mask drawn from a seed;
    ``"topk"``: the k largest coordinates of ``public_update(weights, round)``, the server's own update on public
    data held out of every client's (the mask then depends on no client's data). Same mechanism, sampling, ledger and
    ``secagg`` (SecAgg+ of the k values) as :func:`dp_fedavg`."""
    _sparsifier(sparsifier, public_update)
    return _client_level_strategy(initial, rounds, mechanism, secagg, evaluate_fn, recorder, sparsifier=sparsifier,
                                  compression_ratio=compression_ratio, public_update_fn=public_update,
                                  name=f"fed-smp-{sparsifier}")


def sparse_fedavg(initial: Weights, rounds: Rounds, *, clip: float, sparsifier: str = "randk",
                  compression_ratio: float = 0.01, public_update: PublicUpdateFn | None = None,
                  evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None) -> FedSMPStrategy:
    """FedAvg-randk / FedAvg-topk: Fed-SMP's sparsify-and-clip without noise (no privacy; the baselines of Fed-SMP
    Sec. 6.3.2). Clients: ``client_level_client(..., mechanism=None, clip=clip)``; an update above ``clip`` is
    rejected."""
    _sparsifier(sparsifier, public_update)
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip = {clip} must be a finite number > 0")
    return FedSMPStrategy(clip=clip, sparsifier=sparsifier, compression_ratio=compression_ratio,
                               public_update_fn=public_update, name=f"fedavg-{sparsifier}",
                               **_engine(initial, rounds, evaluate_fn, recorder, "rdp"))


def public_update(model: nn.Module, public: UserData, *, lr: float, steps: int, batch_size: int,
                  momentum: float = 0.0, lr_decay: float = 1.0, loss: Loss | None = None, seed: int = 0,
                  device: str = "cpu") -> PublicUpdateFn:
    """Fed-SMP top-k's server-side update (Sec. 6.2): from the round's global weights θ_t, ``steps`` momentum-SGD
    steps of size ``lr``·``lr_decay``^(t−1) on ``public`` (the server's public set D_p, held out of every client's
    data), batches of ``batch_size``; returns Δ_p = θ' − θ_t (flat). ``model`` is copied, never trained."""
    data = as_array_dataset(public, "public")
    if not 1 <= batch_size <= len(data) or steps < 1:
        raise ValueError(f"batch_size = {batch_size} must be in 1..{len(data)} (the public records) and steps = "
                         f"{steps} >= 1")
    template = copy.deepcopy(model)
    torch_device = resolve_device(device)

    def update(weights: list[np.ndarray], server_round: int) -> np.ndarray:
        set_weights(template, weights)
        local_train(template, data, LocalTraining(batch_size=batch_size, steps=steps,
                                                  lr=lr * lr_decay ** (server_round - 1), momentum=momentum,
                                                  seed=mask_seed(seed, server_round, 502), loss=loss), torch_device)
        return flatten(get_weights(template)) - flatten(weights)

    return update


def ftrl_mechanism(*, num_clients: int, rounds: int, clip: float, target_epsilon: float | None = None,
                   noise_multiplier: float | None = None, delta: float | None = None, kind: str = "banded",
                   bands: int = 1, restart_every: int = 0, min_separation: int = 1,
                   allow_large_delta: bool = False) -> FTRLMechanism:
    """DP-FTRL's matrix mechanism (Kairouz et al. 2021 ``kind="tree"``; Choquette-Choo et al. 2023
    ``kind="banded"``, ``bands``) for n = ``num_clients`` clients, each contributing in the rounds of its turn
    (``min_separation`` b: client i trains in rounds t with (t − 1 − i) mod b = 0), without SecAgg+: the server adds
    the correlated noise to the sum of the clipped updates. Exactly one of ``target_epsilon`` (z calibrated so the T
    rounds spend it) and ``noise_multiplier``. δ defaults to 1/(10 n) (larger refused unless ``allow_large_delta``).
    Every client takes part in every round (no sampling)."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of target_epsilon and noise_multiplier")
    delta = default_client_delta(num_clients) if delta is None else delta
    if delta > max_delta(num_clients) and not allow_large_delta:
        raise ValueError(f"delta = {delta:g} is above 1/(10 n) = {max_delta(num_clients):.3g} for n = {num_clients} "
                         "clients; pass allow_large_delta=True to use it anyway")
    kwargs: dict[str, Any] = {"kind": kind, "rounds": rounds, "clip": clip, "num_clients": num_clients,
                              "delta": delta, "bands": bands, "restart_every": restart_every,
                              "min_separation": min_separation, "clients_per_round": 0, "secure_aggregation": False}
    if noise_multiplier is not None:
        return FTRLMechanism(noise_multiplier=noise_multiplier, **kwargs)
    assert target_epsilon is not None
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon = {target_epsilon} must be a finite number > 0")
    return FTRLMechanism.calibrated(target_epsilon, **kwargs)


def dp_ftrl(initial: Weights, rounds: Rounds, mechanism: FTRLMechanism, *, evaluate_fn: EvaluateFn | None = None,
            recorder: RoundRecorder | None = None) -> DPFTRLStrategy:
    """DP-FTRL (client-level, no amplification by sampling): clients (:func:`~fedapp.library.clients.ftrl_client`)
    clip their update to C; the server adds the round's row of the correlated noise C⁻¹Z to the sum and keeps the
    ledger of the one Gaussian the release is. Without SecAgg+ the server sees every clipped update: the guarantee
    holds against whoever sees the released models, not against the server. Every client every round
    (``rounds.clients_per_round`` must be 0); the noise stream draws from OS entropy."""
    if mechanism.secure_aggregation:
        raise ValueError("mechanism.secure_aggregation = True needs the project's SecAgg+ workflow; build it with "
                         "fedapp.library.ftrl_mechanism(...)")
    if rounds.clients_per_round not in (0, mechanism.num_clients):
        raise ValueError(f"rounds.clients_per_round = {rounds.clients_per_round}: DP-FTRL here runs every client "
                         "every round (0)")
    num_clients = mechanism.num_clients

    def factory(n: int) -> FTRLMechanism:
        if n != num_clients:
            raise ValueError(f"{n} clients connected; the DP-FTRL mechanism is planned for n = {num_clients}")
        return mechanism

    return DPFTRLStrategy(ftrl_factory=factory, noise_seed=None, clip=mechanism.clip, secure_aggregation=False,
                          **_engine(initial, rounds, evaluate_fn, recorder, "rdp"))


def soteriafl(initial: Weights, rounds: Rounds, settings: SoteriaFLSettings, *,
              evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None) -> SoteriaFLStrategy:
    """SoteriaFL (Li et al., NeurIPS 2022) and its baselines (``settings.method``): each client
    (:func:`~fedapp.library.clients.soteriafl_client`) sends its noisy, clipped gradient estimator, shift-compressed
    by random-k; the server decodes, steps x ← x − η v and keeps the shift. Record-level local DP (each client's
    (ε_i, δ_i) against the server); the server charges each client from its declared σ_p, b and m.
    ``rounds.server_lr`` must be 1 (the step is ``settings.eta``)."""
    weights = get_weights(initial) if isinstance(initial, nn.Module) else [np.asarray(w) for w in initial]
    d = int(sum(np.asarray(w).size for w in weights))
    k, _, gamma = soteriafl_params(SoteriaFLConfig(soteriafl_k=settings.k, soteriafl_gamma=settings.gamma), d)
    return SoteriaFLStrategy(method=get_method(settings.method), eta=settings.eta, k=k, gamma=gamma,
                             clip=settings.clip_norm, **_engine(weights, rounds, evaluate_fn, recorder,
                                                                 settings.accountant))


def dp2_fedsam(initial: nn.Module, rounds: Rounds, mechanism: ClientLevelDP, settings: DP2FedSAMSettings, *,
               evaluate_fn: EvaluateFn | None = None, recorder: RoundRecorder | None = None) -> DP2FedSAMStrategy:
    """The DP2-FedSAM family (``settings.variant``): client-level DP on the shared part. Personalized variants
    (``dp2-fedsam``, ``centaur``) hold only the body φ, your model's parameters outside ``settings.head``; each client
    (:func:`~fedapp.library.clients.dp2_fedsam_client`) keeps its head h_i. The mechanism, sampling and ledger are
    :func:`dp_fedavg`'s, without SecAgg+. A personalized variant has no global head to evaluate: ``evaluate_fn`` must
    be None (its accuracy is the clients' federated evaluation with their own heads)."""
    variant = get_variant(settings.variant)
    if not isinstance(initial, nn.Module):
        raise ModelProblem("dp2_fedsam needs your nn.Module as initial (its parameter names define the head)")
    try:
        mask = shared_mask(initial, settings.head, variant.personalized)
    except ValueError as exc:
        raise ModelProblem(f"head = {settings.head!r}: {exc}") from None
    if variant.personalized and evaluate_fn is not None:
        raise ValueError(f"variant {settings.variant!r} keeps a personal head on every client: the server has no "
                         "full model to evaluate; pass evaluate_fn=None")
    if mechanism.secure_aggregation:
        raise ValueError("dp2_fedsam runs without SecAgg+ in this library: build the mechanism with "
                         "client_level_mechanism(..., secure_aggregation=False)")
    factory = _client_level_factory(rounds, mechanism)
    engine = _engine(initial, rounds, evaluate_fn, recorder, mechanism.accountant)
    engine["initial_weights"] = [w for w, shared in zip(engine["initial_weights"], mask) if shared]
    return DP2FedSAMStrategy(name=settings.variant, eval_every=settings.eval_every, mechanism_factory=factory,
                             clip=mechanism.clip, secure_aggregation=False, **engine)


def central_evaluation(model: nn.Module, test: UserData, *, loss: Loss | None = None, batch_size: int = 256,
                       device: str = "cpu") -> EvaluateFn:
    """The server's evaluation of the global weights on held-out ``test`` data: (mean loss, {"accuracy": ...}) with
    ``loss`` (None: cross-entropy); accuracy when the model's outputs are class scores and the labels integers."""
    data = as_array_dataset(test, "test")
    torch_device = resolve_device(device)

    def evaluate(weights: list[np.ndarray]) -> tuple[float, dict[str, Any]]:
        set_weights(model, weights)
        mean_loss, accuracy = evaluate_user_model(model, data, loss, batch_size, torch_device)
        return mean_loss, ({} if accuracy is None else {"accuracy": accuracy})

    return evaluate


class JsonRecorder:
    """A :class:`~strategies.server.records.RoundRecorder` writing ``rounds.jsonl`` (one record per round: metrics
    and every client's status, the server's ε for it and any reason) and, after the last round, ``summary.json`` into ``folder``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.rounds: list[dict[str, Any]] = []

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "rounds.jsonl").write_text("", encoding="utf-8")

    def write_round(self, record: dict[str, Any]) -> None:
        self.rounds.append(record)
        with (self.folder / "rounds.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def finish(self) -> None:
        (self.folder / "summary.json").write_text(json.dumps(self.summary(), indent=2), encoding="utf-8")

    def summary(self) -> dict[str, Any]:
        """Rounds completed, the last round's metrics and, per client id, the largest ε the server's own ledger
        charged it (composed from the mechanism each reply declared, never the client's claim)."""
        spent: dict[str, float] = {}
        for record in self.rounds:
            for client in record.get("clients", []):
                eps = client.get("epsilon_spent")
                if isinstance(eps, (int, float)) and client.get("client_id") is not None:
                    key = str(client["client_id"])
                    spent[key] = max(spent.get(key, 0.0), float(eps))
        last = self.rounds[-1] if self.rounds else {}
        return {"rounds_completed": len(self.rounds), "final_metrics": last.get("metrics", {}),
                "epsilon_spent_by_client": spent}


__all__ = ["JsonRecorder", "SecureClientLevelStrategy", "central_evaluation", "client_level_mechanism", "dp2_fedsam",
           "dp_fedavg", "dp_ftrl", "dpsgd_fedavg", "fed_smp", "fedavg", "ftrl_mechanism", "min_eps", "pfa",
           "public_update", "robust_hdp", "run_secure_aggregation", "secagg_client_dp", "secure_sum", "soteriafl",
           "sparse_fedavg", "weiavg"]
