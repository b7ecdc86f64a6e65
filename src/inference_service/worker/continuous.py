"""Continuous batching in the worker: TorchServe's ``continuousBatching: true`` contract.

The handler is called again and again with the running requests (up to ``batch_size``);
``data[index]`` is a request's input map on its first call, ``{}`` after;
``context.stopping_criteria`` says per request whether a result is its last. A lagging stream
pauses, is preempted after ``streamPausePreemptMSec`` and ended after ``streamPauseAbortMSec``;
``preempt_requests`` / ``drop_requests`` are optional handler additions. See docs/llm.md.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference_service.contracts import wire
from inference_service.contracts.controls import PRIORITY_HEADER, header_values
from inference_service.handler.encoding import encode_response
from inference_service.handler.streaming import RequestCancelled
from inference_service.worker import answers
from inference_service.worker.inputs import handler_request

if TYPE_CHECKING:
    from inference_service.worker.runtime import Worker

log = logging.getLogger("inference_service.worker")

_RESOURCE_EXHAUSTED = 8  # grpc.StatusCode.RESOURCE_EXHAUSTED


def _ms_setting(config: dict[str, Any], key: str, default: int) -> float | None:
    """A model-config duration in ms (range-checked by the server) as seconds; ``None`` for 0."""
    value = config.get(key)
    ms = default if value is None or isinstance(value, bool) else int(value)
    return ms / 1000 if ms > 0 else None


def _priority(headers: dict[str, str]) -> int:
    """The request's ``x-request-priority`` (checked by the server; 0 when absent)."""
    return int(header_values(headers, (PRIORITY_HEADER,)).get(PRIORITY_HEADER, 0))


@dataclass(eq=False)
class _Running:
    """A request on this worker: its headers and, until its first call, its inputs."""

    request_id: str
    sequence_id: str | None
    headers: dict[str, Any]
    inputs: dict[str, Any] | None = field(default=None)
    resumed: bool = False  # preempted earlier: its flow-control credit is kept, not reset
    priority: int = 0  # x-request-priority: lower first
    yielded: bool = False  # preempted for a request of an earlier priority (YIELD)
    arrival: int = 0


class ContinuousRunner:
    """Runs a worker's handler as a continuous batch (see the module docstring)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.channel = worker.channel
        self.max_running = max(1, worker.spec.max_running)
        self.waiting: deque[_Running] = deque()
        self.running: dict[str, _Running] = {}
        self.preempted: dict[str, _Running] = {}  # paused too long: no place until its client reads
        self._blocked_since: dict[str, float] = {}  # request -> time.monotonic() it ran out of credit
        self._to_yield: set[str] = set()
        self._arrivals = 0
        config = worker.spec.model_yaml_config or {}
        self.preempt_after_s = _ms_setting(config, "streamPausePreemptMSec", 1000)
        self.abort_after_s = _ms_setting(config, "streamPauseAbortMSec", 60_000)

    def serve(self) -> None:
        """Run until ``STOP`` or the channel closes."""
        channel = self.channel
        while True:
            if not self.running and not self.waiting and not self.preempted:
                item = channel.read_frame()
                if item is None or not self._take(item):
                    return
            channel.poll()
            while (item := channel.next_pending()) is not None:
                if not self._take(item):
                    return
            self._drop_cancelled()
            self._yield()
            timeout = self._check_paused(time.monotonic())
            self._admit()
            active = [r for r in self.running.values() if channel.has_credit(r.request_id)]
            if active:
                self._step(active)
            elif self.running or self.preempted:
                channel.wait_input(timeout)  # every request waits for its client: wait for a frame

    def _admit(self) -> None:
        """Fill the free places: the waiting requests and those that yielded theirs, by priority,
        a yielded one first among equals, then arrival."""
        channel = self.channel
        while len(self.running) < self.max_running:
            yielded = [r for r in self.preempted.values() if r.yielded and channel.has_credit(r.request_id)]
            if not self.waiting and not yielded:
                return
            request = min([*yielded, *self.waiting], key=lambda r: (r.priority, not r.yielded, r.arrival))
            if request.yielded:
                del self.preempted[request.request_id]
                request.yielded = False
                channel.send(wire.frame(wire.RESUMED, request.request_id.encode()))
            else:
                self.waiting.remove(request)
            self.running[request.request_id] = request
            if not request.resumed:
                channel.begin([request.request_id])

    def _yield(self) -> None:
        """Preempt the running requests the server asked to give their place up (YIELD)."""
        rids = [rid for rid in self._to_yield if rid in self.running]
        self._to_yield.clear()
        if not rids:
            return
        for rid in rids:
            request = self.preempted[rid] = self.running.pop(rid)
            request.yielded = request.resumed = True
        self._call_handler("preempt_requests", rids)
        self.channel.send(b"".join([wire.frame(wire.PREEMPTED, rid.encode()) for rid in rids]
                                   + self.channel.pending_metrics()))

    def _check_paused(self, now: float) -> float | None:
        """Preempt or end the requests out of credit for too long, queue again the preempted
        ones whose client read; return the seconds until the next such bound (``None``: none)."""
        channel = self.channel
        blocked = self._blocked_since
        to_preempt: list[str] = []
        to_end: list[str] = []
        due: float | None = None
        for group in (self.running, self.preempted):
            for rid in group:
                if channel.has_credit(rid):
                    blocked.pop(rid, None)
                    continue
                since = blocked.setdefault(rid, now)
                bounds = [self.abort_after_s] + ([self.preempt_after_s] if group is self.running else [])
                if self.abort_after_s is not None and now - since >= self.abort_after_s:
                    to_end.append(rid)
                elif group is self.running and self.preempt_after_s is not None and now - since >= self.preempt_after_s:
                    to_preempt.append(rid)
                for bound in bounds:
                    if bound is None:
                        continue
                    left = since + bound - now
                    if left > 0:
                        due = left if due is None else min(due, left)
        notes = []
        for rid in [rid for rid, r in self.preempted.items() if channel.has_credit(rid) and not r.yielded]:
            request = self.preempted.pop(rid)
            request.resumed = True
            self.waiting.appendleft(request)  # ahead of the new requests, as vLLM's preempted
            notes.append(wire.frame(wire.RESUMED, rid.encode()))
        if to_preempt:
            for rid in to_preempt:
                self.preempted[rid] = self.running.pop(rid)
                notes.append(wire.frame(wire.PREEMPTED, rid.encode()))
            self._call_handler("preempt_requests", to_preempt)
            notes += self.channel.pending_metrics()  # the engine's gauges now: no step may run for a while
        if notes:
            channel.send(b"".join(notes))
        if to_end:
            frames = []
            for rid in to_end:
                self.running.pop(rid, None)
                self.preempted.pop(rid, None)
                blocked.pop(rid, None)
                frames.append(wire.encode_error(
                    rid, _RESOURCE_EXHAUSTED,
                    f"stream paused (client not reading) for more than {self.abort_after_s:g} s; ended to free "
                    "its place (streamPauseAbortMSec)", 429))
            self.channel.end(to_end)
            self._drop_in_handler(to_end)
            self.channel.send(b"".join(frames + self.channel.pending_metrics()))
        return due

    def _take(self, item: tuple[int, bytes]) -> bool:
        """Handle one frame; False on ``STOP`` or the end of the channel."""
        kind, body = item
        if kind == wire.BATCH:
            decode = self.worker.spec.decode_input_request
            for request in wire.decode_batch(body):
                headers, inputs = handler_request(request, decode)
                self._arrivals += 1
                self.waiting.append(_Running(request.request_id, request.sequence_id, headers, inputs,
                                             priority=_priority(request.headers), arrival=self._arrivals))
        elif kind == wire.CANCEL:
            self.channel.cancelled.add(body.decode())
        elif kind == wire.YIELD:
            self._to_yield.add(body.decode())
        elif kind == wire.STOP or kind == 0:
            return False
        return True

    def _drop_cancelled(self) -> None:
        """Answer CANCELLED for the cancelled requests and let them go."""
        cancelled = self.channel.cancelled
        if not cancelled:
            return
        frames = []
        known = []  # requests the handler has seen: it frees their state
        for request in [r for r in self.waiting if r.request_id in cancelled]:
            self.waiting.remove(request)
            frames.append(answers.cancelled(request.request_id))
            if request.resumed:
                known.append(request.request_id)
        gone = [rid for rid in [*self.running, *self.preempted] if rid in cancelled] + known
        for rid in gone:
            self.running.pop(rid, None)
            self.preempted.pop(rid, None)
            self._blocked_since.pop(rid, None)
            if rid not in known:  # a resumed waiting request got its frame above
                frames.append(answers.cancelled(rid))
        if gone:
            self.channel.end(gone)
            self._drop_in_handler(gone)
            frames += self.channel.pending_metrics()
        cancelled.clear()  # ids of requests this worker no longer has are forgotten too
        if frames:
            self.channel.send(b"".join(frames))

    def _drop_in_handler(self, request_ids: list[str]) -> None:
        self._call_handler("drop_requests", request_ids)

    def _call_handler(self, method: str, request_ids: list[str]) -> None:
        """Call the handler's optional ``method(request_ids)`` (``drop_requests``, ``preempt_requests``)."""
        call = getattr(self.worker.handler_object, method, None)
        if callable(call):
            try:
                call(list(request_ids))
            except Exception:  # noqa: BLE001 - the handler's cleanup must not stop the worker
                log.error("handler %s(%s) failed:\n%s", method, request_ids, traceback.format_exc())

    def _step(self, active: list[_Running]) -> None:
        """One handler call over ``active``; answer or keep each request."""
        worker = self.worker
        context = worker.context
        ids = [r.request_id for r in active]
        context.begin_batch(ids, [r.headers for r in active], [r.sequence_id for r in active])
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
                if rid in cancelled:
                    continue  # answered by _drop_cancelled at the next turn
                refused = answers.status_error(context, idx, rid)
                if refused is not None:
                    out.append(refused)
                    ended.append(rid)
                    continue
                value = result[idx]
                stop = criteria[idx](value) if criteria is not None else None
                headers = context.get_response_headers(idx)
                if stop is False:
                    if value is not None:
                        self.channel.send_intermediate(rid, encode_response(value), headers)
                    continue
                out += self.channel.headers_frames(rid, headers)
                out.append(answers.final(rid, value))
                ended.append(rid)
        except RequestCancelled:
            ended = [rid for rid in ids if rid not in self.channel.cancelled]
            out = [answers.error(rid, "handler stopped: every request it streamed to was cancelled")
                   for rid in ended]
            self._drop_in_handler(ended)
        except Exception as exc:  # noqa: BLE001 - a handler bug fails this call's requests, the worker lives on
            out = answers.failed(ids, exc)
            ended = ids
            self._drop_in_handler(ids)
        for rid in ended:
            self.running.pop(rid, None)
            self._blocked_since.pop(rid, None)
        if ended:
            self.channel.end(ended)
        out += self.channel.pending_metrics()
        if out:
            self.channel.send(b"".join(out))

