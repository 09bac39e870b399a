"""Flower's HTTP retry policy, with a TLS handshake the peer cut short retried like any other dropped connection.

Flower's policy (``flwr.supercore.retry.http_retry.make_simple_http_retry_invoker``) retries dropped connections with
backoff, but gives up at once on any transport error whose text mentions "ssl", "tls" or "certificate": meant for a
certificate that does not verify, which no retry fixes. The same words are in ``[SSL: UNEXPECTED_EOF_WHILE_READING]
EOF occurred in violation of protocol``: the peer closed the connection during the handshake, which a deployment's
loopback TLS hops do now and then under load, and which a fresh connection fixes. Given up on, it costs a run dearly:

* the ServerApp's grid (``HttpGrid``) fails that client's exchange: the client misses the round;
* a SuperNode's fleet connection fails to send a reply, and Flower's SuperNode drops the reply
  (``start_client_internal._push_messages``): the server waits for it for ever unless the run has a round-timeout.

:func:`tolerate_tls_eof` wraps one ``RetryInvoker``: such an error is retried with the invoker's own backoff, at most
:data:`MAX_TLS_EOF_RETRIES` times within one call; every other decision (a certificate that does not verify, an HTTP
status) stays Flower's. :func:`retry_grid_tls_eof` applies it to the ServerApp's grid (the ServerApp calls it on the
grid it is given); :func:`retry_supernode_tls_eof` to every fleet connection a SuperNode opens
(:mod:`fedapp.run.supernode`, the launcher's SuperNode). Both check their Flower symbols first
(:mod:`fedapp.compat.surface`, group ``http-retry``) and leave a Flower that differs alone, with a warning.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from fedapp.compat import surface

log = logging.getLogger(__name__)

GROUP = "http-retry"
#: where a SuperNode's fleet connection makes its retry invoker (a name imported into that module)
SUPERNODE_FACTORY = "flwr.supernode.fleet_http_connection.make_simple_http_retry_invoker"
#: handshakes cut short that one call retries before Flower's own decision (give up) stands
MAX_TLS_EOF_RETRIES = 8
#: what OpenSSL and Python say when the peer closed the connection before the handshake finished
_EOF_TEXTS = ("UNEXPECTED_EOF_WHILE_READING", "EOF occurred in violation of protocol")
_MARK = "_dpfl_tolerates_tls_eof"


def is_tls_eof(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a TLS handshake the peer closed early."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLEOFError) or any(text in str(cur) for text in _EOF_TEXTS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _while_connecting(exc: BaseException) -> bool:
    """An ``httpx.ConnectError``: the request was never sent, so sending it again cannot duplicate it."""
    return any(c.__name__ == "ConnectError" and c.__module__.startswith("httpx") for c in type(exc).__mro__)


def tolerate_tls_eof(invoker: Any) -> Any:
    """Make ``invoker`` (a Flower ``RetryInvoker``) retry a TLS handshake cut short while connecting, at most
    :data:`MAX_TLS_EOF_RETRIES` times per ``invoke``; returns it. Idempotent; safe across threads (the count is per
    thread, as each ``invoke`` runs in one)."""
    if getattr(invoker, _MARK, False):
        return invoker
    flower_giveup: Callable[[Exception], bool] | None = invoker.should_giveup
    flower_invoke = invoker.invoke
    count = threading.local()

    def should_giveup(exc: Exception) -> bool:
        if _while_connecting(exc) and is_tls_eof(exc):
            count.n = getattr(count, "n", 0) + 1
            if count.n <= MAX_TLS_EOF_RETRIES:
                log.warning("TLS handshake cut short by the peer (%s); retrying (%d of at most %d)", exc, count.n,
                            MAX_TLS_EOF_RETRIES)
                return False
        return flower_giveup(exc) if flower_giveup is not None else False

    def invoke(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        count.n = 0
        return flower_invoke(target, *args, **kwargs)

    invoker.should_giveup = should_giveup
    invoker.invoke = invoke
    setattr(invoker, _MARK, True)
    return invoker


def _matches() -> bool:
    found = surface.problems(GROUP)
    if found:
        log.warning("Flower's HTTP retry policy is left as it is (written for flwr %s): %s",
                    surface.releases("flwr"), "; ".join(found))
    return not found


def retry_grid_tls_eof(grid: Any) -> bool:
    """Apply :func:`tolerate_tls_eof` to a deployed ServerApp's ``HttpGrid``; True when done (False for another grid,
    or a Flower whose symbols differ)."""
    if not any(c.__name__ == "HttpGrid" for c in type(grid).__mro__) or not _matches():
        return False
    tolerate_tls_eof(grid._retry_invoker)
    return True


def retry_supernode_tls_eof() -> bool:
    """Make every fleet connection a SuperNode opens in this process tolerate TLS handshakes cut short; True when
    done. Idempotent."""
    if getattr(surface.resolve(SUPERNODE_FACTORY), _MARK, False):
        return True
    if not _matches():
        return False
    flower_factory = surface.library_object(SUPERNODE_FACTORY)

    def make_simple_http_retry_invoker() -> Any:
        return tolerate_tls_eof(flower_factory())

    setattr(make_simple_http_retry_invoker, _MARK, True)
    surface.replace(SUPERNODE_FACTORY, make_simple_http_retry_invoker)
    return True
