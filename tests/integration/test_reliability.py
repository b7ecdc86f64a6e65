"""Reliability: worker crashes, cancellation reaching the handler, timeouts, overload, shutdown."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerProcess, build_dir, build_mar, wait_for
from inference_service._proto import inference_pb2


@pytest.fixture(scope="module")
def rel_store(store: Path) -> Path:
    build_mar(store, "steps", "steps_handler.py")
    build_mar(store, "gensteps", "gen_steps_handler.py")
    (store / "slow-load.yaml").write_text("load_delay: 30\n")
    build_mar(store, "slowload", "slow_handler.py", config=str(store / "slow-load.yaml"))
    build_dir(store, "tiny_queue", "echo_handler.py", model_name="tiny_queue",
              config_yaml="jobQueueSize: 2\nminWorkers: 1\nmaxWorkers: 1\n")
    return store


@pytest.fixture(scope="module")
def rsrv(rel_store: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(tmp_path_factory.mktemp("rel"), rel_store,
                        ["--enable-model-api", "--models", "echo=echo.mar", "--workers-per-model", "2",
                         "--max-backoff", "4"])
    try:
        srv.wait_workers("echo", 2)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _status(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value.code(), err.value.details()


def _steps_request(model: str, log: Path, steps: int = 200, delay: float = 0.2, swallow: bool = False):
    body = json.dumps({"steps": steps, "delay": delay, "log": str(log), "swallow": swallow}).encode()
    return inference_pb2.PredictionsRequest(model_name=model, input={"data": body})


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------- worker crash
def test_worker_sigkill_mid_stream_fails_fast_and_restarts(rsrv, tmp_path):
    rsrv.register("steps.mar", model_name="victim", initial_workers=1)
    pid = rsrv.describe("victim")[0]["workers"][0]["pid"]
    other = ThreadPoolExecutor(1).submit(rsrv.predict, "echo", "sleep:1.5")  # another model, busy
    call = rsrv.inference.StreamPredictions(_steps_request("victim", tmp_path / "log"), timeout=30)
    next(call)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert time.monotonic() - killed_at < 10  # at once, not after response_timeout (120 s)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "victim" in err.value.details() and "died" in err.value.details()
    assert other.result(10) == b"slept"  # other models are untouched
    rsrv.wait_workers("victim", 1)
    worker = rsrv.describe("victim")[0]["workers"][0]
    assert worker["restarts"] == 1 and worker["pid"] != pid
    req = _steps_request("victim", tmp_path / "log2", steps=1, delay=0)
    assert rsrv.inference.Predictions(req, timeout=10).prediction.endswith(str(worker["pid"]).encode())
    rsrv.unregister("victim")


def test_worker_exit_inside_handler_leaves_other_worker_serving(rsrv):
    before = {w["pid"] for w in rsrv.describe("echo")[0]["workers"]}
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(rsrv.predict, "echo", "sleep:3")
        rsrv.wait_busy("echo", 1)  # the slow request took one worker
        code, details = _status(rsrv.predict, "echo", "exit")
        assert code == grpc.StatusCode.UNAVAILABLE and "died" in details
        assert slow.result(10) == b"slept"
    workers = rsrv.wait_workers("echo", 2)
    assert len(before & {w["pid"] for w in workers}) == 1
    assert sum(w["restarts"] for w in workers) == 1


def test_crash_on_every_load_backs_off_without_spinning(rsrv):
    server_proc = psutil.Process(rsrv.proc.pid)

    def cpu() -> float:
        total = sum(server_proc.cpu_times()[:2])
        for child in server_proc.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total + sum(server_proc.cpu_times()[2:4])

    rsrv.register("broken.mar", initial_workers=1, synchronous=False)
    start_cpu, start = cpu(), time.monotonic()
    # the third restart comes after back-offs of 0 s, 1 s and 2 s (x0.9..1.1), so >= 2.7 s
    worker = rsrv.wait_described("broken", lambda d: d["workers"][0]["restarts"] >= 3, 60,
                                 "three restarts of the broken worker")["workers"][0]
    elapsed, used = time.monotonic() - start, cpu() - start_cpu
    assert elapsed >= 2.5, elapsed  # restarts spaced by the back-off, not spinning
    assert worker["restarts"] <= 4, worker
    assert used < 0.5 * elapsed * (os.cpu_count() or 1), used
    health = health_pb2_grpc.HealthStub(rsrv.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="model/broken"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert "weights are corrupt (test)" in rsrv.log()
    rsrv.unregister("broken")


# ---------------------------------------------------------------- cancellation
@pytest.mark.parametrize("model,swallow", [("steps", False), ("steps", True), ("gensteps", False)])
def test_cancel_stops_the_handler_within_one_step(rsrv, tmp_path, model, swallow):
    rsrv.register(f"{model}.mar", model_name=f"c_{model}", initial_workers=1)
    name = f"c_{model}"
    pid = rsrv.describe(name)[0]["workers"][0]["pid"]
    log = tmp_path / "steps.log"
    call = rsrv.inference.StreamPredictions(_steps_request(name, log, swallow=swallow), timeout=60)
    received = 0
    for _ in call:
        received += 1
        if received == 4:
            call.cancel()
            break
    # the next request is served by the same worker, at once (not after the 40 s the stream had left)
    start = time.monotonic()
    out = rsrv.inference.Predictions(_steps_request(name, tmp_path / "next.log", steps=1, delay=0), timeout=20)
    assert time.monotonic() - start < 10
    assert out.prediction.endswith(str(pid).encode())
    steps_after_cancel = _lines(log) - received
    assert steps_after_cancel <= 1, steps_after_cancel
    worker = rsrv.describe(name)[0]["workers"][0]
    assert worker["pid"] == pid and worker["restarts"] == 0
    rsrv.unregister(name)


def test_deadline_stops_the_handler(rsrv, tmp_path):
    rsrv.register("steps.mar", model_name="dl", initial_workers=1)
    log = tmp_path / "dl.log"
    code, _ = _status(lambda: list(rsrv.inference.StreamPredictions(_steps_request("dl", log), timeout=1.0)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    out = rsrv.inference.Predictions(_steps_request("dl", tmp_path / "n.log", steps=1, delay=0), timeout=10)
    assert out.prediction
    assert _lines(log) <= 1.0 / 0.2 + 2  # stopped right after the deadline
    rsrv.unregister("dl")


def test_queued_request_whose_client_left_is_not_run(rsrv, tmp_path):
    rsrv.register("echo.mar", model_name="single", initial_workers=1)
    marker = tmp_path / "ran"
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(rsrv.predict, "single", "sleep:3")
        rsrv.wait_busy("single", 1)
        code, _ = _status(rsrv.predict, "single", f"touch:{marker}", timeout=0.3)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert busy.result(10) == b"slept"
    assert rsrv.predict("single", "after") == b"after"
    assert not marker.exists()
    rsrv.unregister("single")


# ---------------------------------------------------------------- timeouts
def test_response_timeout_replaces_the_worker(rsrv):
    rsrv.register("echo.mar", model_name="rt", initial_workers=1, response_timeout=1)
    pid = rsrv.describe("rt")[0]["workers"][0]["pid"]
    start = time.monotonic()
    code, details = _status(rsrv.predict, "rt", "sleep:30")
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "response_timeout=1" in details
    assert time.monotonic() - start < 15  # the timeout, not the handler's 30 s
    # a stream that makes progress is never cut, though it runs past response_timeout
    messages = rsrv.stream("rt", "stream:5:0.6")
    assert len(messages) == 6
    worker = rsrv.describe("rt")[0]["workers"][0]
    assert worker["pid"] != pid and worker["restarts"] == 1
    rsrv.unregister("rt")


def test_startup_timeout_bounds_loading(rsrv):
    start = time.monotonic()
    code, details = _status(rsrv.register, "slowload.mar", startup_timeout=1)
    assert code == grpc.StatusCode.INTERNAL and "startup_timeout=1" in details
    assert time.monotonic() - start < 15  # the timeout, not the handler's 30 s load


# ---------------------------------------------------------------- overload
def test_full_job_queue_is_resource_exhausted_and_health_stays_fast(rsrv):
    rsrv.register("tiny_queue", initial_workers=1)
    results: list[object] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(rsrv.predict, "tiny_queue", "sleep:4")]
        rsrv.wait_busy("tiny_queue", 1)
        futures += [pool.submit(rsrv.predict, "tiny_queue", "sleep:0.1") for _ in range(2)]
        rsrv.wait_busy("tiny_queue", 1, pending=2)  # the queue of 2 is full
        start = time.monotonic()
        code, details = _status(rsrv.predict, "tiny_queue", "x")
        assert time.monotonic() - start < 2  # refused at once, not after the queue drained
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "job_queue_size" in details
        # while saturated, Ping and health answer quickly
        health = health_pb2_grpc.HealthStub(rsrv.channel)
        latencies = []
        for _ in range(30):
            t = time.monotonic()
            rsrv.inference.Ping(empty_pb2.Empty(), timeout=5)
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            latencies.append(time.monotonic() - t)
        assert max(latencies) < 2, max(latencies)
        results = [f.result(10) for f in futures]
    assert results == [b"slept", b"slept", b"slept"]
    rsrv.unregister("tiny_queue")


# ---------------------------------------------------------------- shutdown
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_drains_in_flight_streams(rel_store, tmp_path, sig):
    srv = ServerProcess(tmp_path, rel_store, ["--models", "echo=echo.mar", "--workers-per-model", "1",
                                              "--drain-timeout", "20"])
    srv.wait_workers("echo", 1)
    workers = srv.worker_pids()
    call = srv.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:6:0.25"}), timeout=30)
    messages = [next(call).prediction]
    srv.proc.send_signal(sig)
    health = health_pb2_grpc.HealthStub(srv.channel)
    wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
             == health_pb2.HealthCheckResponse.NOT_SERVING, 10, 0.02, "liveness NOT_SERVING")
    code, details = _status(srv.predict, "echo", "new work")
    assert code == grpc.StatusCode.UNAVAILABLE
    messages += [r.prediction for r in call]
    assert messages == [f"part{i};".encode() for i in range(6)] + [b"end"]
    assert srv.proc.wait(30) == 0
    assert srv.stop() == 0  # asserts no worker process outlived the server
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in workers)


# ---------------------------------------------------------------- size limits
def test_message_size_limits(rel_store, tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("max_request_size=1000\nmax_response_size=1000\n")
    srv = ServerProcess(tmp_path / "w", rel_store, ["--ts-config", str(config), "--models", "echo=echo.mar",
                                                    "--workers-per-model", "1"])
    try:
        srv.wait_workers("echo", 1)
        code, details = _status(srv.predict, "echo", "x" * 1500)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_request_size=1000" in details
        code, details = _status(srv.predict, "echo", "y" * 5000)  # beyond gRPC's own limit
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert srv.predict("echo", "repeat:900") == b"x" * 900
        code, details = _status(srv.predict, "echo", "repeat:1500")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_response_size=1000" in details
        assert srv.predict("echo", "fine") == b"fine"
    finally:
        assert srv.stop() == 0


def test_tensor_result_is_json_not_pickle(rsrv):
    assert json.loads(rsrv.predict("echo", "tensor")) == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_worker_killed_while_idle_is_replaced_before_the_next_request(rsrv):
    rsrv.register("echo.mar", model_name="idle", initial_workers=1)
    pid = rsrv.describe("idle")[0]["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    rsrv.wait_described("idle", lambda d: d["workers"][0]["pid"] not in (pid, -1), what="a new worker process")
    start = time.monotonic()
    assert rsrv.predict("idle", "fresh worker") == b"fresh worker"
    assert time.monotonic() - start < 10
    assert rsrv.describe("idle")[0]["workers"][0]["restarts"] == 1
    rsrv.unregister("idle")
