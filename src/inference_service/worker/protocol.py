"""Framing of the local IPC channel between the frontend and a worker process.

The channel is a connected ``AF_UNIX`` stream socket pair. Every message is a
frame::

    u32 length (of what follows, big-endian) | u8 kind | body

Frontend -> worker kinds: ``INIT`` (JSON :class:`WorkerSpec`), ``BATCH``
(:func:`encode_batch`), ``CANCEL`` (request id), ``STOP``.
Worker -> frontend kinds: ``READY`` (JSON ``{"pid"}``), ``LOAD_FAILED``
(message), ``CHUNK`` (an intermediate response), ``FINAL`` (the last
response), ``ERROR`` (request id, gRPC code, message), ``DONE`` (the batch
is finished and the worker is free) and ``METRIC`` (handler metric updates,
:func:`encode_metrics`, only when the spec asks to ``forward_metrics``). Responses carry the request id, so one
routing task on the frontend can hand each to its request's mailbox.
No pickle: bodies are JSON headers plus raw bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

# frontend -> worker
INIT = 1
BATCH = 2
CANCEL = 3
STOP = 4
# worker -> frontend
READY = 10
LOAD_FAILED = 11
CHUNK = 12
FINAL = 13
ERROR = 14
DONE = 15
METRIC = 16

HEADER = struct.Struct("!IB")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ERR = struct.Struct("!HB")
MAX_FRAME = 1 << 31


class ProtocolError(Exception):
    """A frame was malformed or the channel closed mid-frame."""


def frame(kind: int, body: bytes = b"") -> bytes:
    """One frame of ``kind`` holding ``body`` (bytes)."""
    return HEADER.pack(len(body) + 1, kind) + body


@dataclass
class Request:
    """One request of a batch as the worker sees it.

    Args:
        request_id: the id the handler sees in ``context.request_ids``.
        inputs: the gRPC input map (name -> bytes).
        headers: request headers passed to ``context.get_request_header``.
        sequence_id: StreamPredictions2 sequence id, else ``None``.
    """

    request_id: str
    inputs: dict[str, bytes]
    headers: dict[str, str] = field(default_factory=dict)
    sequence_id: str | None = None


def encode_batch(requests: list[Request]) -> bytes:
    """The ``BATCH`` frame for ``requests``: a JSON index, then the input blobs in order."""
    index: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for req in requests:
        names = list(req.inputs)
        index.append({
            "id": req.request_id,
            "seq": req.sequence_id,
            "headers": req.headers,
            "inputs": [[name, len(req.inputs[name])] for name in names],
        })
        blobs.extend(req.inputs[name] for name in names)
    head = json.dumps(index, separators=(",", ":")).encode()
    return frame(BATCH, _U32.pack(len(head)) + head + b"".join(blobs))


def decode_batch(body: bytes) -> list[tuple[str, str | None, dict[str, str], dict[str, bytearray]]]:
    """Inverse of :func:`encode_batch`: ``(request_id, sequence_id, headers, inputs)`` per request.

    Inputs come back as ``bytearray`` values, as TorchServe hands them to handlers.

    Raises:
        ProtocolError: the body is malformed.
    """
    try:
        (head_len,) = _U32.unpack_from(body, 0)
        index = json.loads(body[4 : 4 + head_len])
        view = memoryview(body)
        pos = 4 + head_len
        out = []
        for item in index:
            inputs: dict[str, bytearray] = {}
            for name, size in item["inputs"]:
                inputs[name] = bytearray(view[pos : pos + size])
                pos += size
            out.append((item["id"], item["seq"], item["headers"], inputs))
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ProtocolError(f"malformed batch frame: {exc}") from exc
    if pos != len(body):
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


def encode_error(request_id: str, code: int, message: str) -> bytes:
    """An ``ERROR`` frame: u16 id length, u8 gRPC code number, id, UTF-8 message."""
    rid = request_id.encode()
    return frame(ERROR, _ERR.pack(len(rid), code) + rid + message.encode("utf-8", "replace"))


def decode_error(body: bytes) -> tuple[str, int, str]:
    """Inverse of :func:`encode_error`: ``(request_id, code number, message)``."""
    n, code = _ERR.unpack_from(body, 0)
    return body[3 : 3 + n].decode(), code, body[3 + n :].decode("utf-8", "replace")


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
        model_name: registered model name.
        model_version: the version being served.
        model_dir: extracted archive directory (on ``sys.path`` in the worker).
        handler: entry point, as in the manifest (``file.py``, ``module:function``,
            a built-in name, or a dotted module).
        manifest: the archive manifest.
        model_yaml_config: parsed per-model YAML config.
        batch_size: the model's batch_size.
        worker_id: the worker's id (e.g. ``9000``), for logs.
        gpu: GPU id or ``None``.
        server_version: this server's version.
        extra_paths: extra ``sys.path`` entries (e.g. per-model dependencies).
        limit_max_image_pixels: TorchServe's Pillow guard flag.
        world_size: processes in the worker group (>1: launched with torchrun).
        forward_metrics: send handler metrics to the frontend as ``METRIC`` frames
            (``metrics_mode=prometheus``) instead of logging them.
        log_level: the worker's logging level name (the server's ``--log-level``).
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

    def to_frame(self) -> bytes:
        """The ``INIT`` frame."""
        return frame(INIT, json.dumps(self.__dict__).encode())

    @classmethod
    def from_body(cls, body: bytes) -> WorkerSpec:
        """Parse an ``INIT`` body."""
        return cls(**json.loads(body))
