"""The layering contract (import-linter) and the "add a strategy in 3 files" walk-through of docs/architecture.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO as ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(cwd)})


def test_import_contract_holds() -> None:
    """strategies/ never imports fedapp/, fedapp/'s packages are layers, no package has an import cycle."""
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("breach", ["forbidden", "cycle", "layers"])
def test_import_contract_fails_when_broken(tmp_path: Path, breach: str) -> None:
    """The contract is not vacuous: a copy of the tree with one bad import breaks it."""
    for pkg in ("strategies", "fedapp"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if breach == "forbidden":
        target, line = tmp_path / "strategies" / "aggregate.py", "import fedapp.config  # noqa\n"
    elif breach == "layers":  # a client imports the launcher: SuperNodes would need fedapp.run
        target, line = tmp_path / "fedapp" / "clients" / "common.py", "import fedapp.run.launch  # noqa\n"
    else:  # strategies.compression <-> strategies.aggregate
        target, line = tmp_path / "strategies" / "aggregate.py", "import strategies.compression  # noqa\n"
        (tmp_path / "strategies" / "compression.py").write_text(
            (tmp_path / "strategies" / "compression.py").read_text() + "\nimport strategies.aggregate  # noqa\n")
    target.write_text(target.read_text() + "\n" + line)
    out = lint_imports(tmp_path)
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout


# ---------------------------------------------------------------- add a strategy in 3 files
TOY_STRATEGY = '''
"""File 1 (strategies/<family>.py): the paper's math on plain numpy, no run-config, no fedapp."""
import numpy as np

from strategies.base import DPFLStrategy
from strategies.privacy import threat_models


class UniformAvg(DPFLStrategy):
    """w_i = 1/r: every accepted update counts the same, whatever its dataset size."""

    name = "toy-uniform"
    privacy = threat_models.NONE

    def aggregation_weights(self, server_round, updates):
        return np.ones(len(updates)), {"toy_clients": len(updates)}
'''

TOY_FACTORY = '''
"""File 2 (a builder in fedapp/apps/factories.py): run-config sections -> constructor arguments."""
from toy_family import UniformAvg


def build_toy(ctx, engine):  # declares no section: it reads only the settings every strategy shares
    return UniformAvg(**engine.kwargs(ctx))
'''


@pytest.mark.slow
def test_a_new_strategy_plugs_in_with_three_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk-through of docs/architecture.md: strategy module, builder, one registry line — then it runs."""
    from fedapp.experiments import notebook_utils as nbu
    from fedapp.registry import REGISTRY, StrategySpec, register
    from strategies.privacy import threat_models

    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_STRATEGY))
    (tmp_path / "toy_factories.py").write_text(textwrap.dedent(TOY_FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    # File 3: one StrategySpec line (fedapp/registry.py); the client is an existing one
    spec = StrategySpec("toy-uniform", "toy", "toy_factories:build_toy", "fedapp.apps.factories:make_plain_client",
                        threat_models.NONE, "FedAvg with uniform weights")
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    with pytest.raises(ValueError, match="already registered"):
        register(StrategySpec("toy-uniform", "x", "a:b", "c:d", "", ""))
    run = nbu.run_federation({"strategy": "toy-uniform", "num-server-rounds": 2, "output-dir": str(tmp_path / "out"),
                              "max-samples": 300, "fraction-evaluate": 0.0}, num_clients=3)
    rounds = nbu.load_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        weights = [c["aggregation_weight"] for c in r["clients"] if c["status"] == "ok"]
        assert len(weights) == 3 and np.allclose(weights, 1 / 3) and r["metrics"]["toy_clients"] == 3
