"""One request's text generation for causal LMs: prompt ids in, text pieces out.

A thin wrapper over a one-request :class:`~inference_service.llm.engine.GenerationEngine`, the
one generation loop of this package; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

from inference_service.contracts.outputs import FinalMessage, TokenLogprob, Usage
from inference_service.contracts.tokenizer import NO_CHAT_TEMPLATE
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.requests import GenerationRequest, InvalidRequest

__all__ = [
    "build_prompt_ids",
    "final_message",
    "generate_pieces",
    "generate_text",
    "model_context_length",
]


def model_context_length(model: Any) -> int | None:
    """The model's maximum sequence length (``config.max_position_embeddings``), or ``None``."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def build_prompt_ids(tokenizer: Any, request: GenerationRequest, context_length: int | None = None) -> list[int]:
    """The prompt token ids (non-empty): ``prompt`` tokenized with the tokenizer's special tokens, or
    ``messages`` rendered by ``apply_chat_template(..., add_generation_prompt=True)`` and tokenized
    without adding them again.

    Raises:
        InvalidRequest: no chat template for ``messages``, an empty prompt, or prompt +
            ``max_new_tokens`` above ``context_length``.
    """
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(NO_CHAT_TEMPLATE)
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(template_messages(request.messages), add_generation_prompt=True,
                                                 tokenize=False, tools=list(request.tools) or None)
        except TemplateError as exc:  # raised by the template itself (e.g. unsupported role order)
            raise InvalidRequest(f"cannot apply the chat template to 'messages': {exc}") from None
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(request.prompt)["input_ids"])
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens")
    if context_length is not None and len(ids) + request.params.max_new_tokens > context_length:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({request.params.max_new_tokens}) "
            f"exceeds the model's context length ({context_length})"
        )
    return ids


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat as chat templates read it: a tool call's ``arguments`` as an object (transformers'
    convention; OpenAI's JSON text when it is not an object)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
                for call in calls]}
        out.append(message)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def generate_pieces(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: GenerationParams,
    should_stop: Callable[[], bool] | None = None,
    eos_ids: Iterable[int] | None = None,
) -> Generator[str, None, GenerationResult]:
    """Generate text for one request, yielding each non-empty text piece as soon as it is stable.

    Ends at an end-of-sequence token (not decoded; unless ``params.ignore_eos``), a stop string (not
    emitted), ``params.max_new_tokens``, or ``should_stop()`` true before a step (finish reason
    ``"cancelled"``). Closing the generator frees the KV cache at once. Invariant:
    ``"".join(pieces) + result.remaining_text`` is ``tokenizer.decode(ids,
    skip_special_tokens=True)`` of the sampled ids, cut before the first stop string.

    Returns:
        A :class:`~inference_service.llm.params.GenerationResult` (``StopIteration.value``).

    Raises:
        ValueError: ``prompt_ids`` is empty.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    engine = GenerationEngine(model, tokenizer, eos_ids=None if eos_ids is None else frozenset(eos_ids))
    key = "request"
    engine.add(key, prompt_ids, params)
    try:
        while True:
            if should_stop is not None and should_stop():
                cancelled = engine.cancel(key)
                assert cancelled is not None
                return cancelled
            out = engine.step()[key]
            if out.piece:
                yield out.piece
            if out.finished:
                assert out.result is not None
                return out.result
    finally:
        engine.close()  # free the KV cache promptly, also when the consumer closes us


def generate_text(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: GenerationParams,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[str, GenerationResult]:
    """Run :func:`generate_pieces` to the end and return ``(full text, result)``."""
    pieces = generate_pieces(model, tokenizer, prompt_ids, params, should_stop)
    parts: list[str] = []
    while True:
        try:
            parts.append(next(pieces))
        except StopIteration as done:
            result: GenerationResult = done.value
            return "".join(parts) + result.remaining_text, result


def final_message(result: GenerationResult, params: GenerationParams,
                  logprobs: Sequence[TokenLogprob] = ()) -> str | dict[str, Any]:
    """The last message of a stream: the remaining text, or with ``include_usage`` or ``logprobs``
    the :class:`~inference_service.contracts.outputs.FinalMessage` object (as JSON; usage with
    ``include_usage``, the entries ``logprobs`` of the tokens not sent before with ``logprobs``)."""
    if not params.include_usage and not params.logprobs:
        return result.remaining_text
    usage = Usage(result.prompt_tokens, result.completion_tokens) if params.include_usage else None
    entries = tuple(logprobs) if params.logprobs else None
    return FinalMessage(result.remaining_text, result.finish_reason, usage, entries, result.stop_string).to_json()
