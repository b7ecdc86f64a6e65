#!/usr/bin/env python3
"""The frontend limit for benchmarks/compare.py: a bare grpc.aio server of the inference proto.

Implements ``Ping``, ``Predictions`` (echo of ``input["data"]``) and ``StreamPredictions``
(``int(input["data"])`` messages, default 1000: N-1 of 16 bytes, then ``b"done"``, as
benchmarks/handlers/stream_handler.py) in the servicer itself: no workers, no queues, no
authorization. Uses this project's generated stubs. Writes ``{"inference_port": P, "pid": PID}``
to ``--port-file`` once serving; stops on SIGTERM/SIGINT.

``--uvloop`` runs it on uvloop (the project server's default event loop) instead of asyncio's
own loop: compare.py's ``bare_uvloop`` server.

Usage: .venv/bin/python benchmarks/bare_server.py --port-file PATH [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from inference_service._proto import inference_pb2, inference_pb2_grpc  # noqa: E402

PAYLOAD = b"0123456789abcdef"


class BareInference(inference_pb2_grpc.InferenceAPIsServiceServicer):
    """Answers in the servicer: the cost of grpc.aio and protobuf alone."""

    async def Ping(self, request, context):  # noqa: N802 - gRPC method name
        """Always healthy."""
        return inference_pb2.TorchServeHealthResponse(health='{"status": "Healthy"}')

    async def Predictions(self, request, context):  # noqa: N802 - gRPC method name
        """Echo of ``input["data"]``."""
        return inference_pb2.PredictionResponse(prediction=request.input.get("data", b""))

    async def StreamPredictions(self, request, context):  # noqa: N802 - gRPC method name
        """``int(input["data"])`` messages (default 1000), the last one ``b"done"``."""
        n = int(request.input.get("data", b"").decode() or 1000)
        message = inference_pb2.PredictionResponse(prediction=PAYLOAD)
        for _ in range(n - 1):
            yield message
        yield inference_pb2.PredictionResponse(prediction=b"done")


async def serve(port_file: Path) -> None:
    """Serve on a free port of 127.0.0.1 until SIGTERM/SIGINT."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(BareInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(json.dumps({"inference_port": port, "pid": os.getpid()}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> int:
    """Parse arguments and serve."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's loop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(serve(args.port_file))
    else:
        asyncio.run(serve(args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
