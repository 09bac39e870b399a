"""benchmarks/peer_pfl.py splits the time outside the rounds into start-up and teardown from a run's own output."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from benchmarks.peer_pfl import OUR_MARKS, PFL_MARKS, PFL_SIDE, Phases, run_measured

CHILD = """
import time
print("INFO     starting", flush=True)
time.sleep(0.4)
print("INFO     [ROUND 1]", flush=True)
time.sleep(0.2)
print("INFO     [round 1/2] accuracy=0.1", flush=True)
print("INFO     [ROUND 2]", flush=True)
time.sleep(0.2)
print("INFO     [round 2/2] accuracy=0.2", flush=True)
time.sleep(0.5)
print("bye", flush=True)
"""


def test_a_run_is_split_at_its_first_round_and_its_last_rounds_end(tmp_path):
    """A real child process: start-up ends at the first ``[ROUND 1]`` line, teardown starts at the last
    ``[round t/T]`` line, and the log still receives every line."""
    log = tmp_path / "child.log"
    phases = Phases(*OUR_MARKS)
    code, wall, _ = run_measured([sys.executable, "-c", CHILD], env={}, cwd=tmp_path, log=log, interval=0.2,
                                 timeout=60, phases=phases)
    split = phases.split(wall)
    assert code == 0
    assert split["start_up"] is not None and split["teardown"] is not None
    assert 0.4 <= split["start_up"] < wall - 0.4, split  # after the 0.4 s sleep, before the two rounds
    assert 0.5 <= split["teardown"] < wall - 0.8, split  # the 0.5 s after the last round's line
    assert phases.round1_begins is not None and phases.last_round_ended is not None
    assert phases.last_round_ended - phases.round1_begins >= 0.4  # the second round's line, not the first's
    assert log.read_text(encoding="utf-8").splitlines() == [
        "INFO     starting", "INFO     [ROUND 1]", "INFO     [round 1/2] accuracy=0.1", "INFO     [ROUND 2]",
        "INFO     [round 2/2] accuracy=0.2", "bye"]


def test_a_run_without_marker_lines_has_no_split(tmp_path):
    phases = Phases(*PFL_MARKS)
    code, wall, _ = run_measured([sys.executable, "-c", "print('no rounds here')"], env={}, cwd=tmp_path,
                                 log=tmp_path / "x.log", interval=0.2, timeout=60, phases=phases)
    assert code == 0 and phases.split(wall) == {"start_up": None, "teardown": None}


def _string_constant(path: Path, name: str) -> str:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError(f"{path} defines no {name}")


def test_the_pfl_markers_match_the_lines_pfl_side_prints():
    """pfl_side.py runs in pfl's environment, so peer_pfl.py cannot import its constants: read them from its source."""
    begins, ended = _string_constant(PFL_SIDE, "TRAIN_BEGINS"), _string_constant(PFL_SIDE, "ROUND_ENDED")
    assert PFL_MARKS[0].search(begins) and not PFL_MARKS[1].search(begins)
    assert PFL_MARKS[1].search(f"{ended} 3") and not PFL_MARKS[0].search(f"{ended} 3")
