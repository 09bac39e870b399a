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
    from strategies.fed_smp import FedSMPStrategy

    assert not issubclass(DPFTRLStrategy, FedSMPStrategy)
    assert get_spec("dp-ftrl").family.name == "dp-ftrl"


#: the collaborators RoundEngine builds (strategies/engine.py); a family binds what it learns late through their own
#: methods (ClientSampler.fix_rate, PrivacyLedger.allow_report_slack), never by assigning to them or their attributes
ENGINE_COLLABORATORS = ("sampler", "identity", "validator", "strikes", "node_strikes", "ledger", "round_log")


def _collaborator_writes(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            chain = []
            while isinstance(target, ast.Attribute):
                chain.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id == "self" and chain and chain[-1] in ENGINE_COLLABORATORS:
                found.append(".".join(["self", *reversed(chain)]) + f" (line {node.lineno})")
    return found


def _family_modules() -> list[Path]:
    """The modules that define a strategy (a RoundEngine subclass)."""
    return sorted({Path(inspect.getfile(cls)) for cls in _engine_classes()})


@pytest.mark.parametrize("path", _family_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_family_replaces_or_pokes_an_engine_collaborator(path: Path) -> None:
    writes = _collaborator_writes(ast.parse(path.read_text()))
    assert not writes, f"{path.name} writes the engine's collaborators after construction: {writes}"


def test_the_collaborator_check_catches_the_old_writes() -> None:
    old = "class S:\n    def setup(self):\n        self.sampler.fixed_rate = 0.5\n        self.ledger = None\n"
    assert len(_collaborator_writes(ast.parse(old))) == 2
