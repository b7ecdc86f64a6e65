#!/usr/bin/env python3
"""The torch engine in-process on one device (a GPU: ``--device cuda``): tokens/s, TTFT and ITL
of 1, 8 and 32 concurrent greedy requests through
:class:`~inference_service.llm.engine.GenerationEngine`, the handler's continuous batching.

The model is ``--model-path`` (a transformers directory), or with ``--random-weights`` a model
built from that directory's ``config.json`` with random weights (seed 0): the same shapes and
so the same speed, for a machine that has the tokenizer and config but not the weights. Before
timing, the engine's invariant is checked on the device: each request's greedy tokens in a
batch of 8 equal the same request alone (up to ``--allow-diverging`` prompts that diverge late
on floating-point near-ties).

Prints a table and one JSON line (with the peak RSS). ``benchmarks/llm_peers.py --in-process``
runs it on the CPU (``--no-check``, its prompts, its threads). It needs only torch, transformers
and ``src/``: ``common`` imports nothing else at its top. Usage: python
benchmarks/llm_engine_device.py --model-path DIR [--random-weights] [--device cuda]
    [--dtype float32|bfloat16] [--tokens 64] [--streams 1,8,32] [--threads N] [--prompts FILE]
    [--no-check]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from common import percentile  # noqa: E402 - the benchmarks' one percentile; no grpc at import

from inference_service.llm.engine import GenerationEngine  # noqa: E402
from inference_service.llm.params import GenerationParams  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "Why is the sky blue?", "Explain how a refrigerator works.", "List three fruits.",
           "Who wrote Hamlet?", "Describe a cat in one sentence."]


def load(model_dir: str, random_weights: bool, device: str, dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch_dtype = getattr(torch, dtype)
    if random_weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.to(device).eval(), tokenizer


def run(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int, device: str) -> dict[str, Any]:
    """All ``prompts`` added at once; steps until every request ended. Times per request."""
    import torch

    engine = GenerationEngine(model, tokenizer, max_num_seqs=len(prompts), max_num_batched_tokens=2048)
    params = GenerationParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, ids in enumerate(prompts):
        engine.add(str(index), ids, params)
    arrivals: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    results: dict[str, list[int]] = {}
    steps = 0
    while len(engine):
        outputs = engine.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        now = time.perf_counter()
        steps += 1
        for key, out in outputs.items():
            arrivals[key].append(now)
            if out.finished and out.result is not None:
                results[key] = out.result.token_ids
    elapsed = time.perf_counter() - start
    ttft = [times[0] - start for times in arrivals.values() if times]
    itl = [1000 * (b - a) for times in arrivals.values() for a, b in zip(times, times[1:], strict=False)]
    return {"streams": len(prompts), "tokens_per_s": sum(len(r) for r in results.values()) / elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "steps": steps, "tokens": [results[str(i)] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--allow-diverging", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prompts", default=None, help="a JSON list of prompts instead of the built-in 8")
    parser.add_argument("--no-check", action="store_true", help="skip the batch-of-8-vs-alone check")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model_path, args.random_weights, args.device, args.dtype)
    prompts = json.loads(pathlib.Path(args.prompts).read_text()) if args.prompts else PROMPTS
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts[:8]]
    ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    run(model, tokenizer, ids[:2], 4, args.device)  # warm-up: kernels, allocator
    diverging = 0
    if not args.no_check:
        batch = run(model, tokenizer, ids, args.tokens, args.device)["tokens"]
        alone = [run(model, tokenizer, [i], args.tokens, args.device)["tokens"][0] for i in ids]
        diverging = sum(a != b for a, b in zip(batch, alone, strict=True))
    rows = []
    for count in (int(n) for n in args.streams.split(",")):
        figures = run(model, tokenizer, [ids[i % len(ids)] for i in range(count)], args.tokens, args.device)
        figures.pop("tokens")
        rows.append(figures)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"device: {device}; torch {torch.__version__}; dtype {args.dtype}; {args.tokens} tokens; "
          + ("check skipped" if args.no_check else f"batch of 8 vs alone: {len(ids) - diverging}/{len(ids)} identical"))
    print("| streams | tokens/s | TTFT p50 s | ITL p50 ms | ITL p99 ms | steps |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.4f} | {r['itl_p50_ms']:.2f} "
              f"| {r['itl_p99_ms']:.2f} | {r['steps']} |")
    peak_rss_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps({"device": device, "torch": torch.__version__, "dtype": args.dtype, "identical_of_8":
                      None if args.no_check else len(ids) - diverging, "peak_rss_mib": peak_rss_mib, "rows": rows}))
    return 0 if diverging <= args.allow_diverging else 1


if __name__ == "__main__":
    sys.exit(main())
