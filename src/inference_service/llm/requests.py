"""Generation requests as the LLM handler reads them: one row of a batch, and the prompt-size
check before tokenization.

The request itself (fields, limits, defaults, parsing) is declared once in
:mod:`inference_service.contracts.sampling` and re-exported here; docs/llm.md lists the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference_service.contracts.sampling import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    REQUEST_FIELDS,
    GenerationParams,
    GenerationRequest,
    InvalidRequest,
    params_from_config,
    parse_request,
)

__all__ = [
    "MAX_NEW_TOKENS_LIMIT",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MAX_TEMPERATURE",
    "REQUEST_FIELDS",
    "GenerationRequest",
    "InvalidRequest",
    "check_prompt_size",
    "max_token_chars",
    "params_from_config",
    "parse_input_row",
    "parse_request",
]


def parse_input_row(row: Any, defaults: GenerationParams = GenerationParams()) -> GenerationRequest:
    """Parse one request of a handler's ``data`` batch: the body under ``"data"`` or ``"body"``, or the
    row itself. InvalidRequest when there is none or it is invalid."""
    if isinstance(row, Mapping):
        body = row.get("data")
        if body is None:
            body = row.get("body")
        if body is None:
            raise InvalidRequest("request has no 'data' or 'body' input" + (
                ", only form fields: curl -d sends a body as a form unless given "
                "-H 'Content-Type: application/json'" if row else ""))
    else:
        body = row
    return parse_request(body, defaults)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for: the longest
    entry of its vocabulary (byte-level BPE spells every byte as one character, so the length
    of an entry bounds the characters it decodes to)."""
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1


def check_prompt_size(request: GenerationRequest, max_chars: int | None) -> None:
    """Refuse, before tokenization, a prompt whose characters (prompt, or messages' contents summed)
    exceed ``max_chars`` (context length times :func:`max_token_chars`; ``None``: no check): even at
    the longest token it would not fit the context. Raises InvalidRequest."""
    if max_chars is None:
        return
    if request.prompt is not None:
        size = len(request.prompt)
    else:
        size = sum(len(m["content"]) for m in request.messages or ())
    if size > max_chars:
        raise InvalidRequest(
            f"prompt too long: {size} characters cannot fit the model's context "
            f"(at most {max_chars} characters)"
        )
