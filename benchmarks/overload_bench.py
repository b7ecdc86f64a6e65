#!/usr/bin/env python3
"""Health under overload: Ping and grpc.health.v1 Check latency while a model is saturated.

Starts the server with one worker of a sleeping echo model (tests/handlers/echo_handler.py),
keeps its worker busy and its job queue full from 16 client threads, and measures
``--samples`` Ping and health Check calls meanwhile. Prints p50/p99 in ms and one JSON line
(target: p99 <= 50 ms). Figures are this machine's.

Usage: .venv/bin/python benchmarks/overload_bench.py [--samples 500]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from inference_service._proto import inference_pb2, inference_pb2_grpc  # noqa: E402


def main() -> int:
    """Run the measurement and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overload-"))
    model = work / "store" / "busy"
    (model / "MAR-INF").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "handlers" / "echo_handler.py", model)
    (model / "model-config.yaml").write_text("minWorkers: 1\nmaxWorkers: 1\njobQueueSize: 8\n")
    (model / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"runtime": "python", "model": {"modelName": "busy", "handler": "echo_handler.py", "modelVersion": "1.0",
                                        "configFile": "model-config.yaml"}}))
    proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                             "--model-store", str(work / "store"), "--models", "busy",
                             "--grpc-inference-port", "0", "--grpc-management-port", "0",
                             "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        status = work / ".inference_service" / "status.json"
        deadline = time.monotonic() + 60
        while not status.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.05)
        port = json.loads(status.read_text())["inference_port"]
        key = json.loads((work / "key_file.json").read_text())["inference"]["key"]  # token authorization is on
        auth = (("authorization", f"Bearer {key}"),)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="model/busy")
        while health.Check(check, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "model did not load"
            time.sleep(0.05)
        stop = threading.Event()
        outcomes: dict[str, int] = {}

        def load() -> None:
            request = inference_pb2.PredictionsRequest(model_name="busy", input={"data": b"sleep:0.2"})
            while not stop.is_set():
                try:
                    stub.Predictions(request, timeout=30, metadata=auth)
                    key = "OK"
                except grpc.RpcError as err:
                    key = err.code().name
                outcomes[key] = outcomes.get(key, 0) + 1

        threads = [threading.Thread(target=load, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # let the queue fill
        ping_ms, check_ms = [], []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            stub.Ping(empty_pb2.Empty(), timeout=5, metadata=auth)
            t1 = time.perf_counter()
            health.Check(check, timeout=5)
            t2 = time.perf_counter()
            ping_ms.append((t1 - t0) * 1000)
            check_ms.append((t2 - t1) * 1000)
        stop.set()
        for t in threads:
            t.join(10)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[int(q) - 1]

    result = {"scenario": "health_under_overload", "samples": args.samples,
              "ping_p50_ms": round(pct(ping_ms, 50), 2), "ping_p99_ms": round(pct(ping_ms, 99), 2),
              "check_p50_ms": round(pct(check_ms, 50), 2), "check_p99_ms": round(pct(check_ms, 99), 2),
              "load_outcomes": outcomes}
    print(f"while saturated ({outcomes}): Ping p50 {result['ping_p50_ms']} ms, p99 {result['ping_p99_ms']} ms; "
          f"health Check p50 {result['check_p50_ms']} ms, p99 {result['check_p99_ms']} ms (this machine)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
