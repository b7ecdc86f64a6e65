"""Framing of the local IPC channel between the frontend and a worker process.

An ``AF_UNIX`` stream socket pair; every message is a frame
``u32 length (big-endian) | u8 kind | body``, no pickle. Intermediate responses are
flow-controlled per request: a worker sends at most :attr:`WorkerSpec.stream_window` ``CHUNK``
frames beyond those credited (``CREDIT``), so a fast handler waits for a slow client instead of
burning a core. See docs/architecture.md.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# frontend -> worker
INIT = 1
BATCH = 2
CANCEL = 3
STOP = 4
CREDIT = 5
#: continuous batching: give the request's (body: its id) place to a waiting request of an earlier
#: priority; it is preempted and runs again at the first free place its priority earns.
YIELD = 6
# worker -> frontend
READY = 10
LOAD_FAILED = 11
CHUNK = 12
FINAL = 13
ERROR = 14
DONE = 15
METRIC = 16
#: continuous batching: the request (body: its id) gave its place back (its client stopped
#: reading); the frontend may send one more request. It still runs and answers as before.
PREEMPTED = 17
#: continuous batching: the preempted request (body: its id) takes a place again.
RESUMED = 18
#: the response headers the handler set for a request (``context.set_response_header``), sent
#: before its next ``CHUNK`` or ``FINAL`` when they changed: the HTTP answer carries them.
HEADERS = 19

#: Intermediate responses a request may have in flight beyond the frontend's credits.
STREAM_WINDOW = 64
#: The frontend returns credits in batches of this many.
CREDIT_BATCH = STREAM_WINDOW // 2

#: The server's interpreter, in the environment of every worker: a worker under another Python (an
#: engine's own environment) has work that needs the server's packages run by it.
SERVER_PYTHON_ENV = "INFERENCE_SERVICE_SERVER_PYTHON"

#: Worker modes (:attr:`WorkerSpec.mode`).
MODE_BATCH = "batch"  # one batch at a time, DONE when it is answered (TorchServe's default)
MODE_CONTINUOUS = "continuous"  # continuousBatching: requests join and leave a running batch
MODE_ASYNC = "async"  # asyncCommunication: one ``async def handle`` task per request
MODES = (MODE_BATCH, MODE_CONTINUOUS, MODE_ASYNC)

HEADER = struct.Struct("!IB")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ERR = struct.Struct("!HBH")
_NONE = 0xFFFF  # u16 length of an absent sequence id
_NONE_BYTES = _U16.pack(_NONE)
MAX_FRAME = 1 << 31


class ProtocolError(Exception):
    """A frame was malformed or the channel closed mid-frame."""


def frame(kind: int, body: bytes = b"") -> bytes:
    """One frame of ``kind`` holding ``body`` (bytes)."""
    return HEADER.pack(len(body) + 1, kind) + body


@dataclass
class Request:
    """One request of a batch as the frontend sends it: ``inputs`` the input map, ``headers`` for
    ``context.get_request_header``, ``sequence_id`` StreamPredictions2's or ``None``,
    ``content_types`` the content type of some inputs (TorchServe's ``InputParameter``
    content type: an HTTP body's, a multipart file's; absent for form fields and gRPC inputs)."""

    request_id: str
    inputs: dict[str, bytes]
    headers: dict[str, str] = field(default_factory=dict)
    sequence_id: str | None = None
    content_types: dict[str, str] = field(default_factory=dict)


class Received(NamedTuple):
    """One request of a ``BATCH`` frame as the worker reads it (inputs as ``bytearray``, as
    TorchServe hands them; ``content_types`` "" or absent: none)."""

    request_id: str
    sequence_id: str | None
    headers: dict[str, str]
    inputs: dict[str, bytearray]
    content_types: dict[str, str]


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    if len(data) >= _NONE:
        raise ValueError(f"text field of {len(data)} bytes exceeds {_NONE - 1}")
    return data


#: Most entries of a request's input map or headers, and longest name or id in bytes (UTF-8),
#: that the ``BATCH`` framing carries (u16 counts and lengths; 0xFFFF marks an absent id).
MAX_ENTRIES = 0xFFFF
MAX_NAME_BYTES = _NONE - 1


def _too_long(text: str) -> bool:
    # a str of n characters has at most 4n UTF-8 bytes: only long ones are encoded to measure
    return len(text) > MAX_NAME_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES


def request_problem(inputs: dict[str, bytes], headers: dict[str, str], sequence_id: str | None,
                    content_types: dict[str, str] | None = None) -> str | None:
    """Why a request cannot be framed for a worker (naming the limit), or ``None``: checked before
    queueing, so it is refused with INVALID_ARGUMENT instead of failing on its way."""
    for content_type in (content_types or {}).values():
        if _too_long(content_type):
            return f"a content type is longer than {MAX_NAME_BYTES} bytes"
    if len(inputs) > MAX_ENTRIES:
        return f"the input map has {len(inputs)} entries; at most {MAX_ENTRIES} are allowed"
    if len(headers) > MAX_ENTRIES:
        return f"the request has {len(headers)} headers; at most {MAX_ENTRIES} are allowed"
    for name in inputs:
        if _too_long(name):
            return f"an input name is longer than {MAX_NAME_BYTES} bytes"
    for name in headers:
        if _too_long(name):
            return f"a header name is longer than {MAX_NAME_BYTES} bytes"
    if sequence_id is not None and _too_long(sequence_id):
        return f"the sequence id is longer than {MAX_NAME_BYTES} bytes"
    return None


def encode_batch(requests: list[Request]) -> bytes:
    """The ``BATCH`` frame for ``requests`` (binary, no JSON: this runs once per request)::

        u16 count, then per request:
          u16 len | request id | u16 len (0xFFFF: none) | sequence id
          u16 headers, each: u16 len | name | u32 len | value  (UTF-8)
          u16 inputs, each: u16 len | name | u16 len | content type ("": none) | u32 len | bytes

    Raises:
        ValueError: an id, name, content type or header longer than 65534 bytes.
    """
    parts: list[bytes] = [_U16.pack(len(requests))]
    append = parts.append
    u16, u32 = _U16.pack, _U32.pack
    for req in requests:
        rid = _text(req.request_id)
        append(u16(len(rid)))
        append(rid)
        if req.sequence_id is None:
            append(_NONE_BYTES)
        else:
            seq = _text(req.sequence_id)
            append(u16(len(seq)))
            append(seq)
        append(u16(len(req.headers)))
        for name, value in req.headers.items():
            key, val = _text(name), value.encode("utf-8", "surrogatepass")
            append(u16(len(key)))
            append(key)
            append(u32(len(val)))
            append(val)
        append(u16(len(req.inputs)))
        content_types = req.content_types
        for name, blob in req.inputs.items():
            key = _text(name)
            append(u16(len(key)))
            append(key)
            content_type = content_types.get(name)
            if content_type:
                ctype = _text(content_type)
                append(u16(len(ctype)))
                append(ctype)
            else:
                append(b"\x00\x00")
            append(u32(len(blob)))
            append(blob)
    body = b"".join(parts)
    return HEADER.pack(len(body) + 1, BATCH) + body


def decode_batch(body: bytes) -> list[Received]:
    """Inverse of :func:`encode_batch`.

    Raises:
        ProtocolError: the body is malformed.
    """
    u16, u32 = _U16.unpack_from, _U32.unpack_from
    end = len(body)

    def take(pos: int, size: int) -> bytes:
        if pos + size > end:
            raise ValueError("field runs past the end")
        return body[pos:pos + size]

    def text(pos: int) -> tuple[str, int]:
        """u16 len | UTF-8 text."""
        (n,) = u16(body, pos)
        return take(pos + 2, n).decode("utf-8", "surrogatepass"), pos + 2 + n

    def pairs(pos: int, typed: bool) -> tuple[list[tuple[str, str, bytes]], int]:
        """u16 count, then count times: u16 len | UTF-8 name | (``typed``: u16 len | UTF-8 content
        type) | u32 len | value."""
        (n,) = u16(body, pos)
        pos += 2
        items = []
        content_type = ""
        for _ in range(n):
            key, pos = text(pos)
            if typed:
                content_type, pos = text(pos)
            (v,) = u32(body, pos)
            items.append((key, content_type, take(pos + 4, v)))
            pos += 4 + v
        return items, pos

    try:
        (count,) = u16(body, 0)
        pos = 2
        out = []
        for _ in range(count):
            rid, pos = text(pos)
            seq = None
            if body[pos:pos + 2] == _NONE_BYTES:
                pos += 2
            else:
                seq, pos = text(pos)
            header_items, pos = pairs(pos, False)
            headers = {key: value.decode("utf-8", "surrogatepass") for key, _, value in header_items}
            input_items, pos = pairs(pos, True)
            inputs = {key: bytearray(value) for key, _, value in input_items}
            content_types = {key: content_type for key, content_type, _ in input_items if content_type}
            out.append(Received(rid, seq, headers, inputs, content_types))
    except (ValueError, struct.error) as exc:
        raise ProtocolError(f"malformed batch frame: {exc}") from exc
    if pos != end:
        raise ProtocolError("malformed batch frame: trailing bytes")
    return out


def encode_response(kind: int, request_id: str, payload: bytes) -> bytes:
    """A ``CHUNK`` or ``FINAL`` frame: u16 id length, id, payload."""
    rid = request_id.encode()
    return frame(kind, _U16.pack(len(rid)) + rid + payload)


def decode_response(body: bytes) -> tuple[str, bytes]:
    """Inverse of :func:`encode_response`: ``(request_id, payload)``."""
    (n,) = _U16.unpack_from(body, 0)
    return body[2 : 2 + n].decode(), body[2 + n :]


def encode_headers(request_id: str, headers: dict[str, str]) -> bytes:
    """A ``HEADERS`` frame: u16 id length, id, the headers as a JSON object of strings."""
    rid = request_id.encode()
    return frame(HEADERS, _U16.pack(len(rid)) + rid + json.dumps(headers, separators=(",", ":")).encode())


def decode_headers(body: bytes) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`encode_headers`; entries that are not strings are left out.

    Raises:
        ProtocolError: the headers are not a JSON object.
    """
    request_id, payload = decode_response(body)
    try:
        headers = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"malformed headers frame: {exc}") from exc
    if not isinstance(headers, dict):
        raise ProtocolError("malformed headers frame: not an object")
    return request_id, {str(k): v for k, v in headers.items() if isinstance(v, str)}


def encode_credit(request_id: str, count: int) -> bytes:
    """A ``CREDIT`` frame: ``count`` (u32) more intermediate responses of ``request_id`` may come."""
    return frame(CREDIT, _U32.pack(count) + request_id.encode())


def decode_credit(body: bytes) -> tuple[str, int]:
    """Inverse of :func:`encode_credit`: ``(request_id, count)``."""
    (count,) = _U32.unpack_from(body, 0)
    return body[4:].decode(), count


def encode_error(request_id: str, code: int, message: str, http_status: int = 0) -> bytes:
    """An ``ERROR`` frame: u16 id length, u8 gRPC code number, u16 HTTP status the handler set
    (0: none), id, UTF-8 message."""
    rid = request_id.encode()
    return frame(ERROR, _ERR.pack(len(rid), code, http_status) + rid + message.encode("utf-8", "replace"))


def decode_error(body: bytes) -> tuple[str, int, str, int]:
    """Inverse of :func:`encode_error`: ``(request_id, code number, message, HTTP status or 0)``."""
    n, code, http_status = _ERR.unpack_from(body, 0)
    start = _ERR.size
    return body[start : start + n].decode(), code, body[start + n :].decode("utf-8", "replace"), http_status


def encode_metrics(updates: list[tuple[str, str, str, dict[str, str], float]]) -> bytes:
    """A ``METRIC`` frame: a JSON list of ``[name, type, unit, dimensions, value]`` updates
    (a counter's increment, a gauge's new value, a histogram's observation)."""
    return frame(METRIC, json.dumps(updates, separators=(",", ":")).encode())


def decode_metrics(body: bytes) -> list[tuple[str, str, str, dict[str, str], float]]:
    """Inverse of :func:`encode_metrics`; malformed entries are left out.

    Raises:
        ProtocolError: the body is not a JSON list.
    """
    try:
        items = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"malformed metric frame: {exc}") from exc
    if not isinstance(items, list):
        raise ProtocolError("malformed metric frame: not a list")
    out = []
    for item in items:
        if (isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and isinstance(item[1], str)
                and isinstance(item[3], dict) and isinstance(item[4], (int, float))):
            out.append((item[0], item[1], str(item[2]), {str(k): str(v) for k, v in item[3].items()},
                        float(item[4])))
    return out


@dataclass
class WorkerSpec:
    """Everything a worker needs to load its model (sent as the ``INIT`` frame).

    Args:
        handler: entry point as in the manifest (``file.py``, ``module:function``, a built-in
            name, or a dotted module).
        extra_paths: extra ``sys.path`` entries (per-model dependencies).
        world_size: processes in the worker group (>1: launched with torchrun).
        forward_metrics: send handler metrics as ``METRIC`` frames (``metrics_mode=prometheus``).
        stream_window: intermediate responses in flight beyond the credits (0: no flow control).
        mode: :data:`MODES`: ``batch`` (then ``DONE``), ``continuous`` (``continuousBatching``;
            each request ends with its own ``FINAL``/``ERROR``, no ``DONE``) or ``async``.
        max_running: most requests run at once in ``continuous`` and ``async`` mode.
        envelope: the ``service_envelope`` to wrap the handler in, or ``None``.
        decode_input_request: JSON and text inputs reach the handler decoded
            (:mod:`inference_service.worker.inputs`).
        max_response_size: the server's ``max_response_size`` (bytes), for the handler's context.
    """

    model_name: str
    model_version: str
    model_dir: str
    handler: str
    manifest: dict[str, Any]
    model_yaml_config: dict[str, Any]
    batch_size: int
    worker_id: int
    gpu: int | None = None
    server_version: str = ""
    extra_paths: list[str] = field(default_factory=list)
    limit_max_image_pixels: bool = True
    world_size: int = 1
    forward_metrics: bool = False
    log_level: str = "INFO"
    stream_window: int = 0
    mode: str = MODE_BATCH
    max_running: int = 1
    envelope: str | None = None
    decode_input_request: bool = True
    max_response_size: int = 6_553_500

    def to_frame(self) -> bytes:
        """The ``INIT`` frame."""
        return frame(INIT, json.dumps(self.__dict__).encode())

    @classmethod
    def from_body(cls, body: bytes) -> WorkerSpec:
        """Parse an ``INIT`` body."""
        return cls(**json.loads(body))


@dataclass(frozen=True)
class EngineInfo:
    """What an LLM handler's engine serves with, sent in the worker's READY and shown as its entry's
    ``engine`` in DescribeModel: the engine's name, the weight format, why that one, the CPU it
    was chosen for, and the chat template it renders messages with (empty where it does not apply)."""

    name: str
    weight_format: str = ""
    reason: str = ""
    cpu: str = ""
    chat_template: str = ""

    def as_json(self) -> dict[str, str]:
        """DescribeModel's object: ``name``, ``weightFormat``, ``reason``, ``cpu``, ``chatTemplate``,
        the empty ones left out."""
        shown = {"name": self.name, "weightFormat": self.weight_format, "reason": self.reason, "cpu": self.cpu,
                 "chatTemplate": self.chat_template}
        return {key: value for key, value in shown.items() if value}

    @classmethod
    def from_json(cls, value: Any) -> EngineInfo | None:
        """The READY field back (``None`` when absent or not an object of strings)."""
        if not isinstance(value, dict) or "name" not in value or not all(isinstance(v, str) for v in value.values()):
            return None
        return cls(value["name"], value.get("weight_format", ""), value.get("reason", ""), value.get("cpu", ""),
                   value.get("chat_template", ""))
