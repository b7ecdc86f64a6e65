"""The OpenVINO GenAI settings our engine derives: a request's ``GenerationConfig`` and the size of the
paged KV cache (:mod:`inference_service.llm.openvino_engine` uses them)."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from pathlib import Path
from typing import Any

from inference_service.llm.params import GenerationParams
from inference_service.llm.prefix_cache import BLOCK_TOKENS

__all__ = ["KV_BLOCK_TOKENS", "generation_config", "kv_bytes_per_token", "kv_cache_blocks", "kv_element_bytes"]


def generation_config(params: GenerationParams, generated: int, eos_ids: Collection[int]) -> Any:
    """``openvino_genai.GenerationConfig`` for a request that has already ``generated`` tokens.

    Greedy when ``temperature`` is 0; otherwise multinomial sampling with ``top_p`` and a seed
    (``params.seed``, or a random one), offset by ``generated`` after a preemption. The
    end-of-sequence ids stop generation unless ``ignore_eos``; stop strings are ours.
    """
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = max(1, params.max_new_tokens - generated)
    config.ignore_eos = params.ignore_eos
    config.stop_token_ids = {int(i) for i in eos_ids} | {int(i) for i in getattr(params, "stop_token_ids", ())}
    config.repetition_penalty = float(getattr(params, "repetition_penalty", 1.0))
    config.logprobs = 1 if getattr(params, "logprobs", False) else 0
    if params.temperature > 0:
        if getattr(params, "top_k", 0) > 0:  # OpenVINO's default (the largest integer) keeps all
            config.top_k = int(params.top_k)
        config.do_sample = True
        config.temperature = params.temperature
        config.top_p = params.top_p
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        config.rng_seed = (seed + generated) % (2**64)
    else:
        config.do_sample = False
    if params.structured_outputs is not None:
        from inference_service.llm.grammar import openvino_config

        config.structured_output_config = openvino_config(params.structured_outputs)
    return config


#: Tokens per KV cache block of OpenVINO GenAI's CPU pipeline.
KV_BLOCK_TOKENS = BLOCK_TOKENS


def kv_cache_blocks(cache_gb: float | None, token_bytes: int, max_num_seqs: int | None,
                    max_model_len: int | None) -> int:
    """The KV cache's blocks: ``cache_gb`` GiB's worth, else enough for ``max_num_seqs`` requests at
    ``max_model_len`` tokens each (so the pipeline never preempts on its own; the memory is taken as
    it is used), else 1 GiB's worth. At least one block per request."""
    if cache_gb is None and max_num_seqs and max_model_len:
        blocks = max_num_seqs * -(-max_model_len // KV_BLOCK_TOKENS)
    else:
        blocks = int((cache_gb or 1.0) * 2**30) // max(1, token_bytes * KV_BLOCK_TOKENS)
    return max(blocks, max_num_seqs or 1)


def kv_bytes_per_token(ir_dir: Path, precision: Any) -> int:
    """Bytes of KV cache one token takes: 2 (keys, values) x layers x KV heads x head size x the
    element size, from the IR directory's ``config.json``; 0 when it cannot be read."""
    import json

    try:
        config = json.loads((ir_dir / "config.json").read_text(encoding="utf-8"))
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return 2 * layers * heads * head_dim * kv_element_bytes(precision)


def kv_element_bytes(precision: Any) -> int:
    """Bytes of one KV cache value at OpenVINO's ``KV_CACHE_PRECISION`` (its CPU default: u8)."""
    return {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}.get(str(precision).lower(), 1)
