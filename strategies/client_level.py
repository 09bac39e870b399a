"""Server side of client-level DP (DP-FedAvg, Fed-SMP, DP2-FedSAM and their baselines).

The mechanism (:class:`~strategies.privacy.mechanisms.ClientLevelDP`): each sampled client clips its
update to C and adds Gaussian noise. With secure aggregation (Flower SecAgg+, ``fedapp.privacy.secure_aggregation``)
the server sees only the sum: each client adds N(0, C²σ²/r_t), r_t the round's sampled count (sent as
``dp-round-clients``; a client never uses more than its own floor ``min-round-clients``), so the sum carries
σC. Without it the server sees every update: each client adds the fixed N(0, C²σ²/r), one update carries
multiplier σ/√r, and the budget (σ calibrated for it) is that individual ε.

With ``secagg-mechanism = 'ddg'`` (the default under SecAgg+) the shares are distributed discrete Gaussian
(:class:`~strategies.privacy.discrete_gaussian.DistributedDiscreteGaussian`): each client sends its rotated, scaled,
conditionally rounded update plus discrete Gaussian noise modulo 2^b, the server decodes the residue of the sum
(:meth:`~strategies.server.secure_sum.SecureSumAdapter.decode_ddg`), and each round is charged as a Gaussian of its equivalent
multiplier 1/(a + τ√d) (Kairouz et al., Prop. 14: an upper bound of its RDP at every order, so the RDP ledger never
claims less than the mechanism gives), unamplified for every view.

Adaptive clipping (``adaptive-clip-quantile`` > 0: dp-fedavg, fed-smp-randk/topk and the DP2-FedSAM family, each
counting the bit of the vector it clips; not dp-ftrl; Andrew et al. 2021, Alg. 1): the server holds C_t,
sends it in the fit config (``dp-clip-norm``) and sets C_{t+1} = C_t · exp(−η_C (b̄_t − γ)) from the clients' count
shares b_i − ½ + N(0, σ_b²/r) (:meth:`~strategies.server.adaptive_clip.ServerClip.adapt`). Each update carries z_Δ·C_t with
z_Δ⁻² = z⁻² − (2σ_b)⁻², so update and share together are one Gaussian at the run's z (Thm 1), charged as such.
Without SecAgg+ each share is a metric (r the expected clients, b̄ = Σ/r + ½). Under SecAgg+ with continuous Gaussian
shares (``secagg-mechanism = 'gaussian'``) no share is sent in the clear: each client adds N(0, σ_b²/r_t) to its
centred bit and appends it, times :func:`~strategies.privacy.adaptive_clipping.count_share_scale`, as coordinate d+1
of the vector it masks; the server splits that coordinate off the decoded sum and sets b̄ = Σ/r' + ½ over the r'
survivors (:meth:`~strategies.server.secure_sum.SecureSumAdapter.split_count`). Threat model: against an honest-but-curious server that
follows the protocol — the assumption SecAgg+'s ``epsilon_vs_server`` already rests on — it learns only the noisy sum
of bits and the budget z holds against it. A server that sends different C_t to different clients is NOT covered: a
large C_t to one target leaves the other clients' noise, scaled by their smaller C_j, small next to the target's
sensitivity. The distributed discrete Gaussian (``ddg``) is refused with adaptive clipping: its RDP bound covers the
rotated update alone, not a count coordinate inside the rotation.

Sampling: every registered client independently with q = r/n (Poisson, secret randomness), fixed for the
run; an unavailable or excluded client counts as sampled and dropped, so the realized rate never exceeds
the accounted one.

Whom the budget holds against (``adversary``): the server that draws the sample (default: no
amplification, every round charged at q = 1, which bounds every client's ``epsilon_vs_server``), or
observers of the release (amplified at q = r/n, the papers' accounting).

Accounting is the server's own (:class:`~strategies.privacy.ledger.PrivacyLedger`): each round is charged
with the noise the server actually saw — σ·√(r'/r_t) when r' of the r_t sampled updates were summed — so
dropouts never lower the noise silently, and a resume that recalibrates σ is composed exactly. Under
SecAgg+ the budget is checked before the sum is reconstructed (:meth:`ClientLevelDPStrategy.unmask_refusal`);
a round it cannot pay for is never unmasked, and every reconstructed sum is charged. Once a planned round no
longer fits, nobody is sampled. Round records carry

* ``epsilon`` — the headline the budget is for (against ``adversary``; the aggregate's multiplier with secure
  aggregation, one update's without);
* ``epsilon_aggregate`` / ``epsilon_individual`` — both multipliers at the accounted q;
* ``epsilon_vs_release`` (round) — the released sum's ε, amplified by secret sampling at q = r/n;
* ``epsilon_vs_server`` (per client record) — against the server: one unamplified Gaussian per round the
  client's update reached it, at the multiplier it saw, composed over the rounds the client took part in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import FitRes, Parameters, Scalar, log
from flwr.server.client_proxy import ClientProxy

from strategies.aggregate import unflatten, weighted_sum
from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate, Reply
from strategies.errors import ConfigError
from strategies.privacy import threat_models
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig, count_share_scale, secagg_update_range
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.mechanisms import ClientLevelDP, noisy_norm_bound
from strategies.server.adaptive_clip import METRIC_UNCLIPPED_SHARE, ServerClip, checked_clip, server_clip
from strategies.server.client_accounting import ClientLevelAccounting
from strategies.server.records import AGGREGATE_PHASE, FIT_PHASE
from strategies.server.secure_sum import MIN_SECURE_SURVIVORS, SecureSumAdapter, check_cohort

__all__ = ["CFG_CLIP", "CFG_ROTATION_SEED", "CFG_ROUND_CLIENTS", "CFG_SIGMA", "METRIC_UNCLIPPED_SHARE",
           "MIN_SECURE_SURVIVORS", "ClientLevelDPStrategy", "check_declared_multiplier", "rotation_seed",
           "uplink_metrics"]

CFG_SIGMA = "dp-noise-multiplier"  # fit-config: the mechanism's σ (clients cross-check it)
CFG_ROUND_CLIENTS = "dp-round-clients"  # fit-config: r_t, the number of clients sampled this round
CFG_ROTATION_SEED = "ddg-rotation-seed"  # fit-config: the round's public seed of the DDG's random rotation
CFG_CLIP = "dp-clip-norm"  # fit-config: the round's clip norm C_t under adaptive clipping (clients check it)

MechanismFactory = Callable[[int], ClientLevelDP]
#: (the run's client-level mechanism, the payload's length) → the distributed discrete Gaussian, or None when the
#: secure sum carries continuous Gaussian shares
SecureSumFactory = Callable[[ClientLevelDP, int], DistributedDiscreteGaussian | None]
#: the run's client-level mechanism → its adaptive clipping, or None for a fixed clip
AdaptiveClipFactory = Callable[[ClientLevelDP], AdaptiveClipConfig | None]


def rotation_seed(run_seed: int, server_round: int) -> int:
    """The public seed of a round's randomized rotation, its ±1 signs (any rotation keeps the guarantee: it preserves
    norms; it only spreads the update over the coordinates so that few bits suffice)."""
    return int(np.random.SeedSequence([int(run_seed), 503, int(server_round)]).generate_state(1)[0] & 0x7FFFFFFF)


def check_declared_multiplier(metrics: Mapping[str, Scalar], expected: float, what: str) -> None:
    """Reject a reply whose declared ``noise_multiplier`` is not ``expected`` (the client ran another mechanism)."""
    reported = metrics.get("noise_multiplier")
    if (isinstance(reported, bool) or not isinstance(reported, (int, float))
            or not math.isclose(float(reported), expected, rel_tol=1e-9)):
        raise RejectedUpdate(f"client noise multiplier {reported!r} != {what} = {expected}")


def uplink_metrics(updates: list[ClientUpdate], cumulative: int, k: int, dim: int) -> tuple[int, dict[str, Any]]:
    """(the run's uplink bytes after this round, the round record's uplink metrics) of a family sending k of the
    model's d coordinates (Fed-SMP's compression ratio k/d; 1 for the dense families)."""
    round_bytes = int(sum(u.uplink_bytes for u in updates))
    cumulative += round_bytes
    return cumulative, {"compression_ratio": k / dim, "k": k, "uplink_bytes_cumulative": cumulative,
                        "uplink_bytes_per_client": round_bytes / max(len(updates), 1)}


def drawn_round(server_round: int, chosen: list[int], secure: bool) -> tuple[list[int], dict[str, Any]]:
    """The nodes a round contacts, and its sampling metrics, from the nodes its sampler drew. Under secure aggregation a
    draw of fewer than :data:`MIN_SECURE_SURVIVORS` contacts nobody (``below_secure_minimum``): such a sum is never
    unmasked, so the round could release nothing, and what is released (nothing) is the same either way."""
    metrics: dict[str, Any] = {"clients_sampled": len(chosen)}
    if secure and 0 < len(chosen) < MIN_SECURE_SURVIVORS:
        log(WARNING, "round %d: client sampling drew %d client(s); a secure sum of fewer than %d is never unmasked, "
            "so none is contacted", server_round, len(chosen), MIN_SECURE_SURVIVORS)
        return [], {**metrics, "below_secure_minimum": True}
    return chosen, metrics


class ClientLevelDPStrategy(DPFLStrategy):
    """Client-level DP server: Poisson sampling, σ cross-check, noise-aware norm bound; composes the accounting
    (:class:`~strategies.server.client_accounting.ClientLevelAccounting`), the SecAgg+ messages (:class:`SecureSumAdapter`)
    and the adaptive clip (:class:`~strategies.server.adaptive_clip.ServerClip`)."""

    privacy = threat_models.CLIENT_LEVEL_LOCAL_NOISE
    send_ledger = False  # ε is a property of the mechanism and the round, not of a client's state

    def __init__(self, *, mechanism_factory: MechanismFactory | None = None, clip: float | None = None,
                 secure_sum_factory: SecureSumFactory | None = None, secure_aggregation: bool = False,
                 adaptive_clip_factory: AdaptiveClipFactory | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("sampling", "poisson")
        super().__init__(**kwargs)
        #: True when the server runs the fit step through SecAgg+ (every reply then carries the survivors' mean)
        self.secure_aggregation = secure_aggregation
        self.mechanism_factory = mechanism_factory
        self.secure_sum_factory = secure_sum_factory
        self.adaptive_clip_factory = adaptive_clip_factory
        self.clip = clip
        self.accounting = ClientLevelAccounting(self.ledger)  #: the mechanism, its secure sum and the four ledgers
        self.secure_sum = SecureSumAdapter()
        self.adaptive: ServerClip | None = None  #: C_t under adaptive clipping (Andrew et al. 2021); None: fixed
        self._resumed_clip: float | None = None  # a checkpoint's C_t, until the adaptive clip is built
        self.sampled: dict[int, int] = {}
        self.budget_exhausted = False

    @property
    def payload_is_shared(self) -> bool:
        return self.secure_aggregation

    @property
    def private(self) -> bool:
        return self.mechanism_factory is not None

    @property
    def dp(self) -> ClientLevelDP | None:
        """The run's client-level mechanism (None before round 1, or without DP)."""
        return self.accounting.dp

    @property
    def ddg(self) -> DistributedDiscreteGaussian | None:
        """The distributed discrete Gaussian the secure sums carry (None: continuous Gaussian shares, or no SecAgg+)."""
        return self.accounting.ddg

    @property
    def clip_t(self) -> float | None:
        """C_t, the clip of the next round under adaptive clipping (None: a fixed clip)."""
        return self.adaptive.clip if self.adaptive is not None else self._resumed_clip

    def setup_privacy(self, num_clients: int) -> None:
        """Build the mechanism for n = ``num_clients`` once (before round 1: errors stop the run early)."""
        if self.mechanism_factory is None or self.dp is not None:
            return
        dp = self.mechanism_factory(num_clients)
        self.accounting.bind(dp, None)
        self.sampler.fix_rate(dp.sample_rate)  # q = r/n of the registered clients, all run long
        if self.secure_aggregation:
            check_cohort(dp.clients_per_round)
        if self.secure_sum_factory is not None and dp.secure_aggregation:
            ddg = self.secure_sum_factory(dp, self.payload_dim())
            if ddg is not None:  # clients account the continuous plan σ, the ledger the discrete sum's z ≥ σ
                self.ledger.allow_report_slack(ddg.report_slack(dp.noise_multiplier))
                self.accounting.bind(dp, ddg)
        config = self.adaptive_clip_factory(dp) if self.adaptive_clip_factory is not None else None
        self.adaptive = server_clip(config, dp, self._resumed_clip, discrete=self.ddg is not None,
                                    sized_for_count=self.count_in_secure_sum)

    def noise_mechanism(self) -> ClientLevelDP:
        """What each update carries this round: the run's mechanism, or C_t and z_Δ under adaptive clipping."""
        assert self.dp is not None
        return self.dp if self.adaptive is None else self.adaptive.mechanism()

    @property
    def count_in_secure_sum(self) -> bool:
        """Whether each client's count share rides in the secure sum as coordinate d+1 (adaptive clipping under
        SecAgg+; known before the mechanism is built, so that every place sizing the payload agrees)."""
        return self.secure_aggregation and self.private and self.adaptive_clip_factory is not None

    def payload_dim(self) -> int:
        """*hook*: the length of the vector each client privatizes and sends (the model's parameters, dense, plus
        the count coordinate under :attr:`count_in_secure_sum`)."""
        return self.num_params + int(self.count_in_secure_sum)

    def payload_arrays(self, values: np.ndarray) -> list[np.ndarray]:
        """*hook*: a privatized vector of :meth:`payload_dim` entries as the arrays a client sends."""
        return unflatten(values, self.shapes)

    def prepare_round(self, num_available: int) -> None:
        if self.private and self.dp is None:
            self.setup_privacy(num_available)
            if self.dp is not None and self.dp.secure_aggregation != self.secure_aggregation:
                raise ConfigError(
                    f"run-config 'secure-aggregation' = {str(self.dp.secure_aggregation).lower()} but this server "
                    f"{'runs' if self.secure_aggregation else 'does not run'} SecAgg+: the budget would be claimed for "
                    "a guarantee the run does not give (in-process loops cannot run SecAgg+; set it to false there)")

    def release_denominator(self, server_round: int) -> int:
        """The released mean's divisor: the expected cohort r under sampling at q < 1 (McMahan et al. 2018's fixed
        denominator, as TFF), so its noise std σC/r hides the realised count; else the round's sampled count r_t."""
        if self.dp is not None and self.dp.sample_rate < 1:
            return self.dp.clients_per_round
        return max(self.sampled.get(server_round, 1), 1)

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """Σ_i Δ_i / :meth:`release_denominator` (Fed-SMP Alg. 1 line 10, DP2-FedSAM Alg. 2 line 25; under SecAgg+
        every reply carries the survivors' mean, so Σ_i is r' times it)."""
        total: np.ndarray = weighted_sum([u.update for u in updates], np.ones(len(updates)))
        return total / self.release_denominator(server_round)

    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        if self.dp is not None and (server_round > self.dp.rounds or self.accounting.next_round_exceeds()):
            if not self.budget_exhausted:
                log(WARNING, "round %d: the planned client-level budget epsilon=%.4f cannot pay for another "
                    "round; no client is sampled", server_round, self.dp.epsilon())
            self.budget_exhausted = True
            self.sampled[server_round] = 0
            self.round_log.add_metrics({"budget_exhausted": True})
            return []
        chosen, metrics = drawn_round(server_round, super().sample_clients(server_round, nodes), self.secure_aggregation)
        self.sampled[server_round] = metrics["clients_sampled"]
        self.round_log.add_metrics(metrics)  # also when too few to run the round
        return chosen

    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        cfg: dict[str, Scalar] = {CFG_ROUND_CLIENTS: max(self.sampled.get(server_round, 1), 1)}
        if self.dp is not None:
            cfg[CFG_SIGMA] = float(self.dp.noise_multiplier)
        if self.ddg is not None:
            cfg[CFG_ROTATION_SEED] = rotation_seed(self.seed, server_round)
        if self.adaptive is not None:
            cfg[CFG_CLIP] = float(self.adaptive.clip)
        return cfg

    def round_clients(self) -> int:
        rnd = self.round_log.round
        return max(self.sampled.get(rnd, 1), 1) if rnd is not None else 1

    def declared_norm_bound(self, dim: int) -> float | None:
        """‖Δ̂‖ ≤ C plus, when private, the norm allowance of the round's noise N(0, C²σ²/r_t) on ``dim`` coordinates."""
        if self.ddg is not None:  # discrete noise and rounding, spread over the rotated coordinates
            return noisy_norm_bound(self.ddg.clip, self.ddg.noise_std(self.round_clients()), self.ddg.rotated_dim)
        if self.dp is not None:
            noise = self.noise_mechanism()
            return noisy_norm_bound(noise.clip, noise.noise_std(self.round_clients()), dim)
        return None if self.clip is None else self.clip * (1 + 1e-5)

    def secagg_clipping_range(self) -> float:
        """Per-coordinate range of SecAgg+'s quantizer this round: C plus 12 stds of the round's noise."""
        if self.dp is None:
            return float(self.clip or 1.0)
        noise = self.noise_mechanism()
        return secagg_update_range(noise.clip, noise.noise_std(self.round_clients()))

    def count_share_scale(self) -> float:
        """The factor by which this round's count shares enter the secure sum (:func:`count_share_scale`)."""
        assert self.adaptive is not None
        return count_share_scale(self.secagg_clipping_range(), self.adaptive.count_share_std(self.round_clients()))

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        self.check_sigma(metrics)
        if self.adaptive is not None:
            self.adaptive.check_reply(metrics, self.round_clients(), share_in_sum=self.secure_aggregation)

    def check_sigma(self, metrics: Mapping[str, Scalar]) -> None:
        """Reject a reply whose declared σ is not the mechanism's (the client ran another mechanism)."""
        if self.dp is not None:
            check_declared_multiplier(metrics, self.dp.noise_multiplier, "mechanism σ")

    def privacy_charge(self, server_round: int, record: Mapping[str, Any], metrics: Mapping[str, Scalar]) -> None:
        return None  # charged to the population in population_charge

    def unmask_refusal(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> str | None:
        """Why this round's secure sum must not be reconstructed (None: unmask it), asked by the SecAgg+ workflow
        before its unmask stage: a survivor's reply is unusable (:meth:`SecureSumAdapter.unusable_survivor`) or the
        budget cannot pay for ``len(results)`` survivors. Whatever is reconstructed is charged, so this is the only
        place a round can be withheld without cost."""
        server_round = self.actual_round(server_round)
        reason = self.secure_sum.unusable_survivor(results, identity=self.identity, strikes=self.strikes,
                                                   connected=self.connected_nodes, check=self.check_survivor)
        if reason is not None or self.dp is None or not results:
            return reason
        return self.accounting.unmask_refusal(len(results), self.sampled.get(server_round, len(results)))

    def check_survivor(self, metrics: Mapping[str, Scalar]) -> None:
        """Reject a survivor's reply inside the secure sum that declares another σ or (adaptive) another C_t."""
        self.check_sigma(metrics)
        if self.adaptive is not None:
            self.adaptive.check_clip_used(metrics)

    def record_unreconstructed(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                               failures: list[Any], reason: str) -> None:
        """Record a secure round whose sum was never reconstructed: its replies, the strikes their own metrics
        earn, status ``withheld``; nothing is released and nothing is charged."""
        log(WARNING, "round %d: %s; the secure sum is not reconstructed", self.actual_round(server_round), reason)
        self.secure_sum.unreleased = reason
        try:
            self.aggregate_fit(server_round, results, failures)
        finally:
            self.secure_sum.unreleased = None

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        self.round_log.mark(FIT_PHASE)
        secure = self.secure_sum
        secure.open(results)
        with self.round_log.timed(AGGREGATE_PHASE):
            if self.secure_aggregation and results and secure.unreleased is None:
                if self.ddg is not None:
                    secure.decode_ddg(server_round, results, self.ddg, rotation_seed(self.seed, server_round),
                                      self.payload_arrays)
                if self.adaptive is not None and self.count_in_secure_sum:
                    secure.split_count(results, self.payload_dim() - 1, self.count_share_scale(), self.payload_arrays)
        return super().aggregate_fit(server_round, results, failures)

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Scalar]) -> np.ndarray:
        if (reason := self.secure_sum.rejection()) is not None:
            raise RejectedUpdate(reason)
        return super().decode_update(server_round, reply, metrics)

    def population_charge(self, server_round: int, accepted: list[ClientUpdate],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        return self.accounting.round_record(server_round, accepted, records, self.sampled.get(server_round, len(accepted)),
                                            secure=self.secure_sum if self.secure_aggregation else None,
                                            clip=self.adaptive, count_in_sum=self.count_in_secure_sum)

    def client_record(self, reply: Reply, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        rec = super().client_record(reply, metrics)
        secagg_bytes = metrics.get("secagg_uplink_bytes")
        if self.secure_aggregation and isinstance(secagg_bytes, int) and not isinstance(secagg_bytes, bool):
            rec["uplink_bytes"] = secagg_bytes  # what the client sent: masked vector plus the protocol's keys
        if self.dp is not None:  # the mechanism's parameters, as the server knows them
            rec.update(epsilon_budget=self.dp.epsilon(), delta=self.dp.delta, noise_multiplier=self.dp.noise_multiplier,
                       sample_rate=self.dp.sample_rate)
        if self.adaptive is not None:  # the C_t it clipped at (checked on acceptance)
            rec["clip_norm"] = self.adaptive.clip
        return rec

    def checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {**self.accounting.state(), "sampled": {str(k): v for k, v in self.sampled.items()}}
        if self.clip_t is not None:
            state["clip_norm"] = float(self.clip_t)
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.accounting.load(state)
        self.sampled = {int(k): int(v) for k, v in dict(state.get("sampled", {})).items()}
        if "clip_norm" in state:
            self._resumed_clip = checked_clip(state["clip_norm"])
            if self.adaptive is not None:
                self.adaptive.clip = self._resumed_clip
