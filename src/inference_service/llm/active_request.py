"""A request running in the LLM handler's engine, and the look-ups on the worker's context
that both of the handler's modes (static batches, continuous batching) share.

See docs/llm.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_service.handler import Context
from inference_service.llm.requests import GenerationRequest


@dataclass
class ActiveRequest:
    """A request in the engine: its engine key, parsed form, log id, start time and prompt
    length; ``prefilled`` once its first token was sampled (its prompt tokens are counted then)."""

    key: str
    request: GenerationRequest
    request_id: str | None
    started: float
    prompt_tokens: int
    prefilled: bool = False


def cancelled(context: Context, idx: int) -> bool:
    """``context.is_cancelled(idx)`` where the context has it (TorchServe's has not)."""
    check = getattr(context, "is_cancelled", None)
    return bool(check(idx)) if callable(check) else False


def log_id(context: Context, idx: int) -> str | None:
    """The id request ``idx``'s log lines carry: its ``x-request-id`` header (the one its access
    line names), else the worker's request id."""
    try:
        header = context.get_request_header(idx, "x-request-id")
    except (IndexError, AttributeError):  # no request properties: called outside a worker
        header = None
    return header or context.request_ids.get(idx)
