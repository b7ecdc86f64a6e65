"""The frontend's end of a worker's IPC connection (:class:`FrameChannel`, an asyncio protocol)
and the relay of a worker's stdout/stderr lines into the server's log (:func:`relay_output`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from inference_service.contracts import wire

LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}


class ChannelOwner(Protocol):
    """What a :class:`FrameChannel` reports to (``dispatch.process.WorkerProcess``)."""

    spec: wire.WorkerSpec

    def attach_channel(self, channel: FrameChannel) -> None:
        """The connection is up."""

    def on_frame(self, channel: FrameChannel, kind: int, body: bytes) -> None:
        """One complete frame arrived."""

    def on_channel_closed(self) -> None:
        """The connection is gone: the owner starts (and owns) whatever cleanup task it needs."""


class FrameChannel(asyncio.Protocol):
    """One rank's IPC connection: each frame handed to the owner's ``on_frame`` (no task, no await);
    :meth:`pause`/:meth:`resume` back-pressure the worker."""

    def __init__(self, owner: ChannelOwner) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.answers = owner.spec.world_size == 1  # only rank 0 answers clients
        self._buf = bytearray()
        self._paused = False
        self.lost = False  # the connection is gone (uvloop's transport may not say is_closing() then)

    @property
    def open(self) -> bool:
        """Whether frames can still be written and reading paused or resumed."""
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        """Write ``data`` if the connection is open; a frame to a worker that is gone is dropped
        (its requests fail through :meth:`connection_lost`)."""
        if self.open:
            assert self.transport is not None
            try:
                self.transport.write(data)
            except RuntimeError:  # uvloop: the handle was closed before connection_lost ran
                self.lost = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.owner.attach_channel(self)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:
            src = data
        end, size, pos = len(src), wire.HEADER.size, 0
        unpack = wire.HEADER.unpack_from
        frame_handler = self.owner.on_frame
        while end - pos >= size:
            length, kind = unpack(src, pos)
            stop = pos + 4 + length
            if stop > end:
                break
            body = src[pos + size:stop]
            pos = stop
            frame_handler(self, kind, bytes(body) if isinstance(body, bytearray) else body)
        if src is buf:
            del buf[:pos]
        elif pos < end:
            self._buf = bytearray(src[pos:])

    def pause(self) -> None:
        """Stop reading until :meth:`resume` (a mailbox is full: back-pressure the worker)."""
        if not self._paused and self.open:
            assert self.transport is not None
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again."""
        if self._paused and self.open:
            assert self.transport is not None
            self._paused = False
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.owner.on_channel_closed()


#: Where the handler metric lines of every worker go (``metrics_mode=log``; TorchServe's model_metrics.log).
MODEL_METRICS_LOGGER = "inference_service.model_metrics"
_METRIC_LINE = "inference_service.metrics: "  # the worker's metrics logger (handler/metrics.py)


async def relay_output(stream: asyncio.StreamReader | None, level: int, logger: logging.Logger, prefix: str,
                       extra: dict[str, Any]) -> None:
    """Log each non-blank line of a worker's stdout/stderr as ``<prefix> <line>`` on ``logger``: a line
    the worker's logging wrote keeps its level (traceback lines that of the line before), others get
    ``level``; handler metric lines go to :data:`MODEL_METRICS_LOGGER`. ``extra`` is on each record."""
    if stream is None:
        return
    metrics_logger = logging.getLogger(MODEL_METRICS_LOGGER)
    current, in_traceback = level, False
    while line := await stream.readline():
        text = line.decode("utf-8", "replace").rstrip()
        if not text:
            continue
        head = text.split(" ", 1)[0]
        if head in LEVELS:
            current, in_traceback = LEVELS[head], False
            text = text[len(head) + 1:]  # the record carries the level: one prefix per line
        elif text.startswith("Traceback ("):
            in_traceback = True
        elif text[:1].isspace():
            pass
        elif in_traceback:  # the exception line ends a traceback
            in_traceback = False
        else:
            current = level
        target = metrics_logger if text.startswith(_METRIC_LINE) else logger
        target.log(current, "%s %s", prefix, text, extra=extra)
