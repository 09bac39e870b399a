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
(:meth:`ClientLevelDPStrategy.decode_secure_sum`), and each round is charged as a Gaussian of its equivalent
multiplier 1/(a + τ√d) (Kairouz et al., Prop. 14: an upper bound of its RDP at every order, so the RDP ledger never
claims less than the mechanism gives), unamplified for every view.

Adaptive clipping (``adaptive-clip-quantile`` > 0: dp-fedavg, fed-smp-randk/topk and the DP2-FedSAM family, each
counting the bit of the vector it clips; not dp-ftrl; Andrew et al. 2021, Alg. 1): the server holds C_t,
sends it in the fit config (``dp-clip-norm``) and sets C_{t+1} = C_t · exp(−η_C (b̄_t − γ)) from the clients' count
shares b_i − ½ + N(0, σ_b²/r) (:meth:`ClientLevelDPStrategy.adapt_clip`). Each update carries z_Δ·C_t with
z_Δ⁻² = z⁻² − (2σ_b)⁻², so update and share together are one Gaussian at the run's z (Thm 1), charged as such.
Without SecAgg+ each share is a metric (r the expected clients, b̄ = Σ/r + ½). Under SecAgg+ with continuous Gaussian
shares (``secagg-mechanism = 'gaussian'``) no share is sent in the clear: each client adds N(0, σ_b²/r_t) to its
centred bit and appends it, times :func:`~strategies.privacy.adaptive_clipping.count_share_scale`, as coordinate d+1
of the vector it masks; the server splits that coordinate off the decoded sum and sets b̄ = Σ/r' + ½ over the r'
survivors (:meth:`ClientLevelDPStrategy.split_count_sum`). Threat model: against an honest-but-curious server that
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
from flwr.common import FitRes, Parameters, Scalar, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from strategies.aggregate import unflatten, weighted_sum
from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate, Reply
from strategies.errors import ConfigError
from strategies.privacy import threat_models
from strategies.privacy.accountants import History, epsilon_of
from strategies.privacy.adaptive_clipping import (
    AdaptiveClipConfig,
    count_share_scale,
    fraction_from_noisy_sum,
    geometric_clip_update,
    round_mechanism,
    secagg_update_range,
    split_count_coordinate,
    update_noise_multiplier,
)
from strategies.privacy.budget import exceeds_budget
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ledger import PrivacyLedger
from strategies.privacy.mechanisms import ClientLevelDP, noisy_norm_bound
from strategies.server.records import AGGREGATE_PHASE, FIT_PHASE
from strategies.server.validation import metric_problem, parse_client_id

CFG_SIGMA = "dp-noise-multiplier"  # fit-config: the mechanism's σ (clients cross-check it)
CFG_ROUND_CLIENTS = "dp-round-clients"  # fit-config: r_t, the number of clients sampled this round
CFG_ROTATION_SEED = "ddg-rotation-seed"  # fit-config: the round's public seed of the DDG's random rotation
CFG_CLIP = "dp-clip-norm"  # fit-config: the round's clip norm C_t under adaptive clipping (clients check it)
#: client metric under adaptive clipping without SecAgg+: its share of the noisy count, b_i − ½ + N(0, σ_b²/r)
#: (under SecAgg+ the share is coordinate d+1 of the secure sum instead, never a metric)
METRIC_UNCLIPPED_SHARE = "unclipped_share"

#: the fewest survivors whose secure sum is unmasked: with two, the server holds one survivor's self-mask seed after
#: unmasking and the one pairwise seed between them is 32 bits in Flower's mask PRG (MT19937), a feasible search
MIN_SECURE_SURVIVORS = 3

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


class ClientLevelDPStrategy(DPFLStrategy):
    """Client-level DP server: Poisson sampling, σ cross-check, noise-aware norm bound, the server's ledger."""

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
        self.clip = clip
        self.dp: ClientLevelDP | None = None
        #: the distributed discrete Gaussian the secure sums carry (None: continuous Gaussian shares, or no SecAgg+)
        self.ddg: DistributedDiscreteGaussian | None = None
        self.adaptive_clip_factory = adaptive_clip_factory
        #: adaptive clipping (Andrew et al. 2021): γ, η_C, σ_b, C_0; None for a fixed clip
        self.adaptive: AdaptiveClipConfig | None = None
        self.clip_t: float | None = None  # C_t, the clip of the next round (checkpointed)
        self.update_multiplier: float | None = None  # z_Δ, the update's share of the round's multiplier z
        self.other_view = PrivacyLedger(self.ledger.accountant)  # the view the budget is not for
        #: ε against the server that draws the sample: per client, the unamplified Gaussian (q = 1) of every
        #: round it took part in, at the multiplier the server saw (the sum's, or one update's without SecAgg+)
        self.server_view = PrivacyLedger(self.ledger.accountant)
        self.release_view = PrivacyLedger(self.ledger.accountant)  # the sum, amplified at q = r/n
        self.sampled: dict[int, int] = {}
        self.budget_exhausted = False
        self._contributors = 0  # replies inside this round's secure sum
        self._unreleased: str | None = None  # why this round's secure sum was not reconstructed
        #: under SecAgg+ with adaptive clipping: Σ of this round's survivors' count shares (from the sum's last
        #: coordinate), or why the sum could not be split
        self._count_sum: float | None = None
        self._sum_problem: str | None = None

    @property
    def payload_is_shared(self) -> bool:
        return self.secure_aggregation

    @property
    def private(self) -> bool:
        return self.mechanism_factory is not None

    def setup_privacy(self, num_clients: int) -> None:
        """Build the mechanism for n = ``num_clients`` once (before round 1: errors stop the run early)."""
        if self.mechanism_factory is not None and self.dp is None:
            self.dp = self.mechanism_factory(num_clients)
            self.sampler.fixed_rate = self.dp.sample_rate  # q = r/n of the registered clients, all run long
            if self.secure_aggregation and self.dp.clients_per_round < MIN_SECURE_SURVIVORS:
                raise ConfigError(f"secure aggregation with {self.dp.clients_per_round} client(s) a round "
                                  f"(clients-per-round, else every client): a secure sum of fewer than "
                                  f"{MIN_SECURE_SURVIVORS} survivors is never unmasked, so no round would release; "
                                  f"run at least {MIN_SECURE_SURVIVORS} clients a round or set secure-aggregation = "
                                  "false")
            if self.secure_sum_factory is not None and self.dp.secure_aggregation:
                self.ddg = ddg = self.secure_sum_factory(self.dp, self.payload_dim())
                if ddg is not None:  # clients account the continuous plan σ, the ledger the discrete sum's z ≥ σ
                    self.ledger.report_slack = ddg.report_slack(self.dp.noise_multiplier)
            if self.adaptive_clip_factory is not None:
                self.adaptive = self.adaptive_clip_factory(self.dp)
            if self.adaptive is not None and self.ddg is not None:
                raise ConfigError("adaptive clipping with secagg-mechanism = 'ddg' is not supported: the distributed "
                                  "discrete Gaussian's privacy bound covers the rotated update alone, not a count "
                                  "coordinate inside it; use secagg-mechanism = 'gaussian'")
            if self.count_in_secure_sum and self.adaptive is None:
                raise ConfigError("this server sized the secure sum for adaptive clipping's count coordinate, but "
                                  "its adaptive clipping is off (adaptive-clip-quantile = 0)")
            if self.adaptive is not None:
                self.update_multiplier = update_noise_multiplier(self.dp.noise_multiplier,
                                                                 self.adaptive.count_noise_std)
                if self.clip_t is None:  # a resumed run keeps the checkpointed C_t
                    self.clip_t = self.adaptive.initial_clip

    def noise_mechanism(self) -> ClientLevelDP:
        """What each update carries this round: the run's mechanism, or under adaptive clipping C_t with the
        update multiplier z_Δ (the budget is still charged for the run's z, :meth:`round_charge`)."""
        assert self.dp is not None
        if self.adaptive is None:
            return self.dp
        assert self.clip_t is not None and self.update_multiplier is not None
        return round_mechanism(self.dp, self.clip_t, self.update_multiplier)

    def count_share_std(self, round_clients: int) -> float:
        """Std of one client's noise on its centred bit, σ_b/√r (r as for the update noise): one update carries
        the multiplier z/√r of a fixed-clip round, the sum of r shares N(0, σ_b²) (Andrew et al. 2021, Thm 1)."""
        assert self.dp is not None and self.adaptive is not None
        r = round_clients if self.dp.secure_aggregation else self.dp.clients_per_round
        return self.adaptive.count_noise_std / math.sqrt(max(int(r), 1))

    @property
    def count_in_secure_sum(self) -> bool:
        """Whether each client's count share rides in the secure sum as coordinate d+1 (adaptive clipping under
        SecAgg+; known before the mechanism is built, so that every place sizing the payload agrees)."""
        return self.secure_aggregation and self.private and self.adaptive_clip_factory is not None

    def count_coordinates(self) -> int:
        """1 when the secure sum carries the count share after the update's coordinates, else 0."""
        return 1 if self.count_in_secure_sum else 0

    def payload_dim(self) -> int:
        """*hook*: the length of the vector each client privatizes and sends (the model's parameters, dense, plus
        the count coordinate under :attr:`count_in_secure_sum`)."""
        return self.num_params + self.count_coordinates()

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

    # ---- sampling and budget -------------------------------------------------------------
    def round_charge(self, survivors: int, sampled: int) -> tuple[float, float]:
        """(aggregate, individual) noise multipliers of a round with ``survivors`` of ``sampled`` updates summed:
        the sum of r' updates each carrying std s = C·σ_t has multiplier s√r'/C; one update has s/C.

        Under adaptive clipping each update carries z_Δ > z and each count share σ_b/√r: the pair is one Gaussian
        with multiplier z (Andrew et al. 2021, Thm 1: z⁻² = z_Δ⁻² + (2σ_b)⁻², per update and for any r' of them),
        so the round is charged at the run's z, exactly as a fixed-clip round."""
        assert self.dp is not None
        if self.ddg is not None:  # the discrete sum's Gaussian equivalent (an RDP upper bound at every order)
            return self.ddg.gaussian_equivalent(survivors, sampled), self.ddg.gaussian_equivalent(1, sampled)
        per_update = self.dp.noise_std(sampled) / self.dp.clip
        return per_update * math.sqrt(survivors), per_update

    def charged_sample_rate(self, survivors: int, sampled: int) -> float:
        """The rate the budget charges a round with ``survivors`` of ``sampled`` updates in its sum at: the mechanism's
        accounted q (:attr:`ClientLevelDP.accounted_sample_rate`), except 1 when dropouts left fewer survivors than
        sampled clients, whose sum then carries σ·√(r'/r_t) and so reveals the count (and with it part of who was
        sampled): amplification by secret sampling does not hold for that round."""
        assert self.dp is not None
        return self.dp.accounted_sample_rate if survivors >= sampled else 1.0

    def release_sample_rate(self, survivors: int, sampled: int) -> float:
        """The rate a round's release is amplified at (its ``epsilon_vs_release``): q = r/n only for a continuous
        Gaussian secure sum of every sampled update (:attr:`ClientLevelDP.release_sample_rate`), else 1 (the discrete
        Gaussian's bound is not analysed under amplification; dropouts and per-update noise reveal the count)."""
        assert self.dp is not None
        return self.dp.release_sample_rate if self.ddg is None and survivors >= sampled else 1.0

    def release_denominator(self, server_round: int) -> int:
        """What the released mean divides the sum of updates by: the fixed expected cohort r = ``clients-per-round``
        when clients are sampled at q < 1 (the fixed-denominator estimator of McMahan et al. 2018, as TFF normalises
        by the expected clients per round), so the release's noise std σC/r does not depend on the realised count;
        the round's sampled count r_t otherwise (full participation, or no DP)."""
        if self.dp is not None and self.dp.sample_rate < 1:
            return self.dp.clients_per_round
        return max(self.sampled.get(server_round, 1), 1)

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """(1/:meth:`release_denominator`) Σ_i Δ_i over the accepted updates (under SecAgg+ every reply carries the
        survivors' mean, so Σ_i is r' times it: the secure sum; Fed-SMP Alg. 1 line 10, DP2-FedSAM Alg. 2 line 25)."""
        total: np.ndarray = weighted_sum([u.update for u in updates], np.ones(len(updates)))
        return total / self.release_denominator(server_round)

    def headline_charge(self, survivors: int, sampled: int) -> tuple[float, float]:
        """(the multiplier the budget is for, the other view's) of such a round."""
        z_sum, z_ind = self.round_charge(survivors, sampled)
        return (z_sum, z_ind) if self.dp is not None and self.dp.secure_aggregation else (z_ind, z_sum)

    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        if self.dp is not None:
            planned = self.ledger.population + [(self.dp.budget_noise_multiplier, self.dp.accounted_sample_rate, 1)]
            if server_round > self.dp.rounds or exceeds_budget(self.epsilon_after(planned), self.dp.epsilon()):
                if not self.budget_exhausted:
                    log(WARNING, "round %d: the planned client-level budget epsilon=%.4f cannot pay for another "
                        "round; no client is sampled", server_round, self.dp.epsilon())
                self.budget_exhausted = True
                self.sampled[server_round] = 0
                self.round_log.add_metrics({"budget_exhausted": True})
                return []
        chosen = super().sample_clients(server_round, nodes)
        self.sampled[server_round] = len(chosen)
        self.round_log.add_metrics({"clients_sampled": len(chosen)})  # also when too few to run the round
        return chosen

    def epsilon_after(self, history: History) -> float:
        assert self.dp is not None
        return epsilon_of(history, self.dp.delta, self.ledger.accountant)

    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        cfg: dict[str, Scalar] = {CFG_ROUND_CLIENTS: max(self.sampled.get(server_round, 1), 1)}
        if self.dp is not None:
            cfg[CFG_SIGMA] = float(self.dp.noise_multiplier)
        if self.ddg is not None:
            cfg[CFG_ROTATION_SEED] = rotation_seed(self.seed, server_round)
        if self.adaptive is not None and self.clip_t is not None:
            cfg[CFG_CLIP] = float(self.clip_t)
        return cfg

    # ---- validation ------------------------------------------------------------------------
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
        return count_share_scale(self.secagg_clipping_range(), self.count_share_std(self.round_clients()))

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Scalar]) -> None:
        self.check_sigma(metrics)
        self.check_count_share(metrics)

    def check_count_share(self, metrics: Mapping[str, Scalar]) -> None:
        """Under adaptive clipping: reject a reply clipped at another C_t, or (without SecAgg+) whose count share
        lies outside ½ + 12 stds of its noise (a legitimate one does so with probability < e⁻⁷²; it would steer the
        clip). Under SecAgg+ the share is inside the sum and any metric of that name is ignored."""
        if self.adaptive is None:
            return
        self.check_clip_used(metrics)
        if self.secure_aggregation:
            return
        share = metrics.get(METRIC_UNCLIPPED_SHARE)
        bound = 0.5 + 12.0 * self.count_share_std(self.round_clients())
        if (isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(float(share))
                or abs(float(share)) > bound):
            raise RejectedUpdate(f"{METRIC_UNCLIPPED_SHARE} {share!r} is not a number within ±{bound:.4g}")

    def check_clip_used(self, metrics: Mapping[str, Scalar]) -> None:
        """Reject a reply clipped at another clip than this round's adaptive C_t."""
        used = metrics.get("clip_norm")
        if (isinstance(used, bool) or not isinstance(used, (int, float)) or self.clip_t is None
                or not math.isclose(float(used), self.clip_t, rel_tol=1e-9)):
            raise RejectedUpdate(f"client clip norm {used!r} != this round's adaptive clip C_t = {self.clip_t}")

    def check_sigma(self, metrics: Mapping[str, Scalar]) -> None:
        """Reject a reply whose declared σ is not the mechanism's (the client ran another mechanism)."""
        if self.dp is not None:
            check_declared_multiplier(metrics, self.dp.noise_multiplier, "mechanism σ")

    def privacy_charge(self, server_round: int, record: Mapping[str, Any], metrics: Mapping[str, Scalar]) -> None:
        return None  # charged to the population in population_charge

    # ---- secure aggregation: decide before the sum is reconstructed ---------------------------
    def unmask_refusal(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> str | None:
        """Why this round's secure sum must not be reconstructed (None: unmask it). Called by the SecAgg+
        workflow after the masked vectors arrived and before the unmask stage, with the survivors' replies.

        The sum is refused when a survivor's metrics are unusable (it would be inside the sum and could not be
        taken out) or when the budget cannot pay for the noise that ``len(results)`` survivors carry. Whatever
        is reconstructed is charged (:meth:`population_charge`), so this is the only place a round can be
        withheld without cost.
        """
        server_round = self.actual_round(server_round)
        connected = self.connected_nodes | {int(p.node_id) for p, _ in results}
        claims = [parse_client_id(res.metrics.get("client_id")) for _, res in results]
        twice = sorted({c for c in claims if c is not None and claims.count(c) > 1})
        if twice:
            return f"secure aggregation: client_id {twice[0]} is claimed by several survivors"
        for proxy, res in results:
            metrics = dict(res.metrics)
            cid = parse_client_id(metrics.get("client_id"))
            problem = metric_problem(metrics)
            if problem is None and cid is not None:
                problem = self.identity.check(int(proxy.node_id), cid, connected)
                if problem is None and self.strikes.excluded(cid):
                    problem = f"client {cid} is excluded"
                if problem is None and metrics.get("status", "ok") != "ok":
                    problem = f"status {metrics.get('status')!r} inside the sum"
                if problem is None:
                    try:
                        self.check_sigma(metrics)
                        if self.adaptive is not None:
                            self.check_clip_used(metrics)
                    except RejectedUpdate as exc:
                        problem = str(exc)
            if problem is not None:
                return f"secure aggregation: node {int(proxy.node_id)}'s reply is unusable ({problem})"
        if results and len(results) < MIN_SECURE_SURVIVORS:
            return (f"secure aggregation: only {len(results)} survivor(s); a sum of fewer than {MIN_SECURE_SURVIVORS} "
                    "is never unmasked (with two, the server that holds the self-mask seeds after unmasking could "
                    "search the one 32-bit pairwise mask seed of Flower's PRG and read a share)")
        if self.dp is None or not results:
            return None
        sampled = self.sampled.get(server_round, len(results))
        survivors = min(len(results), max(sampled, 1))
        z_budget, _ = self.headline_charge(survivors, max(sampled, 1))
        rate = self.charged_sample_rate(survivors, max(sampled, 1))
        if exceeds_budget(self.epsilon_after(self.ledger.population + [(z_budget, rate, 1)]), self.dp.epsilon()):
            return (f"budget: {len(results)} of {sampled} sampled updates would release multiplier {z_budget:.4f}, "
                    f"more ε than the planned budget {self.dp.epsilon():.4f} has left")
        return None

    def record_unreconstructed(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                               failures: list[Any], reason: str) -> None:
        """Record a secure round whose sum was never reconstructed: its replies, the strikes their own metrics
        earn, status ``withheld``; nothing is released and nothing is charged."""
        log(WARNING, "round %d: %s; the secure sum is not reconstructed", self.actual_round(server_round), reason)
        self._unreleased = reason
        try:
            self.aggregate_fit(server_round, results, failures)
        finally:
            self._unreleased = None

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        self.round_log.mark(FIT_PHASE)
        self._contributors = len(results)
        self._count_sum, self._sum_problem = None, None
        with self.round_log.timed(AGGREGATE_PHASE):
            if self.ddg is not None and self.secure_aggregation and results and self._unreleased is None:
                self.decode_secure_sum(server_round, results)
            if self.adaptive is not None and self.count_in_secure_sum and results and self._unreleased is None:
                self.split_count_sum(results)
        return super().aggregate_fit(server_round, results, failures)

    def split_count_sum(self, results: list[tuple[ClientProxy, FitRes]]) -> None:
        """Under SecAgg+ with adaptive clipping: take the count coordinate off the survivors' mean (every reply
        carries it; Flower divides the secure sum by the r' survivors) and keep Σ_i (b_i − ½ + N(0, σ_b²/r_t)) for
        :meth:`adapt_clip`; the replies then carry the update part only. A mean of any other layout than the update's
        arrays plus one (1,) array is not split: every reply is then rejected (and the round withheld)."""
        arrays = parameters_to_ndarrays(results[0][1].parameters)
        update_shapes = [tuple(a.shape) for a in self.payload_arrays(np.zeros(self.payload_dim() - 1))]
        shapes = [tuple(a.shape) for a in arrays]
        if shapes != update_shapes + [(1,)]:
            self._sum_problem = (f"the secure sum has shapes {shapes}, expected the update's {update_shapes} and one "
                                 "count coordinate (1,)")
            return
        flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
        try:
            update_mean, count_mean = split_count_coordinate(flat, self.payload_dim() - 1, self.count_share_scale())
        except ValueError as exc:
            self._sum_problem = str(exc)
            return
        if not math.isfinite(count_mean):
            self._sum_problem = f"the secure sum's count coordinate is not finite ({count_mean})"
            return
        self._count_sum = count_mean * len(results)
        mean = ndarrays_to_parameters(self.payload_arrays(update_mean))
        for _, res in results:
            res.parameters = mean

    def decode_secure_sum(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> None:
        """Replace the reconstructed sum modulo 2^b (one array of the rotated length, every reply carries it) by
        the survivors' mean update in the clients' wire format: wrap, scale by γ, undo the rotation, divide by r'."""
        assert self.ddg is not None
        arrays = parameters_to_ndarrays(results[0][1].parameters)
        if len(arrays) != 1 or arrays[0].shape != (self.ddg.rotated_dim,):
            shapes = [tuple(a.shape) for a in arrays]
            raise RuntimeError(f"round {server_round}: the secure sum has shapes {shapes}, the distributed discrete "
                               f"Gaussian ({self.ddg.rotated_dim},)")
        total = self.ddg.decode(arrays[0], rotation_seed(self.seed, server_round))
        mean = ndarrays_to_parameters(self.payload_arrays(total / len(results)))
        for _, res in results:
            res.parameters = mean

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Scalar]) -> np.ndarray:
        if self._unreleased is not None:
            raise RejectedUpdate(f"not reconstructed: {self._unreleased}")
        if self._sum_problem is not None:
            raise RejectedUpdate(self._sum_problem)
        return super().decode_update(server_round, reply, metrics)

    def population_charge(self, server_round: int, accepted: list[ClientUpdate],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        sampled = self.sampled.get(server_round, len(accepted))
        out: dict[str, Any] = {"clients_sampled": sampled, "secure_aggregation": self.secure_aggregation}
        if self._unreleased is not None:
            for r in records:
                if r.get("status") == "ok" or r.get("attributable") is False:
                    r["status"], r["reason"] = "withheld", self._unreleased
                    r.pop("attributable", None)
            out.update(round_withheld=True, sum_reconstructed=False)
            if self.dp is not None:
                out["epsilon"] = self.ledger.population_epsilon()
            return out
        bad = [r for r in records if r.get("status") == "rejected"]
        withhold = None
        if self.secure_aggregation and bad:
            # a rejected reply's update is inside the secure sum and cannot be taken out: release nothing of
            # it; the sum was reconstructed all the same, so it is charged below
            withhold = (f"secure aggregation: the sum contains the reply of node {bad[0].get('node_id')}, rejected "
                        f"({bad[0].get('reason')}); round withheld")
            log(WARNING, "round %d: %s", server_round, withhold)
            for r in records:
                if r.get("status") == "ok" or r.get("attributable") is False:
                    r["status"], r["reason"] = "withheld", withhold
            out["round_withheld"] = True
        if self.dp is None:
            return out
        # what the server has seen: the reconstructed sum of the contributors (secure aggregation), else every
        # update that arrived (accepted or not); either is charged whether or not the round is then released
        seen = self._contributors if self.secure_aggregation else \
            sum(1 for r in records if r.get("status") in ("ok", "withheld", "rejected"))
        survivors = seen if self.secure_aggregation else len(accepted)  # inside the released sum
        if seen > 0 and sampled > 0:
            survivors = min(max(survivors, 1), sampled)
            z_sum, _ = self.round_charge(survivors, sampled)
            z_budget, z_other = self.headline_charge(survivors, sampled)  # z_budget: the multiplier the server saw
            rate = self.charged_sample_rate(survivors, sampled)
            charge = [(z_budget, rate, 1)]
            if exceeds_budget(self.epsilon_after(self.ledger.population + charge), self.dp.epsilon()):
                log(WARNING, "round %d: %d of %d sampled updates released multiplier %.4f, more than the planned "
                    "budget %.4f has left; charged as released", server_round, survivors, sampled, z_budget,
                    self.dp.epsilon())
            self.ledger.charge_population(charge, self.dp.delta)
            self.other_view.charge_population([(z_other, rate, 1)], self.dp.delta)
            if withhold is None and (self.secure_aggregation or accepted):  # something reaches the released model
                # it carries the sum's noise; amplified for whoever does not see the sample when nothing in the
                # release reveals the count (release_sample_rate)
                self.release_view.charge_population([(z_sum, self.release_sample_rate(survivors, sampled), 1)],
                                                    self.dp.delta)
            for r in records:  # every reply whose update the server received, inside the sum or alone
                if r.get("client_id") is not None and r.get("status") in ("ok", "withheld", "rejected"):
                    self.server_view.charge(int(r["client_id"]), [(z_budget, 1.0, 1)], self.dp.delta)
            if survivors < sampled and self.dp.secure_aggregation:
                log(WARNING, "round %d: %d of %d sampled clients were aggregated; the sum carried multiplier %.4f, "
                    "accounted as such", server_round, survivors, sampled, z_budget)
            out["noise_multiplier_effective"] = z_sum
        if withhold is not None:
            out["epsilon"] = self.ledger.population_epsilon()
        aggregate, individual = self.ledger, self.other_view
        if not self.dp.secure_aggregation:
            aggregate, individual = individual, aggregate
        for r in records:
            cid = r.get("client_id")
            if cid is not None and self.server_view.histories.get(int(cid)):
                r["epsilon_vs_server"] = self.server_view.epsilon(int(cid))
        out["epsilon_vs_release"] = self.release_view.population_epsilon()
        if self.adaptive is not None:
            out.update(self.adapt_clip(accepted if withhold is None else []))
        if self.server_view.histories:
            out["max_epsilon_vs_server"] = self.server_view.max_epsilon()
        if self.dp.secure_aggregation:  # the discrete Gaussian's sum is analysed; a rounded continuous one is not
            out["epsilon_vs_server_proven"] = self.ddg is not None
            if self.ddg is None:
                out["epsilon_vs_server_caveat"] = threat_models.ROUNDED_SUM_CAVEAT
        out.update(epsilon=self.ledger.population_epsilon(), epsilon_aggregate=aggregate.population_epsilon(),
                   epsilon_individual=individual.population_epsilon(), delta=self.dp.delta,
                   noise_multiplier=self.dp.noise_multiplier, sample_rate=self.dp.sample_rate,
                   epsilon_budget=self.dp.epsilon(),
                   accounted_sample_rate=self.dp.accounted_sample_rate, adversary=self.dp.adversary,
                   secure_sum=("distributed discrete Gaussian" if self.ddg is not None else
                               "continuous Gaussian" if self.dp.secure_aggregation else "none"),
                   epsilon_guarantee=("aggregate (secure aggregation)" if self.dp.secure_aggregation
                                      else "individual update (the server sees every update)")
                   + (", against the server that draws the sample (no amplification)" if self.dp.adversary == "server"
                      else ", against observers of the release (amplified by secret sampling)"))
        return out

    def client_record(self, reply: Reply, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        rec = super().client_record(reply, metrics)
        secagg_bytes = metrics.get("secagg_uplink_bytes")
        if self.secure_aggregation and isinstance(secagg_bytes, int) and not isinstance(secagg_bytes, bool):
            rec["uplink_bytes"] = secagg_bytes  # what the client sent: masked vector plus the protocol's keys
        if self.dp is not None:  # the mechanism's parameters, as the server knows them
            rec.update(epsilon_budget=self.dp.epsilon(), delta=self.dp.delta, noise_multiplier=self.dp.noise_multiplier,
                       sample_rate=self.dp.sample_rate)
        if self.adaptive is not None and self.clip_t is not None:  # the C_t it clipped at (checked on acceptance)
            rec["clip_norm"] = self.clip_t
        return rec

    def adapt_clip(self, accepted: list[ClientUpdate]) -> dict[str, Any]:
        """C_{t+1} = C_t · exp(−η_C (b̄_t − γ)) from the noisy count shares (Andrew et al. 2021, Alg. 1): without
        SecAgg+ the accepted replies' metrics, b̄_t = (Σ shares) / r + ½, r the expected clients per round; under
        SecAgg+ the sum's count coordinate over its r' survivors, b̄_t = Σ / r' + ½. A round with nothing accepted
        keeps C_t. Post-processing of privatized shares: it costs nothing beyond the round's charge."""
        assert self.adaptive is not None and self.dp is not None and self.clip_t is not None
        out: dict[str, Any] = {"clip_norm": self.clip_t, "adaptive_clip_quantile": self.adaptive.target_quantile,
                               "count_noise_std": self.adaptive.count_noise_std,
                               "update_noise_multiplier": self.update_multiplier}
        if accepted and self.count_in_secure_sum:
            if self._count_sum is None:  # the sum's shapes were checked in split_count_sum: nothing is accepted
                raise RuntimeError("an accepted secure sum without its count coordinate")
            # the fixed expected cohort under sampling (as the update's mean), so C_{t+1} does not reveal r'
            count = self.dp.clients_per_round if self.dp.sample_rate < 1 else self._contributors
            fraction = fraction_from_noisy_sum(self._count_sum, count)
            self.clip_t = geometric_clip_update(self.clip_t, fraction, self.adaptive.target_quantile,
                                                self.adaptive.learning_rate)
            out.update(unclipped_fraction=fraction, count_sum_clients=self._contributors)
        elif accepted:
            noisy_sum = sum(float(u.metrics[METRIC_UNCLIPPED_SHARE]) for u in accepted)
            fraction = fraction_from_noisy_sum(noisy_sum, self.dp.clients_per_round)
            self.clip_t = geometric_clip_update(self.clip_t, fraction, self.adaptive.target_quantile,
                                                self.adaptive.learning_rate)
            out["unclipped_fraction"] = fraction
        out["next_clip_norm"] = self.clip_t
        return out

    # ---- checkpoint ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"other_view": self.other_view.state(), "server_view": self.server_view.state(),
                                 "release_view": self.release_view.state(),
                                 "sampled": {str(k): v for k, v in self.sampled.items()}}
        if self.clip_t is not None:
            state["clip_norm"] = float(self.clip_t)
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.other_view.load(dict(state.get("other_view", {})))
        self.server_view.load(dict(state.get("server_view", {})))
        self.release_view.load(dict(state.get("release_view", {})))
        self.sampled = {int(k): int(v) for k, v in dict(state.get("sampled", {})).items()}
        if "clip_norm" in state:
            clip = float(state["clip_norm"])
            if not (clip > 0 and math.isfinite(clip)):
                raise ValueError(f"checkpoint clip_norm {clip} is not a finite number > 0")
            self.clip_t = clip
