"""Row and column surgery on a transformers ``DynamicCache`` (the engine's running KV cache).

The engine keeps one cache of shape ``[batch, heads, columns, head_dim]`` per layer for all
running requests; these helpers check that a model's cache has that layout
(:func:`check_cache`), keep some rows of it (:func:`select_rows`) and left-pad a KV tensor
or an attention mask with empty columns (:func:`pad_left`), so two caches of different
widths can be stacked.

torch and transformers are imported inside the functions; this module imports without them.
"""

from __future__ import annotations

from typing import Any


def cache_keyword(forward: Any) -> str:
    """The keyword under which ``forward`` (a model's ``forward``) takes its KV cache:
    ``"cache"`` from transformers 5.24 on (where ``past_key_values`` is deprecated with a
    ``FutureWarning``), ``"past_key_values"`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache a forward pass returned (its ``cache`` field from transformers 5.24 on,
    ``past_key_values`` before), or ``None``."""
    fields = getattr(out, "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in fields else "past_key_values", None)


def check_cache(cache: Any) -> None:
    """Raise ``TypeError`` unless every layer of ``cache`` holds plain 4-D key/value tensors."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if type(layer) is not DynamicLayer or keys is None or keys.dim() != 4:
            raise TypeError(
                f"unsupported KV cache layer {type(layer).__name__}: the engine batches DynamicCache "
                "full-attention layers only"
            )


def select_rows(cache: Any, index: Any) -> None:
    """Keep the rows ``index`` (a 1-D long tensor) of every layer of ``cache``, in that order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def pad_left(tensor: Any, count: int) -> Any:
    """Zero-pad dimension -2 of a KV tensor ``[b, h, cols, d]`` (or dimension 1 of a mask
    ``[b, cols]``) with ``count`` columns on the left."""
    if count == 0:
        return tensor
    import torch

    if tensor.dim() == 2:
        pad = torch.zeros((tensor.shape[0], count), dtype=tensor.dtype, device=tensor.device)
        return torch.cat([pad, tensor], dim=1)
    shape = list(tensor.shape)
    shape[-2] = count
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=-2)
