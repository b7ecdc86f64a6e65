"""The OpenVINO engine: OpenVINO GenAI's continuous batching behind the handler's engine interface.

:class:`OpenVINOEngine` has the methods of :class:`~inference_service.llm.engine.GenerationEngine`
(``add``, ``step``, ``cancel``, ``preempt``, ``stats``, ``close``), so the handler, the worker
and the front doors do not know which engine runs. The model step, the paged KV cache, chunked
prefill (``dynamic_split_fuse``), prefix caching and sampling are OpenVINO GenAI's
(``openvino_genai.ContinuousBatchingPipeline``); our side keeps what must be the same on every
engine: the prompt ids (our tokenizer and chat template), the incremental detokenizer, stop
strings, end-of-sequence rules and the token counts.

Pausing and preemption. A request left out of a step's ``active`` set keeps generating inside
the pipeline; its tokens wait in its ``GenerationHandle`` until it is active again.
:meth:`OpenVINOEngine.preempt` drops the handle (the pipeline frees its KV cache blocks at once);
when the request is active again it is added anew with its prompt and generated tokens as the
prompt (recompute, as vLLM's), its remaining ``max_new_tokens``, and a seed derived from the
request's seed and its token count. A seeded sampled request is instead added anew as it first
was (its prompt, its seed, its whole budget) and the tokens it regenerates that the client
already has are checked and skipped, so its text is that of the request unpreempted; should
one differ (floating-point noise), it goes on from there the recompute way (logged at DEBUG).
See docs/llm.md.

``pipeline.step()`` releases the GIL (measured: a Python thread keeps running through it), so
the worker's I/O threads go on while a step runs. One thread drives the engine.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine_protocol import (
    EngineCapabilities,
    SampledLogprob,
    StepOutput,
    request_fault,
)
from inference_service.llm.openvino_settings import (
    KV_BLOCK_TOKENS,
    generation_config,
    kv_bytes_per_token,
    kv_cache_blocks,
)
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.prefix_cache import BLOCK_TOKENS, PrefixCacheTally
from inference_service.llm.request_state import RequestState, hand_over

log = logging.getLogger(__name__)

#: OpenVINO CPU properties that change results, set explicitly per weight format (docs/llm.md,
#: "Engines"); tests/e2e/test_llm_quality.py holds each format to its bar with them.
#: fp32: f32 compute and KV cache, the torch engine's greedy tokens (OpenVINO's CPU defaults, bf16
#: compute where the CPU has it and a u8 KV cache, changed 1 of 10 committed prompts at token 13).
#: int8: a u8 KV cache and activations quantized in groups of 32 (OpenVINO's CPU defaults;
#: perplexity +0.9 % over torch fp32, measured), compute in bf16 where the CPU has it.
#: int4: int8's.
QUALITY_PROPERTIES: dict[str, dict[str, Any]] = {
    "fp32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
    "int8": {"KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32},
    "int4": {"KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32},
}


@dataclass
class _Live:
    """A request in the engine: its state, its pipeline handle (``None`` while preempted)."""

    state: RequestState
    handle: Any
    pipeline_id: int
    replay: deque[int] = field(default_factory=deque)  # regenerated tokens still to check and skip
    exact: bool = True  # a seeded resubmission may replay from the start (False once one diverged)


class OpenVINOEngine:
    """Continuous batching on an OpenVINO IR directory (``openvino_model.xml`` and friends, as
    optimum-intel's exporter writes them).

    Args:
        ir_dir: the IR directory.
        tokenizer: the transformers tokenizer whose ids the IR was exported with (decoding);
            ``None``: given later to :meth:`set_tokenizer`, before the first :meth:`add` (the
            builder loads it while the pipeline compiles, which releases the GIL).
        eos_ids: end-of-sequence token ids.
        max_num_seqs: most requests the pipeline runs at once (the worker's ``batchSize``).
        max_num_batched_tokens: most tokens per step (prompt chunks plus one per decoding
            request; with ``dynamic_split_fuse`` a long prompt is split over steps).
        max_model_len: most tokens (prompt + generated) of one request; sizes
            :meth:`stats`' capacity together with ``max_num_seqs``.
        weight_format: the IR's weight format (``fp32``, ``int8``, ``int4``): picks
            :data:`QUALITY_PROPERTIES`.
        kv_cache_gb: size of the paged KV cache in GB (OpenVINO's ``cache_size``).
        threads: ``INFERENCE_NUM_THREADS`` (``None``: OpenVINO's choice, every core).
        enable_prefix_caching: reuse the KV blocks of a shared prompt prefix.
        properties: more OpenVINO properties, over :data:`QUALITY_PROPERTIES`.

    Raises:
        RuntimeError: OpenVINO cannot read or compile the IR (its message).
    """

    #: OpenVINO GenAI's presence and frequency penalties move a logit towards zero (a negative logit
    #: goes up), where OpenAI's rule, which the torch engine follows, always lowers it.
    #: Its prefix cache is one for every request: no per-request salt (without prefix caching, there
    #: is nothing to share, and ``cache_salt`` is honoured). Its ``logprobs`` are the sampled token's
    #: alone ("only single top logprob can be returned", GenerationConfig's own help).
    capabilities = EngineCapabilities("openvino", MappingProxyType({
        "presence_penalty": "its rule differs from OpenAI's",
        "frequency_penalty": "its rule differs from OpenAI's",
        "cache_salt": "its prefix cache is shared by every request; set 'enable_prefix_caching: false'",
        "top_logprobs": "OpenVINO GenAI gives the sampled token's log probability alone",
    }), default_batched_tokens=256)

    def __init__(self, ir_dir: str | Path, tokenizer: Any = None, eos_ids: Collection[int] = (), *,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, weight_format: str = "int8", kv_cache_gb: float | None = None,
                 threads: int | None = None,
                 enable_prefix_caching: bool = True, properties: dict[str, Any] | None = None) -> None:
        import openvino_genai

        config: dict[str, Any] = dict(QUALITY_PROPERTIES.get(weight_format, {}))
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        config.update(properties or {})
        self._token_bytes = kv_bytes_per_token(Path(ir_dir), config.get("KV_CACHE_PRECISION"))
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.cache_size = 0
        scheduler.num_kv_blocks = kv_cache_blocks(kv_cache_gb, self._token_bytes, max_num_seqs, max_model_len)
        scheduler.max_num_seqs = max_num_seqs or 256
        scheduler.max_num_batched_tokens = max(max_num_batched_tokens or self.capabilities.default_batched_tokens,
                                               max_num_seqs or 1)
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = enable_prefix_caching
        self.pipeline = openvino_genai.ContinuousBatchingPipeline(str(ir_dir), scheduler, "CPU", config)
        if not enable_prefix_caching:  # nothing shared: a salt is honoured
            unsupported = {k: v for k, v in self.capabilities.unsupported.items() if k != "cache_salt"}
            self.capabilities = replace(self.capabilities, unsupported=MappingProxyType(unsupported))
        self.tokenizer = tokenizer
        if not _has_vocabulary(self.pipeline):
            self.capabilities = replace(self.capabilities, unsupported=MappingProxyType({
                **self.capabilities.unsupported,
                "structured_outputs": "this model's OpenVINO IR has no detokenizer (openvino_detokenizer.xml), whose "
                                      "vocabulary the grammar needs"}))
        self.eos: frozenset[int] = frozenset(eos_ids)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill = None  # the pipeline schedules prefills itself
        self._requests: dict[str, _Live] = {}
        self._next_id = 0
        self._preempted_total = 0
        self.capacity_tokens = scheduler.num_kv_blocks * KV_BLOCK_TOKENS
        self.prefix_cache = PrefixCacheTally(scheduler.num_kv_blocks) if enable_prefix_caching else None
        self._prompt_tokens = 0  # prefix cache queries without a prefix cache
        needed = (max_num_seqs or 0) * (max_model_len or 0)
        if needed > self.capacity_tokens:
            log.warning("the KV cache holds %d tokens, less than batchSize x context (%d): OpenVINO preempts "
                        "requests on its own when it fills; those preemptions are not counted, and a seeded "
                        "sampled request preempted so may give another text (docs/llm.md, 'Engines')",
                        self.capacity_tokens, needed)

    def set_tokenizer(self, tokenizer: Any, eos_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids)

    # --- bookkeeping ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def keys(self) -> list[str]:
        return list(self._requests)

    def has(self, key: str) -> bool:
        return key in self._requests

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._requests

    def stats(self) -> SchedulerStats:
        """The counters of :meth:`GenerationEngine.stats`: ``running`` (scheduled in the last
        step), ``waiting`` (in the engine but not scheduled, preempted ones included),
        ``preempted_total``, ``kv_cache_used_tokens`` (the pipeline's cache use times its
        capacity), ``kv_cache_capacity_tokens`` (``max_num_seqs * max_model_len``) and the
        prefix cache's queries and hits (:class:`~inference_service.llm.prefix_cache.PrefixCacheTally`)."""
        metrics = self.pipeline.get_metrics()
        submitted = sum(1 for live in self._requests.values() if live.handle is not None)
        running = min(int(metrics.scheduled_requests), submitted)  # a preempted request is not
        used = int(round(float(metrics.cache_usage) / 100.0 * self.capacity_tokens))
        return SchedulerStats(
            running=running,
            waiting=len(self._requests) - running,
            preempted_total=self._preempted_total,
            kv_cache_used_tokens=used,
            kv_cache_allocated_tokens=used,  # paged: blocks, no padding
            kv_cache_capacity_tokens=self.capacity_tokens,
            prefix_cache_queries_total=self.prefix_cache.queries if self.prefix_cache else self._prompt_tokens,
            prefix_cache_hits_total=self.prefix_cache.hits if self.prefix_cache else 0,
        )

    # --- requests --------------------------------------------------------------------
    def check(self, params: GenerationParams) -> None:
        """Compile the request's structured output, if any, with the XGrammar the pipeline uses: a
        constraint that fails in the pipeline fails its step, for every request. Thread-safe.

        Raises:
            InvalidRequest: the constraint does not compile (names the field).
        """
        if params.structured_outputs is not None:
            from inference_service.llm.grammar import check_constraint

            check_constraint(params.structured_outputs)

    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request; the pipeline schedules its prefill from the next :meth:`step` on.

        Raises:
            ValueError: ``key`` is already in the engine, or ``prompt_ids`` is empty.
        """
        if key in self._requests:
            raise ValueError(f"request {key!r} is already in the engine")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        state = RequestState(key, [int(i) for i in prompt_ids], params, self.tokenizer, sampler=False)
        live = _Live(state, None, -1)
        self._submit(live)
        self._requests[key] = live
        if self.prefix_cache is None:
            self._prompt_tokens += len(state.prompt_ids)
        else:
            self.prefix_cache.lookup(state.prompt_ids)
            whole = len(state.prompt_ids) - len(state.prompt_ids) % BLOCK_TOKENS
            self.prefix_cache.remember(state.prompt_ids[:whole])  # its blocks are shared while it runs

    def _remember(self, state: RequestState) -> None:
        """A request left: its prompt's and output's KV stay in the prefix cache (the last sampled
        token was never computed)."""
        if self.prefix_cache is not None:
            self.prefix_cache.remember(state.prompt_ids + state.result.token_ids[:-1])

    def _submit(self, live: _Live) -> None:
        """Hand the request to the pipeline: its prompt (plus, after a preemption, the tokens it
        already generated) and what is left of its budget."""
        import numpy as np
        import openvino

        state = live.state
        known = state.result.token_ids + state.pending  # pending: drained at a preemption, not yet accepted
        params = state.params
        if known and live.exact and params.temperature > 0 and params.seed is not None:
            ids, config = state.prompt_ids, generation_config(params, 0, self.eos)  # as it first was
            live.replay = deque(known)
        else:
            ids, config = state.prompt_ids + known, generation_config(params, len(known), self.eos)
            live.replay.clear()
        self._next_id += 1
        live.pipeline_id = self._next_id
        live.handle = self.pipeline.add_request(
            live.pipeline_id, openvino.Tensor(np.asarray([ids], dtype=np.int64)), config
        )

    def cancel(self, key: str) -> GenerationResult | None:
        """Drop request ``key`` now (its KV cache blocks are freed by the pipeline's next step).

        Returns:
            Its result (``finish_reason`` ``"cancelled"``), or ``None`` for an unknown key.
        """
        live = self._requests.pop(key, None)
        if live is None:
            return None
        if live.handle is not None:
            live.handle.cancel()
        self._remember(live.state)
        return live.state.finish("cancelled")

    def preempt(self, key: str) -> bool:
        """Drop request ``key``'s pipeline handle and KV cache; it is added anew (recomputed)
        when it is active again. False when it is unknown, already preempted, or under a structured
        output (the pipeline holds its grammar state)."""
        live = self._requests.get(key)
        if live is None or live.handle is None or live.state.params.structured_outputs is not None:
            return False  # a structured output's grammar state lives in the pipeline: it keeps its cache
        self._drain(live)  # tokens already generated stay with the request
        live.handle.cancel()
        live.handle = None
        self._preempted_total += 1
        return True

    def close(self) -> None:
        for key in list(self._requests):
            self.cancel(key)

    # --- one step --------------------------------------------------------------------
    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """Run one pipeline step (when it has work), then collect the tokens of the active
        requests.

        Args:
            active: the keys whose tokens are collected (``None``: all). A preempted request
                in it is added anew first; one not in it keeps generating in the pipeline,
                its tokens held in its handle.

        Returns:
            ``{key: StepOutput}`` for the active requests that received tokens or ended;
            finished ones are removed from the engine.
        """
        keys = list(self._requests) if active is None else [k for k in active if k in self._requests]
        outputs: dict[str, StepOutput] = {}
        for key in keys:
            live = self._requests[key]
            if live.handle is None:
                try:
                    self._submit(live)
                except Exception as exc:  # noqa: BLE001 - the pipeline refused this request alone
                    outputs[key] = self._fail(key, exc)
        if self.pipeline.has_non_finished_requests():
            self.pipeline.step()
        for key in keys:
            if key in outputs:
                continue
            try:
                out = self._collect(self._requests[key])
            except Exception as exc:  # noqa: BLE001 - reading this request's output failed: it ends alone
                out = self._fail(key, exc)
            if out is not None:
                outputs[key] = out
                if out.finished and (gone := self._requests.pop(key, None)) is not None:
                    self._remember(gone.state)
        return outputs

    def _fail(self, key: str, exc: Exception) -> StepOutput:
        """End request ``key`` alone after the pipeline failed on it (its handle cancelled)."""
        live = self._requests.pop(key)
        if live.handle is not None:
            live.handle.cancel()
        return request_fault(key, exc)

    def _drain(self, live: _Live) -> tuple[list[int], bool]:
        """The tokens waiting in the request's handle, and whether the pipeline is done with it."""
        import openvino_genai

        handle = live.handle
        tokens: list[int] = []
        logprobs: list[float] = []
        while handle.can_read():
            for output in handle.read().values():
                tokens.extend(int(t) for t in output.generated_ids)
                logprobs.extend(float(p) for p in output.generated_log_probs)
        status = handle.get_status()
        done = status != openvino_genai.GenerationStatus.RUNNING and not handle.can_read()
        if live.replay:
            skipped = len(tokens)
            tokens = self._skip_replayed(live, tokens, done)
            if live.handle is not handle:  # diverged: resubmitted the recompute way
                return [], False
            logprobs = logprobs[skipped - len(tokens):]
        if tokens:
            live.state.pending.extend(tokens)
            if live.state.params.logprobs:
                live.state.pending_logprobs.extend(logprobs)
        return tokens, done

    def _skip_replayed(self, live: _Live, tokens: list[int], done: bool) -> list[int]:
        """Drop the regenerated tokens the request already has (checking each); on a mismatch,
        or if the pipeline ends before they are all regenerated, resubmit it the recompute way."""
        replay = live.replay
        taken = 0
        for token in tokens:
            if not replay:
                break
            if token != replay[0]:
                log.debug("request %s: its replay after a preemption diverged (%d, not %d) with %d tokens to "
                          "go; recomputing from there", live.state.key, token, replay[0], len(replay))
                return self._recompute(live)
            replay.popleft()
            taken += 1
        if replay and done:
            log.debug("request %s: its replay after a preemption ended early; recomputing", live.state.key)
            return self._recompute(live)
        return tokens[taken:]

    def _recompute(self, live: _Live) -> list[int]:
        """Drop the request's replaying handle and resubmit it with its tokens as the prompt."""
        live.handle.cancel()
        live.exact = False
        self._submit(live)
        return []

    def _collect(self, live: _Live) -> StepOutput | None:
        """Feed the request's new tokens to its state: its new text, and how it ended if it did."""
        _, done = self._drain(live)
        state = live.state
        pending, state.pending = state.pending, []
        scores, state.pending_logprobs = state.pending_logprobs, []
        entries = [SampledLogprob(t, p) for t, p in zip(pending, scores, strict=False)]  # scores may be short
        out, stopped = hand_over(state, pending, self.eos, entries, engine_done=done)  # done: the pipeline's rule
        if stopped:
            live.handle.cancel()
        return out


def _has_vocabulary(pipeline: Any) -> bool:
    """Whether the pipeline's tokenizer exposes its vocabulary (structured outputs need it)."""
    try:
        return bool(len(pipeline.get_tokenizer().get_vocab()))
    except RuntimeError:  # "Tokenizer vocab is empty": no detokenizer model
        return False
