"""strategies.base.wait_for_clients: asks the client manager to register the nodes it can see before waiting."""

from __future__ import annotations

from strategies.base import wait_for_clients


class CompatClientManager:
    """Like the client manager of Flower's ``start_grid``: nodes are registered when ``num_available`` (or ``all``,
    ``sample``) is called, otherwise only by a loop every 5 s; ``wait_for`` records what it had to wait for."""

    def __init__(self, visible: int) -> None:
        self.visible, self.registered, self.waits = visible, 0, []

    def num_available(self) -> int:
        self.registered = self.visible
        return self.registered

    def wait_for(self, num_clients: int, timeout: int) -> bool:
        self.waits.append((self.registered, num_clients, timeout))
        return self.registered >= num_clients


def test_the_nodes_already_there_are_registered_without_waiting_for_flowers_5_second_loop():
    manager = CompatClientManager(visible=20)
    assert wait_for_clients(manager, 20)
    assert manager.waits == []  # waiting at 0 registered is what held round 1 for up to 5 s


def test_missing_nodes_are_waited_for_in_short_waits_until_the_timeout():
    manager = CompatClientManager(visible=3)
    assert not wait_for_clients(manager, 5, timeout=0.05)
    assert manager.waits and all(w == (3, 5, 1) for w in manager.waits)
