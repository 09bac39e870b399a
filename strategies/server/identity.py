"""Client identity bound to the node Flower authenticates.

A reply's ``client_id`` is a field the client writes; the node id is assigned by the SuperLink
(and, in a deployment with SuperNode authentication, bound to a registered public key). The first
reply of a node binds its client id to it; afterwards a node claiming another client's id, or a
second node claiming a bound id while the bound node is still connected, is rejected. A bound node
that is gone (a restarted SuperNode, a resumed simulation) releases its id to the next node claiming it.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any


class IdentityBinding:
    """node id ↔ client id, one to one."""

    def __init__(self) -> None:
        self.client_of: dict[int, int] = {}  # node_id -> client_id
        self.node_of: dict[int, int] = {}  # client_id -> node_id

    def check(self, node_id: int, client_id: int, connected: Container[int]) -> str | None:
        """Why ``node_id`` may not speak for ``client_id`` (None when it may)."""
        bound = self.client_of.get(node_id)
        if bound is not None and bound != client_id:
            return f"node {node_id} is bound to client {bound} but claims client_id {client_id}"
        owner = self.node_of.get(client_id)
        if owner is not None and owner != node_id and owner in connected:
            return f"client_id {client_id} is bound to connected node {owner}, not to node {node_id}"
        return None

    def bind(self, node_id: int, client_id: int) -> None:
        old_node = self.node_of.get(client_id)
        if old_node is not None and old_node != node_id:
            self.client_of.pop(old_node, None)
        self.client_of[node_id] = client_id
        self.node_of[client_id] = node_id

    def state(self) -> dict[str, Any]:
        return {str(k): v for k, v in self.client_of.items()}

    def load(self, state: Mapping[str, Any]) -> None:
        self.client_of, self.node_of = {}, {}
        for node, cid in dict(state).items():
            self.bind(int(node), int(cid))
