"""Sleep and wake: an idle model's workers stop after ``idleTimeoutSec`` and the next request
wakes it and waits; vLLM's ``/sleep``, ``/wake_up`` and ``/is_sleeping``; health while asleep; a
failed wake; and what each model's workers cost (memory, threads) on DescribeModel and /metrics."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerProcess, _alive, build_mar, read_key, wait_for


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("sleep_wake")
    config = work / "sleepy.yaml"
    config.write_text("idleTimeoutSec: 1\nminWorkers: 1\nmaxWorkers: 1\n")
    build_mar(store, "sleepy", "echo_handler.py", config=str(config))
    server = ServerProcess(work, store, ["--enable-model-api", "--workers-per-model", "1",
                                         "--models", "sleepy=sleepy.mar", "echo=echo.mar"])
    try:
        server.wait_workers("echo", 1, timeout=60)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def http(srv: ServerProcess, method: str, path: str, scope: str | None = "management",
         port: str = "http_port", body: bytes | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {read_key(srv.key_file, scope)}"} if scope else {}
    request = urllib.request.Request(f"http://127.0.0.1:{srv.status[port]}{path}", data=body, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode()


def metric(srv: ServerProcess, family: str, model: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics", timeout=10).read().decode()
    wanted = {"model_name": model, **labels}
    for line in text.splitlines():
        match = re.match(rf"{family}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in wanted.items()):
            return float(match.group(2))
    raise AssertionError(f"no {family} sample for {wanted}")


def health(srv: ServerProcess, service: str) -> int:
    return health_pb2_grpc.HealthStub(srv.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_idle_model_sleeps_then_the_next_request_wakes_it(srv: ServerProcess):
    pid = int(srv.predict("sleepy", "pid", timeout=60))
    desc = srv.describe("sleepy")[0]
    assert desc["idleTimeoutSec"] == 1.0 and desc["wakes"] == 0
    srv.wait_described("sleepy", lambda d: d["state"] == "SLEEPING" and not d["workers"], timeout=30,
                       what="sleepy asleep after its idle timeout")
    wait_for(lambda: not _alive(pid), timeout=10, what=f"worker {pid} gone")
    assert re.search(r"model sleepy version 1\.0 sleeps \(idle for [\d.]+ s \(idleTimeoutSec=1\)\): 1 worker",
                     srv.log())
    assert metric(srv, "inference_service_model_state", "sleepy", state="SLEEPING") == 1.0
    assert metric(srv, "inference_service_model_state", "sleepy", state="READY") == 0.0
    assert metric(srv, "inference_service_worker_memory_bytes", "sleepy") == 0.0
    # asleep is ready to take requests: health and KServe readiness say so; the server stays healthy
    assert health(srv, "model/sleepy") == health_pb2.HealthCheckResponse.SERVING
    assert http(srv, "GET", "/v2/models/sleepy/ready", "inference")[0] == 200
    assert http(srv, "GET", "/ping", "inference")[1]["status"] == "Healthy"

    started = time.monotonic()
    new_pid = int(srv.predict("sleepy", "pid", timeout=60))  # waits for the wake
    waited = time.monotonic() - started
    assert new_pid != pid and _alive(new_pid)
    woke = re.search(r"model sleepy version 1\.0 woke in ([\d.]+) s \(1 worker\(s\) starting, 1 request\(s\) waited\)",
                     srv.log())
    assert woke, srv.log()[-3000:]
    took = float(woke.group(1))
    assert 0 < took <= waited
    print(f"wake took {took:.3f} s; the request waited {waited:.3f} s")
    desc = srv.describe("sleepy")[0]
    assert desc["state"] == "READY" and desc["wakes"] == 1 and desc["wakeSeconds"] == pytest.approx(took, abs=2e-3)
    assert metric(srv, "inference_service_model_wakes_total", "sleepy") == 1.0
    assert metric(srv, "inference_service_model_wake_seconds_total", "sleepy") == pytest.approx(took, abs=2e-3)
    assert metric(srv, "inference_service_model_woken_requests_total", "sleepy") == 1.0


def test_workers_cost_on_describe_and_metrics(srv: ServerProcess):
    worker = srv.describe("echo")[0]["workers"][0]
    assert worker["threads"] >= 1 and worker["treeMemoryUsage"] >= worker["memoryUsage"] > 10 * 2**20
    assert metric(srv, "inference_service_worker_memory_bytes", "echo", model_version="1.0") > 10 * 2**20
    assert metric(srv, "inference_service_worker_threads", "echo", model_version="1.0") >= 1


def test_sleep_routes_need_the_management_key_and_name_the_model(srv: ServerProcess):
    assert http(srv, "GET", "/is_sleeping", "inference")[0] == 401
    assert http(srv, "POST", "/sleep?model=echo", None)[0] == 401
    status, body = http(srv, "POST", "/sleep")
    assert status == 400 and "model is required" in body["message"]
    assert http(srv, "POST", "/sleep?model=nope")[0] == 404
    assert http(srv, "GET", "/is_sleeping?model=echo&version=9.9")[0] == 404

    status, body = http(srv, "POST", "/sleep?model=echo&level=1")
    assert (status, body["state"], body["is_sleeping"]) == (200, "SLEEPING", True)
    assert srv.describe("echo")[0]["workers"] == []
    assert http(srv, "GET", "/is_sleeping?model=echo", port="http_management_port")[1]["is_sleeping"] is True
    assert http(srv, "POST", "/sleep?model=echo")[1]["state"] == "SLEEPING"  # asleep already: nothing to do

    # a request whose deadline passes while the model wakes fails alone; the wake it started goes on
    with pytest.raises(grpc.RpcError) as err:
        srv.predict("echo", "hi", timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    srv.wait_described("echo", lambda d: d["state"] == "READY" and d["workers"][0]["status"] == "READY",
                       timeout=60, what="echo awake after the expired request's wake")

    assert http(srv, "POST", "/sleep?model=echo", port="http_management_port")[1]["state"] == "SLEEPING"
    status, body = http(srv, "POST", "/wake_up?model=echo")
    assert (status, body["state"], body["is_sleeping"]) == (200, "READY", False)
    assert srv.describe("echo")[0]["workers"][0]["status"] == "READY"
    assert srv.predict("echo", "hi") == b"hi"


def test_idle_timeout_set_through_the_management_api(srv: ServerProcess):
    status, text = http(srv, "PUT", "/models/echo?idle_timeout=abc", port="http_management_port")
    assert status == 400 and "idle_timeout" in text["message"]
    assert http(srv, "PUT", "/models/echo?idle_timeout=-1", port="http_management_port")[0] == 400
    status, text = http(srv, "PUT", "/models/echo?idle_timeout=0.5", port="http_management_port")
    assert (status, text["status"]) == (200, "Idle timeout set to 0.5 s for model: echo")
    try:
        srv.wait_described("echo", lambda d: d["state"] == "SLEEPING" and d["idleTimeoutSec"] == 0.5,
                           timeout=30, what="echo asleep after idle_timeout=0.5")
    finally:
        http(srv, "PUT", "/models/echo?idle_timeout=0", port="http_management_port")
    assert srv.predict("echo", "back", timeout=60) == b"back"
    assert srv.describe("echo")[0]["state"] == "READY"


def test_failed_wake_answers_the_waiting_request_with_the_load_error(srv: ServerProcess, store: Path,
                                                                     tmp_path: Path):
    flag = tmp_path / "broken-now"
    config = tmp_path / "flaky.yaml"
    config.write_text(f"maxRetryTimeoutInSec: 600\nhandler:\n  fail_while: {flag}\n")
    build_mar(store, "flaky", "flaky_load_handler.py", config=str(config))
    srv.register("flaky.mar")
    try:
        assert http(srv, "POST", "/sleep?model=flaky")[1]["state"] == "SLEEPING"
        flag.write_text("")
        with pytest.raises(grpc.RpcError) as err:
            srv.predict("flaky", "hello", timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed to wake" in err.value.details() or "cannot start a worker" in err.value.details()
        assert "cannot load while" in err.value.details()
        desc = srv.wait_described("flaky", lambda d: d["state"] == "SLEEPING" and not d["workers"], timeout=30,
                                  what="flaky back asleep after its failed wake")
        assert "cannot load while" in desc["wakeError"] and desc["wakes"] == 1
        assert re.search(r"model flaky version 1\.0 failed to wake after [\d.]+ s", srv.log())
        # a model that cannot wake is not ready (a probe takes it out), and /wake_up says why
        assert health(srv, "model/flaky") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert http(srv, "GET", "/v2/models/flaky/ready", "inference")[0] != 200
        status, body = http(srv, "POST", "/wake_up?model=flaky")
        assert status == 503 and "cannot load while" in body["message"]
        flag.unlink()
        assert srv.predict("flaky", "hello", timeout=60) == b"loaded"
        assert srv.describe("flaky")[0]["state"] == "READY" and "wakeError" not in srv.describe("flaky")[0]
        assert health(srv, "model/flaky") == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.unregister("flaky")


def test_unregister_while_asleep_or_waking(srv: ServerProcess):
    for when in ("asleep", "waking"):
        srv.register("echo.mar", model_name="nap")
        assert http(srv, "POST", "/sleep?model=nap")[1]["state"] == "SLEEPING"
        if when == "waking":  # a request that gives up at once leaves its wake running
            with pytest.raises(grpc.RpcError):
                srv.predict("nap", "hi", timeout=0.01)
            assert srv.describe("nap")[0]["state"] in ("WAKING", "READY")
        srv.unregister("nap")
        with pytest.raises(grpc.RpcError) as err:
            srv.describe("nap")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Traceback" not in srv.log() and "never retrieved" not in srv.log()
