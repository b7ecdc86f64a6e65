"""Batched token generation with continuous batching: many requests share one forward pass per step.

:class:`GenerationEngine` holds the requests of one model and puts together the two halves of
a step, as vLLM v1 does: the torch-free :class:`~inference_service.llm.scheduler.Scheduler`
plans it (who decodes, which prompt chunks prefill under the ``max_num_batched_tokens``
budget, who is paused or preempted) and the
:class:`~inference_service.llm.runner.ModelRunner` executes the plan on the model and samples.
The state of one request lives in :mod:`inference_service.llm.request_state`; the
one-request wrapper is :func:`~inference_service.llm.generation.generate_pieces`.

Requests join at any time (:meth:`GenerationEngine.add`), each :meth:`GenerationEngine.step`
advances the running ones by one token and computes prompt chunks of the newcomers (a prompt
longer than the budget is spread over several steps; its first token comes with its last
chunk), and a request leaves when it ends (end-of-sequence token, stop string,
``max_new_tokens``) or is cancelled (:meth:`GenerationEngine.cancel`).

A request left out of a step's ``active`` set is *paused* (e.g. its client reads more slowly
than it is generated): it keeps its KV cache and state and resumes later with exactly the
tokens it would have produced without the pause (its cache row holds one masked column per
step it misses). :meth:`GenerationEngine.preempt` drops a request's KV cache instead (vLLM's
recompute preemption): when it is active again its prompt and generated tokens are prefilled
again and it goes on where it stopped, with the same tokens up to floating-point near-ties.

For greedy decoding the tokens equal ``model.generate(prompt, do_sample=False)`` up to
floating-point near-ties, whatever the batch mates and the chunking. Each request samples on
its own (greedy, or temperature / top-p with its own generator seeded from
``params.seed``), with its own incremental decoder, stop strings, ``max_new_tokens`` and
``ignore_eos``.

The engine is not thread-safe: one thread drives it. Supported models: decoder-only
transformers causal LMs whose KV cache is a ``DynamicCache`` of full-attention layers (Llama,
Mistral, Qwen2/3, Phi, GPT-2, SmolLM ...); others raise ``TypeError`` at their first prefill.
torch and transformers are imported inside the functions that need them; this module imports
without them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine_protocol import EngineCapabilities, StepOutput, request_fault
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.request_state import RequestState, eos_token_ids
from inference_service.llm.runner import ModelRunner
from inference_service.llm.scheduler import PREEMPTED, PREFILLING, RUNNING, WAITING, Scheduler

log = logging.getLogger(__name__)


class GenerationEngine:
    """Generate for many requests at once with one batched KV cache (continuous batching).

    See the module docstring for what a step does. Typical use::

        engine = GenerationEngine(model, tokenizer)
        engine.add("a", prompt_ids_a, GenerationParams(max_new_tokens=32))
        engine.add("b", prompt_ids_b, GenerationParams(temperature=0.7, seed=1))
        while len(engine):
            for key, out in engine.step().items():
                ...  # out.piece, out.finished, out.result

    Args:
        model: a transformers decoder-only causal LM (``model(input_ids=[batch, seq],
            attention_mask=[batch, columns], position_ids=[batch, seq],
            past_key_values=DynamicCache, use_cache=True)`` returning ``.logits``
            ``[batch, seq, vocab]``), in eval mode.
        tokenizer: its tokenizer (decoding and the padding token id).
        eos_ids: end-of-sequence token ids; ``None`` means
            :func:`~inference_service.llm.request_state.eos_token_ids`.
        max_prefill: most requests with a prompt chunk in one step (``None``: no bound).
            Prefill costs about as much per prompt token batched or not on a CPU, so taking
            newcomers a few at a time lets the first of a burst get their first token sooner
            (and the running requests their next one) instead of all waiting for the
            whole burst's prefill.
        max_num_batched_tokens: most tokens in one step: one per decoding request plus the
            prompt-chunk tokens (vLLM's name); ``None``: whole prompts in one step.
        max_num_seqs: most requests running at once (the worker's ``batchSize``); with
            ``max_model_len`` it sizes :meth:`stats`' ``kv_cache_capacity_tokens``.
        max_model_len: most tokens (prompt + generated) of one request; ``None``: the
            model's ``config.max_position_embeddings``.
    """

    #: It honours every field; its step budget was chosen by measurement (benchmarks/RESULTS.md,
    #: "Issue 25: scheduler").
    capabilities = EngineCapabilities("torch", default_batched_tokens=64, on_gpu=True)

    def __init__(self, model: Any, tokenizer: Any, eos_ids: Collection[int] | None = None,
                 max_prefill: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_model_len is None:
            length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            max_model_len = length if isinstance(length, int) and length > 0 else None
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.scheduler = Scheduler(max_num_batched_tokens, max_prefill)
        self.max_prefill = max_prefill
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.model = model
        self.tokenizer = tokenizer
        self.eos: frozenset[int] = frozenset(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        if not isinstance(pad, int):
            pad = min(self.eos) if self.eos else 0
        self.pad_id: int = pad
        self.runner = ModelRunner(model, pad)
        self.runner.capacity_tokens = (max_num_seqs or 0) * (max_model_len or 0)
        self._requests: dict[str, RequestState] = {}
        self._prompt_tokens = 0  # prefix cache queries: it has no prefix cache, so never a hit
        self._grammars: Any = None  # llm.grammar.GrammarMasks, made for the first structured output
        self._grammars_lock = threading.Lock()

    # --- bookkeeping ---------------------------------------------------------------
    def __len__(self) -> int:
        """Number of requests in the engine (waiting, prefilling, running or preempted)."""
        return len(self._requests)

    def keys(self) -> list[str]:
        """The keys of all requests in the engine (waiting and preempted ones first)."""
        sched = self.scheduler
        return sched.keys(WAITING, PREEMPTED) + sched.keys(PREFILLING, RUNNING)

    def has(self, key: str) -> bool:
        """Whether request ``key`` is in the engine."""
        return key in self._requests

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.has(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def cache_shape(self) -> tuple[int, int]:
        """``(rows, columns)`` of the running KV cache; ``(0, 0)`` when nothing runs."""
        return self.runner.cache_shape

    def stats(self) -> SchedulerStats:
        """The engine's state now (vLLM's set): ``running`` (requests with a KV cache: decoding
        or part-way through their prefill), ``waiting`` (new or preempted, no KV cache),
        ``preempted_total`` (preemptions since the engine was built), ``kv_cache_used_tokens``
        (token positions cached for a request; padding not counted),
        ``kv_cache_allocated_tokens`` (the positions the caches take, padding included) and
        ``kv_cache_capacity_tokens`` (``max_num_seqs * max_model_len``; 0 when either is
        unknown); ``prefix_cache_queries_total`` counts the prompts' tokens and
        ``prefix_cache_hits_total`` stays 0 (no prefix cache)."""
        sched = self.scheduler
        running = len(sched.keys(RUNNING, PREFILLING))
        return SchedulerStats(
            running=running,
            waiting=len(self._requests) - running,
            preempted_total=sched.preempted_total,
            kv_cache_used_tokens=self.runner.used_tokens(),
            kv_cache_allocated_tokens=self.runner.allocated_tokens(),
            kv_cache_capacity_tokens=self.runner.capacity_tokens,
            prefix_cache_queries_total=self._prompt_tokens,
        )

    def _grammar_masks(self) -> Any:
        """The engine's XGrammar compiler and masks, made once (about 1 s: the vocabulary is read)."""
        with self._grammars_lock:
            if self._grammars is None:
                from inference_service.llm.grammar import GrammarMasks

                vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
                self._grammars = GrammarMasks(self.tokenizer, vocab if isinstance(vocab, int) else len(self.tokenizer),
                                              self.eos)
            return self._grammars

    def check(self, params: GenerationParams) -> None:
        """Compile the request's structured output, if any (cached for its :meth:`add`); thread-safe.

        Raises:
            InvalidRequest: the constraint does not compile (names the field).
        """
        if params.structured_outputs is not None:
            self._grammar_masks().compile(params.structured_outputs)

    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request; its prefill (and first token) starts at the next :meth:`step`
        that includes it.

        Args:
            key: the request's name in this engine (e.g. the request id).
            prompt_ids: its prompt token ids (non-empty).
            params: its generation options.

        Raises:
            ValueError: ``key`` is already in the engine, or ``prompt_ids`` is empty.
        """
        if self.has(key):
            raise ValueError(f"request {key!r} is already in the engine")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        request = RequestState(key, [int(i) for i in prompt_ids], params, self.tokenizer)
        if params.structured_outputs is not None:
            request.mask = self._grammar_masks().matcher(params.structured_outputs)
        self.scheduler.add(key, len(request.prompt_ids))
        self._requests[key] = request
        self._prompt_tokens += len(request.prompt_ids)

    def cancel(self, key: str) -> GenerationResult | None:
        """Drop request ``key`` now and free its KV cache.

        Returns:
            Its result (``finish_reason`` ``"cancelled"``, the held-back text as
            ``remaining_text``), or ``None`` if the engine has no such request.
        """
        request = self._requests.pop(key, None)
        if request is None:
            return None
        self.scheduler.remove(key)
        self.runner.free([key])
        return request.finish("cancelled")

    def preempt(self, key: str) -> bool:
        """Drop request ``key``'s KV cache now; it stays in the engine and, when it is active
        again, its prompt and generated tokens are recomputed (in prompt chunks, as a
        prefill) before it samples its next token. False when it holds no cache (unknown,
        not prefilled yet, or already preempted)."""
        if not self.scheduler.preempt(key):
            return False
        self.runner.free([key])
        return True

    def close(self) -> None:
        """Drop every request and free the KV cache."""
        for key in list(self._requests):
            self.scheduler.remove(key)
        self._requests.clear()
        self.runner.reset()

    # --- one step ------------------------------------------------------------------
    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """One step: a decode token for every active running request and prompt chunks
        for the active newcomers, as the scheduler plans them.

        Args:
            active: the keys that advance (``None``: all). A running request not in it is
                paused (keeps its state, produces nothing); a waiting or preempted one
                stays waiting. Unknown keys are ignored.

        Returns:
            ``{key: StepOutput}`` for every request that sampled a token (a request whose
            prompt chunk did not end its prefill has none); finished ones are already
            removed from the engine.

        Raises:
            TypeError: the model's KV cache is not a ``DynamicCache`` of full-attention
                layers.
            Exception: whatever the model's forward raises; the requests of the failed step
                are then dropped from the engine (their caches are half-updated).
        """
        plan = self.scheduler.schedule(active)
        if plan.empty:
            self.runner.free(plan.preempted)
            return {}
        try:
            tokens = self.runner.execute_model(plan, self._requests)
        except BaseException:
            for key in plan.decode + [c.key for c in plan.prefill]:
                self._requests.pop(key, None)
                self.scheduler.remove(key)
            self.runner.free(plan.decode + [c.key for c in plan.prefill])
            raise
        outputs: dict[str, StepOutput] = {}
        finished: list[str] = []
        failed = dict(self.runner.failed)  # sampling failed for these requests alone
        for key, token in tokens.items():
            request = self._requests[key]
            try:
                piece, reason = request.accept(token, self.eos)
            except Exception as exc:  # noqa: BLE001 - one request's fault ends that request alone
                failed[key] = exc
                continue
            if reason is None:
                outputs[key] = StepOutput(piece)
            else:
                outputs[key] = StepOutput(piece, True, request.finish(reason))
                finished.append(key)
                del self._requests[key]
            sampled = self.runner.logprobs.get(key)
            if sampled is not None and not request.ends_on(token, self.eos):
                outputs[key].logprobs.append(sampled)
        for key, cause in failed.items():
            outputs[key] = request_fault(key, cause)
            finished.append(key)
            self._requests.pop(key, None)
        self.scheduler.update(plan, finished)
        self.runner.commit(finished)
        self._bound(plan.paused)
        return outputs

    def _bound(self, paused: list[str]) -> None:
        """Keep the KV caches within ``kv_cache_capacity_tokens``: the runner compacts first;
        if they are still over, paused requests are preempted, the newest first."""
        runner = self.runner
        capacity = runner.capacity_tokens
        for key in reversed(paused):
            if not capacity or runner.allocated_tokens() <= capacity:
                return
            if self.preempt(key):
                log.info("request %s preempted: the KV cache is at its capacity", key)
