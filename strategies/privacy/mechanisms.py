"""Mechanisms: ℓ2 clipping and the Gaussian mechanism on a sum of clipped client updates.

Client-level DP (DP-FedAvg / Fed-SMP Alg. 1–2, DP2-FedSAM Alg. 2). What it protects: the whole dataset of one
client under zero-out neighbours (Kairouz et al. 2021; Ponomareva et al. 2023): its update replaced by zero while it
still takes part, so the sum's sensitivity is C (the server sees who takes part and r_t anyway). The replace-one
relation (one client's data swapped for another's) has sensitivity 2C and about twice the ε. Each of the r clients of a round clips its update to
‖Δ‖ ≤ C and adds N(0, C²σ²/r) itself, so the *sum* of the r updates carries N(0, C²σ²): the Gaussian
mechanism with multiplier σ on a sum of sensitivity C. That sum-level guarantee needs every
individual update to be hidden from the server (secure aggregation); a server that reads each update
alone sees multiplier σ/√r, reported as :meth:`ClientLevelDP.epsilon_individual`.

Per-sample clipping for record-level DP-SGD is Opacus' (``fedapp.clients.training``); SoteriaFL clips per
sample in :class:`strategies.soteriafl.GradientOracle`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from strategies.privacy.accountants import epsilon_of
from strategies.privacy.calibration import calibrate_noise_multiplier

#: whom a client-level budget holds against (:class:`ClientLevelDP`)
ADVERSARIES = ("server", "release")
#: t of the norm allowance ‖noise‖ ≤ s(√k + t): a legitimate update exceeds it with probability ≤ e^(−t²/2)
NORM_ALLOWANCE_SIGMAS = 12.0


class NonFiniteUpdate(ValueError):
    """An update with a NaN or infinite coordinate (or norm): it has no ℓ2 norm to clip, so it is never sent."""


def clip_by_l2(update: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """Scale ``update`` to ℓ2 norm at most ``clip``: Δ · min(1, C/‖Δ‖). Returns (clipped, original norm).

    A vector with a non-finite coordinate or norm raises :class:`NonFiniteUpdate`: ``min(1, C/nan)`` is 1,
    so such a vector would leave unclipped and break the sensitivity bound the noise is sized for.
    """
    if clip <= 0:
        raise ValueError(f"clip norm must be > 0, got {clip}")
    with np.errstate(over="ignore", invalid="ignore"):
        norm = float(np.linalg.norm(update))
    if not (np.isfinite(norm) and np.all(np.isfinite(update))):
        raise NonFiniteUpdate(f"the update has {int(np.sum(~np.isfinite(update)))} non-finite coordinate(s) "
                              f"(norm {norm}); it cannot be clipped")
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return update * factor, norm


def noisy_norm_bound(clip: float, noise_std: float, dim: int) -> float:
    """A norm no clipped-and-noised update of ``dim`` coordinates exceeds except with probability ≤ e⁻⁷²:
    C + s(√d + t) (Laurent–Massart concentration of a Gaussian vector's norm, t = 12)."""
    return clip + noise_std * (math.sqrt(dim) + NORM_ALLOWANCE_SIGMAS)


@dataclass(frozen=True)
class ClientLevelDP:
    """The client-level Gaussian mechanism of DP-FedAvg with its accountant.

    ``noise_multiplier`` σ applies to the sum of ``clients_per_round`` clipped updates; clients are
    sampled with rate q = r/n each round for ``rounds`` rounds.

    ``secure_aggregation`` says which multiplier the budget is for. True: the server sees only the sum
    (SecAgg+), ε is the aggregate's (multiplier σ), and each client adds C·σ/√r_t with r_t the round's
    sampled count so the sum always carries σC. False: the server sees every update, ε is one update's
    (multiplier σ/√r), and each client adds the fixed C·σ/√r, at the price of √r times the noise of the
    aggregate for the same ε.

    ``adversary`` says against whom. ``"server"``: the server draws the sample and sees who replies, so a
    round in which a client takes part is an unamplified Gaussian for it; the budget composes T such rounds
    (q = 1, every client could be sampled every round). ``"release"``: whoever sees only the released
    models, amplified by secret Poisson sampling at q = r/n (the papers' accounting).
    """

    noise_multiplier: float
    clip: float
    clients_per_round: int
    num_clients: int
    rounds: int
    delta: float
    accountant: str = "rdp"
    secure_aggregation: bool = True
    adversary: str = "server"

    def __post_init__(self) -> None:
        if not 0 < self.clients_per_round <= self.num_clients:
            raise ValueError(f"clients per round r={self.clients_per_round} must be in 1..n={self.num_clients}")
        if self.adversary not in ADVERSARIES:
            raise ValueError(f"adversary must be one of {ADVERSARIES}, got {self.adversary!r}")
        if self.noise_multiplier < 0 or self.clip <= 0 or self.rounds <= 0 or not 0 < self.delta < 1:
            raise ValueError(f"invalid client-level DP parameters: {self}")

    @property
    def sample_rate(self) -> float:
        """q = r / n."""
        return self.clients_per_round / self.num_clients

    @property
    def release_sample_rate(self) -> float:
        """The sampling rate a release is amplified at: q = r/n when the released sum's noise does not depend on how
        many clients were sampled (SecAgg+: each of r_t clients adds C²σ²/r_t, the sum carries σC whatever r_t is),
        else 1. Without SecAgg+ every update carries the fixed C²σ²/r, so the released mean's noise variance, r_t
        times that, reveals r_t (with d ≫ r_t² coordinates), and with it part of who was sampled: amplification by
        secret sampling does not hold and the release is charged unamplified."""
        return self.sample_rate if self.secure_aggregation else 1.0

    @property
    def accounted_sample_rate(self) -> float:
        """The sampling rate the budget composes: 1 against the server that draws the sample, else the release's
        (:attr:`release_sample_rate`)."""
        return 1.0 if self.adversary == "server" else self.release_sample_rate

    @property
    def per_client_std(self) -> float:
        """Std of the noise each client adds: C·σ/√r (so the sum over r clients has std C·σ)."""
        return self.noise_std()

    @property
    def individual_noise_multiplier(self) -> float:
        """σ/√r: the multiplier protecting one update that the server reads alone."""
        return self.noise_multiplier / math.sqrt(self.clients_per_round)

    def norm_bound(self, dim: int) -> float:
        """The largest ℓ2 norm an honest privatized update of ``dim`` coordinates has (see :func:`noisy_norm_bound`)."""
        return noisy_norm_bound(self.clip, self.per_client_std, dim)

    def noise_std(self, round_clients: int | None = None) -> float:
        """Std of one client's noise in a round with r_t = ``round_clients`` sampled clients: C·σ/√r_t under
        secure aggregation (the sum carries σC), the fixed C·σ/√r without it (each update carries σ/√r)."""
        r = self.clients_per_round if round_clients is None or not self.secure_aggregation else int(round_clients)
        if r < 1:
            raise ValueError(f"a round needs at least 1 sampled client, got {r}")
        return self.clip * self.noise_multiplier / math.sqrt(r)

    def privatize(self, update: np.ndarray, rng: np.random.Generator,
                  round_clients: int | None = None) -> tuple[np.ndarray, float]:
        """Clip ``update`` to C and add N(0, C²σ²/r_t) to every coordinate. Returns (noisy, pre-clip norm)."""
        clipped, norm = clip_by_l2(update, self.clip)
        return clipped + rng.normal(0.0, self.noise_std(round_clients), size=clipped.shape), norm

    @property
    def budget_noise_multiplier(self) -> float:
        """The multiplier the budget is planned on: σ (aggregate, secure aggregation) or σ/√r (one update)."""
        return self.noise_multiplier if self.secure_aggregation else self.individual_noise_multiplier

    def epsilon(self, rounds_done: int | None = None) -> float:
        """ε of the guarantee the budget is for (the aggregate's multiplier with secure aggregation, one
        update's without; against :attr:`adversary`) after ``rounds_done`` rounds (default: all planned)."""
        t = self.rounds if rounds_done is None else rounds_done
        return epsilon_of([(self.budget_noise_multiplier, self.accounted_sample_rate, t)], self.delta,
                          self.accountant)

    def epsilon_aggregate(self, rounds_done: int | None = None) -> float:
        """ε against an observer of the sum only (multiplier σ), same accounted q and T."""
        t = self.rounds if rounds_done is None else rounds_done
        return epsilon_of([(self.noise_multiplier, self.accounted_sample_rate, t)], self.delta, self.accountant)

    def epsilon_individual(self, rounds_done: int | None = None) -> float:
        """ε against a server that sees each noisy update alone (multiplier σ/√r), same accounted q and T."""
        t = self.rounds if rounds_done is None else rounds_done
        return epsilon_of([(self.individual_noise_multiplier, self.accounted_sample_rate, t)], self.delta,
                          self.accountant)

    def epsilon_vs_release(self, rounds_done: int | None = None) -> float:
        """ε against whoever sees only the released models: the sum's multiplier σ, amplified at
        :attr:`release_sample_rate` (q = r/n under SecAgg+, else 1)."""
        t = self.rounds if rounds_done is None else rounds_done
        return epsilon_of([(self.noise_multiplier, self.release_sample_rate, t)], self.delta, self.accountant)

    @classmethod
    def calibrated(cls, target_epsilon: float, *, clip: float, clients_per_round: int, num_clients: int, rounds: int,
                   delta: float, accountant: str = "rdp", secure_aggregation: bool = True,
                   adversary: str = "server") -> ClientLevelDP:
        """σ such that T rounds at the accounted q (1 against the server, r/n against observers of the release under
        SecAgg+, 1 without it: :attr:`release_sample_rate`) spend ``target_epsilon`` (to 0.1 %) for the multiplier
        the budget is for: the aggregate's σ, or one update's σ/√r without secure aggregation."""
        q = 1.0 if adversary == "server" or not secure_aggregation else clients_per_round / num_clients
        z = calibrate_noise_multiplier(target_epsilon, delta, q, rounds, accountant)
        sigma = z if secure_aggregation else z * math.sqrt(clients_per_round)
        return cls(sigma, clip, clients_per_round, num_clients, rounds, delta, accountant, secure_aggregation,
                   adversary)


@functools.lru_cache(maxsize=4096)
def cached_epsilon(dp: ClientLevelDP, rounds_done: int | None) -> float:
    """:meth:`ClientLevelDP.epsilon` memoized (the mechanism is frozen and hashable)."""
    return dp.epsilon(rounds_done)


def max_delta(population: int) -> float:
    """The largest δ the project accepts without an explicit override: 1/(10·N) for N protected units
    (records of a client for record-level DP, clients for client-level DP). A δ near 1/N permits
    mechanisms that publish one unit's data outright with probability δ."""
    if population < 1:
        raise ValueError(f"population must be >= 1, got {population}")
    return 1.0 / (10.0 * population)


def default_client_delta(num_clients: int) -> float:
    """δ = 1/(10 n) for n clients: stricter than Fed-SMP's n^-1.1 (Sec. 6.2; 0.037 at n = 20) and the 1/N
    of DP2-FedSAM's experiments, both of which are too close to 1/n to mean much."""
    if num_clients < 2:
        raise ValueError(f"client-level δ needs n >= 2 clients, got {num_clients}")
    return max_delta(num_clients)
