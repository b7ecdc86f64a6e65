"""The one builder of the LLM handler's engine: ``engine: openvino | torch | vllm | llamacpp`` of the typed handler
config (docs/llm.md, "Engines"). Every engine implements
:class:`~inference_service.llm.engine_protocol.Engine`, so nothing above the handler knows which runs."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inference_service.contracts.handler_config import HandlerConfig
from inference_service.contracts.wire import EngineInfo
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.engine_protocol import Engine, EngineCapabilities
from inference_service.llm.llamacpp_engine import LlamaCppEngine
from inference_service.llm.openvino_engine import OpenVINOEngine
from inference_service.llm.vllm_engine import VLLMEngine

log = logging.getLogger(__name__)

#: Every engine's declaration, by the name the handler config gives it.
CAPABILITIES: dict[str, EngineCapabilities] = {
    engine.capabilities.name: engine.capabilities
    for engine in (OpenVINOEngine, GenerationEngine, VLLMEngine, LlamaCppEngine)
}
#: The vLLM engine's KV cache on a CPU when ``cache_size`` names none (GiB; on a GPU vLLM sizes it).
VLLM_CPU_CACHE_GB = 1
#: Newly arrived requests the torch engine prefills per step by default: a burst of 8 gets its
#: first tokens about twice as early at the median than with all 8 prefilled in one step, at the
#: same throughput (benchmarks/README.md, "LLM concurrency").
DEFAULT_MAX_PREFILL = 2


class EngineConfigError(ValueError):
    """The handler config asks for an engine this worker cannot run; the message names the key."""


@dataclass
class BuiltEngine:
    """What the handler keeps of its engine."""

    engine: Engine
    tokenizer: Any
    context_length: int | None
    name: str
    model_path: str
    model: Any = None  # the torch model (torch engine only)
    info: EngineInfo | None = None  # what DescribeModel shows of it (None: its name alone)


def engine_name(config: HandlerConfig, device_type: str) -> str:
    """``engine`` when set, else ``openvino`` on CPU and ``torch`` on an accelerator; EngineConfigError
    for an engine that does not run on ``device_type``."""
    if config.engine is None:
        return "openvino" if device_type == "cpu" else "torch"
    capabilities = CAPABILITIES[config.engine]
    if device_type != "cpu" and not capabilities.on_gpu:
        able = " or ".join(f"'engine: {c.name}'" for c in CAPABILITIES.values() if c.on_gpu)
        raise EngineConfigError(f"handler config: 'engine: {config.engine}' runs on CPU only; this worker has "
                                f"{device_type}; use {able}")
    return config.engine


def build_engine(config: HandlerConfig, device: str, max_num_seqs: int | None, continuous: bool) -> BuiltEngine:
    """The engine the config names (:func:`engine_name`) on ``device`` (``"cpu"``, ``"cuda:0"``),
    running up to ``max_num_seqs`` requests at once; ``continuous``: requests join at any step
    (else the torch engine prefills whole prompts).

    Raises:
        EngineConfigError: an engine that does not run on ``device``.
        ModelPreparationError: the model cannot be located, converted or loaded.
    """
    name = engine_name(config, "cpu" if device == "cpu" else "cuda")
    if config.vllm_engine_config and name != "vllm":
        raise EngineConfigError(f"handler config: 'vllm_engine_config' is for vLLM's engine; this model's engine "
                                f"is {name}")
    if name == "openvino":
        return _build_openvino(config, max_num_seqs)
    if name == "vllm":
        return _build_vllm(config, device, max_num_seqs)
    if name == "llamacpp":
        return _build_llamacpp(config, max_num_seqs)
    return _build_torch(config, device, max_num_seqs, continuous)


def worker_threads(config: HandlerConfig) -> int | None:
    """The worker's thread count: ``torch_threads`` (as the worker applied it) or what the worker set in
    ``OMP_NUM_THREADS`` (from its CPU affinity and quota, :mod:`inference_service.worker.cpu`)."""
    if config.torch_threads is not None:
        return config.torch_threads
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _build_torch(config: HandlerConfig, device: str, max_num_seqs: int | None, continuous: bool) -> BuiltEngine:
    """The transformers model and the torch engine (``engine: torch``)."""
    import torch

    from inference_service.llm.generation import model_context_length
    from inference_service.llm.model import load_model, resolve_model_dir, warm_up

    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    model_dir = resolve_model_dir(config)
    model, tokenizer = load_model(model_dir, device=device)
    log.info("warm-up forward pass took %.2f s", warm_up(model))
    context_length = model_context_length(model)
    budget = config.max_num_batched_tokens or GenerationEngine.capabilities.default_batched_tokens
    engine = GenerationEngine(
        model, tokenizer, max_prefill=config.max_prefill_requests or DEFAULT_MAX_PREFILL, max_num_seqs=max_num_seqs,
        max_model_len=context_length, max_num_batched_tokens=budget if continuous else None,
    )
    return BuiltEngine(engine, tokenizer, context_length, "torch", str(model_dir), model)


def _build_vllm(config: HandlerConfig, device: str, max_num_seqs: int | None) -> BuiltEngine:
    """vLLM's engine on a transformers model directory (``engine: vllm``), in a worker running vLLM's own
    Python. A GGUF is converted by the server's Python, whose transformers reads it as tested."""
    from inference_service.llm.model import ModelPreparationError, resolve_model_dir
    from inference_service.llm.request_state import eos_token_ids
    from inference_service.llm.vllm_engine import load_tokenizer, prepare_model_dir

    if device.startswith("cuda:") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2]  # vLLM uses the first visible GPU
    try:
        import vllm
    except ImportError as exc:
        raise EngineConfigError(
            "handler config: 'engine: vllm' needs vLLM in the worker's Python; install it with "
            f"scripts/install --engine vllm or name its interpreter with 'python' ({exc})") from None
    model_dir = resolve_model_dir(config) if config.model_path else prepare_model_dir(config)
    tokenizer = load_tokenizer(model_dir)
    model_config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    model_like = SimpleNamespace(config=SimpleNamespace(**model_config),
                                 generation_config=SimpleNamespace(**generation))
    start = time.perf_counter()
    try:
        engine = VLLMEngine(
            model_dir, tokenizer, eos_token_ids(model_like, tokenizer), max_num_seqs=max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_cache_gb=config.cache_size or (VLLM_CPU_CACHE_GB if device == "cpu" else None),
            enable_prefix_caching=config.enable_prefix_caching, on_gpu=device != "cpu",
            engine_args=dict(config.vllm_engine_config or {}))
    except (TypeError, ValueError) as exc:  # EngineArgs' own refusals: an unknown or bad argument
        raise ModelPreparationError(f"vLLM refused the engine settings: {exc}") from exc
    log.info("loaded %s on vLLM %s in %.1f s", model_dir, vllm.__version__, time.perf_counter() - start)
    return BuiltEngine(engine, tokenizer, engine.max_model_len, "vllm", str(model_dir))


#: The llama.cpp engine's KV cache when ``cache_size`` names none (GiB, all sequences together).
LLAMACPP_CACHE_GB = 1


def _build_llamacpp(config: HandlerConfig, max_num_seqs: int | None) -> BuiltEngine:
    """llama.cpp on the GGUF as it is (``engine: llamacpp``): ``gguf_file``, or ``model_path`` naming a
    ``.gguf`` file, else the bundled SmolLM2. Its KV cache: ``cache_size`` GiB (default
    :data:`LLAMACPP_CACHE_GB`) shared by all sequences, at most ``max_num_seqs`` times the model's
    trained context.

    Raises:
        EngineConfigError: llama-cpp-python is not installed, or ``model_path`` is not a GGUF file.
        ModelPreparationError: llama.cpp cannot load the file or make its context.
    """
    from inference_service.llm.llamacpp_model import GGUFModel, GGUFTokenizer
    from inference_service.llm.model import ModelPreparationError, find_default_gguf

    if config.model_path and not str(config.model_path).endswith(".gguf"):
        raise EngineConfigError(f"handler config: 'engine: llamacpp' serves GGUF files; model_path "
                                f"{config.model_path} is not one (use gguf_file, or another engine for a folder)")
    path = Path(str(config.gguf_file or config.model_path)).expanduser() if (config.gguf_file or config.model_path) \
        else find_default_gguf()
    if not path.is_file():
        raise ModelPreparationError(f"GGUF file {path} does not exist")
    start = time.perf_counter()
    try:
        model = GGUFModel(path)
    except ImportError as exc:
        raise EngineConfigError(f"handler config: {exc}") from None
    except ValueError as exc:
        raise ModelPreparationError(str(exc)) from None
    tokenizer = GGUFTokenizer(model)
    seqs = max_num_seqs or 1
    cache_tokens = int((config.cache_size or LLAMACPP_CACHE_GB) * 2**30 // max(1, model.kv_bytes_per_token))
    trained = model.n_ctx_train if model.n_ctx_train > 0 else cache_tokens
    step_tokens = config.max_num_batched_tokens or LlamaCppEngine.capabilities.default_batched_tokens
    try:
        engine = LlamaCppEngine(model, tokenizer, max_num_seqs=seqs, max_num_batched_tokens=step_tokens,
                                kv_cache_tokens=max(256, min(cache_tokens, seqs * trained)),
                                threads=worker_threads(config) or len(os.sched_getaffinity(0)))
    except ValueError as exc:
        model.close()
        raise ModelPreparationError(str(exc)) from None
    log.info("loaded %s (%s, %.0f MB, %s vocabulary) on llama.cpp in %.1f s; KV cache %d tokens for %d sequences, "
             "max_num_batched_tokens %d", path, model.description(), model.size_bytes / 1e6, tokenizer.vocab_type,
             time.perf_counter() - start, engine.n_ctx, seqs, engine.step_tokens)
    info = EngineInfo("llamacpp", model.description(), "the GGUF file as it is, on llama.cpp")
    return BuiltEngine(engine, tokenizer, engine.max_model_len, "llamacpp", str(path), info=info)


def _build_openvino(config: HandlerConfig, max_num_seqs: int | None) -> BuiltEngine:
    """The OpenVINO engine on an IR: ``model_path`` naming an IR directory as is, else the model
    converted once to ``weight_format`` (``auto`` or none: this CPU's default, with the settings of
    its row in :mod:`inference_service.llm.cpu_defaults`).

    Raises:
        ModelPreparationError: the model cannot be located or converted, or the IR directory
            lacks a file or holds a config value out of range.
    """
    from inference_service.llm.cpu_defaults import choose_weight_format
    from inference_service.llm.model import ModelPreparationError, resolve_model_dir
    from inference_service.llm.openvino_ir import (
        DEFAULT_IR_CACHE_LIMIT_GB,
        looks_like_ir,
        prepare_ir,
        read_ir_config,
    )
    from inference_service.llm.request_state import eos_token_ids

    choice = choose_weight_format(config.weight_format)
    model_path = config.model_path
    if model_path and looks_like_ir(Path(model_path).expanduser()):
        ir_dir = Path(model_path).expanduser()
        recorded = ir_weight_format(ir_dir, choice.weight_format)
        if recorded != choice.weight_format:
            choice = replace(choose_weight_format(recorded, choice.cpu),
                             reason=f"the IR directory's own (converted as {recorded})")
    else:
        ir_dir, seconds = prepare_ir(resolve_model_dir(config), choice.weight_format, config.cache_dir,
                                     config.ir_cache_limit_gb or DEFAULT_IR_CACHE_LIMIT_GB)
        if seconds is not None:
            log.info("no OpenVINO IR was cached: converting took %.1f s", seconds)
    model_config = read_ir_config(ir_dir)
    weight_format, row = choice.weight_format, choice.row
    step_tokens = (config.max_num_batched_tokens or row.max_num_batched_tokens
                   or OpenVINOEngine.capabilities.default_batched_tokens)
    log.info("weight format %s: %s; OpenVINO properties %s; max_num_batched_tokens %d (%s)", weight_format,
             choice.reason, dict(choice.properties) or "the format's own", step_tokens,
             "set in the handler config" if config.max_num_batched_tokens
             else f"the {row.kind} row's" if row.max_num_batched_tokens else "the engine's default")
    context_length = model_config.get("max_position_embeddings")  # checked: a positive int or None
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="openvino-compile") as pool:
        pending = pool.submit(  # compiling releases the GIL: transformers and the tokenizer load meanwhile
            OpenVINOEngine, ir_dir, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=step_tokens,
            max_model_len=context_length, weight_format=weight_format,
            kv_cache_gb=config.cache_size or row.cache_size_gb, threads=_threads(config, row.threads),
            enable_prefix_caching=config.enable_prefix_caching, properties=dict(choice.properties))
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(ir_dir))
        except Exception as exc:  # noqa: BLE001 - any tokenizer file transformers cannot read
            raise ModelPreparationError(f"cannot load the tokenizer of {ir_dir}: {type(exc).__name__}: {exc}") from exc
        engine = pending.result()
    generation = _read_json(ir_dir / "generation_config.json")
    model_like = SimpleNamespace(config=SimpleNamespace(**model_config),
                                 generation_config=SimpleNamespace(**generation))
    engine.set_tokenizer(tokenizer, eos_token_ids(model_like, tokenizer))
    size_mb = (ir_dir / "openvino_model.bin").stat().st_size / 1e6
    log.info("loaded %s (OpenVINO IR, %s weights, %.0f MB) in %.1f s", ir_dir, weight_format, size_mb,
             time.perf_counter() - start)
    info = EngineInfo("openvino", weight_format, choice.reason, f"{choice.cpu}, kind {choice.cpu.kind}")
    return BuiltEngine(engine, tokenizer, context_length, "openvino", str(ir_dir), info=info)


def _threads(config: HandlerConfig, row_threads: int | None) -> int | None:
    """The engine's threads: ``torch_threads``, else the CPU row's (at most the worker's), else the worker's."""
    threads = worker_threads(config)
    if config.torch_threads is None and row_threads is not None:
        return min(row_threads, threads) if threads is not None else row_threads
    return threads


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
