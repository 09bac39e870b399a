"""Client sampling of a round, from secret randomness by default.

* ``fixed``   exactly r of the n available clients, uniformly without replacement;
* ``poisson`` every available client independently with probability q = r/n (the sampling the
  Poisson subsampled-Gaussian accountant composes; the realized r_t varies). With ``fixed_rate`` set
  (client-level DP: q = r/n of the registered federation), q does not grow when clients are unavailable
  or excluded: they count as sampled and dropped;
* r = 0 or r ≥ n: every client, every round.

Secret by default: the generator is seeded from OS entropy, so no one who knows the run seed can
tell who is sampled (amplification by subsampling needs the sample to be unknown to the observer).
``seed`` makes it reproducible for tests and benchmarks, which voids that amplification; the
strategy marks such runs. The server always knows its own sample: against the server itself
subsampling amplifies nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
MODES = ("fixed", "poisson")


class ClientSampler:
    """Chooses the clients of a round (see the module docstring)."""

    def __init__(self, clients_per_round: int = 0, mode: str = "fixed", seed: int | None = None,
                 rng: np.random.Generator | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
        if clients_per_round < 0:
            raise ValueError(f"clients per round must be >= 0, got {clients_per_round}")
        self.clients_per_round = int(clients_per_round)
        self.mode = mode
        self.seed = seed
        #: OS entropy (PCG64), or the CSPRNG the caller passes (``secure-randomness``)
        self.rng = rng if rng is not None else np.random.default_rng()
        self._fixed_rate: float | None = None

    @property
    def fixed_rate(self) -> float | None:
        """Poisson rate fixed for the run (q = r/n over the registered federation): the accountant's q holds
        whatever is available, and a client that is not available counts as sampled and dropped."""
        return self._fixed_rate

    def fix_rate(self, rate: float) -> None:
        """Fix the Poisson rate once, when the federation's size is known (before round 1); a second, different rate
        would change the q the ledger already charged, and is refused."""
        if self._fixed_rate is not None and self._fixed_rate != rate:
            raise RuntimeError(f"the sampling rate is fixed at {self._fixed_rate} for this run; refusing {rate}")
        self._fixed_rate = float(rate)

    @property
    def secret(self) -> bool:
        return self.seed is None

    def sample_rate(self, num_available: int) -> float:
        """q = r/n of a round with ``num_available`` clients (1 under full participation)."""
        r = self.clients_per_round
        return 1.0 if r == 0 or r >= num_available else r / num_available

    def _rng(self, server_round: int) -> np.random.Generator:
        return self.rng if self.seed is None else np.random.default_rng([int(self.seed), 301, int(server_round)])

    def sample(self, server_round: int, candidates: Sequence[T]) -> list[T]:
        """The round's clients among ``candidates`` (given in a stable order), in that order."""
        n, r = len(candidates), self.clients_per_round
        if self.mode == "poisson" and self.fixed_rate is not None:
            if self.fixed_rate >= 1.0:
                return list(candidates)
            chosen = np.flatnonzero(self._rng(server_round).random(n) < self.fixed_rate)
            return [candidates[int(i)] for i in chosen]
        if r == 0 or r >= n:
            return list(candidates)
        rng = self._rng(server_round)
        if self.mode == "fixed":
            chosen = np.sort(rng.choice(n, size=r, replace=False))
        else:
            chosen = np.flatnonzero(rng.random(n) < r / n)
        return [candidates[int(i)] for i in chosen]

    def state(self) -> dict[str, Any]:
        """The generator's state for a checkpoint: PCG64's; a CSPRNG's key is never written (a resumed run draws
        from a fresh key)."""
        return {"rng": self.rng.bit_generator.state} if self._plain else {}

    @property
    def _plain(self) -> bool:
        """Whether the generator is NumPy's PCG64 (its state may be checkpointed)."""
        return type(self.rng.bit_generator).__name__ == "PCG64"

    def load(self, state: Mapping[str, Any]) -> None:
        if state.get("rng") and self._plain:
            self.rng.bit_generator.state = dict(state["rng"])
