#!/usr/bin/env python3
"""Paused readers and a long prompt against the bundled SmolLM2 archive (issue 25's scenarios).

The server and archive are ``llm_concurrency.py``'s ``ours`` (continuousBatching, batchSize 8,
gRPC StreamPredictions with token authorization); ``--tree DIR`` runs the server of another
checkout (the baseline). Scenarios:

- ``paused``: 8 streams of 2000 tokens from a client with a small HTTP/2 window (256 bytes, no
  BDP growth) read their first message and stop reading. A 9th request (64 tokens, a normal
  client) is sent (a) at once and (b) ``--settle`` seconds later (the 8 are paused by then).
  Figure: the 9th's time to first token, and whether it finished.
- ``long``: 4 streams (200 tokens) run; a 6 MB prompt goes to ``/v1/completions`` and then to
  gRPC. Figures: each refusal's status, OpenAI error type, latency, and the running streams'
  longest gap between messages from the long prompt's send to 0.5 s after its answer.

Prints one JSON object. Usage: .venv/bin/python benchmarks/llm_scheduling.py [--tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_concurrency_servers as lc  # noqa: E402

from inference_service._proto import inference_pb2, inference_pb2_grpc  # noqa: E402

SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 256)]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def body(prompt: str, tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True}).encode()


def request(data: bytes) -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name=lc.MODEL, input={"data": data})


async def first_token(stub: Any, server: lc.Server, data: bytes, timeout: float) -> dict[str, Any]:
    """Send one stream, read it to the end: seconds to its first message, and the outcome."""
    sent = time.perf_counter()
    first = None
    try:
        async for _ in stub.StreamPredictions(request(data), metadata=server.metadata, timeout=timeout):
            if first is None:
                first = time.perf_counter() - sent
        return {"ttft_s": round(first, 3) if first is not None else None, "ok": True}
    except grpc.aio.AioRpcError as exc:
        return {"ttft_s": round(first, 3) if first is not None else None, "ok": False, "error": exc.code().name}


async def paused(server: lc.Server, settle: float) -> dict[str, Any]:
    target = f"127.0.0.1:{server.inference_port}"
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target, options=SMALL_WINDOW) as slow, grpc.aio.insecure_channel(target) as ok:
        slow_stub = inference_pb2_grpc.InferenceAPIsServiceStub(slow)
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ok)
        for label, wait_s in (("at_once", 0.0), ("after_settle", settle)):
            calls = [slow_stub.StreamPredictions(request(body(f"{PROMPT} ({i})", 2000)), metadata=server.metadata,
                                                 timeout=600) for i in range(8)]
            await asyncio.gather(*(c.read() for c in calls))  # all 8 run; their clients stop reading now
            await asyncio.sleep(wait_s)
            out[label] = await first_token(stub, server, body("What is the capital of France?", 64), 60)
            for c in calls:
                c.cancel()
            await asyncio.sleep(2)  # the cancels reach the worker
    return out


async def long_prompt(server: lc.Server) -> dict[str, Any]:
    target = f"127.0.0.1:{server.inference_port}"
    big = "word " * 1_200_000  # 6 MB
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        for transport in ("v1", "grpc"):
            times: list[list[float]] = [[] for _ in range(4)]

            async def run(i: int, into: list[float]) -> None:
                async for _ in stub.StreamPredictions(request(body(f"{PROMPT} [{i}]", 200)),
                                                      metadata=server.metadata, timeout=300):
                    into.append(time.perf_counter())

            tasks = [asyncio.create_task(run(i, times[i])) for i in range(4)]
            while not all(len(t) >= 3 for t in times):
                await asyncio.sleep(0.05)
            sent = time.perf_counter()
            if transport == "v1":
                headers = {"Authorization": server.metadata[0][1], "Content-Type": "application/json"}
                async with aiohttp.ClientSession() as session, session.post(
                        f"http://127.0.0.1:{server.extra['http_port']}/v1/completions", headers=headers,
                        data=json.dumps({"model": lc.MODEL, "prompt": big, "max_tokens": 8})) as resp:
                    answer = await resp.read()
                    status: Any = resp.status
                try:
                    kind = json.loads(answer)["error"]["type"]
                except (ValueError, KeyError, TypeError):
                    kind = answer[:120].decode(errors="replace")
            else:
                try:
                    await stub.Predictions(request(json.dumps({"prompt": big}).encode()), metadata=server.metadata,
                                           timeout=60)
                    status, kind = "OK", None
                except grpc.aio.AioRpcError as exc:
                    status, kind = exc.code().name, (exc.details() or "")[:80]
            answered = time.perf_counter()
            await asyncio.sleep(0.5)
            window_end = time.perf_counter()
            gaps = []
            for t in times:
                inside = [x for x in t if sent - 1.0 <= x <= window_end]
                gaps += [b - a for a, b in zip(inside, inside[1:], strict=False)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            out[transport] = {"status": status, "error": kind, "latency_s": round(answered - sent, 3),
                              "running_longest_gap_s": round(max(gaps), 3) if gaps else None}
    return out


async def measure(server: lc.Server, args: argparse.Namespace) -> dict[str, Any]:
    async with lc.Clients(server) as clients:
        await lc.wait_serving(clients, args.start_timeout)
    return {"paused": await paused(server, args.settle), "long": await long_prompt(server)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=None, help="run the server of this checkout (the baseline)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before the second 9th request")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--handler-config", action="append", default=[], metavar="KEY=INT")
    args = parser.parse_args()
    handler = {k: int(v) for k, v in (item.split("=", 1) for item in args.handler_config)}
    base = Path(tempfile.mkdtemp(prefix="llm-scheduling-"))
    store = base / "model_store"
    lc.build_archive(store, lc.CB_CONFIG, handler=handler)
    tree = Path(args.tree).resolve() if args.tree else None
    server = lc.start_ours("tree" if tree else "ours", store, base, tree)
    try:
        status = json.loads((base / ".inference_service" / "status.json").read_text())
        server.extra["http_port"] = int(status["http_port"])
        result = asyncio.run(measure(server, args))
    finally:
        server.stop()
    print(json.dumps({"tree": args.tree or "this", "handler": handler, **result}))
    print(f"logs: {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
