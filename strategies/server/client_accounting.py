"""The server's accounting of client-level DP: what each round is charged, in which view, and what ε it reports.

A round with r' of the r_t sampled updates in its sum (all that arrived without secure aggregation) is charged with
the noise the server actually saw: σ·√(r'/r_t) for the sum, one update's σ/√r_t alone (:meth:`round_charge`); the
distributed discrete Gaussian's rounds at its Gaussian equivalent 1/(a + τ√d) (Kairouz et al. 2021, Prop. 14: an
upper bound of its RDP at every order). Four ledgers compose the rounds:

* ``ledger`` (the engine's) — the headline the budget is for: the sum's multiplier under secure aggregation, one
  update's without, at the accounted rate q (1 against the server that draws the sample, r/n for observers of the
  release), or 1 in a round whose dropouts revealed the count;
* ``other_view`` — the other of those two multipliers at the same rate;
* ``release_view`` — the released sum, amplified at q = r/n only where nothing in the release reveals the count;
* ``server_view`` — per client, one unamplified Gaussian per round its update reached the server.

An amplified view of a secure sum also reports the δ its guarantee holds at (``delta_total``, ``delta_vs_release``):
the accountant's δ plus what SecAgg+'s minimum cohort adds (:mod:`strategies.privacy.secure_minimum`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from logging import WARNING
from typing import Any

from flwr.common import log

from strategies.privacy import threat_models
from strategies.privacy.accountants import History, epsilon_of
from strategies.privacy.budget import exceeds_budget
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.privacy.ledger import PrivacyLedger
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.privacy.secure_minimum import planned_delta, secure_minimum_delta, total_delta
from strategies.server.adaptive_clip import ServerClip
from strategies.server.admission import ClientUpdate
from strategies.server.secure_sum import MIN_SECURE_SURVIVORS, SecureSumAdapter


class ClientLevelAccounting:
    """The four ledgers of a client-level DP run and the charge of each round (module docstring). ``ledger`` is the
    engine's; :meth:`bind` gives the run's mechanism (and its discrete secure sum) once it is built."""

    def __init__(self, ledger: PrivacyLedger) -> None:
        self.ledger = ledger
        self.other_view = PrivacyLedger(ledger.accountant)
        self.server_view = PrivacyLedger(ledger.accountant)
        self.release_view = PrivacyLedger(ledger.accountant)
        self.dp: ClientLevelDP | None = None
        self.ddg: DistributedDiscreteGaussian | None = None

    def bind(self, dp: ClientLevelDP, ddg: DistributedDiscreteGaussian | None) -> None:
        self.dp, self.ddg = dp, ddg
        if ddg is None and (planned := planned_delta(dp, MIN_SECURE_SURVIVORS)) > 2 * dp.delta:
            log(WARNING, "the budget's ε %.4f holds at δ %.3g, not %.3g: under secret sampling a round of fewer than "
                "%d clients releases nothing, which the accountant does not model (strategies.privacy.secure_minimum); "
                "more clients a round, or client-dp-adversary = 'server', avoid it",
                dp.epsilon(), planned, dp.delta, MIN_SECURE_SURVIVORS)

    def mechanism(self) -> ClientLevelDP:
        assert self.dp is not None, "the mechanism is bound before the first round"
        return self.dp

    # ---- what a round is charged ----------------------------------------------------------------
    def round_charge(self, survivors: int, sampled: int) -> tuple[float, float]:
        """(aggregate, individual) noise multipliers of a round with ``survivors`` of ``sampled`` updates summed:
        the sum of r' updates each carrying std s = C·σ_t has multiplier s√r'/C; one update has s/C.

        Under adaptive clipping each update carries z_Δ > z and each count share σ_b/√r: the pair is one Gaussian
        with multiplier z (Andrew et al. 2021, Thm 1: z⁻² = z_Δ⁻² + (2σ_b)⁻², per update and for any r' of them),
        so the round is charged at the run's z, exactly as a fixed-clip round."""
        dp = self.mechanism()
        if self.ddg is not None:  # the discrete sum's Gaussian equivalent (an RDP upper bound at every order)
            return self.ddg.gaussian_equivalent(survivors, sampled), self.ddg.gaussian_equivalent(1, sampled)
        per_update = dp.noise_std(sampled) / dp.clip
        return per_update * math.sqrt(survivors), per_update

    def headline_charge(self, survivors: int, sampled: int) -> tuple[float, float]:
        """(the multiplier the budget is for, the other view's) of such a round."""
        z_sum, z_ind = self.round_charge(survivors, sampled)
        return (z_sum, z_ind) if self.mechanism().secure_aggregation else (z_ind, z_sum)

    def charged_sample_rate(self, survivors: int, sampled: int) -> float:
        """The rate the budget charges such a round at: the mechanism's accounted q
        (:attr:`ClientLevelDP.accounted_sample_rate`), except 1 when dropouts left fewer survivors than sampled
        clients, whose sum then carries σ·√(r'/r_t) and so reveals the count (and with it part of who was
        sampled): amplification by secret sampling does not hold for that round."""
        return self.mechanism().accounted_sample_rate if survivors >= sampled else 1.0

    def release_sample_rate(self, survivors: int, sampled: int) -> float:
        """The rate a round's release is amplified at (its ``epsilon_vs_release``): q = r/n only for a continuous
        Gaussian secure sum of every sampled update (:attr:`ClientLevelDP.release_sample_rate`), else 1 (the discrete
        Gaussian's bound is not analysed under amplification; dropouts and per-update noise reveal the count)."""
        return self.mechanism().release_sample_rate if self.ddg is None and survivors >= sampled else 1.0

    # ---- the budget -----------------------------------------------------------------------------
    def epsilon_after(self, history: History) -> float:
        return epsilon_of(history, self.mechanism().delta, self.ledger.accountant)

    def exceeds_with(self, multiplier: float, rate: float) -> bool:
        """Whether charging one more round at ``multiplier`` and ``rate`` would exceed the budget."""
        dp = self.mechanism()
        return exceeds_budget(self.epsilon_after(self.ledger.population + [(multiplier, rate, 1)]), dp.epsilon())

    def next_round_exceeds(self) -> bool:
        """Whether one more planned round (every sampled client summed) would exceed the budget."""
        dp = self.mechanism()
        return self.exceeds_with(dp.budget_noise_multiplier, dp.accounted_sample_rate)

    def unmask_refusal(self, survivors: int, sampled: int) -> str | None:
        """Why the budget cannot pay for a secure sum of ``survivors`` of ``sampled`` updates (None: it can)."""
        dp = self.mechanism()
        kept = min(survivors, max(sampled, 1))
        z_budget, _ = self.headline_charge(kept, max(sampled, 1))
        if self.exceeds_with(z_budget, self.charged_sample_rate(kept, max(sampled, 1))):
            return (f"budget: {survivors} of {sampled} sampled updates would release multiplier {z_budget:.4f}, "
                    f"more ε than the planned budget {dp.epsilon():.4f} has left")
        return None

    def minimum_cohort_delta(self, rate: float, rounds: int) -> float:
        """η of ``rounds`` rounds drawn at sampling ``rate``: a continuous Gaussian secure sum released only from
        :data:`MIN_SECURE_SURVIVORS` clients (:func:`secure_minimum_delta`); 0 without SecAgg+, under the discrete
        Gaussian (never amplified) or at q = 1."""
        dp = self.mechanism()
        if not dp.secure_aggregation or self.ddg is not None:
            return 0.0
        return secure_minimum_delta(dp.num_clients, rate, rounds, MIN_SECURE_SURVIVORS)

    # ---- charging a round -----------------------------------------------------------------------
    def charge(self, server_round: int, seen: int, survivors: int, sampled: int, records: list[dict[str, Any]], *,
               released: bool) -> dict[str, Any]:
        """Charge a round in which the server saw ``seen`` updates, ``survivors`` of the ``sampled`` inside the
        released sum: the headline and other views, the release's view when something of it is ``released``, and
        the server's view of each record whose update it received. Returns the sum's effective multiplier."""
        dp = self.mechanism()
        if seen <= 0 or sampled <= 0:
            return {}
        survivors = min(max(survivors, 1), sampled)
        z_sum, _ = self.round_charge(survivors, sampled)
        z_budget, z_other = self.headline_charge(survivors, sampled)  # z_budget: the multiplier the server saw
        rate = self.charged_sample_rate(survivors, sampled)
        if self.exceeds_with(z_budget, rate):
            log(WARNING, "round %d: %d of %d sampled updates released multiplier %.4f, more than the planned "
                "budget %.4f has left; charged as released", server_round, survivors, sampled, z_budget, dp.epsilon())
        self.ledger.charge_population([(z_budget, rate, 1)], dp.delta)
        self.other_view.charge_population([(z_other, rate, 1)], dp.delta)
        if released:  # it carries the sum's noise; amplified where nothing in the release reveals the count
            self.release_view.charge_population([(z_sum, self.release_sample_rate(survivors, sampled), 1)], dp.delta)
        for r in records:  # every reply whose update the server received, inside the sum or alone
            if r.get("client_id") is not None and r.get("status") in ("ok", "withheld", "rejected"):
                self.server_view.charge(int(r["client_id"]), [(z_budget, 1.0, 1)], dp.delta)
        if survivors < sampled and dp.secure_aggregation:
            log(WARNING, "round %d: %d of %d sampled clients were aggregated; the sum carried multiplier %.4f, "
                "accounted as such", server_round, survivors, sampled, z_budget)
        return {"noise_multiplier_effective": z_sum}

    def records_epsilon(self, records: list[dict[str, Any]], *, withheld: bool) -> dict[str, Any]:
        """Each record's ``epsilon_vs_server`` (clients whose updates reached the server), and the round's ε
        against the release (with the headline's when the round was withheld)."""
        out: dict[str, Any] = {"epsilon": self.ledger.population_epsilon()} if withheld else {}
        for r in records:
            cid = r.get("client_id")
            if cid is not None and self.server_view.histories.get(int(cid)):
                r["epsilon_vs_server"] = self.server_view.epsilon(int(cid))
        out["epsilon_vs_release"] = self.release_view.population_epsilon()
        return out

    def summary(self, server_round: int) -> dict[str, Any]:
        """The round record's ε of every view and the mechanism's parameters after ``server_round`` drawn rounds."""
        dp = self.mechanism()
        aggregate, individual = (self.ledger, self.other_view) if dp.secure_aggregation else \
            (self.other_view, self.ledger)
        out: dict[str, Any] = {}
        if self.server_view.histories:
            out["max_epsilon_vs_server"] = self.server_view.max_epsilon()
        if dp.secure_aggregation:  # the discrete Gaussian's sum is analysed; a rounded continuous one is not
            out["epsilon_vs_server_proven"] = self.ddg is not None
            if self.ddg is None:
                out["epsilon_vs_server_caveat"] = threat_models.ROUNDED_SUM_CAVEAT
        epsilon = self.ledger.population_epsilon()
        eta = self.minimum_cohort_delta(dp.accounted_sample_rate, server_round)
        if eta > 0:  # the budget's guarantee holds at δ + e^ε η
            out.update(delta_secure_minimum=eta, delta_total=total_delta(dp.delta, epsilon, eta))
        eta_release = self.minimum_cohort_delta(self.release_sample_rate(1, 1), server_round)
        if eta_release > 0 and self.release_view.population:
            out["delta_vs_release"] = total_delta(dp.delta, self.release_view.population_epsilon(), eta_release)
        out.update(epsilon=epsilon, epsilon_aggregate=aggregate.population_epsilon(),
                   epsilon_individual=individual.population_epsilon(), delta=dp.delta,
                   noise_multiplier=dp.noise_multiplier, sample_rate=dp.sample_rate, epsilon_budget=dp.epsilon(),
                   accounted_sample_rate=dp.accounted_sample_rate, adversary=dp.adversary,
                   secure_sum=("distributed discrete Gaussian" if self.ddg is not None else
                               "continuous Gaussian" if dp.secure_aggregation else "none"),
                   epsilon_guarantee=("aggregate (secure aggregation)" if dp.secure_aggregation
                                      else "individual update (the server sees every update)")
                   + (", against the server that draws the sample (no amplification)" if dp.adversary == "server"
                      else ", against observers of the release (amplified by secret sampling)"))
        return out

    # ---- the round record -----------------------------------------------------------------------
    def round_record(self, server_round: int, accepted: list[ClientUpdate], records: list[dict[str, Any]],
                     sampled: int, *, secure: SecureSumAdapter | None, clip: ServerClip | None,
                     count_in_sum: bool) -> dict[str, Any]:
        """A round's privacy record: withhold what must not be released (``secure``: the round's SecAgg+ state, None
        without SecAgg+), :meth:`charge` what the server saw, step the adaptive ``clip``, report every view's ε."""
        out: dict[str, Any] = {"clients_sampled": sampled, "secure_aggregation": secure is not None}
        if secure is not None and secure.unreleased is not None:
            out.update(secure.withhold_unreleased(records))
            if self.dp is not None:
                out["epsilon"] = self.ledger.population_epsilon()
            return out
        withheld = secure is not None and secure.withhold_rejected(server_round, records)
        if withheld:
            out["round_withheld"] = True
        if self.dp is None:
            return out
        # what the server has seen: the reconstructed sum of the contributors (secure aggregation), else every
        # update that arrived (accepted or not); either is charged whether or not the round is then released
        seen = secure.contributors if secure is not None else \
            sum(1 for r in records if r.get("status") in ("ok", "withheld", "rejected"))
        survivors = seen if secure is not None else len(accepted)  # inside the released sum
        out.update(self.charge(server_round, seen, survivors, sampled, records,
                               released=not withheld and (secure is not None or bool(accepted))))
        out.update(self.records_epsilon(records, withheld=withheld))
        if clip is not None:
            out.update(clip.adapt([] if withheld else accepted, count_sum=secure.count_sum if secure else None,
                                  share_in_sum=count_in_sum, contributors=secure.contributors if secure else 0))
        out.update(self.summary(server_round))
        return out

    # ---- checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"other_view": self.other_view.state(), "server_view": self.server_view.state(),
                "release_view": self.release_view.state()}

    def load(self, state: Mapping[str, Any]) -> None:
        self.other_view.load(dict(state.get("other_view", {})))
        self.server_view.load(dict(state.get("server_view", {})))
        self.release_view.load(dict(state.get("release_view", {})))
