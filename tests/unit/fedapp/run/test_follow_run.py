"""fedapp.run.launch.follow_run: the launcher prints the ServerApp's whole log, and stops following once it is over."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from fedapp.compat.server_log import RESULTS_FOLDER_LINE, RUN_END_LINE
from fedapp.run.launch import NewRun, follow_run
from fedapp.run.processes import Processes
from fedapp.state.results import ResultsWriter


def _stand_in_runtime() -> subprocess.Popen:
    """A process whose command line carries the simulation runtime's name and that outlives the test's run."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flwr-simulation"])


def _append(path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def test_the_lines_after_the_last_results_file_are_printed_before_the_launcher_stops(tmp_path, capsys):
    """The results' summary.json says "finished" before the ServerApp logs the last round's line and Flower's
    summary: following stops at the ServerApp's last line, not at the summary, while the runtime still runs."""
    log = tmp_path / "serverapp.log"
    writer = ResultsWriter(tmp_path / "out", {"strategy": "fedavg", "dataset": "digits", "seed": 1},
                           on_open=lambda folder: _append(log, f"INFO     {RESULTS_FOLDER_LINE}{folder}"))
    runtime = _stand_in_runtime()
    procs = Processes()
    procs.add(runtime)

    def server_app() -> None:
        writer.open()
        writer.write_round({"round": 1, "metrics": {"accuracy": 0.5}, "clients": []})
        time.sleep(0.5)  # the launcher is following by now
        writer.finish()
        time.sleep(0.6)  # several of the launcher's polls see a finished summary and no last line yet
        for line in ("[round 1/1] accuracy=0.5000", "[SUMMARY]", RUN_END_LINE):
            _append(log, f"INFO     {line}")

    writer_thread = threading.Thread(target=server_app)
    try:
        results = NewRun()
        writer_thread.start()
        start = time.monotonic()
        pid = follow_run(procs, log, timeout=30, results=results, poll=0.05)
        took = time.monotonic() - start
        assert pid == runtime.pid and runtime.poll() is None  # it stopped following a runtime that still runs
        printed = capsys.readouterr().out
        for line in ("[round 1/1] accuracy=0.5000", "[SUMMARY]", RUN_END_LINE):
            assert line in printed, printed
        assert results.ended() and results.log_complete and took < 10
    finally:
        writer_thread.join()
        runtime.kill()
        runtime.wait()


def test_a_server_app_that_never_logs_its_last_line_is_left_a_bounded_wait_after_its_summary(tmp_path, capsys,
                                                                                               monkeypatch):
    """A ServerApp that failed after its results were written logs no last line: the launcher stops following
    :data:`LOG_END_WAIT_S` after summary.json said the run ended, with what the log holds printed."""
    from fedapp.run import launch

    monkeypatch.setattr(launch, "LOG_END_WAIT_S", 0.4)
    log = tmp_path / "serverapp.log"
    writer = ResultsWriter(tmp_path / "out", {"strategy": "fedavg", "dataset": "digits", "seed": 1},
                           on_open=lambda folder: _append(log, f"INFO     {RESULTS_FOLDER_LINE}{folder}"))
    runtime = _stand_in_runtime()
    procs = Processes()
    procs.add(runtime)
    try:
        writer.open()
        writer.write_round({"round": 1, "metrics": {}, "clients": []})
        writer.finish()
        _append(log, "ERROR    something failed after the results were written")
        results = NewRun()
        start = time.monotonic()
        follow_run(procs, log, timeout=30, results=results, poll=0.05)
        took = time.monotonic() - start
        assert 0.4 <= took < 5 and not results.log_complete
        assert "something failed after the results were written" in capsys.readouterr().out
    finally:
        runtime.kill()
        runtime.wait()
