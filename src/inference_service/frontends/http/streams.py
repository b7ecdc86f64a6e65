"""How ``/predictions`` writes a streamed answer so that a plain client can split it.

Raw (TorchServe's) with the LLM's usage object on its own last line, or NDJSON
(``Accept: application/x-ndjson``). A stream starting as UTF-8 text is ``text/plain;
charset=utf-8``. The LLM's piece objects (a request with ``logprobs``) are lines of their own in
both forms. See docs/llm.md.
"""

from __future__ import annotations

import codecs
import contextlib
import json
from typing import Any

NDJSON = "application/x-ndjson"
TEXT = "text/plain; charset=utf-8"
#: Bytes of a message looked at to tell text or the usage object (bounded work on the event loop).
PEEK_BYTES = 4096
#: Largest piece object parsed on the event loop (a token with 20 alternatives is about 2 KB).
PIECE_BYTES = 65536


def wants_ndjson(accept: str) -> bool:
    """True when the ``Accept`` header names ``application/x-ndjson``."""
    return any(part.split(";")[0].strip().lower() == NDJSON for part in accept.split(","))


def is_text(payload: bytes) -> bool:
    """True when the first :data:`PEEK_BYTES` of ``payload`` are UTF-8 (a character cut at the
    end counts as text)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(payload[:PEEK_BYTES], final=False)
    except UnicodeDecodeError:
        return False
    return True


def usage_object(payload: bytes) -> dict[str, Any] | None:
    """The LLM handler's final usage object (``{"text", "finish_reason", "usage"}``), else ``None``.

    Only a message of at most :data:`PEEK_BYTES` is parsed (on the event loop): the usage
    object is about 100 bytes, its ``text`` empty on a stream."""
    if payload[:1] != b"{" or len(payload) > (PIECE_BYTES if b'"logprobs"' in payload[:PEEK_BYTES] else PEEK_BYTES):
        return None
    obj: Any = None
    with contextlib.suppress(ValueError):
        obj = json.loads(payload)
    if isinstance(obj, dict) and isinstance(obj.get("text"), str) and "finish_reason" in obj \
            and (isinstance(obj.get("usage"), dict) or isinstance(obj.get("logprobs"), list)):
        return obj
    return None


def piece_object(payload: bytes) -> dict[str, Any] | None:
    """The LLM handler's piece object (``{"text", "logprobs"}``, a request with ``logprobs``), else ``None``."""
    if payload[:9] != b'{"text": ' or len(payload) > PIECE_BYTES:
        return None
    obj: Any = None
    with contextlib.suppress(ValueError):
        obj = json.loads(payload)
    if isinstance(obj, dict) and set(obj) == {"text", "logprobs"} and isinstance(obj["text"], str) \
            and isinstance(obj["logprobs"], list):
        return obj
    return None


class StreamFraming:
    """Turns one answer's messages into the bytes written, in the raw or the NDJSON form.

    Args:
        ndjson: write one JSON object per line (``Accept: application/x-ndjson``).
    """

    def __init__(self, ndjson: bool) -> None:
        self.ndjson = ndjson
        self._wrote = False
        self._lines = False  # wrote piece objects: every message is a line

    def content_type(self, first: bytes) -> str | None:
        """The answer's Content-Type from its first message (``None``: leave aiohttp's default)."""
        if self.ndjson:
            return NDJSON
        return TEXT if is_text(first) else None

    def piece(self, payload: bytes) -> bytes:
        """An intermediate message as written."""
        self._wrote = self._wrote or bool(payload)
        if (obj := piece_object(payload)) is not None:
            self._lines = True
            return _line(obj)
        if not self.ndjson:
            return payload
        return _line({"text": payload.decode("utf-8", "replace")}) if payload else b""

    def final(self, payload: bytes) -> bytes:
        """The final message as written: the usage object on a line of its own."""
        usage = usage_object(payload)
        if usage is None:
            return self.piece(payload)
        if "logprobs" in usage:  # the last of a stream of objects, as it is
            return _line(usage) if self.ndjson or self._lines or not self._wrote else b"\n" + _line(usage)
        text, usage["text"] = usage["text"], ""
        head = self.piece(text.encode()) if text else b""
        if self.ndjson or not self._wrote:
            return head + _line(usage)
        return head + b"\n" + _line(usage)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


#: Response headers a handler may not set: the HTTP framing's, and TorchServe's internal stream flag.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "ts_stream_next"})


def passed_headers(headers: dict[str, str]) -> dict[str, str]:
    """The handler's response headers that go on the HTTP answer, as TorchServe's RestJob sets them
    (``Content-Type`` included); framing headers and values with a line break are left out."""
    return {key: value for key, value in headers.items()
            if key.lower() not in _FRAMING and "\r" not in value and "\n" not in value}
