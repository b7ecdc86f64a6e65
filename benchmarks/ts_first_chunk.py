#!/usr/bin/env python3
"""What TorchServe 0.12's first HTTP chunk carries for a burst of continuous-batching requests.

Runs TorchServe's continuous-batching loop in this process over the bundled LLM handler (the
real SmolLM2): every call holds every running request, new ones with their inputs and running
ones with ``{}`` (TorchServe's ``ContinuousBatching.pollBatch``), and each result with "not
finished" is one HTTP chunk, a ``None`` result the 4 bytes ``null`` (TorchServe's worker
JSON-encodes it). Prints, for N requests of ``max_new_tokens`` tokens from
``prompts_concurrency.json``: when the first chunk (``null`` or a token) and the first token
arrive (p50 / p90 seconds since the burst), how many requests get ``null`` first, and the
``null`` chunks each request gets over its whole generation.

Usage: .venv/bin/python benchmarks/ts_first_chunk.py [--requests 8] [--max-new-tokens 64]
(converts the model once if it is not cached yet; no server, no TorchServe needed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from inference_service.handler.context import Context, RequestProcessor
from inference_service.llm.handler import LLMHandler
from inference_service.llm.model import find_default_gguf, prepare_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    n = args.requests
    model_dir = prepare_gguf(find_default_gguf())  # converted once, then cached
    prompts = json.loads((ROOT / "benchmarks" / "prompts_concurrency.json").read_text())[:n]
    context = Context(model_name="smollm2", model_dir=str(model_dir), manifest={"model": {"modelName": "smollm2"}},
                      batch_size=n, gpu=None, server_version="bench",
                      model_yaml_config={"continuousBatching": True, "handler": {"model_path": str(model_dir)}})
    context.request_processor = [RequestProcessor({}) for _ in range(n)]
    handler = LLMHandler()
    handler.initialize(context)
    # the worker's per-call reset (Context.begin_batch; _begin_batch in older trees)
    begin_batch = getattr(context, "begin_batch", None) or getattr(context, "_begin_batch")  # noqa: B009
    ids = [f"r{i}" for i in range(n)]
    first_chunk: dict[str, float] = {}
    first_token: dict[str, float] = {}
    nulls = dict.fromkeys(ids, 0)
    done: set[str] = set()
    started = time.perf_counter()
    new = True
    while len(done) < n:
        running = [rid for rid in ids if rid not in done]
        begin_batch(running, [{} for _ in running], [None for _ in running])
        data = [{"data": bytearray(json.dumps({"prompt": prompts[ids.index(rid)], "ignore_eos": True,
                                               "max_new_tokens": args.max_new_tokens}).encode())} if new else {}
                for rid in running]
        new = False
        results = handler.handle(data, context)
        now = time.perf_counter() - started
        for idx, rid in enumerate(running):
            first_chunk.setdefault(rid, now)
            if results[idx] is None:
                nulls[rid] += 1
            else:
                first_token.setdefault(rid, now)
            if context.stopping_criteria[idx](results[idx]):
                done.add(rid)
    chunk, token = sorted(first_chunk.values()), sorted(first_token.values())
    p90 = max(0, round(0.9 * n) - 1)
    print(f"first chunk ('null' or a token): p50 {statistics.median(chunk):.3f} s, p90 {chunk[p90]:.3f} s")
    print(f"first token:                     p50 {statistics.median(token):.3f} s, p90 {token[p90]:.3f} s")
    print(f"requests whose first chunk is 'null': {sum(first_chunk[r] < first_token[r] for r in ids)} of {n}")
    print(f"'null' chunks per request over the generation: {[nulls[r] for r in ids]}")


if __name__ == "__main__":
    main()
