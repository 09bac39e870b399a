"""A SuperExec that becomes a 3-4 MB waiter once it has started the launcher's one simulation run.

The launcher runs its own ``flower-superexec`` beside its private SuperLink (:mod:`fedapp.run.launch`,
:mod:`fedapp.run.cli_preload`). That SuperExec polls the SuperLink for a task, starts Flower's simulation runtime
(``flwr-simulation``) for the run, and then only polls on for the rest of the run: 101 MB of PSS (Flower, gRPC,
SQLAlchemy, cryptography, numpy) through every round (docs/benchmarks/peer_pfl.md). The launcher's SuperLink holds
one run, so nothing is left for it to start.

With :data:`ENV` set (the launcher sets it for its own SuperExec only), :func:`install` wraps Flower's
``BaseExecPlugin.launch_task``: once it has started a ``flwr-simulation`` task (launch result ``accepted``), the process
replaces its image (``execv``) by :data:`WAITER`, a Python interpreter without site packages that reaps its children
and exits when none is left or when the SuperLink (the SuperExec's ``--parent-pid``) is gone. The PID stays the same,
so the simulation runtime keeps its parent (its ``--parent-pid`` is this PID), the process tree that the launcher and
its watchdog stop is unchanged, and SIGTERM still ends the process. Nothing of the run passes through the SuperExec:
the runtime talks to the SuperLink with the task's token.

Flower's objects it relies on are registered in :mod:`fedapp.compat.surface` (group ``lean-superexec``); under another
Flower :func:`install` raises, and :mod:`fedapp.run.cli_preload` then runs the SuperExec as it is.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fedapp.compat import surface

#: environment variable holding the SuperLink's PID: set, the SuperExec hands over to :data:`WAITER` after its launch
ENV = "DPFL_LEAN_SUPEREXEC"
GROUP = "lean-superexec"
LAUNCH_TASK = "flwr.supercore.superexec.plugin.base_exec_plugin.BaseExecPlugin.launch_task"
#: what the process runs after its launch: ``python -S -I -c WAITER <SuperLink PID>``; reaps children, exits when
#: none is left (with the last one's status) or when the SuperLink is gone, polling every 0.5 s
WAITER = """\
import os, sys, time
superlink, code = int(sys.argv[1]), 0
while True:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid:
        code = os.waitstatus_to_exitcode(status)
        continue
    try:
        os.kill(superlink, 0)
    except ProcessLookupError:
        break
    except PermissionError:
        pass
    time.sleep(0.5)
sys.exit(code if code >= 0 else 1)
"""


def waiter_argv(superlink_pid: int) -> list[str]:
    """The command line :func:`install`'s wrapper ``execv``\\ s into."""
    return [sys.executable, "-S", "-I", "-c", WAITER, str(int(superlink_pid))]


def _simulation_started(task: Any, result: Any) -> bool:
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import LaunchResultStatus

    return getattr(task, "type", None) == TaskType.SIMULATION.value and result.status == LaunchResultStatus.ACCEPTED


def install() -> bool:
    """With :data:`ENV` set to the SuperLink's PID, make this process's SuperExec hand over to :data:`WAITER` after it
    started a simulation task; True when in place. Raises RuntimeError under a Flower whose SuperExec differs from the
    one this was written for, ValueError for a PID that is not a positive integer."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return False
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{ENV} = {value!r}: the SuperLink's PID, a positive integer")
    superlink = int(value)
    surface.require(GROUP)
    original = surface.library_object(LAUNCH_TASK)

    def launch_task(self: Any, token: str, task: Any) -> Any:
        result = original(self, token, task)
        if _simulation_started(task, result):
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            argv = waiter_argv(superlink)
            os.execv(argv[0], argv)
        return result

    launch_task.__wrapped__ = original  # type: ignore[attr-defined]
    surface.replace(LAUNCH_TASK, launch_task)
    return True
