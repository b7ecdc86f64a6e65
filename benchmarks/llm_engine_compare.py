#!/usr/bin/env python3
"""Our batched generation engine vs transformers' own generation paths, in-process, on the real SmolLM2.

Greedy decoding, exactly ``--max-new-tokens`` (64) new tokens per request (end-of-sequence
ignored: ``ignore_eos`` for our engine, EOS id -1 for ``generate`` and for the continuous
batching manager, so all three produce the same tokens), 8 distinct chat prompts of 30 to 60
tokens. Measured, each as the
median of ``--runs`` rounds (one unmeasured warm-up run each first; every round runs all
variants in turn, so a change of load on the machine hits them alike):

- ``static_generate``: ``model.generate`` on one left-padded batch of the 8 prompts (the
  ceiling: no scheduling at all);
- ``engine_8``: :class:`inference_service.llm.engine.GenerationEngine` with the 8 requests
  added at once, stepped until all are done;
- ``transformers_cb``: transformers' continuous batching manager
  (``model.init_continuous_batching()``, ``add_request(..., streaming=True)``), 8 requests;
- ``engine_1`` / ``generate_1``: one request alone (the first prompt) with our engine and with
  ``model.generate``;
- ``baseline_1`` (with ``--baseline-rev``): one request with ``generate_pieces`` as it was at
  that git revision (the hand-written single-request loop the engine replaced).

Prints one JSON object: aggregate completion tokens/s of each, the ratios
``engine_8 / static_generate``, ``transformers_cb / static_generate``,
``engine_1 / baseline_1`` and ``engine_1 / generate_1``, and how many of the engine's
8 greedy outputs equal the static batch's.

Usage: .venv/bin/python benchmarks/llm_engine_compare.py [--runs 3] [--max-new-tokens 64]
           [--threads N] [--baseline-rev cd812f5] [--skip-cb]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from inference_service.llm.engine import GenerationEngine  # noqa: E402
from inference_service.llm.model import load_model, prepare_gguf  # noqa: E402
from inference_service.llm.params import GenerationParams  # noqa: E402

#: 8 distinct user questions; with SmolLM2's chat template (and its default system prompt) each
#: encodes to 30..60 tokens (checked at run time).
QUESTIONS = [
    "Why is the sky blue?",
    "Write a haiku about autumn leaves falling on a quiet lake.",
    "What is the capital of France, and what is it famous for?",
    "Explain in simple words how a refrigerator keeps food cold, as if you were talking to a child.",
    "List three tips for a good night's sleep.",
    "A train travels 120 kilometres in 90 minutes. What is its average speed in kilometres per hour? Show your steps.",
    "Translate 'good morning, my friend' into Spanish and German.",
    "Describe the water cycle step by step, from evaporation over the ocean to rain on a mountain and back to the sea.",
]


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The token ids of ``question`` as one user message, chat template applied (generation prompt added)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _round_robin(variants: dict[str, Callable[[], int]], runs: int) -> dict[str, list[float]]:
    """Run every variant once unmeasured, then ``runs`` rounds of each variant in turn (so a load
    change on the machine hits all of them alike); each returns the completion tokens it produced.
    Returns each variant's tokens/s per round."""
    for fn in variants.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(round(tokens / (time.perf_counter() - start), 2))
    return rates


def _load_baseline(rev: str) -> Any:
    """Import ``inference_service.llm.generation`` as it was at git revision ``rev``."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/inference_service/llm/generation.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "baseline_generation.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_generation", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_generation"] = module
    spec.loader.exec_module(module)
    return module


def run_engine(model: Any, tokenizer: Any, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """Generate greedily for all ``prompts`` at once with our engine; ``{key: token ids}``."""
    engine = GenerationEngine(model, tokenizer)
    for i, ids in enumerate(prompts):
        engine.add(str(i), ids, GenerationParams(max_new_tokens=n, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while len(engine):
        for key, out in engine.step().items():
            if out.finished:
                assert out.result is not None
                done[key] = out.result.token_ids
    return done


def run_static(model: Any, prompts: list[list[int]], pad_id: int, n: int) -> list[list[int]]:
    """``model.generate`` on one left-padded batch; the new tokens of each row."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=n, eos_token_id=-1, pad_token_id=pad_id
    )
    return [row[width:].tolist() for row in out]


def run_cb(manager: Any, prompts: list[list[int]], n: int) -> int:
    """Our 8 requests through transformers' continuous batching manager; total new tokens."""
    ids = [manager.add_request(p, max_new_tokens=n, streaming=True, eos_token_id=-1) for p in prompts]
    pending = set(ids)
    tokens = 0
    deadline = time.monotonic() + 600
    while pending and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
    if pending:
        raise RuntimeError(f"continuous batching manager did not finish {sorted(pending)}")
    return tokens


def measure(runs: int, n: int, threads: int | None, baseline_rev: str | None, skip_cb: bool) -> dict[str, Any]:
    """Load SmolLM2 and measure every variant (see the module docstring); a JSON-ready dict."""
    import torch
    from transformers import GenerationConfig

    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(prepare_gguf())
    prompts = [chat_prompt_ids(tokenizer, q) for q in QUESTIONS]
    lengths = [len(p) for p in prompts]
    assert all(30 <= k <= 60 for k in lengths), lengths
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    report: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "prompt_tokens": lengths,
        "max_new_tokens": n,
        "runs": runs,
        "tokens_per_s": {},
        "runs_tokens_per_s": {},
    }
    rates: dict[str, float] = report["tokens_per_s"]
    detail: dict[str, list[float]] = report["runs_tokens_per_s"]

    def static() -> int:
        return sum(len(r) for r in run_static(model, prompts, pad_id, n))

    def engine8() -> int:
        return sum(len(v) for v in run_engine(model, tokenizer, prompts, n).values())

    def engine1() -> int:
        return sum(len(v) for v in run_engine(model, tokenizer, prompts[:1], n).values())

    def generate1() -> int:
        ids = torch.tensor([prompts[0]])
        # an explicit mask: with eos_token_id=-1 generate() would take the prompt's <|im_end|> (= pad id) for padding
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=-1
        )
        return int(out.shape[1] - len(prompts[0]))

    variants: dict[str, Callable[[], int]] = {
        "static_generate": static,
        "engine_8": engine8,
        "engine_1": engine1,
        "generate_1": generate1,
    }
    if baseline_rev:
        baseline = _load_baseline(baseline_rev)
        params = baseline.GenerationParams(max_new_tokens=n, ignore_eos=True)

        def baseline1() -> int:
            return int(baseline.generate_text(model, tokenizer, prompts[0], params)[1].completion_tokens)

        variants["baseline_1"] = baseline1
    manager = None
    if not skip_cb:
        config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=-1, pad_token_id=pad_id)
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()  # idle between its runs (it waits on an event), so it does not slow the others
        variants["transformers_cb"] = lambda: run_cb(manager, prompts, n)
        report["transformers_cb_attn_implementation"] = model.config._attn_implementation
    report["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    try:
        detail.update(_round_robin(variants, runs))
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=30)
            model.destroy_cached_continuous_batching_manager()
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for name, values in detail.items():
        rates[name] = _median(values)
    same = run_engine(model, tokenizer, prompts, n)
    static_out = run_static(model, prompts, pad_id, n)
    report["engine_8_equal_to_static_generate"] = sum(same[str(i)] == static_out[i] for i in range(len(prompts)))
    ratios = {"engine_8/static_generate": rates["engine_8"] / rates["static_generate"]}
    if "transformers_cb" in rates:
        ratios["transformers_cb/static_generate"] = rates["transformers_cb"] / rates["static_generate"]
        ratios["engine_8/transformers_cb"] = rates["engine_8"] / rates["transformers_cb"]
    ratios["engine_1/generate_1"] = rates["engine_1"] / rates["generate_1"]
    if "baseline_1" in rates:
        ratios["engine_1/baseline_1"] = rates["engine_1"] / rates["baseline_1"]
    ratios["engine_8/engine_1"] = rates["engine_8"] / rates["engine_1"]
    report["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    return report


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run :func:`measure`, print its JSON."""
    parser = argparse.ArgumentParser(description="GenerationEngine vs model.generate vs transformers CB.")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--baseline-rev", default=None, help="git revision whose generate_pieces to time too")
    parser.add_argument("--skip-cb", action="store_true", help="leave out transformers' continuous batching")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about eos_token_id=-1 on every call
    print(json.dumps(measure(args.runs, args.max_new_tokens, args.threads, args.baseline_rev, args.skip_cb), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
