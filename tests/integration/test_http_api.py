"""TorchServe's HTTP/1.1 inference API (``/ping``, ``/predictions``) against the real server.

A plain ``http.client`` reads the answers, chunk by chunk where they stream, with arrival
times; the models run in real worker processes behind the same core as gRPC.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import ServerProcess, build_mar, read_key
from inference_service.errors import InferenceError, NotFound, ResourceExhausted, Unavailable, error_for_code
from inference_service.frontends.http.inference import http_status

CONFIG = """\
max_request_size=16384
max_response_size=4096
models={"slowecho": {"1.0": {"marName": "echo.mar", "minWorkers": 1, "responseTimeout": 1}}}
"""


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """echo (1 worker), gen (generator handler), echo_dir (batchSize 4), slowecho (responseTimeout 1 s),
    cb (continuous batching, batchSize 4)."""
    work = tmp_path_factory.mktemp("http")
    (work / "config.properties").write_text(CONFIG)
    (work / "cb-config.yaml").write_text("continuousBatching: true\nbatchSize: 4\nmaxBatchDelay: 0\n"
                                         "minWorkers: 1\nmaxWorkers: 1\n")
    build_mar(store, "cb_http", "cb_handler.py", config=str(work / "cb-config.yaml"))
    server = ServerProcess(work, store, ["--ts-config", str(work / "config.properties"), "--workers-per-model", "1",
                                         "--models", "echo=echo.mar", "gen=gen.mar", "echo_dir=echo_dir",
                                         "slowecho=echo.mar", "cb=cb_http.mar"])
    try:
        for name in ("echo", "gen", "echo_dir", "slowecho", "cb"):
            server.wait_workers(name, 1)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def _auth(server: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {read_key(server.key_file, 'inference')}"}


def call(server: ServerProcess, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
         key: bool = True, timeout: float = 30) -> tuple[int, http.client.HTTPResponse, bytes]:
    """One request on a fresh connection; returns (status, response, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=timeout)
    try:
        sent = {**(_auth(server) if key else {}), **(headers or {})}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response, response.read()
    finally:
        conn.close()


def post(server: ServerProcess, path: str, text: str, **kwargs) -> tuple[int, http.client.HTTPResponse, bytes]:
    """POST ``text`` as a raw body (Content-Type text/plain, so it is not read as a form)."""
    headers = {"Content-Type": "text/plain", **kwargs.pop("headers", {})}
    return call(server, "POST", path, text.encode(), headers, **kwargs)


def multipart(fields: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body with one part per field; returns (body, content type)."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}.bin\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def error(body: bytes) -> dict:
    """TorchServe's JSON error body, checked for its three fields."""
    parsed = json.loads(body)
    assert set(parsed) == {"code", "type", "message"}, parsed
    return parsed


def test_port_is_reported_and_logged(srv):
    port = srv.status["http_port"]
    assert isinstance(port, int) and port > 0 and srv.status["http_address"] == "127.0.0.1"
    assert f"HTTP inference API listening on 127.0.0.1:{port} (plaintext)" in srv.log()


def test_ping_and_token_authorization(srv):
    status, response, body = call(srv, "GET", "/ping")
    assert status == 200 and json.loads(body) == {"status": "Healthy"}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/ping"), ("POST", "/predictions/echo"), ("GET", "/no/such/path")):
            status, response, body = call(srv, method, path, b"x", headers, key=False)
            assert status == 401, (headers, path)
            assert response.getheader("WWW-Authenticate") == "Bearer"
            assert error(body) == {"code": 401, "type": "InvalidKeyException", "message": (
                "Token Authorization failed. Token either incorrect, expired, or not provided correctly")}
    # the key is never handed to the handler; other headers are
    status, _, body = post(srv, "/predictions/echo", "headers", headers={"X-Trace": "abc"})
    seen = json.loads(body)
    assert status == 200 and seen["X-Trace"] == "abc"
    assert not any(k.lower() == "authorization" for k in seen)
    assert read_key(srv.key_file, "inference") not in srv.log()


def test_raw_body_put_and_versions(srv):
    status, response, body = call(srv, "POST", "/predictions/echo", b"\x00raw bytes\xff",
                                  {"Content-Type": "application/octet-stream"})
    assert (status, body) == (200, "\x00raw bytes\ufffd".encode())  # echo decodes UTF-8 with replacement
    assert response.getheader("Content-Length") == str(len(body)) and response.getheader("Transfer-Encoding") is None
    assert call(srv, "PUT", "/predictions/echo", b"put body")[::2] == (200, b"put body")  # curl -T
    assert post(srv, "/predictions/echo/1.0", "versioned")[::2] == (200, b"versioned")
    status, _, body = post(srv, "/predictions/echo/9.9", "x")
    assert status == 404 and error(body)["message"] == "model 'echo' has no version '9.9'"
    status, _, body = post(srv, "/predictions/no-such-model", "x")
    assert (status, error(body)["type"]) == (404, "ModelNotFoundException")
    status, _, body = call(srv, "GET", "/v2/models")
    assert (status, error(body)["type"]) == (404, "ResourceNotFoundException")
    status, response, body = call(srv, "GET", "/predictions/echo")
    assert status == 405 and response.getheader("Allow") == "POST, PUT" and error(body)["code"] == 405


def test_form_fields_become_inputs(srv):
    body, ctype = multipart({"data": b"hello big world"})
    assert call(srv, "POST", "/predictions/gen", body, {"Content-Type": ctype})[::2] == (200, b"hello big world <done>")
    body, ctype = multipart({"body": b"from the body field"})
    assert call(srv, "POST", "/predictions/echo", body, {"Content-Type": ctype})[::2] == (200, b"from the body field")
    body, ctype = multipart({"data": b"data wins", "body": b"ignored by echo"})
    assert call(srv, "POST", "/predictions/echo", body, {"Content-Type": ctype})[::2] == (200, b"data wins")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert call(srv, "POST", "/predictions/echo", b"data=url%20encoded", form)[::2] == (200, b"url encoded")
    assert call(srv, "POST", "/predictions/echo", b"", {"Content-Type": "text/plain"})[::2] == (200, b"")


def test_intermediate_responses_stream_as_chunks(srv):
    """The handler sends part0..part2 0.4 s apart, then "end": one chunk each, the first long before the end."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    try:
        started = time.monotonic()
        conn.request("POST", "/predictions/echo", b"stream:3:0.4", {**_auth(srv), "Content-Type": "text/plain"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Transfer-Encoding") == "chunked" and response.getheader("Content-Length") is None
        chunks = []
        while piece := response.read1(65536):  # what has arrived, at most the rest of one chunk
            chunks.append((time.monotonic() - started, piece))
    finally:
        conn.close()
    assert [piece for _, piece in chunks] == [b"part0;", b"part1;", b"part2;", b"end"]
    arrivals = [at for at, _ in chunks]
    # part0 and part1 leave together (when part1 shows it is a stream); part2 and "end" 0.4 s apart each
    assert arrivals[-1] - arrivals[0] > 0.6, arrivals
    assert arrivals[2] - arrivals[1] > 0.25 and arrivals[3] - arrivals[2] > 0.25, arrivals

    # a generator handler's yields stream the same way
    body, ctype = multipart({"data": b"one two three"})
    status, response, out = call(srv, "POST", "/predictions/gen", body, {"Content-Type": ctype})
    assert (status, out) == (200, b"one two three <done>") and response.getheader("Transfer-Encoding") == "chunked"


@pytest.mark.parametrize("model,parts", [("echo", 0), ("echo", 2), ("echo_dir", 0)])
def test_the_handlers_response_headers_go_on_the_answer(srv, model, parts):
    """As TorchServe's RestJob: the handler's content type and headers, on a whole answer, a stream
    and a dynamically batched one; a framing header it sets is left out."""
    status, response, body = post(srv, f"/predictions/{model}", f"replyheaders:{parts}")
    assert status == 200, body
    assert body == "".join(f"part{i};" for i in range(parts)).encode() + b"end"
    assert response.getheader("Content-Type") == "application/x-echo"
    assert response.getheader("X-Echo-Parts") == str(parts)
    assert (response.getheader("Transfer-Encoding") == "chunked") == (parts > 0)
    assert response.getheader("Content-Length") == (None if parts else str(len(body)))


def test_client_disconnect_cancels_the_request(srv):
    """echo has one worker: a 10 s stream whose client hangs up must free it within a step."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    conn.request("POST", "/predictions/echo", b"stream:50:0.2", {**_auth(srv), "Content-Type": "text/plain"})
    response = conn.getresponse()
    assert response.status == 200 and response.read1(65536).startswith(b"part0;")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    started = time.monotonic()
    status, _, body = post(srv, "/predictions/echo", "after the cancel", timeout=15)
    assert (status, body) == (200, b"after the cancel")
    assert time.monotonic() - started < 8  # not after the 10 s the stream had left
    # a client gone mid-stream is a normal event: an info line, no traceback
    assert "Traceback" not in srv.log()


def test_error_statuses(srv):
    status, _, body = post(srv, "/predictions/echo", "boom")
    # a handler that raised: TorchServe's 503 (its message is "Prediction failed"; here the exception's)
    assert (status, error(body)) == (503, {"code": 503, "type": "ServiceUnavailableException",
                                           "message": "boom: the handler failed"})
    # the handler's own status comes back as is, as from TorchServe's REST API
    for handler_status, expected in ((400, 400), (404, 404), (503, 503), (507, 507), (418, 418), (409, 409),
                                     (502, 502)):
        status, response, body = post(srv, "/predictions/echo", f"status:{handler_status}")
        assert (status, error(body)["message"]) == (expected, "handler says no"), handler_status
    assert response.getheader("Retry-After") is None
    status, response, body = post(srv, "/predictions/echo", "status:503")
    assert status == 503 and response.getheader("Retry-After") == "1"
    # max_response_size=4096 (TorchServe's 507 for an oversized response)
    status, _, body = post(srv, "/predictions/echo", "repeat:5000")
    assert status == 507 and "max_response_size=4096" in error(body)["message"]
    # max_request_size=16384: a raw body, a multipart body, a declared length
    status, _, body = call(srv, "POST", "/predictions/echo", b"x" * 20000, {"Content-Type": "text/plain"})
    assert status == 413 and "max_request_size=16384" in error(body)["message"]
    mp, ctype = multipart({"data": b"x" * 20000})
    status, _, body = call(srv, "POST", "/predictions/echo", mp, {"Content-Type": ctype})
    assert status == 413 and error(body)["code"] == 413
    # 16000 bytes pass the request limit (and the echo then fails the response limit)
    status, _, body = post(srv, "/predictions/echo", "x" * 16000)
    assert status == 507 and "response of 16000 bytes" in error(body)["message"]
    # responseTimeout 1 s on slowecho: 504, and the worker is replaced
    status, _, body = post(srv, "/predictions/slowecho", "sleep:3")
    assert status == 504 and error(body)["code"] == 504
    srv.wait_workers("slowecho", 1)


def test_error_after_the_first_chunk_truncates_the_body(srv):
    """A too-large third message fails after two chunks went out: no terminating chunk is sent."""
    body, ctype = multipart({"data": b"a b " + b"x" * 5000 + b" c"})
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    try:
        conn.request("POST", "/predictions/gen", body, {**_auth(srv), "Content-Type": ctype})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
        with pytest.raises(http.client.IncompleteRead) as raised:
            response.read()
        assert raised.value.partial == b"a b "
    finally:
        conn.close()
    assert "HTTP stream of /predictions/gen failed after its first chunk" in srv.log()


def test_batched_model_goes_through_dynamic_batching(srv):
    """echo_dir has batchSize 4 and maxBatchDelay 5 s: four concurrent HTTP requests form one batch."""
    results: list[tuple[int, bytes]] = []

    def one() -> None:
        status, _, body = post(srv, "/predictions/echo_dir", "batch")
        results.append((status, body))

    threads = [threading.Thread(target=one) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [(200, b"4")] * 4
    assert time.monotonic() - started < 4.5  # dispatched when full, not after maxBatchDelay
    # on a batched model intermediate responses come back concatenated, in one body (as gRPC Predictions)
    threads = [threading.Thread(target=lambda: post(srv, "/predictions/echo_dir", "x")) for _ in range(3)]
    for t in threads:
        t.start()
    status, response, body = post(srv, "/predictions/echo_dir", "stream:2")
    for t in threads:
        t.join(30)
    assert (status, body) == (200, b"part0;part1;end") and response.getheader("Transfer-Encoding") is None


def _read_chunks(server: ServerProcess, path: str, body: bytes,
                 timeout: float = 30) -> tuple[http.client.HTTPResponse, list[tuple[float, bytes]]]:
    """POST ``body``; the response and each piece read as it arrived, with seconds since the send."""
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=timeout)
    try:
        started = time.monotonic()
        conn.request("POST", path, body, {**_auth(server), "Content-Type": "application/json"})
        response = conn.getresponse()
        chunks = []
        while piece := response.read1(65536):
            chunks.append((time.monotonic() - started, piece))
        return response, chunks
    finally:
        conn.close()


def test_continuous_batching_model_streams_chunked(srv):
    """cb has continuousBatching and batchSize 4: each request streams chunked, one chunk per
    intermediate response, the first long before the end, while the others run beside it."""
    results: list[tuple[http.client.HTTPResponse, list[tuple[float, bytes]]]] = []
    bodies = [json.dumps({"steps": 4, "delay": 0.3}).encode() for _ in range(3)]
    threads = [threading.Thread(target=lambda b=b: results.append(_read_chunks(srv, "/predictions/cb", b)))
               for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3
    for response, chunks in results:
        assert response.status == 200
        assert response.getheader("Transfer-Encoding") == "chunked" and response.getheader("Content-Length") is None
        messages = [json.loads(piece) for _, piece in chunks]
        assert [m["step"] for m in messages] == [0, 1, 2, 3], chunks
        arrivals = [at for at, _ in chunks]
        assert arrivals[-1] - arrivals[0] > 0.6, arrivals  # the first chunk did not wait for the end
    # the three ran together on the one worker (not one after the other)
    assert max(m["max_batch"] for _, chunks in results for m in (json.loads(p) for _, p in chunks)) >= 2

    # a request that ends in its first call answers one body; a rejected one TorchServe's 400
    response, chunks = _read_chunks(srv, "/predictions/cb", json.dumps({"steps": 1}).encode())
    assert response.status == 200 and response.getheader("Transfer-Encoding") is None
    assert json.loads(b"".join(p for _, p in chunks))["step"] == 0
    status, _, body = call(srv, "POST", "/predictions/cb", json.dumps({"steps": 3, "reject": True}).encode(),
                           {"Content-Type": "application/json"})
    assert (status, error(body)["message"]) == (400, "rejected as asked")


def test_http_status_mapping():
    assert http_status(NotFound("x")) == 404
    assert http_status(Unavailable("x")) == 503
    assert http_status(ResourceExhausted("x")) == 507
    assert http_status(ResourceExhausted("x", reason="JOB_QUEUE_FULL")) == 503  # TorchServe: 503, not 429
    assert http_status(ResourceExhausted("x", reason="REQUEST_TOO_LARGE")) == 413
    assert http_status(InferenceError("x")) == 500
    expected = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
                grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.ALREADY_EXISTS: 409,
                grpc.StatusCode.INTERNAL: 500}
    for code, status in expected.items():
        assert http_status(error_for_code(code, "x")) == status, code


def test_shutdown_drains_http_streams(store, tmp_path):
    """SIGTERM during a stream: the stream finishes, new requests get 503, the server exits 0."""
    server = ServerProcess(tmp_path / "work", store, ["--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        server.wait_workers("echo", 1)
        conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=30)
        conn.request("POST", "/predictions/echo", b"stream:4:0.3", {**_auth(server), "Content-Type": "text/plain"})
        response = conn.getresponse()
        chunks = [response.read1(65536)]
        server.proc.send_signal(signal.SIGTERM)
        status_file = server.workdir / ".inference_service" / "status.json"
        deadline = time.monotonic() + 10
        while json.loads(status_file.read_text())["state"] != "stopping":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, response2, body = post(server, "/predictions/echo", "too late")
        assert status == 503 and error(body)["type"] == "ServiceUnavailableException"
        assert response2.getheader("Retry-After") == "1"
        while piece := response.read1(65536):
            chunks.append(piece)
        conn.close()
        assert b"".join(chunks) == b"part0;part1;part2;part3;end"
    finally:
        assert server.stop() == 0, server.log()


def _pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(cn, key, issuer=None, issuer_key=None, ca=False):
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer.subject if issuer else name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if cn == "127.0.0.1":
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(cn))]), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    out = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("test CA", ca_key, ca=True)
    out["ca"] = tmp_path / "ca.pem"
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, cn in (("server", "127.0.0.1"), ("client", "client")):
        key = ec.generate_private_key(ec.SECP256R1())
        out[role] = tmp_path / f"{role}.pem"
        out[role].write_bytes(issue(cn, key, ca, ca_key).public_bytes(serialization.Encoding.PEM))
        out[f"{role}_key"] = tmp_path / f"{role}.key"
        out[f"{role}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return out


def test_https_inference_address_with_mutual_tls(store, tmp_path):
    """inference_address=https://... serves TLS with certificate_file / private_key_file (as TorchServe);
    client_ca_file (with enable_grpc_ssl) requires a client certificate on it too."""
    pki = _pki(tmp_path)
    config = tmp_path / "config.properties"
    config.write_text(f"inference_address=https://127.0.0.1:8443\nenable_grpc_ssl=true\n"
                      f"metrics_address=https://127.0.0.1:8445\n"
                      f"certificate_file={pki['server']}\nprivate_key_file={pki['server_key']}\n"
                      f"client_ca_file={pki['ca']}\n")
    server = ServerProcess(tmp_path / "work", store, ["--ts-config", str(config)])  # --http-port 0 wins over 8443
    try:
        port = server.status["http_port"]
        assert port not in (0, 8443)
        assert f"HTTP inference API listening on 127.0.0.1:{port} (HTTPS)" in server.log()
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.load_cert_chain(pki["client"], pki["client_key"])
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        conn.request("GET", "/ping", headers=_auth(server))
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())) == (200, {"status": "Healthy"})
        conn.close()
        # TorchServe's metrics_address=https://... (its test configs): the metrics API over TLS too
        metrics = http.client.HTTPSConnection("127.0.0.1", server.status["metrics_port"], timeout=10, context=context)
        metrics.request("GET", "/metrics")
        response = metrics.getresponse()
        assert response.status == 200 and b"ts_inference_requests_total" in response.read()
        metrics.close()
        assert "metrics API listening on https://127.0.0.1:" in server.log()
        # without a client certificate, and in plaintext, no answer
        anonymous = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                                context=ssl.create_default_context(cafile=str(pki["ca"])))
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for conn in (anonymous, plain):
            with pytest.raises((ssl.SSLError, http.client.RemoteDisconnected, ConnectionError)):
                conn.request("GET", "/ping", headers=_auth(server))
                conn.getresponse()
            conn.close()
    finally:
        assert server.stop() == 0, server.log()


def test_malformed_multipart_is_a_bad_request(srv):
    # each is refused with TorchServe's 400 JSON error naming the problem; the model stays served
    cases = {
        "no boundary": (b"--x\r\n\r\nhello\r\n--x--\r\n", "multipart/form-data"),
        "wrong boundary": (b"--y\r\nContent-Disposition: form-data; name=\"data\"\r\n\r\nhi\r\n--y--\r\n",
                           "multipart/form-data; boundary=x"),
        "truncated": (b"--x\r\nContent-Disposition: form-data; name=\"data\"\r\n\r\nhi",
                      "multipart/form-data; boundary=x"),
        "garbage headers": (b"--x\r\n\x00\x01\x02 not a header\r\n\r\nhi\r\n--x--\r\n",
                            "multipart/form-data; boundary=x"),
    }
    for label, (body, ctype) in cases.items():
        status, _, answer = call(srv, "POST", "/predictions/echo", body, {"Content-Type": ctype})
        assert status == 400, (label, status, answer)
        assert error(answer)["message"].startswith("malformed multipart body"), (label, answer)
    status, _, answer = post(srv, "/predictions/echo", "still here")
    assert (status, answer) == (200, b"still here")
