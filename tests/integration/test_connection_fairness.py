"""HTTP connections shared fairly: one client address holding idle connections cannot take the
places of the others (``http_max_connections_per_address``, by default a quarter of
``http_max_connections``), a connection that never sends a byte ends after
``request_head_timeout_sec``, a 401 closes its connection, a full port takes over its oldest idle
keep-alive connection and answers health checks from a reserve. The other clients bind 127.0.0.2
and up, more loopback addresses."""

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
        assert message == "too many connections from one address: http_max_connections_per_address=250"
        assert "connections refused past http_max_connections=1000 or http_max_connections_per_address=250" \
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

    socks = [connect() for _ in range(250)]
    try:
        extra = connect()
        refused = _answer(extra, 2)
        extra.close()
        assert refused is not None and b"http_max_connections_per_address=250" in refused
        status, seconds = _call(srv, "GET", "/ping", source="127.0.0.1")  # another address: room
        assert status == 200 and seconds < 1.0
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _call(srv, "GET", "/ping")[0] == 200, 10, what="127.0.0.2's share back")


def _request(sock: socket.socket, path: str, key: str | None) -> bytes:
    """Send one GET on ``sock`` (keep-alive) and read its whole answer (head and body)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    got = b""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
        assert time.monotonic() < deadline, got
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_keyless_clients_of_two_addresses_leave_ping_to_a_third(fair_server):
    """The issue's attack: two addresses open 500 keyless connections each and send a request
    on each; every 401 closes its connection, and /ping from a third address answers at once."""
    srv = fair_server
    port = srv.status["http_port"]
    socks = []
    try:
        for source in ("127.0.0.3", "127.0.0.4"):
            for _ in range(500):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)))
        status, seconds = _call(srv, "GET", "/ping", source="127.0.0.5")
        assert status == 200 and seconds < 1.0, (status, seconds)
        refused = unauthorized = 0
        for sock in socks:
            sock.sendall(b"GET /predictions/echo HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in socks:
            answer = _answer(sock, 5)  # closed by the server either way: refused, or after the 401
            assert answer is not None, "a connection left open"
            refused += answer.startswith(b"HTTP/1.1 503")
            unauthorized += answer.startswith(b"HTTP/1.1 401")
        assert (refused, unauthorized) == (500, 500)  # 250 of each address's 500 admitted
        status, seconds = _call(srv, "GET", "/ping", source="127.0.0.5")
        assert status == 200 and seconds < 1.0, (status, seconds)
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture(scope="module")
def small_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """40 connections a port (10 an address, a reserve of 4), a long head deadline."""
    workdir = tmp_path_factory.mktemp("small")
    config = workdir / "config.properties"
    config.write_text("http_max_connections=40\nrequest_head_timeout_sec=60\ndefault_workers_per_model=1\n")
    srv = ServerProcess(workdir, store, ["--ts-config", str(config), "--models", "echo=echo.mar"])
    try:
        srv.wait_workers("echo", 1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _fill(port: int, key: str | None) -> list[socket.socket]:
    """40 connections from 4 addresses (10 each); with ``key``, each has served a /ping and
    waits idle for its next request, else each has sent nothing."""
    socks = []
    for n in range(4):
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(f"127.0.0.{2 + n}", 0))
            socks.append(sock)
            if key is not None:
                assert _request(sock, "/ping", key).startswith(b"HTTP/1.1 200")
    return socks


def test_a_full_port_answers_health_checks_from_its_reserve(small_server):
    srv = small_server
    port = srv.status["http_port"]
    socks = _fill(port, None)  # no connection idle: none can be taken over
    try:
        key = read_key(srv.key_file, "inference")
        for path in ("/ping", "/v2/health/live"):
            reserved = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.6", 0))
            assert _request(reserved, path, key).startswith(b"HTTP/1.1 200"), path
            assert _answer(reserved, 2) == b""  # and closed: the reserve is for one health check at a time
            reserved.close()
        other = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.6", 0))
        answer = _request(other, "/predictions/echo", key)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["message"] == \
            "too many connections: http_max_connections=40"
        other.close()
        held = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.6", 0))
                for _ in range(4)]  # the reserve taken by connections that send nothing
        socks.extend(held)
        refused = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.6", 0))
        answer = _answer(refused, 2)
        refused.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _call(srv, "GET", "/ping")[0] == 200, 10, what="room again")


def test_a_full_port_takes_over_its_oldest_idle_connection(small_server):
    srv = small_server
    port = srv.status["http_port"]
    key = read_key(srv.key_file, "inference")
    socks = _fill(port, key)
    try:
        time.sleep(0.6)  # idle long enough to be taken over (IDLE_EVICT_AFTER_S)
        status, seconds = _call(srv, "POST", "/predictions/echo", b"hello", source="127.0.0.6")
        assert status == 200 and seconds < 1.0, (status, seconds)
        assert _answer(socks[0], 2) == b""  # the oldest idle connection was closed for it
        assert _answer(socks[1], 0.2) is None  # the others are still open
        # 127.0.0.5 at its share of 10: its own oldest idle connection makes room
        status, _ = _call(srv, "GET", "/ping", source="127.0.0.5")
        assert status == 200
        assert _answer(socks[30], 2) == b""
        assert _request(socks[31], "/ping", key).startswith(b"HTTP/1.1 200")  # kept alive, still served
        assert "idle keep-alive connections closed to admit new ones" in srv.log()
    finally:
        for sock in socks:
            sock.close()


def test_a_401_closes_its_connection(small_server):
    srv = small_server
    sock = socket.create_connection(("127.0.0.1", srv.status["http_port"]), timeout=5)
    try:
        answer = _request(sock, "/predictions/echo", None)
        assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer, answer
        assert _answer(sock, 2) == b""
    finally:
        sock.close()


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
