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


def test_every_builtin_builder_resolves_to_a_factory_with_its_signature() -> None:
    """The built-in families name their builders lazily (fedapp.apps.families): each must exist in
    fedapp.apps.factories and show that function's signature, which RunConfig.sections_for reads."""
    import inspect

    from fedapp.apps import factories

    for name in registry.REGISTRY:
        spec = registry.REGISTRY[name]
        for builder in (spec.build, spec.client):
            target = getattr(factories, builder.__name__)
            assert inspect.signature(builder) == inspect.signature(target), (name, builder.__name__)


def test_reading_the_registry_loads_no_strategy_flower_or_numpy() -> None:
    """What the launcher keeps for a whole run: its checks resolve the run-config (and so read the registry) without
    importing the strategies' builders, Flower or numpy (fedapp.apps.factories alone pulls in ~110 MB)."""
    import subprocess

    code = ("import sys\nfrom fedapp.run.launch import checked_config\nfrom fedapp.run.processes import PROJECT_ROOT\n"
            "from fedapp.config import resolve_config\n"
            "for s in ('fedavg', 'dp-fedavg', 'robust-hdp', 'soteriafl-sgd', 'dp2-fedsam', 'dp-ftrl'):\n"
            "    resolve_config({'strategy': s})\n"
            "print(sorted(m for m in ('numpy', 'flwr', 'torch', 'scipy', 'fedapp.apps.factories') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
