"""The llama.cpp engine (``engine: llamacpp``): a GGUF file served as it is, through llama.cpp's C API
(``llama-cpp-python``'s binding) in the worker.

Continuous batching over llama.cpp's parallel sequences: one context whose KV cache all requests
share (``kv_unified``), each running request holding one sequence id. Every :meth:`LlamaCppEngine.step`
is one ``llama_decode`` of one batch: a token for each decoding request, then prompt tokens of new
(or preempted) requests up to ``max_num_batched_tokens`` (chunked prefill). A request joins at any
step, and leaving (finished, cancelled, preempted) frees its sequence at once (``llama_memory_seq_rm``).
When the cache has no room for a batch, the request that arrived last is preempted and recomputed
later, as vLLM's recompute preemption.

Sampling is llama.cpp's sampler chain per request (top-k, temperature, top-p, a seeded
distribution; greedy at temperature 0). What must be the same on every engine is ours, on the
logits llama.cpp leaves in its buffer before it samples: the penalties (:func:`~inference_service.
llm.sampling.penalize`), structured outputs (XGrammar's masks over llama.cpp's vocabulary, as on the
torch engine), log probabilities of the raw distribution, the text, stop strings and end-of-sequence
rules (:class:`~inference_service.llm.request_state.RequestState`).
"""

from __future__ import annotations

import ctypes
import logging
import secrets
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine_protocol import EngineCapabilities, SampledLogprob, StepOutput, request_fault
from inference_service.llm.llamacpp_model import GGUFModel, GGUFTokenizer
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.request_state import RequestState, hand_over
from inference_service.llm.sampling import needs_logit_processing

log = logging.getLogger(__name__)

#: llama.cpp's "pick a random seed" value of ``llama_sampler_init_dist``.
_RANDOM_SEED = 0xFFFFFFFF


@dataclass
class _Live:
    """A request in the engine: its state, its llama.cpp sequence (``None``: none held) and how many of
    its tokens (prompt, then generated) that sequence's KV cache holds."""

    state: RequestState
    order: int
    seq: int | None = None
    n_past: int = 0
    sampler: Any = None


class LlamaCppEngine:
    """Continuous batching on llama.cpp (see the module docstring).

    Args:
        model: the GGUF, loaded.
        tokenizer: its tokenizer (:class:`~inference_service.llm.llamacpp_model.GGUFTokenizer`).
        max_num_seqs: most requests holding a sequence at once (the worker's ``batchSize``).
        max_num_batched_tokens: most tokens of one step (one ``llama_decode``).
        kv_cache_tokens: token positions of the shared KV cache (all sequences together).
        threads: llama.cpp's threads (``None``: its default).

    Raises:
        ValueError: llama.cpp cannot make a context of this size.
    """

    #: every field: no prefix cache is shared between requests, so ``cache_salt`` holds trivially
    capabilities = EngineCapabilities("llamacpp", default_batched_tokens=512, on_cpu=True, on_gpu=False)

    def __init__(self, model: GGUFModel, tokenizer: GGUFTokenizer, *, max_num_seqs: int | None,
                 max_num_batched_tokens: int, kv_cache_tokens: int, threads: int | None) -> None:
        ll = self.ll = model.ll
        self.model = model
        self.tokenizer = tokenizer
        self.eos: frozenset[int] = tokenizer.eos_ids
        self.max_num_seqs: int | None = max_num_seqs or 1
        self.max_prefill = None  # prompts share the step's token budget, chunked
        self.n_ctx = int(kv_cache_tokens)
        self.max_model_len: int | None = min(model.n_ctx_train, self.n_ctx) if model.n_ctx_train > 0 else self.n_ctx
        self.step_tokens = max(int(max_num_batched_tokens), self.max_num_seqs)
        params = ll.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = params.n_ubatch = self.step_tokens
        params.n_seq_max = self.max_num_seqs
        params.kv_unified = True
        params.no_perf = True
        if threads:
            params.n_threads = params.n_threads_batch = int(threads)
        self.ctx = ll.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot make a context of {self.n_ctx} tokens for {self.max_num_seqs} "
                             "sequences")
        self.memory = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(self.step_tokens, 0, 1)
        self._requests: dict[str, _Live] = {}
        self._free = list(range(self.max_num_seqs - 1, -1, -1))
        self._order = 0
        self._preempted_total = 0
        self._masks: Any = None
        self._masks_lock = threading.Lock()

    # --- bookkeeping ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def keys(self) -> list[str]:
        return list(self._requests)

    def has(self, key: str) -> bool:
        return key in self._requests

    def stats(self) -> SchedulerStats:
        """``running`` (requests holding a sequence), ``waiting`` (the others), ``preempted_total``,
        ``kv_cache_used_tokens`` (positions the sequences hold; unified cache: no padding) and the
        cache's capacity (``n_ctx``)."""
        running = sum(1 for live in self._requests.values() if live.seq is not None)
        used = sum(live.n_past for live in self._requests.values())
        return SchedulerStats(running=running, waiting=len(self._requests) - running,
                              preempted_total=self._preempted_total, kv_cache_used_tokens=used,
                              kv_cache_allocated_tokens=used, kv_cache_capacity_tokens=self.n_ctx)

    # --- requests --------------------------------------------------------------------
    def _grammar_masks(self) -> Any:
        """XGrammar's compiler over llama.cpp's vocabulary, made once (the vocabulary is read)."""
        with self._masks_lock:
            if self._masks is None:
                from inference_service.llm.grammar import GrammarMasks

                self._masks = GrammarMasks(self.tokenizer, self.model.n_vocab, self.eos)
            return self._masks

    def check(self, params: GenerationParams) -> None:
        """Compile a structured output's grammar (cached for :meth:`add`); InvalidRequest naming the
        field when it does not compile. Thread-safe: runs beside the step loop."""
        if params.structured_outputs is not None:
            self._grammar_masks().compile(params.structured_outputs)

    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request; it is prefilled from the next :meth:`step` on.

        Raises:
            ValueError: ``key`` is already in the engine, ``prompt_ids`` is empty, or prompt plus
                ``max_new_tokens`` exceed ``max_model_len``.
        """
        if key in self._requests:
            raise ValueError(f"request {key!r} is already in the engine")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_model_len is not None and len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceed "
                             f"the engine's context ({self.max_model_len})")
        state = RequestState(key, [int(i) for i in prompt_ids], params, self.tokenizer, sampler=False)
        if params.structured_outputs is not None:
            state.mask = self._grammar_masks().matcher(params.structured_outputs)
        self._order += 1
        self._requests[key] = _Live(state, self._order, sampler=self._sampler(params))

    def _sampler(self, params: GenerationParams) -> Any:
        """llama.cpp's sampler chain of a request (its penalties and constraint are applied before)."""
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
        if params.top_p < 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
        seed = params.seed % _RANDOM_SEED if params.seed is not None else secrets.randbelow(_RANDOM_SEED)
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        return chain

    def _release(self, live: _Live) -> None:
        """Free the request's sequence (its KV cache); it keeps its tokens for a recompute."""
        if live.seq is not None:
            self.ll.llama_memory_seq_rm(self.memory, live.seq, -1, -1)
            self._free.append(live.seq)
        live.seq, live.n_past = None, 0

    def _drop(self, key: str) -> _Live | None:
        live = self._requests.pop(key, None)
        if live is not None:
            self._release(live)
            if live.sampler is not None:
                self.ll.llama_sampler_free(live.sampler)
                live.sampler = None
        return live

    def cancel(self, key: str) -> GenerationResult | None:
        """Drop request ``key`` now, its sequence freed; its result (``finish_reason`` ``"cancelled"``),
        or ``None`` for an unknown key."""
        live = self._drop(key)
        return live.state.finish("cancelled") if live is not None else None

    def preempt(self, key: str) -> bool:
        """Free request ``key``'s sequence; it is recomputed when it is active again (False: it held none)."""
        live = self._requests.get(key)
        if live is None or live.seq is None:
            return False
        self._release(live)
        self._preempted_total += 1
        return True

    def close(self) -> None:
        for key in list(self._requests):
            self._drop(key)
        if self.ctx:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None
        self.model.close()

    # --- one step --------------------------------------------------------------------
    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """One ``llama_decode`` of the active requests: a token for each one decoding, then prompt
        tokens up to the step's budget; then one token sampled for each request whose prompt is
        all in the cache.

        Returns:
            ``{key: StepOutput}`` for the requests that produced text or ended; finished ones are
            removed. A failure of ``llama_decode`` itself propagates (RuntimeError).
        """
        keys = list(self._requests) if active is None else [k for k in active if k in self._requests]
        outputs: dict[str, StepOutput] = {}
        while True:
            plan = self._plan(keys)
            if not plan:
                return outputs
            rc = self._decode(plan)
            if rc == 0:
                break
            if rc != 1:
                raise RuntimeError(f"llama_decode failed ({rc})")
            victim = max((self._requests[k] for k, _ in plan), key=lambda live: live.order)
            self._release(victim)  # no room in the KV cache: the latest request waits, recomputed
            self._preempted_total += 1
            keys = [k for k in keys if k != victim.state.key]
        row = 0
        for key, count in plan:
            live = self._requests[key]
            live.n_past += count
            row += count
            if live.n_past < len(live.state.prompt_ids) + len(live.state.result.token_ids):
                continue  # a chunk of its prompt: no token yet
            try:
                token, sampled = self._sample(live, row - 1)
            except Exception as exc:  # noqa: BLE001 - one request's fault ends that request alone
                self._drop(key)
                outputs[key] = request_fault(key, exc)
                continue
            out, stopped = hand_over(live.state, [token], self.eos, sampled, engine_done=False)
            if out is not None:
                outputs[key] = out
                if out.finished:
                    self._drop(key)
        return outputs

    def _plan(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """``[(key, tokens fed this step)]``: decoding requests first (one token each), then prompts
        (new or preempted requests, by arrival) in chunks up to the step's token budget."""
        budget = self.step_tokens
        decoding: list[tuple[_Live, int]] = []
        prefilling: list[tuple[_Live, int]] = []
        for key in keys:
            live = self._requests[key]
            todo = len(live.state.prompt_ids) + len(live.state.result.token_ids) - live.n_past
            (decoding if live.seq is not None and todo == 1 else prefilling).append((live, todo))
        plan = []
        for live, _ in decoding:
            plan.append((live.state.key, 1))
            budget -= 1
        for live, todo in sorted(prefilling, key=lambda item: item[0].order):
            if budget <= 0:
                break
            if live.seq is None:
                if not self._free:
                    continue
                live.seq = self._free.pop()
            count = min(todo, budget)
            plan.append((live.state.key, count))
            budget -= count
        return plan

    def _decode(self, plan: Sequence[tuple[str, int]]) -> int:
        """Fill the batch with the plan's tokens (logits for each request's last) and decode it."""
        batch = self.batch
        i = 0
        for key, count in plan:
            live = self._requests[key]
            tokens = live.state.all_tokens()
            start = live.n_past
            for position in range(start, start + count):
                batch.token[i] = tokens[position]
                batch.pos[i] = position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = live.seq
                batch.logits[i] = position == len(tokens) - 1
                i += 1
        batch.n_tokens = i
        return int(self.ll.llama_decode(self.ctx, batch))

    def _sample(self, live: _Live, row: int) -> tuple[int, list[SampledLogprob]]:
        """The request's next token from batch row ``row``'s logits, after its penalties and
        constraint; with its log probability when it asks for them."""
        state, params = live.state, live.state.params
        raw = None
        if needs_logit_processing(params) or state.mask is not None or params.logprobs:
            import numpy as np
            import torch

            pointer = self.ll.llama_get_logits_ith(self.ctx, row)
            view = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                         shape=(self.model.n_vocab,))
            logits = torch.from_numpy(view)  # llama.cpp's own buffer: changed in place, then sampled
            if params.logprobs:
                raw = logits.clone()
            if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
                from inference_service.llm.sampling import penalize

                logits.copy_(penalize(logits, params, state.prompt_ids, state.result.token_ids))
            if state.mask is not None:
                state.mask.apply(logits)
        token = int(self.ll.llama_sampler_sample(live.sampler, self.ctx, row))
        if raw is None:
            return token, []
        from inference_service.llm.sampling import sampled_logprob

        return token, [sampled_logprob(raw, token, params.top_logprobs)]
