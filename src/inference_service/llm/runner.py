"""The model runner: executes a :class:`~inference_service.llm.scheduler.SchedulerOutput` on the
model and samples (the part of vLLM v1's ``ModelRunner.execute_model``).

The runner holds the KV caches:

- the **running cache**, one transformers ``DynamicCache`` for every request that decodes,
  ``[rows, heads, columns, head_dim]`` per layer, with a 2-D ``attention_mask``
  ``[rows, columns]`` (1 = real token, 0 = padding) and per-row ``position_ids`` (the number
  of real tokens before the token), so a request's tokens see exactly its own tokens at the
  positions ``model.generate`` gives them. A decode step is one forward pass over all rows
  (input ``[rows, 1]``); a paused row gets a padding token with mask 0 and its position does
  not advance. Rows of finished, cancelled or preempted requests are removed at once and
  leading columns that are padding in every row are trimmed. Each step a paused row gets
  one masked column, so the columns can outgrow the longest request; when more than a
  quarter of them are such excess (or rows x columns pass ``capacity_tokens``) the runner
  packs every row's real columns to the right (:meth:`ModelRunner.compact`): the cache is
  then as wide as its longest request again.
- a **prefill cache** per request part-way through its prefill (``[1, heads, computed,
  head_dim]``): each prompt chunk is one forward pass ``[1, chunk]`` over it. When the last
  chunk is computed the request samples its next token and, unless it finished, its cache
  joins the running cache as a new row (the shorter side padded on the left).

Sampling: greedy (``argmax``) or temperature / top-p with the request's own seeded CPU
``torch.Generator`` (:func:`~inference_service.llm.sampling.sample_next_token`).

Forward passes run under ``torch.inference_mode()`` (the caller's :meth:`ModelRunner.execute_model`
wraps them); torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from inference_service.llm.engine_protocol import SampledLogprob
from inference_service.llm.kv_cache import cache_keyword, check_cache, output_cache, pad_left, select_rows
from inference_service.llm.request_state import RequestState
from inference_service.llm.sampling import needs_logit_processing, penalize, sample_next_token, sampled_logprob
from inference_service.llm.scheduler import PrefillChunk, SchedulerOutput

__all__ = ["ModelRunner"]


class ModelRunner:
    """Run planned steps on one model (see the module docstring).

    Args:
        model: a transformers decoder-only causal LM in eval mode whose KV cache is a
            ``DynamicCache`` of full-attention layers.
        pad_id: the token fed to paused rows (masked out).
    """

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        accepted = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in accepted
        self._takes_position_ids = "position_ids" in accepted
        self._takes_cache_position = "cache_position" in accepted
        self._cache_keyword = cache_keyword(model.forward)
        self.rows: list[str] = []  # keys of the running cache's rows, in row order
        self._row_of: dict[str, int] = {}
        self._cache: Any = None  # DynamicCache of the running rows
        self._mask: Any = None  # [rows, columns] long: 1 real token, 0 padding
        self._positions: Any = None  # [rows] long: position id of each row's next token
        self._prefill: dict[str, Any] = {}  # key -> DynamicCache of a partly prefilled request
        self._ready: dict[str, Any] = {}  # key -> cache of a request whose prefill ended this step
        self.capacity_tokens = 0  # rows x columns above which the running cache is compacted (0: no bound)
        self.failed: dict[str, Exception] = {}  # requests whose sampling failed in the last step
        self.logprobs: dict[str, SampledLogprob] = {}  # the last step's tokens of requests asking for them

    # --- state -------------------------------------------------------------------------
    @property
    def cache_shape(self) -> tuple[int, int]:
        """``(rows, columns)`` of the running cache; ``(0, 0)`` when nothing runs."""
        if self._mask is None:
            return (0, 0)
        return (int(self._mask.shape[0]), int(self._mask.shape[1]))

    def used_tokens(self) -> int:
        """Token positions whose keys/values are cached for a request (padding not counted)."""
        used = int(self._mask.sum()) if self._mask is not None else 0
        for cache in self._prefill.values():
            used += int(cache.layers[0].keys.shape[-2]) if cache.layers else 0
        return used

    def allocated_tokens(self) -> int:
        """Token positions the KV caches take, padding included (rows x columns of the running
        cache plus the prefill caches)."""
        rows, columns = self.cache_shape
        allocated = rows * columns
        for cache in self._prefill.values():
            allocated += int(cache.layers[0].keys.shape[-2]) if cache.layers else 0
        return allocated

    def longest(self) -> int:
        """Real tokens of the longest row of the running cache (0 when nothing runs)."""
        return int(self._positions.max()) if self._positions is not None else 0

    def compact(self) -> None:
        """Pack each row's real columns to the right of the running cache, dropping the masked
        columns paused steps left between them: the cache is then as wide as its longest row.
        Keys keep their positions (they were rotated at their position ids when computed)."""
        import torch

        if self._mask is None:
            return
        width = self.longest()
        columns = int(self._mask.shape[1])
        if width >= columns:
            return
        # a stable sort puts each row's padding first and its real columns last, in order
        order = torch.sort(self._mask, dim=1, stable=True).indices[:, columns - width:]
        self._mask = torch.gather(self._mask, 1, order)
        for layer in self._cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.gather(layer.keys, 2, index)
            layer.values = torch.gather(layer.values, 2, index)

    def _bound(self) -> None:
        """Compact the running cache when too much of its width is excess padding."""
        if self._mask is None:
            return
        rows, columns = self.cache_shape
        excess = columns - self.longest()
        over = bool(self.capacity_tokens) and rows * columns > self.capacity_tokens
        if (excess >= 16 and excess * 4 > columns) or (excess > 0 and over):
            self.compact()

    def free(self, keys: Collection[str]) -> None:
        """Drop the caches of ``keys`` (finished, cancelled, preempted); unknown keys are ignored."""
        for key in keys:
            self._prefill.pop(key, None)
            self._ready.pop(key, None)
        rows = {self._row_of[k] for k in keys if k in self._row_of}
        if rows:
            self._remove_rows(rows)

    def reset(self) -> None:
        """Drop every cache."""
        self.rows = []
        self._row_of = {}
        self._cache = self._mask = self._positions = None
        self._prefill.clear()
        self._ready.clear()

    # --- one step ----------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput, requests: Mapping[str, RequestState]) -> dict[str, int]:
        """Run one planned step: drop the preempted caches, one decode pass over the running
        rows (``plan.decode`` advance, the other rows are padded), then one pass per prompt
        chunk.

        Returns:
            ``{key: sampled token}`` for every decoded request and every request whose last
            chunk was computed, but those whose sampling raised: they are in :attr:`failed`
            (key -> exception) until the next step. Call :meth:`commit` once the tokens are
            accepted, with the failed keys among the finished ones.

        Raises:
            TypeError: the model's KV cache is not a ``DynamicCache`` of full-attention layers.
            Exception: what the model raises; the caches of the step's requests are then
                inconsistent and the caller must :meth:`free` them.
        """
        import torch

        self.free(plan.preempted)
        self.failed = {}
        self.logprobs = {}
        tokens: dict[str, int] = {}
        with torch.inference_mode():
            if plan.decode:
                self._decode(set(plan.decode), requests, tokens)
            for chunk in plan.prefill:
                self._prefill_chunk(chunk, requests[chunk.key], tokens)
        return tokens

    def commit(self, finished: Collection[str]) -> None:
        """After a step: free the finished requests, add the freshly prefilled others as rows."""
        self.free(finished)
        if self._ready:
            ready, self._ready = self._ready, {}
            self._merge(list(ready), list(ready.values()))
        self._bound()

    def _decode(self, selected: set[str], requests: Mapping[str, RequestState], tokens: dict[str, int]) -> None:
        import torch

        device = self.device
        flags = [key in selected for key in self.rows]
        step_mask = torch.tensor(flags, dtype=torch.long, device=device)
        tokens_in = [[requests[k].last_token if f else self.pad_id] for k, f in zip(self.rows, flags, strict=True)]
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
        chosen = self._choose(logits, advanced, [requests[self.rows[i]] for i in advanced], self.failed,
                              self.logprobs)
        for i, token in zip(advanced, chosen, strict=True):
            if token is not None:
                tokens[self.rows[i]] = token

    def _prefill_chunk(self, chunk: PrefillChunk, request: RequestState, tokens: dict[str, int]) -> None:
        import torch
        from transformers import DynamicCache

        device = self.device
        cache = self._prefill.get(chunk.key)
        if cache is None or chunk.start == 0:
            cache = DynamicCache()
        sequence = request.prompt_ids if chunk.end <= len(request.prompt_ids) else request.all_tokens()
        ids = torch.tensor([sequence[chunk.start:chunk.end]], dtype=torch.long, device=device)
        mask = torch.ones((1, chunk.end), dtype=torch.long, device=device)
        positions = torch.arange(chunk.start, chunk.end, dtype=torch.long, device=device).unsqueeze(0)
        try:
            logits = self._forward(ids, mask, positions, cache, chunk.start)
            check_cache(cache)
        except BaseException:
            self._prefill.pop(chunk.key, None)
            raise
        if chunk.last:
            self._prefill.pop(chunk.key, None)
            self._ready[chunk.key] = cache
            token = self._choose(logits, [0], [request], self.failed, self.logprobs)[0]
            if token is not None:
                tokens[chunk.key] = token
        else:
            self._prefill[chunk.key] = cache

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
            kwargs["logits_to_keep"] = 1  # no lm_head over the whole chunk
        out = self.model(**kwargs)
        if output_cache(out) is not cache:
            raise TypeError("the model did not fill the DynamicCache it was given; its cache layout is unsupported")
        return out.logits[:, -1, :]

    @staticmethod
    def _choose(logits: Any, indices: list[int], requests: Sequence[RequestState],
                failed: dict[str, Exception], logprobs: dict[str, SampledLogprob]) -> list[int | None]:
        """The next token of each row in ``indices`` (``requests[j]`` samples row ``indices[j]``);
        ``None`` for a request whose sampling raised, recorded in ``failed``. The tokens of requests
        with ``logprobs`` have theirs in ``logprobs``."""
        greedy = None
        tokens: list[int | None] = []
        for i, request in zip(indices, requests, strict=True):
            params = request.params
            try:
                if request.mask is not None:  # a structured output: the grammar's tokens only
                    row = (penalize(logits[i], params, request.prompt_ids, request.result.token_ids)
                           if needs_logit_processing(params) else logits[i].float())
                    request.mask.apply(row)
                    token = sample_next_token(row, params.temperature, params.top_p, request.generator,
                                              getattr(params, "top_k", 0))
                elif needs_logit_processing(params):
                    row = penalize(logits[i], params, request.prompt_ids, request.result.token_ids)
                    token = sample_next_token(row, params.temperature, params.top_p, request.generator,
                                              getattr(params, "top_k", 0))
                elif params.temperature <= 0.0:
                    if greedy is None:
                        greedy = logits.argmax(dim=-1).tolist()
                    token = int(greedy[i])
                else:
                    token = sample_next_token(logits[i], params.temperature, params.top_p, request.generator)
                if params.logprobs:
                    logprobs[request.key] = sampled_logprob(logits[i], token, params.top_logprobs)
                tokens.append(token)
            except Exception as exc:  # noqa: BLE001 - one request's fault ends that request alone
                failed[request.key] = exc
                tokens.append(None)
        return tokens

    # --- the running cache ---------------------------------------------------------------
    def _merge(self, keys: list[str], caches: list[Any]) -> None:
        """Append freshly prefilled one-row caches to the running cache (left-padding the shorter side)."""
        import torch

        device = self.device
        widths = [int(c.layers[0].keys.shape[-2]) for c in caches]
        width = max(widths)
        if len(caches) == 1:
            cache = caches[0]
        else:
            cache = caches[0]
            for layer_index, layer in enumerate(cache.layers):
                layer.keys = torch.cat(
                    [pad_left(c.layers[layer_index].keys, width - w) for c, w in zip(caches, widths, strict=True)])
                layer.values = torch.cat(
                    [pad_left(c.layers[layer_index].values, width - w) for c, w in zip(caches, widths, strict=True)])
        mask = torch.zeros((len(caches), width), dtype=torch.long, device=device)
        for i, w in enumerate(widths):
            mask[i, width - w:] = 1
        positions = torch.tensor(widths, dtype=torch.long, device=device)
        if self._cache is None:
            self._cache, self._mask, self._positions = cache, mask, positions
        else:
            old_cols = self._mask.shape[1]
            total = max(old_cols, width)
            for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
                old_layer.keys = torch.cat(
                    [pad_left(old_layer.keys, total - old_cols), pad_left(new_layer.keys, total - width)]
                )
                old_layer.values = torch.cat(
                    [pad_left(old_layer.values, total - old_cols), pad_left(new_layer.values, total - width)]
                )
            self._mask = torch.cat([pad_left(self._mask, total - old_cols), pad_left(mask, total - width)])
            self._positions = torch.cat([self._positions, positions])
        for key in keys:
            self._row_of[key] = len(self.rows)
            self.rows.append(key)

    def _remove_rows(self, rows: Collection[int]) -> None:
        """Drop cache rows, then trim all-padding leading columns."""
        import torch

        keep = [i for i in range(len(self.rows)) if i not in rows]
        if not keep:
            self.rows = []
            self._row_of = {}
            self._cache = self._mask = self._positions = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        select_rows(self._cache, index)
        self._mask = self._mask.index_select(0, index)
        self._positions = self._positions.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]
        self._row_of = {k: i for i, k in enumerate(self.rows)}
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
