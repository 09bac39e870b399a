"""Process helpers behind the launchers: signals, parent-death signal, watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from fedapp.run.processes import Interrupted, signals_as_interrupt, start_watchdog

LINUX = sys.platform.startswith("linux")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# a process that starts a child and prints its PID: a two-level tree like SuperLink -> superexec
TREE = [sys.executable, "-c", textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")]


def _gone(pid: int, create_time: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            p = psutil.Process(pid)
            if p.create_time() != create_time or p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _kill(*procs: subprocess.Popen | psutil.Process) -> None:
    for p in procs:
        try:
            p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stop_signals_interrupt_once_and_handlers_are_restored(sig) -> None:
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as info, signals_as_interrupt():
        os.kill(os.getpid(), sig)
        time.sleep(5)
    assert info.value.signum == sig and isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(sig) is before
    with signals_as_interrupt():  # a second signal during cleanup cannot abort it
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), sig)
            time.sleep(5)
        os.kill(os.getpid(), sig)
        time.sleep(0.2)


def test_no_handlers_outside_the_main_thread() -> None:
    seen = []

    def body() -> None:
        with signals_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux-only")
def test_parent_death_signal_stops_the_child_of_a_killed_parent() -> None:
    middle = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        from fedapp.run.processes import parent_death_preexec
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                 preexec_fn=parent_death_preexec())
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(middle.stdout.readline()))
        middle.kill()  # kill -9: no cleanup code runs in the parent
        middle.wait()
        assert _gone(child.pid, child.create_time(), timeout=5)
    finally:
        _kill(middle, *([child] if child else []))


def test_watchdog_stops_the_tree_when_its_parent_dies() -> None:
    parent = subprocess.Popen(SLEEPER)
    root = subprocess.Popen(TREE, stdout=subprocess.PIPE, text=True)
    grandchild = psutil.Process(int(root.stdout.readline()))
    dog = start_watchdog(root, parent_pid=parent.pid, interval=0.1)
    try:
        time.sleep(1.5)  # the watchdog has recorded the tree
        parent.kill()
        parent.wait()
        assert dog.wait(timeout=20) == 1
        assert root.wait(timeout=5) is not None  # stopped by PID (its parent, the test, reaps it)
        assert _gone(grandchild.pid, grandchild.create_time(), timeout=5)
    finally:
        _kill(parent, root, grandchild, dog)


def test_watchdog_stops_every_tree_it_was_given() -> None:
    """The launcher's SuperLink and SuperExec are two trees (the SuperExec is the launcher's child): one watchdog
    stops both, grandchildren included, once the launcher is gone."""
    parent = subprocess.Popen(SLEEPER)
    roots = [subprocess.Popen(TREE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    grandchildren = [psutil.Process(int(r.stdout.readline())) for r in roots]
    dog = start_watchdog(*roots, parent_pid=parent.pid, interval=0.1)
    try:
        time.sleep(1.5)
        parent.kill()
        parent.wait()
        assert dog.wait(timeout=20) == 1
        for root, grandchild in zip(roots, grandchildren):
            assert root.wait(timeout=5) is not None
            assert _gone(grandchild.pid, grandchild.create_time(), timeout=5)
    finally:
        _kill(parent, *roots, *grandchildren, dog)


def test_watchdog_exits_by_itself_when_the_tree_ends() -> None:
    root = subprocess.Popen(SLEEPER)
    dog = start_watchdog(root, interval=0.1)
    try:
        time.sleep(1.0)
        root.kill()
        root.wait()
        assert dog.wait(timeout=20) == 0
    finally:
        _kill(root, dog)


# a tree whose leader has exited and whose member, in the leader's group, ignores SIGTERM
ORPHANED_GROUP = ["sh", "-c", "(trap '' TERM; sleep 120) & echo $!"]
# a leader that ignores SIGTERM, with a child in a session of its own (found only as a seen descendant)
STUBBORN_TREE = [sys.executable, "-c", textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")]


@pytest.mark.skipif(not LINUX, reason="process groups and psutil trees as on Linux")
def test_stop_all_stops_every_group_and_descendant_and_escalates_to_sigkill() -> None:
    from fedapp.run.processes import Processes

    procs = Processes()
    orphaned = procs.add(subprocess.Popen(ORPHANED_GROUP, stdout=subprocess.PIPE, text=True, start_new_session=True))
    member = int(orphaned.stdout.readline())
    orphaned.wait(timeout=10)  # the leader is gone; its group lives on in the TERM-ignoring member
    stubborn = procs.add(subprocess.Popen(STUBBORN_TREE, stdout=subprocess.PIPE, text=True, start_new_session=True))
    detached = int(stubborn.stdout.readline())
    procs.snapshot()
    assert detached in procs.seen and member not in procs.seen  # the member is reached through its group only
    created = {pid: psutil.Process(pid).create_time() for pid in (member, stubborn.pid, detached)}
    assert procs.stop_all(timeout=1.0) == []
    for pid, t0 in created.items():
        assert _gone(pid, t0, timeout=5), pid
    assert stubborn.returncode is not None  # reaped, not a zombie
