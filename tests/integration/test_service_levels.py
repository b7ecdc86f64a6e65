"""A request's service level on the real server: ``x-request-priority`` orders the waiting requests
(lower first, then arrival) and ``x-request-timeout`` bounds its wait: still queued when it passes,
the request leaves with 504 before any work; running, it is stopped with 504."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import grpc
import pytest
from test_metrics import scrape, value

from conftest import build_mar, read_key, wait_for
from inference_service._proto import inference_pb2

CONFIG = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\n"


@pytest.fixture(scope="module")
def srv(server, store: Path):
    (store / "one.yaml").write_text(CONFIG)
    build_mar(store, "one", "echo_handler.py", config=str(store / "one.yaml"))
    server.register("one.mar")
    yield server
    server.unregister("one")


def _post(srv, body: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=60)
    try:
        conn.request("POST", "/predictions/one", body=body.encode(), headers={
            "Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": "text/plain",
            **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _queued(srv) -> int:
    """The model's waiting requests (DescribeModel's job queue)."""
    return int(srv.describe("one")[0]["jobQueueStatus"]["pendingRequests"])


def _busy(srv) -> bool:
    """Whether its one worker runs a request (DescribeModel's worker status)."""
    return srv.describe("one")[0]["workers"][0]["status"] == "BUSY"


def test_waiting_requests_are_served_by_priority_then_arrival(srv):
    done: list[str] = []
    blocker = threading.Thread(target=_post, args=(srv, "sleep:1.5"))
    blocker.start()  # holds the only worker while the others queue
    wait_for(lambda: _busy(srv), timeout=10, what="the blocker running")
    threads = []
    for name, priority in (("late", "5"), ("first", "-1"), ("plain", None), ("second", "-1")):
        headers = {"x-request-priority": priority} if priority is not None else {}
        # each runs 0.25 s, so the answers come apart in the order the worker took the requests
        thread = threading.Thread(target=lambda n=name, h=headers: done.append(
            n if _post(srv, "sleep:0.25", h) == (200, b"slept") else f"failed {n}"))
        threads.append(thread)
        thread.start()
        wait_for(lambda k=len(threads): _queued(srv) >= k, timeout=10, what=f"{len(threads)} queued")
    for thread in [blocker, *threads]:
        thread.join(30)
    assert done == ["first", "second", "plain", "late"]


def test_a_deadline_passed_in_the_queue_is_504_before_any_work(srv, tmp_path):
    marker = tmp_path / "ran"
    blocker = threading.Thread(target=_post, args=(srv, "sleep:2"))
    blocker.start()
    wait_for(lambda: _busy(srv), timeout=10, what="the blocker running")
    start = time.monotonic()
    status, body = _post(srv, f"touch:{marker}", {"x-request-timeout": "0.5"})
    elapsed = time.monotonic() - start
    assert status == 504 and "in the job queue" in json.loads(body)["message"], (status, body)
    assert elapsed < 1.5, elapsed
    blocker.join(30)
    assert _post(srv, "after") == (200, b"after")  # the worker is free: the late request never ran
    assert not marker.exists()


def test_a_running_request_past_its_deadline_is_stopped_with_504(srv):
    start = time.monotonic()
    status, body = _post(srv, "sleep:3", {"X-Request-Timeout": "0.5"})
    assert status == 504 and "ran past its deadline" in json.loads(body)["message"], (status, body)
    assert time.monotonic() - start < 2.0
    wait_for(lambda: _post(srv, "ok") == (200, b"ok"), timeout=30, what="the worker serves again")


def test_bad_service_level_headers_are_400_naming_them(srv):
    for headers, name in (({"x-request-timeout": "soon"}, "x-request-timeout"),
                          ({"x-request-timeout": "-1"}, "x-request-timeout"),
                          ({"x-request-priority": "high"}, "x-request-priority")):
        status, body = _post(srv, "hello", headers)
        assert status == 400 and name in json.loads(body)["message"], (status, body)
    # over gRPC the priority is call metadata, the deadline the call's own
    with pytest.raises(grpc.RpcError) as err:
        srv.inference.Predictions(inference_pb2.PredictionsRequest(model_name="one", input={"data": b"x"}),
                                  metadata=[("x-request-priority", "high")], timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-request-priority" in err.value.details()


def test_goodput_counts_the_streams_that_met_the_models_slos(srv, store: Path):
    (store / "slo.yaml").write_text(CONFIG + "sloTtftMSec: 1000\nsloTpotMSec: 150\n")
    build_mar(store, "slo", "echo_handler.py", config=str(store / "slo.yaml"))
    srv.register("slo.mar")
    try:
        labels = {"model_name": "slo", "model_version": "1.0"}
        for body in ("stream:3:0", "stream:3:0.4", "stream:2:0"):  # the second's messages come 0.4 s apart
            conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=60)
            conn.request("POST", "/predictions/slo", body=body.encode(), headers={
                "Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": "text/plain"})
            assert conn.getresponse().read().endswith(b"end")
            conn.close()
        counted = wait_for(lambda: (value(scrape(srv), "inference_service_slo_requests_total", **labels) == 3
                                    and scrape(srv)), timeout=10, what="3 streams counted")
        assert value(counted, "inference_service_goodput_requests_total", **labels) == 2
        # a model without SLOs exports neither counter
        assert value(counted, "inference_service_slo_requests_total", model_name="one") == 0
    finally:
        srv.unregister("slo")


@pytest.fixture(scope="module")
def cb2(srv, store: Path):
    """A continuous batch of 2 places (tests/handlers/cb_handler.py)."""
    (store / "cb2.yaml").write_text("continuousBatching: true\nbatchSize: 2\nmaxBatchDelay: 0\nminWorkers: 1\n"
                                    "maxWorkers: 1\n")
    build_mar(store, "cb2", "cb_handler.py", config=str(store / "cb2.yaml"))
    srv.register("cb2.mar")
    yield srv
    srv.unregister("cb2")


def _steps(srv, body: dict, priority: int | None, out: dict, key: str, started: list | None = None) -> None:
    """Stream ``body`` on cb2: ``out[key]`` = (seconds to the first message, the steps received);
    ``key`` joins ``started`` at the first message."""
    start = time.monotonic()
    metadata = [("x-request-priority", str(priority))] if priority is not None else []
    request = inference_pb2.PredictionsRequest(model_name="cb2", input={"data": json.dumps(body).encode()})
    first, steps = None, []
    for message in srv.inference.StreamPredictions(request, metadata=metadata, timeout=60):
        if first is None:
            first = time.monotonic() - start
            if started is not None:
                started.append(key)
        steps.append(json.loads(message.prediction)["step"])
    out[key] = (first, steps)


def _two_long_streams(srv, out: dict) -> list[threading.Thread]:
    """Two 2-second streams holding both places of cb2's worker, running when this returns."""
    started: list[str] = []
    threads = [threading.Thread(target=_steps, args=(srv, {"steps": 40, "delay": 0.05}, None, out, f"long{i}",
                                                     started)) for i in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(started) == 2, timeout=10, what="both long streams running")
    return threads


def test_an_earlier_priority_takes_the_place_of_a_running_request_which_then_finishes(cb2):
    out: dict = {}
    threads = _two_long_streams(cb2, out)
    _steps(cb2, {"steps": 3, "delay": 0.05}, -1, out, "urgent")
    for thread in threads:
        thread.join(60)
    urgent_first, urgent_steps = out["urgent"]
    assert urgent_steps == [0, 1, 2]
    assert urgent_first < 1.0, out  # not after a long stream's 2 s: one of them gave its place
    for key in ("long0", "long1"):
        assert out[key][1] == list(range(40)), (key, out[key])  # the yielded one resumed where it was
    # a request of the default priority takes no running request's place: it waits for one to end
    out.clear()
    threads = _two_long_streams(cb2, out)
    _steps(cb2, {"steps": 1, "delay": 0}, None, out, "plain")
    for thread in threads:
        thread.join(60)
    assert out["plain"][0] > 1.0, out
