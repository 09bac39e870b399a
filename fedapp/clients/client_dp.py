"""Client-level DP client (DP-FedAvg, Fed-SMP Alg. 1–2; reusable by DP2-FedSAM).

What it protects: the whole local dataset of this client (client-level DP). Each round the
client runs τ local momentum-SGD steps from the global model θ (momentum reset every round,
η decayed per round, Fed-SMP Sec. 6.2), forms Δ = θ_local − θ, then

* dense (``dp-fedavg``): clips Δ to C and adds N(0, C²σ²/r) (Alg. 1 lines 21–22);
* sparse (``fed-smp-*``): DP-spar with the round's server mask (Alg. 2 lines 44–51) and sends
  only the k masked values (``strategies.fed_smp.encode_sparse``);
* non-private (``fedavg-randk/topk``): the same sparsify + clip, no noise.

With adaptive clipping (dp-fedavg, fed-smp-randk/topk, ``adaptive-clip-quantile`` > 0; Andrew et al. 2021, Alg. 1 /
Thm 1) the clip is the server's C_t (for Fed-SMP: of the sparsified vector DP-spar clips, so b_i is that vector's
norm against C_t, not the full Δ's), the noise z_Δ·C_t/√r with z_Δ from this client's run-config (:func:`adaptive_round`), and the
client also releases its noised count share b_i − ½ + N(0, σ_b²/r): as a metric without SecAgg+; under SecAgg+
(``secagg-mechanism = 'gaussian'`` only) never as a metric, but scaled as one extra coordinate of the vector it
masks (:func:`secure_count_coordinate`), so the server learns only the survivors' sum. That holds against an
honest-but-curious server that follows the protocol (as SecAgg+'s ``epsilon_vs_server`` does); a server that sends
different C_t to different clients is not covered: the other clients' noise, scaled by their smaller C_j, then hides
little of a target sent a large C_t.

The noise is sized so that the *sum* over the r_t clients sampled this round (``dp-round-clients``)
carries σC; see ``strategies/client_level.py`` for the threat model and the server's ledger. σ comes
from ``fedapp.privacy.profiles.client_level_mechanism`` — the same function the server uses — and a
client refuses to train in a round whose ε would exceed the planned budget ε(T).

Reuse (DP2-FedSAM): subclass :class:`ClientLevelDPClient` and override :meth:`local_train`
(e.g. a SAM optimizer); clipping, noise, masks, budget refusal and metrics stay here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, Context
from torch import nn

from fedapp.clients.broken_mechanism import noise_scale_fault
from fedapp.clients.client_level_guard import (
    ClientFloors,
    accounted_rounds,
    floor_refusal,
    record_release,
    releases,
    round_clients,
)
from fedapp.clients.common import (
    ClientSetup,
    evaluate_on_local_test,
    noise_rng,
    nonfinite_model_refusal,
    read_record,
    restart_if_diverged,
    round_lr,
    round_seed,
    write_record,
)
from fedapp.clients.training import LocalTraining, TrainResult, get_weights, local_train, set_weights
from fedapp.config import ClientDPConfig, ConfigError, TrainingConfig
from fedapp.privacy.profiles import (
    adaptive_clip_config,
    client_level_mechanism,
    ftrl_mechanism,
    secure_sum_mechanism,
    steps_per_epoch,
)
from fedapp.privacy.secure_aggregation import OUTSIDE_SECAGG, SECAGG_BITS, outside_secagg
from strategies.aggregate import flatten, unflatten
from strategies.client_level import CFG_CLIP, CFG_ROTATION_SEED, CFG_SIGMA, METRIC_UNCLIPPED_SHARE
from strategies.compression import encode_sparse
from strategies.dp_ftrl import advance_to
from strategies.fed_smp import dp_dense, dp_spar, mask_from_config
from strategies.privacy.adaptive_clipping import (
    AdaptiveClipConfig,
    count_share_scale,
    noisy_centred_bit,
    round_mechanism,
    secagg_update_range,
    update_noise_multiplier,
)
from strategies.privacy.budget import budget_refusal
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ftrl_accounting import in_turn
from strategies.privacy.mechanisms import ClientLevelDP, cached_epsilon


def discrete_share(ddg: DistributedDiscreteGaussian, clipped: np.ndarray, config: dict[str, Any], round_clients: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """The wire payload of a clipped vector under the distributed discrete Gaussian: its residues modulo 2^b, rotated
    with the round's public seed; ``ValueError`` when the server sent no seed."""
    if CFG_ROTATION_SEED not in config:
        raise ValueError(f"the round's fit config has no {CFG_ROTATION_SEED!r} for the discrete Gaussian")
    return [ddg.encode(clipped, int(config[CFG_ROTATION_SEED]), rng, round_clients=round_clients)]


def adaptive_round(dp: ClientLevelDP, adaptive: AdaptiveClipConfig, config: dict[str, Any],
                   secagg_mechanism: str = "gaussian") -> tuple[ClientLevelDP | None, str | None]:
    """(the mechanism this client's update carries this round, or None with the reason it refuses). The clip C_t is
    the server's (``dp-clip-norm``, refused unless a finite number > 0; under SecAgg+ only with continuous Gaussian
    shares); the multiplier is z_Δ, derived here from the run-config's z and σ_b, never from the server, and checked
    to compose with the count share back to z (Andrew et al. 2021, Thm 1), the multiplier the budget is charged for."""
    if dp.secure_aggregation and secagg_mechanism != "gaussian":
        return None, (f"adaptive clipping under secagg-mechanism = {secagg_mechanism!r} is not supported (only "
                      "'gaussian': the discrete Gaussian's bound does not cover a count coordinate)")
    raw = config.get(CFG_CLIP)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and raw > 0):
        return None, f"server sent adaptive clip {CFG_CLIP!r} = {raw!r}; it must be a finite number > 0"
    z_delta = update_noise_multiplier(dp.noise_multiplier, adaptive.count_noise_std)
    composed = (z_delta**-2 + (2.0 * adaptive.count_noise_std) ** -2) ** -0.5
    if not math.isclose(composed, dp.noise_multiplier, rel_tol=1e-9):
        return None, f"update multiplier {z_delta} and count noise {adaptive.count_noise_std} compose to {composed}, " \
                     f"not the budget's z = {dp.noise_multiplier}"
    return round_mechanism(dp, float(raw), z_delta), None


def secure_count_coordinate(norm: float, noise_dp: ClientLevelDP, adaptive: AdaptiveClipConfig,
                            config: dict[str, Any], noise_clients: int, rng: np.random.Generator) -> float:
    """The count coordinate this client appends to its SecAgg+ vector: count_share_scale · (b_i − ½ + N(0, σ_b²/r)),
    b_i = 1[``norm`` ≤ C_t], C_t = ``noise_dp.clip``. The noise is sized for ``noise_clients`` (its own r_t, capped
    by ``min-round-clients``) as its update's; the scale uses the server's r_t of the fit config, the same for every
    client and for the server (:func:`~strategies.privacy.adaptive_clipping.count_share_scale`), so the sum decodes."""
    share = noisy_centred_bit(norm, noise_dp.clip, adaptive.count_noise_std / math.sqrt(noise_clients), rng)
    r_cfg = round_clients(config, noise_dp)
    scale = count_share_scale(secagg_update_range(noise_dp.clip, noise_dp.noise_std(r_cfg)),
                              adaptive.count_noise_std / math.sqrt(r_cfg))
    return scale * share


def adaptive_setup(dp: ClientLevelDP, client_dp: ClientDPConfig, config: dict[str, Any], metrics: dict[str, Any]
                   ) -> tuple[ClientLevelDP | None, AdaptiveClipConfig | None, str | None]:
    """(the mechanism this round's update carries, the run's adaptive clipping or None, why the client refuses or
    None) for a client-level client whose run-config may ask for adaptive clipping (Andrew et al. 2021): ``dp``
    unchanged for a fixed clip, else the server's C_t with z_Δ (:func:`adaptive_round`), recorded in ``metrics``."""
    try:
        adaptive = adaptive_clip_config(client_dp, dp)
    except ConfigError as exc:
        return dp, None, str(exc)
    if adaptive is None:
        return dp, None, None
    noise_dp, reason = adaptive_round(dp, adaptive, config, client_dp.secagg_mechanism)
    if noise_dp is not None:
        metrics.update(clip_norm=noise_dp.clip, update_noise_multiplier=noise_dp.noise_multiplier)
    return noise_dp, adaptive, reason


def release_count_share(arrays: list[np.ndarray], metrics: dict[str, Any], norm: float, noise_dp: ClientLevelDP,
                        adaptive: AdaptiveClipConfig, config: dict[str, Any], floors: ClientFloors | None,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """Release this client's share of adaptive clipping's noisy count (Andrew et al. 2021, Alg. 1), b_i − ½ + noise
    with b_i = 1[``norm`` ≤ C_t], C_t = ``noise_dp.clip``; returns the arrays to send.

    ``norm`` must be the pre-clip norm of exactly the vector the round clips at C_t and noises (dense Δ for
    dp-fedavg, the sparsified and, for rand_k, d/k-scaled k values for Fed-SMP, the shared part Δφ for the
    DP2-FedSAM family): the bit is then the one Thm 1's noise split covers (sensitivity ½ per client). Under SecAgg+
    the share, σ_b/√r_t as the update's z_Δ C_t/√r_t, is appended as one extra coordinate of the secure sum
    (:func:`secure_count_coordinate`) and never reported; without it the share, σ_b/√r as the update's z_Δ C_t/√r,
    is the metric ``unclipped_share``."""
    if noise_dp.secure_aggregation:
        r_t = round_clients(config, noise_dp, floors)
        count = secure_count_coordinate(float(norm), noise_dp, adaptive, config, r_t, rng)
        return [*arrays, np.array([count], dtype=np.float64)]
    share_std = adaptive.count_noise_std / math.sqrt(noise_dp.clients_per_round)
    metrics[METRIC_UNCLIPPED_SHARE] = noisy_centred_bit(float(norm), noise_dp.clip, share_std, rng)
    return arrays


def local_steps(client_dp: ClientDPConfig, training: TrainingConfig, num_examples: int, batch_size: int) -> int:
    """τ: ``local-steps`` if set, else ``local-epochs`` · ⌈N/b⌉."""
    return client_dp.local_steps or training.local_epochs * steps_per_epoch(num_examples, batch_size)


class ClientLevelDPClient(NumPyClient):
    """Local training + client-level clip/noise (+ optional Fed-SMP mask) for one client."""

    #: whether this client runs adaptive clipping when the run-config asks for it (its privatize clips at dp.clip)
    adaptive_clipping: bool = True
    #: an audit canary's unit direction u, or zero (:mod:`fedapp.privacy.audit`): the client then sends C·u through
    #: the mechanism (sampling, clipping, its noise share, SecAgg+) instead of training, and evaluates nothing
    canary: np.ndarray | None = None

    def __init__(self, setup: ClientSetup, client_dp: ClientDPConfig, context: Context | None = None,
                 private: bool = True) -> None:
        self.s = setup
        self.client_dp = client_dp  # the run-config's client-level DP section
        self.context = context
        self.private = private

    # ---- privacy ---------------------------------------------------------------------
    def mechanism(self) -> ClientLevelDP | None:
        """The run's client-level mechanism (None for the non-private baselines)."""
        if not self.private:
            return None
        return client_level_mechanism(self.s.general, self.s.training, self.client_dp, self.s.profile.num_clients)

    def node_config(self) -> dict:
        """This node's node-config (empty without a Context)."""
        return dict(self.context.node_config) if self.context is not None else {}

    @property
    def floors(self) -> ClientFloors:
        return ClientFloors.from_node_config(self.context.node_config if self.context is not None else {})

    def budget_check(self, dp: ClientLevelDP, server_round: int) -> tuple[float, str | None]:
        """(ε after this round, refusal reason or None). Budget = ε(T) of the planned ``dp-rounds``; the round
        is charged as round max(server round, own releases + 1) (:func:`accounted_rounds`)."""
        budget = cached_epsilon(dp, None)
        released = releases(self.context)
        rounds = accounted_rounds(server_round, released)
        eps_next = cached_epsilon(dp, rounds)
        if rounds > dp.rounds:
            return eps_next, (f"budget: this would be round {rounds} (server round {server_round}, {released} updates "
                              f"released), past dp-rounds={dp.rounds}, the rounds ε was planned for")
        return eps_next, budget_refusal(rounds, eps_next, budget, f"client-level, planned for dp-rounds={dp.rounds}")

    # ---- hooks -----------------------------------------------------------------------
    def local_steps(self) -> int:
        return local_steps(self.client_dp, self.s.training, len(self.s.train), self.s.profile.batch_size)

    def local_train(self, model: nn.Module, *, lr: float, seed: int, config: dict[str, Any]) -> TrainResult:
        """*hook*: τ local steps in place on ``model`` (an audit canary: θ + C·u, no data read)."""
        if self.canary is not None:
            weights = get_weights(model)
            moved = flatten(weights) + float(self.s.training.clip_norm) * self.canary
            set_weights(model, unflatten(moved, [tuple(w.shape) for w in weights]))
            return TrainResult(steps=0, loss=float("nan"), seconds=0.0)
        spec = LocalTraining(batch_size=self.s.profile.batch_size, steps=self.local_steps(), lr=lr,
                             momentum=float(self.s.training.momentum), seed=seed)
        return local_train(model, self.s.train, spec, self.s.device)

    def privatize(self, update: np.ndarray, shapes: list[tuple[int, ...]], config: dict[str, Any],
                  dp: ClientLevelDP | None, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
        """*hook*: Δ (flat) → wire arrays + metrics. Dense per-layer arrays, or the k masked values."""
        sparsifier, indices = mask_from_config(config, update.size)
        clip = dp.clip if dp is not None else float(self.s.training.clip_norm)
        r_t = round_clients(config, dp, self.floors) if dp is not None else None
        ddg = secure_sum_mechanism(self.client_dp, dp, update.size if indices is None else len(indices)) \
            if dp is not None else None
        if ddg is not None:  # clip here; the discrete Gaussian share replaces the continuous noise
            assert r_t is not None
            if indices is None:
                clipped, norm = dp_dense(update, clip=clip, dp=None, rng=rng)
            else:
                clipped, norm = dp_spar(update, indices, sparsifier, clip=clip, dp=None, rng=rng)
            return discrete_share(ddg, clipped, config, r_t, rng), {"update_norm": norm, "k": len(clipped),
                                                                    SECAGG_BITS: ddg.bits}
        scale = noise_scale_fault()
        if dp is not None and scale != 1.0:  # a test's deliberately broken mechanism (fedapp.clients.broken_mechanism)
            dp = dataclasses.replace(dp, noise_multiplier=dp.noise_multiplier * scale)
        if indices is None:
            noisy, norm = dp_dense(update, clip=clip, dp=dp, rng=rng, round_clients=r_t)
            return unflatten(noisy, shapes), {"update_norm": norm, "k": update.size}
        values, norm = dp_spar(update, indices, sparsifier, clip=clip, dp=dp, rng=rng, round_clients=r_t)
        return encode_sparse(values), {"update_norm": norm, "k": len(indices)}

    # ---- Flower API ------------------------------------------------------------------
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return get_weights(self.s.new_model())

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        p, training = self.s.profile, self.s.training
        server_round = int(config["server-round"])
        metrics: dict[str, Any] = {"client_id": p.client_id, "batch_size": p.batch_size, "num_train": len(self.s.train)}
        dp = self.mechanism()
        noise_dp, adaptive = dp, None  # the mechanism the update carries (under adaptive clipping: C_t, z_Δ)
        if dp is not None and self.client_dp.secure_aggregation and outside_secagg(self.context):
            return [], 0, {**metrics, "status": "refused", "reason": OUTSIDE_SECAGG}
        if dp is not None:
            eps_next, reason = self.budget_check(dp, server_round)
            metrics.update({"noise_multiplier": dp.noise_multiplier, "sample_rate": dp.sample_rate, "delta": dp.delta,
                            "epsilon_budget": cached_epsilon(dp, None), "steps": server_round})
            if CFG_SIGMA in config and not math.isclose(float(config[CFG_SIGMA]), dp.noise_multiplier, rel_tol=1e-9):
                reason = (f"server asks for noise multiplier {config[CFG_SIGMA]} but this client's run-config "
                          f"gives {dp.noise_multiplier}")
            reason = reason or floor_refusal(dp, self.floors)
            if reason is None and self.adaptive_clipping:
                noise_dp, adaptive, reason = adaptive_setup(dp, self.client_dp, config, metrics)
            if reason is not None:
                metrics.update({"status": "refused", "reason": reason,
                                "epsilon_spent": cached_epsilon(dp, min(server_round - 1, dp.rounds))})
                return [], 0, metrics
            metrics["epsilon_spent"] = eps_next
        if p.batch_size > len(self.s.train):
            return [], 0, {**metrics, "status": "refused",
                           "reason": f"batch-size {p.batch_size} > local dataset size {len(self.s.train)}"}
        reason = nonfinite_model_refusal(parameters)
        if reason is not None:  # before any state changes (an FTRL turn, a stream, a release)
            metrics.pop("epsilon_spent", None)
            return [], 0, {**metrics, "status": "refused", "reason": reason}
        model = self.s.new_model()
        set_weights(model, parameters)
        lr = round_lr(training.lr, training.lr_decay, server_round)
        result = self.local_train(model, lr=lr, seed=round_seed(self.s.general.seed, p.client_id, server_round, stream=411),
                                  config=config)
        update = flatten(get_weights(model)) - flatten(parameters)
        if dp is not None:
            update, _ = restart_if_diverged(update, p.client_id, server_round)
        elif not np.all(np.isfinite(update)):  # no DP here: the failure may be reported as it is
            return [], 0, {**metrics, "status": "failed", "reason": "local training diverged (non-finite update)"}
        rng = noise_rng(self.s.general, p.client_id, server_round, self.node_config())  # secret unless seeded-noise
        try:
            arrays, extra = self.privatize(update, [tuple(a.shape) for a in parameters], config, noise_dp, rng)
        except (KeyError, ValueError) as exc:  # malformed mask from the server: send nothing
            return [], 0, {**metrics, "status": "refused", "reason": f"bad round config from server: {exc}"}
        metrics.update({"status": "ok", "train_seconds": result.seconds, "lr": lr, "steps_round": result.steps, **extra})
        if adaptive is not None and noise_dp is not None:
            # the bit of the norm privatize clipped at C_t: the dense Δ, or Fed-SMP's sparsified (rand_k: d/k-scaled)
            # k values, whose norm can fall on the other side of C_t than the full Δ's
            arrays = release_count_share(arrays, metrics, float(extra["update_norm"]), noise_dp, adaptive, config,
                                         self.floors, rng)
        if dp is None:  # non-private baselines only: loss and pre-clip norm of private data are not covered by DP
            metrics["train_loss"] = result.loss
        else:
            metrics.pop("update_norm", None)
            record_release(self.context)
        # under secure aggregation every update has weight 1: the secure sum is Σ Δ_i (and N_i stays private)
        return arrays, 1 if dp is not None and self.client_dp.secure_aggregation else len(self.s.train), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        if self.canary is not None:  # a canary has no data: it never counts in utility metrics
            return 0.0, 0, {"client_id": self.s.profile.client_id, "audit_canary": True}
        return evaluate_on_local_test(self.s, parameters)


#: Context.state records of a client's DP-FTRL noise stream (kept at their newest value on resume: never rewound)
FTRL_STREAM = "ftrl-stream"
FTRL_STREAM_MEMORY = "ftrl-stream-memory"
#: the last server round in which this DP-FTRL client's data entered a sum (a turn is never taken twice)
FTRL_TURN = "ftrl-turn"


class FTRLClient(ClientLevelDPClient):
    """DP-FTRL client (``dp-ftrl``, :mod:`strategies.dp_ftrl`): clips Δ to C; under SecAgg+ it adds w_{i,t} =
    (C⁻¹Z_i)_t from its own stream (entries of Z_i with std zC/√n, secret randomness), indexed by the server round
    and kept in ``Context.state`` so its position survives between rounds; a round already drawn is refused (its
    noise is never reused), and so is every round after the first once the stream is missing from its state: it drops
    out (the server leaves it out of P) instead of restarting the stream. Without SecAgg+ it sends the clipped update
    only: the server adds the noise.

    Its data enters only the rounds of its turn (``ftrl-min-separation`` b: (t − 1 − i) mod b = 0, every round for
    b = 1), each once and in increasing order: a round of its turn not later than the last it trained in is refused,
    whatever the server asks. Outside its turn it trains nothing and sends a zero update (plus its stream's share
    under SecAgg+), so the accountant's pattern (≤ ⌈T/b⌉ contributions, b apart) holds by the client's own doing."""

    adaptive_clipping = False

    def mechanism(self):  # an FTRLMechanism: duck-typed where the parent reads σ, q, δ and ε
        return ftrl_mechanism(self.s.general, self.s.training, self.client_dp, self.s.profile.num_clients)

    def takes_turn(self, server_round: int) -> bool:
        return in_turn(self.s.profile.client_id, server_round, self.client_dp.ftrl_min_separation)

    def local_train(self, model: nn.Module, *, lr: float, seed: int, config: dict[str, Any]) -> TrainResult:
        """Train only in a round of this client's turn, recorded before training (a turn is spent once asked)."""
        server_round = int(config["server-round"])
        if not self.takes_turn(server_round):
            return TrainResult(0, float("nan"), 0.0)  # the model stays the global one: Δ = 0 exactly
        if self.context is not None:
            write_record(self.context, FTRL_TURN, {"round": server_round})
        return super().local_train(model, lr=lr, seed=seed, config=config)

    def budget_check(self, dp, server_round: int) -> tuple[float, str | None]:
        """Refuse past the T rounds C was built for, a round whose noise this client already drew, and under SecAgg+
        every round after the first once its stream is lost (:meth:`stream_lost`)."""
        rounds = accounted_rounds(server_round, releases(self.context))
        if rounds > dp.rounds:
            return dp.epsilon(), (f"budget: this would be round {rounds} (server round {server_round}), past "
                                  f"dp-rounds={dp.rounds}, the rounds DP-FTRL's factorization was built for")
        if dp.secure_aggregation and self.stream_lost(server_round):
            return dp.epsilon(rounds), (f"server round {server_round}: this client's noise stream is lost (no "
                                        f"{FTRL_STREAM!r} in its state); a restarted stream would not be the one "
                                        "the released sums carry, so it drops out of the run")
        drawn = int(read_record(self.context, FTRL_STREAM).get("round", 0)) if self.context is not None else 0
        if dp.secure_aggregation and server_round - 1 < drawn:
            return dp.epsilon(rounds), (f"server round {server_round}: this client's noise stream already drew round "
                                        f"{drawn}; its noise is never reused")
        last = int(read_record(self.context, FTRL_TURN).get("round", 0)) if self.context is not None else 0
        if self.takes_turn(server_round) and server_round <= last:
            return dp.epsilon(rounds), (f"server round {server_round}: this client's data already entered round "
                                        f"{last}; each round of its turn (ftrl-min-separation = "
                                        f"{self.client_dp.ftrl_min_separation}) is taken once, in increasing order")
        return dp.epsilon(rounds), None

    def privatize(self, update, shapes, config, dp, rng):
        clipped, norm = dp_dense(update, clip=float(self.s.training.clip_norm), dp=None, rng=rng)
        if dp is not None and dp.secure_aggregation:
            stream = self._load_stream(dp, clipped.size, int(config["server-round"]))
            clipped = clipped + advance_to(stream, int(config["server-round"]) - 1)
            self._save_stream(stream)
        return unflatten(clipped, shapes), {"update_norm": norm, "k": update.size,
                                            "in_turn": self.takes_turn(int(config["server-round"]))}

    def stream_lost(self, server_round: int) -> bool:
        """Whether this client's stream should exist and does not: after round 1 every client of a SecAgg+ run has
        drawn its stream in each round it took part in (its turn or not). A client without it sat out round 1 or lost
        its state; either way its stream did not reach every released sum, so it is not among the clients P the
        accountant counts (:mod:`strategies.dp_ftrl`), and it drops out rather than send a restarted stream."""
        return server_round > 1 and (self.context is None or FTRL_STREAM not in self.context.state)

    def _load_stream(self, dp, dim: int, server_round: int):
        if self.stream_lost(server_round):  # budget_check refuses first; never start a stream after round 1
            raise RuntimeError(f"server round {server_round}: this client's DP-FTRL noise stream is lost")
        stream = dp.noise_stream(dim, noise_rng(self.s.general, self.s.profile.client_id, 0, self.node_config()))
        if self.context is None or FTRL_STREAM not in self.context.state:
            return stream
        saved = read_record(self.context, FTRL_STREAM)
        record = self.context.state[FTRL_STREAM_MEMORY]
        if not isinstance(record, ArrayRecord):
            raise RuntimeError(f"Context.state {FTRL_STREAM_MEMORY!r} is not the stream's memory")
        stream.load_state_dict({"round": int(saved["round"]), "memory": record["memory"].numpy(),
                                "rng": json.loads(saved["rng"], object_hook=_array_from_json)})
        return stream

    def _save_stream(self, stream) -> None:
        if self.context is None:
            raise RuntimeError("a DP-FTRL client under SecAgg+ needs its Context to keep its noise stream")
        state = stream.state_dict()
        self.context.state[FTRL_STREAM_MEMORY] = ArrayRecord({"memory": Array(np.ascontiguousarray(state["memory"]))})
        write_record(self.context, FTRL_STREAM, {"round": int(state["round"]),
                                                 "rng": json.dumps(state["rng"], default=_array_to_json)})


def _array_to_json(value: object) -> dict:
    """A bit generator's state array as JSON (ChaCha's key, block and counter; PCG64's state is plain ints)."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _array_from_json(obj: dict) -> object:
    return np.asarray(obj["__ndarray__"], dtype=obj["dtype"]) if "__ndarray__" in obj else obj
