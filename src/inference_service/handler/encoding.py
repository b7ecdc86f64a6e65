"""Encoding of handler results into the bytes of a ``PredictionResponse``."""

from __future__ import annotations

import json
from typing import Any


def encode_response(value: Any) -> bytes:
    """Encode one handler result as TorchServe's worker does: ``str`` as UTF-8, bytes-likes unchanged,
    ``None`` empty, a tensor or numpy array as the JSON of ``tolist()`` (never pickle), anything
    else as JSON; TypeError when not JSON-serialisable."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if value is None:
        return b""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        value = tolist()
    return json.dumps(value, default=_json_default).encode("utf-8")


def _json_default(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"handler returned a {type(obj).__name__}, which cannot be encoded as JSON")
