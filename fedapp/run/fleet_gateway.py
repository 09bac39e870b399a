"""Fleet gateway: the only part of a SuperLink that SuperNodes' network can reach.

Flower 1.41 serves the Fleet API (SuperNodes), the Control API (``flwr run``/``ls``/``supernode
register``) and the runtime API on *one* HTTP server (``--host``/``--port``; the separate
``--control-api-address`` is deprecated and ignored). So the SuperLink itself is bound to
127.0.0.1, and this gateway listens on the public interface with the SuperLink's TLS certificate
and forwards exactly the routes in :data:`ALLOWED` (the twelve ``POST /v1/fleet/<rpc>`` routes and
``GET /health``). The check is on the raw request path as sent on the wire, which must already be one
of those routes byte for byte; the upstream request carries that same path, so nothing (neither the
ASGI server nor httpx) decodes or normalises ``%2e%2e``/``..``/``//`` into a Control or runtime API
path in between. Everything else is answered 403 without reaching the SuperLink. SuperNode
authentication headers are passed through unchanged, so the SuperLink still refuses unregistered keys.

    python -m fedapp.run.fleet_gateway --listen 0.0.0.0:9092 --upstream 127.0.0.1:9093 \
        --ssl-certfile certs/server.pem --ssl-keyfile certs/server.key --ssl-ca-certfile certs/ca.crt
"""

from __future__ import annotations

import argparse
import re
import ssl
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: the Fleet API routes Flower 1.41 serves over HTTP (``flwr/superlink/routers/fleet/router.py``: all
#: ``POST``, protobuf body, no query parameters)
FLEET_RPCS = ("register-node", "activate-node", "deactivate-node", "unregister-node", "send-node-heartbeat",
              "pull-messages", "push-messages", "get-run", "get-fab", "push-object", "pull-object",
              "confirm-message-received")
#: (method, exact path) pairs forwarded to the SuperLink; everything else is refused. ``GET /health`` is what
#: :func:`fedapp.run.deploy.wait_https_health` polls on the gateway.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {("POST", f"/v1/fleet/{rpc}") for rpc in FLEET_RPCS} | {("GET", "/health")})
MAX_PATH_LENGTH = 64
#: a canonical path: ``/``-separated lower-case segments of ``[a-z0-9-]`` that do not start with a dot, so no
#: ``%`` escapes, ``.``/``..`` segments, empty segments (``//``, trailing ``/``), backslashes or non-ASCII
_CANONICAL = re.compile(r"(/[a-z0-9][a-z0-9-]*)+")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length",
               "proxy-connection", "proxy-authorization"}
_REFUSAL = b"this endpoint is not served to the SuperNodes' network\n"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def is_canonical(path: str) -> bool:
    """Whether ``path`` is a plain canonical route (see ``_CANONICAL``) no longer than :data:`MAX_PATH_LENGTH`."""
    return len(path) <= MAX_PATH_LENGTH and _CANONICAL.fullmatch(path) is not None


if not all(is_canonical(path) for _, path in ALLOWED):  # the allow-list itself must be canonical
    raise RuntimeError("ALLOWED holds a non-canonical path")


def allowed(method: str, raw_path: str | bytes, query_string: bytes | str = b"") -> bool:
    """Whether a request goes to the SuperLink: no query string, and ``raw_path`` (the path exactly as sent,
    the ASGI ``raw_path``, never a decoded form) is canonical and, with ``method``, exactly in :data:`ALLOWED`."""
    if isinstance(raw_path, bytes):
        if len(raw_path) > MAX_PATH_LENGTH or not raw_path.isascii():
            return False
        raw_path = raw_path.decode("ascii")
    return not query_string and is_canonical(raw_path) and (method, raw_path) in ALLOWED


def make_app(upstream: str, ca_file: str | None) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app forwarding :data:`ALLOWED` requests to ``https://<upstream>`` (``http`` without a CA)."""
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response

    base = httpx.URL(f"{'https' if ca_file else 'http'}://{upstream}")
    # absolute URLs built from the raw path: httpx neither merges them with a base URL nor re-normalises them
    urls = {key: base.copy_with(raw_path=key[1].encode("ascii")) for key in ALLOWED}
    if any(url.raw_path != path.encode("ascii") for (_, path), url in urls.items()):
        raise RuntimeError("httpx would not forward the allowed paths verbatim")
    verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else False
    client = httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(300.0, connect=10.0), follow_redirects=False)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":  # websocket: refused before accepting (uvicorn answers 403)
            await send({"type": "websocket.close", "code": 1008})
            return
        method, raw_path = scope["method"], scope.get("raw_path")
        if not isinstance(raw_path, bytes) or not allowed(method, raw_path, scope.get("query_string", b"")):
            await Response(_REFUSAL, status_code=403, media_type="text/plain")(scope, receive, send)
            return
        request = Request(scope, receive)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            reply = await client.request(method, urls[method, raw_path.decode("ascii")],
                                         content=await request.body(), headers=headers)
        except httpx.HTTPError:
            response = Response(b"the SuperLink is unreachable\n", status_code=502, media_type="text/plain")
        else:
            out = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_BY_HOP | {"content-encoding"}}
            response = Response(reply.content, status_code=reply.status_code, headers=out)
        await response(scope, receive, send)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="host:port SuperNodes connect to, e.g. 0.0.0.0:9092")
    parser.add_argument("--upstream", required=True, help="the SuperLink's loopback host:port, e.g. 127.0.0.1:9093")
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--ssl-ca-certfile", default=None, help="CA that signed the SuperLink's certificate")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    tls = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile} if args.ssl_certfile else {}
    uvicorn.run(make_app(args.upstream, args.ssl_ca_certfile), host=host, port=int(port), log_level="warning",
                ws="none", lifespan="on", proxy_headers=False, server_header=False, **tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
