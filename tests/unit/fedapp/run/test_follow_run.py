"""fedapp.run.launch.follow_run: the launcher prints the ServerApp's whole log, and stops following once it is over."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedapp.compat.server_log import RESULTS_FOLDER_LINE, RUN_END_LINE
from fedapp.run.launch import NewRun, follow_run
from fedapp.run.processes import Processes
from fedapp.state.results import ResultsWriter


def _append(path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


@dataclass
class Launch:
    """What follow_run watches: the ServerApp's log, its results writer (which names its folder in that log), and a
    stand-in for the simulation runtime among the launcher's processes."""

    log: Path
    writer: ResultsWriter
    runtime: subprocess.Popen
    procs: Processes


@pytest.fixture
def launch(tmp_path) -> Iterator[Launch]:
    log = tmp_path / "serverapp.log"
    writer = ResultsWriter(tmp_path / "out", {"strategy": "fedavg", "dataset": "digits", "seed": 1},
                           on_open=lambda folder: _append(log, f"INFO     {RESULTS_FOLDER_LINE}{folder}"))
    # a process whose command line carries the simulation runtime's name and that outlives the test's run
    runtime = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flwr-simulation"])
    procs = Processes()
    procs.add(runtime)
    try:
        yield Launch(log, writer, runtime, procs)
    finally:
        runtime.kill()
        runtime.wait()


def test_the_lines_after_the_last_results_file_are_printed_before_the_launcher_stops(launch, capsys):
    """The results' summary.json says "finished" before the ServerApp logs the last round's line and Flower's
    summary: following stops at the ServerApp's last line, not at the summary, while the runtime still runs."""
    writer = launch.writer

    def server_app() -> None:
        writer.open()
        writer.write_round({"round": 1, "metrics": {"accuracy": 0.5}, "clients": []})
        time.sleep(0.5)  # the launcher is following by now
        writer.finish()
        time.sleep(0.6)  # several of the launcher's polls see a finished summary and no last line yet
        for line in ("[round 1/1] accuracy=0.5000", "[SUMMARY]", RUN_END_LINE):
            _append(launch.log, f"INFO     {line}")

    writer_thread = threading.Thread(target=server_app)
    try:
        results = NewRun()
        writer_thread.start()
        start = time.monotonic()
        pid = follow_run(launch.procs, launch.log, timeout=30, results=results, poll=0.05)
        took = time.monotonic() - start
        assert pid == launch.runtime.pid and launch.runtime.poll() is None  # it stopped following a live runtime
        printed = capsys.readouterr().out
        for line in ("[round 1/1] accuracy=0.5000", "[SUMMARY]", RUN_END_LINE):
            assert line in printed, printed
        assert results.ended() and results.log_complete and took < 10
    finally:
        writer_thread.join()


def test_a_server_app_that_never_logs_its_last_line_is_left_a_bounded_wait_after_its_summary(launch, capsys,
                                                                                               monkeypatch):
    """A ServerApp that failed after its results were written logs no last line: the launcher stops following
    :data:`LOG_END_WAIT_S` after summary.json said the run ended, with what the log holds printed."""
    from fedapp.run import launch as launcher

    monkeypatch.setattr(launcher, "LOG_END_WAIT_S", 0.4)
    launch.writer.open()
    launch.writer.write_round({"round": 1, "metrics": {}, "clients": []})
    launch.writer.finish()
    _append(launch.log, "ERROR    something failed after the results were written")
    results = NewRun()
    start = time.monotonic()
    follow_run(launch.procs, launch.log, timeout=30, results=results, poll=0.05)
    took = time.monotonic() - start
    assert 0.4 <= took < 5 and not results.log_complete
    assert "something failed after the results were written" in capsys.readouterr().out
