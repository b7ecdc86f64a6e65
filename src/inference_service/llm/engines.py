"""Building the LLM handler's engine from its config: ``engine: openvino | torch`` (docs/llm.md,
"Engines"). Both engines have the same methods, so nothing above the handler knows which runs."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inference_service.contracts.cpu import positive_int

log = logging.getLogger(__name__)

ENGINES = ("openvino", "torch")
#: KV cache of the OpenVINO engine by default (GB): 8 SmolLM2 requests of 8,192 tokens in f32
#: take about 3 GB; the pipeline preempts past what it holds.
DEFAULT_CACHE_SIZE_GB = 1
#: Tokens per OpenVINO step by default (prompt chunks plus one per decoding request).
DEFAULT_OPENVINO_BATCHED_TOKENS = 256


class EngineConfigError(ValueError):
    """A handler config value for the engine is invalid; the message names the key."""


@dataclass
class BuiltEngine:
    """What the handler keeps of its engine."""

    engine: Any
    tokenizer: Any
    context_length: int | None
    name: str
    model_path: str
    model: Any = None  # the torch model (torch engine only)


def engine_name(config: Mapping[str, Any], device_type: str) -> str:
    """``engine`` when set, else ``openvino`` on CPU and ``torch`` on an accelerator; EngineConfigError
    for an unknown engine or ``openvino`` off CPU."""
    value = config.get("engine")
    if value is None:
        return "openvino" if device_type == "cpu" else "torch"
    if value not in ENGINES:
        raise EngineConfigError(f"handler config: 'engine' must be one of {', '.join(ENGINES)}, got {value!r}")
    if value == "openvino" and device_type != "cpu":
        raise EngineConfigError(f"handler config: 'engine: openvino' runs on CPU only; this worker has "
                                f"{device_type}; use 'engine: torch'")
    return str(value)


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise EngineConfigError(f"handler config: '{key}' must be true or false, got {value!r}")
    return value


def worker_threads(config: Mapping[str, Any]) -> int | None:
    """The worker's thread count: ``torch_threads`` or what the worker set in ``OMP_NUM_THREADS``
    (from its CPU affinity and quota, :mod:`inference_service.worker.cpu`)."""
    threads = positive_int(config, "torch_threads")
    if threads is not None:
        return threads
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def build_openvino(config: Mapping[str, Any], max_num_seqs: int | None) -> BuiltEngine:
    """The OpenVINO engine on an IR: ``model_path`` naming an IR directory as is, else the model
    converted once to ``weight_format``.

    Raises:
        EngineConfigError: a bad ``weight_format``, ``cache_size``, ``ir_cache_limit_gb`` or
            ``enable_prefix_caching``.
        ModelPreparationError: the model cannot be located or converted, or the IR directory
            lacks a file or holds a config value out of range.
    """
    from transformers import AutoTokenizer

    from inference_service.llm.model import ModelPreparationError, resolve_model_dir
    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.openvino_ir import (
        DEFAULT_IR_CACHE_LIMIT_GB,
        DEFAULT_WEIGHT_FORMAT,
        WEIGHT_FORMATS,
        looks_like_ir,
        prepare_ir,
        read_ir_config,
    )
    from inference_service.llm.request_state import eos_token_ids

    weight_format = config.get("weight_format", DEFAULT_WEIGHT_FORMAT)
    if weight_format not in WEIGHT_FORMATS:
        raise EngineConfigError(f"handler config: 'weight_format' must be one of {', '.join(WEIGHT_FORMATS)}, "
                                f"got {weight_format!r}")
    cache_size = positive_int(config, "cache_size", DEFAULT_CACHE_SIZE_GB)
    budget = positive_int(config, "max_num_batched_tokens", DEFAULT_OPENVINO_BATCHED_TOKENS)
    prefix_caching = _flag(config, "enable_prefix_caching", True)
    cache_limit = positive_int(config, "ir_cache_limit_gb", DEFAULT_IR_CACHE_LIMIT_GB)
    model_path = config.get("model_path")
    if model_path and looks_like_ir(Path(str(model_path)).expanduser()):
        ir_dir = Path(str(model_path)).expanduser()
    else:
        cache_dir = config.get("cache_dir")
        ir_dir, seconds = prepare_ir(resolve_model_dir(config), str(weight_format),
                                     str(cache_dir) if cache_dir else None, cache_limit or DEFAULT_IR_CACHE_LIMIT_GB)
        if seconds is not None:
            log.info("no OpenVINO IR was cached: converting took %.1f s", seconds)
    model_config = read_ir_config(ir_dir)
    weight_format = ir_weight_format(ir_dir, str(weight_format))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ir_dir))
    except Exception as exc:  # noqa: BLE001 - any tokenizer file transformers cannot read
        raise ModelPreparationError(f"cannot load the tokenizer of {ir_dir}: {type(exc).__name__}: {exc}") from exc
    generation = _read_json(ir_dir / "generation_config.json")
    context_length = model_config.get("max_position_embeddings")  # checked: a positive int or None
    model_like = SimpleNamespace(config=SimpleNamespace(**model_config),
                                 generation_config=SimpleNamespace(**generation))
    start = time.perf_counter()
    engine = OpenVINOEngine(ir_dir, tokenizer, eos_token_ids(model_like, tokenizer), max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=budget, max_model_len=context_length,
                            weight_format=weight_format, kv_cache_gb=cache_size or DEFAULT_CACHE_SIZE_GB,
                            threads=worker_threads(config),
                            enable_prefix_caching=prefix_caching)
    size_mb = (ir_dir / "openvino_model.bin").stat().st_size / 1e6
    log.info("loaded %s (OpenVINO IR, %s weights, %.0f MB) in %.1f s", ir_dir, weight_format, size_mb,
             time.perf_counter() - start)
    return BuiltEngine(engine, tokenizer, context_length, "openvino", str(ir_dir))


def ir_weight_format(ir_dir: Path, configured: str) -> str:
    """The weight format an IR directory was exported with (its conversion record), else the
    configured one (an IR directory made elsewhere)."""
    recorded = _read_json(ir_dir / "inference_service_ir.json").get("format")
    return recorded if isinstance(recorded, str) else configured


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
