"""The worker's end of its IPC socket (:class:`WorkerChannel`): framed writes, frame reads on
the main thread, the cancel set and the per-request credits of flow control."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque
from typing import Any

from inference_service.contracts import wire
from inference_service.handler.metrics import Metrics

POLL_INTERVAL_S = 0.001  # how often a running handler's cancel checks read the socket, at most
_RECV_BYTES = 1 << 18


class WorkerChannel:
    """The worker's end of the IPC socket. Only the main thread reads: :meth:`read_frame` between
    batches, :meth:`poll` while a handler runs. With :attr:`window` > 0 a request may send ``window``
    intermediate responses beyond its credits; the next :meth:`send_intermediate` blocks until a
    ``CREDIT`` or ``CANCEL``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pending: deque[tuple[int, bytes] | None] = deque()
        self._polled = 0.0
        self._lock = threading.Lock()  # writes
        self._reading = threading.Lock()  # reads: the main thread, or a handler's thread polling
        self.cancelled: set[str] = set()
        self.metrics: Metrics | None = None  # set when handler metrics go to the frontend
        self.window = 0
        self._credit: dict[str, int] = {}  # running request -> intermediate responses it may still send
        self._sent_headers: dict[str, dict[str, str]] = {}  # running request -> response headers sent
        self._eof = False

    def _next_buffered(self) -> tuple[int, bytes] | None:
        buf = self._buf
        size = wire.HEADER.size
        if len(buf) < size:
            return None
        length, kind = wire.HEADER.unpack_from(buf, 0)
        end = 4 + length
        if len(buf) < end:
            return None
        body = bytes(buf[size:end])
        del buf[:end]
        return kind, body

    def read_frame(self) -> tuple[int, bytes] | None:
        """Next frame ``(kind, body)`` (blocking), or ``None`` when the frontend closed the channel."""
        with self._reading:
            while True:
                if self._pending:
                    return self._pending.popleft()
                if (item := self._next_buffered()) is not None:
                    return item
                self._receive()

    def _receive(self, flags: int = 0) -> bool:
        """One ``recv`` into the buffer; False at end of stream (``None`` then waits among the
        pending frames, for :meth:`read_frame`). Hold :attr:`_reading`."""
        data = self._sock.recv(_RECV_BYTES, flags)
        if data:
            self._buf += data
            return True
        self._eof = True
        self._pending.append(None)
        return False

    def begin(self, request_ids: list[str]) -> None:
        """A batch starts: each request may send :attr:`window` intermediate responses uncredited."""
        if self.window:
            for rid in request_ids:
                self._credit[rid] = self.window

    def end(self, request_ids: list[str]) -> None:
        """A batch ended: forget its cancels and credits."""
        self.cancelled.difference_update(request_ids)
        for rid in request_ids:
            self._credit.pop(rid, None)
            self._sent_headers.pop(rid, None)

    def _take(self, item: tuple[int, bytes]) -> None:
        kind, body = item
        if kind == wire.CANCEL:
            self.cancelled.add(body.decode())
        elif kind == wire.CREDIT:
            rid, count = wire.decode_credit(body)
            if rid in self._credit:
                self._credit[rid] += count
        else:
            self._pending.append(item)

    def _await_credit(self, request_id: str) -> None:
        """Block until ``request_id`` has credit, is cancelled, or the frontend is gone."""
        with self._reading:
            while True:
                while (item := self._next_buffered()) is not None:
                    self._take(item)
                if self._credit.get(request_id, 1) > 0 or request_id in self.cancelled or self._eof:
                    return
                self._receive()

    def poll(self) -> None:
        """Take the frames that already arrived, without blocking (nothing while another thread reads)."""
        if not self._reading.acquire(blocking=False):
            return
        try:
            self._poll()
        finally:
            self._reading.release()

    def next_pending(self) -> tuple[int, bytes] | None:
        """The oldest frame a poll kept (not a cancel or credit), ``None`` if none; ``(0, b"")`` is the
        channel's end."""
        if not self._pending:
            return None
        item = self._pending.popleft()
        return item if item is not None else (0, b"")

    def wait_input(self, timeout: float | None = None) -> None:
        """Block until at least one more frame arrived (or the channel closed, or ``timeout``
        seconds passed), then take every frame that is complete as :meth:`poll` does."""
        with self._reading:
            if self._eof or self._pending:
                return
            if self._next_complete():
                self._poll()
                return
            try:
                if timeout is not None:
                    readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
                    if not readable:
                        return
                self._receive()
            except OSError:
                self._eof = True
                self._pending.append(None)
            self._poll()

    def _next_complete(self) -> bool:
        buf = self._buf
        if len(buf) < wire.HEADER.size:
            return False
        length, _ = wire.HEADER.unpack_from(buf, 0)
        return len(buf) >= 4 + length

    def credit(self, request_id: str) -> int | None:
        """Intermediate responses ``request_id`` may still send (``None``: not flow-controlled)."""
        return self._credit.get(request_id)

    def has_credit(self, request_id: str) -> bool:
        """Whether ``request_id`` may send an intermediate response now without waiting."""
        return self._credit.get(request_id, 1) > 0

    def poll_due(self) -> None:
        """:meth:`poll`, unless it ran within the last :data:`POLL_INTERVAL_S`."""
        if time.monotonic() - self._polled >= POLL_INTERVAL_S:
            self.poll()

    def _poll(self) -> None:
        self._polled = time.monotonic()
        if not self._eof:
            try:
                while self._receive(socket.MSG_DONTWAIT):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._eof = True
                self._pending.append(None)
        while (item := self._next_buffered()) is not None:
            self._take(item)

    def send(self, data: bytes) -> None:
        """Write one or more encoded frames atomically."""
        with self._lock:
            self._sock.sendall(data)

    # Channel protocol used by the handler API
    def send_intermediate(self, request_id: str, payload: bytes, headers: dict[str, Any] | None = None) -> None:
        """Send a ``CHUNK`` after any queued handler metrics and the request's response ``headers``
        when they changed; blocks while the request has no credit."""
        credit = self._credit.get(request_id)
        if credit is not None:
            if credit <= 0:
                self._await_credit(request_id)
                credit = self._credit.get(request_id, 1)
            self._credit[request_id] = credit - 1
        frames = self.pending_metrics()
        if headers:
            frames += self.headers_frames(request_id, headers)
        frames.append(wire.encode_response(wire.CHUNK, request_id, payload))
        self.send(b"".join(frames))

    def headers_frames(self, request_id: str, headers: dict[str, Any]) -> list[bytes]:
        """The ``HEADERS`` frame of ``request_id`` when ``headers`` differ from those sent last ([] else);
        values become strings."""
        text = {str(k): str(v) for k, v in headers.items()}
        if not text or self._sent_headers.get(request_id) == text:
            return []
        self._sent_headers[request_id] = text
        return [wire.encode_headers(request_id, text)]

    def pending_metrics(self) -> list[bytes]:
        """The METRIC frame of what the handler recorded since the last one ([] when nothing)."""
        metrics = self.metrics
        if metrics is None or not metrics.pending:
            return []
        return [wire.encode_metrics(metrics.drain())]

    def is_cancelled(self, request_id: str) -> bool:
        """Whether a ``CANCEL`` arrived for ``request_id`` (reads the socket at most every
        :data:`POLL_INTERVAL_S`)."""
        self.poll_due()
        return request_id in self.cancelled
