"""Bounds on request work that grows with the input, checked before the work starts.

The front doors share one event loop, so parsing must neither take long on it nor inflate far
beyond the raw size. The bounds (``max_request_size``, ``max_request_parts``, ``max_json_depth``,
``max_json_nodes``) are settings answered with a client error; see docs/operations.md. Bodies of
at least :data:`OFFLOAD_BYTES` are handled off the loop (:func:`off_loop`), and every C call on
them is sliced too (:class:`JsonWriter`, :func:`loads_sliced`): one ``json.loads`` of a 4 MB
tensor holds the interpreter, and so the loop, for 0.1 to 0.5 s.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from inference_service.errors import InvalidArgument, ResourceExhausted

T = TypeVar("T")
#: Conversions of at least this many bytes (or tensor elements) run in a thread (:func:`off_loop`).
OFFLOAD_BYTES = 64 * 1024
#: Elements JSON-encoded by one ``json.dumps`` call (about 1 ms of FP32 values).
JSON_SLICE = 8192


async def off_loop(fn: Callable[..., T], *args: Any, size: int) -> T:
    """``fn(*args)``: inline below :data:`OFFLOAD_BYTES` (``size``: bytes or elements it works
    on), else in the loop's default thread pool, so that the loop keeps serving meanwhile."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def check_json_nodes(body: bytes, max_nodes: int) -> None:
    """Refuse ``body`` before parsing when it may hold more than ``max_nodes`` objects and arrays: each
    costs ``json.loads`` 0.1 to 0.25 us in one C call holding the interpreter (2 M empty lists:
    0.5 s). Counted as ``{`` and ``[`` bytes at C speed (an upper bound).

    Raises:
        InvalidArgument: "the request body holds more than max_json_nodes=100000 objects and arrays".
    """
    if len(body) > max_nodes and body.count(b"{") + body.count(b"[") > max_nodes:
        raise InvalidArgument(f"the request body holds more than max_json_nodes={max_nodes} objects and arrays",
                              reason="TOO_MANY_JSON_NODES")


def parse_json(body: bytes, max_depth: int, max_nodes: int = 100_000) -> Any:
    """``body`` as JSON, refused when nested deeper than ``max_depth`` or holding more than
    ``max_nodes`` objects and arrays.

    Raises:
        InvalidArgument: not JSON (invalid UTF-8 included), too deep, or too many nodes.
    """
    check_json_nodes(body, max_nodes)
    try:
        value = loads_sliced(body)
    except RecursionError:
        raise InvalidArgument(_too_deep(max_depth)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"the request body is not JSON: {exc}") from None
    brackets = body.count(b"[") + body.count(b"{")
    if brackets > max_depth and json_depth(value) > max_depth:
        raise InvalidArgument(_too_deep(max_depth))
    return value


# A JSON array of at least 4 KiB of numbers only: the bulk of a tensor's "data".
_NUMBER_RUN = re.compile(rb"\[[-+0-9.eE, \t\r\n]{4096,}\]")
#: Bytes of numbers parsed by one ``json.loads`` call in :func:`loads_sliced` (about 2 ms).
NUMBERS_SLICE = 64 * 1024


def loads_sliced(body: bytes) -> Any:
    """``json.loads(body)`` with long arrays of numbers parsed :data:`NUMBERS_SLICE` bytes per call, so
    no call holds the interpreter long. Same result and errors (ValueError, RecursionError); small
    bodies, a backslash or non-UTF-8 go to ``json.loads`` whole."""
    if len(body) < OFFLOAD_BYTES or b"\\" in body or b"\x00" in body[:4] or body.startswith(codecs.BOM_UTF8):
        return json.loads(body)
    nonce = f"\u0000{secrets.token_hex(8)}"  # a key no client can guess: marks where an array was
    skeleton: list[bytes] = []
    arrays: list[list[Any]] = []
    pos = counted = quotes = 0
    for match in _NUMBER_RUN.finditer(body):
        start, end = match.span()
        quotes += body.count(b'"', counted, start)
        counted = start  # the match itself holds no quote
        if quotes % 2:  # inside a string: leave it to json.loads
            continue
        skeleton += [body[pos:start], json.dumps({nonce: len(arrays)}).encode("ascii")]
        arrays.append(_numbers(body, start + 1, end - 1))
        pos = end
    if not arrays:
        return json.loads(body)
    skeleton.append(body[pos:])
    return _put_back(json.loads(b"".join(skeleton)), nonce, arrays)


def _numbers(body: bytes, start: int, stop: int) -> list[Any]:
    """The numbers of the array interior ``body[start:stop]``; ValueError for an empty or non-number element."""
    out: list[Any] = []
    while True:
        cut = body.find(b",", min(start + NUMBERS_SLICE, stop), stop)
        piece = body[start:stop if cut < 0 else cut]
        if not piece.strip():
            raise json.JSONDecodeError("Expecting value", "", 0)
        out += json.loads(b"[" + piece + b"]")
        if cut < 0:
            return out
        start = cut + 1


def _put_back(value: Any, nonce: str, arrays: list[list[Any]]) -> Any:
    """``value`` with each ``{nonce: i}`` replaced by ``arrays[i]`` (walked without recursion;
    the arrays put back are not walked)."""
    def swap(item: Any) -> Any:
        if isinstance(item, dict) and len(item) == 1 and nonce in item:
            return arrays[item[nonce]]
        return item

    value = swap(value)
    stack = [value]
    while stack:
        item = stack.pop()
        children = enumerate(item) if isinstance(item, list) else list(item.items()) if isinstance(item, dict) else ()
        for key, child in children:
            if isinstance(child, dict | list):
                swapped = swap(child)
                if swapped is child:
                    stack.append(child)
                else:
                    item[key] = swapped
    return value


def _too_deep(max_depth: int) -> str:
    return f"the request body nests JSON deeper than max_json_depth={max_depth}"


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (0 for a scalar, 1 for ``[1, 2]``), walked
    without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in item if isinstance(child, dict | list))
    return deepest


def check_parts(count: int, max_parts: int, what: str) -> None:
    """Refuse a body of more than ``max_parts`` parts (``count`` may be an upper bound) with
    InvalidArgument naming ``max_request_parts``."""
    if count > max_parts:
        raise InvalidArgument(f"{what} of more than max_request_parts={max_parts} {_noun(what)}",
                              reason="TOO_MANY_PARTS")


def _noun(what: str) -> str:
    return "fields" if "form" in what else "parts"


#: What curl sends with ``-d`` (unless told otherwise) and with ``-F``.
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def refuse_form(content_type: str, body: bytes) -> None:
    """InvalidArgument (reason ``FORM_BODY``) for a form body at a door that reads JSON (``/v1``,
    ``/v2``); ``content_type`` as aiohttp's ``request.content_type``.

    A urlencoded body that is JSON text (``curl -d @request.json``, as KServe's samples send it)
    is read as JSON, as KServe's model server and vLLM's OpenAI server read it; multipart/form-data
    and a urlencoded body of form fields are refused.
    """
    if content_type == FORM_TYPES[0] and body.lstrip()[:1] in (b"{", b"["):
        return
    if content_type in FORM_TYPES:
        raise InvalidArgument(f"the body was sent as a form (Content-Type: {content_type}, what curl -d sends "
                              "unless told otherwise); this API reads JSON: send it with "
                              "-H 'Content-Type: application/json'", reason="FORM_BODY")


class JsonWriter:
    """JSON text written piece by piece; :meth:`write` / :meth:`values` raise ResourceExhausted
    (``REQUEST_TOO_LARGE``, 413) once it passes ``limit`` bytes (``max_request_size``)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.size = 0
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Append ``data``."""
        self.size += len(data)
        if self.size > self.limit:
            raise ResourceExhausted(f"{self.what} passes max_request_size={self.limit} bytes",
                                    reason="REQUEST_TOO_LARGE")
        self._parts.append(data)

    def value(self, value: Any) -> None:
        """Append ``value`` as compact JSON (one ``json.dumps``: keep it small)."""
        self.write(json.dumps(value, separators=(",", ":")).encode("utf-8"))

    def values(self, count: int, slice_of: Callable[[int, int], list[Any]]) -> None:
        """Append a JSON array of ``count`` elements, ``slice_of(start, stop)`` giving each
        :data:`JSON_SLICE` of them, so no single call holds the interpreter for long."""
        self.write(b"[")
        for start in range(0, count, JSON_SLICE):
            if start:
                self.write(b",")
            text = json.dumps(slice_of(start, min(count, start + JSON_SLICE)), separators=(",", ":"))
            self.write(text[1:-1].encode("ascii"))
        self.write(b"]")

    def getvalue(self) -> bytes:
        """The text written so far."""
        return b"".join(self._parts)
