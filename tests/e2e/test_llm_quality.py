"""Quality bar of every serving mode of the bundled LLM (SmolLM2-135M-Instruct), in-process.

For each mode of :func:`inference_service.llm.quantize.optimize_model` that the bundled
handler offers (model-config ``quantization`` / ``prepack``):

- perplexity on ``data/operating_a_model_server.txt`` (original prose written for this
  project, about 2,180 tokens; one teacher-forced forward pass) within 3 % of fp32 eager's;
- for modes without quantization, greedy outputs equal to fp32 eager's: the token ids of
  :func:`~inference_service.llm.generation.generate_pieces` (the handler's generation loop,
  ``NEW_TOKENS`` tokens, ``ignore_eos``) for each of the 10 committed prompts of ``prompts.json``.

The eager model is loaded once for the module; each mode transforms a deep copy.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.llm, pytest.mark.timeout(900)]  # slow on a loaded 2-core machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
TEXT_FILE = HERE / "data" / "operating_a_model_server.txt"
PROMPTS_FILE = HERE / "prompts.json"
NEW_TOKENS = 16
PPL_TOLERANCE = 0.03
#: mode name -> handler config keys; "exact" modes must reproduce eager greedy tokens.
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "prepack": ({"quantization": "none", "prepack": True}, True),
    "int8": ({"quantization": "int8", "prepack": True}, False),
}


def perplexity(model: Any, ids: Any) -> float:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].float()
        return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))


def greedy(model: Any, tokenizer: Any, prompts: list[list[int]]) -> list[list[int]]:
    from inference_service.llm.generation import generate_pieces
    from inference_service.llm.params import GenerationParams

    params = GenerationParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
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

    model, tokenizer = load_model(resolve_model_dir({}))
    ids = torch.tensor([tokenizer(TEXT_FILE.read_text(encoding="utf-8"))["input_ids"]])
    assert ids.shape[1] >= 2000
    bodies = json.loads(PROMPTS_FILE.read_text())
    assert len(bodies) == 10
    prompts = [build_prompt_ids(tokenizer, parse_request(body, GenerationParams())) for body in bodies]
    return {"model": model, "tokenizer": tokenizer, "ids": ids, "prompts": prompts,
            "ppl": perplexity(model, ids), "greedy": greedy(model, tokenizer, prompts)}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_holds_the_quality_bar(eager: dict[str, Any], mode: str) -> None:
    from inference_service.llm.quantize import optimize_model

    config, exact = MODES[mode]
    model = optimize_model(copy.deepcopy(eager["model"]), **config)
    ppl = perplexity(model, eager["ids"])
    assert abs(ppl / eager["ppl"] - 1) <= PPL_TOLERANCE, f"{mode}: perplexity {ppl:.3f} vs fp32 {eager['ppl']:.3f}"
    if exact:
        got = greedy(model, eager["tokenizer"], eager["prompts"])
        for index, (tokens, want) in enumerate(zip(got, eager["greedy"], strict=True)):
            assert tokens == want, f"{mode}: prompt {index} diverges from fp32 eager"


def test_prepack_replaces_every_linear_layer(eager: dict[str, Any]) -> None:
    import torch

    from inference_service.llm.quantize import PackedLinear, optimize_model

    model = optimize_model(copy.deepcopy(eager["model"]), quantization="none", prepack=True)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 7 * model.config.num_hidden_layers + 1


def test_quantization_mode_is_checked(eager: dict[str, Any]) -> None:
    from inference_service.llm.quantize import optimize_model

    with pytest.raises(ValueError, match="'quantization' must be one of"):
        optimize_model(eager["model"], quantization="int3")


def test_int8_keeps_the_sensitive_layers_fp32(eager: dict[str, Any]) -> None:
    import torch

    from inference_service.llm.quantize import Int8Linear, PackedLinear, optimize_model

    model = optimize_model(copy.deepcopy(eager["model"]), quantization="int8", prepack=True)
    layers = model.model.layers
    assert isinstance(model.lm_head, PackedLinear)
    for index, layer in enumerate(layers):
        kinds = {name: type(child) for name, child in layer.named_modules() if name.endswith("_proj")}
        assert kinds["mlp.down_proj"] is PackedLinear
        inner = 0 < index < len(layers) - 1
        assert (kinds["self_attn.q_proj"] is Int8Linear) == inner, index
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
