"""Config snapshots: models, versions, defaults, workers and batch settings survive restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import ServerProcess
from inference_service._proto import management_pb2


def _start(workdir: Path, store: Path, *extra: str) -> ServerProcess:
    srv = ServerProcess.__new__(ServerProcess)
    # like ServerProcess, but without --ncs: snapshots on
    srv.workdir, srv.store = workdir, store
    workdir.mkdir(parents=True, exist_ok=True)
    srv.log_path = workdir / "server.log"
    srv._log = open(srv.log_path, "ab")
    srv.proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground",
                                 "--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
                                 "--http-management-port", "0", "--metrics-port", "0", "--model-store", str(store),
                                 "--enable-model-api", *extra],
                                cwd=workdir, stdout=srv._log, stderr=subprocess.STDOUT)
    ServerProcess._connect(srv)
    return srv


def _wait_model(srv: ServerProcess, name: str, versions: int, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            desc = srv.describe(name, "all")
            if len(desc) == versions and all(
                    len([w for w in d["workers"] if w["status"] == "READY"]) == d["minWorkers"] for d in desc):
                return desc
        except Exception:  # noqa: BLE001 - not restored yet
            pass
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.1)


def test_state_survives_kill_9(store, tmp_path):
    work = tmp_path / "work"
    srv = _start(work, store)
    srv.register("echo.mar", model_name="snap", batch_size=3, max_batch_delay=40)
    srv.register("echo_v2.mar", model_name="snap")
    srv.management.SetDefault(management_pb2.SetDefaultRequest(model_name="snap", model_version="2.0"), timeout=10)
    srv.scale("snap", 2, version="2.0")
    workers = srv.worker_pids()
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    srv._log.close()
    deadline = time.monotonic() + 10  # orphaned workers exit when their channel closes
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
        assert time.monotonic() < deadline, "workers outlived a killed server"
        time.sleep(0.05)
    snapshots = sorted((work / "logs" / "config").glob("*-snapshot.cfg"))
    assert snapshots

    again = _start(work, store)
    try:
        desc = {d["modelVersion"]: d for d in _wait_model(again, "snap", 2)}
        assert desc["1.0"]["batchSize"] == 3 and desc["1.0"]["maxBatchDelay"] == 40
        assert desc["2.0"]["minWorkers"] == 2 and len(desc["2.0"]["workers"]) == 2
        assert again.describe("snap")[0]["modelVersion"] == "2.0"
        assert again.predict("snap", "restored") == b"restored"
        assert "restoring 2 model versions" in again.log()
    finally:
        assert again.stop() == 0


def test_corrupt_snapshot_is_set_aside(store, tmp_path):
    work = tmp_path / "work"
    config_dir = work / "logs" / "config"
    config_dir.mkdir(parents=True)
    bad = config_dir / "20990101000000000000-snapshot.cfg"
    bad.write_text("model_snapshot={not json\n")
    srv = _start(work, store)
    try:
        log = srv.log()
        assert str(bad) in log and "unreadable" in log
        assert not bad.exists() and (config_dir / (bad.name + ".corrupt")).exists()
        srv.register("echo.mar", model_name="fresh")
        assert srv.predict("fresh", "ok") == b"ok"
    finally:
        assert srv.stop() == 0


def test_models_flag_skips_snapshot_with_warning(store, tmp_path):
    work = tmp_path / "work"
    first = _start(work, store)
    first.register("echo.mar", model_name="old")
    assert first.stop() == 0
    second = _start(work, store, "--models", "echo=echo.mar", "--workers-per-model", "1")
    try:
        second.wait_workers("echo", 1)
        assert "not restored because --models was given" in second.log()
        names = [m for m in second.management.ListModels(management_pb2.ListModelsRequest(), timeout=5).msg.split('"')
                 if m in ("old", "echo")]
        assert "old" not in names and "echo" in names
    finally:
        assert second.stop() == 0
