"""The answers of Anthropic's Messages API: the generated text, read for tool calls by the OpenAI
door's readers (:mod:`inference_service.frontends.openai.tool_calls`), as content blocks of one
``message`` object, or as the server-sent events of a stream (each ``event: <type>`` then
``data: <json>``): ``message_start``, per block ``content_block_start`` /
``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (``stop_reason``, usage) and ``message_stop``."""

from __future__ import annotations

import json
import uuid
from typing import Any

from inference_service.frontends.openai.format import Outcome
from inference_service.frontends.openai.tool_calls import CallPiece, Item, reader_of
from inference_service.frontends.openai.tools import ToolPlan

#: Anthropic's error ``type`` by HTTP status (``api_error`` for any other 5xx).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by the event's ``type``, as Anthropic's clients read them."""
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(outcome: Outcome, calls: int) -> str:
    """``max_tokens``, ``tool_use``, ``stop_sequence`` or ``end_turn``."""
    if outcome.reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if outcome.stop_string is not None else "end_turn"


def usage(outcome: Outcome | None) -> dict[str, int]:
    """``{"input_tokens", "output_tokens"}`` (0 when the handler did not count them)."""
    counts = outcome.usage if outcome is not None else None
    return {"input_tokens": counts.prompt_tokens if counts else 0,
            "output_tokens": counts.completion_tokens if counts else 0}


class MessageAnswer:
    """The answer of one request: ``feed`` each piece of text, then ``end`` with the outcome.

    ``events``: what to send since the last call (a stream); :meth:`message`: the whole object.
    """

    def __init__(self, model: str, plan: ToolPlan) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.reader = reader_of(plan)
        self.blocks: list[dict[str, Any]] = []  # the whole message's content
        self._arguments: dict[int, list[str]] = {}  # block index -> a tool call's JSON arguments so far
        self._open: str | None = None  # the type of the block being streamed
        self.calls = 0
        self.events: list[dict[str, Any]] = []
        self.outcome: Outcome | None = None

    def start(self) -> list[dict[str, Any]]:
        """The ``message_start`` event (usage is known at the end: ``message_delta`` carries it)."""
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}]

    def feed(self, text: str) -> None:
        """A piece of generated text."""
        if text:
            self._items(self.reader.feed(text) if self.reader is not None else [text])

    def end(self, outcome: Outcome) -> None:
        """The generation ended: the last text, the open block closed, ``message_delta`` and ``message_stop``."""
        self.feed(outcome.text)
        if self.reader is not None:
            self._items(self.reader.finish())
        self._close()
        self.events += [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason(outcome, self.calls),
                                                "stop_sequence": outcome.stop_string},
             "usage": usage(outcome)},
            {"type": "message_stop"}]
        self.outcome = outcome

    def message(self) -> dict[str, Any]:
        """The whole ``message`` object (after :meth:`end`)."""
        assert self.outcome is not None
        content = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                arguments = "".join(self._arguments.get(index, ()))
                try:
                    parsed = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    parsed = {}  # cut short by max_tokens: stop_reason says so
                block = {**block, "input": parsed if isinstance(parsed, dict) else {}}
            content.append(block)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(self.outcome, self.calls), "stop_sequence": self.outcome.stop_string,
                "usage": usage(self.outcome)}

    def take(self) -> list[dict[str, Any]]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events

    def _items(self, items: list[Item]) -> None:
        for item in items:
            if isinstance(item, CallPiece):
                if item.id is not None:  # a new call: its own block
                    self._begin({"type": "tool_use", "id": _tool_id(), "name": item.name or "", "input": {}})
                    self.calls += 1
                if item.arguments and self._open == "tool_use":
                    index = len(self.blocks) - 1
                    self._arguments.setdefault(index, []).append(item.arguments)
                    self.events.append({"type": "content_block_delta", "index": index,
                                        "delta": {"type": "input_json_delta", "partial_json": item.arguments}})
            elif item:
                if self._open != "text":
                    self._begin({"type": "text", "text": ""})
                index = len(self.blocks) - 1
                self.blocks[index]["text"] += item
                self.events.append({"type": "content_block_delta", "index": index,
                                    "delta": {"type": "text_delta", "text": item}})

    def _begin(self, block: dict[str, Any]) -> None:
        self._close()
        self.blocks.append(dict(block))
        self._open = block["type"]
        self.events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block})

    def _close(self) -> None:
        if self._open is not None:
            self.events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
            self._open = None
