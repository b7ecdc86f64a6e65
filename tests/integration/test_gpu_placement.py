"""GPU placement: round-robin gpu ids per worker, degrading to the CPU where there is no GPU."""

from __future__ import annotations

import json
import time

import pytest

from conftest import ServerProcess, build_dir, build_mar


@pytest.fixture(scope="module")
def gpu_server(store, tmp_path_factory):
    build_mar(store, "device", "device_handler.py")
    build_dir(store, "device_cpu", "device_handler.py", model_name="device_cpu", config_yaml="deviceType: cpu\n")
    work = tmp_path_factory.mktemp("gpu")
    config = work / "config.properties"
    config.write_text("number_of_gpu=2\n")  # pretend the machine has two GPUs
    srv = ServerProcess(work / "w", store, ["--ts-config", str(config), "--enable-model-api"])
    yield srv
    assert srv.stop() == 0


def _reports(srv: ServerProcess, name: str, workers: int) -> dict[int, dict]:
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + 30
    while len(seen) < workers:  # requests spread over the workers
        report = json.loads(srv.predict(name, "where"))
        seen[report["pid"]] = report
        assert time.monotonic() < deadline
    return seen


def test_round_robin_gpu_ids_and_cpu_fallback(gpu_server):
    gpu_server.register("device.mar", initial_workers=3)
    workers = gpu_server.describe("device")[0]["workers"]
    assert [w["gpu"] for w in workers] == [True, True, True]
    reports = _reports(gpu_server, "device", 3)
    assert sorted(r["gpu_id"] for r in reports.values()) == [0, 0, 1]
    # no GPU here: BaseHandler places the model on the CPU instead of failing
    assert {r["device"] for r in reports.values()} == {"cpu"}
    gpu_server.unregister("device")


def test_number_gpu_limits_gpu_workers(gpu_server):
    gpu_server.register("device.mar", initial_workers=0)
    from inference_service._proto import management_pb2

    gpu_server.management.ScaleWorker(management_pb2.ScaleWorkerRequest(
        model_name="device", min_worker=3, max_worker=3, number_gpu=1, synchronous=True), timeout=60)
    workers = gpu_server.describe("device")[0]["workers"]
    assert sorted(w["gpu"] for w in workers) == [False, False, True]
    reports = _reports(gpu_server, "device", 3)
    cpu_workers = [r for r in reports.values() if r["gpu_id"] is None]
    assert len(cpu_workers) == 2 and all(r["cuda_visible"] == "" for r in cpu_workers)
    gpu_server.unregister("device")


def test_device_type_cpu_keeps_workers_off_gpus(gpu_server):
    gpu_server.register("device_cpu", initial_workers=1)
    assert gpu_server.describe("device_cpu")[0]["workers"][0]["gpu"] is False
    assert json.loads(gpu_server.predict("device_cpu", "where"))["gpu_id"] is None
    gpu_server.unregister("device_cpu")
