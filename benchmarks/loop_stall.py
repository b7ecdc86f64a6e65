#!/usr/bin/env python3
"""How long one large or malformed request holds the frontend's event loop: gRPC ``Ping``
latency (and ``grpc.health.v1`` Check) measured while the request is processed.

Starts the server of the tree on ``PYTHONPATH`` (or the installed one) with two models, an
echo handler for ``/predictions`` and a v2 echo handler for the Open Inference Protocol, then
runs each scenario ``--runs`` times while a probe thread calls ``Ping`` and health ``Check``
back to back on its own channel. Prints, per scenario: the request's answer status, its time
(median), and Ping latency (median and max over all runs).

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/loop_stall.py --runs 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from common import Server, start_project, wait_model_serving
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service._proto import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
ECHO = ROOT / "benchmarks" / "handlers" / "echo_handler.py"
V2_ECHO = '''
import json


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        request = json.loads(row["body"])
        out.append(json.dumps({"model_name": request["model_name"], "outputs": [
            {"name": t["name"] + "_echo", "datatype": t["datatype"], "shape": t["shape"], "data": t["data"]}
            for t in request["inputs"]]}, separators=(",", ":")))
    return out
'''
BOUNDARY = "stallboundary"


class Probe(threading.Thread):
    """Calls Ping and health Check back to back until stopped; keeps every latency (s)."""

    def __init__(self, port: int, key: str) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.ping = inference_pb2_grpc.InferenceAPIsServiceStub(self.channel).Ping
        self.check = health_pb2_grpc.HealthStub(self.channel).Check
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.pings: list[float] = []
        self.checks: list[float] = []
        self.failures = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            calls = ((self.ping, self.pings, {"metadata": self.metadata}), (self.check, self.checks, {}))
            for call, out, kwargs in calls:
                request = empty_pb2.Empty() if out is self.pings else health_pb2.HealthCheckRequest()
                start = time.perf_counter()
                try:
                    call(request, timeout=60, **kwargs)
                except grpc.RpcError:
                    self.failures += 1
                out.append(time.perf_counter() - start)
            time.sleep(0.002)


def _http(port: int, key: str, method: str, path: str, body: bytes, content_type: str,
          headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        sent = {"Content-Type": content_type, "Authorization": f"Bearer {key}", "Content-Length": str(len(body)),
                **(headers or {})}
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in sent.items():
            conn.putheader(name, value)
        try:
            conn.endheaders(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _multipart(count: int) -> bytes:
    return b"".join(f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"p{i}\"\r\n\r\n\r\n".encode()
                    for i in range(count)) + f"--{BOUNDARY}--\r\n".encode()


def _v2_binary(count: int, value: float) -> tuple[bytes, str]:
    raw = struct.pack(f"<{count}f", *([value] * count)) if value else os.urandom(4 * count)
    head = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [count],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, str(len(head))


def scenarios(info: dict[str, Any], keys: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) of every scenario; each call returns the answer's status."""
    http_port, key = int(info["http_port"]), keys["inference"]["key"]
    channel = grpc.insecure_channel(f"127.0.0.1:{info['inference_port']}",
                                    options=[("grpc.max_send_message_length", 64 * 1024 * 1024),
                                             ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    v2 = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
    metadata = (("authorization", f"Bearer {key}"),)

    def grpc_raw(count: int, value: float) -> Callable[[], str]:
        raw = struct.pack(f"<{count}f", *([value] * count)) if value else os.urandom(4 * count)
        request = grpc_predict_v2_pb2.ModelInferRequest(model_name="v2echo", raw_input_contents=[raw])
        request.inputs.add(name="a", datatype="FP32", shape=[count])

        def call() -> str:
            try:
                v2.ModelInfer(request, timeout=120, metadata=metadata)
            except grpc.RpcError as err:
                return err.code().name
            return "OK"
        return call

    def http_call(path: str, body: bytes, content_type: str, headers: dict[str, str] | None = None
                  ) -> Callable[[], int]:
        return lambda: _http(http_port, key, "POST", path, body, content_type, headers)

    binary, head = _v2_binary(1_600_000, 0.0)
    accepted, accepted_head = _v2_binary(1_000_000, 0.5)
    json_body = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1_000_000],
                                        "data": [0.5] * 1_000_000}]}).encode()
    multipart = "multipart/form-data; boundary=" + BOUNDARY
    return [
        ("multipart, 65,536 empty parts (4.3 MB)", http_call("/predictions/echo", _multipart(65_536), multipart)),
        ("multipart, 1,000 empty parts", http_call("/predictions/echo", _multipart(1_000), multipart)),
        ("form, 1,000,000 fields (4 MB)", http_call("/predictions/echo", b"&".join([b"a=1"] * 1_000_000),
                                                    "application/x-www-form-urlencoded")),
        ("raw body 6.5 MB to /predictions", http_call("/predictions/echo", b"x" * 6_500_000,
                                                      "application/octet-stream")),
        ("JSON 100,000 deep to /v2 infer", http_call("/v2/models/v2echo/infer", b"[" * 100_000 + b"]" * 100_000,
                                                     "application/json")),
        ("v2 gRPC raw FP32 6.4 MB (random)", grpc_raw(1_600_000, 0.0)),
        ("v2 gRPC raw FP32 4 MB (accepted)", grpc_raw(1_000_000, 0.5)),
        ("v2 HTTP binary FP32 6.4 MB (random)", http_call("/v2/models/v2echo/infer", binary, "application/json",
                                                          {"Inference-Header-Content-Length": head})),
        ("v2 HTTP binary FP32 4 MB (accepted)", http_call("/v2/models/v2echo/infer", accepted, "application/json",
                                                          {"Inference-Header-Content-Length": accepted_head})),
        ("v2 HTTP JSON 5 MB (accepted)", http_call("/v2/models/v2echo/infer", json_body, "application/json")),
    ]


def start(workdir: Path) -> tuple[Server, dict[str, Any], dict[str, Any]]:
    """The server with ``echo`` and ``v2echo`` (one worker each), returned once both are SERVING."""
    store = workdir / "store"
    store.mkdir()
    (workdir / "v2echo.py").write_text(V2_ECHO)
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    for name, handler in (("echo", ECHO), ("v2echo", workdir / "v2echo.py")):
        subprocess.run([str(archiver), "--model-name", name, "--version", "1.0", "--handler", str(handler),
                        "--export-path", str(store)], check=True, capture_output=True, timeout=120)
    server = start_project("loop_stall", store, workdir, ["echo=echo.mar", "v2echo=v2echo.mar"],
                           extra_args=["--workers-per-model", "1"])
    try:
        for model in ("echo", "v2echo"):
            wait_model_serving(server.inference_port, model, 180)
    except BaseException:
        server.stop()
        raise
    info = {"http_port": server.http_port, "inference_port": server.inference_port}
    return server, info, json.loads((workdir / "key_file.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server, info, keys = start(Path(tmp))
        try:
            rows = []
            for name, call in scenarios(info, keys):
                times, pings, checks, statuses, failures = [], [], [], set(), 0
                for _ in range(args.runs):
                    probe = Probe(int(info["inference_port"]), keys["inference"]["key"])
                    probe.start()
                    time.sleep(0.2)  # the probe's first calls, before the request
                    started = time.perf_counter()
                    statuses.add(str(call()))
                    times.append(time.perf_counter() - started)
                    time.sleep(0.1)
                    probe.halt.set()
                    probe.join(60)
                    pings += probe.pings
                    checks += probe.checks
                    failures += probe.failures
                rows.append((name, "/".join(sorted(statuses)), statistics.median(times), statistics.median(pings),
                             max(pings), max(checks), failures))
        finally:
            server.stop()
    print(f"{'scenario':42} {'status':>18} {'request s':>9} {'Ping p50 ms':>11} {'Ping max ms':>11} "
          f"{'Check max ms':>12} {'failed':>6}")
    for name, status, took, p50, pmax, cmax, failures in rows:
        print(f"{name:42} {status:>18} {took:9.2f} {p50 * 1000:11.1f} {pmax * 1000:11.1f} {cmax * 1000:12.1f} "
              f"{failures:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
