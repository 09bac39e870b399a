"""Privacy of DP-FTRL / the matrix mechanism, without amplification by sampling or shuffling.

The whole run releases C X + Z with Z ~ N(0, (z·clip)²) per entry, and one client moves C X by at most
clip·sens(C) in Frobenius norm (:func:`strategies.privacy.matrix_mechanism.sensitivity`). It is therefore ONE
Gaussian mechanism with multiplier z / sens(C) (Kairouz et al. 2021; Choquette-Choo et al. 2023),
whoever draws the participation pattern: the ε holds against the server. ε comes from Google dp_accounting's PLD
accountant on a ``GaussianDpEvent`` (tight for one Gaussian, within discretisation of the analytic Gaussian
mechanism of Balle & Wang 2018); :func:`zcdp_epsilon` is the looser closed form ρ + 2√(ρ log(1/δ)),
ρ = sens²/(2z²) (Bun & Steinke 2016, Prop. 1.3). Neighbours zero out one client's participations (its updates replaced by zero; n stays public). The replace-one ε
is that of sensitivity 2·sens(C).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.privacy.calibration import calibrate
from strategies.privacy.matrix_mechanism import BandedNoise, Factorization, FloatArray, TreeNoise, sensitivity

#: PLD discretisation of the privacy-loss values (pessimistic; within 0.1 % of the analytic Gaussian for z ≤ 100)
PLD_INTERVAL = 1e-3


def _check(noise_multiplier: float, sens: float, delta: float) -> None:
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be a finite number > 0, got {noise_multiplier}")
    if not (sens > 0 and math.isfinite(sens)):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sens}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def ftrl_event(noise_multiplier: float, sens: float) -> Any:  # a dp_accounting.GaussianDpEvent (untyped package)
    """The run as one dp_accounting event, for a ledger that composes it with other mechanisms."""
    import dp_accounting as dpa

    _check(noise_multiplier, sens, 0.5)
    return dpa.GaussianDpEvent(noise_multiplier / sens)


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(effective_multiplier: float, delta: float) -> float:
    """ε at δ of one Gaussian mechanism with noise std / sensitivity = ``effective_multiplier`` (dp_accounting PLD)."""
    from dp_accounting import pld

    _check(effective_multiplier, 1.0, delta)
    accountant = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    accountant.compose(ftrl_event(effective_multiplier, 1.0))
    return max(float(accountant.get_epsilon(delta)), 0.0)


def ftrl_epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """ε of the run: Z's std is ``noise_multiplier``·clip and the encoder's sensitivity ``sens``."""
    _check(noise_multiplier, sens, delta)
    return gaussian_epsilon(noise_multiplier / sens, delta)


def zcdp_epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """The ρ-zCDP bound: ρ = sens²/(2z²), ε = ρ + 2√(ρ log(1/δ)) (≥ :func:`ftrl_epsilon`)."""
    _check(noise_multiplier, sens, delta)
    rho = sens**2 / (2.0 * noise_multiplier**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def ftrl_noise_multiplier(target_epsilon: float, delta: float, sens: float, rtol: float = 1e-3) -> float:
    """The smallest z (Z's std over the clip) whose run spends at most ``target_epsilon``: z = z_eff·sens with
    z_eff the calibrated Gaussian multiplier (:func:`strategies.privacy.calibration.calibrate`), so
    target·(1 − rtol) ≤ ε ≤ target."""
    _check(1.0, sens, delta)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    start = math.sqrt(2.0 * math.log(1.25 / delta)) / target_epsilon  # Dwork & Roth, Thm A.1
    z_eff = calibrate(lambda z: gaussian_epsilon(z, delta), target_epsilon, start=start, rtol=rtol,
                      what=f"Gaussian multiplier (delta={delta})")
    return z_eff * sens


def ledger_sensitivities(factorization: Factorization, participations: int = 1,
                         min_separation: int = 1) -> FloatArray:
    """sens_t, t = 1..T: the sensitivity of the rows released within the first t rounds (they read only the
    first t columns). Nondecreasing, sens_T = sens(C)."""
    return np.array([sensitivity(factorization.released_encoder(t), participations, min_separation)
                     for t in range(1, factorization.rounds + 1)])


def ledger_epsilons(factorization: Factorization, noise_multiplier: float, delta: float, participations: int = 1,
                    min_separation: int = 1) -> FloatArray:
    """ε_t after t of T rounds: the Gaussian mechanism with multiplier z / sens_t (:func:`ledger_sensitivities`).

    ε_t is cumulative (the released prefix of one mechanism), nondecreasing, and equals :func:`ftrl_epsilon` at
    t = T; a server ledger records ε_t as ``epsilon_vs_server`` rather than adding per-round charges. A round in
    which nothing new reaches the client's columns leaves ε_t unchanged.
    """
    sens = ledger_sensitivities(factorization, participations, min_separation)
    return np.array([ftrl_epsilon(noise_multiplier, float(s), delta) if s > 0 else 0.0 for s in sens])


# ---------------------------------------------------------------------------- the run's mechanism
#: the factorizations a run can use (run-config ``ftrl-mechanism``)
FTRL_FACTORIZATIONS = ("tree", "banded")
#: decimals the band coefficients are rounded to: every process that builds the run's C from (T, b) gets the same
#: matrix bit for bit (the optimiser's last digits may differ between BLAS builds), and ε is computed from it
BAND_DECIMALS = 12


@functools.lru_cache(maxsize=16)
def run_band(rounds: int, bands: int) -> FloatArray:
    """The b-banded Toeplitz coefficients of a run of T rounds (:func:`optimal_banded_coefficients`, rounded to
    :data:`BAND_DECIMALS` decimals; the encoder is exactly these, so its sensitivity is theirs)."""
    from strategies.privacy.matrix_mechanism import optimal_banded_coefficients

    band = np.round(optimal_banded_coefficients(rounds, bands), BAND_DECIMALS)
    band.setflags(write=False)
    return band


@functools.lru_cache(maxsize=16)
def run_factorization(kind: str, rounds: int, bands: int = 1, restart_every: int = 0) -> Factorization:
    """C = B⁻¹A of a run: the online tree (restarted every ``restart_every`` rounds, 0 = never) or the b-banded
    Toeplitz factorization of :func:`run_band`."""
    from strategies.privacy.matrix_mechanism import from_encoder, toeplitz_encoder, tree_aggregation

    if kind == "tree":
        return tree_aggregation(rounds, restart_every or None)
    if kind == "banded":
        return from_encoder(toeplitz_encoder(run_band(rounds, bands), rounds), f"banded-{bands}")
    raise ValueError(f"factorization must be one of {FTRL_FACTORIZATIONS}, got {kind!r}")


def every_round_sensitivities(factorization: Factorization) -> FloatArray:
    """sens_t, t = 1..T, when the client may take part in every round (k = T, min_separation = 1).

    For an entrywise nonnegative C (the tree; banded with c ≥ 0), G = CᵀC ≥ 0 and the worst pattern is every
    round with one direction, sens_t² = ‖C_t 1‖² = Σ over the rows released by round t of their squared row sums
    (a row released by t reads only rounds < t): O(mT) instead of :func:`ledger_sensitivities`' O(mT³). Any
    other C falls back to :func:`ledger_sensitivities` (max_π Σ|G_ij|, an upper bound)."""
    c = factorization.encoder
    if np.any(c < 0):
        return ledger_sensitivities(factorization, factorization.rounds, 1)
    released = np.searchsorted(factorization.row_round, np.arange(1, factorization.rounds + 1), side="left")
    cumulative = np.concatenate([[0.0], np.cumsum(c.sum(axis=1) ** 2)])
    return np.asarray(np.sqrt(cumulative[released]), dtype=np.float64)


@functools.lru_cache(maxsize=64)
def _run_sensitivities(kind: str, rounds: int, bands: int, restart_every: int, participations: int,
                       min_separation: int) -> tuple[float, ...]:
    f = run_factorization(kind, rounds, bands, restart_every)
    if participations >= rounds and min_separation == 1:
        return tuple(float(s) for s in every_round_sensitivities(f))
    return tuple(float(s) for s in ledger_sensitivities(f, participations, min_separation))


@functools.lru_cache(maxsize=64)
def _per_round_norms(kind: str, rounds: int, bands: int, restart_every: int) -> tuple[float, ...]:
    decoder = run_factorization(kind, rounds, bands, restart_every).decoder
    rows = np.diff(decoder, axis=0, prepend=np.zeros((1, decoder.shape[1])))
    return tuple(float(v) for v in np.linalg.norm(rows, axis=1))


def in_turn(client_id: int, server_round: int, min_separation: int) -> bool:
    """Whether client i contributes its data in round t (1-based) under b-min-separated cyclic participation:
    (t − 1 − i) mod b = 0, so its contributions are exactly b rounds apart and at most ⌈T/b⌉ in T rounds (b = 1:
    every round). The schedule is public; each client enforces it on itself."""
    return (int(server_round) - 1 - int(client_id)) % int(min_separation) == 0


def turn_size(server_round: int, num_clients: int, min_separation: int) -> int:
    """How many of clients 0..n−1 contribute data in round t: #{i : (t − 1 − i) mod b = 0}."""
    first = (int(server_round) - 1) % int(min_separation)
    return len(range(first, int(num_clients), int(min_separation)))


@dataclass(frozen=True)
class FTRLMechanism:
    """DP-FTRL's matrix mechanism for one federated run (Kairouz et al., ICML 2021; Choquette-Choo et al.,
    NeurIPS 2023), in units of the clip C.

    Round t's sum of clipped client updates x_t receives w_t = (C⁻¹ Z)_t, Z with i.i.d. N(0, (z C)²) entries, so
    the model's prefix sums carry B Z (:meth:`Factorization.per_round_noise`). Whoever adds it — the server
    (``secure_aggregation`` False) or each of the n clients its own stream with std z C/√n under SecAgg+ — the
    release after t rounds is one Gaussian mechanism with multiplier z_eff / sens_t
    (:func:`ledger_epsilons`), sens_t for a client that takes part in at most ``participations`` rounds
    (0 = as many as ``min_separation`` allows), any two ≥ ``min_separation`` apart (:func:`in_turn`: the clients'
    schedule). Nothing is amplified: the pattern is not secret. Neighbours zero out one client (all its
    participations).

    ``present`` clients of n whose noise reached every released sum give z_eff = z √(present/n) (the others'
    partial streams are independent of the data: post-processing); without SecAgg+ z_eff = z.
    """

    kind: str
    rounds: int
    noise_multiplier: float
    clip: float
    num_clients: int
    delta: float
    bands: int = 1
    restart_every: int = 0
    participations: int = 0
    min_separation: int = 1
    clients_per_round: int = 0
    secure_aggregation: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FTRL_FACTORIZATIONS:
            raise ValueError(f"factorization must be one of {FTRL_FACTORIZATIONS}, got {self.kind!r}")
        if self.rounds < 1 or self.num_clients < 2:
            raise ValueError(f"DP-FTRL needs rounds >= 1 and at least 2 clients, got {self.rounds} and "
                             f"{self.num_clients}")
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be a finite number > 0, got {self.noise_multiplier}")
        if not (self.clip > 0 and math.isfinite(self.clip)) or not 0 < self.delta < 1:
            raise ValueError(f"clip must be > 0 and delta in (0, 1), got {self.clip} and {self.delta}")
        if self.kind == "banded" and not 1 <= self.bands <= self.rounds:
            raise ValueError(f"bands must be in 1..rounds = {self.rounds}, got {self.bands}")
        if self.kind == "tree" and self.restart_every < 0:
            raise ValueError(f"restart_every must be >= 0 (0 = never), got {self.restart_every}")
        if self.participations < 0 or self.min_separation < 1:
            raise ValueError(f"participations must be >= 0 (0 = every round) and min_separation >= 1, got "
                             f"{self.participations} and {self.min_separation}")
        if self.min_separation > self.rounds:
            raise ValueError(f"min_separation must be at most rounds = {self.rounds}, got {self.min_separation}")
        if not 0 <= self.clients_per_round <= self.num_clients:
            raise ValueError(f"clients per round must be in 0..n = {self.num_clients}, got {self.clients_per_round}")

    @property
    def _key(self) -> tuple[str, int, int, int]:
        return (self.kind, self.rounds, self.bands if self.kind == "banded" else 1,
                self.restart_every if self.kind == "tree" else 0)

    @property
    def factorization(self) -> Factorization:
        return run_factorization(*self._key)

    @property
    def band(self) -> FloatArray:
        """The band coefficients c_0..c_{b−1} (banded only)."""
        if self.kind != "banded":
            raise ValueError(f"a {self.kind} factorization has no band")
        return run_band(self.rounds, self.bands)

    @property
    def sample_rate(self) -> float:
        """r/n, the rate of the server's (not secret) client sampling; 1 with every client every round."""
        return (self.clients_per_round or self.num_clients) / self.num_clients

    def sensitivity(self, rounds_done: int | None = None) -> float:
        """sens_t of the rows released within the first t rounds (default T), in units of the clip."""
        t = self.rounds if rounds_done is None else int(rounds_done)
        if not 1 <= t <= self.rounds:
            raise ValueError(f"rounds_done must be in 1..{self.rounds}, got {t}")
        return _run_sensitivities(*self._key, self.participations or self.rounds, self.min_separation)[t - 1]

    def effective_multiplier(self, rounds_done: int | None = None, present: int | None = None) -> float:
        """z_eff / sens_t: the Gaussian multiplier of the release after t rounds (``present``: see the class)."""
        p = self.num_clients if present is None or not self.secure_aggregation else int(present)
        if not 0 < p <= self.num_clients:
            raise ValueError(f"present must be in 1..{self.num_clients}, got {p}")
        return self.noise_multiplier * math.sqrt(p / self.num_clients) / self.sensitivity(rounds_done)

    def epsilon(self, rounds_done: int | None = None, present: int | None = None) -> float:
        """ε at δ after t rounds (default T; 0 for t = 0): one Gaussian (:func:`gaussian_epsilon`, PLD)."""
        if rounds_done == 0:
            return 0.0
        return gaussian_epsilon(self.effective_multiplier(rounds_done, present), self.delta)

    @property
    def noise_std(self) -> float:
        """Std of each entry of one noise stream's Z: z C for the server's, z C/√n for each client's."""
        return self.clip * self.noise_multiplier / (math.sqrt(self.num_clients) if self.secure_aggregation else 1.0)

    def round_noise_std(self, round_index: int) -> float:
        """Per-coordinate std of the w_t one stream adds in round t (0-based): ``noise_std``·‖(A⁻¹B)_t‖."""
        return self.noise_std * _per_round_norms(*self._key)[round_index]

    @property
    def max_round_noise_std(self) -> float:
        return self.noise_std * max(_per_round_norms(*self._key))

    def noise_stream(self, dim: int, rng: np.random.Generator) -> BandedNoise | TreeNoise:
        """A fresh stream of w_0, w_1, … of ``dim`` coordinates with entry std :attr:`noise_std`."""
        if self.kind == "tree":
            return TreeNoise(dim, self.noise_std, rng, restart_every=self.restart_every or None)
        return BandedNoise(self.band, dim, self.noise_std, rng)

    @classmethod
    def calibrated(cls, target_epsilon: float, **kwargs: Any) -> FTRLMechanism:
        """z such that the whole run (T rounds, every client's noise present) spends ``target_epsilon`` (to
        0.1 %, never above): z = z_eff·sens_T (:func:`ftrl_noise_multiplier`)."""
        probe = cls(noise_multiplier=1.0, **kwargs)
        z = ftrl_noise_multiplier(target_epsilon, probe.delta, probe.sensitivity())
        return cls(noise_multiplier=z, **kwargs)
