"""The mainstream architectures (issue 47 item 3) as tiny random-weight models made from their
configs, each run by the engines that claim it and held to transformers' own greedy tokens (eager,
fp32) for 16 tokens: the torch engine on the folder, the OpenVINO engine on its fp32 IR (the
conversion, checked). SmolLM2's tokenizer stands in for each model's own; the LM head is scaled so
that the greedy choice of a random model is not a near-tie that float rounding could flip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference_service.contracts.handler_config import HandlerConfig
from inference_service.llm.engine_protocol import run_to_the_end
from inference_service.llm.engines import build_engine
from inference_service.llm.params import GenerationParams

pytestmark = [pytest.mark.llm, pytest.mark.slow]

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024}
#: architecture -> (transformers config class, causal-LM class, extra config values)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 512}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 512}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 16


def _tiny(arch: str, target: Path, tokenizer_dir: Path) -> Path:
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, extra = ARCHITECTURES[arch]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id, **{**SMALL, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked logits: a clear greedy choice
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def _reference(model_dir: Path, prompt_ids: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32, attn_implementation="eager")
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(prompt_ids):]]


def _served(config: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    built = build_engine(HandlerConfig.parse(config), "cpu", 4, True)
    engine = built.engine
    try:
        return run_to_the_end(engine, prompts, GenerationParams(max_new_tokens=TOKENS, ignore_eos=True), 20 * TOKENS)
    finally:
        engine.close()


# no fixture is shared: each architecture may run on a pytest worker of its own
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"arch-{a}")) for a in ARCHITECTURES])
def test_greedy_tokens_equal_transformers_on_every_engine_that_claims_the_architecture(arch, tmp_path_factory):
    from transformers import AutoTokenizer

    from inference_service.llm.model import prepare_gguf

    model_dir = _tiny(arch, tmp_path_factory.mktemp(arch) / f"tiny-{arch}", prepare_gguf())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [list(tokenizer(p)["input_ids"]) for p in PROMPTS]
    expected = [_reference(model_dir, ids) for ids in prompts]
    assert _served({"engine": "torch", "model_path": str(model_dir)}, prompts) == expected
    ir_cache = tmp_path_factory.mktemp(f"{arch}-ir")
    assert _served({"engine": "openvino", "weight_format": "fp32", "model_path": str(model_dir),
                    "cache_dir": str(ir_cache)}, prompts) == expected
