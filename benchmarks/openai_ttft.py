#!/usr/bin/env python3
"""Time to first token: OpenAI's ``/v1/chat/completions`` (streaming) versus gRPC StreamPredictions.

Starts ``inference-service`` with one worker of the bundled SmolLM2 archive (built by
``scripts/build_llm_archive`` into a temporary model store; the converted weights are cached),
then sends the same chat request (greedy, ``max_tokens`` tokens, ``ignore_eos``) again and again
through three clients, one request at a time, in rotating order:

- ``grpc``: StreamPredictions with the LLM handler's own body (``max_new_tokens``,
  ``include_usage``); TTFT is the arrival of the first message (the first text piece);
- ``http``: ``POST /v1/chat/completions`` with ``stream: true`` on one kept-alive
  ``http.client`` connection; TTFT is the arrival of the first event with ``delta.content``;
- ``openai``: the official ``openai`` client, the same request (its own SSE parsing and
  pydantic models included); informative.

Every stream is read to its end before the next request, so the worker always starts idle.
Prints medians of TTFT and total time per client, the ratios to gRPC, and one JSON line.

Usage: .venv/bin/python benchmarks/openai_ttft.py [--runs 20] [--max-tokens 16]
Figures are this machine's; run it when the machine is quiet (``uptime`` load below 1.5).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import grpc  # noqa: E402
from common import ROOT, Metadata, start_project, stream_once, wait_model_serving  # noqa: E402

from inference_service._proto import inference_pb2_grpc  # noqa: E402

QUESTION = "What is the capital of France?"


def grpc_run(stub: inference_pb2_grpc.InferenceAPIsServiceStub, body: bytes,
             metadata: Metadata) -> tuple[float, float, int]:
    """One StreamPredictions call: (TTFT s, total s, completion tokens)."""
    ttft, total, last = stream_once(stub, "smollm2", body, metadata, 120)
    return ttft, total, json.loads(last)["usage"]["completion_tokens"]


def http_run(conn: http.client.HTTPConnection, body: bytes, key: str) -> tuple[float, float, int]:
    """One streamed ``/v1/chat/completions`` on a kept-alive connection: (TTFT s, total s, tokens)."""
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {response.read()!r}")
    first = None
    tokens = 0
    while line := response.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
            first = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    response.read()  # the terminating chunk: the connection is ready for the next request
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def openai_run(client: openai.OpenAI, max_tokens: int) -> tuple[float, float, int]:
    """The same request through the official client: (TTFT s, total s, tokens)."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="requests per client (default 20)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="openai-ttft-"))
    store = workdir / "model_store"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store)],
                   check=True, stdout=subprocess.DEVNULL)
    server = start_project("project", store, workdir, ["smollm2=smollm2.mar"], startup_s=60)
    try:
        key = json.loads((workdir / "key_file.json").read_text())["inference"]["key"]
        wait_model_serving(server.inference_port, "smollm2", 900)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.inference_port}")
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        metadata = server.metadata
        messages = [{"role": "user", "content": QUESTION}]
        grpc_body = json.dumps({"messages": messages, "max_new_tokens": args.max_tokens, "temperature": 0,
                                "ignore_eos": True, "include_usage": True}).encode()
        http_body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": args.max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key, max_retries=0)
        clients: dict[str, Callable[[], tuple[float, float, int]]] = {
            "grpc": lambda: grpc_run(stub, grpc_body, metadata),
            "http": lambda: http_run(conn, http_body, key),
            "openai": lambda: openai_run(client, args.max_tokens),
        }
        for run in clients.values():  # warm-up: the first requests of each path are not measured
            run()
            run()
        rows: dict[str, list[tuple[float, float, int]]] = {name: [] for name in clients}
        names = list(clients)
        for i in range(args.runs):
            for name in names[i % 3:] + names[:i % 3]:  # rotate which client goes first
                rows[name].append(clients[name]())
        conn.close()
        client.close()
        channel.close()
    finally:
        server.stop()

    result: dict[str, float | int | str] = {"scenario": "openai_ttft", "runs": args.runs,
                                            "max_tokens": args.max_tokens}
    for name, values in rows.items():
        assert all(tokens == args.max_tokens for _, _, tokens in values), (name, values)
        result[f"{name}_ttft_ms"] = round(statistics.median(v[0] for v in values) * 1000, 2)
        result[f"{name}_total_ms"] = round(statistics.median(v[1] for v in values) * 1000, 2)
    for name in ("http", "openai"):
        result[f"{name}_ttft_ratio"] = round(float(result[f"{name}_ttft_ms"]) / float(result["grpc_ttft_ms"]), 3)
    print(f"SmolLM2-135M-Instruct, chat '{QUESTION}', {args.max_tokens} tokens greedy, "
          f"medians of {args.runs} requests per client, rotating order (this machine)")
    print(f"{'client':34}{'TTFT ms':>10}{'total ms':>10}{'TTFT / gRPC':>13}")
    labels = {"grpc": "gRPC StreamPredictions", "http": "/v1/chat/completions (http.client)",
              "openai": "/v1/chat/completions (openai)"}
    for name, label in labels.items():
        ratio = f"{result[f'{name}_ttft_ratio']:.3f}" if name != "grpc" else "1.000"
        print(f"{label:34}{result[f'{name}_ttft_ms']:>10.2f}{result[f'{name}_total_ms']:>10.2f}{ratio:>13}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
