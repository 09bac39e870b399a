"""How the deployment launcher waits for ``flwr run --stream``: with real processes standing in for Flower's, every
way a deployment can stall ends in seconds with a message that names the cause (:func:`fedapp.run.deploy.await_run`),
never in a wait as long as the run's timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedapp.run.deploy import await_run, log_tails
from fedapp.run.processes import Processes


def _sleeper(seconds: float, *marks: str) -> subprocess.Popen:
    """A process alive ``seconds``, whose command line carries ``marks`` (as Flower's ``flwr-serverapp`` does)."""
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})", *marks])


@pytest.fixture
def procs():
    procs = Processes()
    yield procs
    assert procs.stop_all(timeout=5) == []


def _summary(folder: Path, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(fields), encoding="utf-8")


def test_a_supernode_that_dies_during_the_run_ends_the_wait_naming_it(procs, tmp_path) -> None:
    runner = procs.add(_sleeper(60))
    procs.add(_sleeper(60, "flwr-serverapp"))
    node = procs.add(_sleeper(0.5))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"SuperNode 1 \(pid \d+\) exited with code 0 during the run"):
        await_run(runner, {"SuperNode 1": node}, procs, tmp_path, set(), timeout=60, poll=0.05)
    assert time.monotonic() - start < 10


def test_a_run_whose_server_app_never_starts_is_reported_pending(procs, tmp_path) -> None:
    runner = procs.add(_sleeper(60))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no ServerApp process started within 1 s of flwr run: the run stayed "
                                           "pending"):
        await_run(runner, {}, procs, tmp_path, set(), timeout=60, poll=0.05, start_timeout=1.0)
    assert time.monotonic() - start < 10


def test_a_stream_that_outlives_the_runs_summary_is_stopped_and_the_results_decide(procs, tmp_path) -> None:
    runner = procs.add(_sleeper(60))
    procs.add(_sleeper(60, "flwr-serverapp"))
    earlier = tmp_path / "earlier"
    _summary(earlier, finished=True)  # a run folder from before this one: not this run's end
    _summary(tmp_path / "this-run", finished=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not end within 2 s"):
        await_run(runner, {}, procs, tmp_path, {earlier}, timeout=2, poll=0.05, end_wait=0.5)
    _summary(tmp_path / "this-run", finished=True)
    assert await_run(runner, {}, procs, tmp_path, {earlier}, timeout=30, poll=0.05, end_wait=0.5) == 0
    assert runner.poll() is not None and 2.5 <= time.monotonic() - start < 10


def test_the_runners_own_exit_code_is_returned(procs, tmp_path) -> None:
    runner = procs.add(subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"]))
    assert await_run(runner, {}, procs, tmp_path, set(), timeout=30, poll=0.05) == 3


def test_a_failure_quotes_the_end_of_every_log(tmp_path) -> None:
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "supernode-2.log").write_text("\n".join(f"line {i}" for i in range(40)) + "\n\n")
    (tmp_path / "flwr-home" / "superlink-123.out").write_text("ERROR the SuperLink said this\n")
    text = log_tails(tmp_path, lines=3)
    assert "--- supernode-2.log (last 3 lines)\nline 37\nline 38\nline 39" in text
    assert "--- superlink-123.out (last 1 lines)\nERROR the SuperLink said this" in text and "line 36" not in text
