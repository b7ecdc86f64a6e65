"""Sleep and wake of one model version: its workers stop after ``idleTimeoutSec`` without
requests (or on ``POST /sleep``) and start again on the next request, which waits in the job
queue meanwhile. See docs/operations.md (Sleep and wake)."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Any, Protocol

from inference_service.dispatch.jobs import JobQueue
from inference_service.dispatch.supervisor import WorkerSlot, WorkerState
from inference_service.errors import FailedPrecondition, Unavailable
from inference_service.serving.model_config import ModelConfig

log = logging.getLogger("inference_service.model")

#: The idle check runs at least this often (seconds), and a quarter of the timeout when shorter.
IDLE_POLL_S = 1.0


class SleepState(enum.Enum):
    """A model version's state as DescribeModel, ``/v1/models`` and the metrics show it."""

    READY = "READY"
    SLEEPING = "SLEEPING"
    WAKING = "WAKING"


class Sleeper(Protocol):
    """What a :class:`Slumber` needs of its model version (``model_version.ModelVersion``)."""

    name: str
    version: str
    config: ModelConfig
    queue: JobQueue
    slots: dict[int, WorkerSlot]
    sequences: dict[str, int]
    held: Any
    closed: bool

    @property
    def ready_workers(self) -> int: ...
    def on_change(self) -> None: ...
    def live_slots(self) -> list[WorkerSlot]: ...
    async def remove_slot(self, slot: WorkerSlot, timeout: float) -> None: ...
    async def scale(self, min_workers: int, max_workers: int, synchronous: bool, timeout: float = 10.0,
                    number_gpu: int | None = None, *, waking: bool = False) -> list[WorkerSlot]: ...


class Slumber:
    """The sleep state of ``model``; its idle watch runs while ``idle_timeout_s`` > 0."""

    def __init__(self, model: Sleeper) -> None:
        self.model = model
        self.state = SleepState.READY
        self.last_active = time.monotonic()
        self.wakes = 0
        self.wake_seconds = 0.0
        self.woken_requests = 0  # requests that arrived while it slept or woke (and so waited)
        self.wake_error: str | None = None  # the latest wake's load error, until a wake succeeds
        self._watch: asyncio.Task[None] | None = None
        self._change: asyncio.Future[None] | None = None  # the running sleep or wake
        self._wake_started = 0.0
        self._waiting = 0  # requests queued when the wake started
        self.set_idle_timeout(model.config.idle_timeout_s)

    @property
    def asleep(self) -> bool:
        """Sleeping or waking: a request is queued for the wake rather than refused."""
        return self.state is not SleepState.READY

    def set_idle_timeout(self, seconds: float) -> None:
        """Set ``idleTimeoutSec`` (0: never sleep when idle); the idle time counts from now."""
        self.model.config.idle_timeout_s = seconds
        self.last_active = time.monotonic()
        if seconds > 0 and (self._watch is None or self._watch.done()):
            self._watch = asyncio.create_task(self._watch_idle(), name=f"idle-{self.model.name}")

    def _busy(self) -> bool:
        model = self.model
        return bool(len(model.queue) or model.sequences or model.held.held
                    or any(s.state is WorkerState.BUSY for s in model.slots.values()))

    async def _watch_idle(self) -> None:
        model = self.model
        while (timeout := model.config.idle_timeout_s) > 0 and not model.closed:
            now = time.monotonic()
            if self.asleep or self._busy():
                self.last_active = now
            elif now - self.last_active >= timeout and model.config.min_workers > 0:
                await self.sleep(f"idle for {now - self.last_active:.1f} s (idleTimeoutSec={timeout:g})")
                continue
            await asyncio.sleep(min(IDLE_POLL_S, timeout / 4, max(0.0, self.last_active + timeout - now) + 0.01))

    def arrived(self) -> None:
        """A request was queued: it counts as activity, and wakes the version when it sleeps."""
        self.last_active = time.monotonic()
        if self.asleep:
            self.woken_requests += 1
            if self.state is SleepState.SLEEPING:
                self.wake()

    async def sleep(self, why: str) -> None:
        """Stop every worker (after their running requests, at most ``responseTimeout``); a request
        arriving meanwhile wakes the version again once the sleep is done."""
        model = self.model
        if self.state is not SleepState.READY:
            return
        self.state = SleepState.SLEEPING
        start = time.monotonic()
        model.on_change()
        slots = list(model.slots.values())
        done = self._change = asyncio.get_running_loop().create_future()
        try:
            await asyncio.gather(*(model.remove_slot(s, model.config.response_timeout_s) for s in slots))
        finally:
            self._change = None
            done.set_result(None)
        log.info("model %s version %s sleeps (%s): %d worker(s) stopped in %.3f s", model.name, model.version,
                 why, len(slots), time.monotonic() - start)
        model.on_change()
        if len(model.queue) and self.state is SleepState.SLEEPING:
            self.wake()  # requests came while the workers stopped

    async def wake_up(self) -> None:
        """Wake and wait for it (``POST /wake_up``); nothing when awake.

        Raises:
            Unavailable: the wake failed to load a worker (MODEL_LOAD_FAILED).
        """
        if self.state is SleepState.SLEEPING and self._change is not None:
            await asyncio.shield(self._change)  # a sleep still stopping its workers
        wake = self.wake()
        if wake is None:
            return
        await asyncio.shield(wake)
        if self.wake_error is not None:
            raise Unavailable(f"model {self.model.name} version {self.model.version} failed to wake: "
                              f"{self.wake_error}", reason="MODEL_LOAD_FAILED", retry_after_s=5.0)

    def wake(self) -> asyncio.Future[None] | None:
        """Start the wake unless one runs; returns it (``None``: awake, or a sleep is still stopping
        workers: that sleep wakes it when requests wait)."""
        if self.state is SleepState.WAKING:
            return self._change
        if self.state is not SleepState.SLEEPING or self._change is not None:
            return None
        self.state = SleepState.WAKING
        self.model.on_change()
        task = asyncio.create_task(self._wake(), name=f"wake-{self.model.name}")
        self._change = task
        return task

    async def _wake(self) -> None:
        model = self.model
        self._wake_started = time.monotonic()
        self._waiting = len(model.queue)
        try:
            new = await model.scale(model.config.min_workers, model.config.max_workers, False, waking=True)
            outcomes = await asyncio.gather(*(slot.first_outcome for slot in new))
        except FailedPrecondition:
            return  # unregistered meanwhile: close() failed the waiting requests
        finally:
            self._change = None
        if self.state is not SleepState.WAKING:
            return  # a worker became ready (worker_changed), or an explicit scale took over
        if new and all(outcomes):
            took = self._count_wake()
            self.wake_error = error = str(outcomes[0])
            log.error("model %s version %s failed to wake after %.3f s (%d request(s) waiting): %s",
                      model.name, model.version, took, self._waiting, error)
            model.queue.drain(Unavailable(f"model {model.name} version {model.version} failed to wake: {error}",
                                          reason="MODEL_LOAD_FAILED", retry_after_s=5.0))
            self.state = SleepState.READY  # so that sleep() stops the failing workers
            await self.sleep("its wake failed")
            return
        self.state = SleepState.READY  # no worker to start: scaled to 0 meanwhile
        model.queue.drain(Unavailable(f"model {model.name} version {model.version} has no worker",
                                      reason="NO_WORKER", retry_after_s=5.0))
        model.on_change()

    def _count_wake(self) -> float:
        took = time.monotonic() - self._wake_started
        self.wakes += 1
        self.wake_seconds += took
        return took

    def worker_changed(self) -> None:
        """A worker's state changed: the first ready one ends a wake (before the queue hands it a request)."""
        if self.state is SleepState.WAKING and self.model.ready_workers > 0:
            took = self._count_wake()
            self.state = SleepState.READY
            self.wake_error = None
            self.last_active = time.monotonic()
            log.info("model %s version %s woke in %.3f s (%d worker(s) starting, %d request(s) waited)",
                     self.model.name, self.model.version, took, len(self.model.live_slots()), self._waiting)

    def awake(self) -> None:
        """An explicit scale: the version counts as awake (its workers are what the scale sets)."""
        if self.state is SleepState.SLEEPING and self._change is None:
            self.state = SleepState.READY
            self.wake_error = None

    def close(self) -> None:
        """The version is being unregistered: stop watching."""
        if self._watch is not None:
            self._watch.cancel()
