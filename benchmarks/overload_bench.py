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
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
from common import ROOT, percentile, start_project, wait_model_serving  # noqa: E402
from google.protobuf import empty_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

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
    server = start_project("overload", work / "store", work, ["busy"], startup_s=60)
    try:
        wait_model_serving(server.inference_port, "busy", 60)
        port = server.inference_port
        auth = server.metadata  # token authorization is on
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="model/busy")
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
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {"scenario": "health_under_overload", "samples": args.samples,
              "ping_p50_ms": percentile(ping_ms, 50, 2), "ping_p99_ms": percentile(ping_ms, 99, 2),
              "check_p50_ms": percentile(check_ms, 50, 2), "check_p99_ms": percentile(check_ms, 99, 2),
              "load_outcomes": outcomes}
    print(f"while saturated ({outcomes}): Ping p50 {result['ping_p50_ms']} ms, p99 {result['ping_p99_ms']} ms; "
          f"health Check p50 {result['check_p50_ms']} ms, p99 {result['check_p99_ms']} ms (this machine)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
