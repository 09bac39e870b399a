"""The fleet gateway (``python -m fedapp.run.fleet_gateway``) live on loopback, in front of a fake SuperLink that
records every connection and request: only the exact Fleet API routes reach it, with the path unchanged."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from fedapp.run.fleet_gateway import ALLOWED, FLEET_RPCS, allowed
from fedapp.run.processes import free_port, stop_process_tree

CONTROL = ["/v1/control/list-runs", "/v1/control/register-node", "/v1/control/start-run",
           "/v1/runtime/acquire-task", "/docs", "/openapi.json", "/", "/v1/fleet", "/v1/fleet/", "/v1/fleetx"]
#: request targets sent verbatim after ``POST``; each must be refused by the gateway itself
TRAVERSALS = [
    b"/v1/fleet/../control/list-runs", b"/v1/fleet/../control/register-node",
    b"/v1/fleet/../../v1/control/list-runs", b"/v1/fleet/pull-messages/../../control/list-runs",
    b"/health/../v1/control/list-runs", b"/v1/fleet/./../control/list-runs", b"/v1/fleet/./..",
    b"/v1/fleet/%2e%2e/control/list-runs", b"/v1/fleet/%2E%2E/control/register-node",
    b"/v1/fleet/.%2e/control/list-runs", b"/v1/fleet/..%2fcontrol/list-runs", b"/v1/fleet/..%2Fcontrol/list-runs",
    b"/v1/fleet/%2e%2e%2fcontrol%2flist-runs", b"/v1/fleet/%252e%252e/control/list-runs",
    b"/v1/fleet/%252e%252e%252fcontrol%252flist-runs", b"/v1/fleet/..\\control\\list-runs",
    b"/v1/fleet\\..\\control/list-runs", b"/v1/fleet/..%5ccontrol%5clist-runs", b"/v1/fleet/..%5Ccontrol/list-runs",
    b"/v1/fleet/..;/control/list-runs", b"/v1/fleet/%2e%2e;/control/list-runs",
    b"/v1/fleet/\xef\xbc\x8e\xef\xbc\x8e/control/list-runs",  # fullwidth dots, raw UTF-8
    b"/v1/fleet/%c0%ae%c0%ae/control/list-runs",  # overlong UTF-8 dots
    b"http://127.0.0.1/v1/control/list-runs",  # absolute-form target
]
#: look-alikes of ``POST /v1/fleet/pull-messages`` that are not byte for byte that route
LOOKALIKES = [
    b"/V1/fleet/pull-messages", b"/v1/Fleet/pull-messages", b"/v1/fleet/Pull-Messages",
    b"/v1/fleet/pull-messages.", b"/v1/fleet/pull-messages..", b"/v1/fleet/pull-messages/",
    b"/v1/fleet/pull-messages/.", b"/v1/fleet//pull-messages", b"//v1/fleet/pull-messages",
    b"/v1//fleet/pull-messages", b"/v1/fleet/./pull-messages", b"/v1/./fleet/pull-messages",
    b"/v1/fleet/pull-messages%00", b"/v1/fleet/pull-messages%00.json", b"/v1/fleet/pull-messages%20",
    b"/v1/fleet/pull-messages%0d%0aX-Injected:%201", b"/v1/fleet/%70ull-messages", b"/v1/fleet%2fpull-messages",
    b"/v1/fleet/pull-messages\\", b"/v1/fleet/pull-messages%5c", b"/v1/fleet/pull-messages;x=1",
    b"/v1/fleet/pull-messages?x=1", b"/v1/fleet/pull-messages?a=b&c", b"/v1/fleet/pull-messag\xc3\xa9s",
    b"/v1/fleet/pull-messages%c3%a9", b"/v1/fleet/" + b"a" * 10_000, b"/v1/fleet/" + b"./" * 5_000 + b"pull-messages",
]
#: other methods on allowed paths
METHODS = [(m, b"/v1/fleet/pull-messages") for m in (b"GET", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"PATCH",
                                                     b"TRACE")]
METHODS += [(m, b"/health") for m in (b"POST", b"HEAD", b"PUT", b"DELETE")]
#: answered 400 by uvicorn's HTTP parser before the app runs (raw non-ASCII target; with httptools, the default
#: here, also a method not spelled in capitals); with h11 the lower-case methods reach the app and get 403
PARSER_400 = {(b"post", b"/v1/fleet/pull-messages"), (b"Post", b"/v1/fleet/pull-messages"),
              (b"POST", b"/v1/fleet/pull-messag\xc3\xa9s"),
              (b"POST", b"/v1/fleet/\xef\xbc\x8e\xef\xbc\x8e/control/list-runs")}
CORPUS = list(dict.fromkeys([(b"POST", p.encode()) for p in CONTROL] + [(b"POST", t) for t in TRAVERSALS]
                            + [(b"POST", t) for t in LOOKALIKES] + METHODS + sorted(PARSER_400)))


@dataclass
class Upstream:
    """A fake SuperLink on loopback: every accepted connection and every request line it parsed."""

    port: int
    connections: list[tuple[str, int]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def clear(self) -> None:
        self.connections.clear()
        self.requests.clear()


def _upstream_server(upstream: Upstream) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def parse_request(self) -> bool:
            upstream.requests.append({"line": self.raw_requestline})  # before http.server may reject it
            return super().parse_request()

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            upstream.requests[-1].update(method=self.command, path=self.path, headers=dict(self.headers), body=body)
            reply = b"upstream saw " + self.path.encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/protobuf")
            self.send_header("X-Upstream", "fake-superlink")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = _answer

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def verify_request(self, request: Any, client_address: Any) -> bool:
            upstream.connections.append(client_address)
            return True

    return Server(("127.0.0.1", upstream.port), Handler)


def _send(port: int, method: bytes, target: bytes, body: bytes = b"", headers: bytes = b"") -> tuple[int, bytes]:
    """One request on a fresh TCP connection, written byte for byte (no client library normalises ``target``)."""
    head = b"%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/protobuf\r\nContent-Length: %d\r\n" \
           b"Connection: close\r\n%s\r\n" % (method, target, port, len(body), headers)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest.partition(b"\r\n\r\n")[2]


@dataclass
class Live:
    """The running gateway: its port, the fake SuperLink behind it and the gateway's log file."""

    port: int
    upstream: Upstream
    log: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The real gateway process on a free loopback port, forwarding to the fake SuperLink."""
    upstream = Upstream(free_port())
    server = _upstream_server(upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port, log = free_port(), tmp_path_factory.mktemp("gateway") / "fleet-gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedapp.run.fleet_gateway", "--listen", f"127.0.0.1:{port}",
                                 "--upstream", f"127.0.0.1:{upstream.port}"], cwd=str(REPO), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the gateway did not start listening"
                time.sleep(0.05)
        yield Live(port, upstream, log)
    finally:
        stop_process_tree(proc)
        server.shutdown()
        server.server_close()


def test_allowed_is_an_exact_allow_list_of_canonical_paths() -> None:
    assert {p for _, p in ALLOWED} == {f"/v1/fleet/{rpc}" for rpc in FLEET_RPCS} | {"/health"}
    assert len(FLEET_RPCS) == 12
    for method, path in ALLOWED:
        assert allowed(method, path) and allowed(method, path.encode())
        assert not allowed(method, path, b"x=1") and not allowed(method, path + "/") and not allowed(method, path + ".")
    assert allowed("POST", "/v1/fleet/pull-messages") and allowed("GET", "/health")
    for method, path in (("POST", "/v1/control/start-run"), ("POST", "/v1/control/list-runs"),
                         ("POST", "/v1/control/register-supernode"), ("POST", "/v1/runtime/x"),
                         ("GET", "/v1/fleet/pull-messages"), ("POST", "/v1/fleetx"), ("HEAD", "/health"),
                         ("post", "/v1/fleet/pull-messages"), ("POST", "/v1/fleet/pull-messagés")):
        assert not allowed(method, path), (method, path)
    for method, target in CORPUS:
        path, _, query = target.partition(b"?")
        assert not allowed(method.decode(), path, query), target[:80]
        assert not allowed(method.decode(), target.decode("utf-8", "replace")), target[:80]


def test_live_gateway_refuses_the_corpus_without_contacting_the_superlink(live: Live) -> None:
    port, upstream = live.port, live.upstream
    upstream.clear()
    got = {(method, target): _send(port, method, target, body=b"\x0a\x02hi") for method, target in CORPUS}
    wrong = {(m, t[:80]): status for (m, t), (status, _) in got.items()
             if status not in ({400, 403} if (m, t) in PARSER_400 else {403})}
    assert wrong == {}, wrong
    assert all(b"not served" in body for (m, t), (status, body) in got.items() if status == 403 and m != b"HEAD")
    # websocket / h2c upgrade attempts on a Control path are refused the same way
    for upgrade in (b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n",
                    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"):
        assert _send(port, b"GET", b"/v1/fleet/../control/list-runs", headers=upgrade)[0] == 403
    assert upstream.connections == [] and upstream.requests == [], upstream.requests[:3]
    assert "Traceback" not in live.log.read_text(errors="replace")  # every refusal is an answer, not a crash


def test_live_gateway_forwards_the_fleet_routes_with_the_exact_path(live: Live) -> None:
    port, upstream = live.port, live.upstream
    upstream.clear()
    auth = b"flwr-public-key: cHVibGlj\r\nflwr-signature: c2ln\r\nflwr-timestamp: 2026-01-01T00:00:00+00:00\r\n"
    for rpc in FLEET_RPCS:
        path = f"/v1/fleet/{rpc}".encode()
        status, body = _send(port, b"POST", path, body=b"\x0a\x03" + rpc.encode()[:3], headers=auth)
        assert (status, body) == (201, b"upstream saw " + path)
        seen = upstream.requests[-1]
        assert seen["method"] == "POST" and seen["path"] == path.decode()
        assert seen["line"] == b"POST " + path + b" HTTP/1.1\r\n"  # byte for byte what the gateway checked
        assert seen["body"] == b"\x0a\x03" + rpc.encode()[:3]
        headers = {k.lower(): v for k, v in seen["headers"].items()}
        assert headers["flwr-public-key"] == "cHVibGlj" and headers["flwr-signature"] == "c2ln"
        assert headers["content-type"] == "application/protobuf" and headers["host"] == f"127.0.0.1:{upstream.port}"
    assert _send(port, b"GET", b"/health")[0] == 201 and upstream.requests[-1]["path"] == "/health"
    # an empty query (a bare '?') is not visible in ASGI: what goes upstream is still the bare checked route
    assert _send(port, b"POST", b"/v1/fleet/get-run?")[0] == 201
    assert upstream.requests[-1]["line"] == b"POST /v1/fleet/get-run HTTP/1.1\r\n"
    assert len(upstream.requests) == len(FLEET_RPCS) + 2
