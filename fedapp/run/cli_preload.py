"""Flower's commands with their imports done before they are called.

The launcher's chain to a run is SuperLink → SuperExec → ``flwr run`` → the simulation runtime, and two links of it
are Python processes that spend most of their start importing Flower: the SuperExec (~0.7 s) and ``flwr run``
(~0.7 s of its ~0.85 s). Neither could start before the SuperLink answers, so both imports used to sit on the way to
round 1. :class:`PreloadedCommand` starts ``python -m fedapp.run.cli_preload COMMAND [ARGS]`` as soon as the launcher
starts: the child imports the function behind Flower's console script (:data:`ENTRY_POINTS`) while the SuperLink
boots, then reads one line from its stdin, a JSON list of further arguments, and runs ``COMMAND ARGS…`` in its own
process: the same code, arguments, environment and working directory as the script, so its output and exit code
are the command's. Stdin closed without a line: the child exits without running anything.

A child that could not import its command has exited by the time it is called, and the script then runs as a plain
subprocess instead, so preloading only ever saves time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedapp.run.processes import parent_death_preexec, venv_bin

#: Flower's console scripts that can be preloaded: the module and the function each script runs
ENTRY_POINTS = {
    "flwr": ("flwr.cli.app", "app"),
    "flower-superexec": ("flwr.supercore.cli.flower_superexec", "flower_superexec"),
}
#: the line the child writes to stderr once the command is imported
READY = "[cli_preload] imported"


class PreloadedCommand:
    """One Flower command (:data:`ENTRY_POINTS`) with ``args``: its interpreter started and its code imported ahead
    of :meth:`run` (wait for it, output captured) or :meth:`start` (it goes on running, its stdout and stderr in the
    file ``output``; ``new_session`` detaches it from the terminal's signals as the SuperLink is)."""

    def __init__(self, command: str, env: Mapping[str, str], cwd: Path, args: Sequence[str] = (),
                 output: Path | None = None, new_session: bool = False) -> None:
        if command not in ENTRY_POINTS:
            raise ValueError(f"no preloaded entry point for {command!r} (known: {sorted(ENTRY_POINTS)})")
        self.command, self.args = command, list(args)
        self.env, self.cwd, self.output, self.new_session = dict(env), cwd, output, new_session
        with self._sink("w") as sink:  # the child holds its own descriptor
            #: the preloaded child; it waits for its line until :meth:`run`, :meth:`start` or :meth:`close`
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                [sys.executable, "-m", __name__, command, *self.args], env=self.env, cwd=str(cwd),
                stdin=subprocess.PIPE, stdout=sink, stderr=sink, text=True, start_new_session=new_session,
                preexec_fn=parent_death_preexec())
        self._waiting = True

    def _sink(self, mode: str) -> contextlib.AbstractContextManager[Any]:
        """Where the command's output goes: the ``output`` file, or pipes (``run`` captures them)."""
        if self.output is None:
            return contextlib.nullcontext(subprocess.PIPE)
        return open(self.output, mode, encoding="utf-8")

    def _script(self, more: Sequence[str]) -> list[str]:
        return [venv_bin(self.command), *self.args, *more]

    def _take_live(self) -> subprocess.Popen[str] | None:
        """The child if it is still waiting for its line; a child that exited (its import failed) is reaped."""
        if not self._waiting:
            raise RuntimeError(f"the preloaded {self.command} was used or closed already")
        self._waiting = False
        if self.proc.poll() is None:
            return self.proc
        self.proc.communicate()
        return None

    def run(self, more: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``COMMAND ARGS MORE``, waited for, its output captured. Raises ``subprocess.TimeoutExpired`` after
        ``timeout``; the command is stopped on that and on an interrupt."""
        if self.output is not None:
            raise ValueError("run() captures the output: construct without output")
        proc = self._take_live()
        if proc is None:
            return subprocess.run(self._script(more), env=self.env, cwd=str(self.cwd), capture_output=True,
                                  text=True, timeout=timeout, preexec_fn=parent_death_preexec())
        try:
            out, err = proc.communicate(json.dumps(list(more)) + "\n", timeout=timeout)
        except BaseException:  # the timeout, or an interrupt of this process: what subprocess.run does
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(self._script(more), proc.returncode, out, err.replace(READY + "\n", ""))

    def start(self, more: Sequence[str] = ()) -> subprocess.Popen[str]:
        """``COMMAND ARGS MORE`` left running: the preloaded child itself, or the script started now."""
        if self.output is None:
            raise ValueError("start() writes the output to a file: construct with output")
        proc = self._take_live()
        if proc is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps(list(more)) + "\n")
                proc.stdin.close()
                return proc
            except BrokenPipeError:  # it exited after all: reaped below, the script runs instead
                proc.wait()
        with self._sink("a") as sink:  # after what the child wrote before it exited
            return subprocess.Popen(self._script(more), env=self.env, cwd=str(self.cwd), stdout=sink, stderr=sink,
                                    text=True, start_new_session=self.new_session, preexec_fn=parent_death_preexec())

    def close(self) -> None:
        """End the child if it was never called (closing its stdin ends it; SIGKILL if it does not end)."""
        if not self._waiting:
            return
        self._waiting = False
        try:
            self.proc.communicate("", timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _lean_superexec() -> None:
    """The SuperExec hands over to a waiter after its launch when the launcher asks (:mod:`fedapp.compat.lean_superexec`);
    under a Flower it was not written for it runs as it is, with a warning."""
    from fedapp.compat import lean_superexec

    try:
        lean_superexec.install()
    except (RuntimeError, ValueError) as exc:
        print(f"[cli_preload] the SuperExec stays whole after its launch: {exc}", file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ENTRY_POINTS:
        print(f"usage: python -m {__name__} {{{','.join(ENTRY_POINTS)}}} [ARGS]", file=sys.stderr)
        return 2
    module, function = ENTRY_POINTS[argv[0]]
    entry = getattr(importlib.import_module(module), function)
    if argv[0] == "flower-superexec":
        _lean_superexec()
    print(READY, file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    more = json.loads(line)
    if not isinstance(more, list) or not all(isinstance(a, str) for a in more):
        print(f"[cli_preload] expected a JSON list of strings, got {line.strip()[:200]!r}", file=sys.stderr)
        return 2
    sys.argv = [argv[0], *argv[1:], *more]
    entry()  # a typer/click command exits with its code; flower_superexec returns when it stops
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
