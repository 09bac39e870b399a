"""fedapp.registry: the built-in families register first, so a plugin never shadows one of their strategies."""

from __future__ import annotations

import sys

import pytest

from fedapp import registry
from fedapp.registry import Family, StrategySpec
from strategies.privacy.threat_models import ThreatModel


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> registry._Registry:
    """A registry in which nothing has loaded yet (the built-in families' module imported again on first read)."""
    assert len(registry.REGISTRY)  # the real registry loaded: its module goes back into sys.modules afterwards
    fresh = registry._Registry()
    monkeypatch.setattr(registry, "REGISTRY", fresh)
    monkeypatch.setattr(registry, "FAMILIES", {})
    monkeypatch.delitem(sys.modules, registry.BUILTIN_FAMILIES)
    return fresh


def test_a_plugin_cannot_take_a_builtin_name_even_before_the_builtins_load(fresh_registry) -> None:
    mine = Family("mine", frozenset({"general"}), (
        StrategySpec("fedavg", ThreatModel.NONE, None, print, print, "a second fedavg"),  # type: ignore[arg-type]
    ))
    with pytest.raises(ValueError, match="strategy 'fedavg' is already registered"):
        registry.register_family(mine)
    assert fresh_registry["fedavg"].family.name == "foundation" and "mine" not in registry.FAMILIES


def test_a_failed_import_of_the_builtins_is_raised_and_retried(fresh_registry, monkeypatch) -> None:
    monkeypatch.setattr(registry, "BUILTIN_FAMILIES", "fedapp.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        len(fresh_registry)
    monkeypatch.setattr(registry, "BUILTIN_FAMILIES", "fedapp.apps.families")
    assert "dp-ftrl" in fresh_registry  # retried on the next read, not left empty
