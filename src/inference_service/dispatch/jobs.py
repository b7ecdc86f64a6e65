"""Requests in flight: :class:`Job` (one request and its :class:`Mailbox`) and :class:`JobQueue`.

A mailbox is fed only by the routing callback of the worker that runs its job. Dispatch is
synchronous: a put job reaches a free worker, and a worker reporting done takes the next batch,
within the same call; only ``max_batch_delay`` arms a timer (this beat a task per batch). A
worker offers its *room*: 1 batch, or free places when it runs several requests at once
(``concurrent=True``). There the shared jobs are taken in turn by unit of fairness (a client
request; the engine requests of one OpenAI request share one, :attr:`Job.group`), and a worker's
last free place goes only to a unit it runs nothing of. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, Union

from inference_service.contracts.explain import is_explanation
from inference_service.dispatch.units import UnitQueue
from inference_service.errors import DeadlineExceeded, InferenceError

log = logging.getLogger(__name__)

MAILBOX_SIZE = 256
#: The RPC credits its worker every this many intermediate responses it took (flow control;
#: the worker side's window is ``contracts.wire.STREAM_WINDOW``).
CREDIT_BATCH = 32


class Kind(enum.IntEnum):
    """What a mailbox item carries."""

    CHUNK = 0  #: an intermediate response (bytes)
    FINAL = 1  #: the last response (bytes)
    ERROR = 2  #: the request failed (an :class:`InferenceError`)


MailItem = tuple[Kind, Union[bytes, InferenceError]]
"""One mailbox item: ``(Kind.CHUNK | Kind.FINAL, bytes)`` or ``(Kind.ERROR, InferenceError)``."""


class Runner(Protocol):
    """What a :class:`Job` needs of the worker running it (``dispatch.process.WorkerProcess``)."""

    def credit(self, request_id: str, count: int) -> None:
        """The client took ``count`` more intermediate responses of ``request_id``."""

    def cancel(self, request_id: str) -> None:
        """The client of ``request_id`` went away."""

_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A request id unique in this server's lifetime: 32 hex digits (a random per-process
    prefix, then a counter), the length of a uuid4 hex without a system call per request."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class Taker(Protocol):
    """A worker as :class:`JobQueue` sees it (``dispatch.supervisor.WorkerSlot``)."""

    @property
    def id(self) -> int:
        """The worker id (a sequence's jobs are pinned to it)."""

    def take(self, batch: list[Job]) -> bool:
        """Hand ``batch`` to the worker now; False when it went away (the jobs are queued again).

        Raises:
            Exception: anything; :meth:`JobQueue._hand` fails that batch alone (``DISPATCH_FAILED``).
        """

    def runs(self, unit: str) -> bool:
        """Whether a request of ``unit`` (:attr:`Job.unit`) runs on the worker."""


class Mailbox:
    """A job's responses on their way to its RPC: one producer (the routing callback), one consumer.

    :meth:`put` never blocks: past ``capacity`` it returns False and the routing stops reading that
    worker until :attr:`on_space` is called, so a lagging client back-pressures its worker.
    """

    __slots__ = ("capacity", "on_space", "_items", "_waiter")

    def __init__(self, capacity: int = MAILBOX_SIZE) -> None:
        self.capacity = capacity
        self.on_space: Callable[[], None] | None = None
        self._items: deque[MailItem] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: MailItem) -> bool:
        """Append ``item`` (never blocks) and wake the consumer; False when now full."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return len(self._items) < self.capacity

    async def get(self) -> MailItem:
        """The next item ``(kind, payload)``, waiting for one."""
        items = self._items
        while not items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        item = items.popleft()
        if self.on_space is not None and len(items) < self.capacity:
            self._space()
        return item

    def clear(self) -> None:
        """Drop every waiting item (the producer may go on)."""
        self._items.clear()
        if self.on_space is not None:
            self._space()

    def _space(self) -> None:
        callback, self.on_space = self.on_space, None
        if callback is not None:
            callback()


@dataclass(eq=False)
class Job:
    """One inference request. Times are ``time.monotonic()``: ``deadline`` (dropped after; ``None``:
    none), ``enqueued`` (starts ``max_batch_delay``), ``dispatched`` (0.0: not yet). ``stream`` (or
    an explanation: :attr:`alone`) forces a batch of one; ``request_id`` is the handler's
    ``context.request_ids`` value; ``content_types`` as :class:`~inference_service.contracts.wire.Request`'s;
    ``group``: the requests of one client request share it (:attr:`unit`); ``response_headers``:
    those the handler set, filled in as they arrive (before the message they came with)."""

    inputs: dict[str, bytes]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    sequence_id: str | None = None
    deadline: float | None = None
    request_id: str = field(default_factory=new_request_id)
    enqueued: float = field(default_factory=time.monotonic)
    mailbox: Mailbox = field(default_factory=Mailbox)
    cancelled: bool = False
    finished: bool = False
    worker: Runner | None = None
    dispatched: float = 0.0
    taken: int = 0  # intermediate responses taken since the last credit
    content_types: dict[str, str] = field(default_factory=dict)
    group: str | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    priority: int = 0  # lower first, as vLLM's
    timed_out: bool = False  # its deadline passed (:meth:`deadline_passed`): counted as a cancel

    @property
    def unit(self) -> str:
        """Its unit of fairness in a concurrent queue: its group, else itself."""
        return self.group or self.request_id

    @property
    def alone(self) -> bool:
        """A batch of its own: a stream, or an explanation (TorchServe's ``explain_handle`` reads the
        first request's target only, and a prediction must never get an explanation)."""
        return self.stream or is_explanation(self.headers)

    def took_chunk(self) -> None:
        """The RPC took one intermediate response: credit the worker every :data:`CREDIT_BATCH`."""
        self.taken += 1
        if self.taken >= CREDIT_BATCH:
            self.taken = 0
            if self.worker is not None and not self.finished:
                self.worker.credit(self.request_id, CREDIT_BATCH)

    def expired(self, now: float) -> bool:
        """Whether the client's deadline passed."""
        return self.deadline is not None and now >= self.deadline

    def fail(self, error: InferenceError) -> None:
        """End the job with ``error`` (the terminal item) unless it already ended (never blocks)."""
        if self.finished:
            return
        self.finished = True
        if self.cancelled:
            return
        self.mailbox.put((Kind.ERROR, error))

    def end(self, error: InferenceError) -> None:
        """End the running job with ``error`` and tell its worker to drop it (what the worker still
        sends of it is dropped; its last frame frees its place)."""
        if self.finished:
            return
        self.fail(error)
        self.cancelled = True
        if self.worker is not None:
            self.worker.cancel(self.request_id)

    def deadline_passed(self) -> None:
        """The client's deadline passed: a queued job leaves the queue unworked (DEADLINE_IN_QUEUE),
        a running one is stopped in its worker; both answer DEADLINE_EXCEEDED (HTTP 504)."""
        if self.finished or self.cancelled:
            return
        self.timed_out = True
        if self.worker is None:  # the queue drops it when it comes up
            self.fail(DeadlineExceeded("deadline passed while queued in the job queue", reason="DEADLINE_IN_QUEUE"))
            self.cancelled = True
        else:
            self.end(DeadlineExceeded("the request ran past its deadline and was stopped", reason="DEADLINE_RUNNING"))

    def abort(self) -> None:
        """The client went away: drop buffered output and tell the worker running it."""
        if self.cancelled:
            return
        self.cancelled = True
        self.mailbox.clear()
        if self.worker is not None and not self.finished:
            self.worker.cancel(self.request_id)


def overdue(jobs: Iterable[Job], now: float, timeout: float) -> tuple[list[Job], float]:
    """The running ``jobs`` dispatched ``timeout`` s or more before ``now`` (cancelled and finished
    ones left out), and when the next of the others is due (``inf``: none)."""
    ended: list[Job] = []
    next_due = float("inf")
    for job in jobs:
        if job.cancelled or job.finished:
            continue
        due = job.dispatched + timeout
        if now >= due:
            ended.append(job)
        else:
            next_due = min(next_due, due)
    return ended, next_due


class JobQueue:
    """A model version's bounded job queue, per-worker queues for sequences, and its free workers.

    Shared jobs are batched for whichever worker is free first (TorchServe's rule), by priority then
    arrival; a sequence's go to its pinned worker. A batch leaves at ``batch_size`` jobs or after
    ``max_batch_delay_ms``; a streaming job or an explanation is a batch of one. With
    ``concurrent=True`` a worker takes every waiting job it has room for at once, the roomiest
    first. ``capacity`` is ``job_queue_size``.
    """

    def __init__(self, capacity: int, batch_size: int = 1, max_batch_delay_ms: int = 0,
                 concurrent: bool = False) -> None:
        self.capacity = capacity
        self.batch_size = max(1, batch_size)
        self.max_batch_delay_s = max(0, max_batch_delay_ms) / 1000.0
        self.concurrent = concurrent
        self._shared: deque[Job] | UnitQueue[Job] = UnitQueue() if concurrent else deque()
        self._pinned: dict[int, deque[Job]] = {}
        self._idle: dict[int, tuple[Taker, int]] = {}  # free workers (in the order they became free), room
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._size = 0
        self.dispatch_failures = 0  #: batches that could not be handed to a worker (see _hand)

    def __len__(self) -> int:
        return self._size

    def remaining_capacity(self, unit: str | None = None) -> int:
        """Free places (DescribeModel's ``jobQueueStatus.remainingCapacity``); a concurrent
        queue's unit holds one place, so a job of a queued ``unit`` always has room."""
        if not self.concurrent:
            return max(0, self.capacity - self._size)
        if unit is not None and unit in self._shared:
            return max(1, self.capacity - self._places())
        return max(0, self.capacity - self._places())

    def _places(self) -> int:
        return len(self._shared) + sum(len(q) for q in self._pinned.values())

    def put(self, job: Job, worker_id: int | None = None) -> None:
        """Enqueue ``job`` (pinned to ``worker_id`` when given) and dispatch what is ready; the caller has
        admitted it (``ModelVersion.admit``)."""
        if worker_id is not None:
            self._pinned.setdefault(worker_id, deque()).append(job)
        elif isinstance(self._shared, UnitQueue) or not self._shared or job.priority >= self._shared[-1].priority:
            self._shared.append(job)
        else:  # ahead of the first waiting job of a later priority (lower first, then arrival)
            self._shared.insert(next(i for i, j in enumerate(self._shared) if j.priority > job.priority), job)
        self._size += 1
        if self._idle:
            self._dispatch()

    def offer(self, worker: Taker, room: int = 1) -> None:
        """``worker`` can take ``room`` more requests (a batch, when not concurrent): hand it
        what is ready now, the rest when it is (``room`` 0 withdraws it)."""
        if room <= 0:
            self._idle.pop(worker.id, None)
            return
        self._idle[worker.id] = (worker, room)
        self._dispatch()

    def withdraw(self, worker_id: int) -> None:
        """Worker ``worker_id`` takes no more batches (it stops or died)."""
        self._idle.pop(worker_id, None)

    def _dispatch(self) -> None:
        idle = self._idle
        if self._pinned:
            for wid in [w for w in idle if self._pinned.get(w)]:
                pinned = self._pinned[wid]
                room = idle[wid][1] if self.concurrent else 1
                jobs: list[Job] = []
                while len(jobs) < room and (job := self._pop_live(pinned)) is not None:
                    jobs.append(job)
                if jobs:
                    self._hand(wid, jobs, pinned=True)
        while idle and self._shared:
            if self.concurrent:  # the roomiest worker first; one whose last place no unit may take is passed
                batch = None
                for wid in sorted(idle, key=lambda w: -idle[w][1]):
                    if (batch := self._take_now(*idle[wid])) is not None:
                        break
            else:
                wid = next(iter(idle))
                batch = self._take_shared()
            if batch is None:
                return
            self._hand(wid, batch)

    def _hand(self, worker_id: int, batch: list[Job], pinned: bool = False) -> None:
        """Send ``batch`` to the worker. One rule for whatever goes wrong on the way: the
        batch's requests fail with INTERNAL naming the cause, the worker stays free for the
        next batch, and :attr:`dispatch_failures` counts it."""
        worker, room = self._idle.pop(worker_id)
        try:
            sent = worker.take(batch)
        except Exception as exc:  # noqa: BLE001 - contained here: only this batch fails
            log.exception("cannot hand %d request(s) to worker %d", len(batch), worker_id)
            self._idle[worker_id] = (worker, room)
            self.dispatch_failures += 1
            error = InferenceError(f"request could not be handed to a worker: {type(exc).__name__}: {exc}",
                                   reason="DISPATCH_FAILED")
            for job in batch:
                job.fail(error)
            return
        if sent:
            if self.concurrent and room > len(batch):
                self._idle[worker_id] = (worker, room - len(batch))
            return
        # The worker went away meanwhile: the jobs go back to the front of their queue.
        dq = self._pinned.setdefault(worker_id, deque()) if pinned else self._shared
        dq.extendleft(reversed(batch))
        self._size += len(batch)

    def _take_now(self, worker: Taker, room: int) -> list[Job] | None:
        """Up to ``room`` live shared jobs for ``worker``, a unit at a time in turn (concurrent
        mode), or None. Its last free place goes only to a unit it runs nothing of, so that a
        client request arriving later finds a place at once."""
        out: list[Job] = []
        taken: set[str] = set()

        def newcomer(unit: str) -> bool:
            return unit not in taken and not worker.runs(unit)

        while len(out) < room:
            job = self._pop_live(self._shared, newcomer if room - len(out) == 1 else None)
            if job is None:
                break
            out.append(job)
            taken.add(job.unit)
        return out or None

    def _take_shared(self) -> list[Job] | None:
        """The next batch of shared jobs, or None (nothing live, or the batch still fills:
        a timer dispatches it when ``max_batch_delay`` passes)."""
        shared = self._shared
        assert isinstance(shared, deque)  # batch mode
        first = self._pop_live(shared)
        if first is None:
            return None
        if first.alone or self.batch_size <= 1:
            return [first]
        batch = [first]
        ready = False
        for job in shared:
            if job.alone:
                ready = True
                break
            if not job.cancelled:
                batch.append(job)
                if len(batch) >= self.batch_size:
                    ready = True
                    break
        due = first.enqueued + self.max_batch_delay_s
        if not ready and time.monotonic() < due:
            shared.appendleft(first)
            self._size += 1
            self._arm(due)
            return None
        out = [first]
        while len(out) < self.batch_size and shared and not shared[0].alone:
            live = self._pop_live(shared)
            if live is not None:
                out.append(live)
        return out

    def _arm(self, when: float) -> None:
        """Dispatch again at ``when`` (a ``time.monotonic()`` value)."""
        if self._timer is not None:
            if self._timer_due <= when:
                return
            self._timer.cancel()
        self._timer_due = when
        self._timer = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _pop_live(self, dq: deque[Job] | UnitQueue[Job], allowed: Callable[[str], bool] | None = None) -> Job | None:
        now = time.monotonic()
        while dq:
            try:
                job = dq.popleft(allowed) if isinstance(dq, UnitQueue) else dq.popleft()
            except IndexError:  # no unit allowed
                return None
            self._size -= 1
            if job.cancelled:
                continue
            if job.expired(now):
                job.fail(DeadlineExceeded("deadline passed while the request waited in the job queue",
                                          reason="DEADLINE_IN_QUEUE"))
                continue
            return job
        return None

    def drain(self, error: InferenceError, worker_id: int | None = None) -> None:
        """Fail every waiting job (of one worker's pinned queue, or all)."""
        queues = [self._pinned.pop(worker_id, deque())] if worker_id is not None else [
            self._shared, *self._pinned.values()]
        for dq in queues:
            while dq:
                dq.popleft().fail(error)
                self._size -= 1
