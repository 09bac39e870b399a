"""The ServerApp's log as a file that the project's launcher prints while the run goes on.

``flwr run --stream`` relays the ServerApp's log through the SuperLink's Control API to a Flower CLI process that
lives as long as the run (76 MB of PSS at the run's peak, docs/benchmarks.md). The launcher
(:mod:`fedapp.run.launch`) instead submits the run with a plain ``flwr run``, which returns once the run has started,
names a file in :data:`ENV` for the Flower processes it starts, and prints that file as it grows. Flower's
simulation runtime ``flwr-simulation`` imports this project's ServerApp and ClientApp modules before it starts
Ray; each calls :func:`log_to_file_from_env`, which attaches one file handler to Flower's logger there, so the file
holds what ``--stream`` would show from then on: the ServerApp's rounds, Flower's workflow messages and every
error either logs. Ray's actors inherit the environment and import the ClientApp module too; they write nothing
(only the runtime process acts). Without :data:`ENV` (a plain ``flwr run``, a deployment) nothing changes.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

#: environment variable naming the file; set by the launcher for the SuperLink and its descendants
ENV = "DPFL_SERVER_LOG"
#: the process that runs the ServerApp when ``flwr run`` targets a SuperLink started with ``--simulation``
SIMULATION_RUNTIME = "flwr-simulation"
FORMAT = "%(levelname)-8s %(message)s"
#: what the ServerApp logs, followed by the path, once its results folder exists: the launcher's way to tell its own
#: run's folder from another one started into the same output folder meanwhile
RESULTS_FOLDER_LINE = "results folder: "
#: what the ServerApp logs once Flower's round loop has returned (its summary logged): the launcher's sign that the log
#: is complete, since the results' last file is written before the last round's line and Flower's summary
RUN_END_LINE = "ServerApp: the round loop returned"

_attached: logging.Handler | None = None


def log_to_file_from_env(program: str | None = None) -> Path | None:
    """In ``flwr-simulation`` (``program``: default ``sys.argv[0]``) with :data:`ENV` set, append every record of
    Flower's ``flwr`` logger to that file, once per process; returns the file, elsewhere None."""
    global _attached
    path = os.environ.get(ENV, "").strip()
    if not path or Path(program if program is not None else sys.argv[0]).name != SIMULATION_RUNTIME:
        return None
    if _attached is None:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")  # flushed after every record
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.setLevel(logging.INFO)  # what `flwr run --stream` shows
        logging.getLogger("flwr").addHandler(handler)
        _attached = handler
    return Path(path)


def detach() -> None:
    """Undo :func:`log_to_file_from_env` (for tests; the runtime process simply ends)."""
    global _attached
    if _attached is not None:
        logging.getLogger("flwr").removeHandler(_attached)
        _attached.close()
        _attached = None


class LogFollower:
    """The lines a growing text file gained since the last call (a last line without its newline waits for it,
    unless ``final``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            chunk = b""
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", errors="replace") for line in lines]
