#!/usr/bin/env python3
"""LLM streaming benchmark: the real SmolLM2 through the server versus generating in-process.

Starts ``inference-service`` (one worker of ``model_store/smollm2.mar``, built by
``scripts/build_llm_archive`` if missing) on free ports, loads the same model in
this process, then alternates runs of the same greedy request (``ignore_eos``,
``max_new_tokens`` tokens): one streamed through the server with
StreamPredictions, one with the handler's own generation loop in-process. Only
one of them computes at a time. Prints a table and one JSON line:

- ``ttft_s``: time to the first streamed message (server) / first text piece (in-process);
- ``tokens_per_s``: completion tokens / total seconds;
- ratios server / in-process (tokens/s: higher is better; TTFT: lower is better).

Usage: .venv/bin/python benchmarks/llm_bench.py [--runs 5] [--max-new-tokens 64]
Figures are this machine's; single runs vary by about ±20 %, hence the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import grpc  # noqa: E402
from common import ROOT, Metadata, start_project, stream_once  # noqa: E402
from llm_inprocess import DEFAULT_PROMPT, time_generation  # noqa: E402

from inference_service._proto import inference_pb2_grpc  # noqa: E402
from inference_service.llm.generation import build_prompt_ids, model_context_length  # noqa: E402
from inference_service.llm.model import load_model, prepare_gguf  # noqa: E402
from inference_service.llm.params import GenerationParams  # noqa: E402
from inference_service.llm.requests import GenerationRequest  # noqa: E402


def server_run(stub: inference_pb2_grpc.InferenceAPIsServiceStub, body: bytes,
               metadata: Metadata = ()) -> dict[str, float]:
    """One streamed request: TTFT, total seconds and completion tokens (from include_usage)."""
    ttft, total, last = stream_once(stub, "smollm2", body, metadata, 600)
    tokens = json.loads(last)["usage"]["completion_tokens"]
    return {"ttft_s": ttft, "total_s": total, "completion_tokens": float(tokens)}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    store = ROOT / "model_store"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--force"], check=True, stdout=subprocess.DEVNULL)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="llm-bench-"))
    server = start_project("project", store, workdir, ["smollm2=smollm2.mar"], startup_s=60)
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)  # as the server's single worker
        model, tokenizer = load_model(prepare_gguf())
        params = GenerationParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        request = GenerationRequest(prompt=None, messages=({"role": "user", "content": args.prompt},),
                                    params=params)
        prompt_ids = build_prompt_ids(tokenizer, request, model_context_length(model))
        body = json.dumps({"messages": [{"role": "user", "content": args.prompt}],
                           "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                           "include_usage": True}).encode()
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.inference_port}"))
        auth = server.metadata
        deadline = time.monotonic() + 900
        while True:  # wait for the worker: the first request is also the server's warm-up
            try:
                server_run(stub, body, auth)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        time_generation(model, tokenizer, prompt_ids, params)  # in-process warm-up
        served, local = [], []
        for _ in range(args.runs):
            served.append(server_run(stub, body, auth))
            local.append(time_generation(model, tokenizer, prompt_ids, params))
    finally:
        server.stop()

    def med(rows: list[dict[str, float]], key: str) -> float:
        if key == "tokens_per_s":
            return statistics.median(r["completion_tokens"] / r["total_s"] for r in rows)
        return statistics.median(r[key] for r in rows)

    result = {
        "scenario": "llm_stream", "runs": args.runs, "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": len(prompt_ids),
        "server_ttft_s": round(med(served, "ttft_s"), 4), "inprocess_ttft_s": round(med(local, "ttft_s"), 4),
        "server_tokens_per_s": round(med(served, "tokens_per_s"), 2),
        "inprocess_tokens_per_s": round(med(local, "tokens_per_s"), 2),
    }
    result["tokens_per_s_ratio"] = round(result["server_tokens_per_s"] / result["inprocess_tokens_per_s"], 3)
    result["ttft_ratio"] = round(result["server_ttft_s"] / result["inprocess_ttft_s"], 3)
    print(f"SmolLM2-135M-Instruct, {args.max_new_tokens} tokens greedy, median of {args.runs} alternating runs "
          "(this machine)")
    print(f"{'':22}{'server':>12}{'in-process':>12}{'ratio':>8}")
    print(f"{'time to first token s':22}{result['server_ttft_s']:>12.3f}{result['inprocess_ttft_s']:>12.3f}"
          f"{result['ttft_ratio']:>8.2f}")
    print(f"{'tokens/s':22}{result['server_tokens_per_s']:>12.2f}{result['inprocess_tokens_per_s']:>12.2f}"
          f"{result['tokens_per_s_ratio']:>8.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
