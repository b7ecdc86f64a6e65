#!/usr/bin/env python3
"""int4 weights with data-aware compression for the bundled SmolLM2, against the quality bar of
tests/e2e/test_llm_quality.py (issue 40): which variant, if any, may be offered.

Each variant (``--variant RATIO:GROUP:METHODS``, repeatable; METHODS a ``+``-list of ``awq``,
``se`` (scale estimation), ``gptq``, or ``none``) is converted from the bundled model's
transformers folder as the ``int4`` format is (:func:`inference_service.llm.int4_export.export_int4`:
optimum-intel's Python API over NNCF's ``compress_weights``, asymmetric int4 in groups of GROUP
for RATIO of the layers by parameters, the rest, the embeddings and the LM head in int8,
calibrated on ``src/inference_service/llm/calibration.txt``, not the perplexity text), into
``--out`` (default ``.cache/int4-variants/``; a variant already there is measured again, not
converted). The format's own recipe is ``int4_export.INT4_RECIPE``.
``--ir NAME=DIR`` measures an existing IR directory as it is (the cached int8 IR, say).

Figures, as the quality test takes them: perplexity on
``tests/e2e/data/operating_a_model_server.txt`` (one teacher-forced pass through
``OVModelForCausalLM`` with the int8 format's OpenVINO properties, u8 KV cache and activations
quantized in groups of 32, 2 threads) against torch fp32's 37.35 (the bar: 3 %); the three fact
prompts greedy through the serving engine (the words fp32 answers with); the conversion's seconds
and the 1-minute load average when it started; the CPU at the head of the table.

Usage: .venv/bin/python benchmarks/int4_variants.py --variant 0.8:64:awq+se [--variant ...]
           [--ir int8=DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
TEXT = ROOT / "tests" / "e2e" / "data" / "operating_a_model_server.txt"
TORCH_FP32_PPL = 37.35  # tests/e2e/test_llm_quality.py's reference, torch fp32 eager
PROPERTIES = {"KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32}  # the int8 format's
FACTS = {"What is the capital of France?": "Paris", "What is the capital of Japan?": "Tokyo",
         "What is the capital of Germany?": "Berlin"}


def convert(model_dir: Path, target: Path, ratio: float, group: int, methods: set[str]) -> float:
    """Export ``model_dir`` to ``target`` with int4 weights; returns the seconds it took."""
    from inference_service.llm.int4_export import Int4Recipe, export_int4

    recipe = Int4Recipe(ratio, group, awq="awq" in methods, scale_estimation="se" in methods, gptq="gptq" in methods)
    start = time.perf_counter()
    export_int4(str(model_dir), str(target), recipe)
    return time.perf_counter() - start


def quality(ir_dir: Path, tokenizer: Any) -> tuple[float, list[str]]:
    """``(perplexity, the fact prompts' greedy answers)`` of an IR directory."""
    import torch
    from optimum.intel import OVModelForCausalLM

    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.params import GenerationParams

    ids = torch.tensor([tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]])
    config = {key: str(value) for key, value in PROPERTIES.items()}
    model = OVModelForCausalLM.from_pretrained(str(ir_dir), ov_config={**config, "INFERENCE_NUM_THREADS": "2"})
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    ppl = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    del model
    engine = OpenVINOEngine(ir_dir, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=8, max_model_len=8192,
                            threads=2, properties=dict(PROPERTIES))
    for index, question in enumerate(FACTS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        engine.add(str(index), list(prompt), GenerationParams(max_new_tokens=48, temperature=0.0))
    answers: dict[str, str] = {}
    for _ in range(500):
        for key, out in engine.step().items():
            if out.finished and out.result is not None:
                answers[key] = tokenizer.decode(out.result.token_ids, skip_special_tokens=True)
        if not len(engine):
            break
    return ppl, [answers[str(index)] for index in range(len(FACTS))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], help="RATIO:GROUP:METHODS, e.g. 0.8:64:awq+se")
    parser.add_argument("--ir", action="append", default=[], help="NAME=DIR: an IR directory measured as it is")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "int4-variants")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from inference_service.llm.cpu_defaults import this_cpu
    from inference_service.llm.model import prepare_gguf

    model_dir = prepare_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows: list[tuple[str, Path, str, str]] = []
    for spec in args.variant:
        ratio, group, methods = spec.split(":")
        target = args.out / f"int4-r{ratio}-g{group}-{methods}"
        seconds, load = "cached", ""
        if not (target / "openvino_model.xml").is_file():
            load = f"{os.getloadavg()[0]:.1f}"
            seconds = f"{convert(model_dir, target, float(ratio), int(group), set(methods.split('+'))):.0f}"
        rows.append((f"int4 | {ratio} | {group} | {methods}", target, seconds, load))
    for spec in args.ir:
        name, _, path = spec.partition("=")
        rows.append((f"{name} | - | - | -", Path(path), "-", ""))
    print(f"# CPU: {this_cpu()} (kind {this_cpu().kind}); torch fp32 perplexity {TORCH_FP32_PPL}")
    print("| format | ratio | group | methods | perplexity | vs torch fp32 | facts | convert s | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, ir_dir, seconds, load in rows:
        ppl, answers = quality(ir_dir, tokenizer)
        facts = sum(word.lower() in answer.lower() for word, answer in zip(FACTS.values(), answers, strict=True))
        print(f"| {label} | {ppl:.2f} | {ppl / TORCH_FP32_PPL - 1:+.1%} | {facts}/{len(FACTS)} | {seconds} | {load} |",
              flush=True)
        print(json.dumps({"ir": str(ir_dir), "ppl": ppl, "answers": answers}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
