"""Privacy accountants: one interface, interchangeable implementations (cf. Opacus ``accountants/``).

Every ε in this project comes from a standard accountant, never from a hand formula. A *history*
is the list ``[(noise_multiplier, sample_rate, steps), ...]`` of subsampled-Gaussian mechanism
applications (Opacus' representation), so it can be persisted and restored exactly. The noise
multiplier z is the noise std divided by the sensitivity under the accountant's neighbouring
relation.

Implementations (:func:`get_accountant` by name):

* ``rdp``  — Opacus RDP (Mironov et al. 2019), Poisson sampling, add/remove-one neighbours. The
  per-(z, q) RDP vectors are cached: RDP composes additively and is linear in the step count.
* ``prv``  — Opacus PRV (Gopi et al. 2021), Poisson sampling.
* ``dpa-rdp`` — Google dp_accounting RDP, Poisson sampling (a cross-check of ``rdp``).
* ``dpa-pld`` — Google dp_accounting privacy-loss distributions, Poisson sampling (tighter).
* ``dpa-pld-replace-one`` — Google dp_accounting privacy-loss distributions, Poisson sampling,
  *replace-one* neighbours (:class:`ReplaceOnePLD`). Record-level DP's default (run-config
  ``record-neighbours``; :func:`record_accountant` maps a run's accountant and relation to a name).
* :class:`WithoutReplacementRDP` — dp_accounting RDP for *fixed-size* sampling of r of n without
  replacement under the replace-one relation (Opacus has no such accountant). A replaced unit's
  clipped contribution can move the sum by 2C, so by default z is halved (``sensitivity_factor = 2``).

Neighbouring relations. Add/remove-one (D′ = D ∪ {x} or D \\ {x}) is what Opacus' accountants and the
client-level families compose; every accountant above except the replace-one ones is add/remove.
Replace-one (|D′| = |D|, one record swapped) is the relation that fits a record-level client that
releases its dataset size N_i (``num_examples``; q_i = 1/⌈N_i/b_i⌉ and the step count are functions of
N_i): releasing N_i tells add/remove neighbours apart outright, so an add/remove guarantee says nothing
about them, while replace-one neighbours have the same N_i. For the Poisson-subsampled Gaussian with
per-record contributions of norm ≤ C, dp_accounting's replace-one analysis pairs the mixtures
(1 − q)·N(0, σ²) + q·N(±C, σ²) — the same z = σ/C as under add/remove, about twice the ε. dp_accounting's
RDP accountant refuses ``PoissonSampledDpEvent`` under ``REPLACE_ONE`` (0.6.0: add/remove or
replace-special only), so replace-one is composed with its PLD accountant.
"""

from __future__ import annotations

import functools
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

History = list[tuple[float, float, int]]


def compact_history(history: Iterable[Sequence[float]]) -> History:
    """Merge consecutive entries with equal (z, q) — exact, since steps just add up; drop empty ones."""
    out: History = []
    for z, q, steps in history:
        z, q, steps = float(z), float(q), int(steps)
        if steps <= 0:
            continue
        if out and out[-1][0] == z and out[-1][1] == q:
            out[-1] = (z, q, out[-1][2] + steps)
        else:
            out.append((z, q, steps))
    return out


class Accountant(ABC):
    """ε of a history of subsampled-Gaussian steps at a given δ."""

    name: str = ""
    #: the neighbouring relation the accountant composes (``add-remove`` unless it says otherwise)
    relation: str = "add-remove"

    def epsilon(self, history: Iterable[Sequence[float]], delta: float) -> float:
        """ε spent by ``history`` at ``delta``: 0 for an empty history, ∞ when a step has no noise.

        Never negative or NaN (a numerically negative bound is clamped to 0).
        """
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        hist = compact_history(history)
        if not hist:
            return 0.0
        for _, q, _ in hist:
            if not 0 < q <= 1:
                raise ValueError(f"sample rate must be in (0, 1], got {q}")
        if any(z <= 0 for z, _, _ in hist):
            return math.inf
        with warnings.catch_warnings():  # "optimal order is the largest alpha" for tiny noise
            warnings.simplefilter("ignore", UserWarning)
            eps = float(self._epsilon(hist, delta))
        if math.isnan(eps):
            raise ArithmeticError(f"{self.name} accountant returned NaN for {hist} at delta={delta}")
        return max(eps, 0.0)

    @abstractmethod
    def _epsilon(self, history: History, delta: float) -> float:
        """ε of a non-empty, compacted history with positive noise."""


OPACUS_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
"""``opacus.accountants.RDPAccountant.DEFAULT_ALPHAS`` (a test checks they are equal)."""


@functools.cache
def opacus_rdp_analysis() -> ModuleType:
    """Opacus' RDP analysis module (``opacus/accountants/analysis/rdp.py``: numpy, scipy.special, math) loaded
    from its file without running the ``opacus`` package ``__init__``, which imports the privacy engine,
    ``torch.distributed`` and ``scipy.stats`` (~100 MB and seconds in every server and client-level process
    that only needs ε). The same code, so the same numbers: a test checks against ``RDPAccountant``."""
    import importlib.util
    from pathlib import Path

    found = importlib.util.find_spec("opacus")
    if found is None or not found.submodule_search_locations:
        raise ImportError("opacus is not installed")
    path = Path(next(iter(found.submodule_search_locations))) / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location("_dpfl_opacus_rdp_analysis", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load opacus' RDP analysis module from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=8192)
def _opacus_rdp_per_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    return np.asarray(opacus_rdp_analysis().compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                                        orders=list(OPACUS_RDP_ORDERS)))


class OpacusRDP(Accountant):
    """Exactly ``opacus.accountants.RDPAccountant(history).get_epsilon(delta)`` (a test checks equality)."""

    name = "rdp"

    def _epsilon(self, history: History, delta: float) -> float:
        rdp = sum(steps * _opacus_rdp_per_step(z, q) for z, q, steps in history)
        eps, _ = opacus_rdp_analysis().get_privacy_spent(orders=list(OPACUS_RDP_ORDERS), rdp=rdp, delta=delta)
        return float(eps)


class OpacusPRV(Accountant):
    """Opacus' PRV accountant (numerical composition of privacy random variables)."""

    name = "prv"

    def _epsilon(self, history: History, delta: float) -> float:
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
        acc.history = list(history)
        return float(acc.get_epsilon(delta=delta))


def _poisson_event(history: History) -> Any:  # a dp_accounting.ComposedDpEvent (dp_accounting is untyped)
    import dp_accounting as dpa

    return dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps) for z, q, steps in history
    ])


class DPAccountingRDP(Accountant):
    """Google dp_accounting's RDP accountant, Poisson sampling, add/remove-one neighbours."""

    name = "dpa-rdp"

    def _epsilon(self, history: History, delta: float) -> float:
        from dp_accounting import rdp

        acc = rdp.RdpAccountant()
        acc.compose(_poisson_event(history))
        return float(acc.get_epsilon(delta))


class DPAccountingPLD(Accountant):
    """Google dp_accounting's PLD accountant, Poisson sampling (tighter than RDP)."""

    name = "dpa-pld"

    def __init__(self, value_discretization_interval: float = 1e-3) -> None:
        self.interval = value_discretization_interval

    def _epsilon(self, history: History, delta: float) -> float:
        from dp_accounting import pld

        acc = pld.PLDAccountant(value_discretization_interval=self.interval)
        acc.compose(_poisson_event(history))
        return float(acc.get_epsilon(delta))


class WithoutReplacementRDP(Accountant):
    """Fixed-size sampling of r = q·n of ``population`` n without replacement, replace-one neighbours.

    ``sensitivity_factor`` scales the sensitivity the history's z refers to: with z = std/C and a
    replaced unit moving a sum of C-clipped contributions by up to 2C, the effective multiplier is z/2.
    """

    name = "dpa-rdp-wor"
    relation = "replace-one"

    def __init__(self, population: int, sensitivity_factor: float = 2.0) -> None:
        if population < 1:
            raise ValueError(f"population must be >= 1, got {population}")
        if sensitivity_factor <= 0:
            raise ValueError(f"sensitivity factor must be > 0, got {sensitivity_factor}")
        self.population = int(population)
        self.sensitivity_factor = float(sensitivity_factor)

    def sample_size(self, q: float) -> int:
        r = q * self.population
        if abs(r - round(r)) > 1e-6 * max(1.0, r):
            raise ValueError(f"sample rate {q} is not r/n for an integer r of n = {self.population}")
        return int(round(r))

    def _epsilon(self, history: History, delta: float) -> float:
        import dp_accounting as dpa
        from dp_accounting import rdp
        from dp_accounting.privacy_accountant import NeighboringRelation

        acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
        for z, q, steps in history:
            r = self.sample_size(q)
            gauss = dpa.GaussianDpEvent(z / self.sensitivity_factor)
            event = gauss if r >= self.population else dpa.SampledWithoutReplacementDpEvent(self.population, r, gauss)
            acc.compose(dpa.SelfComposedDpEvent(event, steps))
        return float(acc.get_epsilon(delta))


#: record-level neighbouring relations (run-config ``record-neighbours``)
REPLACE_ONE = "replace-one"
ADD_REMOVE = "add-remove"
RECORD_NEIGHBOURS: tuple[str, ...] = (REPLACE_ONE, ADD_REMOVE)

#: the PLD grid of :class:`ReplaceOnePLD` (the same as :class:`DPAccountingPLD`'s default; pessimistic rounding,
#: so a coarser grid only over-states ε: at the main job's (z, q, T) it agrees with 1e-4 to 1e-4 relative)
REPLACE_ONE_PLD_INTERVAL = 1e-3


@functools.lru_cache(maxsize=32)  # a PLD is a dense pmf (tens of kB to a few MB): keep few
def _replace_one_step_pld(noise_multiplier: float, sample_rate: float, interval: float) -> Any:
    """dp_accounting's PLD of one Poisson-subsampled Gaussian step under replace-one neighbours (what its
    ``PLDAccountant`` builds for ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``), cached per (z, q)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.privacy_accountant import NeighboringRelation

    return pld_lib.from_gaussian_mechanism(standard_deviation=noise_multiplier, sampling_prob=sample_rate,
                                           value_discretization_interval=interval,
                                           neighboring_relation=NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=8)
def _replace_one_steps_pld(noise_multiplier: float, sample_rate: float, steps: int, interval: float) -> Any:
    return _replace_one_step_pld(noise_multiplier, sample_rate, interval).self_compose(steps)


class ReplaceOnePLD(Accountant):
    """Google dp_accounting's PLD accountant, Poisson sampling, *replace-one* neighbours.

    The same computation as ``PLDAccountant(NeighboringRelation.REPLACE_ONE, interval).compose(event)``
    (a test checks it against that accountant): one step's PLD per (z, q) with
    ``from_gaussian_mechanism(..., neighboring_relation=REPLACE_ONE)``, self-composed ``steps`` times, the
    history's entries composed. One step's PLD is cached per (z, q) and ε per (history, δ), so a client's
    ε after each round (and the server's ledger) costs one self-composition, not a fresh accountant."""

    name = "dpa-pld-replace-one"
    relation = REPLACE_ONE

    def __init__(self, value_discretization_interval: float = REPLACE_ONE_PLD_INTERVAL) -> None:
        self.interval = float(value_discretization_interval)

    def _epsilon(self, history: History, delta: float) -> float:
        return _replace_one_epsilon(tuple(history), float(delta), self.interval)


@functools.lru_cache(maxsize=4096)
def _replace_one_epsilon(history: tuple[tuple[float, float, int], ...], delta: float, interval: float) -> float:
    composed = None
    for z, q, steps in history:
        part = _replace_one_steps_pld(float(z), float(q), int(steps), interval)
        composed = part if composed is None else composed.compose(part)
    if composed is None:  # Accountant.epsilon never passes an empty history
        raise ValueError("an empty history has no privacy loss distribution")
    return float(composed.get_epsilon_for_delta(delta))


ACCOUNTANTS: dict[str, type[Accountant]] = {
    cls.name: cls for cls in (OpacusRDP, OpacusPRV, DPAccountingRDP, DPAccountingPLD, ReplaceOnePLD)
}


def record_accountant(accountant: str, relation: str) -> str:
    """The accountant name for record-level DP with run-config ``accountant`` under neighbouring ``relation``.

    ``add-remove``: ``accountant`` itself (Opacus RDP/PRV, dp_accounting RDP/PLD: all add/remove-one).
    ``replace-one``: :class:`ReplaceOnePLD` whatever ``accountant`` names — Opacus' accountants (``rdp``,
    ``prv``) compose add/remove only and dp_accounting's RDP has no replace-one analysis of Poisson
    sampling, so the one standard replace-one accountant for the Poisson-subsampled Gaussian is
    dp_accounting's PLD. The client-level families never call this: their neighbours are whole clients
    added or removed, composed by ``accountant`` as before."""
    if relation == ADD_REMOVE:
        return accountant
    if relation == REPLACE_ONE:
        return ReplaceOnePLD.name
    raise ValueError(f"unknown record-level neighbouring relation {relation!r}; valid: {list(RECORD_NEIGHBOURS)}")


@functools.cache
def accountant_versions() -> str:
    """Versions of the accounting libraries (a calibration cached under other versions is not reused)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("opacus", "dp-accounting"):
        try:
            out.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            out.append(f"{dist} absent")
    return ",".join(out)


@functools.cache
def get_accountant(kind: str) -> Accountant:
    """The Poisson-sampling accountant named ``kind`` (one of :data:`ACCOUNTANTS`; add/remove-one neighbours
    except ``dpa-pld-replace-one``)."""
    if kind not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {kind!r}; valid: {sorted(ACCOUNTANTS)}")
    return ACCOUNTANTS[kind]()


def epsilon_of(history: Iterable[Sequence[float]], delta: float, kind: str = "rdp") -> float:
    """ε spent by ``history`` at ``delta`` with the accountant ``kind`` (0 for an empty history)."""
    return get_accountant(kind).epsilon(history, delta)
