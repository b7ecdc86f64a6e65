"""Entry point of a worker process: ``python -m inference_service.worker.main --fd N``
(or ``--connect PATH`` for each rank of a torchrun-launched group).

1. Read the ``INIT`` frame (a :class:`~.protocol.WorkerSpec`) from the inherited socket.
2. Put the TorchServe import shims (``ts.*``) and the model directory on ``sys.path``.
3. Load the handler; answer ``READY`` (or ``LOAD_FAILED`` with the cause, then exit 1).
4. Run batches one at a time on the main thread, which reads the socket itself (no
   reader thread: a request costs no thread hand-off). While a handler runs, every
   place where it can observe a cancel (``context.is_cancelled()``,
   ``send_intermediate_predict_response``, each item of a generator handler) first
   takes the frames that arrived meanwhile without blocking (at most every
   :data:`POLL_INTERVAL_S`), so a cancel reaches a running handler:
   ``send_intermediate_predict_response`` raises :class:`RequestCancelled`,
   ``context.is_cancelled()`` turns true and a generator handler is closed.
"""

from __future__ import annotations

import argparse
import faulthandler
import inspect
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from http import HTTPStatus
from typing import Any

from inference_service.errors import grpc_code_for_http
from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response
from inference_service.handler.metrics import Metrics
from inference_service.handler.streaming import RequestCancelled
from inference_service.handler.util import PredictionException
from inference_service.worker import protocol
from inference_service.worker.loader import HandlerLoadError, Service, load_service

log = logging.getLogger("inference_service.worker")

COMPAT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat")
_CANCELLED = 1  # grpc.StatusCode.CANCELLED
_INTERNAL = 13
POLL_INTERVAL_S = 0.001  # how often a running handler's cancel checks read the socket, at most
_RECV_BYTES = 1 << 18


def _code_number(status: int) -> int:
    return int(grpc_code_for_http(status).value[0])


class WorkerChannel:
    """The worker's end of the IPC socket: framed writes under a lock, frame reads, cancel set.

    Only the main thread reads: :meth:`read_frame` blocks between batches, :meth:`poll`
    takes what arrived while a handler runs (``CANCEL`` frames go to :attr:`cancelled`,
    ``CREDIT`` frames to the running requests' credits, others wait in order for
    :meth:`read_frame`).

    Flow control (:attr:`window` > 0): a running request may send ``window``
    intermediate responses beyond its credits; the next :meth:`send_intermediate`
    blocks until a ``CREDIT`` (or a ``CANCEL``) for it arrives.
    """

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
        self._eof = False

    def _next_buffered(self) -> tuple[int, bytes] | None:
        buf = self._buf
        size = protocol.HEADER.size
        if len(buf) < size:
            return None
        length, kind = protocol.HEADER.unpack_from(buf, 0)
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

    def _take(self, item: tuple[int, bytes]) -> None:
        kind, body = item
        if kind == protocol.CANCEL:
            self.cancelled.add(body.decode())
        elif kind == protocol.CREDIT:
            rid, count = protocol.decode_credit(body)
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
        """Take the frames that already arrived, without blocking: record cancels, keep the rest.

        Does nothing while another thread reads."""
        if not self._reading.acquire(blocking=False):
            return
        try:
            self._poll()
        finally:
            self._reading.release()

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
    def send_intermediate(self, request_id: str, payload: bytes) -> None:
        """Send one intermediate response (``CHUNK``), preceded by any queued handler metrics.

        Blocks while the request has no credit left (see the class docstring)."""
        credit = self._credit.get(request_id)
        if credit is not None:
            if credit <= 0:
                self._await_credit(request_id)
                credit = self._credit.get(request_id, 1)
            self._credit[request_id] = credit - 1
        data = protocol.encode_response(protocol.CHUNK, request_id, payload)
        metrics = self.metrics
        if metrics is not None and metrics.pending:
            data = protocol.encode_metrics(metrics.drain()) + data
        self.send(data)

    def is_cancelled(self, request_id: str) -> bool:
        """Whether a ``CANCEL`` arrived for ``request_id`` (reads the socket at most every
        :data:`POLL_INTERVAL_S`)."""
        self.poll_due()
        return request_id in self.cancelled


class Worker:
    """Runs one loaded :class:`Service` over a :class:`WorkerChannel`."""

    def __init__(self, channel: WorkerChannel, spec: protocol.WorkerSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.context = Context(
            model_name=spec.model_name,
            model_dir=spec.model_dir,
            manifest=spec.manifest,
            batch_size=spec.batch_size,
            gpu=spec.gpu,
            server_version=spec.server_version,
            limit_max_image_pixels=spec.limit_max_image_pixels,
            metrics=Metrics(spec.model_name),
            model_yaml_config=spec.model_yaml_config,
        )
        self.context._channel = channel
        if spec.forward_metrics:
            self.context.metrics.forward()
            channel.metrics = self.context.metrics
        self.service: Service | None = None

    def load(self) -> None:
        """Load the handler. Raises HandlerLoadError with the cause."""
        self.service = load_service(self.spec.handler, self.spec.model_dir, self.context)

    def serve(self) -> None:
        """Main thread: run batches until ``STOP`` or the channel closes; record cancels between them."""
        channel = self.channel
        while (item := channel.read_frame()) is not None:
            kind, body = item
            if kind == protocol.BATCH:
                self.run_batch(body)
            elif kind == protocol.CANCEL:
                channel.cancelled.add(body.decode())
            elif kind == protocol.STOP:
                return

    def run_batch(self, body: bytes) -> None:
        """Run one batch through the handler and answer every request in it, then ``DONE``."""
        assert self.service is not None
        batch = protocol.decode_batch(body)
        ids = [rid for rid, _, _, _ in batch]
        self.context._begin_batch(ids, [h for _, _, h, _ in batch], [s for _, s, _, _ in batch])
        self.channel.begin(ids)
        data: list[dict[str, Any]] = [inputs for _, _, _, inputs in batch]
        out: list[bytes] = []
        cancelled = self.channel.cancelled
        try:
            result = self.service.handle(data, self.context)
            if inspect.isgenerator(result):
                result = self._drain_generator(result, ids)
            if result is None:
                result = [None] * len(ids)
            if not isinstance(result, (list, tuple)) or len(result) != len(ids):
                got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
                raise TypeError(f"handler returned {got} results for a batch of {len(ids)} requests")
            self.channel.poll()
            for idx, rid in enumerate(ids):
                status = self.context.get_response_status(idx)
                if rid in cancelled:
                    out.append(protocol.encode_error(rid, _CANCELLED, "request cancelled"))
                elif status >= 400:
                    phrase = self.context.request_processor[idx].get_response_status_phrase()
                    message = phrase or _phrase(status)
                    out.append(protocol.encode_error(rid, _code_number(status), message))
                else:
                    out.append(protocol.encode_response(protocol.FINAL, rid, encode_response(result[idx])))
        except RequestCancelled:
            out = [protocol.encode_error(rid, _CANCELLED, "request cancelled") for rid in ids]
        except PredictionException as exc:
            log.warning("handler raised PredictionException %s: %s", exc.error_code, exc.message)
            out = [protocol.encode_error(rid, _code_number(exc.error_code), exc.message) for rid in ids]
        except Exception as exc:  # noqa: BLE001 - a handler bug answers INTERNAL, the worker lives on
            log.error("handler failed on requests %s:\n%s", ids, traceback.format_exc())
            message = str(exc) or type(exc).__name__
            out = [protocol.encode_error(rid, _INTERNAL, message) for rid in ids]
        self.channel.end(ids)
        metrics = self.channel.metrics
        if metrics is not None and metrics.pending:
            out.append(protocol.encode_metrics(metrics.drain()))
        out.append(protocol.frame(protocol.DONE))
        self.channel.send(b"".join(out))

    def _drain_generator(self, gen: Any, ids: list[str]) -> Any:
        """Send each yielded list as intermediate responses; return the generator's return value."""
        cancelled = self.channel.cancelled
        try:
            while True:
                item = next(gen)
                if not isinstance(item, (list, tuple)) or len(item) != len(ids):
                    raise TypeError(
                        f"generator handler yielded {type(item).__name__} instead of a list of "
                        f"{len(ids)} entries"
                    )
                live = 0
                self.channel.poll_due()  # take the cancels that arrived meanwhile
                for rid, value in zip(ids, item, strict=True):
                    if rid in cancelled:
                        continue
                    live += 1
                    if value is not None:
                        self.channel.send_intermediate(rid, encode_response(value))
                if live == 0:
                    gen.close()
                    raise RequestCancelled("all requests of this batch were cancelled")
        except StopIteration as stop:
            return stop.value
        finally:
            gen.close()


def _phrase(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"handler set status {status}"


def main(argv: list[str] | None = None) -> int:
    """Run a worker on the socket inherited as ``--fd``. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="inference_service.worker.main")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="inherited socket (a single worker)")
    where.add_argument("--connect", help="Unix socket of the frontend (a rank of a torchrun group)")
    args = parser.parse_args(argv)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.connect)
    channel = WorkerChannel(sock)
    first = channel.read_frame()
    if first is None or first[0] != protocol.INIT:
        return 2
    spec = protocol.WorkerSpec.from_body(first[1])
    channel.window = spec.stream_window
    faulthandler.enable()
    # The frontend relays each stderr line at the level it starts with, under its own
    # timestamp and the worker's model and id (worker/process.py).
    logging.basicConfig(
        level=os.environ.get("INFERENCE_SERVICE_LOG_LEVEL") or spec.log_level or "INFO",
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if COMPAT_PATH not in sys.path:
        sys.path.insert(0, COMPAT_PATH)
    for path in reversed(spec.extra_paths):
        sys.path.insert(0, path)
    os.environ.setdefault("TS_MODEL_DIR", spec.model_dir)
    worker = Worker(channel, spec)
    try:
        worker.load()
    except HandlerLoadError as exc:
        log.error("model %s failed to load: %s", spec.model_name, exc)
        channel.send(protocol.frame(protocol.LOAD_FAILED, str(exc).encode()))
        return 1
    except BaseException as exc:  # noqa: BLE001 - report any load failure, even SystemExit
        log.error("model %s failed to load:\n%s", spec.model_name, traceback.format_exc())
        channel.send(protocol.frame(protocol.LOAD_FAILED, f"{type(exc).__name__}: {exc}".encode()))
        return 1
    rank = int(os.environ.get("RANK", "0"))
    if channel.metrics is not None and channel.metrics.pending:  # recorded by initialize()
        channel.send(protocol.encode_metrics(channel.metrics.drain()))
    channel.send(protocol.frame(protocol.READY, f'{{"pid": {os.getpid()}, "rank": {rank}}}'.encode()))
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
