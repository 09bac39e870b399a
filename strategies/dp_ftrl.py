"""DP-FTRL for DP-FedAvg: correlated noise across rounds instead of amplification by sampling.

Kairouz et al., "Practical and Private (Deep) Learning without Sampling or Shuffling" (ICML 2021): tree
aggregation, the online ("honest") estimator, with restarts; Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization" (NeurIPS 2023): a b-banded Toeplitz C for the run's T. Round t's sum of clipped client updates x_t
gets w_t = (C⁻¹Z)_t (:mod:`strategies.privacy.matrix_mechanism`), so the global model θ_t = θ_0 + η Σ_{s≤t}
(x_s + w_s)/r_s carries the decoder's B Z in its prefix sums. The run is one Gaussian mechanism with multiplier
z/sens(C) (:class:`~strategies.privacy.ftrl_accounting.FTRLMechanism`), whoever chose the participants: no
sampling or shuffling assumption, so the same ε holds against the server that samples whenever the server
never sees the noise-free sum.

What it protects: one whole client under zero-out neighbours (every update of one client replaced by zero; it still
takes part, the public n is unchanged: Kairouz et al. 2021, Ponomareva et al. 2023), clipped to C each round. Participation:
every client may contribute in every round (k = T, min_separation = 1: sens_t² = ‖C_t 1‖² for C ≥ 0), or, with
``min_separation`` b > 1, client i contributes only in the rounds t with (t − 1 − i) mod b = 0 (Choquette-Choo et
al., NeurIPS 2023, b-min-separated participation; :func:`~strategies.privacy.ftrl_accounting.in_turn`): at most
⌈T/b⌉ contributions b apart, and a b-banded C then has sens² = ⌈T/b⌉ ‖c‖² (the columns a client touches are
orthogonal). The schedule is public and each client enforces it on itself; outside its turn a client still takes
part, with a zero update (plus its noise stream under SecAgg+), and the round's mean divides by the turn's size. A
server sampling r < n does not change the bound, nothing is amplified. Who adds the noise:

* ``secure_aggregation`` False (*central*): the server adds w_t to the sum of the clipped updates it received.
  It sees every clipped update without noise, so **nothing holds against the server** (trusted server); ε is
  for observers of the released models (``client-dp-adversary = 'release'`` is required, and no
  ``epsilon_vs_server`` is reported). The stream's state (its last b − 1 outputs or the tree's open nodes and
  its generator) is secret server state, checkpointed so a resumed run continues the same noise sequence.
* ``secure_aggregation`` True: each of the n clients adds its own stream (C⁻¹Z_i)_t, entries of Z_i with std
  zC/√n, drawn from its own secret randomness and kept in its state (``fedapp.clients.client_dp``); SecAgg+
  (continuous Gaussian shares) reveals only Σ_i, which carries C⁻¹ΣZ_i. A client missing from a released sum
  breaks its stream there; its partial stream is data-independent noise (post-processing), so the ledger
  counts only the P clients present in every released sum: z_eff = z √(|P|/n). Streams are indexed by the
  server round (a client never repeats or rewinds one), so a round that is not released only drops rows.
  Assumes honest clients (a client colluding with the server reveals its stream).

Accounting (the server's ledger, :meth:`~strategies.privacy.ledger.PrivacyLedger.restate_population`): after the
release of round t the population's history is the single Gaussian [(z_eff/sens_t, 1, 1)], composed by
dp_accounting's PLD accountant (tight for one Gaussian), where sens_t covers the rows of C released by round t
(Denisov et al. 2022, adaptive streams: a lower-triangular C on adaptively chosen rows is as private as on
fixed ones). The budget is the whole run's ε_T; nobody is sampled once the next round's ε_t would exceed it.

Utility under full participation: sens² ≥ ‖C 1‖² and ‖A 1‖ ≤ ‖B‖_F ‖C 1‖ give ‖B‖_F² sens² ≥ Σ_t t², so no
factorization has a prefix-sum RMSE below 1/√1.5 ≈ 0.82 of independent noise (C = I, ‖A‖_F² · T) at equal ε;
the tree does worse than C = I there. Correlated noise pays off with min-separated participation (b > 1).

Not covered: Fed-SMP's sparsified variants. Their round mask m_t changes the coordinates each round carries, so
the per-coordinate stream (C⁻¹Z)_t would be sampled on different coordinates every round: coordinate j's noise
is (C⁻¹Z)_{t,j} only in the rounds whose mask holds j, the released prefix sum of j is B restricted to those rows,
and the cancellation that makes B Z small is lost (the noise of j's skipped rounds never arrives). The privacy of
that release is still the Gaussian of C X (each coordinate's rows are a subset), but its utility is not DP-FTRL's;
a sound variant needs a factorization per coordinate pattern, so the registry offers dense ``dp-ftrl`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import FitRes, Scalar, log
from flwr.server.client_proxy import ClientProxy

from strategies.aggregate import weighted_sum
from strategies.base import ClientUpdate
from strategies.client_level import CFG_SIGMA, ClientLevelDPStrategy, check_declared_multiplier, uplink_metrics
from strategies.errors import ConfigError
from strategies.privacy import threat_models
from strategies.privacy.budget import exceeds_budget
from strategies.privacy.ftrl_accounting import FTRLMechanism, turn_size
from strategies.privacy.matrix_mechanism import BandedNoise, TreeNoise
from strategies.privacy.mechanisms import noisy_norm_bound

#: fit-config keys: the factorization and its shape, which clients cross-check against their own run-config
CFG_FTRL = "ftrl-mechanism"
#: the accountant of DP-FTRL's one Gaussian (dp_accounting PLD; q = 1, one event)
FTRL_ACCOUNTANT = "dpa-pld"

FTRLFactory = Callable[[int], FTRLMechanism]


def advance_to(stream: BandedNoise | TreeNoise, index: int) -> np.ndarray:
    """w_index of ``stream``: the rounds before it are drawn and dropped (never reused); a stream already past
    ``index`` raises (its noise was spent)."""
    if stream.round > index:
        raise ValueError(f"the noise stream is at round {stream.round}; round {index} was already drawn")
    while stream.round < index:
        stream.next()
    return stream.next()


class DPFTRLStrategy(ClientLevelDPStrategy):
    """DP-FTRL server (see the module docstring): dense DP-FedAvg rounds, correlated noise, one-Gaussian ledger.

    No adaptive clipping (Andrew et al. 2021): the correlated noise's sensitivity is analysed for one fixed clip C
    across rounds, and a changing C_t breaks the prefix-sum structure that analysis rests on."""

    name = "dp-ftrl"
    privacy = threat_models.CLIENT_LEVEL_FTRL

    def __init__(self, *, ftrl_factory: FTRLFactory, noise_seed: int | None = None, **kwargs: Any) -> None:
        # every ledger composes with the PLD accountant: the matrix mechanism's rounds are not subsampled Gaussians
        super().__init__(**{**kwargs, "accountant": FTRL_ACCOUNTANT})
        self.ftrl_factory = ftrl_factory
        self.noise_seed = noise_seed  # None: OS entropy (secret); set only for reproducible tests
        self.ftrl: FTRLMechanism | None = None
        self.stream: BandedNoise | TreeNoise | None = None  # the server's stream (central mode only)
        self._stream_state: dict[str, Any] | None = None  # from a checkpoint, loaded once the stream exists
        self.present: set[int] | None = None  # SecAgg+: clients whose noise reached every released sum (None: all)
        self.released_round = 0  # the server round of the last released sum (ε_t is for t = this)
        self.uplink_total = 0

    @property
    def private(self) -> bool:
        return True

    # ---- setup -------------------------------------------------------------------------
    def setup_privacy(self, num_clients: int) -> None:
        if self.ftrl is not None:
            return
        ftrl = self.ftrl_factory(num_clients)
        if ftrl.secure_aggregation != self.secure_aggregation:
            raise ConfigError(
                f"run-config 'secure-aggregation' = {str(ftrl.secure_aggregation).lower()} but this server "
                f"{'runs' if self.secure_aggregation else 'does not run'} SecAgg+ (in-process loops cannot run it)")
        self.ftrl = ftrl
        self.sampler.fix_rate(ftrl.sample_rate)
        if not ftrl.secure_aggregation:
            rng = np.random.default_rng(None if self.noise_seed is None else [int(self.noise_seed), 601])
            self.stream = ftrl.noise_stream(self.num_params, rng)
            if self._stream_state is not None:
                self.stream.load_state_dict(self._stream_state)
                self._stream_state = None

    def prepare_round(self, num_available: int) -> None:
        self.setup_privacy(num_available)

    def present_count(self) -> int:
        assert self.ftrl is not None
        return self.ftrl.num_clients if self.present is None else len(self.present)

    # ---- sampling and budget ---------------------------------------------------------------
    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        assert self.ftrl is not None
        if server_round > self.ftrl.rounds or exceeds_budget(
                self.ftrl.epsilon(min(server_round, self.ftrl.rounds), max(self.present_count(), 1)),
                self.ftrl.epsilon()):
            if not self.budget_exhausted:
                log(WARNING, "round %d: DP-FTRL was planned for %d rounds at epsilon=%.4f; no client is sampled",
                    server_round, self.ftrl.rounds, self.ftrl.epsilon())
            self.budget_exhausted = True
            self.sampled[server_round] = 0
            self.round_log.add_metrics({"budget_exhausted": True})
            return []
        return super().sample_clients(server_round, nodes)

    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        cfg = super().fit_config(server_round)
        assert self.ftrl is not None
        cfg[CFG_SIGMA] = float(self.ftrl.noise_multiplier)
        cfg[CFG_FTRL] = self.ftrl.kind
        return cfg

    # ---- validation ------------------------------------------------------------------------
    def declared_norm_bound(self, dim: int) -> float | None:
        """Central: the clipped update (no client noise); SecAgg+: plus the largest per-round std of one stream."""
        if self.ftrl is None or not self.ftrl.secure_aggregation:
            return self.clip_bound()
        return noisy_norm_bound(self.ftrl.clip, self.ftrl.max_round_noise_std, self.num_params)

    def clip_bound(self) -> float | None:
        return None if self.clip is None else self.clip * (1 + 1e-5)

    def secagg_clipping_range(self) -> float:
        """C plus 12 stds of the largest per-round share a client adds (SecAgg+'s quantizer range)."""
        assert self.ftrl is not None
        return self.ftrl.clip + 12.0 * self.ftrl.max_round_noise_std

    def check_sigma(self, metrics: Mapping[str, Scalar]) -> None:
        if self.ftrl is not None:
            check_declared_multiplier(metrics, self.ftrl.noise_multiplier, "DP-FTRL z")

    def unmask_refusal(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> str | None:
        reason = super().unmask_refusal(server_round, results)
        if reason is not None or self.ftrl is None or not results:
            return reason
        server_round = self.actual_round(server_round)
        contributors = {int(c) for _, res in results if isinstance(c := res.metrics.get("client_id"), int)}
        present = contributors if self.present is None else self.present & contributors
        if not present:
            return "budget: no client's noise stream reached every released sum; the sum would carry no noise"
        eps = self.ftrl.epsilon(min(server_round, self.ftrl.rounds), len(present))
        if exceeds_budget(eps, self.ftrl.epsilon()):
            return (f"budget: with {len(present)} of {self.ftrl.num_clients} noise streams present in every sum the "
                    f"release of round {server_round} would spend epsilon={eps:.4f} > {self.ftrl.epsilon():.4f}")
        return None

    # ---- noise and aggregation -------------------------------------------------------------
    def contributors(self, server_round: int, sampled: int) -> int:
        """r_t, the clients whose data the round's sum carries: the turn's size under min-separated participation,
        else the clients sampled."""
        if self.ftrl is None or self.ftrl.min_separation == 1:
            return sampled
        return turn_size(server_round, self.ftrl.num_clients, self.ftrl.min_separation)

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """(Σ_i Δ_i + w_t)/r_t; w_t from the server's stream in central mode (the clients' under SecAgg+)."""
        total = weighted_sum([u.update for u in updates], np.ones(len(updates)))
        if self.stream is not None:
            total = total + advance_to(self.stream, server_round - 1)
        mean: np.ndarray = total / max(self.contributors(server_round, self.sampled.get(server_round, len(updates))), 1)
        return mean

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        """Uniform (the sum is divided by r_t in :meth:`aggregate_updates`), with the dense uplink's metrics."""
        self.uplink_total, metrics = uplink_metrics(updates, self.uplink_total, self.num_params, self.num_params)
        return np.ones(len(updates)), metrics

    def step(self, server_round: int, accepted: list[ClientUpdate]) -> dict[str, Any]:
        metrics = super().step(server_round, accepted)
        if self.ftrl is not None and not self.ftrl.secure_aggregation:
            metrics.pop("mean_update_norm", None)  # noise-free clipped updates: not for the round records
        return metrics

    # ---- accounting --------------------------------------------------------------------------
    def population_charge(self, server_round: int, accepted: list[ClientUpdate],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().population_charge(server_round, accepted, records)
        ftrl = self.ftrl
        if ftrl is None:
            return out
        if self.secure_sum.unreleased is None:
            if self.secure_aggregation and self.secure_sum.contributors > 0:  # a reconstructed sum is released to the server
                inside = {int(r["client_id"]) for r in records
                          if r.get("client_id") is not None and r.get("status") in ("ok", "withheld", "rejected")}
                self.present = inside if self.present is None else self.present & inside
                self.released_round = server_round
            elif not self.secure_aggregation and accepted:
                self.released_round = server_round
        t = min(self.released_round, ftrl.rounds)
        if t > 0:
            z_eff = ftrl.effective_multiplier(t, max(self.present_count(), 1))
            self.ledger.restate_population([(z_eff, 1.0, 1)], ftrl.delta)
            out["noise_multiplier_effective"] = z_eff
        eps = self.ledger.population_epsilon()
        if ftrl.min_separation > 1:
            out.update(ftrl_min_separation=ftrl.min_separation,
                       clients_in_turn=turn_size(server_round, ftrl.num_clients, ftrl.min_separation))
        out.update(epsilon=eps, epsilon_vs_release=eps, epsilon_budget=ftrl.epsilon(), delta=ftrl.delta,
                   noise_multiplier=ftrl.noise_multiplier, sensitivity=ftrl.sensitivity(t) if t else 0.0,
                   ftrl_mechanism=ftrl.factorization.name, sample_rate=ftrl.sample_rate,
                   adversary="server" if ftrl.secure_aggregation else "release")
        if ftrl.secure_aggregation:
            out.update(max_epsilon_vs_server=eps, clients_present=self.present_count(),
                       epsilon_vs_server_proven=False, epsilon_vs_server_caveat=threat_models.ROUNDED_SUM_CAVEAT,
                       epsilon_guarantee="DP-FTRL, each client adds its noise stream under SecAgg+: against the "
                                         "server and observers of the release (no sampling assumption)")
            for r in records:
                if r.get("client_id") is not None and t > 0:
                    r["epsilon_vs_server"] = eps
        else:
            out["epsilon_guarantee"] = ("DP-FTRL, noise added by the server: against observers of the released "
                                        "models only; the server sees every clipped update, no epsilon holds "
                                        "against it")
        return out

    def client_record(self, reply: Any, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        rec = super().client_record(reply, metrics)
        if self.ftrl is not None:
            rec.update(epsilon_budget=self.ftrl.epsilon(), delta=self.ftrl.delta,
                       noise_multiplier=self.ftrl.noise_multiplier, sample_rate=self.ftrl.sample_rate)
            if isinstance(metrics.get("in_turn"), bool):  # what the client says it did (the schedule is public)
                rec["in_turn"] = metrics["in_turn"]
        return rec

    # ---- checkpoint ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        state = super().checkpoint_state()
        stream = self.stream.state_dict() if self.stream is not None else self._stream_state
        state["ftrl"] = {"released_round": self.released_round,
                         "present": None if self.present is None else sorted(self.present),
                         "stream": stream}
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        super().load_checkpoint_state(state)
        ftrl = dict(state.get("ftrl") or {})
        self.released_round = int(ftrl.get("released_round", 0))
        present = ftrl.get("present")
        self.present = None if present is None else {int(c) for c in present}
        stream = ftrl.get("stream")
        if stream is not None:
            if self.stream is not None:
                self.stream.load_state_dict(dict(stream))
            else:
                self._stream_state = dict(stream)
