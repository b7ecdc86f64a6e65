"""How the OpenAI-compatible API shapes its answers: server-sent events, the LLM handler's messages
read back into text, log probabilities, finish reason and usage, and the chat / text completion
objects of one request, whole or in chunks, each choice under its ``index`` (used by
:mod:`inference_service.frontends.openai.api`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from inference_service.contracts.outputs import FinalMessage, Piece, TokenLogprob
from inference_service.frontends.openai.logprobs import ChatLogprobs, CompletionLogprobs
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


@dataclass
class Outcome:
    """How one choice ended, from its final message: the text not sent before, the finish reason,
    its token counts (``None``: not reported), the log probability entries not sent before
    (``None``: not asked for) and the stop string that ended it (``None``: none did)."""

    text: str
    reason: FinishReason
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_string: str | None = None


def final_outcome(payload: bytes) -> Outcome:
    """The :class:`Outcome` of a handler's final message: the LLM's
    :class:`~inference_service.contracts.outputs.FinalMessage` (a ``cancelled`` reason reads as
    ``stop``); any other final message (another handler) is text, ``stop``, usage unknown."""
    final = FinalMessage.parse(payload)
    if final is None:
        return Outcome(payload.decode("utf-8", "replace"), "stop", None)
    reason: FinishReason = "length" if final.finish_reason == "length" else "stop"
    counts = final.usage
    usage = None if counts is None else Usage(prompt_tokens=counts.prompt_tokens,
                                              completion_tokens=counts.completion_tokens,
                                              total_tokens=counts.total_tokens)
    return Outcome(final.text, reason, usage, final.logprobs, final.stop_string)


def piece_of(payload: bytes, logprobs: bool) -> Piece:
    """An intermediate message as text and entries (a request with ``logprobs`` sends piece objects)."""
    piece = Piece.parse(payload) if logprobs else None
    return piece if piece is not None else Piece(payload.decode("utf-8", "replace"))


class AnswerFormat(Protocol):
    """How one endpoint shapes its answers (chat or text completion); ``index`` names a choice."""

    def opening(self, index: int) -> list[BaseModel]:
        """The chunks a choice's stream starts with (chat: the assistant role; echo: the prompt)."""
        ...

    def piece(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] | None) -> BaseModel | None:
        """The chunk of one piece of generated text and its tokens' entries, if asked for (``None``:
        nothing to send for it yet)."""
        ...

    def closing(self, index: int, outcome: Outcome) -> list[BaseModel]:
        """The chunks a choice ends with: the last text (if any) and the finish reason."""
        ...

    def usage(self, usage: Usage) -> BaseModel:
        """The usage chunk (``stream_options.include_usage``)."""
        ...

    def whole(self, choices: Sequence[tuple[int, str, Outcome]], usage: Usage | None) -> BaseModel:
        """The whole answer of a request that is not streamed: ``(index, text, outcome)`` per choice,
        the outcome's ``logprobs`` those of the whole text."""
        ...


class ChatFormat:
    """``chat.completion`` / ``chat.completion.chunk`` answers of one request."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, index: int, delta: Delta, reason: FinishReason | None = None,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> ChatCompletionChunk:
        shaped = None if logprobs is None else ChatLogprobs.of(logprobs)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=shaped)])

    def opening(self, index: int) -> list[BaseModel]:
        return [self._chunk(index, Delta(role="assistant", content=""))]

    def piece(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] | None) -> BaseModel | None:
        return self._chunk(index, Delta(content=text), logprobs=logprobs)

    def closing(self, index: int, outcome: Outcome) -> list[BaseModel]:
        head = [self._chunk(index, Delta(content=outcome.text), logprobs=outcome.logprobs)
                ] if outcome.text or outcome.logprobs else []
        return [*head, self._chunk(index, Delta(), outcome.reason)]

    def usage(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, choices: Sequence[tuple[int, str, Outcome]], usage: Usage | None) -> BaseModel:
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(index=index, message=ResponseMessage(content=text), finish_reason=outcome.reason,
                       logprobs=None if outcome.logprobs is None else ChatLogprobs.of(outcome.logprobs))
            for index, text, outcome in choices])


class CompletionFormat:
    """``text_completion`` answers (whole and chunks) of one request; with ``echo``, each choice's
    text starts with its prompt (``prompts[index // n]``)."""

    def __init__(self, model: str, prompts: Sequence[str] = (), n: int = 1, echo: bool = False) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompts = list(prompts)
        self.n = max(1, n)
        self.echo = echo
        self._offsets: dict[int, int] = {}  # choice index -> characters sent (text_offset)

    def _prompt(self, index: int) -> str:
        return self.prompts[index // self.n] if self.echo and self.prompts else ""

    def _logprobs(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] | None) -> CompletionLogprobs | None:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        return None if logprobs is None else CompletionLogprobs.of(logprobs, offset)

    def _chunk(self, index: int, text: str, reason: FinishReason | None = None,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=index, text=text, finish_reason=reason,
                             logprobs=self._logprobs(index, text, logprobs))])

    def opening(self, index: int) -> list[BaseModel]:
        prompt = self._prompt(index)
        return [self._chunk(index, prompt)] if prompt else []

    def piece(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] | None) -> BaseModel:
        return self._chunk(index, text, logprobs=logprobs)

    def closing(self, index: int, outcome: Outcome) -> list[BaseModel]:
        return [self._chunk(index, outcome.text, outcome.reason, outcome.logprobs)]

    def usage(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, choices: Sequence[tuple[int, str, Outcome]], usage: Usage | None) -> BaseModel:
        shaped = []
        for index, text, outcome in choices:
            prompt = self._prompt(index)
            logprobs = None if outcome.logprobs is None else CompletionLogprobs.of(outcome.logprobs, len(prompt))
            shaped.append(CompletionChoice(index=index, text=prompt + text, finish_reason=outcome.reason,
                                           logprobs=logprobs))
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage, choices=shaped)
