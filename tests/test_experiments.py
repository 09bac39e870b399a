"""Sweeps (fedapp.sweep) and reports (fedapp.report): grid, resume, validation tuning, intervals, verdicts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedapp.config import ConfigError
from fedapp.report import ReportError, interval, tuned_groups, verdict, write_report
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
validation-fraction = 0.2
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
    no_validation = tmp_path / "noval.toml"
    no_validation.write_text(SWEEP.replace("validation-fraction = 0.2", ""))
    with pytest.raises(ConfigError, match="validation-fraction = 0.0"):
        load_sweep(no_validation)  # choosing among two lrs without a validation split would tune on a test split
    no_validation.write_text(SWEEP.replace("validation-fraction = 0.2", "").replace("lr = [0.05, 0.5]", "lr = [0.05]"))
    assert len(load_sweep(no_validation).cells()) == 4  # one candidate: nothing is chosen
    bad_metric = tmp_path / "metric.toml"
    bad_metric.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ntune-metric = "final_client_accuracy"'))
    with pytest.raises(ConfigError, match="final_client_accuracy"):
        load_sweep(bad_metric)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs" / "papers").glob("*.toml")),
                         ids=lambda p: p.stem)
def test_every_paper_sweep_file_loads_at_every_scale(path: Path, tmp_path: Path):
    import tomllib

    text = path.read_text()
    if not Path("../shared/data").is_dir() and '"../shared/data"' in text:
        # a clone without the shared datasets: the check is the file, so any existing folder will do
        path = tmp_path / path.name
        path.write_text(text.replace('"../shared/data"', json.dumps(str(tmp_path))))
    for scale in [None, *tomllib.loads(text).get("scales", {})]:
        sweep = load_sweep(path, scale)  # every cell's run-config resolves; tuning has a validation split
        assert sweep.cells()


def _cell(lr: float, seed: int, val: float | None, test: float) -> dict:
    return {"assignments": {"strategy": "s", "lr": lr, "seed": seed}, "status": "finished",
            "summary": {"final_client_val_accuracy": val, "final_client_accuracy": test, "final_accuracy": test}}


def test_tuning_chooses_on_the_validation_split_never_on_test():
    # lr 0.1 is better on validation, lr 1.0 better on both test metrics: the report must pick 0.1
    cells = [_cell(0.1, 1, 0.80, 0.50), _cell(0.1, 2, 0.82, 0.52), _cell(1.0, 1, 0.60, 0.90), _cell(1.0, 2, 0.62, 0.91)]
    doc = {"tune": ["lr"], "cells": {str(i): c for i, c in enumerate(cells)}}
    groups, choices = tuned_groups(doc)
    (setting, group), = groups.items()
    assert choices[setting]["lr"] == 0.1 and {c["assignments"]["lr"] for c in group} == {0.1}
    doc["meta"] = {"tune-metric": "final_client_val_loss"}  # lower is better
    for c, loss in zip(cells, (0.9, 0.8, 0.3, 0.4)):
        c["summary"]["final_client_val_loss"] = loss
    assert next(iter(tuned_groups(doc)[1].values()))["lr"] == 1.0
    for c in cells:  # no validation metric anywhere: refusing beats silently tuning on a test metric
        c["summary"].pop("final_client_val_loss")
    with pytest.raises(ReportError, match="final_client_val_loss"):
        tuned_groups(doc)


def test_validation_split_is_disjoint_and_counted_in_n_i():
    from fedapp.client_data import client_partition_indices, client_train_sizes, load_client_data, split_client_indices
    from fedapp.config import resolve_config

    cfg = resolve_config(None, {"validation-fraction": 0.25, "local-test-fraction": 0.2, "max-samples": 400})
    sizes = client_train_sizes(cfg, 3)
    plain = client_train_sizes(resolve_config(None, {"local-test-fraction": 0.2, "max-samples": 400}), 3)
    for cid, part in enumerate(client_partition_indices(cfg, 3)):
        train, val, test = split_client_indices(part, 0.2, 0.25, int(cfg["seed"]), cid)
        assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
        assert sorted([*train, *val, *test]) == sorted(part)
        assert len(val) == round(0.25 * (len(part) - len(test))) and sizes[cid] == len(train)
        assert plain[cid] == len(train) + len(val)  # without a validation split the clients train on it
        tr, va, te = load_client_data(cfg, cid, 3)
        assert (len(tr), len(va), len(te)) == (len(train), len(val), len(test))


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
    changed = load_sweep(path)
    changed.config["num-server-rounds"] = 3
    with pytest.raises(ConfigError, match="config changed"):  # resuming must not mix two experiments
        run_sweep(changed, tmp_path / "out", engine="inprocess")
    first = doc["cells"][cell_id({"strategy": "fedavg", "lr": 0.5, "seed": 1})]
    assert Path(first["run_dir"]).parent.name == cell_id({"strategy": "fedavg", "lr": 0.5, "seed": 1})
    report = write_report(index).read_text()
    assert "| strategy=fedavg | 2 |" in report and "| strategy=dpsgd-fedavg | 2 |" in report
    assert "final_client_accuracy" in report and "no privacy beats DP-SGD" in report
    assert all(c["summary"]["final_client_val_accuracy"] is not None for c in doc["cells"].values())
    assert "Tuned on the clients' validation split (final_client_val_accuracy" in report
    assert any(v in report for v in ("**holds**", "**does not hold**", "**inconclusive"))
    assert (tmp_path / "out" / "accuracy_rounds.png").stat().st_size > 0
