"""Client-level DP for FedAvg-style training: clip the whole update, add Gaussian noise, account.

Shared by DP-FedAvg (Fed-SMP Algorithm 1), Fed-SMP (Algorithm 2) and DP2-FedSAM (Algorithm 2).

What it protects: the participation and data of a *whole client* (client-level DP). Each of
the r clients sampled per round (uniformly without replacement, q = r/n) clips its update to
‖Δ‖ ≤ C and adds N(0, C²σ²/r) itself, so the *sum* of the r updates carries N(0, C²σ²): the
central Gaussian mechanism with noise multiplier σ on a sum of sensitivity C. The reported ε
(subsampled Gaussian, q = r/n, T rounds, Opacus accountant) is the guarantee of that sum —
i.e. against an observer of the aggregate, which assumes secure aggregation hides individual
updates (Fed-SMP Alg. 1 line 23). An untrusted server that sees each noisy update alone only
gets noise multiplier σ/√r per update; :meth:`ClientLevelDP.epsilon_individual` reports that
weaker guarantee too, so nobody mistakes one for the other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from strategies.accounting import calibrate_noise_multiplier, epsilon_of


def clip_by_l2(update: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """Scale ``update`` to ℓ2 norm at most ``clip``: Δ · min(1, C/‖Δ‖). Returns (clipped, original norm)."""
    if clip <= 0:
        raise ValueError(f"clip norm must be > 0, got {clip}")
    norm = float(np.linalg.norm(update))
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return update * factor, norm


@dataclass(frozen=True)
class ClientLevelDP:
    """The client-level Gaussian mechanism of DP-FedAvg with its accountant.

    ``noise_multiplier`` σ applies to the sum of ``clients_per_round`` clipped updates.
    """

    noise_multiplier: float
    clip: float
    clients_per_round: int
    num_clients: int
    rounds: int
    delta: float
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        if not 0 < self.clients_per_round <= self.num_clients:
            raise ValueError(f"clients per round r={self.clients_per_round} must be in 1..n={self.num_clients}")
        if self.noise_multiplier < 0 or self.clip <= 0 or self.rounds <= 0 or not 0 < self.delta < 1:
            raise ValueError(f"invalid client-level DP parameters: {self}")

    @property
    def sample_rate(self) -> float:
        """q = r / n (uniform sampling without replacement, accounted as Poisson with the same rate)."""
        return self.clients_per_round / self.num_clients

    @property
    def per_client_std(self) -> float:
        """Std of the noise each client adds: C·σ/√r (so the sum over r clients has std C·σ)."""
        return self.clip * self.noise_multiplier / math.sqrt(self.clients_per_round)

    def privatize(self, update: np.ndarray, rng: np.random.Generator, mask: np.ndarray | None = None) -> tuple[np.ndarray, float]:
        """Clip ``update`` to C and add N(0, C²σ²/r) (only on ``mask`` coordinates if given). Returns (noisy, pre-clip norm)."""
        clipped, norm = clip_by_l2(update, self.clip)
        if mask is None:
            noise = rng.normal(0.0, self.per_client_std, size=clipped.shape)
            return clipped + noise, norm
        out = clipped.copy()
        out[mask] += rng.normal(0.0, self.per_client_std, size=int(np.count_nonzero(mask)) if mask.dtype == bool else len(mask))
        return out, norm

    def _epsilon(self, noise_multiplier: float, rounds_done: int | None) -> float:
        # epsilon_of gives 0 for no rounds and inf for zero noise
        t = self.rounds if rounds_done is None else rounds_done
        return epsilon_of([(noise_multiplier, self.sample_rate, t)], self.delta, self.accountant)

    def epsilon(self, rounds_done: int | None = None) -> float:
        """ε after ``rounds_done`` rounds (default: all planned rounds) for the aggregate (σ, q)."""
        return self._epsilon(self.noise_multiplier, rounds_done)

    def epsilon_individual(self, rounds_done: int | None = None) -> float:
        """ε against a server that sees each noisy update alone (noise multiplier σ/√r), same q and T."""
        return self._epsilon(self.noise_multiplier / math.sqrt(self.clients_per_round), rounds_done)

    @classmethod
    def calibrated(cls, target_epsilon: float, *, clip: float, clients_per_round: int, num_clients: int, rounds: int,
                   delta: float, accountant: str = "rdp") -> ClientLevelDP:
        """σ such that T rounds at q = r/n spend ``target_epsilon`` (to 0.1 %)."""
        sigma = calibrate_noise_multiplier(target_epsilon, delta, clients_per_round / num_clients, rounds, accountant)
        return cls(sigma, clip, clients_per_round, num_clients, rounds, delta, accountant)


def default_client_delta(num_clients: int) -> float:
    """δ = n^-1.1 (McMahan et al. 2018; Fed-SMP Sec. 6.2), below 1/n."""
    if num_clients < 2:
        raise ValueError(f"client-level δ needs n >= 2 clients, got {num_clients}")
    return float(num_clients) ** -1.1


def theorem1_noise_multiplier(epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """Fed-SMP Theorem 1 (Eq. 10): σ = sqrt(7 q² T (ε + 2 log(1/δ)) / ε²) suffices for (ε, δ) after T rounds.

    A closed-form *upper* bound (valid for ε < 2 log(1/δ) and σ² ≥ 0.7); used only to check
    that the accountant is at least as tight (it must need no more noise for the same ε).
    """
    if not 0 < epsilon < 2 * math.log(1 / delta):
        raise ValueError(f"Theorem 1 needs 0 < ε < 2 log(1/δ) = {2 * math.log(1 / delta):.3f}, got {epsilon}")
    return math.sqrt(7 * sample_rate**2 * rounds * (epsilon + 2 * math.log(1 / delta)) / epsilon**2)


def mechanism_from_config(cfg, num_clients: int) -> ClientLevelDP:
    """The run's client-level mechanism from run-config keys (``noise-multiplier`` or ``target-epsilon``,
    ``clip-norm``, ``clients-per-round`` (0 = all n), ``dp-rounds``/``num-server-rounds``, ``client-delta``
    (0 = n^-1.1), ``accountant``). Server and clients call this with the same inputs, so they agree on σ."""
    r = int(cfg["clients-per-round"]) or num_clients
    rounds = int(cfg.get("dp-rounds", 0)) or int(cfg["num-server-rounds"])
    delta = float(cfg.get("client-delta", 0.0)) or default_client_delta(num_clients)
    return _mechanism(float(cfg["noise-multiplier"]), float(cfg["target-epsilon"]), float(cfg["clip-norm"]),
                      min(r, num_clients), num_clients, rounds, delta, str(cfg.get("accountant", "rdp")))


@functools.lru_cache(maxsize=64)
def _mechanism(sigma: float, target: float, clip: float, r: int, n: int, rounds: int, delta: float,
               accountant: str) -> ClientLevelDP:
    if sigma > 0:
        return ClientLevelDP(sigma, clip, r, n, rounds, delta, accountant)
    return ClientLevelDP.calibrated(target, clip=clip, clients_per_round=r, num_clients=n, rounds=rounds,
                                    delta=delta, accountant=accountant)


@functools.lru_cache(maxsize=4096)
def cached_epsilon(dp: ClientLevelDP, rounds_done: int) -> float:
    """:meth:`ClientLevelDP.epsilon` memoized (the mechanism is frozen/hashable)."""
    return dp.epsilon(rounds_done)
