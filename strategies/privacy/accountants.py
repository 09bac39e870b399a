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
* :class:`WithoutReplacementRDP` — dp_accounting RDP for *fixed-size* sampling of r of n without
  replacement under the replace-one relation (Opacus has no such accountant). A replaced unit's
  clipped contribution can move the sum by 2C, so by default z is halved (``sensitivity_factor = 2``).
"""

from __future__ import annotations

import functools
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

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
def opacus_rdp_analysis():
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
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
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


def _poisson_event(history: History):
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


ACCOUNTANTS: dict[str, type[Accountant]] = {
    cls.name: cls for cls in (OpacusRDP, OpacusPRV, DPAccountingRDP, DPAccountingPLD)
}


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
    """The Poisson-sampling accountant named ``kind`` (one of :data:`ACCOUNTANTS`)."""
    if kind not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {kind!r}; valid: {sorted(ACCOUNTANTS)}")
    return ACCOUNTANTS[kind]()


def epsilon_of(history: Iterable[Sequence[float]], delta: float, kind: str = "rdp") -> float:
    """ε spent by ``history`` at ``delta`` with the accountant ``kind`` (0 for an empty history)."""
    return get_accountant(kind).epsilon(history, delta)
