"""Fed-SMP's figures in a sweep report: accuracy against the compression ratio p, against cumulative uplink bits, and
the uplink each setting spends to first reach a target accuracy, checked by hand on fabricated cells."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedapp.experiments.report import to_target, write_report


def _cell(p: float, seed: int, accuracies: list[float | None], bytes_a_round: int) -> dict[str, Any]:
    rounds = [{"round": t, "uplink_bytes": bytes_a_round, **({"accuracy": a} if a is not None else {})}
              for t, a in enumerate(accuracies, start=1)]
    final = [a for a in accuracies if a is not None][-1]
    return {"assignments": {"strategy": "fed-smp-randk", "seed": seed, "compression-ratio": p}, "status": "finished",
            "config": {}, "rounds": rounds, "summary": {"finished": True, "final_accuracy": final}}


def test_the_first_evaluated_round_at_the_target_and_the_bits_sent_until_then() -> None:
    cell = _cell(0.4, 1, [None, 0.5, None, 0.91, 0.95], 1000)
    assert to_target(cell, 0.9) == (4, 4 * 8 * 1000.0)
    assert to_target(cell, 0.95) == (5, 5 * 8 * 1000.0)
    assert to_target(cell, 0.96) is None


def test_a_sweep_over_p_gets_accuracy_against_p_and_uplink_and_the_uplink_to_its_target(tmp_path: Path) -> None:
    cells = {}
    for seed in (1, 2):
        cells[f"small-{seed}"] = _cell(0.05, seed, [0.5, 0.7, 0.8, 0.85], 100)  # never reaches 0.9
        cells[f"mid-{seed}"] = _cell(0.4, seed, [0.6, 0.9 if seed == 1 else 0.8, 0.92, 0.93], 800)
    doc = {"sweep": "fed-smp-table1", "file": "f.toml", "meta": {"scale": "mid-ratio", "target-accuracy": 0.9},
           "num_supernodes": 10, "config": {}, "grid": {"strategy": ["fed-smp-randk"], "seed": [1, 2]}, "tune": [], "claims": [], "cells": cells,
           "variants": [{"compression-ratio": 0.05}, {"compression-ratio": 0.4}]}
    (tmp_path / "index.json").write_text(json.dumps(doc))
    report = write_report(tmp_path / "index.json").read_text()
    assert "Cells: 4 finished of the scale's 4;" in report
    assert (tmp_path / "accuracy_compression-ratio.png").stat().st_size > 0
    assert (tmp_path / "accuracy_uplink.png").stat().st_size > 0
    assert "![accuracy vs compression-ratio](accuracy_compression-ratio.png)" in report
    assert "| strategy=fed-smp-randk, compression-ratio=0.05 | 0 of 2 | – | – |" in report
    # seed 1 at round 2 (2 rounds × 800 bytes × 8 bits = 12,800), seed 2 at round 3 (19,200): mean 16,000
    row = next(line for line in report.splitlines() if line.startswith("| strategy=fed-smp-randk, compression-ratio=0.4 | 2 of"))
    assert row == "| strategy=fed-smp-randk, compression-ratio=0.4 | 2 of 2 | 2.5 ± 6.4 | 1.6e+04 ± 4.1e+04 |"


def test_personalized_cells_use_the_clients_accuracy_and_cells_never_evaluated_draw_no_uplink_curve(tmp_path):
    """DP2-FedSAM evaluates on the clients (``client_accuracy``); a sweep whose rounds carry bytes but no accuracy at
    all gets no uplink figure rather than an empty log axis."""
    personal = {"rounds": [{"round": t, "uplink_bytes": 500, "client_accuracy": a} for t, a in ((1, 0.8), (2, 0.92))]}
    assert to_target(personal, 0.9) == (2, 2 * 8 * 500.0)
    silent = {"cells": {"a": _cell(0.4, 1, [None, 0.5], 500)}}
    silent["cells"]["a"]["rounds"] = [{"round": 1, "uplink_bytes": 500}, {"round": 2, "uplink_bytes": 500}]
    doc = {"sweep": "s", "file": "f.toml", "meta": {"scale": "x"}, "num_supernodes": 2, "config": {},
           "grid": {"seed": [1]}, "tune": [], "claims": [], **silent}
    (tmp_path / "index.json").write_text(json.dumps(doc))
    report = write_report(tmp_path / "index.json").read_text()
    assert "accuracy_uplink.png" not in report and not (tmp_path / "accuracy_uplink.png").exists()


def test_a_personalized_sweep_over_epsilon_plots_the_clients_accuracy(tmp_path: Path, monkeypatch: Any) -> None:
    """DP2-FedSAM records no server test accuracy: its accuracy-against-ε figure plots the mean client test accuracy,
    one point per ε and method (an empty figure before)."""
    from fedapp.experiments import report as report_module

    plotted: list[tuple[str, str, dict[Any, list[float]]]] = []

    def record(groups: Any, key: str, path: Path, metric: str = "final_accuracy") -> None:
        points = {dict(s)[key]: [c["summary"].get(metric) for c in cells] for s, cells in groups.items()}
        plotted.append((key, metric, points))
        path.write_bytes(b"png")

    monkeypatch.setattr(report_module, "plot_epsilon", record)
    cells = {f"{eps}-{seed}": {"assignments": {"strategy": "dp2-fedsam", "target-epsilon": eps, "seed": seed},
                               "status": "finished", "config": {},
                               "rounds": [{"round": 1, "client_accuracy": 0.5 + eps / 10}],
                               "summary": {"finished": True, "final_client_accuracy": 0.5 + eps / 10 + seed / 100}}
             for eps in (1.0, 2.0) for seed in (1, 2)}
    doc = {"sweep": "dp2", "file": "f.toml", "meta": {"scale": "mid-eps"}, "num_supernodes": 4, "config": {},
           "grid": {"strategy": ["dp2-fedsam"], "target-epsilon": [1.0, 2.0], "seed": [1, 2]}, "tune": [],
           "claims": [], "cells": cells}
    (tmp_path / "index.json").write_text(json.dumps(doc))
    report = write_report(tmp_path / "index.json").read_text()
    assert "![accuracy vs target-epsilon](accuracy_epsilon.png)" in report
    assert plotted == [("target-epsilon", "final_client_accuracy", {1.0: [0.61, 0.62], 2.0: [0.71, 0.72]})]
    assert report_module.accuracy_metric({("a",): [cells["1.0-1"]]}) == "final_client_accuracy"
    # a global method beside them records both: the figure still plots what every cell has
    both = {"summary": {"final_accuracy": 0.7, "final_client_accuracy": 0.68}}
    assert report_module.accuracy_metric({("a",): [cells["1.0-1"]], ("g",): [both]}) == "final_client_accuracy"
    assert report_module.accuracy_metric({("g",): [both]}) == "final_accuracy"


def test_the_figure_plots_the_accuracy_the_claims_judge(tmp_path: Path, monkeypatch: Any) -> None:
    """Robust-HDP's cells record the server's test accuracy and the mean client test accuracy; its claims and its
    paper (Table 12) judge the latter, so its accuracy-against-ε figure plots that (the server's before). Claims
    on two metrics, on an accuracy no cell records, or on a loss leave the figure on the server's accuracy."""
    from fedapp.experiments import report as report_module

    plotted: list[str] = []

    def record(groups: Any, key: str, path: Path, metric: str = "final_accuracy") -> None:
        plotted.append(metric)
        path.write_bytes(b"png")

    monkeypatch.setattr(report_module, "plot_epsilon", record)
    cells = {f"{dist}-{rule}-{seed}": {
        "assignments": {"privacy-dist": dist, "strategy": rule, "seed": seed}, "status": "finished", "config": {},
        "rounds": [{"round": 1, "accuracy": 0.8, "client_accuracy": 0.7}],
        "summary": {"finished": True, "final_accuracy": 0.8 + seed / 100, "final_client_accuracy": 0.7 + seed / 100}}
        for dist in ("dist2", "dist4") for rule in ("robust-hdp", "weiavg") for seed in (1, 2)}
    claim = {"text": "Robust-HDP >= WeiAvg", "metric": "final_client_accuracy", "better": {"strategy": "robust-hdp"},
             "worse": {"strategy": "weiavg"}}
    doc = {"sweep": "robust-hdp", "file": "f.toml", "meta": {"scale": "mid-eps"}, "num_supernodes": 4, "config": {},
           "grid": {"privacy-dist": ["dist2", "dist4"], "strategy": ["robust-hdp", "weiavg"], "seed": [1, 2]},
           "tune": [], "claims": [claim], "cells": cells}
    (tmp_path / "index.json").write_text(json.dumps(doc))
    write_report(tmp_path / "index.json")
    assert plotted == ["final_client_accuracy"]
    groups = {("a",): list(cells.values())}
    assert report_module.accuracy_metric(groups, [claim, {**claim, "metric": "final_accuracy"}]) == "final_accuracy"
    assert report_module.accuracy_metric(groups, [{**claim, "metric": "best_accuracy"}]) == "final_accuracy"
    assert report_module.accuracy_metric(groups, [{**claim, "metric": "final_loss"}]) == "final_accuracy"


def test_a_privacy_distribution_tick_names_its_mean_epsilon() -> None:
    """Robust-HDP's dist2-dist8 say nothing of the budgets' size: the accuracy-against-ε figure's ticks give each
    distribution's mean ε_i; other keys' values stay as they are."""
    from fedapp.experiments.report import tick

    assert tick("privacy-dist", "dist2") == "dist2\nmean ε 1.64"
    assert tick("privacy-dist", "dist8") == "dist8\nmean ε 0.32"
    assert tick("privacy-dist", "fixed") == "fixed"
    assert tick("target-epsilon", 2.0) == "2.0"
