"""Sweeps (fedapp.experiments.sweep) and reports (fedapp.experiments.report): grid, resume, validation tuning, intervals, verdicts."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from fedapp.config import ConfigError
from fedapp.experiments.report import ReportError, interval, main, paired_test, tuned_groups, verdict, write_report
from fedapp.experiments.sweep import cell_id, load_sweep, run_sweep
from fedapp.experiments.sweep import main as main_sweep

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
    for diffs, expected in (([0.4, 0.41, 0.39], "holds"),  # per-seed differences better - worse
                            ([-0.4, -0.41, -0.39], "not shown (mean on the other side)"),
                            ([0.1, -0.1, 0.05], "not shown"), ([0.4], "fewer than 2 pairs: no test")):
        test = paired_test(diffs)
        assert verdict(test, test.p, 0) == expected, diffs


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
    per_method = SWEEP.replace("validation-fraction = 0.2", "").replace('strategy = ["fedavg", "dpsgd-fedavg"]\n', "")
    per_method = per_method.replace("lr = [0.05, 0.5]\n", "") + (
        '\n[[sweep.variants]]\nstrategy = "fedavg"\nlr = 0.5\n\n[[sweep.variants]]\nstrategy = "dpsgd-fedavg"\nlr = 0.05\n')
    no_validation.write_text(per_method)
    assert len(load_sweep(no_validation).cells()) == 4  # two lrs in all, one a method: nothing is chosen
    bad_metric = tmp_path / "metric.toml"
    bad_metric.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ntune-metric = "final_client_accuracy"'))
    with pytest.raises(ConfigError, match="final_client_accuracy"):
        load_sweep(bad_metric)


def test_tuning_stage_keys_are_checked_before_anything_runs(tmp_path: Path):
    path = tmp_path / "t.toml"
    for extra, error in (("tune-seeds = [2]", "both tune-seeds and evaluation seeds"),
                         ('tune-seeds = ["9"]', "list of integer seeds"),
                         ("tune-extend = 1", "needs tune-seeds"),
                         ("tune-seeds = [9]\ntune-extend = -1", "integer >= 0")):
        path.write_text(SWEEP.replace('tune = ["lr"]', f'tune = ["lr"]\n{extra}'))
        with pytest.raises(ConfigError, match=error):
            load_sweep(path)
    path.write_text(SWEEP.replace('tune = ["lr"]', "tune-seeds = [9]"))
    with pytest.raises(ConfigError, match="no tune keys"):
        load_sweep(path)
    path.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ntune-seeds = [9]'))
    assert len(load_sweep(path).cells()) == 8 + 4  # the evaluation grid and the tuning seed's candidates


def test_a_staged_sweep_tunes_on_its_own_seeds_extends_an_edge_and_evaluates_the_choice(tmp_path: Path):
    """tune-seeds = [9]: seed 9 runs both lrs of each method; with two values the choice is always on an edge, so
    tune-extend = 1 runs one value beyond it (0.005 or 5.0) on seed 9; then seeds 1 and 2 run each method at its
    final choice only. The report chooses on seed 9 and pairs seeds 1-2."""
    path = tmp_path / "s.toml"
    path.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ntune-seeds = [9]\ntune-extend = 1'))
    sweep = load_sweep(path)
    index = run_sweep(sweep, tmp_path / "out", engine="inprocess")
    doc = json.loads(index.read_text())
    assert all(c["status"] == "finished" for c in doc["cells"].values())
    by_seed: dict[int, list[dict]] = {}
    for c in doc["cells"].values():
        by_seed.setdefault(c["assignments"]["seed"], []).append(c["assignments"])
    tuning = by_seed.pop(9)
    assert sorted(by_seed) == [1, 2] and len(tuning) == 6  # 2 methods × (2 lrs + 1 extension)
    extended = [a["lr"] for a in tuning if a["lr"] not in (0.05, 0.5)]
    assert len(extended) == 2 and set(extended) <= {0.005, 5.0}
    groups, choices = tuned_groups(doc)
    for cells in by_seed.values():  # each evaluation seed runs each method once, at the tuning seed's choice
        assert len(cells) == 2
        for a in cells:
            assert a["lr"] == choices[(("strategy", a["strategy"]),)]["lr"]
    assert sorted(c["assignments"]["seed"] for g in groups.values() for c in g) == [1, 1, 2, 2]
    ran = [c["assignments"]["seed"] for c in doc["cells"].values() if c["assignments"]["seed"] != 9]
    assert ran == [1, 1, 2, 2]  # seed by seed (the grid lists strategy first): a stopped sweep leaves whole seeds
    report = write_report(index).read_text()
    assert "4 evaluation cells finished of the 4 planned" in report and "6 tuning cells on seeds 9" in report
    again = run_sweep(sweep, tmp_path / "out", engine="inprocess")  # resumes: nothing left to run
    assert json.loads(again.read_text())["cells"].keys() == doc["cells"].keys()


def test_variants_multiply_the_grid_and_never_overlap_it(tmp_path: Path):
    path = tmp_path / "v.toml"
    path.write_text(SWEEP + '\n[[sweep.variants]]\nsecagg-mechanism = "gaussian"\n'
                    '[[sweep.variants]]\nsecagg-mechanism = "ddg"\nsecagg-bits = 12\n')
    cells = load_sweep(path).cells()
    assert len(cells) == 16  # the 8 grid cells, each once per variant
    assert cells[0]["secagg-mechanism"] == "gaussian" and "secagg-bits" not in cells[0]
    assert cells[1]["secagg-bits"] == 12 and {k: v for k, v in cells[0].items() if not k.startswith("secagg")} == \
        {k: v for k, v in cells[1].items() if not k.startswith("secagg")}
    path.write_text(SWEEP + '\n[[sweep.variants]]\nseed = 3\n')
    with pytest.raises(ConfigError, match="keys the grid does not vary"):
        load_sweep(path)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*/*.toml")),
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


def test_every_paper_file_has_a_mid_scale_and_a_paper_scale(tmp_path: Path):
    """A paper table is run in the paper's regime on 2 cores (mid, five seeds) and at the paper's scale on a GPU."""
    import tomllib

    files = sorted((REPO / "configs" / "papers").glob("*.toml"))
    assert len(files) == 5
    for path in files:
        text = path.read_text()
        assert {"quick", "mid", "paper"} <= set(tomllib.loads(text).get("scales", {})), path.name
        if not Path("../shared/data").is_dir():  # a clone without the shared datasets: any existing folder will do
            path = tmp_path / path.name
            path.write_text(text.replace('"../shared/data"', json.dumps(str(tmp_path))))
        assert len({c["seed"] for c in load_sweep(path, "mid").cells()}) >= 5, path.name


def test_common_random_numbers_seed_the_noise_of_every_cell(tmp_path: Path):
    path = tmp_path / "crn.toml"
    path.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ncommon-random-numbers = true'))
    sweep = load_sweep(path)
    assert sweep.config["seeded-noise"] is True and sweep.meta["common-random-numbers"] is True
    assert load_sweep(path, "quick").config["seeded-noise"] is True
    path.write_text(SWEEP.replace("[scales.quick]", "[scales.quick]\nsweep = { common-random-numbers = true }")
                    .replace("sweep = { num-supernodes = 4 }", ""))
    assert "seeded-noise" not in load_sweep(path).config and load_sweep(path, "quick").config["seeded-noise"] is True
    path.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ncommon-random-numbers = true')
                    .replace("batch-size = 16", "batch-size = 16\nseeded-noise = false"))
    with pytest.raises(ConfigError, match="common-random-numbers"):
        load_sweep(path)  # the sweep cannot both seed the noise and not
    path.write_text(SWEEP.replace('tune = ["lr"]', 'tune = ["lr"]\ncommon-random-numbers = "yes"'))
    with pytest.raises(ConfigError, match="true or false"):
        load_sweep(path)


def _fabricate_sweep(root: Path, seeded: bool = False) -> Path:
    """A finished sweep's folder as fedapp.experiments.sweep leaves it: index.json and one results folder per cell."""
    cells = {}
    for strategy, gain in (("fedavg", 0.02), ("dpsgd-fedavg", 0.0)):
        for lr, val in ((0.05, 0.7), (0.5, 0.6)):
            for seed, base in ((1, 0.4), (2, 0.8), (3, 0.6)):
                assignments = {"strategy": strategy, "lr": lr, "seed": seed}
                run_dir = root / "cells" / cell_id(assignments) / "run"
                run_dir.mkdir(parents=True)
                lead = gain if lr == 0.05 else -2 * gain  # fedavg leads at its tuned lr only
                accs = [base / 2 + lead, base + lead + 0.001 * seed]
                rounds = [{"round": r + 1, "metrics": {"accuracy": a, "client_accuracy": a - 0.01, "loss": 1 - a,
                                                        "epsilon": 0.5 * (r + 1), "client_val_accuracy": val,
                                                        "clients_ok": 3},
                           "clients": [{"client_id": c, "status": "ok", "epsilon_spent": 0.5} for c in range(3)]}
                          for r, a in enumerate(accs)]
                (run_dir / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
                summary = {"finished": True, "final_accuracy": accs[-1], "best_accuracy": max(accs),
                           "final_client_accuracy": accs[-1] - 0.01, "final_loss": 1 - accs[-1],
                           "final_client_val_accuracy": val, "max_epsilon": 1.0, "total_uplink_bytes": 3000,
                           "wall_seconds": 1.5, "max_epsilon_per_client": {"0": 1.0, "1": 1.0, "2": 1.0}}
                (run_dir / "summary.json").write_text(json.dumps(summary))
                config = {**assignments, "seeded-noise": seeded, "num-server-rounds": 2}
                (run_dir / "config.json").write_text(json.dumps({"config": config, "seed": seed}))
                cells[cell_id(assignments)] = {"assignments": assignments, "status": "finished",
                                               "run_dir": str(run_dir), "summary": summary, "seconds": 1.0}
    doc = {"sweep": "fabricated", "file": "fabricated.toml", "meta": {"scale": "quick"}, "num_supernodes": 3,
           "config": {"num-server-rounds": 2}, "grid": {"strategy": ["fedavg", "dpsgd-fedavg"], "lr": [0.05, 0.5],
                                                        "seed": [1, 2, 3]},
           "tune": ["lr"], "claims": [{"text": "no privacy beats DP-SGD", "metric": "final_accuracy",
                                       "better": {"strategy": "fedavg"}, "worse": {"strategy": "dpsgd-fedavg"}}],
           "cells": cells}
    (root / "index.json").write_text(json.dumps(doc))
    return root / "index.json"


def _tables(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


def test_the_index_beside_a_report_rebuilds_its_tables_without_results_folders(tmp_path: Path):
    import shutil

    index = _fabricate_sweep(tmp_path / "sweep")
    first = write_report(index).read_text()
    # paired, at the tuned lr; both lrs of a two-value grid are edges, so the claim waits for a wider grid
    assert "| strategy=fedavg | lr=0.05 (**edge**: lr=0.05 at the bottom of 0.05-0.5) |" in first
    assert "**no verdict: better tuned at lr=0.05 at the bottom of 0.05-0.5; worse tuned at lr=0.05 at the bottom " \
           "of 0.05-0.5; extend the grid**" in first
    assert "No privacy guarantee" not in first
    doc = json.loads(index.read_text())  # the sweep's index now holds every cell's config and round metrics
    for cell in doc["cells"].values():
        assert cell["config"]["strategy"] == cell["assignments"]["strategy"] and cell["summary"]["final_accuracy"]
        assert [r["round"] for r in cell["rounds"]] == [1, 2] and "clients" not in cell["rounds"][0]
        assert "max_epsilon_per_client" not in cell["summary"]  # compact: the results folder keeps it
        assert set(cell["rounds"][0]) == {"round", "accuracy", "client_accuracy", "loss", "epsilon",
                                          "client_val_accuracy"}
    docs = tmp_path / "docs" / "benchmarks" / "fabricated"
    assert main([str(index), "--out", str(docs)]) == 0  # a copy for the docs: report, plots and index together
    assert _tables((docs / "report.md").read_text()) == _tables(first)
    shutil.rmtree(tmp_path / "sweep" / "cells")
    for folder in (tmp_path / "sweep", docs):
        (folder / "report.md").unlink()
        assert main([str(folder / "index.json")]) == 0  # from the index alone
        again = (folder / "report.md").read_text()
        assert _tables(again) and _tables(again) == _tables(first) and again == first
        assert (folder / "accuracy_rounds.png").stat().st_size > 0


def test_a_report_of_seeded_noise_runs_says_they_carry_no_privacy_guarantee(tmp_path: Path):
    report = write_report(_fabricate_sweep(tmp_path, seeded=True)).read_text()
    assert "> **No privacy guarantee:** 12 of 12 finished cells ran with `seeded-noise = true`" in report


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
    from fedapp.config import resolve_config
    from fedapp.data.client_data import (
        client_partition_indices,
        client_train_sizes,
        load_client_data,
        split_client_indices,
    )

    cfg = resolve_config(None, {"validation-fraction": 0.25, "local-test-fraction": 0.2, "max-samples": 400})
    sizes = client_train_sizes(cfg.data, cfg.general.seed, 3)
    plain_cfg = resolve_config(None, {"local-test-fraction": 0.2, "max-samples": 400})
    plain = client_train_sizes(plain_cfg.data, plain_cfg.general.seed, 3)
    for cid, part in enumerate(client_partition_indices(cfg.data, cfg.general.seed, 3)):
        train, val, test = split_client_indices(part, 0.2, 0.25, int(cfg["seed"]), cid)
        assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
        assert sorted([*train, *val, *test]) == sorted(part)
        assert len(val) == round(0.25 * (len(part) - len(test))) and sizes[cid] == len(train)
        assert plain[cid] == len(train) + len(val)  # without a validation split the clients train on it
        tr, va, te = load_client_data(cfg.data, cfg.general.seed, cid, 3)
        assert (len(tr), len(va), len(te)) == (len(train), len(val), len(test))


@pytest.mark.slow
def test_in_process_cells_run_in_parallel_processes_give_what_they_give_one_at_a_time(tmp_path: Path):
    """--parallel 2 with the in-process engine: each cell in a spawned process of its own; with seeded noise every
    cell's round metrics equal those of the same cell run in this process, one cell after the other, to float
    rounding: the cells run on one torch thread, this process on its own count, and neither torch nor its BLAS
    promises bitwise equal sums across thread counts (a full test run once saw a client validation loss differ in the
    8th digit, the global model's metrics equal). One per-sample mode for both: ``auto``'s modes agree to float
    rounding, not bit for bit, and which is fastest is timed (tests/unit/fedapp/clients/test_grad_sample_mode.py
    checks that processes share one choice)."""
    path = tmp_path / "s.toml"
    path.write_text(SWEEP.replace("[sweep.config]", "[sweep.config]\nseeded-noise = true\ngrad-sample-mode = 'hooks'"))
    sweep = load_sweep(path)
    only = {"strategy": "dpsgd-fedavg", "lr": 0.5}
    serial = json.loads(run_sweep(sweep, tmp_path / "serial", engine="inprocess", only=only).read_text())
    parallel = json.loads(run_sweep(sweep, tmp_path / "parallel", engine="inprocess", parallel=2,
                                    only=only).read_text())
    assert sorted(parallel["cells"]) == sorted(serial["cells"]) and len(serial["cells"]) == 2
    assert all(c["status"] == "finished" for c in parallel["cells"].values())
    for cid, cell in serial["cells"].items():
        got = parallel["cells"][cid]["rounds"]
        assert [sorted(r) for r in got] == [sorted(r) for r in cell["rounds"]], cid
        for mine, theirs in zip(got, cell["rounds"]):
            for key, value in theirs.items():
                if isinstance(value, float):
                    assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (cid, mine["round"], key)
                else:
                    assert mine[key] == value, (cid, mine["round"], key)


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
    for c in doc["cells"].values():  # the index alone holds what the report reads, compactly
        assert c["config"]["seed"] == c["assignments"]["seed"] and [r["round"] for r in c["rounds"]] == [1, 2]
        assert "max_epsilon_per_client" not in c["summary"] and "max_epsilon" in c["summary"]
        assert "max_epsilon_per_client" in json.loads((Path(c["run_dir"]) / "summary.json").read_text())
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
    assert any(v in report for v in ("**holds**", "**not shown"))
    assert (tmp_path / "out" / "accuracy_rounds.png").stat().st_size > 0


@pytest.mark.slow
def test_a_cell_killed_mid_run_continues_from_its_checkpoint_as_if_never_stopped(tmp_path: Path):
    """kill -9 a sweep in the middle of a cell: run again, the cell continues from its newest checkpoint instead of
    round 1, and with seeded noise its rounds equal those of the same cell run without a stop."""
    path = tmp_path / "s.toml"
    path.write_text(SWEEP.replace("num-server-rounds = 2", "num-server-rounds = 6\nseeded-noise = true\n"
                                  "grad-sample-mode = 'hooks'")
                    .replace('model = "logreg"', 'model = "auto"').replace("max-samples = 300", "max-samples = 1500"))
    only = {"strategy": "dpsgd-fedavg", "lr": 0.05, "seed": 1}
    flags = [f for k, v in only.items() for f in ("--only", f"{k}={v}")]
    out, cid = tmp_path / "killed", cell_id(only)
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fedapp.experiments.sweep", str(path), "--engine", "inprocess",
                                 "--out", str(out), *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if any(len(f.read_text().splitlines()) >= 2 for f in out.glob(f"cells/{cid}/*/rounds.jsonl")):
                os.killpg(proc.pid, signal.SIGKILL)  # rounds 1-2 committed, round 3 under way
                break
            time.sleep(0.02)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    (killed,) = [p for p in (out / "cells" / cid).iterdir() if not p.name.startswith(".")]
    committed = killed.joinpath("rounds.jsonl").read_text().splitlines()
    assert 2 <= len(committed) < 6
    assert main_sweep([str(path), "--engine", "inprocess", "--out", str(out), *flags]) == 0
    entry = json.loads((out / "index.json").read_text())["cells"][cid]
    assert entry["status"] == "finished" and Path(entry["run_dir"]) != killed
    resumed = Path(entry["run_dir"]).joinpath("rounds.jsonl").read_text().splitlines()
    assert resumed[:len(committed)] == committed  # the killed run's rounds, wall times and all: not trained again
    assert [r["round"] for r in entry["rounds"]] == [1, 2, 3, 4, 5, 6]
    whole = json.loads(run_sweep(load_sweep(path), tmp_path / "whole", engine="inprocess", only=only).read_text())
    assert entry["rounds"] == whole["cells"][cid]["rounds"]


def test_a_claim_whose_sides_never_share_a_setting_is_reported_not_dropped(tmp_path: Path):
    index = _fabricate_sweep(tmp_path / "sweep")
    doc = json.loads(index.read_text())
    # a side that names a value no cell has
    doc["claims"].append({"text": "fedavg beats DP-SGD with 5 clients a round", "metric": "final_accuracy",
                          "better": {"strategy": "fedavg"}, "worse": {"strategy": "dpsgd-fedavg",
                                                                      "clients-per-round": 5}})
    index.write_text(json.dumps(doc))
    report = write_report(index).read_text()
    assert "| no privacy beats DP-SGD |" in report
    assert "| fedavg beats DP-SGD with 5 clients a round | – | final_accuracy |" in report
    assert "**not run: no cell matches its worse side**" in report


def test_the_cell_count_is_of_the_scales_grid_not_of_the_index_entries(tmp_path: Path):
    """A partial sweep reads "k finished of the scale's N" with N from the grid; an entry outside the grid is
    counted apart, and a failed entry not at all."""
    index = _fabricate_sweep(tmp_path / "sweep")
    doc = json.loads(index.read_text())
    dropped = [cid for cid, c in doc["cells"].items() if c["assignments"]["seed"] == 3]
    for cid in dropped[:3]:
        del doc["cells"][cid]
    doc["cells"][dropped[3]]["status"] = "failed"
    doc["grid"]["seed"] = [1, 2, 3, 4]
    outside = dict(next(iter(doc["cells"].values())), assignments={"strategy": "fedavg", "lr": 0.05, "seed": 9})
    doc["cells"]["outside"] = outside
    index.write_text(json.dumps(doc))
    report = write_report(index).read_text()
    assert "Cells: 8 finished of the scale's 16 (and 1 outside its grid, reported too);" in report


def test_a_tune_key_with_one_value_a_group_is_stated_as_set_not_as_chosen(tmp_path: Path):
    """Each method at an lr an earlier validation sweep chose: the report says the file set it, and the claims
    compare the methods at those lrs."""
    index = _fabricate_sweep(tmp_path / "sweep")
    doc = json.loads(index.read_text())
    doc["cells"] = {cid: c for cid, c in doc["cells"].items()
                    if (c["assignments"]["strategy"], c["assignments"]["lr"]) in (("fedavg", 0.05), ("dpsgd-fedavg", 0.5))}
    grid = doc["grid"]
    doc["grid"], doc["variants"] = {"seed": [1, 2, 3]}, [{"strategy": "fedavg", "lr": 0.05},
                                                        {"strategy": "dpsgd-fedavg", "lr": 0.5}]
    index.write_text(json.dumps(doc))
    report = write_report(index).read_text()
    assert "Set by the sweep file, one value a group (no choice made here): strategy=dpsgd-fedavg: lr=0.5; " \
           "strategy=fedavg: lr=0.05." in report
    assert "Tuned on the clients' validation split" not in report
    assert ("| no privacy beats DP-SGD | (all) | final_accuracy | 62.2 ± 49.8 (n=3) | 60.2 ± 49.8 (n=3) "
            "| +2.0 ± 0.0 (n=3) |") in report  # fedavg at its 0.05 against DP-SGD at its 0.5
    doc["grid"] = grid  # a tuning sweep with one lr a method finished so far: still a choice, not a setting
    del doc["variants"]
    index.write_text(json.dumps(doc))
    report = write_report(index).read_text()
    assert "Set by the sweep file" not in report and "Tuned on the clients' validation split" in report


COMMITTED_REPORTS = sorted(p.parent for p in (REPO / "docs" / "benchmarks").glob("*/index.json")
                           if (p.parent / "report.md").is_file())


@pytest.mark.parametrize("folder", COMMITTED_REPORTS, ids=lambda p: p.name)
def test_every_committed_report_is_rewritten_exactly_from_its_index(folder: Path, tmp_path: Path):
    """docs/benchmarks/<name>/report.md is what `python -m fedapp.experiments.report <name>/index.json` writes."""
    out = tmp_path / folder.name
    assert main([str(folder / "index.json"), "--out", str(out)]) == 0
    assert (out / "report.md").read_text() == (folder / "report.md").read_text()


def test_rerunning_a_finished_sweep_takes_the_files_current_claims(tmp_path: Path):
    """A claim edited after the cells ran reaches index.json (and so the report) without rerunning a cell."""
    from fedapp.experiments.sweep import Index

    path, out = tmp_path / "s.toml", tmp_path / "out"
    path.write_text(SWEEP)
    out.mkdir()
    index = Index(out, load_sweep(path))
    index.record("c1", {"assignments": {"seed": 1}, "status": "finished"})
    path.write_text(SWEEP.replace('text = "no privacy beats DP-SGD"', 'text = "FedAvg beats DP-SGD"'))
    Index(out, load_sweep(path))
    doc = json.loads((out / "index.json").read_text())
    assert [c["text"] for c in doc["claims"]] == ["FedAvg beats DP-SGD"] and doc["cells"]["c1"]["status"] == "finished"


def test_a_sweep_resumes_from_its_index_alone_in_a_fresh_folder(tmp_path: Path):
    """A committed index.json copied into a new --out: its finished cells (summary, config, rounds in the entry)
    are not run again although their results folders are gone; an entry without its rounds is."""
    from fedapp.experiments.sweep import Index

    path, old, new = tmp_path / "s.toml", tmp_path / "old", tmp_path / "new"
    path.write_text(SWEEP)
    old.mkdir()
    index = Index(old, load_sweep(path))
    whole = {"assignments": {"seed": 1}, "status": "finished", "run_dir": str(old / "cells" / "gone"),
             "summary": {"finished": True}, "config": {"seed": 1}, "rounds": [{"round": 1}]}
    index.record("whole", whole)
    index.record("no-rounds", {k: v for k, v in whole.items() if k != "rounds"})
    index.record("stopped", {**whole, "status": "stopped"})
    new.mkdir()
    shutil.copy(old / "index.json", new / "index.json")
    resumed = Index(new, load_sweep(path))
    assert resumed.done("whole")
    assert not resumed.done("no-rounds") and not resumed.done("stopped") and not resumed.done("never-ran")


def test_only_selects_cells_by_grid_value_and_names_an_unknown_key_or_value(tmp_path: Path):
    from fedapp.experiments.sweep import parse_only

    path = tmp_path / "s.toml"
    path.write_text(SWEEP)
    sweep = load_sweep(path)
    assert parse_only(sweep, ["seed=1", "lr=0.5", "strategy=fedavg"]) == {"seed": 1, "lr": 0.5, "strategy": "fedavg"}
    with pytest.raises(ConfigError, match="'momentum' is not a grid or variant key"):
        parse_only(sweep, ["momentum=0.5"])
    with pytest.raises(ConfigError, match="no cell has seed = 9"):
        parse_only(sweep, ["seed=9"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_only(sweep, ["seed"])
    assert main_sweep([str(path), "--only", "seed=9", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_a_scale_s_variants_replace_the_file_s_and_take_their_keys_out_of_the_grid(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text(SWEEP + '''
[scales.paired]
variants = [{ strategy = "fedavg", lr = 0.5 }, { strategy = "dpsgd-fedavg", lr = 0.05 }]
''')
    sweep = load_sweep(path, "paired")
    assert "strategy" not in sweep.grid and "lr" not in sweep.grid and sweep.tune == ["lr"]
    assert sorted((c["strategy"], c["lr"], c["seed"]) for c in sweep.cells()) == [
        ("dpsgd-fedavg", 0.05, 1), ("dpsgd-fedavg", 0.05, 2), ("fedavg", 0.5, 1), ("fedavg", 0.5, 2)]
    # the report pairs the methods across the tune key: one lr each, the claim judged on seeds 1 and 2
    out = tmp_path / "out"
    out.mkdir()
    doc = {"sweep": sweep.name, "meta": sweep.meta, "config": sweep.config, "grid": sweep.grid, "tune": sweep.tune,
           "claims": sweep.claims, "cells": {}}
    for c in sweep.cells():
        acc = (0.9 if c["strategy"] == "fedavg" else 0.5) + 0.01 * c["seed"]
        doc["cells"][cell_id(c)] = {"assignments": c, "status": "finished", "config": {}, "rounds": [],
                                    "summary": {"finished": True, "final_accuracy": acc, "final_client_accuracy": acc,
                                                "final_client_val_accuracy": acc}}
    (out / "index.json").write_text(json.dumps(doc))
    report = write_report(out / "index.json").read_text()
    assert "| no privacy beats DP-SGD |" in report and "no setting has cells on both sides" not in report
    doc["claims"].append({"text": "FedAvg beats SCAFFOLD", "metric": "final_accuracy",
                          "better": {"strategy": "fedavg"}, "worse": {"strategy": "scaffold"}})
    (out / "index.json").write_text(json.dumps(doc))
    report = write_report(out / "index.json").read_text()
    assert "| FedAvg beats SCAFFOLD | – | final_accuracy | – | – | – | – | – | – | **not run: no cell matches its worse side** |" \
        in report
    path.write_text(SWEEP + '\n[scales.odd]\nvariant = [{ lr = 0.5 }]\n')
    with pytest.raises(ConfigError, match=r"takes config, grid, sweep, variants and claims, not \['variant'\]"):
        load_sweep(path, "odd")
    path.write_text(SWEEP + '\n[scales.own]\nclaims = [{ text = "lr 0.5 beats 0.1", metric = "final_accuracy", '
                    'better = { lr = 0.5 }, worse = { lr = 0.1 } }]\n')
    assert [c["text"] for c in load_sweep(path, "own").claims] == ["lr 0.5 beats 0.1"]  # the scale's replace the file's
    assert [c["text"] for c in load_sweep(path).claims] != ["lr 0.5 beats 0.1"]


def test_reuse_takes_another_sweeps_finished_cells_whatever_their_key_order(tmp_path: Path, monkeypatch):
    """--reuse records another index's finished cell under this sweep's id without running it (its assignments
    written in the other key order, as another scale's grid and variants give them); a stopped cell is not taken,
    and an index run with another config is refused before --out exists."""
    from fedapp.experiments import sweep as sweep_module
    from fedapp.experiments.sweep import Index

    path, other, out = tmp_path / "s.toml", tmp_path / "other", tmp_path / "out"
    path.write_text(SWEEP)
    sweep = load_sweep(path, "quick")
    other.mkdir()
    index = Index(other, sweep)
    mine = {"strategy": "fedavg", "lr": 0.05, "seed": 1}
    theirs = dict(reversed(list(mine.items())))
    assert cell_id(theirs) != cell_id(mine)  # the readable prefix follows the key order
    whole = {"assignments": theirs, "status": "finished", "run_dir": str(other / "gone"),
             "summary": {"finished": True, "final_accuracy": 0.5}, "config": {"seed": 1}, "rounds": [{"round": 1}]}
    index.record(cell_id(theirs), whole)
    index.record("stopped", {**whole, "assignments": {**mine, "strategy": "dpsgd-fedavg"}, "status": "stopped"})

    def no_run(*args, **kwargs):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(sweep_module, "_run_cell", no_run)
    run_sweep(sweep, out, only=mine, reuse=[other / "index.json"])
    cells = json.loads((out / "index.json").read_text())["cells"]
    assert list(cells) == [cell_id(mine)]
    assert cells[cell_id(mine)]["assignments"] == mine and list(cells[cell_id(mine)]["assignments"]) == list(mine)
    assert cells[cell_id(mine)]["summary"] == whole["summary"]
    assert cells[cell_id(mine)]["reused_from"] == str(other / "index.json")
    stopped = {**mine, "strategy": "dpsgd-fedavg"}
    run_sweep(sweep, out, only=stopped, reuse=[other / "index.json"])  # the stopped cell is run again
    assert "a cell ran" in json.loads((out / "index.json").read_text())["cells"][cell_id(stopped)]["error"]

    full = load_sweep(path)  # the default scale: 3 SuperNodes, not quick's 4
    assert main_sweep([str(path), "--reuse", str(other / "index.json"), "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="its num_supernodes differs from this scale's"):
        run_sweep(full, tmp_path / "new", reuse=[other / "index.json"])


def test_robust_hdp_mid_eps_takes_its_dist2_tuning_cells_from_the_committed_indexes_its_file_names():
    """The --reuse indexes of robust_hdp_table12.toml's mid-eps command hold the 8 dist2 seed-101 cells its comment
    counts, and only tuning cells: none of the evaluation seeds (41-45) comes from another sweep."""
    from fedapp.experiments.sweep import _assignment_key, reusable_cells

    sweep = load_sweep(REPO / "configs/papers/robust_hdp_table12.toml", "mid-eps")
    text = sweep.path.read_text()
    paths = ["docs/benchmarks/robust_hdp_mid_resolve/index.json", "docs/benchmarks/robust_hdp_mid_min_eps/index.json"]
    assert all(f"--reuse {p}" in text for p in paths) and "8 of its 36 tuning cells" in text
    pool = reusable_cells([REPO / p for p in paths], sweep)
    tuning = [c for c in sweep.tuning_cells() if _assignment_key(c) in pool]
    assert len(sweep.tuning_cells()) == 36 and len(tuning) == 8
    assert {(c["privacy-dist"], c["seed"]) for c in tuning} == {("dist2", 101)}
    assert not {entry["assignments"]["seed"] for entry in pool.values()} & set(sweep.grid["seed"])


def test_the_committed_post_hoc_lr_check_reuses_mid_ft_s_cells_as_its_sweep_file_says():
    """dp2_fedsam_mid_ft_lr's DP-FedSAM-FT cells are mid-ft's, taken by the --reuse its sweep file documents."""
    from fedapp.experiments.sweep import reusable_cells

    sweep = load_sweep(REPO / "configs/papers/dp2_fedsam_table2.toml", "mid-ft-lr")
    assert "--reuse docs/benchmarks/dp2_fedsam_mid_ft/index.json" in sweep.path.read_text()
    pool = reusable_cells([REPO / "docs/benchmarks/dp2_fedsam_mid_ft/index.json"], sweep)
    committed = json.loads((REPO / "docs/benchmarks/dp2_fedsam_mid_ft_lr/index.json").read_text())["cells"]
    planned = {cell_id(c): c for c in sweep.cells()}
    taken = {cid: pool[json.dumps(c, sort_keys=True)] for cid, c in planned.items()
             if json.dumps(c, sort_keys=True) in pool}
    assert len(taken) == 25 and {c["assignments"]["strategy"] for c in taken.values()} == {"dp-fedsam-ft"}
    for cid, entry in taken.items():
        assert committed[cid]["summary"] == entry["summary"] and committed[cid]["rounds"] == entry["rounds"]
