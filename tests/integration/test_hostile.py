"""Issue 34: hostile clients, settings and run directories, each attack rerun against a real
server. Tests are named by the issue's item numbers; after (or during) each attack a new
client's Ping must be answered within 1 s.

1. connections that never finish a request: HTTP (idle, partial heads, trickling bodies, past
   the cap under a 1,024 open-file limit), the metrics port, gRPC without a handshake
2. readers that grant no flow-control window: gRPC, bounded per connection (streams, and
   bytes of unread answers at the defaults); HTTP, a stream whose reader stops holds its handler
   back (the LLM preemption of such a stream and the KV cache are not covered here)
3. wide JSON bodies on every door that parses JSON
4. ``--stop`` and startup with a pid file naming a stranger
5. a run directory writable by others, owned by another user, or with planted links
6. forged and flooded log lines
7. keys in a worker's environment
8. hostile model-config and registration values, unbounded messages, connection settings out
   of range, ``scripts/build_llm_archive`` inputs
9. HTTP/2 rapid reset (100,000 streams; the KV-cache padding part is not covered here)
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2

from conftest import ROOT, ServerProcess, build_dir, read_key, wait_for
from inference_service._proto import inference_pb2_grpc, management_pb2

pytestmark = pytest.mark.slow

PING_LIMIT_S = 1.0


def ping_within(server: ServerProcess, limit: float = PING_LIMIT_S) -> float:
    """A new channel's Ping, answered within ``limit`` s; returns the seconds it took."""
    started = time.monotonic()
    channel = server.open_channel(server.inference_port, "inference")
    try:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        stub.Ping(empty_pb2.Empty(), timeout=limit)
    finally:
        channel.close()
    took = time.monotonic() - started
    assert took <= limit, f"Ping took {took:.2f}s"
    return took


def http_call(server: ServerProcess, method: str, path: str, *, port_key: str = "http_management_port",
              scope: str = "management", body: bytes = b"") -> tuple[int, Any]:
    """One HTTP request with the ``scope`` key; returns (status, body parsed as JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.status[port_key], timeout=30)
    try:
        conn.request(method, path, body=body,
                     headers={"Authorization": f"Bearer {read_key(server.key_file, scope)}"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")


def register_refused(server: ServerProcess, url: str, name: str, **fields: Any) -> str:
    """Register ``url`` over gRPC, expecting INVALID_ARGUMENT; returns the details."""
    with pytest.raises(grpc.RpcError) as caught:
        server.register(url, model_name=name, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    details = caught.value.details() or ""
    assert len(details) < 1000, len(details)
    return details


# --- item 8: hostile settings -----------------------------------------------------------


@pytest.mark.parametrize(("handler_yaml", "key"), [
    ("torch_threads: 0", "torch_threads"),
    ("torch_threads: -1", "torch_threads"),
    ("torch_threads: '4'", "torch_threads"),
    ("torch_threads: 1e30", "torch_threads"),
    ("cpu_affinity: '0-3000000'", "cpu_affinity"),
    ("max_num_batched_tokens: 0", "max_num_batched_tokens"),
    ("omp_wait_policy: spin", "omp_wait_policy"),
])
def test_8_model_config_values_refused_naming_the_key(server: ServerProcess, handler_yaml: str, key: str) -> None:
    offset = len(server.log())
    url = build_dir(server.store, "hostile_cfg", "cpu_settings_handler.py", model_name="hostile_cfg",
                    config_yaml=f"minWorkers: 1\nhandler:\n  {handler_yaml}\n",
                    handler_entry="cpu_settings_handler:handle")
    details = register_refused(server, url, "hostile_cfg")
    assert f"'{key}' must" in details, details
    ping_within(server)
    assert "Traceback" not in server.log()[offset:]


def test_8_torch_threads_above_the_cpus_is_capped(server: ServerProcess) -> None:
    from inference_service.worker.cpu import usable_cpus

    url = build_dir(server.store, "hostile_threads", "cpu_settings_handler.py", model_name="hostile_threads",
                    config_yaml="minWorkers: 1\nhandler:\n  torch_threads: 64\n",
                    handler_entry="cpu_settings_handler:handle")
    server.register(url, model_name="hostile_threads")
    try:
        got = json.loads(server.predict("hostile_threads", "x"))
        assert got["threads"] == int(usable_cpus())
        wait_for(lambda: "torch_threads 64 is more than the" in server.log(), 10, what="a warning for the cap")
        ping_within(server)
    finally:
        server.unregister("hostile_threads")


@pytest.mark.parametrize("field", ["batch_size", "max_batch_delay", "response_timeout", "startup_timeout"])
def test_8_negative_registration_fields_refused(server: ServerProcess, field: str) -> None:
    details = register_refused(server, "echo.mar", "hostile_neg", **{field: -7})
    assert details.startswith(f"{field} must be 0 (unset) or from"), details
    status, body = http_call(server, "POST", f"/models?url=echo.mar&model_name=hostile_neg&{field}=-7")
    assert status == 400 and field in body["message"], body
    ping_within(server)


def test_8_negative_scale_timeout_refused(server: ServerProcess) -> None:
    status, body = http_call(server, "PUT", "/models/echo?min_worker=2&timeout=-5")
    assert status == 400 and "timeout must be" in body["message"], body
    with pytest.raises(grpc.RpcError) as caught:
        server.management.ScaleWorker(management_pb2.ScaleWorkerRequest(
            model_name="echo", min_worker=2, timeout=-5), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ping_within(server)


def _build_archive(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), *args],
                          capture_output=True, text=True, timeout=120)


def test_8_build_llm_archive_refusals_are_one_line(tmp_path: Path) -> None:
    model = tmp_path / ("m" * 240)  # a 240-character directory name: the default name is cut
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (model / name).write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the archive")
    (model / "leak").symlink_to(secret)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, text in (
        (["--model-store", str(blocker / "store")], "cannot write the archive to"),
        (["--model-store", str(tmp_path / "out"), "--self-contained"], "is a link that leaves the model directory"),
        (["--model-store", str(tmp_path / "out"), "--name", "n" * 230], "--name"),
    ):
        done = _build_archive("--model-path", str(model), *args)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and text in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not list((tmp_path / "out").glob("*.mar")) if (tmp_path / "out").exists() else True
    (model / "leak").unlink()
    done = _build_archive("--model-path", str(model), "--model-store", str(tmp_path / "out"), "--engine", "torch")
    assert done.returncode == 0, done.stderr  # (the torch engine: these files are no model to convert)
    assert len(Path(done.stdout.strip()).name) <= 204


# --- items 4, 5, 7: pid file, run directory, keys ------------------------------------------


def _cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference_service", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_4_5_7_stranger_pid_planted_links_and_keys(store: Path, tmp_path: Path) -> None:
    """A pid file naming a live stranger: startup replaces it (a log line), ``--stop`` stops the
    server and never signals the stranger. A ``status.json.tmp`` link planted in the run
    directory is not written through. The worker's environment holds no key (item 7)."""
    workdir = tmp_path / "srv"
    run_dir = workdir / ".inference_service"
    run_dir.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run_dir / "status.json.tmp").symlink_to(victim)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run_dir / "inference_service.pid").write_text(str(stranger.pid))
        refused = _cli("--stop", cwd=workdir)
        assert refused.returncode == 1 and "is stale" in refused.stderr, refused.stderr
        assert stranger.poll() is None
        key = "k" * 43
        srv = ServerProcess(workdir, store, ["--enable-model-api"],
                            env={"INFERENCE_SERVICE_INFERENCE_KEY": key, "INFERENCE_SERVICE_MANAGEMENT_KEY": key + "m"})
        try:
            assert "replaced the stale pid file" in srv.log()
            assert victim.read_text() == "keep me"
            url = build_dir(store, "hostile_env", "environ_handler.py", model_name="hostile_env",
                            handler_entry="environ_handler:handle")
            srv.register(url, model_name="hostile_env")
            seen = json.loads(srv.predict("hostile_env", "x"))
            assert not [n for n in seen["names"] if n.endswith("_KEY")], seen
            assert key not in seen["values"] and key + "m" not in seen["values"]
            ping_within(srv)
            again = _cli("--foreground", "--ncs", "--model-store", str(store), cwd=workdir)
            assert again.returncode == 1 and f"another instance (pid {srv.proc.pid})" in again.stderr
            stopped = _cli("--stop", cwd=workdir)
            assert stopped.returncode == 0, stopped.stderr
            assert srv.proc.wait(30) == 0
        finally:
            srv.stop()
        assert stranger.poll() is None, "the stranger was signalled"
        assert not (run_dir / "inference_service.pid").exists()
    finally:
        stranger.send_signal(signal.SIGKILL)
        stranger.wait(10)


def test_5_run_dir_created_private_and_untrusted_ones_refused(server: ServerProcess, store: Path,
                                                              tmp_path: Path) -> None:
    assert (server.workdir / ".inference_service").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (linked / "inference_service.pid").symlink_to(victim)
    cases = [(shared, "writable by its group or others"), (linked, "is a symbolic link")]
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
        cases.append((foreign, "belongs to uid 65534"))
    for run_dir, message in cases:
        done = _cli("--foreground", "--ncs", "--run-dir", str(run_dir), "--model-store", str(store),
                    "--grpc-inference-port", "0", "--grpc-management-port", "0", "--no-http",
                    "--metrics-port", "0", cwd=tmp_path)
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        ping_within(server)
    assert victim.read_text() == "keep me"
    assert shared.stat().st_mode & 0o777 == 0o777  # refused, not silently changed


# --- item 6: forged and flooded log lines ---------------------------------------------------


def test_6_log_fields_escaped_and_bounded(server: ServerProcess) -> None:
    from inference_service._proto import inference_pb2

    forged = "FORGED-2026-01-01 00:00:00,000 INFO inference_service: all is well"
    offset = len(server.log().encode())
    for name in (f"x\n{forged}", f"x\r\n{forged}"):
        with pytest.raises(grpc.RpcError) as caught:
            server.inference.Predictions(inference_pb2.PredictionsRequest(model_name=name, model_version=f"1\n{forged}",
                                                                          input={"data": b"x"}), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert http_call(server, "POST", "/predictions/x%0a" + forged.replace(" ", "%20"), port_key="http_port",
                     scope="inference")[0] == 404
    assert http_call(server, "GET", "/models/x%0d%0a" + forged.replace(" ", "%20"))[0] == 404
    big = "n" * (4 << 20)
    for _ in range(5):
        with pytest.raises(grpc.RpcError):
            server.inference.Predictions(inference_pb2.PredictionsRequest(model_name=big, input={"data": b"x"}),
                                         timeout=30)
        ping_within(server)
    wait_for(lambda: server.log().count(" model=x\\n") >= 1, 10, what="the escaped access line")
    grown = server.log_path.read_bytes()[offset:]
    assert len(grown) < 200_000, len(grown)
    lines = grown.decode(errors="replace").splitlines()
    assert not [line for line in lines if line.startswith("FORGED")], lines


# --- item 1: connections that never finish a request ---------------------------------------

SLOW_CONFIG = ("request_head_timeout_sec=1\nconnection_idle_timeout_sec=3\nhttp_body_min_rate=1000\n"
               "grpc_max_concurrent_streams=16\ngrpc_unread_pause_timeout_sec=1\n")


def _connect(port: int, first: bytes = b"") -> Any:
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def _closed_within(sock: Any, seconds: float) -> bytes:
    """What the server sent before closing ``sock`` (asserts it closed within ``seconds``)."""
    import socket

    deadline = time.monotonic() + seconds
    got = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"connection still open after {seconds}s (got {got[:80]!r})")


@pytest.fixture(scope="module")
def slow_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server with short connection deadlines, started under a 1,024 open-file limit (hard and
    soft, when the tests may lower and raise the hard one back)."""
    import resource

    workdir = tmp_path_factory.mktemp("slow")
    config = workdir / "config.properties"
    config.write_text(SLOW_CONFIG)
    real_popen = subprocess.Popen

    def limited(*args: Any, **kwargs: Any) -> Any:  # the server's process only, before it runs
        kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        return real_popen(*args, **kwargs)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = hard >= 1024
    subprocess.Popen = limited  # type: ignore[misc]
    try:
        srv = ServerProcess(workdir, store, ["--ts-config", str(config), "--models", "echo=echo.mar",
                                             "--workers-per-model", "1"])
    finally:
        subprocess.Popen = real_popen  # type: ignore[misc]
    if soft < 2048 <= hard:  # the attacker's own 1,100 sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    try:
        srv.wait_workers("echo", 1)
        yield srv, lowered
    finally:
        srv.stop()


def _http_ping(srv: ServerProcess) -> int:
    status, _ = http_call(srv, "GET", "/ping", port_key="http_port", scope="inference")
    return status


def test_1_slow_connections_are_capped_and_closed(slow_server: Any) -> None:
    srv, lowered = slow_server
    http_port = srv.status["http_port"]
    socks = []
    try:
        for _ in range(1100):
            socks.append(_connect(http_port))
        started = time.monotonic()
        ping_within(srv)
        srv.scale("echo", 1)
        assert _http_ping(srv) in (200, 503)  # answered: served, or refused past the cap
        refused = 0
        for sock in socks[-50:]:
            if b"too many connections" in _closed_within(sock, 5):  # past the port's or the address's cap
                refused += 1
        assert refused == 50  # one address holds at most a quarter of the port's cap, lowered or not
        assert "connections refused past http_max_connections" in srv.log()
        for sock in socks[:20]:  # sent nothing: closed by request_head_timeout_sec (1 s)
            _closed_within(sock, 3 + 3 - (time.monotonic() - started))
        ping_within(srv)
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _http_ping(srv) == 200, 10, what="HTTP /ping served again")


def test_1_partial_heads_and_slow_bodies_are_ended(slow_server: Any) -> None:
    srv, _ = slow_server
    http_port = srv.status["http_port"]
    key = read_key(srv.key_file, "inference")
    # 15 + 15: within one address's share of the port (a quarter of 128 under a 1,024 open-file limit)
    partial = [_connect(http_port, b"GET /ping HTTP/1.1\r\nHo") for _ in range(15)]
    body = (f"POST /predictions/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Length: 100000\r\n\r\n0123456789").encode()
    slow = [_connect(http_port, body) for _ in range(15)]
    try:
        ping_within(srv)
        for sock in partial:
            assert _closed_within(sock, 4).startswith(b"HTTP/1.1 408")
        for sock in slow:
            assert _closed_within(sock, 4).startswith(b"HTTP/1.1 408")
        ping_within(srv)
        assert _http_ping(srv) == 200
    finally:
        for sock in partial + slow:
            sock.close()


def test_1_metrics_port_caps_and_times_out_connections(slow_server: Any) -> None:
    srv, lowered = slow_server
    port = srv.status["metrics_port"]
    socks = [_connect(port) for _ in range(200)]
    try:
        ping_within(srv)
        if lowered:  # the cap (128 under 1,024 descriptors): the last ones are closed at once
            _closed_within(socks[-1], 2)
        for sock in socks[:20]:  # sent nothing: closed by request_head_timeout_sec (1 s)
            _closed_within(sock, 4)
    finally:
        for sock in socks:
            sock.close()

    def scraped() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    wait_for(scraped, 10, what="/metrics served again")


def test_1_grpc_connections_without_handshake_are_closed(slow_server: Any) -> None:
    srv, _ = slow_server
    silent = [_connect(srv.inference_port) for _ in range(30)]
    preface = [_connect(srv.inference_port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") for _ in range(30)]
    try:
        ping_within(srv)
        for sock in silent + preface:
            _closed_within(sock, 5)
        ping_within(srv)
    finally:
        for sock in silent + preface:
            sock.close()


# --- item 3: wide JSON bodies ----------------------------------------------------------------


def _post_json(server: ServerProcess, port_key: str, scope: str, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.status[port_key], timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {read_key(server.key_file, scope)}",
                                                       "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_3_wide_json_is_refused_before_it_is_parsed(server: ServerProcess) -> None:
    import threading

    objects = b"[" + b",".join([b"{}"] * 1_500_000) + b"]"
    lists = b"[" + b",".join([b"[]"] * 2_000_000) + b"]"
    doors = [
        ("http_management_port", "management", "/models", b'{"url": "echo.mar", "x": ' + objects + b"}"),
        ("http_port", "inference", "/v2/models/echo/infer", b'{"inputs": [], "unknown": ' + lists + b"}"),
        ("http_port", "inference", "/v1/completions", b'{"model": "echo", "prompt": "x", "u": ' + lists + b"}"),
    ]
    worst: list[float] = []
    stop = threading.Event()

    def pinging() -> None:
        while not stop.is_set():
            worst.append(ping_within(server))

    pinger = threading.Thread(target=pinging)
    pinger.start()
    try:
        for port_key, scope, path, body in doors:
            status, answer = _post_json(server, port_key, scope, path, body)
            assert status == 400 and b"max_json_nodes=100000" in answer, (path, status, answer[:200])
    finally:
        stop.set()
        pinger.join(10)
    assert worst and max(worst) <= PING_LIMIT_S, max(worst)


# --- item 9: HTTP/2 rapid reset ----------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (short strings)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_9_rapid_reset_streams_leave_memory_as_it_was(server: ServerProcess) -> None:
    """Streams opened and reset at once (CVE-2023-44487), no key: gRPC's own limits
    (``grpc_max_concurrent_streams``) keep the server's memory; 100,000 here (the issue's 400,000
    takes minutes on two shared cores)."""
    import socket

    headers = b"".join(_hpack_literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"127.0.0.1"),
        (b":path", b"/org.pytorch.serve.grpc.inference.InferenceAPIsService/Ping"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    ping_within(server)
    before = _rss_mb(server.proc.pid)
    sock = socket.create_connection(("127.0.0.1", server.inference_port), timeout=10)
    sock.setblocking(True)
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b""))
        stream = 1
        for _ in range(100):  # batches of 1,000 streams, each HEADERS (END_HEADERS) then RST_STREAM CANCEL
            batch = []
            for _ in range(1000):
                batch.append(_h2_frame(1, 4, stream, headers) + _h2_frame(3, 0, stream, (8).to_bytes(4, "big")))
                stream += 2
            try:
                sock.sendall(b"".join(batch))
            except OSError:  # the server may end the connection (GOAWAY, ENHANCE_YOUR_CALM)
                break
        ping_within(server)
    finally:
        sock.close()
    wait_for(lambda: _rss_mb(server.proc.pid) <= before * 1.2 + 10, 30, 0.5,
             f"the server's RSS back near {before:.0f} MB")
    ping_within(server)


# --- item 2: readers that grant no flow-control window ----------------------------------------


def _h2_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream, payload) of each whole frame in ``data``."""
    frames, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        if pos + 9 + length > len(data):
            break
        frames.append((data[pos + 3], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                       data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return frames


def _zero_window_calls(srv: ServerProcess, count: int, size: int) -> Any:
    """A connection that grants no window (SETTINGS_INITIAL_WINDOW_SIZE 0) and opens ``count``
    Predictions streams asking for ``size`` bytes each; returns its socket."""
    import socket

    from inference_service._proto import inference_pb2

    message = inference_pb2.PredictionsRequest(model_name="echo", input={"data": f"repeat:{size}".encode()})
    body = message.SerializeToString()
    grpc_message = b"\x00" + len(body).to_bytes(4, "big") + body
    headers = b"".join(_hpack_literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"127.0.0.1"),
        (b":path", b"/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"authorization", f"Bearer {read_key(srv.key_file, 'inference')}".encode())))
    sock = socket.create_connection(("127.0.0.1", srv.inference_port), timeout=10)
    zero_window = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, zero_window))
    sock.sendall(b"".join(_h2_frame(1, 4, s, headers) + _h2_frame(0, 1, s, grpc_message)
                          for s in range(1, 2 * count, 2)))
    return sock


def _unread_refusals(srv: ServerProcess, since: int) -> int:
    """Calls the access log shows ended for unread answers (their trailers wait for a window
    that never comes, so the attacker does not see them)."""
    return srv.log()[since:].count("CONNECTION_UNREAD_BYTES")


def _receive(sock: Any, seconds: float, enough: Callable[[bytes], bool]) -> bytes:
    """What the server sends on ``sock`` for up to ``seconds``, or until ``enough`` of it."""
    import socket

    received, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline and not enough(received):
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        received += chunk
    return received


def test_2_zero_window_streams_are_bounded_per_connection(slow_server: Any) -> None:
    """80 streams asking for 1 MB answers on one connection that grants no window
    (SETTINGS_INITIAL_WINDOW_SIZE 0): the server takes ``grpc_max_concurrent_streams`` (16
    here) and refuses the others, so what it buffers for the connection is bounded."""
    srv, _ = slow_server
    before = _rss_mb(srv.proc.pid)
    sock = _zero_window_calls(srv, 80, 1_000_000)
    try:
        def refused(data: bytes) -> int:
            return sum(1 for kind, _, payload in _h2_frames(data)
                       # RST_STREAM REFUSED_STREAM or ENHANCE_YOUR_CALM (gRPC's answer)
                       if kind == 3 and int.from_bytes(payload, "big") in (7, 11))

        received = _receive(sock, 5, lambda data: refused(data) >= 64)
        assert refused(received) >= 64, [(k, s, p[:8]) for k, s, p in _h2_frames(received)][:12]
        ping_within(srv)
        wait_for(lambda: _rss_mb(srv.proc.pid) - before > 8, 20, 0.1, "the 16 answers held for the connection")
        srv.wait_described("echo", lambda d: d["jobQueueStatus"]["pendingRequests"] == 0
                           and all(w["status"] == "READY" for w in d["workers"]), 20)
        grown = _rss_mb(srv.proc.pid) - before
        assert grown < 16 * 4 + 50, f"the server grew {grown:.0f} MB"
    finally:
        sock.close()
    ping_within(srv)


def test_2_zero_window_streams_at_the_defaults_keep_memory_bounded(server: ServerProcess) -> None:
    """The issue's attack at the default settings: 80 streams asking for 6 MB answers on one
    connection that grants no window. ``grpc_max_unread_bytes`` (16 MiB) lets two answers out and
    two wait; the others end RESOURCE_EXHAUSTED at once (in the access log: their trailers wait for
    the window too): the server stays under 300 MB (it grew
    to 1.4 GB before) and a new client's Ping is answered within 1 s all along."""
    ping_within(server)
    before, since = _rss_mb(server.proc.pid), len(server.log())
    peak = before
    sock = _zero_window_calls(server, 80, 6_000_000)
    try:
        started = time.monotonic()
        while time.monotonic() - started < 30 and _unread_refusals(server, since) < 76:
            _receive(sock, 0.5, lambda data: False)
            peak = max(peak, _rss_mb(server.proc.pid))
            ping_within(server)
        assert _unread_refusals(server, since) == 76, server.log()[since:][-2000:]
        server.wait_described("echo", lambda d: d["jobQueueStatus"]["pendingRequests"] == 0, 30)
        peak = max(peak, _rss_mb(server.proc.pid))
        assert peak < 300 and peak - before < 150, f"{before:.0f} MB, then {peak:.0f} MB"
    finally:
        sock.close()
    ping_within(server)


def test_2_paused_answers_end_after_the_pause(slow_server: Any) -> None:
    """Answers waiting for room end after ``grpc_unread_pause_timeout_sec`` (1 s here): of 4 zero-
    window streams of 6 MB, two answers go out (and wait for the window), two end."""
    srv, _ = slow_server
    since = len(srv.log())
    sock = _zero_window_calls(srv, 4, 6_000_000)
    try:
        started = time.monotonic()
        wait_for(lambda: _unread_refusals(srv, since) >= 2, 20, 0.05, "the two paused calls ended")
        assert time.monotonic() - started >= 1.0
        time.sleep(1.0)  # the two answers sent are not ended (nothing more happens): the check's wait
        assert _unread_refusals(srv, since) == 2
        ping_within(srv)
    finally:
        sock.close()


def test_2_a_client_that_reads_gets_many_large_answers_on_one_connection(server: ServerProcess) -> None:
    """No regression: 16 concurrent 3.5 MB answers on one channel all arrive (the budget only
    makes some wait while the client reads the others)."""
    from inference_service._proto import inference_pb2

    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"repeat:3500000"})
    for _ in range(2):
        calls = [server.inference.Predictions.future(request, timeout=60) for _ in range(16)]
        assert [len(call.result().prediction) for call in calls] == [3_500_000] * 16


def _dechunk(data: bytes) -> list[bytes]:
    """The chunks of a whole chunked HTTP/1.1 body (``data`` starts after the head)."""
    chunks, pos = [], 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return chunks
        chunks.append(data[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


def test_2_http_stream_of_a_reader_that_stops_holds_the_handler_back(server: ServerProcess) -> None:
    """HTTP: a client that stops reading a 16 MiB stream (4,000 chunks of 4 KiB) holds the
    handler back once the socket buffers are full (the server's writes wait, so do the worker's
    credits), instead of the server buffering the stream; the client then gets every chunk."""
    import socket

    count, size = 4000, 4096
    body = f"streamclock:{count}:{size}".encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.status["http_port"]))
    try:
        sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     + f"Authorization: Bearer {read_key(server.key_file, 'inference')}\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = sock.recv(4096)
        paused_at = time.monotonic()
        time.sleep(1.5)  # the client stops reading: the scenario under test, not a wait for the server
        ping_within(server)
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(1 << 20)
            assert chunk, "the connection closed before the stream's end"
            received += chunk
    finally:
        sock.close()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    chunks = _dechunk(rest)
    assert len(chunks) == count + 1 and all(c.startswith(f"{i}:".encode()) and len(c) == size
                                            for i, c in enumerate(chunks[:-1]))
    # without the writes waiting, the handler ends within a fraction of a second, while paused
    assert float(chunks[-1]) > paused_at + 1.0, float(chunks[-1]) - paused_at


def test_8_huge_values_get_bounded_messages(server: ServerProcess, store: Path, tmp_path: Path) -> None:
    for fields in ({"model_name": "bad name " * 50_000}, {"url": "missing-" + "u" * 400_000 + ".mar"}):
        with pytest.raises(grpc.RpcError) as caught:
            server.register(fields.pop("url", "echo.mar"), **fields)
        assert len(caught.value.details() or "") <= 4003, len(caught.value.details() or "")
        ping_within(server)
    config = tmp_path / "config.properties"
    for line, key in (("request_head_timeout_sec=0", "request_head_timeout_sec"),
                      ("http_max_connections=-1", "http_max_connections"),
                      ("http_max_connections_per_address=-1", "http_max_connections_per_address"),
                      ("max_json_nodes=0", "max_json_nodes")):
        config.write_text(line + "\n")
        done = _cli("--foreground", "--ncs", "--ts-config", str(config), "--model-store", str(store),
                    "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
        assert done.returncode != 0 and key in done.stderr and "Traceback" not in done.stderr, done.stderr
