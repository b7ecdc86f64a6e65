#!/usr/bin/env python3
"""The bundled GGUF read as it is by OpenVINO GenAI, against the converted IRs the engine serves
(issue 40 item 1): quality, load time and speed, to decide whether it may be offered.

For each model, in-process, on the CPU named at the head of the output:

- ``gguf``: ``ContinuousBatchingPipeline`` on ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the model
  OpenVINO GenAI builds from it is saved as IR with its ``enable_save_ov_model`` to measure it);
- ``int8`` and ``fp32``: the IRs ``scripts/build_llm_archive`` converts (from the cache; converted
  here once if missing).

Figures: perplexity on ``tests/e2e/data/operating_a_model_server.txt`` (one teacher-forced pass,
f32 compute, against torch fp32 eager's 37.35: the bar is 3 %), load time (s, pipeline built),
and greedy tokens/s of 1 stream and of 8 together (64 tokens each, ``ignore_eos``).

Usage: .venv/bin/python benchmarks/gguf_direct.py [--threads N] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
TEXT = ROOT / "tests" / "e2e" / "data" / "operating_a_model_server.txt"
PROMPTS = ROOT / "benchmarks" / "prompts_concurrency.json"
TORCH_FP32_PPL = 37.35  # tests/e2e/test_llm_quality.py's reference, torch fp32 eager


def cpu_model() -> str:
    flags: set[str] = set()
    name = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return f"{name} ({', '.join(isa)})"


def perplexity(xml: Path, ids: list[int], threads: int) -> float:
    import numpy as np
    import openvino

    compiled = openvino.Core().compile_model(str(xml), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
        "INFERENCE_NUM_THREADS": str(threads)})
    array = np.asarray([ids], dtype=np.int64)
    request = compiled.create_infer_request()
    request.reset_state()
    request.infer({"input_ids": array, "attention_mask": np.ones_like(array),
                   "position_ids": np.arange(array.shape[1], dtype=np.int64)[None, :],
                   "beam_idx": np.zeros(1, dtype=np.int32)})
    logits = request.get_tensor("logits").data[0, :-1].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return math.exp(-float(np.mean(logprobs[np.arange(len(ids) - 1), ids[1:]])))


def speed(model: Path, prompts: list[list[int]], tokens: int, threads: int) -> tuple[float, float, float]:
    """``(load s, tokens/s of 1 stream, tokens/s of 8 together)``."""
    import numpy as np
    import openvino
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = 1
    scheduler.max_num_seqs = 8
    scheduler.dynamic_split_fuse = True
    start = time.perf_counter()
    pipeline = openvino_genai.ContinuousBatchingPipeline(str(model), scheduler, "CPU", {
        "KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32, "INFERENCE_NUM_THREADS": threads})
    load = time.perf_counter() - start
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = tokens
    config.ignore_eos = True
    figures = []
    inputs = [openvino.Tensor(np.asarray([ids], dtype=np.int64)) for ids in prompts]
    for batch in (inputs[:1], inputs[:8]):
        pipeline.generate(batch[:1], [config])  # warm
        start = time.perf_counter()
        pipeline.generate(batch, [config] * len(batch))
        figures.append(tokens * len(batch) / (time.perf_counter() - start))
    return load, figures[0], figures[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from inference_service.llm.model import find_default_gguf, prepare_gguf
    from inference_service.llm.openvino_ir import prepare_ir

    model_dir = prepare_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = list(tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"])
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in json.loads(PROMPTS.read_text())][:8]
    print(f"# CPU: {cpu_model()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    print("| model | perplexity | vs torch fp32 | load s | 1 stream tokens/s | 8 together tokens/s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / find_default_gguf().name
        shutil.copy(find_default_gguf(), gguf)
        rows = [("gguf", gguf, None)]
        for weight_format in ("int8", "fp32"):
            ir_dir, _ = prepare_ir(model_dir, weight_format)
            rows.append((weight_format, ir_dir, ir_dir / "openvino_model.xml"))
        for name, model, xml in rows:
            load, one, eight = speed(model, prompts, args.tokens, args.threads)
            xml = xml or Path(tmp) / "openvino_model.xml"
            if not xml.exists():  # the GGUF's model, saved by OpenVINO GenAI itself
                import openvino_genai

                openvino_genai.ContinuousBatchingPipeline(str(model), openvino_genai.SchedulerConfig(), "CPU",
                                                          {"enable_save_ov_model": True})
            ppl = perplexity(xml, ids, args.threads)
            print(f"| {name} | {ppl:.2f} | {ppl / TORCH_FP32_PPL - 1:+.1%} | {load:.1f} | {one:.1f} | {eight:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
