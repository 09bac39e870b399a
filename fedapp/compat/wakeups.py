"""Wake-ups instead of 0.1 s polls between the ServerApp and the ClientApps in Flower's simulation runtime.

Both of the launcher's engines run the ServerApp and the Simulation Engine in one process around one in-memory
``LinkState``, and both sides poll it: the engine's feeder thread looks for new instructions every 0.1 s
(``vce_api.add_messages_to_queue``: ``f_stop.wait(0.1)``) and ``InMemoryGrid.send_and_receive`` looks for
replies every ``pull_interval`` = 0.1 s. An exchange therefore waits ~0.1 s on average for nothing, and a round
is several exchanges (SecAgg+: setup, key sharing, masked updates, unmasking; the legacy loop: one per client,
from a thread each). Here a store into that ``LinkState`` wakes the side waiting for it:

* the state's ``store_message_ins`` / ``store_message_res`` (wrapped on the one instance) set an event;
* the feeder thread gets, instead of ``f_stop``, an object whose ``wait`` returns when instructions were stored (at the
  latest after the same 0.1 s) and whose ``is_set`` is ``f_stop``'s;
* the grid's ``send_and_receive`` (replaced on the one ``InMemoryGrid`` instance) pulls again when replies were
  stored (at the latest after 0.1 s), until all arrived or ``timeout`` passed (it pulls at least once); it clears
  the event *before* it pulls, so no reply is missed.

Nothing about the messages changes — the same ``LinkState`` calls, in the same order, only sooner. A deployed
ServerApp talks to its SuperLink through another grid (``HttpGrid``) and is left alone, as is any Flower whose
internals differ from :data:`PATCHED_FLOWER`'s (a warning says so). ``DPFL_WAKEUPS=off`` keeps Flower's polls.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the Flower minor version whose ``vce_api`` and ``InMemoryGrid`` this module was written and tested against
PATCHED_FLOWER = "1.41"
#: environment switch: ``off`` keeps Flower's 0.1 s polls
SWITCH = "DPFL_WAKEUPS"
#: the longest a waiting side sleeps without a wake-up (Flower's own poll interval)
FALLBACK_S = 0.1


def wanted() -> bool:
    """False under ``DPFL_WAKEUPS=off``."""
    return os.environ.get(SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def _flower_matches() -> bool:
    try:
        import flwr
        from flwr.server.superlink.fleet.vce import vce_api
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:
        return False
    if ".".join(str(flwr.__version__).split(".")[:2]) != PATCHED_FLOWER:
        return False
    feeder = list(inspect.signature(vce_api.add_messages_to_queue).parameters)
    return feeder == ["state", "queue", "nodes_mapping", "f_stop"] and all(
        callable(getattr(InMemoryGrid, name, None)) for name in ("push_messages", "pull_messages", "send_and_receive"))


class _Stored:
    """Events set when the wrapped ``LinkState`` stores an instruction (``ins``) or a reply (``res``)."""

    def __init__(self, state: Any) -> None:
        self.ins = threading.Event()
        self.res = threading.Event()
        store_ins, store_res = state.store_message_ins, state.store_message_res

        def store_message_ins(message: Any) -> Any:
            try:
                return store_ins(message)
            finally:
                self.ins.set()

        def store_message_res(message: Any) -> Any:
            try:
                return store_res(message)
            finally:
                self.res.set()

        state.store_message_ins = store_message_ins
        state.store_message_res = store_message_res


_lock = threading.Lock()
_states: weakref.WeakKeyDictionary[Any, _Stored] = weakref.WeakKeyDictionary()


def stored_events(state: Any) -> _Stored:
    """The events of ``state`` (its store methods are wrapped once, whichever side asks first)."""
    with _lock:
        events = _states.get(state)
        if events is None:
            events = _states[state] = _Stored(state)
        return events


class _StopOrStored:
    """``f_stop`` for the feeder thread: ``is_set`` is the stop flag's; ``wait`` also returns once an instruction
    was stored."""

    def __init__(self, stop: threading.Event, stored: threading.Event) -> None:
        self.stop, self.stored = stop, stored

    def is_set(self) -> bool:
        return self.stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        self.stored.wait(FALLBACK_S if timeout is None else min(timeout, FALLBACK_S))
        self.stored.clear()  # the feeder reads the state right after this: nothing stored before it is missed
        return self.stop.is_set()


def wake_feeder() -> bool:
    """Give Flower's Simulation Engine feeder the wake-ups (call before the engine starts); True when in place."""
    if not wanted() or not _flower_matches():
        return False
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    if getattr(original, "dpfl_wakeups", False):
        return True

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
        original(state, queue, nodes_mapping, _StopOrStored(f_stop, stored_events(state).ins))  # type: ignore[arg-type]  # duck-typed: is_set, wait

    add_messages_to_queue.dpfl_wakeups = True  # type: ignore[attr-defined]
    add_messages_to_queue.__wrapped__ = original  # type: ignore[attr-defined]
    vce_api.add_messages_to_queue = add_messages_to_queue
    return True


def wake_feeder_in_simulation_runtime(program: str | None = None) -> bool:
    """:func:`wake_feeder` in Flower's ``flwr-simulation`` (``program``: default ``sys.argv[0]``) only — not in
    the Ray workers that also import the ClientApp module."""
    from fedapp.compat.lean_ray import SIMULATION_RUNTIME

    if Path(program if program is not None else sys.argv[0]).name != SIMULATION_RUNTIME:
        return False
    return wake_feeder()


def wake_grid(grid: Any) -> bool:
    """Replace ``send_and_receive`` of an ``InMemoryGrid`` by one woken by stored replies; True when done."""
    if all(c.__name__ != "InMemoryGrid" for c in type(grid).__mro__) or not wanted() or not _flower_matches():
        return False  # (a deployed ServerApp's HttpGrid: nothing imported)
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return False
    replied = stored_events(grid.state).res

    def send_and_receive(messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
        waiting = set(grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[Any] = []
        while waiting:
            replied.clear()  # before the pull: a reply stored after it sets the event again
            pulled = list(grid.pull_messages(waiting))
            received.extend(pulled)
            waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
            left = None if deadline is None else deadline - time.monotonic()
            if not waiting or (left is not None and left <= 0):
                break
            replied.wait(FALLBACK_S if left is None else min(left, FALLBACK_S))
        return received

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]  # this instance only
    return True


def warn_if_unpatched() -> None:
    """Say when the wake-ups are wanted but this Flower is not the one they were written for."""
    if wanted() and not _flower_matches():
        log.warning("message wake-ups are written for flwr %s's simulation internals, which this Flower does not "
                    "have; keeping its 0.1 s polls", PATCHED_FLOWER)
