"""Tool calls read out of the generated text, piece by piece, and the chat answers that carry them.

A reader takes the text as it streams (:meth:`CallReader.feed`) and returns what the client
gets: content text and tool-call pieces (:data:`Item`); :class:`ToolChatFormat` shapes them as
OpenAI's chunks, or the whole message. One reader per mode of
:class:`~inference_service.frontends.openai.tools.ToolPlan`:

- :class:`NamedCallReader`: the text is the named function's arguments, streamed as they come;
- :class:`CallListReader`: a JSON array of ``{"name", "arguments"}``, each call sent when its
  object closes;
- :class:`HermesReader` (``auto``): content until ``<tool_call>``, each
  ``<tool_call>{...}</tool_call>`` a call; a call that does not parse is sent as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from inference_service.contracts.outputs import TokenLogprob
from inference_service.frontends.openai.format import ChatFormat, Outcome
from inference_service.frontends.openai.logprobs import ChatLogprobs
from inference_service.frontends.openai.schemas import (
    ChatChoice,
    ChatCompletion,
    Delta,
    FinishReason,
    ResponseMessage,
    Usage,
)
from inference_service.frontends.openai.tool_schemas import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from inference_service.frontends.openai.tools import ToolPlan

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class CallPiece:
    """A piece of the ``index``-th call: its start (``id`` and ``name`` set) or more ``arguments``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


#: What a reader gives the client: content text, or a piece of a tool call.
Item = str | CallPiece


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallReader(Protocol):
    """Reads one answer's text for tool calls; ``calls``: how many it found so far."""

    calls: int

    def feed(self, text: str) -> list[Item]: ...

    def finish(self) -> list[Item]: ...


class NamedCallReader:
    """The answer is the arguments of ``name`` (a named ``tool_choice``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Item]:
        if not text:
            return []
        if not self.calls:
            self.calls = 1
            return [CallPiece(0, text, _call_id(), self.name)]
        return [CallPiece(0, text)]

    def finish(self) -> list[Item]:
        if not self.calls:  # nothing generated: the call still happens, with no arguments
            self.calls = 1
            return [CallPiece(0, "", _call_id(), self.name)]
        return []


class CallListReader:
    """The answer is a JSON array of ``{"name", "arguments"}`` (``tool_choice: required``)."""

    def __init__(self) -> None:
        self.calls = 0
        self._text: list[str] = []  # the whole answer, for :meth:`finish`
        self._element: list[str] = []  # the array element being read
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Item]:
        self._text.append(text)
        items: list[Item] = []
        for ch in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:  # an element of the array closes
                    self._element.append(ch)
                    items += self._call("".join(self._element))
                    self._element = []
                    continue
            if self._depth >= 2:
                self._element.append(ch)
        return items

    def _call(self, text: str) -> list[Item]:
        try:
            call = json.loads(text)
        except ValueError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        self.calls += 1
        return [CallPiece(self.calls - 1, json.dumps(call.get("arguments", {}), ensure_ascii=False), _call_id(),
                          call["name"])]

    def finish(self) -> list[Item]:
        return [] if self.calls else ["".join(self._text)]  # cut short (max_tokens): the text as it is


class HermesReader:
    """Content, and ``<tool_call>{"name", "arguments"}</tool_call>`` calls (``tool_choice: auto``)."""

    def __init__(self) -> None:
        self.calls = 0
        self._held = ""  # content that may start a tag, or a call's text
        self._in_call = False

    def feed(self, text: str) -> list[Item]:
        self._held += text
        items: list[Item] = []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE_TAG)
                if end < 0:
                    return items
                items += self._call(self._held[:end], self._held[:end + len(CLOSE_TAG)])
                self._held = self._held[end + len(CLOSE_TAG):]
                self._in_call = False
                continue
            start = self._held.find(OPEN_TAG)
            if start >= 0:
                if self._content(self._held[:start]):
                    items.append(self._held[:start])
                self._held = self._held[start + len(OPEN_TAG):]
                self._in_call = True
                continue
            keep = next((k for k in range(min(len(OPEN_TAG) - 1, len(self._held)), 0, -1)
                         if self._held.endswith(OPEN_TAG[:k])), 0)
            if self._content(self._held[:len(self._held) - keep]):
                items.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
            return items

    def _content(self, text: str) -> bool:
        """Whether ``text`` goes to the client as content: whitespace around calls does not (held
        until more text shows what it is, dropped at the end)."""
        return bool(text.strip()) or bool(text and not self.calls)

    def _call(self, body: str, raw: str) -> list[Item]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return [OPEN_TAG + raw]  # not a call after all: the client gets the text
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return [CallPiece(self.calls - 1, text, _call_id(), call["name"])]

    def finish(self) -> list[Item]:
        held, self._held = self._held, ""
        if not self._in_call:
            return [held] if self._content(held) else []
        return self._call(held, held)  # no closing tag: the end of the answer closes it


def reader_of(plan: ToolPlan) -> CallReader | None:
    """The reader of a plan's mode (``None`` for ``none``: the answer is content)."""
    if plan.mode == "named" and plan.name is not None:
        return NamedCallReader(plan.name)
    if plan.mode == "required":
        return CallListReader()
    return HermesReader() if plan.mode == "auto" else None


def _delta(items: list[Item]) -> Delta | None:
    """One chunk's delta of ``items`` (``None`` when there are none)."""
    if not items:
        return None
    content = "".join(item for item in items if isinstance(item, str))
    calls = [ToolCallDelta(index=p.index, id=p.id, type="function" if p.id else None,
                           function=FunctionDelta(name=p.name, arguments=p.arguments))
             for p in items if isinstance(p, CallPiece)]
    return Delta(content=content or None, tool_calls=calls or None)


class ToolChatFormat(ChatFormat):
    """``chat.completion`` answers whose text a :class:`CallReader` (one per choice) reads for tool
    calls; the finish reason is ``tool_calls`` when it found one and the answer was not cut short.
    Log probability entries of text held by the reader go out with the next chunk sent."""

    def __init__(self, model: str, plan: ToolPlan) -> None:
        super().__init__(model)
        self.plan = plan
        self._readers: dict[int, CallReader | None] = {}
        self._held: dict[int, list[TokenLogprob]] = {}

    def _reader(self, index: int) -> CallReader | None:
        if index not in self._readers:
            self._readers[index] = reader_of(self.plan)
        return self._readers[index]

    def _entries(self, index: int, logprobs: tuple[TokenLogprob, ...] | None,
                 send: bool) -> tuple[TokenLogprob, ...] | None:
        """``logprobs`` added to the held entries; all of them when ``send`` (``None``: not asked for)."""
        if logprobs is None:
            return None
        held = self._held.setdefault(index, [])
        held.extend(logprobs)
        if not send:
            return None
        return tuple(self._held.pop(index))

    def piece(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] | None) -> BaseModel | None:
        reader = self._reader(index)
        if reader is None:
            return super().piece(index, text, logprobs)
        delta = _delta(reader.feed(text))
        entries = self._entries(index, logprobs, delta is not None)
        return None if delta is None else self._chunk(index, delta, logprobs=entries)

    @staticmethod
    def _reason(reader: CallReader, reason: FinishReason) -> FinishReason:
        return "tool_calls" if reader.calls and reason == "stop" else reason

    def closing(self, index: int, outcome: Outcome) -> list[BaseModel]:
        reader = self._reader(index)
        if reader is None:
            return super().closing(index, outcome)
        delta = _delta(reader.feed(outcome.text) + reader.finish())
        entries = self._entries(index, outcome.logprobs, True)
        head = [self._chunk(index, delta or Delta(), logprobs=entries)] if delta is not None or entries else []
        return [*head, self._chunk(index, Delta(), self._reason(reader, outcome.reason))]

    def whole(self, choices: Sequence[tuple[int, str, Outcome]], usage: Usage | None) -> BaseModel:
        shaped = []
        for index, text, outcome in choices:
            reader = reader_of(self.plan)
            logprobs = None if outcome.logprobs is None else ChatLogprobs.of(outcome.logprobs)
            if reader is None:
                shaped.append(ChatChoice(index=index, message=ResponseMessage(content=text),
                                         finish_reason=outcome.reason, logprobs=logprobs))
                continue
            items = reader.feed(text) + reader.finish()
            content = "".join(item for item in items if isinstance(item, str))
            calls: dict[int, dict[str, Any]] = {}
            for piece in (item for item in items if isinstance(item, CallPiece)):
                call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.name, "arguments": ""})
                call["arguments"] += piece.arguments
            tool_calls = [ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
                          for c in calls.values()] or None
            message = ResponseMessage(content=content or (None if tool_calls else ""), tool_calls=tool_calls)
            shaped.append(ChatChoice(index=index, message=message, finish_reason=self._reason(reader, outcome.reason),
                                     logprobs=logprobs))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=shaped)
