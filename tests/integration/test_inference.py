"""Inference API against a real server with real worker processes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import empty_pb2

from conftest import ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


def test_ping_healthy(server):
    health = json.loads(server.inference.Ping(empty_pb2.Empty(), timeout=5).health)
    assert health == {"status": "Healthy", "code": 200}


def test_predictions_echo(server):
    assert server.predict("echo", "hello") == b"hello"
    assert server.predict("echo", "hello", version="1.0") == b"hello"


def test_body_key_is_passed_as_bytearray_map(server):
    req = inference_pb2.PredictionsRequest(model_name="echo", input={"body": b"from-body"})
    assert server.inference.Predictions(req, timeout=10).prediction == b"from-body"


def test_each_worker_is_its_own_process(server):
    pids = {int(server.predict("echo", "pid")) for _ in range(20)}
    described = {w["pid"] for w in server.describe("echo")[0]["workers"]}
    assert pids <= described
    assert server.proc.pid not in pids
    assert len(described) == 2 and all(p > 0 for p in described)


def test_stream_delivers_each_intermediate_before_handler_finishes(server):
    req = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:4:1.0"})
    start = time.monotonic()
    arrivals = []
    messages = []
    for response in server.inference.StreamPredictions(req, timeout=30):
        arrivals.append(time.monotonic() - start)
        messages.append(response.prediction)
    assert messages == [b"part0;", b"part1;", b"part2;", b"part3;", b"end"]
    # the handler sleeps 1 s after each send, so it runs >= 4 s; the first
    # message must arrive long before that
    assert arrivals[0] < 2.5 < arrivals[-1]


def test_predictions_on_streaming_handler_concatenates(server):
    assert server.predict("echo", "stream:3") == b"part0;part1;part2;end"
    # and the worker stays usable for the other kind of call
    assert server.stream("echo", "plain") == [b"plain"]
    assert server.stream("echo", "stream:2") == [b"part0;", b"part1;", b"end"]
    assert server.predict("echo", "after") == b"after"


def test_local_rank_not_zero_sends_no_intermediate(store, tmp_path):
    srv = ServerProcess(tmp_path, store, ["--models", "echo=echo.mar", "--workers-per-model", "1"],
                        env={"LOCAL_RANK": "1"})
    try:
        srv.wait_workers("echo", 1)
        assert srv.stream("echo", "stream:3") == [b"end"]
    finally:
        assert srv.stop() == 0


def test_handler_error_is_internal_with_message_and_worker_survives(server):
    since = len(server.log())  # the server is shared: its log before this test is not this test's
    with pytest.raises(grpc.RpcError) as err:
        server.predict("echo", "boom")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "boom: the handler failed" in err.value.details()
    assert "Traceback" not in err.value.details()
    # the worker's stderr (its traceback) and its socket (the error) are read separately
    wait_for(lambda: "Traceback" in server.log()[since:])
    assert server.predict("echo", "still alive") == b"still alive"


@pytest.mark.parametrize("status,code", [  # TorchServe 0.12's GRPCUtils.getGRPCStatusCode
    (400, grpc.StatusCode.INVALID_ARGUMENT),
    (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED),
    (404, grpc.StatusCode.NOT_FOUND),
    (409, grpc.StatusCode.ABORTED),
    (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (416, grpc.StatusCode.OUT_OF_RANGE),
    (418, grpc.StatusCode.FAILED_PRECONDITION),
    (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (499, grpc.StatusCode.CANCELLED),
    (501, grpc.StatusCode.UNIMPLEMENTED),
    (503, grpc.StatusCode.UNAVAILABLE),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (507, grpc.StatusCode.INTERNAL),
    (502, grpc.StatusCode.INTERNAL),
])
def test_handler_status_maps_like_torchserve(server, status, code):
    with pytest.raises(grpc.RpcError) as err:
        server.predict("echo", f"status:{status}")
    assert err.value.code() == code
    assert err.value.details() == "handler says no"


def test_unknown_model_and_version(server):
    with pytest.raises(grpc.RpcError) as err:
        server.predict("nope", "x")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        server.predict("echo", "x", version="9.9")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "9.9" in err.value.details()


def test_missing_model_name_is_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as err:
        server.inference.Predictions(inference_pb2.PredictionsRequest(input={"data": b"x"}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(server.inference.StreamPredictions(inference_pb2.PredictionsRequest(), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_request_metadata_reaches_handler_as_headers(server):
    req = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"headers"})
    auth = ("authorization", f"Bearer {read_key(server.key_file, 'inference')}")
    out = server.inference.Predictions(req, timeout=10, metadata=[("x-trace", "abc"), auth])
    headers = json.loads(out.prediction)
    assert headers["x-trace"] == "abc"
    assert "authorization" not in headers  # the key never reaches handler code


def test_concurrent_requests_on_two_workers_run_in_parallel(server):
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: server.predict("echo", "sleep:3"), range(2)))
    assert results == [b"slept", b"slept"]
    assert time.monotonic() - start < 5.5  # in parallel: one after the other takes 6 s


def test_stream_with_worker_dying_ends_unavailable(server):
    with pytest.raises(grpc.RpcError) as err:
        server.predict("echo", "exit")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "echo" in err.value.details() and "died" in err.value.details()
    server.wait_workers("echo", 2)
    assert server.predict("echo", "back") == b"back"
