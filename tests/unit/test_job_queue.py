"""JobQueue dispatch rules that need no worker process: rooms of concurrent workers and the one
containment rule for a batch that cannot be handed over."""

from __future__ import annotations

import asyncio

from inference_service.dispatch.jobs import Job, JobQueue, Kind


def _run(coro):
    return asyncio.run(coro)


class _Worker:
    """A worker as the queue sees it (a ``Taker``): ``take`` is the test's function."""

    def __init__(self, worker_id: int, take) -> None:
        self.id = worker_id
        self.take = take


def test_a_batch_that_cannot_be_sent_fails_alone_and_the_worker_stays_free():
    async def scenario():
        queue = JobQueue(capacity=10)
        sent: list[list[Job]] = []

        def send(batch: list[Job]) -> bool:
            if batch[0].inputs.get("data") == b"bad":
                raise ValueError("cannot frame this")
            sent.append(batch)
            return True

        queue.offer(_Worker(1, send))
        bad = Job({"data": b"bad"})
        queue.put(bad)
        kind, error = await asyncio.wait_for(bad.mailbox.get(), 1)
        assert kind is Kind.ERROR and "cannot frame this" in str(error)
        assert queue.dispatch_failures == 1
        good = Job({"data": b"good"})
        queue.put(good)  # the worker was kept: the next job goes out at once
        assert sent == [[good]]

    _run(scenario())


def test_a_concurrent_worker_takes_jobs_up_to_its_room():
    async def scenario():
        queue = JobQueue(capacity=10, concurrent=True)
        sent: list[list[Job]] = []
        worker = _Worker(1, lambda batch: sent.append(batch) or True)
        queue.offer(worker, room=2)
        jobs = [Job({"data": b"%d" % i}, stream=True) for i in range(3)]
        for job in jobs:
            queue.put(job)
        assert [len(b) for b in sent] == [1, 1]  # each joined at once, streams too
        assert len(queue) == 1  # the third waits for room
        queue.offer(worker, room=1)
        assert sent[-1] == [jobs[2]] and len(queue) == 0

    _run(scenario())


class _Runner:
    """A worker as a job sees it: records the requests it is told to drop."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    def cancel(self, request_id: str) -> None:
        self.dropped.append(request_id)


def test_requests_past_response_timeout_are_ended_alone_and_dropped_by_their_worker():
    from inference_service.dispatch.jobs import overdue
    from inference_service.errors import DeadlineExceeded

    runner = _Runner()
    old, young, cancelled = Job({"data": b"a"}), Job({"data": b"b"}), Job({"data": b"c"})
    for job, dispatched in ((old, 100.0), (young, 108.0), (cancelled, 90.0)):
        job.dispatched, job.worker = dispatched, runner
    cancelled.cancelled = True
    ended, next_due = overdue([old, young, cancelled], now=110.0, timeout=10.0)
    assert ended == [old] and next_due == 118.0
    assert overdue([], now=110.0, timeout=10.0) == ([], float("inf"))

    async def scenario():
        old.end(DeadlineExceeded("ran past", reason="RESPONSE_TIMEOUT"))
        kind, error = await asyncio.wait_for(old.mailbox.get(), 1)
        assert kind is Kind.ERROR and error.message == "ran past"
        assert old.finished and old.cancelled and runner.dropped == [old.request_id]
        old.end(DeadlineExceeded("again"))  # once only
        assert runner.dropped == [old.request_id] and len(old.mailbox._items) == 0

    _run(scenario())
