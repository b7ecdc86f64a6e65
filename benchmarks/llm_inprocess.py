#!/usr/bin/env python3
"""In-process LLM generation benchmark: time to first token and tokens/s, no server involved.

Loads the converted SmolLM2 model (converting the GGUF once if needed, see
:mod:`inference_service.llm.model`) or ``--model-path``, then runs the very
generation function the handlers use
(:func:`inference_service.llm.generation.generate_pieces`), greedy with
``ignore_eos`` so every run produces exactly ``max_new_tokens`` tokens, and
prints one JSON object on stdout.

Measured per run (medians over ``--runs`` after ``--warmup`` unmeasured runs):

- ``ttft_s``: seconds from calling the generator to its first text piece
  (prefill + first token; what a streaming client waits for);
- ``tokens_per_s``: completion tokens / total generation seconds;
- ``decode_tokens_per_s``: (completion tokens - 1) / (total - ttft) seconds,
  the steady per-token speed after the first token.

Usage: .venv/bin/python benchmarks/llm_inprocess.py [--model-path DIR] [--prompt TEXT]
           [--raw] [--max-new-tokens 64] [--runs 3] [--warmup 1] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from inference_service.llm.generation import build_prompt_ids, generate_pieces, model_context_length  # noqa: E402
from inference_service.llm.model import load_model, prepare_gguf  # noqa: E402
from inference_service.llm.params import GenerationParams, GenerationResult  # noqa: E402
from inference_service.llm.requests import GenerationRequest  # noqa: E402

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


def time_generation(model: Any, tokenizer: Any, prompt_ids: list[int], params: GenerationParams) -> dict[str, float]:
    """Run one generation with :func:`generate_pieces` and time it.

    Returns:
        ``{"ttft_s", "total_s", "completion_tokens"}`` (seconds, seconds, count).
    """
    start = time.perf_counter()
    first: float | None = None
    pieces = generate_pieces(model, tokenizer, prompt_ids, params)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            result: GenerationResult = done.value
            break
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {
        "ttft_s": (first if first is not None else end) - start,
        "total_s": end - start,
        "completion_tokens": float(result.completion_tokens),
    }


def measure_inprocess(
    model_dir: str | os.PathLike[str] | None = None,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 64,
    runs: int = 3,
    warmup: int = 1,
    chat: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Load the model and measure greedy generation speed in-process.

    Args:
        model_dir: transformers model directory; ``None`` = the converted default SmolLM2.
        prompt: the user prompt.
        max_new_tokens: tokens generated per run (``ignore_eos`` makes it exact).
        runs: measured runs (medians are reported).
        warmup: unmeasured runs first.
        chat: apply the chat template (``messages``) rather than a raw prompt.
        threads: ``torch.set_num_threads`` value, if given.

    Returns:
        A JSON-ready dict: ``model_dir``, ``load_s``, ``torch_threads``,
        ``prompt_tokens``, ``max_new_tokens``, ``runs``, ``ttft_s``,
        ``tokens_per_s``, ``decode_tokens_per_s`` (medians), ``runs_detail``.
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    directory = pathlib.Path(model_dir) if model_dir is not None else prepare_gguf()
    start = time.perf_counter()
    model, tokenizer = load_model(directory)
    load_s = time.perf_counter() - start
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(
        prompt=None if chat else prompt,
        messages=({"role": "user", "content": prompt},) if chat else None,
        params=params,
    )
    prompt_ids = build_prompt_ids(tokenizer, request, model_context_length(model))
    for _ in range(warmup):
        time_generation(model, tokenizer, prompt_ids, params)
    detail = [time_generation(model, tokenizer, prompt_ids, params) for _ in range(max(1, runs))]
    return {
        "model_dir": str(directory),
        "load_s": round(load_s, 3),
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "runs": len(detail),
        "ttft_s": round(statistics.median(d["ttft_s"] for d in detail), 4),
        "tokens_per_s": round(statistics.median(d["completion_tokens"] / d["total_s"] for d in detail), 2),
        "decode_tokens_per_s": round(
            statistics.median(
                (d["completion_tokens"] - 1) / (d["total_s"] - d["ttft_s"])
                for d in detail
                if d["total_s"] > d["ttft_s"]
            ),
            2,
        )
        if any(d["total_s"] > d["ttft_s"] for d in detail)
        else None,
        "runs_detail": [{k: round(v, 4) for k, v in d.items()} for d in detail],
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run :func:`measure_inprocess`, print its JSON."""
    parser = argparse.ArgumentParser(description="In-process LLM generation benchmark (TTFT, tokens/s).")
    parser.add_argument("--model-path", default=None, help="transformers model dir (default: converted SmolLM2)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = measure_inprocess(
        args.model_path,
        args.prompt,
        args.max_new_tokens,
        args.runs,
        args.warmup,
        not args.raw,
        args.threads,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
