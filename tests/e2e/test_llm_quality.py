"""Quality bar of the bundled LLM (SmolLM2-135M-Instruct) on the OpenVINO engine, per weight format
of :mod:`inference_service.llm.openvino_ir`, in-process, against torch fp32 eager (the torch engine):

- perplexity on ``data/operating_a_model_server.txt`` (original prose written for this project,
  about 2,180 tokens; one teacher-forced forward pass through optimum-intel's
  ``OVModelForCausalLM`` over the same IR, with the CPU properties the engine sets on this CPU,
  :data:`~inference_service.llm.openvino_engine.QUALITY_PROPERTIES` and the CPU row's,
  :mod:`~inference_service.llm.cpu_defaults`) within 3 % of fp32 eager's;
- the fact prompts (:data:`FACTS`) answered with the word fp32 eager answers them with;
- for ``fp32``, the first ``OV_NEW_TOKENS`` greedy tokens of the serving engine
  (:class:`~inference_service.llm.openvino_engine.OpenVINOEngine`, all prompts in one batch)
  equal to fp32 eager's on each of the 10 committed prompts of ``prompts.json``.

The eager model is loaded once for the module.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from inference_service.llm.openvino_ir import WEIGHT_FORMATS

pytestmark = [pytest.mark.llm, pytest.mark.slow, pytest.mark.timeout(900)]  # slow on a loaded 2-core machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
TEXT_FILE = HERE / "data" / "operating_a_model_server.txt"
PROMPTS_FILE = HERE / "prompts.json"
PPL_TOLERANCE = 0.03


def perplexity(model: Any, ids: Any) -> float:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].float()
        return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))


def greedy(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int,
           ignore_eos: bool = True) -> list[list[int]]:
    from inference_service.llm.generation import generate_pieces
    from inference_service.llm.params import GenerationParams

    params = GenerationParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=ignore_eos)
    outputs = []
    for ids in prompts:
        pieces = generate_pieces(model, tokenizer, ids, params)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                outputs.append(done.value.token_ids)
                break
    return outputs


@pytest.fixture(scope="module")
def eager() -> dict[str, Any]:
    """The fp32 eager model with its perplexity and greedy tokens on the committed inputs."""
    import torch

    from inference_service.llm.generation import build_prompt_ids
    from inference_service.llm.model import load_model, resolve_model_dir
    from inference_service.llm.params import GenerationParams
    from inference_service.llm.requests import parse_request

    model, tokenizer = load_model(resolve_model_dir())
    ids = torch.tensor([tokenizer(TEXT_FILE.read_text(encoding="utf-8"))["input_ids"]])
    assert ids.shape[1] >= 2000
    bodies = json.loads(PROMPTS_FILE.read_text())
    assert len(bodies) == 10
    prompts = [build_prompt_ids(tokenizer, parse_request(body, GenerationParams())) for body in bodies]
    return {"model": model, "tokenizer": tokenizer, "ids": ids, "prompts": prompts,
            "ppl": perplexity(model, ids)}


OV_NEW_TOKENS = 32
#: Questions the 135M model answers right in fp32, and the word each answer must hold.
FACTS = {"What is the capital of France?": "Paris", "What is the capital of Japan?": "Tokyo",
         "What is the capital of Germany?": "Berlin"}


def _ov_greedy(ir_dir: Any, tokenizer: Any, prompts: list[list[int]], weight_format: str, tokens: int,
               ignore_eos: bool = True) -> list[list[int]]:
    """Greedy token ids of the serving engine, all prompts in one continuous batch, with the
    properties the engine takes for ``weight_format`` on this CPU."""
    from inference_service.llm.cpu_defaults import choose_weight_format
    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.params import GenerationParams

    engine = OpenVINOEngine(ir_dir, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=16, max_model_len=8192,
                            weight_format=weight_format, threads=2,
                            properties=dict(choose_weight_format(weight_format).properties))
    params = GenerationParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=ignore_eos)
    for index, ids in enumerate(prompts):
        engine.add(str(index), ids, params)
    done: dict[str, list[int]] = {}
    for _ in range(10 * tokens):
        for key, out in engine.step().items():
            if out.finished and out.result is not None:
                done[key] = out.result.token_ids
        if not len(engine):
            break
    return [done[str(index)] for index in range(len(prompts))]


@pytest.fixture(scope="module")
def torch_facts(eager: dict[str, Any]) -> dict[str, Any]:
    """The fact prompts' ids and fp32 eager's greedy answers to them."""
    from inference_service.llm.generation import build_prompt_ids
    from inference_service.llm.params import GenerationParams
    from inference_service.llm.requests import parse_request

    tokenizer = eager["tokenizer"]
    prompts = [build_prompt_ids(tokenizer, parse_request(json.dumps({"messages": [{"role": "user", "content": q}]}),
                                                         GenerationParams())) for q in FACTS]
    answers = [tokenizer.decode(ids, skip_special_tokens=True)
               for ids in greedy(eager["model"], tokenizer, prompts, 48, ignore_eos=False)]
    for answer, word in zip(answers, FACTS.values(), strict=True):
        assert word.lower() in answer.lower(), f"fp32 eager no longer knows {word}: {answer!r}"
    return {"prompts": prompts, "answers": answers}


@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_openvino_format_holds_the_quality_bar(eager: dict[str, Any], torch_facts: dict[str, Any],
                                               weight_format: str) -> None:
    """Every format offered, with the OpenVINO properties the engine sets for it on this CPU (its
    quality properties, and the CPU row's where the format is the row's own)."""
    import torch
    from optimum.intel import OVModelForCausalLM

    from inference_service.llm.cpu_defaults import choose_weight_format
    from inference_service.llm.model import resolve_model_dir
    from inference_service.llm.openvino_engine import QUALITY_PROPERTIES
    from inference_service.llm.openvino_ir import prepare_ir

    ir_dir, _ = prepare_ir(resolve_model_dir(), weight_format)
    properties = {**QUALITY_PROPERTIES[weight_format], **choose_weight_format(weight_format).properties}
    config = {key: str(value) for key, value in properties.items()}
    model = OVModelForCausalLM.from_pretrained(str(ir_dir), ov_config={**config, "INFERENCE_NUM_THREADS": "2"})
    ids = eager["ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    ppl = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    del model
    assert abs(ppl / eager["ppl"] - 1) <= PPL_TOLERANCE, f"{weight_format}: perplexity {ppl:.3f} vs {eager['ppl']:.3f}"
    tokenizer = eager["tokenizer"]
    answers = [tokenizer.decode(t, skip_special_tokens=True)
               for t in _ov_greedy(ir_dir, tokenizer, torch_facts["prompts"], weight_format, 48, ignore_eos=False)]
    for answer, word, fp32 in zip(answers, FACTS.values(), torch_facts["answers"], strict=True):
        assert word.lower() in answer.lower(), f"{weight_format} answers {answer!r}; fp32 eager: {fp32!r}"
    if weight_format == "fp32":
        want = greedy(eager["model"], tokenizer, eager["prompts"], OV_NEW_TOKENS)
        got = _ov_greedy(ir_dir, tokenizer, eager["prompts"], weight_format, OV_NEW_TOKENS)
        for index, (tokens, expected) in enumerate(zip(got, want, strict=True)):
            assert tokens == expected, f"fp32 IR: prompt {index} diverges from torch fp32 eager"
