"""Sweeps (fedapp.sweep) and reports (fedapp.report): grid, resume, validation tuning, intervals, verdicts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedapp.config import ConfigError
from fedapp.report import interval, verdict, write_report
from fedapp.sweep import cell_id, load_sweep, run_sweep

SWEEP = """
[sweep]
name = "tiny"
paper = "a toy claim"
paper-scale = "nothing"
num-supernodes = 3
tune = ["lr"]

[sweep.config]
num-server-rounds = 2
max-samples = 300
fraction-evaluate = 1.0
model = "logreg"
privacy-dist = "fixed"
epsilon = 5.0
batch-size = 16

[sweep.grid]
strategy = ["fedavg", "dpsgd-fedavg"]
lr = [0.05, 0.5]
seed = [1, 2]

[[sweep.claims]]
text = "no privacy beats DP-SGD"
metric = "final_accuracy"
better = { strategy = "fedavg" }
worse = { strategy = "dpsgd-fedavg" }

[scales.quick]
grid = { seed = [1] }
sweep = { num-supernodes = 4 }
"""


def test_interval_and_verdicts():
    mean, half, n = interval([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and n == 3 and half == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-3)
    assert verdict((0.9, 0.01, 3), (0.5, 0.01, 3)) == "holds"
    assert verdict((0.5, 0.01, 3), (0.9, 0.01, 3)) == "does not hold"
    assert verdict((0.6, 0.2, 3), (0.5, 0.2, 3)).startswith("inconclusive")
    assert verdict((0.9, math.nan, 1), (0.5, math.nan, 1)).startswith("inconclusive")


def test_sweep_file_is_validated_before_anything_runs(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SWEEP.replace('seed = [1, 2]', 'seed = [1, -2]'))
    with pytest.raises(ConfigError, match="'seed' = -2"):
        load_sweep(bad)
    path = tmp_path / "s.toml"
    path.write_text(SWEEP)
    assert len(load_sweep(path).cells()) == 8 and len(load_sweep(path, "quick").cells()) == 4
    assert load_sweep(path).num_supernodes == 3 and load_sweep(path, "quick").num_supernodes == 4
    with pytest.raises(ConfigError, match="no scale"):
        load_sweep(path, "huge")


@pytest.mark.slow
def test_a_sweep_runs_resumes_and_reports(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text(SWEEP)
    sweep = load_sweep(path)
    index = run_sweep(sweep, tmp_path / "out", engine="inprocess", only={"lr": 0.5, "seed": 1})
    doc = json.loads(index.read_text())
    assert len(doc["cells"]) == 2 and all(c["status"] == "finished" for c in doc["cells"].values())
    index = run_sweep(sweep, tmp_path / "out", engine="inprocess")  # resumes: the two finished cells are skipped
    doc = json.loads(index.read_text())
    assert len(doc["cells"]) == 8 and all(c["status"] == "finished" for c in doc["cells"].values())
    first = doc["cells"][cell_id({"strategy": "fedavg", "lr": 0.5, "seed": 1})]
    assert Path(first["run_dir"]).parent.name == cell_id({"strategy": "fedavg", "lr": 0.5, "seed": 1})
    report = write_report(index).read_text()
    assert "| strategy=fedavg | 2 |" in report and "| strategy=dpsgd-fedavg | 2 |" in report
    assert "final_client_accuracy" in report and "no privacy beats DP-SGD" in report
    assert any(v in report for v in ("**holds**", "**does not hold**", "**inconclusive"))
    assert (tmp_path / "out" / "accuracy_rounds.png").stat().st_size > 0
