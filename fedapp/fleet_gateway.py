"""Fleet gateway: the only part of a SuperLink that SuperNodes' network can reach.

Flower 1.41 serves the Fleet API (SuperNodes), the Control API (``flwr run``/``ls``/``supernode
register``) and the runtime API on *one* HTTP server (``--host``/``--port``; the separate
``--control-api-address`` is deprecated and ignored). So the SuperLink itself is bound to
127.0.0.1, and this gateway listens on the public interface with the SuperLink's TLS certificate
and forwards only ``POST /v1/fleet/*`` and ``GET /health`` to it; every other path (Control and
runtime APIs) is answered 403 without reaching the SuperLink. SuperNode authentication headers are
passed through unchanged, so the SuperLink still refuses unregistered keys.

    python -m fedapp.fleet_gateway --listen 0.0.0.0:9092 --upstream 127.0.0.1:9093 \
        --ssl-certfile certs/server.pem --ssl-keyfile certs/server.key --ssl-ca-certfile certs/ca.crt
"""

from __future__ import annotations

import argparse
import ssl
import sys
from typing import Any

#: (method, path prefix) pairs forwarded to the SuperLink; everything else is refused
ALLOWED = (("POST", "/v1/fleet/"), ("GET", "/health"))
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def allowed(method: str, path: str) -> bool:
    return any(method == m and (path == p or path.startswith(p)) for m, p in ALLOWED)


def make_app(upstream: str, ca_file: str | None) -> Any:
    """The ASGI app forwarding :data:`ALLOWED` requests to ``https://<upstream>`` (``http`` without a CA)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    base = f"{'https' if ca_file else 'http'}://{upstream}"
    verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else False
    client = httpx.AsyncClient(base_url=base, verify=verify, timeout=httpx.Timeout(300.0, connect=10.0))

    async def forward(request: Request) -> Response:
        if not allowed(request.method, request.url.path):
            return PlainTextResponse("this endpoint is not served to the SuperNodes' network\n", status_code=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        reply = await client.request(request.method, request.url.path, params=request.query_params,
                                     content=await request.body(), headers=headers)
        out = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_BY_HOP | {"content-encoding"}}
        return Response(reply.content, status_code=reply.status_code, headers=out)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


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
    uvicorn.run(make_app(args.upstream, args.ssl_ca_certfile), host=host, port=int(port), log_level="warning", **tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
