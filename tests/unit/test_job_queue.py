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
