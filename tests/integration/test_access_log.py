"""The access log (one line per RPC, plain or JSON), relayed worker lines, and the switches."""

from __future__ import annotations

import http.client
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from conftest import ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2, management_pb2

PLAIN = re.compile(r"^\S+ \S+ INFO inference_service\.access: (\w+) model=(\S+) version=(\S+) status=(\w+) "
                   r"reason=(\S+) latency_ms=(\d+(?:\.\d+)?) messages=(\d+) peer=(\S+) request_id=(\S+)$")


def new_lines(srv: ServerProcess, since: int) -> list[str]:
    return srv.log()[since:].splitlines()


def access(lines: list[str]) -> list[tuple[str, ...]]:
    return [m.groups() for line in lines if (m := PLAIN.match(line))]


def test_plain_line_per_rpc(server):
    since = len(server.log())
    missing = f"nope-{uuid.uuid4().hex[:8]}"
    assert server.predict("echo", "hi", version="1.0") == b"hi"
    assert server.stream("echo", "stream:2") == [b"part0;", b"part1;", b"end"]
    with pytest.raises(grpc.RpcError):
        server.predict(missing, "x")
    with pytest.raises(grpc.RpcError):
        server.describe(missing)
    server.inference.Ping(empty_pb2.Empty(), timeout=10)
    replies = list(server.inference.StreamPredictions2(
        iter([inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"x"})]), timeout=10))
    assert replies[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # in-band, the RPC is OK
    # an error status may reach the client just before its line is written
    wait_for(lambda: any(r[0] == "StreamPredictions2" for r in access(new_lines(server, since))))
    rows = access(new_lines(server, since))
    by_call = [(method, model, version, status, reason, messages) for method, model, version, status, reason, _,
               messages, _, _ in rows if method != "DescribeModel" or model == missing]
    assert by_call == [
        ("Predictions", "echo", "1.0", "OK", "-", "1"),
        ("StreamPredictions", "echo", "1.0", "OK", "-", "3"),  # the version that served it, named or not
        ("Predictions", missing, "-", "NOT_FOUND", "MODEL_NOT_FOUND", "0"),
        ("DescribeModel", missing, "-", "NOT_FOUND", "MODEL_NOT_FOUND", "0"),
        ("Ping", "-", "-", "OK", "-", "1"),
        ("StreamPredictions2", "-", "-", "OK", "-", "1"),
    ]
    assert all(float(r[5]) >= 0 and r[7].startswith("ipv4:127.0.0.1:") for r in rows)
    ids = [r[8] for r in rows]  # one made id per call (none sent one)
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in ids) and len(set(ids)) == len(ids)


def test_cancelled_stream_is_logged_cancelled(server):
    since = len(server.log())
    call = server.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:200:0.05"}), timeout=30)
    assert next(call).prediction == b"part0;"
    call.cancel()
    wait_for(lambda: any(r[0] == "StreamPredictions" and r[3] == "CANCELLED"
                         for r in access(new_lines(server, since))))
    row = next(r for r in access(new_lines(server, since)) if r[3] == "CANCELLED")
    assert row[4] == "CANCELLED" and int(row[6]) >= 1
    server.wait_workers("echo", 2)


@pytest.fixture(scope="module")
def json_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("jsonlog"), store,
                        ["--models", "echo=echo.mar", "--workers-per-model", "1", "--log-format", "json"])
    try:
        srv.wait_workers("echo", 1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def test_json_format_access_and_worker_lines(json_server):
    assert json_server.predict("echo", "hi") == b"hi"
    with pytest.raises(grpc.RpcError) as err:
        json_server.predict("echo", "boom")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    wait_for(lambda: '"status": "INTERNAL"' in json_server.log())  # written just after the status is sent
    records = [json.loads(line) for line in json_server.log().splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    rows = [r for r in records if r["logger"] == "inference_service.access" and r["method"] == "Predictions"]
    ok, failed = rows[-2:]
    assert ok["level"] == "INFO" and ok["model"] == "echo" and ok["version"] == "1.0" and ok["status"] == "OK"
    assert ok["code"] == 0 and ok["messages"] == 1 and ok["reason"] == "-" and isinstance(ok["latency_ms"], float)
    assert ok["peer"].startswith("ipv4:127.0.0.1:") and ok["message"].startswith("Predictions model=echo ")
    assert failed["status"] == "INTERNAL" and failed["code"] == 13 and failed["reason"] == "HANDLER_ERROR"
    worker = [r for r in records if r["logger"] == "inference_service.worker.echo"]
    failure = next(r for r in worker if "handler failed on requests" in r["message"])
    assert failure["level"] == "ERROR" and failure["model"] == "echo" and failure["model_version"] == "1.0"
    assert isinstance(failure["worker_id"], int) and isinstance(failure["worker_pid"], int)
    assert failure["message"].startswith(f"[echo worker-{failure['worker_id']} pid {failure['worker_pid']}]")
    trace = [r for r in worker if "boom: the handler failed" in r["message"]]
    assert trace and all(r["level"] == "ERROR" for r in trace)  # traceback lines keep the error's level


def test_switches_access_log_off_and_level_warning(store, tmp_path):
    quiet = ServerProcess(tmp_path / "quiet", store, ["--log-level", "WARNING"])
    try:
        with pytest.raises(grpc.RpcError):
            quiet.describe("nope")
        wait_for(lambda: "DescribeModel model=nope" in quiet.log())
        assert "inference API listening" not in quiet.log()  # INFO of other loggers is filtered
    finally:
        assert quiet.stop() == 0, quiet.log()
    off = ServerProcess(tmp_path / "off", store, ["--no-access-log"])
    try:
        off.inference.Ping(empty_pb2.Empty(), timeout=10)
        with pytest.raises(grpc.RpcError):
            off.management.DescribeModel(management_pb2.DescribeModelRequest(model_name="nope"), timeout=10)
        assert "inference API listening" in off.log() and "inference_service.access" not in off.log()
    finally:
        assert off.stop() == 0, off.log()


HTTP_LINE = re.compile(r"^\S+ \S+ INFO inference_service\.access: ([A-Z]+) (\S+) model=(\S+) version=(\S+) "
                       r"status=(\d+) reason=(\S+) latency_ms=(\d+(?:\.\d+)?) messages=(\d+) "
                       r"peer=(ipv4:127\.0\.0\.1:\d+) request_id=(\S+)$")


def _http(port: int, method: str, path: str, key: str | None, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_http_line_per_request_on_every_front_door(server):
    """8080 (TorchServe's API, /v1, /v2), 8081 and the metrics port: one line per request, in the
    gRPC line's format, with the HTTP status, its name for errors, and the chunks a stream wrote."""
    since = len(server.log())
    inference, management, metrics = (server.status[k] for k in ("http_port", "http_management_port",
                                                                   "metrics_port"))
    ikey, mkey = read_key(server.key_file, "inference"), read_key(server.key_file, "management")
    sent = [
        (inference, "GET", "/ping", ikey, None, 200),
        (inference, "POST", "/predictions/echo", ikey, b"hi", 200),
        (inference, "POST", "/predictions/echo/1.0", ikey, b"stream:3", 200),
        (inference, "POST", "/predictions/nope-http", ikey, b"x", 404),
        (inference, "POST", "/predictions/echo", None, b"x", 401),
        (inference, "GET", "/v2/health/ready", ikey, None, 200),
        (inference, "GET", "/v2/models/echo", ikey, None, 200),
        (inference, "GET", "/v1/models", ikey, None, 200),
        (inference, "GET", "/no/such/path", ikey, None, 404),
        (management, "GET", "/models?limit=5", mkey, None, 200),
        (management, "GET", "/models/echo", mkey, None, 200),
        (management, "GET", "/models/nope-http", mkey, None, 404),
        (metrics, "GET", "/metrics", None, None, 200),
        (metrics, "GET", "/elsewhere", None, None, 404),
    ]
    for port, method, path, key, body, status in sent:
        assert _http(port, method, path, key, body) == status, (port, method, path)
    wait_for(lambda: sum(1 for line in new_lines(server, since) if HTTP_LINE.match(line)) >= len(sent),
             what="an access line per HTTP request")
    rows = [m.groups() for line in new_lines(server, since) if (m := HTTP_LINE.match(line))]
    got = {(method, path): (model, version, status, reason, messages) for method, path, model, version, status,
           reason, _, messages, _, _ in rows}
    assert got[("GET", "/ping")] == ("-", "-", "200", "-", "1")
    assert got[("POST", "/predictions/echo/1.0")] == ("echo", "1.0", "200", "-", "4")  # 3 parts, then the end
    assert got[("POST", "/predictions/nope-http")] == ("nope-http", "-", "404", "NOT_FOUND", "0")
    assert got[("GET", "/v2/models/echo")] == ("echo", "-", "200", "-", "1")
    assert got[("GET", "/no/such/path")][2:4] == ("404", "NOT_FOUND")
    assert got[("GET", "/models")] == ("-", "-", "200", "-", "1")  # the path without its query
    assert got[("GET", "/models/nope-http")] == ("nope-http", "-", "404", "NOT_FOUND", "0")
    assert got[("GET", "/metrics")] == ("-", "-", "200", "-", "1")
    assert got[("GET", "/elsewhere")] == ("-", "-", "404", "NOT_FOUND", "0")
    # the version that served a request, whether or not it named one; none for a refused one
    assert [(r[0], r[1], r[3], r[4]) for r in rows if r[1] == "/predictions/echo"] == [
        ("POST", "/predictions/echo", "1.0", "200"), ("POST", "/predictions/echo", "-", "401")]
    assert ("GET", "/v1/models") in got and ("GET", "/v2/health/ready") in got and ("GET", "/models/echo") in got
    assert all(float(r[6]) >= 0 for r in rows)


def test_http_lines_in_json(json_server):
    port, key = json_server.status["http_port"], read_key(json_server.key_file, "inference")
    assert _http(port, "POST", "/predictions/echo", key, b"hi") == 200
    assert _http(port, "POST", "/predictions/missing", key, b"x") == 404
    wait_for(lambda: '"method": "POST /predictions/missing"' in json_server.log(), what="the JSON access line")
    records = [json.loads(line) for line in json_server.log().splitlines() if line.strip()]
    rows = [r for r in records if r["logger"] == "inference_service.access" and r["method"].startswith("POST ")]
    ok, missing = rows[-2:]
    assert {k: ok[k] for k in ("method", "model", "version", "status", "code", "reason", "messages")} == {
        "method": "POST /predictions/echo", "model": "echo", "version": "1.0", "status": "200", "code": 200,
        "reason": "-", "messages": 1}
    assert isinstance(ok["latency_ms"], float) and ok["peer"].startswith("ipv4:127.0.0.1:")
    assert ok["message"].startswith("POST /predictions/echo model=echo ")
    assert (missing["status"], missing["code"], missing["reason"], missing["messages"]) == ("404", 404, "NOT_FOUND", 0)
    grpc_row = [r for r in records if r["logger"] == "inference_service.access" and r["method"] == "Predictions"]
    assert set(grpc_row[-1]) == set(ok)  # the same fields for both front doors
