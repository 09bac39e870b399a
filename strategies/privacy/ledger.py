"""The server's own privacy ledger: ε per client, composed by the server's accountant.

The ledger never takes a client's word for ε. The server charges a client with the history of
subsampled-Gaussian steps its reply implies — from parameters the server fixes itself (client-level
σ, q) or the client's declared mechanism parameters (record-level DP-SGD: z, q, steps of the round,
checked for consistency) — and composes them with a standard accountant (heterogeneous composition:
each round is charged with the noise it actually carried). A client's own report is only cross-checked
(:meth:`PrivacyLedger.mismatch`).

Two kinds of charges:

* ``charge(client_id, history)`` — what one client's reply released (record-level families);
* ``charge_population(history)`` — a mechanism applied to the whole population in a round (client-level
  DP with Poisson sampling: every client accrues ε each round, sampled or not);
* ``restate_population(history)`` — the population's whole history replaced by one that covers every round
  so far (DP-FTRL: the rounds are rows of one Gaussian mechanism, not separate mechanisms).

A client's ε is the composition of its own charges and the population's.

Neighbouring relation. A record-level charge names the relation it is composed under (``relation``:
``add-remove`` or ``replace-one``, run-config ``record-neighbours``); the ledger maps the run's
``accountant`` and that relation to one accountant (:func:`~strategies.privacy.accountants.record_accountant`),
the very mapping the client used for its own ε, so the two agree. Charges without a relation, and the
population's (client-level DP: one whole client's updates zeroed out, sensitivity C, which the add/remove analysis
of ``accountant`` computes), are composed by ``accountant``. A client's relation is fixed by its first charge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from strategies.privacy.accountants import (
    ADD_REMOVE,
    RECORD_NEIGHBOURS,
    REPLACE_ONE,
    History,
    compact_history,
    epsilon_of,
    record_accountant,
)


class PrivacyLedger:
    """Per-client histories plus a population history, composed by the ``accountant`` (see module docstring)."""

    def __init__(self, accountant: str = "rdp", rel_tol: float = 1e-6, report_slack: float = 0.0) -> None:
        self.accountant = accountant
        self.rel_tol = rel_tol
        #: a client's report may exceed the server's ε by this relative amount and still agree: set where the server
        #: charges a mechanism calibrated to be at least as private as the plan the client accounts (the distributed
        #: discrete Gaussian, whose Gaussian equivalent exceeds σ by the calibration's tolerance). Never below: a
        #: report under the server's ε is always flagged.
        self._report_slack = report_slack
        self.histories: dict[int, History] = {}
        self.deltas: dict[int, float] = {}
        self.population: History = []
        self.population_delta: float | None = None
        self.relations: dict[int, str] = {}  # client_id -> record-level relation of its charges (absent: add/remove)
        #: clients charged only through contested claims so far: their relation is replace-one (the larger ε)
        #: until the client's own first uncontested reply fixes it
        self.provisional: set[int] = set()
        self._cache: dict[int, float] = {}

    # ---- charging --------------------------------------------------------------------
    def charge(self, client_id: int, history: Iterable[Sequence[float]], delta: float,
               relation: str = ADD_REMOVE, provisional: bool = False) -> None:
        """Charge ``history`` at ``delta`` to ``client_id``, composed under the record-level ``relation``
        (a ``ValueError`` when it differs from the relation of the client's earlier charges).

        ``provisional``: a charge whose claimant the server cannot authenticate (a contested client id). It never
        fixes the client's relation: a client charged only provisionally is composed under replace-one (the
        larger ε) until its own first charge fixes the relation, which then applies to the whole history."""
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        record_accountant(self.accountant, relation)  # an unknown relation raises here
        if provisional:
            if not self.histories.get(client_id) or client_id in self.provisional:
                self.provisional.add(client_id)
                self.relations[client_id] = REPLACE_ONE
            relation = self.relation(client_id)  # composed under the client's own relation once it is fixed
        elif client_id in self.provisional:
            self.provisional.discard(client_id)
            self.relations.pop(client_id, None)
            if relation != ADD_REMOVE:
                self.relations[client_id] = relation
        if self.relation(client_id) != relation and self.histories.get(client_id):
            raise ValueError(f"client {client_id} was charged under {self.relation(client_id)!r} neighbours, "
                             f"not {relation!r}")
        if relation != ADD_REMOVE:
            self.relations[client_id] = relation
        self.histories[client_id] = compact_history(self.histories.get(client_id, []) + list(history))
        self.deltas[client_id] = float(delta)
        self._cache.pop(client_id, None)

    def charge_population(self, history: Iterable[Sequence[float]], delta: float) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.population = compact_history(self.population + list(history))
        self.population_delta = float(delta)
        self._cache.clear()

    def restate_population(self, history: Iterable[Sequence[float]], delta: float) -> None:
        """Replace the population history by ``history``: for a mechanism whose whole release so far is one
        event that grows with every round (DP-FTRL's matrix mechanism: the Gaussian of the rows released so far,
        :mod:`strategies.privacy.ftrl_accounting`), so composing its rounds would count the noise twice."""
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.population = compact_history(history)
        self.population_delta = float(delta)
        self._cache.clear()

    def relation(self, client_id: int) -> str:
        """The record-level relation ``client_id``'s charges are composed under (``add-remove`` by default)."""
        return self.relations.get(client_id, ADD_REMOVE)

    def declared_relation(self, client_id: int, declared: Any) -> str:
        """The relation to charge a record-level reply under: what it declares (metric ``record_neighbours``),
        replace-one when it declares none; a ``ValueError`` for an unknown relation or one that differs from
        the relation of the client's earlier charges (fixed at first contact, like its noise)."""
        relation = REPLACE_ONE if declared is None else declared
        if not isinstance(relation, str) or relation not in RECORD_NEIGHBOURS:
            text = repr(relation)
            raise ValueError(f"declared record_neighbours = {text if len(text) <= 60 else text[:57] + '...'} is "
                             f"not one of {list(RECORD_NEIGHBOURS)}")
        if self.histories.get(client_id) and client_id not in self.provisional and self.relation(client_id) != relation:
            raise ValueError(f"declared record_neighbours = {relation!r} differs from the "
                             f"{self.relation(client_id)!r} client {client_id} was charged under")
        return relation

    def accountant_for(self, client_id: int) -> str:
        """The accountant that composes ``client_id``'s ε: ``accountant`` under its relation."""
        return record_accountant(self.accountant, self.relation(client_id))

    @property
    def report_slack(self) -> float:
        return self._report_slack

    def allow_report_slack(self, slack: float) -> None:
        """Set the report slack once, when the charged mechanism is known (before round 1); a second, different value
        is refused, so a report judged in one round is judged the same in every round."""
        if self._report_slack and self._report_slack != slack:
            raise RuntimeError(f"the report slack is {self._report_slack} for this run; refusing {slack}")
        self._report_slack = float(slack)

    def register(self, client_id: int) -> None:
        """Make a client known (its ε is then at least the population's)."""
        self.histories.setdefault(client_id, [])

    # ---- reading ---------------------------------------------------------------------
    def epsilon(self, client_id: int) -> float:
        """ε of ``client_id`` so far (0 when nothing was charged)."""
        if client_id not in self._cache:
            hist = self.population + self.histories.get(client_id, [])
            delta = self.deltas.get(client_id, self.population_delta)
            self._cache[client_id] = 0.0 if not hist or delta is None else epsilon_of(
                hist, delta, self.accountant_for(client_id))
        return self._cache[client_id]

    def population_epsilon(self) -> float:
        if not self.population or self.population_delta is None:
            return 0.0
        return epsilon_of(self.population, self.population_delta, self.accountant)

    def charged(self, client_id: int) -> bool:
        """Whether any mechanism was charged to the client (False: no privacy accounting, not ε = 0)."""
        return bool(self.population or self.histories.get(client_id))

    def epsilons(self) -> dict[int, float]:
        return {cid: self.epsilon(cid) for cid in sorted(self.histories)}

    def max_epsilon(self) -> float:
        values = list(self.epsilons().values()) or [self.population_epsilon()]
        return max(values)

    def mismatch(self, client_id: int, reported: Any) -> str | None:
        """A note when a client's reported ε disagrees with the server's (None when they agree or no report)."""
        if isinstance(reported, bool) or not isinstance(reported, (int, float)) or not math.isfinite(reported):
            return None
        ours = self.epsilon(client_id)
        if math.isclose(float(reported), ours, rel_tol=self.rel_tol, abs_tol=1e-12):
            return None
        if ours <= float(reported) <= ours * (1.0 + self.report_slack):  # the client's plan bounds the charge
            return None
        return f"client reports epsilon_spent={float(reported):.6g}, the server's ledger {ours:.6g}"

    # ---- persistence -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"accountant": self.accountant,
                "histories": {str(k): [list(h) for h in v] for k, v in self.histories.items()},
                "deltas": {str(k): v for k, v in self.deltas.items()},
                "relations": {str(k): v for k, v in self.relations.items()},
                "provisional": sorted(self.provisional),
                "population": [list(h) for h in self.population], "population_delta": self.population_delta}

    def load(self, state: Mapping[str, Any]) -> None:
        self.accountant = str(state.get("accountant", self.accountant))
        self.histories = {int(k): compact_history(v) for k, v in dict(state.get("histories", {})).items()}
        self.deltas = {int(k): float(v) for k, v in dict(state.get("deltas", {})).items()}
        self.relations = {int(k): str(v) for k, v in dict(state.get("relations", {})).items()}  # older: add/remove
        self.provisional = {int(k) for k in state.get("provisional", [])}
        self.population = compact_history(state.get("population", []))
        pd = state.get("population_delta")
        self.population_delta = None if pd is None else float(pd)
        self._cache.clear()
