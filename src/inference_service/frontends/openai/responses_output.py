"""The answers of ``/v1/responses`` in OpenAI's shapes: output items read from the generated text as
it streams (a ``message`` with one ``output_text`` part, ``function_call`` items read by the tool
plan's :class:`~inference_service.frontends.openai.tool_calls.CallReader`), the typed server-sent
events that build them, and the response object (``object: response``).

Events are dicts without their ``sequence_number``, which the writer adds; an item in an event is
a copy, as it stood then.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from inference_service.frontends.openai.format import Outcome
from inference_service.frontends.openai.responses_schemas import ResponsesRequest
from inference_service.frontends.openai.tool_calls import CallPiece, CallReader, Item


def new_id(prefix: str) -> str:
    """``prefix`` and 32 hex digits (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": list(item["content"])} if "content" in item else dict(item)


class OutputBuilder:
    """The output items of one answer, and the events of each piece of its text (``reader``: the
    tool plan's, ``None`` when the answer is all text)."""

    def __init__(self, reader: CallReader | None) -> None:
        self.reader = reader
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._parts: list[str] = []  # the open item's text or arguments so far

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The events of the next piece of generated text."""
        if self.reader is None:
            return self._events([text] if text else [])
        return self._events(self.reader.feed(text) if text else [])

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The closing events; ``incomplete``: the token limit cut the last item short. An answer of
        no text at all is one empty message."""
        events = self._events(self.reader.finish() if self.reader is not None else [])
        if not self.items:
            events += self._open_message()
        return events + self._close("incomplete" if incomplete else "completed")

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _events(self, pieces: list[Item]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if self._open is None or self._open["type"] != "message":
                    events += self._close("completed") + self._open_message()
                self._parts.append(piece)
                events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                               "delta": piece, "logprobs": []})
                continue
            if piece.id is not None or self._open is None or self._open["type"] != "function_call":
                events += self._close("completed") + self._open_call(piece)
            if piece.arguments:
                self._parts.append(piece.arguments)
                events.append({"type": "response.function_call_arguments.delta", **self._where(),
                               "delta": piece.arguments})
        return events

    def _added(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._parts = item, []
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        return [*self._added(item), {"type": "response.content_part.added", **self._where(), "content_index": 0,
                                     "part": _text_part("")}]

    def _open_call(self, piece: CallPiece) -> list[dict[str, Any]]:
        return self._added({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                            "call_id": piece.id or new_id("call"), "name": piece.name or "", "arguments": ""})

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where, text = self._where(), "".join(self._parts)
        item["status"] = status
        if item["type"] == "message":
            item["content"] = [_text_part(text)]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": _text_part(text)}]
        else:
            item["arguments"] = text
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": text}]
        self._open, self._parts = None, []
        return [*events, {"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": _copy(item)}]


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of output items (a turn's calls on one assistant message), for the stored
    conversation a chained request continues."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
            continue
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                        "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def usage_of(outcome: Outcome | None) -> dict[str, Any] | None:
    """OpenAI's Responses ``usage`` of the handler's token counts (``None``: not reported)."""
    if outcome is None or outcome.usage is None:
        return None
    counts = outcome.usage
    return {"input_tokens": counts.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": counts.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.total_tokens}


class ResponseShape:
    """The response object of one request (``id``: ``resp_`` and 32 hex digits), as it stands."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.store = request.store is not False

    def object(self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object: ``status`` ``in_progress``, ``completed``, ``incomplete`` (the token
        limit, ``incomplete_details.reason`` ``max_output_tokens``) or ``failed`` (``error`` set)."""
        request = self.request
        fmt = request.text.format if request.text is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "background": False,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "model": request.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "reasoning": None, "store": self.store,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": fmt.echoed() if fmt is not None else {"type": "text"}},
            "tool_choice": request.tool_choice or "auto", "tools": [t.echoed() for t in request.tools or ()],
            "truncation": "disabled", "usage": usage_of(outcome), "user": request.user,
        }


def sse(event: dict[str, Any], sequence_number: int) -> bytes:
    """One typed server-sent event: ``event: <type>`` and its data with ``sequence_number``."""
    data = json.dumps({**event, "sequence_number": sequence_number}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
