"""The LLM handler's messages that are JSON, typed: written by the worker (``llm/generation.py``,
``llm/logprobs.py``), read back by the doors (the OpenAI door's finish reason, usage, log probabilities).

The final message with ``include_usage`` (or ``logprobs``) is the JSON object ``{"text": "...",
"finish_reason": "stop" | "length" | "cancelled", "usage": {"prompt_tokens": n, "completion_tokens":
m}}``, with ``"logprobs": [...]`` when asked; with ``logprobs`` every intermediate message is
``{"text": "...", "logprobs": [...]}`` (:class:`Piece`). Each entry is OpenAI's chat shape
(:class:`TokenLogprob`). See docs/llm.md.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One likely token at a position: its text, log probability and UTF-8 bytes (OpenAI's names)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}

    @classmethod
    def from_json(cls, obj: Any) -> TopLogprob:
        """Raises ValueError for anything but ``{"token": str, "logprob": number, "bytes": [int]}``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("token"), str) \
                or not isinstance(obj.get("logprob"), (int, float)) or not isinstance(obj.get("bytes"), list):
            raise ValueError("not a log probability entry")
        return cls(obj["token"], float(obj["logprob"]), tuple(int(b) for b in obj["bytes"]))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token: its :class:`TopLogprob` fields and the most likely tokens at its position
    (``top_logprobs`` of them, most likely first)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes),
                "top_logprobs": [top.to_json() for top in self.top_logprobs]}

    @classmethod
    def from_json(cls, obj: Any) -> TokenLogprob:
        """Raises ValueError for a malformed entry."""
        head = TopLogprob.from_json(obj)
        tops = obj.get("top_logprobs", [])
        if not isinstance(tops, list):
            raise ValueError("'top_logprobs' is not a list")
        return cls(head.token, head.logprob, head.bytes, tuple(TopLogprob.from_json(t) for t in tops))


def _logprobs(obj: Any) -> tuple[TokenLogprob, ...] | None:
    """The ``logprobs`` entries of a message object; ``None`` when absent or malformed."""
    entries = obj.get("logprobs")
    if not isinstance(entries, list):
        return None
    try:
        return tuple(TokenLogprob.from_json(entry) for entry in entries)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Piece:
    """An intermediate message of a request with ``logprobs``: new text (possibly ``""``) and the
    tokens sampled since the message before."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "logprobs": [entry.to_json() for entry in self.logprobs]}

    @classmethod
    def parse(cls, payload: bytes) -> Piece | None:
        """The piece in ``payload``, or ``None`` when it is not one (plain text)."""
        obj: Any = None
        if payload[:1] == b"{":
            with contextlib.suppress(ValueError):
                obj = json.loads(payload)
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or "finish_reason" in obj:
            return None
        entries = _logprobs(obj)
        return None if entries is None else cls(obj["text"], entries)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request (tokens of the model's tokenizer)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class FinalMessage:
    """How a generation ended, as its final message tells it: ``text`` not sent before (``""`` when
    streamed), ``finish_reason``, ``usage`` (``None`` when absent or malformed), ``logprobs`` of the
    tokens not sent before (``None``: not asked for), the stop string that ended it (``None``: none
    did; Anthropic's ``stop_sequence``, vLLM's ``stop_reason``)."""

    text: str
    finish_reason: str
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_string: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object the handler returns (the worker encodes it)."""
        out: dict[str, Any] = {"text": self.text, "finish_reason": self.finish_reason}
        if self.stop_string is not None:
            out["stop_string"] = self.stop_string
        if self.usage is not None:
            out["usage"] = {"prompt_tokens": self.usage.prompt_tokens,
                            "completion_tokens": self.usage.completion_tokens}
        if self.logprobs is not None:
            out["logprobs"] = [entry.to_json() for entry in self.logprobs]
        return out

    @classmethod
    def parse(cls, payload: bytes) -> FinalMessage | None:
        """The final message in ``payload``, or ``None`` when it is not one (another handler's
        text, a JSON object without a string ``text`` and a ``finish_reason``)."""
        obj: Any = None
        if payload[:1] == b"{":
            with contextlib.suppress(ValueError):
                obj = json.loads(payload)
        if not (isinstance(obj, dict) and isinstance(obj.get("text"), str) and "finish_reason" in obj):
            return None
        counts = obj.get("usage")
        usage = None
        if isinstance(counts, dict) and isinstance(counts.get("prompt_tokens"), int) \
                and isinstance(counts.get("completion_tokens"), int):
            usage = Usage(counts["prompt_tokens"], counts["completion_tokens"])
        stop = obj.get("stop_string")
        return cls(obj["text"], str(obj["finish_reason"]), usage, _logprobs(obj),
                   stop if isinstance(stop, str) else None)
