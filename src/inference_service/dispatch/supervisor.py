"""Worker supervision: :class:`WorkerSlot` keeps one worker process of a model version alive,
offers it to the job queue, and restarts it with bounded exponential back-off. It knows its
owner only through :class:`SlotOwner`, so this module does not import the registry."""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from typing import Protocol

from inference_service.contracts import wire
from inference_service.dispatch.jobs import Job, JobQueue
from inference_service.dispatch.process import WorkerProcess
from inference_service.dispatch.worker_options import WorkerOptions
from inference_service.errors import Unavailable, WorkerLoadError

log = logging.getLogger("inference_service.model")


class WorkerTimings(Protocol):
    """The timeouts of a model version that its worker slots apply (``serving.model_config.ModelConfig``)."""

    @property
    def startup_timeout_s(self) -> float: ...
    @property
    def max_retry_timeout_s(self) -> float: ...
    @property
    def max_backoff_s(self) -> float: ...
    @property
    def response_timeout_s(self) -> float: ...


class SlotOwner(Protocol):
    """What a :class:`WorkerSlot` needs of the model version it serves."""

    name: str
    restarts_total: int
    queue: JobQueue
    worker_options: WorkerOptions
    accepts_generation: bool
    chat_template: str | None

    @property
    def config(self) -> WorkerTimings:
        """Read-only here, so that a version's ``ModelConfig`` satisfies it."""

    def worker_spec(self, slot: WorkerSlot) -> wire.WorkerSpec:
        """The INIT message for a worker of this version."""

    def worker_env(self, slot: WorkerSlot) -> dict[str, str]:
        """The environment of a worker process."""

    def worker_python(self) -> str:
        """The interpreter of a worker process."""

    def on_change(self) -> None:
        """A worker state changed (health)."""

    def on_worker_failed(self) -> None:
        """A worker gave up (maxRetryTimeoutInSec)."""

    def on_load_failed(self, slot: WorkerSlot) -> None:
        """A worker's start failed to load its model (``slot.load_error`` says why)."""


class WorkerState(enum.Enum):
    """A worker slot's state as DescribeModel shows it."""

    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    BACKOFF = "RESTARTING"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"


class WorkerSlot:
    """Keeps one worker process of a model version alive and fed (TorchServe numbers workers from 9000)."""

    def __init__(self, model: SlotOwner, worker_id: int) -> None:
        self.model = model
        self.id = worker_id
        self.state = WorkerState.STARTING
        self.process: WorkerProcess | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.load_error: str | None = None  # why the latest start failed to load; None once one loaded
        self.first_outcome: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.stopping = False
        self.task: asyncio.Task[None] | None = None
        self.start_time = time.time()
        self.gpu: int | None = None
        self._response_timeout_s = 0.0  # the model's response_timeout, read when a process starts serving
        self._ended: asyncio.Future[None] | None = None  # set when the serving process ends or drains

    def start(self) -> None:
        """Start the slot's supervision task."""
        self.task = asyncio.create_task(self._run(), name=f"worker-{self.id}")

    def _set_state(self, state: WorkerState) -> None:
        self.state = state
        self.model.on_change()

    def _outcome(self, error: str | None) -> None:
        if not self.first_outcome.done():
            self.first_outcome.set_result(error)

    async def _run(self) -> None:
        failures = 0
        first_failure: float | None = None
        config = self.model.config
        attempts = 0
        while not self.stopping:
            if attempts:
                self.restarts += 1
                self.model.restarts_total += 1
            attempts += 1
            self._set_state(WorkerState.STARTING)
            process = WorkerProcess(self.model.worker_spec(self), self.model.worker_env(self),
                                    f"inference_service.worker.{self.model.name}", self.model.worker_options,
                                    self.model.worker_python())
            self.process = process
            try:
                await process.start(config.startup_timeout_s)
            except WorkerLoadError as exc:
                self.last_error = self.load_error = exc.message
                log.error("%s", exc.message)
                self._outcome(exc.message)
                self.model.on_load_failed(self)
            else:
                self.start_time = process.start_time
                self.model.accepts_generation |= process.accepts_generation
                if process.engine_info is not None and process.engine_info.chat_template:
                    self.model.chat_template = process.engine_info.chat_template
                failures, first_failure = 0, None
                self.load_error = None
                self._set_state(WorkerState.READY)
                self._outcome(None)
                await self._serve(process)
                if self.stopping:
                    break
            # The worker failed to load or died: back off, then start a new one.
            await process.kill()
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            if failures and now - first_failure > config.max_retry_timeout_s:
                self.last_error = (f"worker kept failing for more than maxRetryTimeoutInSec="
                                   f"{config.max_retry_timeout_s}s: {self.last_error}")
                log.error("model %s worker %d gives up: %s", self.model.name, self.id, self.last_error)
                self._set_state(WorkerState.FAILED)
                self.model.on_worker_failed()
                return
            delay = 0.0 if failures == 0 else min(config.max_backoff_s, 2 ** (failures - 1))
            failures += 1
            if delay:
                self._set_state(WorkerState.BACKOFF)
                log.info("model %s worker %d restarts in %.1fs", self.model.name, self.id, delay)
                await asyncio.sleep(delay * (0.9 + 0.2 * random.random()))
        self._set_state(WorkerState.UNLOADING)

    async def _serve(self, process: WorkerProcess) -> None:
        """Offer ``process`` to the job queue until it dies or the slot stops; requests reach it through
        :meth:`take`, called by the queue, not through this task."""
        model = self.model
        queue = model.queue
        self._response_timeout_s = model.config.response_timeout_s
        self._ended = asyncio.get_running_loop().create_future()
        process.on_free = self._worker_free
        process.on_exit = self._worker_exited
        queue.offer(self, process.room)
        try:
            await self._ended
        finally:
            queue.withdraw(self.id)
            if self.state is WorkerState.BUSY:
                self.state = WorkerState.READY
        if not process.alive or process.failure is not None:
            if process.timed_out:
                self.last_error = process.failure
            elif process.died_busy:
                self.last_error = process.failure
                log.error("%s", process.failure)
                queue.drain(Unavailable(str(process.failure), reason="WORKER_DIED"), self.id)
            else:
                self.last_error = f"worker {self.id} of model {model.name} exited while idle"
                log.error("%s", self.last_error)

    def take(self, batch: list[Job]) -> bool:
        """Hand ``batch`` to the worker process, synchronously from the job queue; False when the slot
        stops or the process is gone (the queue keeps the jobs).

        Raises:
            ValueError, struct.error: a request does not fit the worker channel's framing.
        """
        process = self.process
        if self.stopping or process is None or not process.send_batch(batch, self._response_timeout_s):
            return False
        self.state = WorkerState.BUSY
        return True

    def runs(self, unit: str) -> bool:
        """Whether a request of ``unit`` runs on this slot's worker (the job queue's fairness)."""
        return self.process is not None and self.process.runs(unit)

    def displace(self, priority: int) -> bool:
        """Whether a running request of a later priority gives a request of ``priority`` its place."""
        return self.process is not None and self.process.displace(priority)

    def _worker_free(self, process: WorkerProcess) -> None:
        """``process`` has room again (a batch or a request ended): offer it again, or, when the
        slot stops and nothing runs on it, end :meth:`_serve`."""
        if process is not self.process:
            return  # a replaced process reporting late
        if self.state is WorkerState.BUSY and not process.busy:
            self.state = WorkerState.READY
        if self.stopping:
            if not process.busy:
                self._end_serving()
        else:
            self.model.queue.offer(self, process.room)

    def _worker_exited(self, process: WorkerProcess) -> None:
        """``process`` died or was killed (its jobs have failed): end :meth:`_serve`."""
        if process is self.process:
            self._end_serving()

    def _end_serving(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    async def stop(self, timeout: float) -> None:
        """Stop after the running requests (waiting at most ``timeout`` s), then stop the process."""
        busy = self.process is not None and self.process.busy
        self.stopping = True
        self.model.queue.withdraw(self.id)
        self._set_state(WorkerState.UNLOADING)
        if self.task is not None:
            if not busy:
                self.task.cancel()
            # asyncio.wait: the task's own outcome is not raised here, a cancel of the caller is
            await asyncio.wait({self.task}, timeout=timeout)
            if not self.task.done():
                self.task.cancel()
                await asyncio.wait({self.task})
            if not self.task.cancelled() and self.task.exception() is not None:
                log.error("worker %d supervision ended with %r", self.id, self.task.exception())
        if self.process is not None:
            await self.process.stop(timeout=2.0)
        self._outcome("worker stopped")
