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
  DP with Poisson sampling: every client accrues ε each round, sampled or not).

A client's ε is the composition of its own charges and the population's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from strategies.privacy.accountants import History, compact_history, epsilon_of


class PrivacyLedger:
    """Per-client histories plus a population history, composed by the ``accountant`` (see module docstring)."""

    def __init__(self, accountant: str = "rdp", rel_tol: float = 1e-6) -> None:
        self.accountant = accountant
        self.rel_tol = rel_tol
        self.histories: dict[int, History] = {}
        self.deltas: dict[int, float] = {}
        self.population: History = []
        self.population_delta: float | None = None
        self._cache: dict[int, float] = {}

    # ---- charging --------------------------------------------------------------------
    def charge(self, client_id: int, history: Iterable[Sequence[float]], delta: float) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.histories[client_id] = compact_history(self.histories.get(client_id, []) + list(history))
        self.deltas[client_id] = float(delta)
        self._cache.pop(client_id, None)

    def charge_population(self, history: Iterable[Sequence[float]], delta: float) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.population = compact_history(self.population + list(history))
        self.population_delta = float(delta)
        self._cache.clear()

    def register(self, client_id: int) -> None:
        """Make a client known (its ε is then at least the population's)."""
        self.histories.setdefault(client_id, [])

    # ---- reading ---------------------------------------------------------------------
    def epsilon(self, client_id: int) -> float:
        """ε of ``client_id`` so far (0 when nothing was charged)."""
        if client_id not in self._cache:
            hist = self.population + self.histories.get(client_id, [])
            delta = self.deltas.get(client_id, self.population_delta)
            self._cache[client_id] = 0.0 if not hist or delta is None else epsilon_of(hist, delta, self.accountant)
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
        return f"client reports epsilon_spent={float(reported):.6g}, the server's ledger {ours:.6g}"

    # ---- persistence -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"accountant": self.accountant,
                "histories": {str(k): [list(h) for h in v] for k, v in self.histories.items()},
                "deltas": {str(k): v for k, v in self.deltas.items()},
                "population": [list(h) for h in self.population], "population_delta": self.population_delta}

    def load(self, state: Mapping[str, Any]) -> None:
        self.accountant = str(state.get("accountant", self.accountant))
        self.histories = {int(k): compact_history(v) for k, v in dict(state.get("histories", {})).items()}
        self.deltas = {int(k): float(v) for k, v in dict(state.get("deltas", {})).items()}
        self.population = compact_history(state.get("population", []))
        pd = state.get("population_delta")
        self.population_delta = None if pd is None else float(pd)
        self._cache.clear()
