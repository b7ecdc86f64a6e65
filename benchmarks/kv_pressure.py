#!/usr/bin/env python3
"""The OpenVINO engine under KV-cache pressure (issue 43 item 5): many seeded sampled requests with
long prompts at once, fp32 KV cache, SmolLM2's fp32 IR, in-process.

For each cache setting (``--cache-size``: ``default``, sized for ``--requests`` x the context, and
GB values such as ``1``), it runs ``--requests`` requests together (``--prompt-tokens`` of committed
prose each, a different slice per request, ``--new-tokens`` sampled at temperature 0.8 with seeds
1..N), prints the engine's gauges at their peak (used, capacity, usage, preemptions) beside the
tokens the requests really hold, then runs each request alone and counts the texts that differ
from their run together.

Usage: .venv/bin/python benchmarks/kv_pressure.py [--requests 12] [--prompt-tokens 1500]
           [--new-tokens 800] [--cache-size default,1] [--solo N]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
TEXT = ROOT / "tests" / "e2e" / "data" / "operating_a_model_server.txt"


def run(engine: object, prompts: dict[str, list[int]], params: dict[str, object]) -> tuple[dict[str, str], dict]:
    """Run ``prompts`` together; their texts and the peak gauges."""
    texts = {key: "" for key in prompts}
    for key, ids in prompts.items():
        engine.add(key, ids, params[key])  # type: ignore[attr-defined]
    peak = {"used": 0, "held": 0, "capacity": 0, "preempted": 0}
    generated = dict.fromkeys(prompts, 0)
    while len(engine):  # type: ignore[arg-type]
        for key, out in engine.step().items():  # type: ignore[attr-defined]
            texts[key] += out.piece + (out.result.remaining_text if out.result else "")
            generated[key] += out.tokens
        stats = engine.stats()  # type: ignore[attr-defined]
        held = sum(len(prompts[k]) + generated[k] for k in prompts if engine.has(k))  # type: ignore[attr-defined]
        if stats.kv_cache_used_tokens > peak["used"]:
            peak.update(used=stats.kv_cache_used_tokens, held=held)
        peak["capacity"] = stats.kv_cache_capacity_tokens
        peak["preempted"] = stats.preempted_total
    return texts, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=800)
    parser.add_argument("--cache-size", default="default,1")
    parser.add_argument("--solo", type=int, default=None, help="requests run alone to compare (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    from inference_service.llm.model import prepare_gguf
    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.openvino_ir import prepare_ir
    from inference_service.llm.params import GenerationParams

    ir_dir, _ = prepare_ir(prepare_gguf(), "fp32")
    tokenizer = AutoTokenizer.from_pretrained(str(ir_dir))
    words = list(tokenizer(TEXT.read_text(encoding="utf-8") * 4)["input_ids"])
    prompts = {f"r{i}": words[i * 97:i * 97 + args.prompt_tokens] for i in range(args.requests)}
    params = {key: GenerationParams(max_new_tokens=args.new_tokens, temperature=0.8, seed=i + 1, ignore_eos=True)
              for i, key in enumerate(prompts)}
    print(f"# {args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} new tokens), fp32 IR and "
          f"KV cache, {len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()[0]:.2f}")
    print("| cache | capacity tokens | peak used (gauge) | tokens held then | usage | preemptions counted | "
          "texts unlike their solo run | s |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in args.cache_size.split(","):
        gb = None if setting == "default" else float(setting)
        engine = OpenVINOEngine(ir_dir, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=args.requests,
                                max_model_len=8192, weight_format="fp32", kv_cache_gb=gb)
        start = time.perf_counter()
        together, peak = run(engine, prompts, params)
        seconds = time.perf_counter() - start
        keys = list(prompts)[:args.solo] if args.solo is not None else list(prompts)
        differ = sum(1 for key in keys if run(engine, {key: prompts[key]}, params)[0][key] != together[key])
        print(f"| {setting} | {peak['capacity']} | {peak['used']} | {peak['held']} | "
              f"{peak['used'] / peak['capacity']:.0%} | {peak['preempted']} | {differ} of {len(keys)} | "
              f"{seconds:.0f} |", flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
