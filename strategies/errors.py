"""Errors shared by the library and the Flower glue (framework-free)."""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A configuration value (run-config, node-config, constructor argument) is invalid; the message names it."""


class ClientFailure(RuntimeError):
    """A client's fit failed on the client's side; ``client_id`` names the client (None: unknown).

    The message is ``"<kind>: client_id=<n> <reason>"``. A transport that carries only the text of an
    exception (Flower turns a ClientApp exception into an error message with ``reason: <type>:<text>``)
    keeps the id readable: :meth:`client_id_in` is the one parser of that text.
    """

    kind = "client failure"
    _ID = re.compile(r"client_id=(\d+)")

    def __init__(self, client_id: int | None, reason: str) -> None:
        self.client_id = client_id
        self.reason = reason
        super().__init__(f"{self.kind}: client_id={client_id} {reason}" if client_id is not None
                         else f"{self.kind}: {reason}")

    def __reduce__(self) -> tuple[type[ClientFailure], tuple[int | None, str]]:
        return type(self), (self.client_id, self.reason)  # pickles across processes with its typed field

    @classmethod
    def client_id_in(cls, failure: BaseException | str) -> int | None:
        """The client id of a failure: the typed field, or the ``client_id=<n>`` its transported text names."""
        if isinstance(failure, ClientFailure):
            return failure.client_id
        match = cls._ID.search(failure if isinstance(failure, str) else repr(failure))
        return int(match.group(1)) if match else None
