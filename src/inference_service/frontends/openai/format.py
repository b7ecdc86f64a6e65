"""How the OpenAI-compatible API shapes its answers: server-sent events, the LLM handler's final
message read back into text, finish reason and usage, and the chat / text completion objects of
one request, whole or in chunks (used by :mod:`inference_service.frontends.openai.api`)."""

from __future__ import annotations

import time
import uuid
from typing import Protocol

from pydantic import BaseModel

from inference_service.contracts.outputs import FinalMessage
from inference_service.frontends.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionChunk,
    Delta,
    FinishReason,
    ResponseMessage,
    Usage,
)


def sse_event(model: BaseModel, exclude: set[str] | None = None) -> bytes:
    """One server-sent event ``data: <model as JSON>`` (without the fields in ``exclude``)."""
    return b"data: " + model.model_dump_json(exclude=exclude).encode() + b"\n\n"


def final_outcome(payload: bytes) -> tuple[str, FinishReason, Usage | None]:
    """``(remaining text, finish reason, usage)`` from a handler's final message: the LLM's
    :class:`~inference_service.contracts.outputs.FinalMessage` (a ``cancelled`` reason reads as
    ``stop``); any other final message (another handler) is text, ``stop``, usage unknown."""
    final = FinalMessage.parse(payload)
    if final is None:
        return payload.decode("utf-8", "replace"), "stop", None
    reason: FinishReason = "length" if final.finish_reason == "length" else "stop"
    counts = final.usage
    usage = None if counts is None else Usage(prompt_tokens=counts.prompt_tokens,
                                              completion_tokens=counts.completion_tokens,
                                              total_tokens=counts.total_tokens)
    return final.text, reason, usage


class AnswerFormat(Protocol):
    """How one endpoint shapes its answers (chat or text completion)."""

    def opening(self) -> list[BaseModel]:
        """The chunks a stream starts with (chat: the assistant role)."""
        ...

    def piece(self, text: str) -> BaseModel | None:
        """The chunk of one piece of generated text (``None``: nothing to send for it yet)."""
        ...

    def closing(self, text: str, reason: FinishReason) -> list[BaseModel]:
        """The chunks a stream ends with: the last text (if any) and the finish reason."""
        ...

    def usage(self, usage: Usage) -> BaseModel:
        """The usage chunk (``stream_options.include_usage``)."""
        ...

    def whole(self, text: str, reason: FinishReason, usage: Usage | None) -> BaseModel:
        """The whole answer of a request that is not streamed."""
        ...


class ChatFormat:
    """``chat.completion`` / ``chat.completion.chunk`` answers of one request."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, delta: Delta, reason: FinishReason | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def piece(self, text: str) -> BaseModel | None:
        return self._chunk(Delta(content=text))

    def closing(self, text: str, reason: FinishReason) -> list[BaseModel]:
        return [*([self._chunk(Delta(content=text))] if text else []), self._chunk(Delta(), reason)]

    def usage(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, reason: FinishReason, usage: Usage | None) -> BaseModel:
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage,
                              choices=[ChatChoice(message=ResponseMessage(content=text), finish_reason=reason)])


class CompletionFormat:
    """``text_completion`` answers (whole and chunks) of one request."""

    def __init__(self, model: str) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, text: str, reason: FinishReason | None = None) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model,
                               choices=[CompletionChoice(text=text, finish_reason=reason)])

    def opening(self) -> list[BaseModel]:
        return []

    def piece(self, text: str) -> BaseModel | None:
        return self._chunk(text)

    def closing(self, text: str, reason: FinishReason) -> list[BaseModel]:
        return [self._chunk(text, reason)]

    def usage(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, reason: FinishReason, usage: Usage | None) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage,
                          choices=[CompletionChoice(text=text, finish_reason=reason)])
