"""fedapp.compat.lean_superexec: Flower's SuperExec plugin, once it has started a simulation task, becomes the small
waiter in the same process (same PID, same children), which exits with its children or with the SuperLink."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import REPO

from fedapp.compat import lean_superexec, surface

#: a process that plays the SuperExec: installs the wrapper, launches a task through Flower's own plugin whose
#: executor starts ``sleep SECONDS``, then prints what the launch returned (only when it did return)
SUPEREXEC = textwrap.dedent("""
    import subprocess, sys
    from flwr.proto.task_pb2 import Task
    from flwr.supercore.superexec.executor.types import LaunchResult
    from flwr.supercore.superexec.plugin import AutoExecPlugin
    from fedapp.compat import lean_superexec

    class Executor:
        def launch(self, spec):
            child = subprocess.Popen(["sleep", sys.argv[2]])
            print(f"child {child.pid} parent-pid {spec.parent_pid}", flush=True)
            return LaunchResult.accepted()

    assert lean_superexec.install()
    plugin = AutoExecPlugin("127.0.0.1:1", True, None, executor=Executor())
    result = plugin.launch_task(token="t", task=Task(task_id=1, run_id=1, type=sys.argv[1]))
    print(f"returned {result.status}", flush=True)
""")


def _superexec(task_type: str, superlink_pid: int, sleep_s: float) -> subprocess.Popen[str]:
    env = {"PYTHONPATH": str(REPO), lean_superexec.ENV: str(superlink_pid), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, "-c", SUPEREXEC, task_type, str(sleep_s)], env=env, cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_after_a_simulation_launch_the_process_is_the_waiter_until_its_child_exits() -> None:
    proc = _superexec("flwr-simulation", superlink_pid=psutil.Process().pid, sleep_s=3)
    try:
        me = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while "-S" not in me.cmdline() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert me.cmdline()[1:5] == ["-S", "-I", "-c", lean_superexec.WAITER]  # same PID, new image
        assert me.memory_info().rss < 30e6, me.memory_info()
        (child,) = me.children()
        assert child.cmdline()[0] == "sleep"  # the runtime stays this PID's child
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"parent-pid {proc.pid}" in out and "returned" not in out, out  # execv: the launch never returned


def test_the_waiter_exits_when_the_superlink_is_gone_and_its_child_outlives_it() -> None:
    superlink = subprocess.Popen(["sleep", "60"])
    proc = _superexec("flwr-simulation", superlink_pid=superlink.pid, sleep_s=60)
    try:
        me = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while not ("-S" in me.cmdline() and me.children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        (child,) = me.children()
        superlink.kill()
        superlink.wait()
        proc.wait(timeout=10)  # as flower-superexec --parent-pid does
    finally:
        proc.kill()
        superlink.kill()
    assert child.is_running()  # the runtime has a --parent-pid monitor of its own; here a plain sleep
    child.kill()


def test_another_task_type_returns_as_flowers_plugin_does() -> None:
    proc = _superexec("flwr-clientapp", superlink_pid=psutil.Process().pid, sleep_s=0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "returned accepted" in out, (out, err)


def test_install_needs_the_superlinks_pid_and_wraps_only_through_the_surface(monkeypatch) -> None:
    monkeypatch.delenv(lean_superexec.ENV, raising=False)
    assert lean_superexec.install() is False
    monkeypatch.setenv(lean_superexec.ENV, "off")
    with pytest.raises(ValueError, match=lean_superexec.ENV):
        lean_superexec.install()
    monkeypatch.setenv(lean_superexec.ENV, "12345")
    original = surface.library_object(lean_superexec.LAUNCH_TASK)
    try:
        assert lean_superexec.install() is True
        wrapped = surface.resolve(lean_superexec.LAUNCH_TASK)
        assert wrapped is not original and wrapped.__wrapped__ is original
        assert not surface.problems(lean_superexec.GROUP)  # the checks still see Flower's own method
    finally:
        surface.restore(lean_superexec.LAUNCH_TASK, original)
    assert surface.resolve(lean_superexec.LAUNCH_TASK) is original


def test_the_launcher_asks_for_the_waiter_unless_switched_off(monkeypatch) -> None:
    from fedapp.run.launch import lean_superexec_env

    monkeypatch.delenv(lean_superexec.ENV, raising=False)
    assert lean_superexec_env(4321) == {lean_superexec.ENV: "4321"}
    monkeypatch.setenv(lean_superexec.ENV, "off")
    assert lean_superexec_env(4321) == {lean_superexec.ENV: ""}
