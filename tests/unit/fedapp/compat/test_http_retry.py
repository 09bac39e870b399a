"""Flower's HTTP retry policy against a real TLS server on loopback that cuts handshakes short
(:mod:`fedapp.compat.http_retry`): Flower's own invoker gives up at the first one, the wrapped one retries it, a
certificate that does not verify is still given up on at once, and the retries are bounded."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from flwr.supercore.retry import make_simple_http_retry_invoker

from fedapp.compat import http_retry, surface


class CuttingServer:
    """HTTPS on loopback that closes the first ``cut`` connections before the TLS handshake ends, then answers 200."""

    def __init__(self, certs: dict[str, Path], cut: int) -> None:
        self.cut = cut
        self.connections = 0
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs["cert"], certs["key"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.connections <= self.cut:
                conn.recv(1024)  # the client hello, then the connection ends mid-handshake
                conn.close()
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            except ssl.SSLError:  # a client that does not trust this certificate ends the handshake
                conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    from fedapp.run.deploy import _make_certs

    return _make_certs()(tmp_path_factory.mktemp("certs"), ("127.0.0.1", "localhost"), 0, ca_key_dir=None)


@pytest.fixture
def server(request, certs) -> Iterator[CuttingServer]:
    srv = CuttingServer(certs, cut=request.param)
    yield srv
    srv.close()


def _fast(invoker):
    invoker.wait_gen_factory = lambda: iter(lambda: 0.01, None)  # Flower's backoff without the seconds
    invoker.jitter = None
    return invoker


def _get(server: CuttingServer, ca: Path):
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=10) as client:
        return client.get(f"https://127.0.0.1:{server.port}/")


@pytest.mark.parametrize("server", [2], indirect=True)
def test_flowers_policy_gives_up_at_the_first_handshake_cut_short_and_the_wrapped_one_retries_it(server, certs):
    with pytest.raises(httpx.ConnectError) as caught:
        _fast(make_simple_http_retry_invoker()).invoke(_get, server, certs["ca"])
    assert http_retry.is_tls_eof(caught.value) and server.connections == 1
    invoker = http_retry.tolerate_tls_eof(_fast(make_simple_http_retry_invoker()))
    assert invoker.invoke(_get, server, certs["ca"]).text == "ok"
    assert server.connections == 3  # the one Flower gave up on, the second cut short, the answered one


@pytest.mark.parametrize("server", [10**6], indirect=True)
def test_the_retries_are_bounded_per_call(server, certs):
    invoker = http_retry.tolerate_tls_eof(http_retry.tolerate_tls_eof(_fast(make_simple_http_retry_invoker())))
    for call in (1, 2):  # each call has its own count
        with pytest.raises(httpx.ConnectError):
            invoker.invoke(_get, server, certs["ca"])
        assert server.connections == call * (http_retry.MAX_TLS_EOF_RETRIES + 1)


@pytest.mark.parametrize("server", [0], indirect=True)
def test_a_certificate_that_does_not_verify_is_still_given_up_on_at_once(server, certs, tmp_path):
    from fedapp.run.deploy import _make_certs

    other_ca = _make_certs()(tmp_path / "other", ("127.0.0.1",), 0, ca_key_dir=None)["ca"]
    invoker = http_retry.tolerate_tls_eof(_fast(make_simple_http_retry_invoker()))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        invoker.invoke(_get, server, other_ca)
    assert server.connections == 1


def test_the_grid_and_the_supernode_connection_are_wrapped_and_the_surface_still_sees_flowers_factory():
    from flwr.superlink.grid.http_grid import HttpGrid

    grid = HttpGrid(token="t")
    assert http_retry.retry_grid_tls_eof(grid) and getattr(grid._retry_invoker, http_retry._MARK)
    assert not http_retry.retry_grid_tls_eof(object())
    import flwr.supernode.fleet_http_connection as connection

    flowers = connection.make_simple_http_retry_invoker
    try:
        assert http_retry.retry_supernode_tls_eof() and http_retry.retry_supernode_tls_eof()
        assert getattr(connection.make_simple_http_retry_invoker(), http_retry._MARK)
        assert surface.problems(http_retry.GROUP) == []
    finally:
        surface.restore(http_retry.SUPERNODE_FACTORY, flowers)
