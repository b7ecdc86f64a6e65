"""Continuous batching in the worker: TorchServe's ``continuousBatching: true`` contract.

The handler is called again and again with the requests running on this worker; new
requests join at the next call (up to ``batch_size`` running at once), and each request
leaves when it ends, so its place is reused at once. One call, for the handler:

- ``context.request_ids`` is ``{index: request id}`` of the requests in this call;
- ``data[index]`` is the request's input map the first time the request is in a call,
  and ``{}`` afterwards (TorchServe re-sends a running request without its inputs;
  handlers keep per-request state themselves, e.g. in ``context.cache``);
- the handler returns one result per request and sets ``context.stopping_criteria``,
  one callable per request, called here with that request's result: ``True`` sends the
  result as the request's last message, ``False`` sends it as an intermediate message
  and keeps the request running (a ``None`` result then sends nothing: an addition), and
  ``None`` sends it as the request's only (non-streamed) response. Without stopping
  criteria every result is the request's final response;
- a status >= 400 set for a request (``context.set_response_status``) ends it with
  that error; an exception from the handler fails every request of the call.

Requests that are not in a call although running:

- a request whose client is slower than the stream (its flow-control window is used
  up) *pauses*: it stays out of the calls until its client takes more, and the others
  go on (its handler state must be kept);
- a cancelled request (client gone, deadline) leaves at the next call and is answered
  CANCELLED; if the handler has a ``drop_requests(request_ids)`` method (an addition,
  e.g. to free a KV cache at once) it is called with the ids that left that way.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference_service.handler.encoding import encode_response
from inference_service.handler.streaming import RequestCancelled
from inference_service.handler.util import PredictionException
from inference_service.worker import protocol

if TYPE_CHECKING:
    from inference_service.worker.runtime import Worker

log = logging.getLogger("inference_service.worker")


@dataclass(eq=False)
class _Running:
    """A request on this worker: its headers and, until its first call, its inputs."""

    request_id: str
    sequence_id: str | None
    headers: dict[str, str]
    inputs: dict[str, Any] | None = field(default=None)


class ContinuousRunner:
    """Runs a worker's handler as a continuous batch (see the module docstring).

    Args:
        worker: the loaded worker (channel, context, service, ``spec.max_running``).
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.channel = worker.channel
        self.max_running = max(1, worker.spec.max_running)
        self.waiting: deque[_Running] = deque()
        self.running: dict[str, _Running] = {}

    def serve(self) -> None:
        """Run until ``STOP`` or the channel closes."""
        channel = self.channel
        while True:
            if not self.running and not self.waiting:
                item = channel.read_frame()
                if item is None or not self._take(item):
                    return
            channel.poll()
            while (item := channel.next_pending()) is not None:
                if not self._take(item):
                    return
            self._drop_cancelled()
            while self.waiting and len(self.running) < self.max_running:
                request = self.waiting.popleft()
                self.running[request.request_id] = request
                channel.begin([request.request_id])
            active = [r for r in self.running.values() if channel.has_credit(r.request_id)]
            if active:
                self._step(active)
            elif self.running:
                channel.wait_input()  # every running request waits for its client: wait for a frame

    def _take(self, item: tuple[int, bytes]) -> bool:
        """Handle one frame; False on ``STOP`` or the end of the channel."""
        kind, body = item
        if kind == protocol.BATCH:
            for rid, seq, headers, inputs in protocol.decode_batch(body):
                self.waiting.append(_Running(rid, seq, headers, inputs))
        elif kind == protocol.CANCEL:
            self.channel.cancelled.add(body.decode())
        elif kind == protocol.STOP or kind == 0:
            return False
        return True

    def _drop_cancelled(self) -> None:
        """Answer CANCELLED for the cancelled requests and let them go."""
        cancelled = self.channel.cancelled
        if not cancelled:
            return
        frames = []
        for request in [r for r in self.waiting if r.request_id in cancelled]:
            self.waiting.remove(request)
            frames.append(self.worker.cancelled_frame(request.request_id))
        gone = [rid for rid in self.running if rid in cancelled]
        for rid in gone:
            del self.running[rid]
            frames.append(self.worker.cancelled_frame(rid))
        if gone:
            self.channel.end(gone)
            self._drop_in_handler(gone)
        cancelled.clear()  # ids of requests this worker no longer has are forgotten too
        if frames:
            self.channel.send(b"".join(frames))

    def _drop_in_handler(self, request_ids: list[str]) -> None:
        drop = getattr(self.worker.handler_object, "drop_requests", None)
        if callable(drop):
            try:
                drop(list(request_ids))
            except Exception:  # noqa: BLE001 - the handler's cleanup must not stop the worker
                log.error("handler drop_requests(%s) failed:\n%s", request_ids, traceback.format_exc())

    def _step(self, active: list[_Running]) -> None:
        """One handler call over ``active``; answer or keep each request."""
        worker = self.worker
        context = worker.context
        ids = [r.request_id for r in active]
        context._begin_batch(ids, [r.headers for r in active], [r.sequence_id for r in active])
        data = []
        for request in active:
            data.append(request.inputs if request.inputs is not None else {})
            request.inputs = None
        out: list[bytes] = []
        ended: list[str] = []
        try:
            result = worker.call_handler(data, ids)
            criteria = context.stopping_criteria
            if criteria is not None and (not isinstance(criteria, (list, tuple)) or len(criteria) != len(ids)):
                got = len(criteria) if isinstance(criteria, (list, tuple)) else type(criteria).__name__
                raise TypeError(f"context.stopping_criteria holds {got} entries for {len(ids)} requests")
            cancelled = self.channel.cancelled
            for idx, rid in enumerate(ids):
                status, _phrase = context.get_response_status(idx)
                if rid in cancelled:
                    continue  # answered by _drop_cancelled at the next turn
                if status >= 400:
                    out.append(worker.status_frame(idx, rid, status))
                    ended.append(rid)
                    continue
                value = result[idx]
                stop = criteria[idx](value) if criteria is not None else None
                if stop is False:
                    if value is not None:
                        self.channel.send_intermediate(rid, encode_response(value))
                    continue
                out.append(protocol.encode_response(protocol.FINAL, rid, encode_response(value)))
                ended.append(rid)
        except RequestCancelled:
            ended = [rid for rid in ids if rid not in self.channel.cancelled]
            out = [worker.error_frame(rid, "handler stopped: every request it streamed to was cancelled")
                   for rid in ended]
            self._drop_in_handler(ended)
        except PredictionException as exc:
            log.warning("handler raised PredictionException %s: %s", exc.error_code, exc.message)
            out = [worker.prediction_error_frame(rid, exc) for rid in ids]
            ended = ids
            self._drop_in_handler(ids)
        except Exception as exc:  # noqa: BLE001 - a handler bug fails this call's requests, the worker lives on
            log.error("handler failed on requests %s:\n%s", ids, traceback.format_exc())
            out = [worker.error_frame(rid, str(exc) or type(exc).__name__) for rid in ids]
            ended = ids
            self._drop_in_handler(ids)
        for rid in ended:
            self.running.pop(rid, None)
        if ended:
            self.channel.end(ended)
        metrics = self.channel.metrics
        if metrics is not None and metrics.pending:
            out.append(protocol.encode_metrics(metrics.drain()))
        if out:
            self.channel.send(b"".join(out))

