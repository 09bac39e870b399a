"""fedapp.compat.server_log: the ServerApp's log in the file the launcher prints, and how the launcher reads it."""

from __future__ import annotations

import pytest

from fedapp.compat import server_log
from fedapp.compat.server_log import ENV, LogFollower, detach, log_to_file_from_env


@pytest.fixture(autouse=True)
def _detached():
    detach()
    yield
    detach()


def test_only_flowers_simulation_runtime_named_by_the_launcher_writes_the_file(tmp_path, monkeypatch):
    path = tmp_path / "serverapp.log"
    monkeypatch.delenv(ENV, raising=False)
    assert log_to_file_from_env("/venv/bin/flwr-simulation") is None  # not launched by the launcher
    monkeypatch.setenv(ENV, str(path))
    assert log_to_file_from_env("/venv/bin/python") is None  # a Ray actor or the launcher itself: inherits the env
    assert log_to_file_from_env("/venv/bin/flwr-simulation") == path
    assert log_to_file_from_env("/venv/bin/flwr-simulation") == path  # the ServerApp and ClientApp modules both call
    from flwr.common.logger import FLOWER_LOGGER as flwr  # Flower's logger as the runtime has it (level DEBUG)

    flwr.info("[round 1/2] accuracy=0.5")
    flwr.debug("not what `flwr run --stream` shows")
    assert path.read_text().splitlines() == ["INFO     [round 1/2] accuracy=0.5"]  # one handler, INFO and up
    assert sum(1 for h in flwr.handlers if h is server_log._attached) == 1


def test_the_follower_returns_whole_lines_once_and_a_last_unterminated_line_at_the_end(tmp_path):
    path = tmp_path / "growing.log"
    follow = LogFollower(path)
    assert follow.new_lines() == []  # not created yet
    path.write_bytes(b"one\ntw")
    assert follow.new_lines() == ["one"]
    with open(path, "ab") as fh:
        fh.write(b"o\n\nthree \xe2\x82")  # a line split inside a UTF-8 character
    assert follow.new_lines() == ["two", ""]
    with open(path, "ab") as fh:
        fh.write(b"\xac")
    assert follow.new_lines() == []
    assert follow.new_lines(final=True) == ["three \u20ac"]
    assert follow.new_lines(final=True) == []


def test_the_launcher_takes_its_runs_folder_from_the_log_not_from_whatever_appeared_in_the_output_folder(tmp_path):
    """Two launches into one output folder: each ends on its own run's summary, named in its own ServerApp log."""
    import json

    from fedapp.compat.server_log import RESULTS_FOLDER_LINE
    from fedapp.run.launch import NewRun
    from fedapp.state.results import ResultsWriter

    logged: list[str] = []
    ours = ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "digits", "seed": 1, "run-name": "ours"},
                         on_open=lambda folder: logged.append(f"INFO     {RESULTS_FOLDER_LINE}{folder}"))
    other = ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "digits", "seed": 2, "run-name": "other"})
    results = NewRun()
    for line in ["INFO     [INIT]", *logged]:
        results.saw(line)
    assert results.folder is None and not results.ended()  # no folder named yet
    other.open()
    ours.open()
    other.finish()  # the other launch's run ended first
    for line in logged:
        results.saw(line)
    assert results.folder == ours.run_dir and not results.ended()
    ours.finish()
    assert results.ended() and not results.summary()["finished"]  # no round trained: ended, not finished
    assert json.loads((ours.run_dir / "summary.json").read_text())["stopped_reason"]
