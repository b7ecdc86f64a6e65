"""Requests in flight: :class:`Job` (one request and its mailbox) and :class:`JobQueue`.

A job's mailbox is a bounded ``asyncio.Queue`` fed only by the routing task of
the worker that runs it; the RPC that owns the job reads it. Abort marks the
job so the routing task drops further output and the queue skips it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_service.errors import Cancelled, DeadlineExceeded, InferenceError, ResourceExhausted

if TYPE_CHECKING:
    from inference_service.worker.process import WorkerProcess

MAILBOX_SIZE = 256

# Mailbox item kinds.
CHUNK = 0
FINAL = 1
ERROR = 2


@dataclass(eq=False)
class Job:
    """One inference request.

    Attributes:
        inputs: the gRPC input map (name -> bytes).
        headers: request headers for the handler (``context.get_request_header``).
        stream: whether the client streams (forces a batch of one).
        sequence_id: StreamPredictions2 sequence, else ``None``.
        deadline: ``time.monotonic()`` value after which the job is dropped, or ``None``.
        request_id: unique id (hex), the handler's ``context.request_ids`` value.
        enqueued: ``time.monotonic()`` at submission (starts ``max_batch_delay``).
        dispatched: ``time.monotonic()`` when a worker took the job (0.0: not yet), for the
            queue latency metric.
        mailbox: bounded queue of ``(kind, payload)``; ``payload`` is bytes for
            CHUNK/FINAL and an :class:`InferenceError` for ERROR.
    """

    inputs: dict[str, bytes]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    sequence_id: str | None = None
    deadline: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    enqueued: float = field(default_factory=time.monotonic)
    mailbox: asyncio.Queue[tuple[int, object]] = field(
        default_factory=lambda: asyncio.Queue(MAILBOX_SIZE)
    )
    cancelled: bool = False
    finished: bool = False
    worker: WorkerProcess | None = None
    dispatched: float = 0.0

    def expired(self, now: float) -> bool:
        """Whether the client's deadline passed."""
        return self.deadline is not None and now >= self.deadline

    def fail(self, error: InferenceError) -> None:
        """End the job with ``error`` unless it already ended (never blocks)."""
        if self.finished:
            return
        self.finished = True
        if self.cancelled:
            return
        while self.mailbox.full():  # make room: the error is the terminal item
            self.mailbox.get_nowait()
        self.mailbox.put_nowait((ERROR, error))

    def abort(self) -> None:
        """The client went away: drop buffered output and tell the worker running it."""
        if self.cancelled:
            return
        self.cancelled = True
        while not self.mailbox.empty():
            self.mailbox.get_nowait()
        if self.worker is not None and not self.finished:
            self.worker.cancel(self.request_id)


class JobQueue:
    """A model version's bounded job queue, plus per-worker queues for sequences.

    Jobs without a sequence go to the shared queue and are batched by whichever
    worker is free (one worker forms a batch at a time, as TorchServe's
    workers poll). A sequence's jobs go to the queue of the worker the
    sequence is pinned to.

    Args:
        capacity: most jobs waiting at once (``job_queue_size``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._shared: deque[Job] = deque()
        self._pinned: dict[int, deque[Job]] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._forming = False
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def remaining_capacity(self) -> int:
        """Free places (DescribeModel's ``jobQueueStatus.remainingCapacity``)."""
        return max(0, self.capacity - self._size)

    def put(self, job: Job, worker_id: int | None = None) -> None:
        """Enqueue ``job`` (pinned to ``worker_id`` when given).

        Raises:
            ResourceExhausted: the queue holds ``capacity`` jobs already.
        """
        if self._size >= self.capacity:
            raise ResourceExhausted(f"job queue is full ({self.capacity} requests waiting; job_queue_size)",
                                    reason="JOB_QUEUE_FULL", retry_after_s=0.5)
        if worker_id is None:
            self._shared.append(job)
        else:
            self._pinned.setdefault(worker_id, deque()).append(job)
        self._size += 1
        self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self, timeout: float | None = None) -> bool:
        """Wait for a put (or wake_all); False when ``timeout`` seconds passed first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if timeout is None:
                await fut
            else:
                await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _pop_live(self, dq: deque[Job]) -> Job | None:
        now = time.monotonic()
        while dq:
            job = dq.popleft()
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

    async def next_batch(self, worker_id: int, batch_size: int, max_batch_delay_ms: int) -> list[Job]:
        """Wait for the next batch for worker ``worker_id``.

        A job pinned to this worker is returned alone. Otherwise the batch
        starts with the oldest shared job and is dispatched as soon as it holds
        ``batch_size`` jobs or its first job has waited ``max_batch_delay_ms``;
        a streaming job always forms a batch of one.
        """
        while True:
            pinned = self._pinned.get(worker_id)
            if pinned and (job := self._pop_live(pinned)) is not None:
                return [job]
            if self._shared and not self._forming:
                first = self._pop_live(self._shared)
                if first is not None:
                    break
                continue
            await self._wait()
        if first.stream or batch_size <= 1:
            return [first]
        self._forming = True
        batch = [first]
        try:
            deadline = first.enqueued + max_batch_delay_ms / 1000.0
            while len(batch) < batch_size:
                if self._shared:
                    if self._shared[0].stream:
                        break
                    job = self._pop_live(self._shared)
                    if job is not None:
                        batch.append(job)
                    continue
                timeout = deadline - time.monotonic()
                if timeout <= 0 or not await self._wait(timeout):
                    break
            return batch
        except asyncio.CancelledError:
            self.requeue(batch)  # the worker went away while the batch was forming
            raise
        finally:
            self._forming = False
            self._notify()

    def requeue(self, jobs: list[Job]) -> None:
        """Put jobs that were taken but never ran back at the front of the shared queue."""
        for job in reversed(jobs):
            if not job.cancelled and not job.finished:
                self._shared.appendleft(job)
                self._size += 1
        self._notify()

    def wake_all(self) -> None:
        """Wake every waiting worker (used when workers stop)."""
        self._notify()


def cancelled_error() -> Cancelled:
    """The error a cancelled job ends with."""
    return Cancelled("request cancelled by the client")
