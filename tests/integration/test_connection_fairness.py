"""HTTP connections shared fairly: one client address holding idle connections cannot take the
places of the others (``http_max_connections_per_address``, by default half of
``http_max_connections``), and a connection that never sends a byte ends after
``request_head_timeout_sec``. The other client binds 127.0.0.2, a second loopback address."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ServerProcess, read_key, wait_for
from inference_service.frontends.http.connections import client_address

IDLE = 1100  # the attack: more than http_max_connections (1000), no key, nothing sent
HEAD_TIMEOUT_S = 3


class _SourceConnection(http.client.HTTPConnection):
    """An HTTP connection from a chosen local address."""

    def __init__(self, port: int, source: str, timeout: float) -> None:
        super().__init__("127.0.0.1", port, timeout=timeout, source_address=(source, 0))


@pytest.fixture(scope="module")
def fair_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default connection limits (1000 per port), a short head deadline, the echo model."""
    workdir = tmp_path_factory.mktemp("fair")
    config = workdir / "config.properties"
    config.write_text(f"request_head_timeout_sec={HEAD_TIMEOUT_S}\ndefault_workers_per_model=1\n")
    srv = ServerProcess(workdir, store, ["--ts-config", str(config), "--models", "echo=echo.mar"])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard:  # this process's own 1,100 sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    try:
        srv.wait_workers("echo", 1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _call(srv: ServerProcess, method: str, path: str, body: bytes | None = None,
          source: str = "127.0.0.2") -> tuple[int, float]:
    """``(status, seconds)`` of one request from ``source`` with the inference key."""
    conn = _SourceConnection(srv.status["http_port"], source, timeout=10)
    start = time.monotonic()
    try:
        conn.request(method, path, body=body,
                     headers={"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}"})
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - start
    finally:
        conn.close()


def _answer(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``seconds``; ``None``: still open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_one_address_holding_idle_connections_leaves_room_for_the_others(fair_server):
    srv = fair_server
    port = srv.status["http_port"]
    socks = []
    try:
        for _ in range(IDLE):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        opened = time.monotonic()
        for path, body in (("/ping", None), ("/predictions/echo", b"hello")):
            status, seconds = _call(srv, "GET" if body is None else "POST", path, body)
            assert status == 200 and seconds < 1.0, (path, status, seconds)
        status, seconds = _call(srv, "GET", "/v2/health/live")
        assert status == 200 and seconds < 1.0
        refused = _answer(socks[-1], 2)  # past the address's share: answered 503 at once
        assert refused is not None and refused.startswith(b"HTTP/1.1 503")
        message = json.loads(refused.split(b"\r\n\r\n", 1)[1])["message"]
        assert message == "too many connections from one address: http_max_connections_per_address=500"
        assert "connections refused past http_max_connections=1000 or http_max_connections_per_address=500" \
            in srv.log()
        held = socks[0]  # sent nothing: ended by request_head_timeout_sec, not the 60 s idle timeout
        ended = _answer(held, HEAD_TIMEOUT_S + 5 - (time.monotonic() - opened))
        assert ended is not None and ended.startswith(b"HTTP/1.1 408"), ended
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _call(srv, "GET", "/ping")[0] == 200, 10, what="/ping")


def test_the_address_share_comes_back_as_its_connections_close(fair_server):
    srv = fair_server
    port = srv.status["http_port"]

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))

    socks = [connect() for _ in range(500)]
    try:
        extra = connect()
        refused = _answer(extra, 2)
        extra.close()
        assert refused is not None and b"http_max_connections_per_address=500" in refused
        status, seconds = _call(srv, "GET", "/ping", source="127.0.0.1")  # another address: room
        assert status == 200 and seconds < 1.0
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _call(srv, "GET", "/ping")[0] == 200, 10, what="127.0.0.2's share back")


class _Transport:
    def __init__(self, peer: object) -> None:
        self.peer = peer

    def get_extra_info(self, name: str) -> object:
        return self.peer if name == "peername" else None


@pytest.mark.parametrize(("peer", "address"), [
    (("127.0.0.2", 50000), "127.0.0.2"),
    (("2001:db8:1:2:aaaa::1", 50000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:bbbb::7", 50001, 0, 0), "2001:db8:1:2::/64"),  # the same host's /64: one share
    (("::ffff:10.1.2.3", 50000, 0, 0), "10.1.2.3"),
    (("fe80::1%eth0", 50000, 0, 2), "fe80::/64"),
    ("", None),  # a Unix socket: no per-address share
])
def test_a_connection_counts_against_its_client_address(peer, address):
    assert client_address(_Transport(peer)) == address  # type: ignore[arg-type]
