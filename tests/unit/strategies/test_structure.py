"""The library's shape: privacy composed, not inherited (small classes, shallow chains, no type-checker-only bases)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import strategies
from strategies.engine import RoundEngine

ROOT = Path(strategies.__file__).parent
MAX_CLASS_LINES = 250
MAX_DEPTH_BELOW_ENGINE = 4


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _engine_classes() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="strategies."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, RoundEngine) and cls is not RoundEngine:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_is_longer_than_250_lines(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and n.end_lineno is not None and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"{path.name}: classes over {MAX_CLASS_LINES} lines: {long}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_type_checking_blocks_only_import(path: Path) -> None:
    """A base class swapped under ``if TYPE_CHECKING`` makes mypy check a hierarchy that never runs."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            kinds = {type(stmt).__name__ for stmt in node.body + node.orelse}
            assert kinds <= {"Import", "ImportFrom"}, f"{path.name}:{node.lineno}: TYPE_CHECKING block holds {kinds}"


def test_every_strategy_is_at_most_four_classes_below_the_engine() -> None:
    classes = _engine_classes()
    assert len(classes) >= 10  # every family's strategies are found
    deep = {c.__qualname__: [k.__name__ for k in c.__mro__ if issubclass(k, RoundEngine) and k is not RoundEngine]
            for c in classes}
    assert all(len(chain) <= MAX_DEPTH_BELOW_ENGINE for chain in deep.values()), deep


def test_dp_ftrl_is_its_own_family_not_a_fed_smp_subclass() -> None:
    from fedapp.registry import get_spec
    from strategies.dp_ftrl import DPFTRLStrategy
    from strategies.fed_smp import ClientLevelStrategy

    assert not issubclass(DPFTRLStrategy, ClientLevelStrategy)
    assert get_spec("dp-ftrl").family == "dp-ftrl"
