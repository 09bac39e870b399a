"""fedapp.run.console: what the launcher prints of Flower's log, where the whole log goes, and its closing summary."""

from __future__ import annotations

import pytest

from fedapp.compat.server_log import RESULTS_FOLDER_LINE
from fedapp.run.console import (
    FLOWER_LOG,
    VERBOSE_ENV,
    echo_progress,
    progress_line,
    summary_lines,
    verbose_from_env,
)
from fedapp.run.launch import NewRun, main
from fedapp.state.results import ResultsWriter

THREAT = "record-level local DP: DP-SGD on each client with its own (ε_i, δ_i) before anything leaves it; untrusted server"


@pytest.mark.parametrize(("line", "shown"), [
    ("INFO     [round 3/30] accuracy=0.5000 loss=1.2 (0.9s)", "[dpfl] [round 3/30] accuracy=0.5000 loss=1.2 (0.9s)"),
    ("\x1b[92mINFO \x1b[0m:      [round 1/2] accuracy=0.1", "[dpfl] [round 1/2] accuracy=0.1"),  # run_simulation's colours
    ("WARNING  a client failed", "WARNING  a client failed"),
    ("\x1b[91mERROR \x1b[0m:     boom", "ERROR :     boom"),
    ("INFO     configure_fit: strategy sampled 20 clients (out of 20)", None),
    ("INFO     [ROUND 1]", None),
    ("INFO     [SUMMARY]", None),
    ("      History (loss, centralized):", None),
])
def test_quiet_mode_keeps_round_headlines_warnings_and_errors_only(line, shown):
    assert progress_line(line) == shown


def test_echo_progress_prints_only_what_it_keeps(capsys):
    for line in ("INFO     [ROUND 2]", "INFO     [round 2/2] accuracy=0.9", "INFO     fit progress: (2, ...)"):
        echo_progress(line)
    assert capsys.readouterr().out == "[dpfl] [round 2/2] accuracy=0.9\n"


@pytest.mark.parametrize(("value", "verbose"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)])
def test_the_environment_can_ask_for_the_whole_log(value, verbose, monkeypatch):
    assert verbose_from_env({VERBOSE_ENV: value}) is verbose
    monkeypatch.setenv(VERBOSE_ENV, value)
    assert verbose_from_env() is verbose


def test_every_line_goes_to_flower_log_in_the_results_folder_also_those_before_it_was_named(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    results = NewRun(announce=True)
    for line in ("INFO     Starting Flower ServerApp", f"\x1b[92mINFO \x1b[0m:      {RESULTS_FOLDER_LINE}{folder}",
                 "INFO     [ROUND 1]", "INFO     [SUMMARY]"):
        results.saw(line)
    results.close()
    assert results.folder == folder
    assert (folder / FLOWER_LOG).read_text().splitlines() == [
        "INFO     Starting Flower ServerApp", f"INFO :      {RESULTS_FOLDER_LINE}{folder}", "INFO     [ROUND 1]",
        "INFO     [SUMMARY]"]  # colour codes dropped
    assert f"(Flower's log: {folder / FLOWER_LOG})" in capsys.readouterr().out


def _run_folder(tmp_path, num_clients: int, spent: float = 0.9, strategy: str = "robust-hdp"):
    """A results folder as the ServerApp writes it: two rounds of ``num_clients`` clients with budgets 1.0."""
    private = strategy != "fedavg"
    writer = ResultsWriter(tmp_path / "out", {"strategy": strategy, "dataset": "digits", "seed": 3},
                           meta={"privacy": {"threat_model": THREAT if private else "none (non-private baseline)",
                                             "guarantee": "as stated by the threat model"}})
    for rnd in (1, 2):
        clients = [{"client_id": i, "status": "ok", **({"epsilon_spent": spent * rnd / 2 + 0.01 * i,
                                                        "epsilon_budget": 1.0, "delta": 1e-4} if private else {})}
                   for i in range(num_clients)]
        writer.write_round({"round": rnd, "metrics": {"accuracy": 0.4 + 0.1 * rnd, "clients_ok": num_clients},
                            "clients": clients})
    writer.finish()
    assert writer.run_dir is not None
    (writer.run_dir / FLOWER_LOG).write_text("INFO     [SUMMARY]\n")
    return writer.run_dir


def test_the_summary_lists_up_to_20_clients_against_their_budgets_and_where_everything_is(tmp_path):
    run_dir = _run_folder(tmp_path, num_clients=20)
    lines = summary_lines(run_dir)
    text = "\n".join(lines)
    assert len(lines) <= 25, text
    assert "test accuracy of the global model: 60.0 % after the last round" in text
    assert "ε spent / budget per client, δ = 1e-04 each: 11 of 20 within budget" in text  # 0.9 + 0.01 i ≤ 1.0
    assert "c0  0.90/1.00" in text and "c19 1.09/1.00!" in text  # over budget: marked
    assert f"threat model: {THREAT}" in text
    assert f"results: {run_dir}" in text
    for name in ("summary.json", "rounds.jsonl", "config.json", "accuracy.png", "privacy.png", FLOWER_LOG):
        assert name in lines[-1], lines[-1]


def test_more_than_20_clients_are_summarised_by_min_median_max(tmp_path):
    lines = summary_lines(_run_folder(tmp_path, num_clients=200, spent=0.5))
    text = "\n".join(lines)
    assert len(lines) <= 25 and "51 of 200 within budget" in text  # 0.5 + 0.01 i ≤ 1.0 for i ≤ 50
    assert "ε spent: min 0.50, median " in text and ", max 2.49" in text
    assert "spent / budget: min 0.50, median " in text and "c0 " not in text


def test_an_audited_run_shows_the_audits_estimate_and_bound_beside_the_accountant(tmp_path):
    import json

    run_dir = _run_folder(tmp_path, num_clients=4)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["audit"] = {"level": "record", "canaries": 400, "epsilon_accountant": 1.0,
                        "final_model": {"epsilon_estimate": 0.12, "epsilon_interval": [0.01, 0.5],
                                        "epsilon_lower_bound": 0.0}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    text = "\n".join(summary_lines(run_dir))
    assert ("audit (400 record-level canaries, final model): estimate 0.12 [0.01, 0.50], lower bound 0.00 (95 %); "
            "accountant ε 1.00") in text
    assert "audit (" not in "\n".join(summary_lines(_run_folder(tmp_path / "plain", num_clients=4)))


def test_a_non_private_run_says_so(tmp_path):
    text = "\n".join(summary_lines(_run_folder(tmp_path, num_clients=3, strategy="fedavg")))
    assert "no ε was accounted (a non-private run)" in text and "threat model: none" in text


def test_main_prints_the_summary_after_a_run(tmp_path, monkeypatch, capsys):
    """``python -m fedapp.run.launch``'s last screen is the summary of the folder the run returned (the run itself
    is stubbed here; tests/integration/fedapp/run/test_launch.py runs a real one)."""
    from fedapp.run import launch

    run_dir = _run_folder(tmp_path, num_clients=4)
    seen = {}

    def fake_run(*args, **kwargs):
        seen.update(kwargs)
        return run_dir

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert main(["--num-supernodes", "4"]) == 0
    out = capsys.readouterr().out
    assert seen["verbose"] is False and "4 of 4 within budget" in out and "summary.json" in out
    assert main(["--num-supernodes", "4", "--verbose"]) == 0 and seen["verbose"] is True
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert main(["--num-supernodes", "4"]) == 0 and seen["verbose"] is True


def test_an_amplified_secure_sum_reports_the_delta_its_epsilon_holds_at(tmp_path):
    """The accountant's δ plus SecAgg+'s minimum cohort's share (strategies.privacy.secure_minimum) reaches
    summary.json and the last screen, from the round records (the largest: δ only grows with rounds)."""
    import json

    writer = ResultsWriter(tmp_path / "out", {"strategy": "dp-fedavg", "dataset": "digits", "seed": 3},
                           meta={"privacy": {"threat_model": THREAT, "guarantee": "as stated by the threat model"}})
    for rnd, (total, vs_release) in enumerate(((0.02, 0.03), (0.049, 0.06)), start=1):
        writer.write_round({"round": rnd, "metrics": {"clients_ok": 3, "epsilon_vs_release": 1.5 * rnd,
                                                      "delta_total": total, "delta_vs_release": vs_release},
                            "clients": [{"client_id": i, "status": "ok", "epsilon_spent": 0.9 * rnd,
                                         "epsilon_budget": 2.0, "delta": 0.01} for i in range(3)]})
    writer.finish()
    assert writer.run_dir is not None
    (writer.run_dir / FLOWER_LOG).write_text("INFO     [SUMMARY]\n")
    summary = json.loads((writer.run_dir / "summary.json").read_text())
    assert summary["delta_total"] == 0.049 and summary["delta_vs_release"] == 0.06
    text = "\n".join(summary_lines(writer.run_dir))
    assert "δ of the budget's ε, with SecAgg+'s minimum cohort: 0.049" in text
    assert "δ of the ε against the released models, with SecAgg+'s minimum cohort: 0.06" in text
    assert "max ε against observers of the released models: 3.00" in text
