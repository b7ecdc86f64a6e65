"""Batched token generation with continuous batching: many requests share one forward pass per step.

This module holds the engine that runs many requests at once and what one step yields
(:class:`StepOutput`). The state of one request lives in
:mod:`inference_service.llm.request_state` (built from :mod:`~inference_service.llm.params`,
:mod:`~inference_service.llm.sampling` and :mod:`~inference_service.llm.text`), the KV-cache
helpers in :mod:`inference_service.llm.kv_cache`; the one-request wrapper is
:func:`~inference_service.llm.generation.generate_pieces`.

:class:`GenerationEngine` holds the requests of one model. Requests join at any time
(:meth:`GenerationEngine.add`), each :meth:`GenerationEngine.step` advances them by one
token, and a request leaves when it ends (end-of-sequence token, stop string,
``max_new_tokens``) or is cancelled (:meth:`GenerationEngine.cancel`). One step is:

1. **decode**: one forward pass over every running request at once, one new token
   each (input ``[batch, 1]``, the shared KV cache);
2. **prefill**: the requests added since the last step, left-padded to the longest
   prompt, in one forward pass of their own (``logits_to_keep=1`` where the model
   supports it), which samples their first token; their KV cache rows are then merged
   into the running cache (the shorter side padded on the left).

The running requests share one transformers ``DynamicCache`` of shape
``[batch, heads, columns, head_dim]`` per layer, with a 2-D ``attention_mask``
``[batch, columns]`` (1 = real token, 0 = padding) and per-row ``position_ids`` (the
number of real tokens before the token, i.e. ``cumsum(mask) - 1``), so a request's
tokens see exactly its own prompt and its own generated tokens, at the positions
``model.generate`` gives them: for greedy decoding the tokens equal
``model.generate(prompt, do_sample=False)`` up to floating-point near-ties, whatever
the batch mates. ``cache_position`` is passed to models whose ``forward`` still takes
it. Rows of finished or cancelled requests are removed from the cache at once, and
leading columns that are padding in every row are trimmed, so padding does not grow
without bound.

A request left out of a step's ``active`` set is *paused* (e.g. its client reads more
slowly than it is generated): its row gets a padding token with mask 0 and its
position does not advance, so it keeps its KV cache and state and resumes later with
exactly the tokens it would have produced without the pause. (Its row holds one masked column
per step it misses, until it finishes or is cancelled: the cache is one rectangle.)

Each request samples on its own: greedy (``argmax`` per row) or temperature / top-p
with its own CPU ``torch.Generator`` seeded from ``params.seed``; its own
:class:`~inference_service.llm.text.IncrementalDecoder`,
:class:`~inference_service.llm.text.StopStringFilter`, ``max_new_tokens`` and
``ignore_eos``.

Forward passes run under ``torch.inference_mode()`` inside :meth:`GenerationEngine.step`
only, so no inference-mode state leaks to the caller. The engine is not thread-safe:
one thread drives it.

Supported models: decoder-only transformers causal LMs whose KV cache is a
``DynamicCache`` of full-attention layers (Llama, Mistral, Qwen2/3, Phi, GPT-2,
SmolLM ...; sliding-window models keep the whole context, which is correct but uses
more memory). Models with recurrent or linear-attention state raise ``TypeError`` at
their first prefill.

torch and transformers are imported inside the functions that need them; this module
imports without them.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from inference_service.llm.kv_cache import cache_keyword, check_cache, output_cache, pad_left, select_rows
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.request_state import RequestState, eos_token_ids
from inference_service.llm.sampling import sample_next_token


@dataclass
class StepOutput:
    """What one :meth:`GenerationEngine.step` produced for one request.

    Attributes:
        piece: newly released text (possibly ``""``: e.g. an incomplete character or a
            possible stop-string prefix is held back).
        finished: the request ended in this step and was removed from the engine.
        result: when finished, how it ended; its ``remaining_text`` is the tail released
            only at the end (not part of ``piece``), as
            :func:`~inference_service.llm.generation.generate_pieces` returns it.
    """

    piece: str = ""
    finished: bool = False
    result: GenerationResult | None = None


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
        max_prefill: most waiting requests prefilled in one step (``None``: all of them).
            Prefill costs about as much per prompt token batched or not on a CPU, so taking
            newcomers a few at a time lets the first of a burst get their first token sooner
            (and the running requests their next one) instead of all waiting for the
            whole burst's prefill.
        max_num_seqs: most requests running at once (the worker's ``batchSize``); with
            ``max_model_len`` it sizes :meth:`stats`' ``kv_cache_capacity_tokens``.
        max_model_len: most tokens (prompt + generated) of one request; ``None``: the
            model's ``config.max_position_embeddings``.
    """

    def __init__(self, model: Any, tokenizer: Any, eos_ids: Collection[int] | None = None,
                 max_prefill: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None) -> None:
        if max_prefill is not None and max_prefill < 1:
            raise ValueError(f"max_prefill must be at least 1, got {max_prefill}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_model_len is None:
            length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            max_model_len = length if isinstance(length, int) and length > 0 else None
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.max_prefill = max_prefill
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._preempted_total = 0
        self.model = model
        self.tokenizer = tokenizer
        self.eos: frozenset[int] = frozenset(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        accepted = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in accepted
        self._takes_position_ids = "position_ids" in accepted
        self._takes_cache_position = "cache_position" in accepted
        self._cache_keyword = cache_keyword(model.forward)
        pad = getattr(tokenizer, "pad_token_id", None)
        if not isinstance(pad, int):
            pad = min(self.eos) if self.eos else 0
        self.pad_id: int = pad
        self._waiting: dict[str, RequestState] = {}  # added, not yet prefilled (insertion order)
        self._rows: list[RequestState] = []  # running requests, in the cache's row order
        self._row_of: dict[str, int] = {}  # key -> row index
        self._cache: Any = None  # DynamicCache of the running rows
        self._mask: Any = None  # [rows, columns] long: 1 real token, 0 padding
        self._positions: Any = None  # [rows] long: position id of each row's next token

    # --- bookkeeping ---------------------------------------------------------------
    def __len__(self) -> int:
        """Number of requests in the engine (waiting for prefill or running)."""
        return len(self._waiting) + len(self._rows)

    def keys(self) -> list[str]:
        """The keys of all requests in the engine (waiting ones first)."""
        return list(self._waiting) + [r.key for r in self._rows]

    def has(self, key: str) -> bool:
        """Whether request ``key`` is in the engine."""
        return key in self._waiting or key in self._row_of

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.has(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def cache_shape(self) -> tuple[int, int]:
        """``(rows, columns)`` of the running KV cache; ``(0, 0)`` when nothing runs."""
        if self._mask is None:
            return (0, 0)
        return (int(self._mask.shape[0]), int(self._mask.shape[1]))

    def stats(self) -> dict[str, int]:
        """Counters for metrics, vLLM's set: ``running`` (requests with a KV cache row),
        ``waiting`` (added, not yet prefilled), ``preempted_total`` (preemptions since the
        engine was built: a request's KV cache dropped, to be recomputed),
        ``kv_cache_used_tokens`` (token positions whose keys/values the cache holds for a
        request; padding not counted) and ``kv_cache_capacity_tokens`` (``max_num_seqs *
        max_model_len``: the most tokens the cache may hold at once; 0 when either is
        unknown)."""
        used = int(self._mask.sum()) if self._mask is not None else 0
        capacity = (self.max_num_seqs or 0) * (self.max_model_len or 0)
        return {
            "running": len(self._rows),
            "waiting": len(self._waiting),
            "preempted_total": self._preempted_total,
            "kv_cache_used_tokens": used,
            "kv_cache_capacity_tokens": capacity,
        }

    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request; its prefill (and first token) happens at the next :meth:`step`
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
        self._waiting[key] = RequestState(key, [int(i) for i in prompt_ids], params, self.tokenizer)

    def cancel(self, key: str) -> GenerationResult | None:
        """Drop request ``key`` now and free its KV cache row.

        Returns:
            Its result (``finish_reason`` ``"cancelled"``, the held-back text as
            ``remaining_text``), or ``None`` if the engine has no such request.
        """
        request = self._waiting.pop(key, None)
        if request is None:
            row = self._row_of.get(key)
            if row is None:
                return None
            request = self._rows[row]
            self._remove_rows({row})
        return request.finish("cancelled")

    def close(self) -> None:
        """Drop every request and free the KV cache."""
        self._waiting.clear()
        self._reset_running()

    # --- one step ------------------------------------------------------------------
    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """Advance the requests by one token: a batched decode step for the running ones,
        then one batched prefill for the newly added ones.

        Args:
            active: the keys that advance (``None``: all). A running request not in it is
                paused (keeps its state, produces nothing); a newly added one not in it
                stays waiting. Unknown keys are ignored.

        Returns:
            ``{key: StepOutput}`` for every request that advanced; finished ones are
            already removed from the engine.

        Raises:
            TypeError: the model's KV cache is not a ``DynamicCache`` of full-attention
                layers.
            Exception: whatever the model's forward raises; the engine stays consistent
                (the failed step is rolled back, requests that were to be prefilled stay
                waiting).
        """
        import torch

        selected = None if active is None else set(active)
        outputs: dict[str, StepOutput] = {}
        # inference mode only around the forward passes, never across the caller's code
        with torch.inference_mode():
            if self._rows:
                self._decode(selected, outputs)
            new = [r for k, r in self._waiting.items() if selected is None or k in selected]
            if self.max_prefill is not None:
                new = new[:self.max_prefill]  # the oldest first; the rest wait for the next steps
            if new:
                self._prefill(new, outputs)
        return outputs

    def _decode(self, selected: set[str] | None, outputs: dict[str, StepOutput]) -> None:
        import torch

        rows = self._rows
        flags = [selected is None or r.key in selected for r in rows]
        if not any(flags):
            return
        device = self.device
        step_mask = torch.tensor(flags, dtype=torch.long, device=device)
        tokens_in = [[r.last_token if f else self.pad_id] for r, f in zip(rows, flags, strict=True)]
        input_ids = torch.tensor(tokens_in, dtype=torch.long, device=device)
        columns = self._mask.shape[1]
        mask = torch.cat([self._mask, step_mask.unsqueeze(1)], dim=1)
        try:
            logits = self._forward(input_ids, mask, self._positions.unsqueeze(1), self._cache, columns)
        except BaseException:
            self._crop_cache(columns)  # layers the failed pass already extended
            raise
        self._mask = mask
        self._positions = self._positions + step_mask
        advanced = [i for i, f in enumerate(flags) if f]
        tokens = self._choose(logits, advanced, rows)
        done: set[int] = set()
        for i, token in zip(advanced, tokens, strict=True):
            request = rows[i]
            piece, reason = request.accept(token, self.eos)
            if reason is None:
                outputs[request.key] = StepOutput(piece)
            else:
                outputs[request.key] = StepOutput(piece, True, request.finish(reason))
                done.add(i)
        if done:
            self._remove_rows(done)

    def _prefill(self, new: list[RequestState], outputs: dict[str, StepOutput]) -> None:
        import torch
        from transformers import DynamicCache

        device = self.device
        width = max(len(r.prompt_ids) for r in new)
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(new), width), dtype=torch.long, device=device)
        for i, request in enumerate(new):
            n = len(request.prompt_ids)
            ids[i, width - n :] = torch.tensor(request.prompt_ids, dtype=torch.long, device=device)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache, 0)
        check_cache(cache)
        for request in new:
            del self._waiting[request.key]
        tokens = self._choose(logits, list(range(len(new))), new)
        keep: list[int] = []
        for i, (request, token) in enumerate(zip(new, tokens, strict=True)):
            piece, reason = request.accept(token, self.eos)
            if reason is None:
                outputs[request.key] = StepOutput(piece)
                keep.append(i)
            else:
                outputs[request.key] = StepOutput(piece, True, request.finish(reason))
        if not keep:
            return
        if len(keep) < len(new):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            select_rows(cache, index)
            mask = mask.index_select(0, index)
        self._merge([new[i] for i in keep], cache, mask)

    def _forward(self, input_ids: Any, mask: Any, positions: Any, cache: Any, past_columns: int) -> Any:
        """One forward pass; returns the last position's logits ``[batch, vocab]``."""
        import torch

        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            self._cache_keyword: cache,
            "use_cache": True,
        }
        if self._takes_position_ids:
            kwargs["position_ids"] = positions
        if self._takes_cache_position:
            kwargs["cache_position"] = torch.arange(
                past_columns, past_columns + input_ids.shape[1], dtype=torch.long, device=input_ids.device
            )
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # no lm_head over the whole prompt
        out = self.model(**kwargs)
        if output_cache(out) is not cache:
            raise TypeError("the model did not fill the DynamicCache it was given; its cache layout is unsupported")
        return out.logits[:, -1, :]

    def _choose(self, logits: Any, indices: list[int], requests: Sequence[RequestState]) -> list[int]:
        """The next token of each row in ``indices`` (``requests[i]`` samples row ``i``)."""
        greedy = None
        tokens = []
        for i in indices:
            params = requests[i].params
            if params.temperature <= 0.0:
                if greedy is None:
                    greedy = logits.argmax(dim=-1).tolist()
                tokens.append(int(greedy[i]))
            else:
                tokens.append(sample_next_token(logits[i], params.temperature, params.top_p, requests[i].generator))
        return tokens

    # --- the running cache -----------------------------------------------------------
    def _merge(self, requests: list[RequestState], cache: Any, mask: Any) -> None:
        """Append freshly prefilled rows to the running cache (left-padding the shorter side)."""
        import torch

        positions = mask.sum(dim=1)
        if self._cache is None:
            self._cache, self._mask, self._positions = cache, mask, positions
        else:
            old_cols, new_cols = self._mask.shape[1], mask.shape[1]
            width = max(old_cols, new_cols)
            for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
                old_layer.keys = torch.cat(
                    [pad_left(old_layer.keys, width - old_cols), pad_left(new_layer.keys, width - new_cols)]
                )
                old_layer.values = torch.cat(
                    [pad_left(old_layer.values, width - old_cols), pad_left(new_layer.values, width - new_cols)]
                )
            self._mask = torch.cat([pad_left(self._mask, width - old_cols), pad_left(mask, width - new_cols)])
            self._positions = torch.cat([self._positions, positions])
        for request in requests:
            self._row_of[request.key] = len(self._rows)
            self._rows.append(request)

    def _remove_rows(self, rows: Collection[int]) -> None:
        """Drop cache rows (finished or cancelled requests), then trim all-padding leading columns."""
        import torch

        keep = [i for i in range(len(self._rows)) if i not in rows]
        if not keep:
            self._reset_running()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        select_rows(self._cache, index)
        self._mask = self._mask.index_select(0, index)
        self._positions = self._positions.index_select(0, index)
        self._rows = [self._rows[i] for i in keep]
        self._row_of = {r.key: i for i, r in enumerate(self._rows)}
        used = self._mask.any(dim=0)
        first = int(used.to(torch.int8).argmax())  # first column some row still uses
        if first > 0:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]
            self._mask = self._mask[:, first:]

    def _crop_cache(self, columns: int) -> None:
        """Cut every layer back to ``columns`` columns (undo a failed forward pass)."""
        if self._cache is None:
            return
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > columns:
                layer.keys = layer.keys[:, :, :columns, :]
                layer.values = layer.values[:, :, :columns, :]

    def _reset_running(self) -> None:
        self._rows = []
        self._row_of = {}
        self._cache = self._mask = self._positions = None
