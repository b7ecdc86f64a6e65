"""JobQueue dispatch rules that need no worker process: rooms of concurrent workers and the one
containment rule for a batch that cannot be handed over."""

from __future__ import annotations

import asyncio

from inference_service.dispatch.jobs import Job, JobQueue, Kind


def _run(coro):
    return asyncio.run(coro)


class _Worker:
    """A worker as the queue sees it (a ``Taker``): ``take`` is the test's function; ``running``
    the jobs it holds (what ``runs`` reads)."""

    def __init__(self, worker_id: int, take) -> None:
        self.id = worker_id
        self.take = take
        self.running: list[Job] = []

    def runs(self, unit: str) -> bool:
        return any(job.unit == unit for job in self.running)


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


def test_units_take_turns_and_the_last_place_waits_for_a_newcomer():
    """Issue 48 item 3: 64 engine requests of one OpenAI request (one group) no longer run in
    front of every later request, nor take every place of the worker."""
    async def scenario():
        queue = JobQueue(capacity=3, concurrent=True)
        worker = _Worker(1, lambda batch: worker.running.extend(batch) or True)
        big = [Job({"data": b"%d" % i}, stream=True, group="big") for i in range(56)]
        for job in big:
            queue.put(job)
        assert queue.remaining_capacity() == 2  # the group holds one place of job_queue_size
        queue.offer(worker, room=8)
        assert len(worker.running) == 7 and len(queue) == 49  # the last place is kept
        small = Job({"data": b"one token"}, stream=True)
        queue.put(small)
        assert worker.running[-1] is small  # a newcomer gets the kept place at once
        done = worker.running.pop(0)  # one of the group ends: its place goes to the group
        done.finished = True
        other = [Job({"data": b"o%d" % i}, stream=True) for i in range(2)]
        for job in other:
            queue.put(job)
        queue.offer(worker, room=1)  # the last place again: a unit running nothing here
        assert worker.running[-1] is other[0]
        worker.running.pop(0)
        queue.offer(worker, room=2)  # in turn: one of the group, then other[1] (the last place)
        assert worker.running[-2:] == [big[7], other[1]]

    _run(scenario())


def test_a_full_queue_still_takes_the_choices_of_a_queued_request():
    async def scenario():
        queue = JobQueue(capacity=2, concurrent=True)
        queue.put(Job({"data": b"a"}, group="g"))
        queue.put(Job({"data": b"b"}))
        assert queue.remaining_capacity() == 0
        assert queue.remaining_capacity("g") == 1  # a choice of the queued request: its place
        assert queue.remaining_capacity("h") == 0  # a new request: 429

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


def test_waiting_jobs_leave_by_priority_then_arrival_in_both_modes():
    async def scenario(concurrent: bool):
        queue = JobQueue(capacity=10, concurrent=concurrent)
        names = [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1), ("f", 5)]
        for name, priority in names:
            queue.put(Job({"data": name.encode()}, stream=True, priority=priority))
        sent: list[str] = []
        for _ in names:  # a worker with one place, offered again after each job
            queue.offer(_Worker(1, lambda batch: sent.extend(j.inputs["data"].decode() for j in batch) or True))
        return sent

    for concurrent in (False, True):
        assert _run(scenario(concurrent)) == ["c", "e", "a", "d", "b", "f"], concurrent


def test_a_queued_job_past_its_deadline_fails_unworked_and_a_running_one_is_stopped():
    async def scenario():
        queue = JobQueue(capacity=10)
        waiting = Job({"data": b"late"}, stream=True)
        queue.put(waiting)  # no worker yet
        waiting.deadline_passed()
        kind, error = await asyncio.wait_for(waiting.mailbox.get(), 1)
        assert kind is Kind.ERROR and error.reason == "DEADLINE_IN_QUEUE" and error.code.name == "DEADLINE_EXCEEDED"
        cancels: list[str] = []

        class Runner(_Worker):
            def cancel(self, request_id: str) -> None:
                cancels.append(request_id)

        sent: list[list[Job]] = []
        worker = Runner(1, lambda batch: sent.append(batch) or True)
        queue.offer(worker)
        assert sent == []  # the late job never reached the worker
        running = Job({"data": b"run"}, stream=True)
        queue.put(running)
        assert sent == [[running]]
        running.worker = worker  # as the worker process sets it when it takes the batch
        running.deadline_passed()
        kind, error = await asyncio.wait_for(running.mailbox.get(), 1)
        assert kind is Kind.ERROR and error.reason == "DEADLINE_RUNNING" and cancels == [running.request_id]

    _run(scenario())
