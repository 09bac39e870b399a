"""Wake-ups instead of 0.1 s polls between the ServerApp and the ClientApps in Flower's simulation runtime, and
a deployed ServerApp that asks its SuperLink for replies every 0.1 s instead of every 3 s.

Both of the launcher's engines run the ServerApp and the Simulation Engine in one process around one in-memory
``LinkState``, and both sides poll it: the engine's feeder thread looks for new instructions every 0.1 s
(``vce_api.add_messages_to_queue``: ``f_stop.wait(0.1)``) and ``InMemoryGrid.send_and_receive`` looks for
replies every ``pull_interval`` = 0.1 s. An exchange therefore waits ~0.1 s on average for nothing, and a round
is several exchanges (SecAgg+: setup, key sharing, masked updates, unmasking; the legacy loop: one per client,
from a thread each). Here a store into that ``LinkState`` wakes the side waiting for it:

* the state's ``store_message_ins`` / ``store_message_res`` (wrapped on the one instance) set an event;
* the feeder thread (:func:`add_messages_to_queue`, Flower's loop) waits on an object whose ``wait`` returns when
  instructions were stored (at the latest after the same 0.1 s) and whose ``is_set`` is ``f_stop``'s, and asks only
  the nodes an instruction was stored for (Flower asks every node of the federation every sweep: O(n·r));
* the grid's ``send_and_receive`` (replaced on the one ``InMemoryGrid`` instance) pulls again when replies were
  stored (at the latest after 0.1 s), until all arrived or ``timeout`` passed (it pulls at least once); it clears
  the event *before* it pulls, so no reply is missed.

Nothing about the messages changes — the same ``LinkState`` calls for the nodes that have messages, in the same
order, only sooner. A deployed
ServerApp talks to its SuperLink through ``HttpGrid``, whose ``send_and_receive`` sleeps 3 s between pulls: there
it pulls every :data:`HTTP_POLL_S` instead. Each part checks its Flower symbols first (:mod:`fedapp.compat.surface`,
groups ``wakeups.*``: flwr :data:`PATCHED_FLOWER` and the recorded signatures); any other Flower is left alone (a
warning names what differs). ``DPFL_WAKEUPS=off`` keeps Flower's polls everywhere.

Switched on by the code paths that run the exchange, each explicitly: the run_simulation engine
(``fedapp.run.simulation_engine``: :func:`wake_feeder`), Flower's ``flwr-simulation`` when it loads the ClientApp module
(``fedapp.apps.client_app``: :func:`wake_feeder_in_simulation_runtime`), and the ServerApp's round loop
(:func:`wake_grid` on its grid). Importing this module changes nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fedapp.compat import surface, switched_off

log = logging.getLogger(__name__)

#: the Flower minor version whose ``vce_api`` and ``InMemoryGrid`` this module was written and tested against
PATCHED_FLOWER = surface.releases("flwr")
#: the Flower symbols the feeder's and the in-memory grid's wake-ups patch (:mod:`fedapp.compat.surface`)
FEEDER = "flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue"
IN_MEMORY_GROUPS = ("wakeups.feeder", "wakeups.linkstate", "wakeups.inmemory-grid")
HTTP_GROUPS = ("wakeups.http-grid",)
#: environment switch: ``off`` keeps Flower's 0.1 s polls
SWITCH = "DPFL_WAKEUPS"
#: the longest a waiting side sleeps without a wake-up (Flower's own poll interval)
FALLBACK_S = 0.1
#: how often a deployed ServerApp asks its SuperLink for replies (Flower's ``HttpGrid``: every 3 s)
HTTP_POLL_S = 0.1


def wanted() -> bool:
    """False under ``DPFL_WAKEUPS=off``."""
    return not switched_off(SWITCH)


def _differences(groups: tuple[str, ...]) -> list[str]:
    """What differs between this Flower and the one the wake-ups of ``groups`` were written for."""
    try:
        return surface.problems(*groups)
    except ImportError as exc:  # surface.check reports a missing symbol; this is a missing library
        return [str(exc)]


def _flower_matches() -> bool:
    found = _differences(IN_MEMORY_GROUPS)
    if found:
        log.warning("the in-memory wake-ups are written for flwr %s: %s", PATCHED_FLOWER, "; ".join(found))
    return not found


class _Stored:
    """Events set when the wrapped ``LinkState`` stores an instruction (``ins``) or a reply (``res``), and the nodes
    instructions were stored for since the feeder last took them (:meth:`take_pending`)."""

    def __init__(self, state: Any) -> None:
        self.ins = threading.Event()
        self.res = threading.Event()
        self._pending: set[int] = set()
        self._pending_lock = threading.Lock()
        store_ins, store_res = state.store_message_ins, state.store_message_res

        def store_message_ins(message: Any) -> Any:
            try:
                return store_ins(message)
            finally:
                node = getattr(getattr(message, "metadata", None), "dst_node_id", None)
                if node is not None:
                    with self._pending_lock:
                        self._pending.add(int(node))
                self.ins.set()  # after the node is pending: a woken feeder finds it

        def store_message_res(message: Any) -> Any:
            try:
                return store_res(message)
            finally:
                self.res.set()

        state.store_message_ins = store_message_ins
        state.store_message_res = store_message_res

    def take_pending(self) -> set[int]:
        """The nodes instructions were stored for since the last call (and forgets them)."""
        with self._pending_lock:
            taken, self._pending = self._pending, set()
        return taken


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
    if not wanted():
        return False
    if not _flower_matches():  # it warned: the engine keeps its 0.1 s poll
        return False
    original = surface.resolve(FEEDER)
    if getattr(original, "dpfl_wakeups", False):
        return True

    add_messages_to_queue.dpfl_wakeups = True  # type: ignore[attr-defined]
    add_messages_to_queue.__wrapped__ = original  # type: ignore[attr-defined]
    surface.replace(FEEDER, add_messages_to_queue)
    return True


def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
    """Flower's feeder loop (``vce_api.add_messages_to_queue``: each sweep asks the state for one undelivered
    instruction of each node, then waits), asking only the nodes that may have one: every node on the first sweep
    (instructions stored before the feeder started), then those an instruction was stored for since the last sweep
    and those that gave one (they may hold more). Flower asks every node of the federation every sweep, and each
    ``get_message_ins`` scans every stored message: O(n·r) a sweep, 8.7 s at n = 10,000 nodes with r = 100
    instructions pending. The sweep waits on :class:`_StopOrStored`, so a store also wakes it."""
    stored = stored_events(state)
    wake = _StopOrStored(f_stop, stored.ins)
    due = set(nodes_mapping.keys())
    while not f_stop.is_set():
        gave: set[int] = set()
        for node_id in nodes_mapping.keys():  # Flower's order, so the queue fills as it would
            if node_id in due:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
                    gave.add(node_id)
        wake.wait(0.1)
        due = gave | stored.take_pending()


def wake_feeder_in_simulation_runtime(program: str | None = None) -> bool:
    """:func:`wake_feeder` in Flower's ``flwr-simulation`` (``program``: default ``sys.argv[0]``) only — not in
    the Ray workers that also import the ClientApp module."""
    from fedapp.compat.lean_ray import SIMULATION_RUNTIME

    if Path(program if program is not None else sys.argv[0]).name != SIMULATION_RUNTIME:
        return False
    return wake_feeder()


def _exchange(grid: Any, wait: Callable[[float], object], arm: Callable[[], object]) -> Callable[..., Iterable[Any]]:
    """``send_and_receive`` for ``grid``: push, then pull until every reply arrived or ``timeout`` passed (pulling at
    least once); between pulls ``wait(seconds)``, with ``arm()`` called before each pull."""

    def send_and_receive(messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
        waiting = set(grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[Any] = []
        while waiting:
            arm()
            pulled = list(grid.pull_messages(waiting))
            received.extend(pulled)
            waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
            left = None if deadline is None else deadline - time.monotonic()
            if not waiting or (left is not None and left <= 0):
                break
            wait(FALLBACK_S if left is None else min(left, FALLBACK_S))
        return received

    return send_and_receive


def _is_a(grid: Any, name: str) -> bool:
    return any(c.__name__ == name for c in type(grid).__mro__)


def wake_grid(grid: Any) -> bool:
    """Give the ServerApp's grid a ``send_and_receive`` that waits less; True when done.

    ``InMemoryGrid`` (both simulation engines): woken by stored replies. ``HttpGrid`` (a ServerApp deployed
    behind a SuperLink): Flower's loop sleeps 3 s between pulls; here it pulls every :data:`HTTP_POLL_S`, one
    small request to the SuperLink's loopback or LAN Runtime API each time (the SuperNodes' own 3 s poll for
    instructions is Flower's and stays)."""
    if not wanted():
        return False
    if _is_a(grid, "InMemoryGrid") and _flower_matches():
        replied = stored_events(grid.state).res
        # cleared before a pull: no reply is missed. Concurrent exchanges (the legacy loop runs one per client, each in
        # a thread) share the event, so one may clear another's wake-up: that one waits the 0.1 s fallback, as before
        exchange = _exchange(grid, replied.wait, replied.clear)
    elif _is_a(grid, "HttpGrid") and _http_grid_matches():
        exchange = _exchange(grid, lambda s: time.sleep(min(s, HTTP_POLL_S)), lambda: None)
    else:  # not a Flower grid, or one whose symbols differ (the check warned): Flower's polls stay
        return False
    grid.send_and_receive = exchange  # type: ignore[method-assign]  # this instance only
    return True


def _http_grid_matches() -> bool:
    found = _differences(HTTP_GROUPS)
    if found:
        log.warning("the deployed grid's faster polls are written for flwr %s: %s", PATCHED_FLOWER, "; ".join(found))
    return not found
