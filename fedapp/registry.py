"""Strategy registry: one :class:`Family` object per strategy family states everything about it.

A family names the run-config sections it reads and the keys of those it ignores, its own sections (a plugin's
keys), the features its strategies support (:class:`Feature`), and each strategy's threat model (an enum), privacy
:class:`Mechanism` (the pre-run check, the plan, what ``config.json`` says, the ε a node is planned), server builder
and client builder, as callables. Nothing elsewhere branches on a strategy's name or a threat model's text.

The built-in families live in :mod:`fedapp.apps.families` and are registered the first time the registry is read
(:data:`BUILTIN_FAMILIES`, the one import by name: this module sits below the packages that build strategies). A
user's own family is one :func:`register_family` call (docs/architecture.md walks through it).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from strategies.errors import ConfigError
from strategies.privacy.threat_models import Level, ThreatModel

#: the module that registers the built-in families when imported (an entry point, like Flower's ``serverapp``)
BUILTIN_FAMILIES = "fedapp.apps.families"


class Feature(StrEnum):
    """What a strategy supports beyond its family's core (the run-config checks read these, never names)."""

    ADAPTIVE_CLIP = "adaptive-clip"  # Andrew et al. 2021 (adaptive-clip-*): independent Gaussian noise per round
    CORRELATED_NOISE = "correlated-noise"  # DP-FTRL's factorized noise (ftrl-*)
    DDG = "ddg"  # the distributed discrete Gaussian under SecAgg+ (secagg-mechanism = 'ddg')
    DPSGD_CLIENTS = "dp-sgd-clients"  # clients train with Opacus DP-SGD (grad-sample-mode, ModuleValidator)
    PERSONAL_HEAD = "personal-head"  # a personal head (dp2-head) that never leaves the client
    PUBLIC_SET = "public-set"  # the server trains on a held-out public set (public-samples)


class Mechanism(Protocol):
    """The run-time side of a family's privacy (implemented in :mod:`fedapp.apps.mechanisms`). ``cfg`` is a resolved
    :class:`~fedapp.config.RunConfig`; ``profiles`` the federation's client profiles; ``sizes`` the clients' dataset
    sizes (None: node-local data, each N_i known to its node only)."""

    def check(self, cfg: Any, num_clients: int, profiles: list[Any], sizes: list[int] | None) -> None:
        """Refuse (``ConfigError``) what would fail or void the guarantee, before round 1."""

    def plan(self, cfg: Any, num_clients: int, payload_dim: int | None) -> dict[str, Any]:
        """The mechanism and planned ε of ``privacy_plan`` (``config.json``, ``launch --plan``)."""

    def meta(self, cfg: Any) -> dict[str, Any]:
        """What ``config.json``'s ``privacy`` block adds for this mechanism (whom the budget holds against)."""

    def planned_epsilon(self, cfg: Any, num_clients: int, node_config: Mapping[str, Any]) -> float | None:
        """The ε the run plans for one node against the server that configures it (None: no DP)."""


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: its threat model and the mechanism that implements it, its builders and features; ``family`` is
    set when its family is built."""

    name: str
    privacy: ThreatModel
    mechanism: Mechanism
    build: Callable[..., Any]  # (StrategyContext, EngineSettings, *, <the sections it reads>) -> flwr Strategy
    client: Callable[..., Any]  # (flwr Context, overrides) -> flwr Client
    description: str
    features: frozenset[Feature] = frozenset()
    family: Family = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    @property
    def level(self) -> Level:
        return self.privacy.level

    def supports(self, feature: Feature) -> bool:
        return feature in self.features or feature in self.family.features


@dataclass(frozen=True)
class Family:
    """Everything about one family. ``sections``: the run-config sections it reads (``Key.section``), keys of other
    sections have no effect on it; ``ignores``: keys of those sections it does not read; ``config``: its own section
    classes (:class:`fedapp.config.sections.Section` subclasses, a plugin's keys); ``features``: every strategy's."""

    name: str
    sections: frozenset[str]
    strategies: tuple[StrategySpec, ...]
    ignores: frozenset[str] = frozenset()
    features: frozenset[Feature] = frozenset()
    config: tuple[Any, ...] = ()  # section classes (a type with SECTION)

    def __post_init__(self) -> None:
        own = frozenset(cls.SECTION for cls in self.config)
        object.__setattr__(self, "sections", frozenset(self.sections) | own)
        object.__setattr__(self, "strategies", tuple(dataclasses.replace(s, family=self) for s in self.strategies))


class _Registry(MutableMapping[str, StrategySpec]):
    """Strategy name → spec; the built-in families are registered on first read."""

    def __init__(self) -> None:
        self._specs: dict[str, StrategySpec] = {}
        self._loaded = False
        self._loading = False

    def _load(self) -> None:
        """Register the built-in families once (a failed import is raised, and retried on the next read)."""
        if self._loaded or self._loading:
            return
        self._loading = True
        try:
            importlib.import_module(BUILTIN_FAMILIES)
            self._loaded = True
        finally:
            self._loading = False

    def __getitem__(self, name: str) -> StrategySpec:
        self._load()
        return self._specs[name]

    def __setitem__(self, name: str, spec: StrategySpec) -> None:
        self._specs[name] = spec

    def __delitem__(self, name: str) -> None:
        del self._specs[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._specs)

    def __len__(self) -> int:
        self._load()
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._specs


REGISTRY = _Registry()
#: family name → family, in registration order
FAMILIES: dict[str, Family] = {}
_version = [0]  # bumped by every (un)registration: the run-config schema and its cache follow it


def register_family(family: Family) -> Family:
    """Add ``family`` and its strategies (built-ins, plugins, notebooks, tests); a name may be registered once (the
    built-ins register first, so a plugin cannot take one of their names)."""
    REGISTRY._load()
    taken = [s.name for s in family.strategies
             if s.name in REGISTRY._specs and REGISTRY._specs[s.name].family is not family]
    if taken or (family.name in FAMILIES and FAMILIES[family.name] is not family):
        raise ValueError(f"family {family.name!r}: strategy {taken[0]!r} is already registered" if taken else
                         f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    for spec in family.strategies:
        REGISTRY[spec.name] = spec
    _version[0] += 1
    return family


def unregister_family(name: str) -> None:
    """Remove the family ``name`` and its strategies (tests, notebooks)."""
    family = FAMILIES.pop(name)
    for spec in family.strategies:
        REGISTRY._specs.pop(spec.name, None)
    _version[0] += 1


def registry_version() -> int:
    return _version[0]


def family_sections() -> list[Any]:
    """The section classes of the registered families that bring their own (without loading the built-ins, which
    bring none)."""
    return [cls for family in FAMILIES.values() for cls in family.config]


def get_spec(name: str) -> StrategySpec:
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def get_family(name: str) -> Family:
    REGISTRY._load()
    if name not in FAMILIES:
        raise ConfigError(f"unknown strategy family {name!r}; valid families: {', '.join(FAMILIES)}")
    return FAMILIES[name]
