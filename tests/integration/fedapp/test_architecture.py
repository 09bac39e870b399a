"""The layering contract (import-linter) and the "add a strategy in 3 files" walk-through of docs/architecture.md."""

from __future__ import annotations

import dataclasses
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


# ---------------------------------------------------------------- add a family: its own files, one registration line
TOY_STRATEGY = '''
"""The family's math (strategies/<family>.py): plain numpy, no run-config, no fedapp."""
import numpy as np

from strategies.base import DPFLStrategy
from strategies.privacy.threat_models import ThreatModel


class UniformAvg(DPFLStrategy):
    """w_i = 1/r: every accepted update counts the same, whatever its dataset size."""

    name = "toy-uniform"
    privacy = ThreatModel.NONE

    def aggregation_weights(self, server_round, updates):
        return np.ones(len(updates)), {"toy_clients": len(updates)}
'''

TOY_APP = '''
"""The family's Flower side: its run-config section, server builder, client, privacy plan and Family object."""
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedapp.clients.common import setup_client
from fedapp.clients.dpsgd import DPSGDClient
from fedapp.config import resolve_config
from fedapp.config.keys import setting
from fedapp.config.sections import Section
from fedapp.registry import Family, StrategySpec
from strategies.privacy.threat_models import ThreatModel
from toy_strategy import UniformAvg

SEEN = []  # what the clients read from the family's own section


@dataclass(frozen=True)
class ToyConfig(Section):
    """The toy family's own keys."""

    SECTION: ClassVar[str] = "toy"

    toy_label_smoothing: float = setting(0.0, "Label smoothing of the clients' loss.",
                                         check=lambda v: 0 <= v < 1, expect="in [0, 1)")


def build_toy(ctx, engine, *, toy: ToyConfig):  # declares the sections it reads: here its own
    return UniformAvg(**engine.kwargs(ctx))


class ToyClient(DPSGDClient):
    def __init__(self, setup, context, smoothing):
        super().__init__(setup, context, private=False)
        SEEN.append(smoothing)
        self.loss = lambda out, y: torch.nn.functional.cross_entropy(out, y, label_smoothing=smoothing)


def make_toy_client(context, overrides=None):
    cfg = resolve_config(context.run_config, overrides)
    return ToyClient(setup_client(context, overrides), context, cfg.toy.toy_label_smoothing).to_client()


class UniformPlan:
    """No noise: nothing to check; the plan says how updates are weighted."""

    def check(self, cfg, num_clients, profiles, sizes):
        return None

    def plan(self, cfg, num_clients, payload_dim):
        return {"mechanism": {"name": "none: uniform average", "weight": 1 / num_clients,
                              "label_smoothing": cfg.toy.toy_label_smoothing}}

    def meta(self, cfg):
        return {}

    def planned_epsilon(self, cfg, num_clients, node_config):
        return None


TOY = Family("toy", frozenset({"general", "data", "privacy", "deployment"}), (
    StrategySpec("toy-uniform", ThreatModel.NONE, UniformPlan(), build_toy, make_toy_client,
                 "FedAvg with uniform weights"),
), config=(ToyConfig,))
'''


def _tracked_changes() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "fedapp", "strategies",
                           "pyproject.toml"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_a_new_family_plugs_in_with_its_own_files_and_one_line(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk-through of docs/architecture.md: a family with its own run-config section, client and plan lives in
    its own two files; one line registers it; then its key is checked, its client reads it, its plan is in
    config.json, and it runs. No file of the project changes."""
    import json

    from fedapp.config import SCHEMA, ConfigError, resolve_config
    from fedapp.experiments import notebook_utils as nbu
    from fedapp.registry import REGISTRY, register_family, unregister_family

    before = _tracked_changes()
    (tmp_path / "toy_strategy.py").write_text(textwrap.dedent(TOY_STRATEGY))
    (tmp_path / "toy_app.py").write_text(textwrap.dedent(TOY_APP))
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_app

    assert "toy-label-smoothing" not in SCHEMA
    register_family(toy_app.TOY)  # the one registration line
    try:
        assert SCHEMA["toy-label-smoothing"].section == "toy" and REGISTRY["toy-uniform"].family is toy_app.TOY
        with pytest.raises(ValueError, match="already registered"):
            register_family(dataclasses.replace(toy_app.TOY, name="toy-2"))
        with pytest.raises(ConfigError, match="toy-label-smoothing"):
            resolve_config(None, {"strategy": "toy-uniform", "toy-label-smoothing": 1.5})
        run = nbu.run_federation({"strategy": "toy-uniform", "num-server-rounds": 2, "num-clients": 3,
                                  "toy-label-smoothing": 0.1, "output-dir": str(tmp_path / "out"),
                                  "max-samples": 300, "fraction-evaluate": 0.0}, num_clients=3)
    finally:
        unregister_family("toy")
    assert "toy-label-smoothing" not in SCHEMA and "toy-uniform" not in REGISTRY
    rounds = nbu.load_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        weights = [c["aggregation_weight"] for c in r["clients"] if c["status"] == "ok"]
        assert len(weights) == 3 and np.allclose(weights, 1 / 3) and r["metrics"]["toy_clients"] == 3
    assert toy_app.SEEN and set(toy_app.SEEN) == {0.1}
    config = json.loads((run / "config.json").read_text())
    assert config["privacy_plan"]["mechanism"] == {"name": "none: uniform average", "weight": 1 / 3,
                                                   "label_smoothing": 0.1}
    assert config["strategy"]["family"] == "toy" and config["unused_keys"] == []
    assert _tracked_changes() == before  # the family's own files (in tmp_path) and one line: nothing else
