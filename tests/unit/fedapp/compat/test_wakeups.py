"""Stored messages wake the waiting side of Flower's in-memory simulation runtime (fedapp.compat.wakeups)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.server.superlink.fleet.vce import vce_api
from flwr.superlink.grid.http_grid import HttpGrid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedapp.compat import wakeups

#: a fallback poll this long would fail every test below: only a wake-up returns in time
NEVER_S = 30.0


class FakeState:
    """The two store methods the wake-ups wrap, and the replies a pull returns."""

    def __init__(self) -> None:
        self.replies: list[Any] = []

    def store_message_ins(self, message: Any) -> str:
        return "ins"

    def store_message_res(self, message: Any) -> str:
        self.replies.append(message)
        return "res"


class FakeGrid(InMemoryGrid):
    def __init__(self) -> None:  # noqa: D107 - no LinkStateFactory: the loop is what is tested
        self.state = FakeState()
        self.pulls = 0

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        return [m for m in messages]

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        self.pulls += 1
        return [r for r in list(self.state.replies) if r.metadata.reply_to_message_id in set(message_ids)]


class FakeHttpGrid(HttpGrid):
    def __init__(self) -> None:  # noqa: D107 - no SuperLink: the loop is what is tested
        self.replies: list[Any] = []
        self.pulls = 0

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        return [m for m in messages]

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        self.pulls += 1
        return [r for r in list(self.replies) if r.metadata.reply_to_message_id in set(message_ids)]


def _reply(to: str) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=to))


@pytest.fixture(autouse=True)
def _long_fallback(monkeypatch) -> None:
    monkeypatch.setattr(wakeups, "FALLBACK_S", NEVER_S)
    monkeypatch.delenv(wakeups.SWITCH, raising=False)


def test_grid_returns_when_the_last_reply_is_stored_not_at_its_next_poll() -> None:
    grid = FakeGrid()
    assert wakeups.wake_grid(grid)

    def answer() -> None:
        for to in ("a", "b"):
            time.sleep(0.2)
            grid.state.store_message_res(_reply(to))

    threading.Thread(target=answer, daemon=True).start()
    start = time.monotonic()
    got = grid.send_and_receive(["a", "b"])
    assert sorted(r.metadata.reply_to_message_id for r in got) == ["a", "b"]
    assert time.monotonic() - start < NEVER_S / 3 and grid.pulls == 3  # the first pull, then one per stored reply


def test_grid_timeout_still_ends_the_wait_and_pulls_once_when_zero() -> None:
    grid = FakeGrid()
    assert wakeups.wake_grid(grid)
    start = time.monotonic()
    assert list(grid.send_and_receive(["a"], timeout=0.3)) == []
    assert 0.3 <= time.monotonic() - start < NEVER_S / 3
    grid.pulls = 0
    grid.state.replies.append(_reply("c"))
    assert len(list(grid.send_and_receive(["c"], timeout=0.0))) == 1 and grid.pulls == 1


def test_deployed_grid_pulls_every_tenth_of_a_second_not_every_three() -> None:
    grid = FakeHttpGrid()
    assert wakeups.wake_grid(grid)
    threading.Timer(0.35, lambda: grid.replies.append(_reply("a"))).start()
    start = time.monotonic()
    assert len(list(grid.send_and_receive(["a"]))) == 1
    took = time.monotonic() - start
    assert 0.35 <= took < 1.5 and 4 <= grid.pulls <= 10, (took, grid.pulls)  # Flower's loop: 3 s, 2 pulls


def test_feeder_wait_returns_on_a_stored_instruction_and_reports_the_stop_flag() -> None:
    state, stop = FakeState(), threading.Event()
    waiter = wakeups._StopOrStored(stop, wakeups.stored_events(state).ins)
    threading.Timer(0.2, lambda: state.store_message_ins(object())).start()
    start = time.monotonic()
    assert waiter.wait(0.1 * NEVER_S) is False and time.monotonic() - start < NEVER_S / 3
    assert not waiter.is_set()
    stop.set()
    assert waiter.is_set() and waiter.wait(0.01) is True


def test_store_methods_are_wrapped_once_and_still_return_flowers_value() -> None:
    state = FakeState()
    first = wakeups.stored_events(state)
    assert wakeups.stored_events(state) is first
    assert state.store_message_res(_reply("x")) == "res" and first.res.is_set() and not first.ins.is_set()


def test_feeder_patch_is_in_place_once_and_off_switch_and_other_processes_leave_flower_alone(monkeypatch) -> None:
    original = vce_api.add_messages_to_queue
    monkeypatch.setattr(vce_api, "add_messages_to_queue", original)  # restored after the test
    if getattr(original, "dpfl_wakeups", False):  # another test's simulation patched this process already
        monkeypatch.setattr(vce_api, "add_messages_to_queue", original.__wrapped__)
    assert not wakeups.wake_feeder_in_simulation_runtime("/usr/bin/python")  # e.g. a Ray worker
    assert not getattr(vce_api.add_messages_to_queue, "dpfl_wakeups", False)
    monkeypatch.setenv(wakeups.SWITCH, "off")
    assert not wakeups.wake_feeder() and not wakeups.wake_grid(FakeGrid())
    monkeypatch.delenv(wakeups.SWITCH)
    assert wakeups.wake_feeder_in_simulation_runtime("/venv/bin/flwr-simulation")
    patched = vce_api.add_messages_to_queue
    assert patched.dpfl_wakeups and wakeups.wake_feeder() and vce_api.add_messages_to_queue is patched
    assert not wakeups.wake_grid(SimpleNamespace())  # a deployed ServerApp's grid


class FeederState(FakeState):
    """Instructions per node and every ``get_message_ins`` call, as the feeder makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.inbox: dict[int, list[Any]] = {}
        self.asked: list[int] = []

    def store_message_ins(self, message: Any) -> str:
        with self.lock:
            self.inbox.setdefault(message.metadata.dst_node_id, []).append(message)
        return "ins"

    def get_message_ins(self, node_id: int, limit: int | None) -> list[Any]:
        with self.lock:
            self.asked.append(node_id)
            box = self.inbox.get(node_id, [])
            return [box.pop(0)] if box else []


def _instruction(node: int) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node))


def test_feeder_asks_only_nodes_with_instructions_after_its_first_sweep_and_delivers_every_one() -> None:
    import queue as queue_module

    state, stop, out = FeederState(), threading.Event(), queue_module.Queue()
    nodes = {node: node for node in range(1000)}
    FeederState.store_message_ins(state, _instruction(5))  # stored before the feeder started (no wake-up)
    feeder = threading.Thread(target=wakeups.add_messages_to_queue, args=(state, out, nodes, stop), daemon=True)
    feeder.start()
    try:
        got = [out.get(timeout=5)]
        for node in (7, 7, 900):
            state.store_message_ins(_instruction(node))  # wrapped once the feeder started: a wake-up each
        got += [out.get(timeout=5) for _ in range(3)]
        time.sleep(0.3)  # a few more sweeps (each waits at most 0.1 s)
    finally:
        stop.set()
        state.store_message_ins(_instruction(1))  # wakes it to see the stop flag
        feeder.join(timeout=5)
    assert sorted(m.metadata.dst_node_id for m in got) == [5, 7, 7, 900] and not feeder.is_alive()
    asked = {node: state.asked.count(node) for node in nodes}
    assert all(asked[node] == 1 for node in nodes if node not in (1, 5, 7, 900)), \
        "a node without instructions is asked again after the first sweep"
    assert asked[7] >= 2 and asked[900] >= 1
