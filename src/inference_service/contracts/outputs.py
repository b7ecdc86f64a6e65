"""The LLM handler's final message with ``include_usage``, typed: written by the worker
(``llm/generation.py``), read back by the doors (the OpenAI door's finish reason and usage).

On the wire it is the JSON object ``{"text": "...", "finish_reason": "stop" | "length" |
"cancelled", "usage": {"prompt_tokens": n, "completion_tokens": m}}`` (docs/llm.md).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any


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
    streamed), ``finish_reason``, ``usage`` (``None`` when absent or malformed)."""

    text: str
    finish_reason: str
    usage: Usage | None

    def to_json(self) -> dict[str, Any]:
        """The JSON object the handler returns (the worker encodes it)."""
        out: dict[str, Any] = {"text": self.text, "finish_reason": self.finish_reason}
        if self.usage is not None:
            out["usage"] = {"prompt_tokens": self.usage.prompt_tokens,
                            "completion_tokens": self.usage.completion_tokens}
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
        return cls(obj["text"], str(obj["finish_reason"]), usage)
