#!/usr/bin/env python3
"""The OpenVINO engine's settings on this CPU, in-process: the figures behind a row of the per-CPU
table (src/inference_service/llm/cpu_defaults.py, issue 40).

Each setting (``--settings``, from :data:`SETTINGS`) builds the serving engine
(:class:`~inference_service.llm.openvino_engine.OpenVINOEngine`, ``max_num_seqs`` 8) on the bundled
SmolLM2's IR in its weight format (the IR cache's, converted here once if missing; ``--ir NAME=DIR``
adds an IR directory as it is, with the int8 format's properties) and runs greedy
requests of ``--tokens`` tokens (``ignore_eos``) with the prompts of ``prompts_concurrency.json``:
1 stream, then 8 together. A figure is generated tokens over the wall time from the first
``add`` to the last token. The settings alternate over ``--runs`` rounds, a fresh engine each
time; the table gives each one's median and the range, with the 1-minute load average taken as
each measurement started (median, range), and the CPU at its head.

Usage: .venv/bin/python benchmarks/cpu_defaults.py [--runs 5] [--tokens 64] [--threads N]
           [--settings int8,int8_dq0,fp32] [--ir NAME=DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
PROMPTS = ROOT / "benchmarks" / "prompts_concurrency.json"

#: name -> (weight format, OpenVINO properties over the format's quality properties, tokens per step)
SETTINGS: dict[str, tuple[str, dict[str, Any], int]] = {
    "int8": ("int8", {}, 256),
    "int8_dq0": ("int8", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}, 256),
    "int8_dq128": ("int8", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 128}, 256),
    "int8_kvf32": ("int8", {"KV_CACHE_PRECISION": "f32"}, 256),
    "int8_kvf16": ("int8", {"KV_CACHE_PRECISION": "f16"}, 256),
    "int8_1024": ("int8", {}, 1024),
    "fp32": ("fp32", {}, 256),
    "int4": ("int4", {}, 256),
}


def one(engine: Any, prompts: list[list[int]], tokens: int) -> float:
    """Tokens/s of ``prompts`` run together to ``tokens`` generated tokens each."""
    from inference_service.llm.params import GenerationParams

    params = GenerationParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, ids in enumerate(prompts):
        engine.add(f"r{index}-{start}", ids, params)
    generated = 0
    deadline = start + 600
    while len(engine) and time.perf_counter() < deadline:
        for out in engine.step().values():
            generated += out.tokens
    return generated / (time.perf_counter() - start)


def measure(name: str, model_dir: Path, prompts: list[list[int]], tokens: int, threads: int,
            irs: dict[str, Path]) -> dict[str, float]:
    from transformers import AutoTokenizer

    from inference_service.llm.openvino_engine import QUALITY_PROPERTIES, OpenVINOEngine
    from inference_service.llm.openvino_ir import prepare_ir

    if name in irs:
        ir_dir, (weight_format, properties, batched) = irs[name], ("int8", dict(QUALITY_PROPERTIES["int8"]), 256)
    else:
        weight_format, properties, batched = SETTINGS[name]
        ir_dir, _ = prepare_ir(model_dir, weight_format)
    tokenizer = AutoTokenizer.from_pretrained(str(ir_dir))
    engine = OpenVINOEngine(ir_dir, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=8, max_model_len=8192,
                            max_num_batched_tokens=batched, weight_format=weight_format, threads=threads,
                            properties=properties)
    one(engine, prompts[:1], 4)  # compiled and warm
    figures = {}
    for streams in (1, 8):
        figures[f"load{streams}"] = os.getloadavg()[0]
        figures[f"tps{streams}"] = one(engine, prompts[:streams], tokens)
    engine.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--settings", default="int8,int8_dq0,fp32")
    parser.add_argument("--ir", action="append", default=[], help="NAME=DIR: an IR directory to run as it is")
    args = parser.parse_args()
    irs = {name: Path(path) for name, _, path in (spec.partition("=") for spec in args.ir)}
    names = [n for n in args.settings.split(",") if n] + list(irs)
    unknown = [n for n in names if n not in SETTINGS and n not in irs]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    from transformers import AutoTokenizer

    from inference_service.llm.cpu_defaults import this_cpu
    from inference_service.llm.model import prepare_gguf

    model_dir = prepare_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
               for text in json.loads(PROMPTS.read_text())][:8]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names if run % 2 == 0 else reversed(names):
            results[name].append(measure(name, model_dir, prompts, args.tokens, args.threads, irs))
            print(json.dumps({"run": run, "setting": name, **results[name][-1]}), file=sys.stderr, flush=True)
    cpu = this_cpu()
    print(f"# CPU: {cpu} (kind {cpu.kind}); {args.threads} threads; {args.runs} runs; {args.tokens} tokens")
    print("| setting | 1 stream tokens/s | load | 8 together tokens/s | load |")
    print("|---|---|---|---|---|")
    for name in names:
        cells = []
        for streams in (1, 8):
            tps = [r[f"tps{streams}"] for r in results[name]]
            load = [r[f"load{streams}"] for r in results[name]]
            cells.append(f"{statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})")
            cells.append(f"{statistics.median(load):.1f} ({min(load):.1f}-{max(load):.1f})")
        print(f"| {name} | {' | '.join(cells)} |")
    print(json.dumps({"cpu": str(cpu), "kind": cpu.kind, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
