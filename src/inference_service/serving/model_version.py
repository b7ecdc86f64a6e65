"""The registry entry of one registered model version: its effective config, job queue,
worker slots (:mod:`inference_service.dispatch.supervisor`) and sequences."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable

from inference_service.archive.model_archive import ModelArchive
from inference_service.contracts import wire
from inference_service.contracts.cpu import default_threads
from inference_service.contracts.handler_config import HandlerConfig
from inference_service.dispatch.gpu import GpuAllocator
from inference_service.dispatch.jobs import Job, JobQueue
from inference_service.dispatch.supervisor import WorkerSlot, WorkerState
from inference_service.dispatch.worker_options import WorkerOptions
from inference_service.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WorkerLoadError,
)
from inference_service.serving.interpreter import InterpreterError, worker_python
from inference_service.serving.model_config import ModelConfig, parallel_settings
from inference_service.serving.sequences import SEQ_END, SEQ_ID, SEQ_START, SequenceBook, new_sequence_id
from inference_service.serving.sleep import Slumber

log = logging.getLogger(__name__)

_worker_ids = itertools.count(9000)


class ModelVersion:
    """One version of a registered model; ``handler`` is RegisterModel's entry point, else the
    manifest's; ``on_change`` is called when worker states change (health updates)."""

    def __init__(self, name: str, archive: ModelArchive, config: ModelConfig, handler: str,
                 server_version: str, on_change: Callable[[], None], loaded_at_startup: bool = False,
                 extra_paths: list[str] | None = None, base_env: dict[str, str] | None = None,
                 gpus: GpuAllocator | None = None, worker_options: WorkerOptions | None = None) -> None:
        self.name = name
        self.version = archive.version
        self.worker_options = worker_options or WorkerOptions()
        self.archive = archive
        self.config = config
        self.handler = handler
        self.server_version = server_version
        self._on_change = on_change
        self.loaded_at_startup = loaded_at_startup
        self.extra_paths = extra_paths or []
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self.queue = JobQueue(config.job_queue_size, config.batch_size, config.max_batch_delay_ms,
                              concurrent=config.worker_mode != wire.MODE_BATCH)
        self.slots: dict[int, WorkerSlot] = {}
        self.sequences: dict[str, int] = {}  # sequence id -> the worker it is pinned to
        self.held = SequenceBook(config.sequence_max_idle_ms, config.sequence_timeout_ms)  # HTTP's sequences
        self.restarts_total = 0  # worker restarts of this version, kept when workers are removed
        self.accepts_generation = False  # a worker's handler took the typed LLM request: /v1/models lists it
        self.chat_template: str | None = None  # an LLM worker's READY: the chat template it renders with
        self.gpus = gpus or GpuAllocator(0)
        # workers placed on GPUs: all of them where there are GPUs, unless deviceType is cpu
        self.gpu_count = 1 << 30 if self.gpus.count and config.device_type != "cpu" else 0
        self.closed = False
        self.world_size, self.rank_threads, self.device_ids = parallel_settings(archive.config)
        self._stops: set[asyncio.Task[None]] = set()  # scale-downs left running (not synchronous)
        self.sleep = Slumber(self)

    def on_change(self) -> None:
        """Propagate a worker state change (the sleep state, then health)."""
        self.sleep.worker_changed()
        self._on_change()

    def on_worker_failed(self) -> None:
        """A worker gave up (maxRetryTimeoutInSec): if none is left, fail the queued jobs."""
        if not any(s.state is not WorkerState.FAILED and not s.stopping for s in self.slots.values()):
            failed = [s.last_error for s in self.slots.values() if s.last_error]
            self.queue.drain(Unavailable(
                f"model {self.name} version {self.version} has no working worker: "
                f"{failed[0] if failed else 'all workers failed'}"))

    @property
    def ready_workers(self) -> int:
        """Workers with a loaded handler."""
        return sum(1 for s in self.slots.values() if s.state in (WorkerState.READY, WorkerState.BUSY))

    @property
    def healthy(self) -> bool:
        """At least ``min_workers`` workers are ready (TorchServe's Ping rule), or it sleeps and its
        latest wake did not fail (a request wakes it: docs/operations.md)."""
        if self.sleep.asleep:
            return self.sleep.wake_error is None
        return self.ready_workers >= self.config.min_workers

    @property
    def serving(self) -> bool:
        """Ready to take requests (a model's readiness): a ready worker, or asleep as :attr:`healthy` says."""
        return (self.ready_workers > 0 or self.sleep.asleep) and self.healthy

    def live_slots(self) -> list[WorkerSlot]:
        """Its worker slots not being stopped."""
        return [s for s in self.slots.values() if not s.stopping]

    def worker_spec(self, slot: WorkerSlot) -> wire.WorkerSpec:
        """The INIT message for a worker of this version."""
        return wire.WorkerSpec(
            model_name=self.name,
            model_version=self.version,
            model_dir=str(self.archive.model_dir),
            handler=self.handler,
            manifest=self.archive.manifest,
            model_yaml_config=self.archive.config,
            batch_size=self.config.batch_size,
            worker_id=slot.id,
            gpu=slot.gpu,
            server_version=self.server_version,
            extra_paths=self.extra_paths,
            world_size=self.world_size,
            mode=self.config.worker_mode,
            max_running=self.config.max_running,
        )

    def cpu_demand(self) -> tuple[int, int]:
        """``(worker processes, threads each)`` of its workers that are ready and use a thread
        pool (torchrun: ranks)."""
        live = sum(1 for slot in self.slots.values() if not slot.stopping and slot.process is not None
                   and slot.process.uses_threads) * max(1, self.world_size)
        handler = HandlerConfig.parse((self.archive.config or {}).get("handler"))  # checked at registration
        return live, handler.torch_threads or self._threads()

    def _threads(self) -> int:
        if self.world_size > 1:
            return self.rank_threads  # per rank; TorchServe's default is 1
        return self.config.worker_threads or default_threads(len(self.slots))

    def worker_python(self) -> str:
        """The interpreter of this version's workers (:func:`~inference_service.serving.interpreter.worker_python`;
        checked at registration: should it be gone since, the server's, whose worker then says what it lacks)."""
        try:
            return worker_python(HandlerConfig.parse((self.archive.config or {}).get("handler")))
        except InterpreterError:
            return sys.executable

    def worker_env(self, slot: WorkerSlot) -> dict[str, str]:
        """Environment of a worker: the server's without its keys (``INFERENCE_SERVICE_*_KEY``:
        handler code never sees them); torch threads = usable CPUs (affinity and cgroup quota)
        / workers unless configured; OpenMP wait policy from the server's settings."""
        env = {k: v for k, v in self.base_env.items()
               if not (k.startswith("INFERENCE_SERVICE_") and k.endswith("_KEY"))}
        threads = self._threads()
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("MKL_NUM_THREADS", str(threads))
        env.setdefault("OMP_WAIT_POLICY", self.config.worker_wait_policy.upper())
        env[wire.SERVER_PYTHON_ENV] = sys.executable  # a worker under another Python has conversions run by it
        if self.device_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.device_ids)
        elif slot.gpu is None:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    async def scale(self, min_workers: int, max_workers: int, synchronous: bool,
                    timeout: float = 10.0, number_gpu: int | None = None, *, waking: bool = False) -> list[WorkerSlot]:
        """Run ``min_workers`` workers (ScaleWorker / RegisterModel's initial_workers); ``timeout``: seconds
        a stopped worker may finish its batch; ``number_gpu``: how many go on GPUs (``None``: keep).
        Returns the slots it started. A scale that is not the wake's own wakes a sleeping version.

        Raises:
            WorkerLoadError: synchronous, and a new worker failed to load (the handler's error).
        """
        if self.closed:
            raise FailedPrecondition(f"model {self.name} version {self.version} is being unregistered")
        if not waking:
            self.sleep.awake()
        self.config.min_workers = min_workers
        self.config.max_workers = max(max_workers, min_workers)
        if number_gpu is not None:
            self.gpu_count = number_gpu
        live = [s for s in self.slots.values() if not s.stopping]
        new: list[WorkerSlot] = []
        on_gpu = sum(1 for s in live if s.gpu is not None)
        while len(live) + len(new) < min_workers:
            slot = WorkerSlot(self, next(_worker_ids))
            if on_gpu < self.gpu_count and self.gpus.count:
                slot.gpu = self.gpus.next()
                on_gpu += 1
            self.slots[slot.id] = slot
            new.append(slot)
        for slot in new:
            slot.start()
        removed = live[min_workers:] if len(live) > min_workers else []
        stops = [self.remove_slot(slot, timeout) for slot in removed]
        self.on_change()
        if synchronous:
            await asyncio.gather(*stops)
            outcomes = await asyncio.gather(*(slot.first_outcome for slot in new))
            errors = [e for e in outcomes if e]
            if errors:
                raise WorkerLoadError(errors[0])
        else:
            for coro in stops:
                task = asyncio.create_task(coro, name=f"stop-{self.name}-{self.version}")
                self._stops.add(task)
                task.add_done_callback(self._stop_done)
        return new

    def _stop_done(self, task: asyncio.Task[None]) -> None:
        """A scale-down left running ended: forget it, log its failure (nobody awaits it)."""
        self._stops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("model %s version %s: stopping a worker failed: %r", self.name, self.version,
                      task.exception())

    async def remove_slot(self, slot: WorkerSlot, timeout: float) -> None:
        await slot.stop(timeout)
        self.slots.pop(slot.id, None)
        for seq, wid in list(self.sequences.items()):
            if wid == slot.id:
                self.close_sequence(seq, f"its worker {slot.id} stopped")
        self.on_change()

    def load_error(self) -> str | None:
        """Why no worker of this version can serve: the latest load error, when no worker is
        ready and every live worker's latest start failed to load (``None`` otherwise, e.g.
        while a first start or a restart after a crash is still loading)."""
        live = [s for s in self.slots.values() if not s.stopping]
        if not live or any(s.state in (WorkerState.READY, WorkerState.BUSY) for s in live):
            return None
        errors = [s.load_error for s in live]
        return errors[0] if all(errors) else None

    def on_load_failed(self, slot: WorkerSlot) -> None:
        """A worker failed to load: if that leaves no worker able to serve, the queued requests
        fail at once with UNAVAILABLE and the load error instead of waiting for a retry that
        may never load (they would otherwise wait until maxRetryTimeoutInSec)."""
        error = self.load_error()
        if error is not None:
            self.queue.drain(Unavailable(f"model {self.name} version {self.version} cannot start a worker: "
                                         f"{error}", reason="MODEL_LOAD_FAILED", retry_after_s=5.0))

    def admit(self, job: Job, max_request_size: int) -> int | None:
        """The one admission check for this version, before anything is queued; nothing changes when it
        raises. Returns the worker the job's sequence is pinned to, or None.

        Raises:
            ResourceExhausted: inputs above ``max_request_size`` bytes (REQUEST_TOO_LARGE), or
                ``job_queue_size`` requests queued (JOB_QUEUE_FULL, retry after 0.5 s).
            Unavailable: being unregistered; no worker (NO_WORKER); every worker's latest start
                failed to load (MODEL_LOAD_FAILED, until one loads).
            InvalidArgument: the request does not fit the worker channel's framing.
        """
        size = sum(len(v) for v in job.inputs.values())
        if size > max_request_size:
            raise ResourceExhausted(f"request of {size} bytes exceeds max_request_size={max_request_size} bytes",
                                    reason="REQUEST_TOO_LARGE")
        if self.closed:
            raise Unavailable(f"model {self.name} version {self.version} is being unregistered")
        asleep = self.sleep.asleep  # its wake starts workers: the request waits for them in the queue
        if not asleep and not any(s.state is not WorkerState.FAILED and not s.stopping for s in self.slots.values()):
            raise Unavailable(
                f"model {self.name} version {self.version} has no worker; scale it with ScaleWorker",
                reason="NO_WORKER", retry_after_s=5.0)
        load_error = None if asleep else self.load_error()
        if load_error is not None:
            raise Unavailable(f"model {self.name} version {self.version} cannot start a worker: {load_error}",
                              reason="MODEL_LOAD_FAILED", retry_after_s=5.0)
        problem = wire.request_problem(job.inputs, job.headers, job.sequence_id, job.content_types)
        if problem is not None:
            raise InvalidArgument(problem)
        if self.queue.remaining_capacity(job.unit) == 0:
            raise ResourceExhausted(f"job queue is full ({self.queue.capacity} requests waiting; job_queue_size)",
                                    reason="JOB_QUEUE_FULL", retry_after_s=0.5)
        return self.sequences.get(job.sequence_id) if job.sequence_id is not None else None

    def submit(self, job: Job, max_request_size: int) -> None:
        """:meth:`admit` ``job`` (raising as it does), then queue it; it reaches a free worker within this call,
        or one running a request of a later priority gives it that request's place (continuous batching)."""
        self.queue.put(job, self.admit(job, max_request_size))
        if job.worker is None and self.queue.concurrent and job.sequence_id is None:
            for slot in list(self.slots.values()):
                if slot.displace(job.priority):
                    break
        self.sleep.arrived()

    def open_sequence(self, sequence_id: str) -> None:
        """Pin a new sequence to the least-loaded worker (StreamPredictions2).

        Raises:
            FailedPrecondition: no sequence batching. ResourceExhausted: ``maxNumSequence`` open.
            Unavailable: no worker.
        """
        if not self.config.sequence_batching:
            raise FailedPrecondition(
                f"model {self.name} does not support sequences: set sequenceBatching: true in its "
                "model config"
            )
        if sequence_id in self.sequences:
            return
        if len(self.sequences) >= self.config.max_num_sequence:
            raise ResourceExhausted(f"model {self.name} has maxNumSequence={self.config.max_num_sequence} "
                                    "sequences open")
        slots = [s for s in self.slots.values() if not s.stopping and s.state is not WorkerState.FAILED]
        if not slots:
            raise Unavailable(f"model {self.name} version {self.version} has no worker")
        load = {s.id: 0 for s in slots}
        for wid in self.sequences.values():
            if wid in load:
                load[wid] += 1
        ready = [s.id for s in slots if s.state in (WorkerState.READY, WorkerState.BUSY)] or list(load)
        self.sequences[sequence_id] = min(ready, key=lambda wid: load[wid])

    def enter_held(self, sequence_id: str | None, headers: dict[str, str]) -> str:
        """A request of a sequence the server holds between requests (HTTP, :mod:`.sequences`) starts:
        with no ``sequence_id`` a sequence opens under a new id (``headers`` get
        ``ts_request_sequence_start: true``), else the named one goes on (a name not seen yet opens
        it, as TorchServe's job groups). ``headers`` get ``ts_request_sequence_id``. Returns the id;
        pair with :meth:`leave_held`.

        Raises:
            NotFound: an id of this server's minting whose sequence ended, expired or lost its worker.
            Unavailable: ``maxNumSequence`` sequences open (HTTP 503, as TorchServe), or no worker.
            FailedPrecondition: the model has no ``sequenceBatching``.
        """
        held, now = self.held, time.monotonic()
        if sequence_id is None:
            for seq, why in held.overdue(now):  # their places count against maxNumSequence
                self.close_sequence(seq, why)
            sequence_id = new_sequence_id()
            headers[SEQ_START] = "true"
        elif (overdue := held.why_overdue(sequence_id, now)) is not None:
            self.close_sequence(sequence_id, overdue)
        elif sequence_id in held.held and sequence_id not in self.sequences:
            self.close_sequence(sequence_id, "its worker stopped")
        held.check(sequence_id)
        try:
            self.open_sequence(sequence_id)
        except ResourceExhausted as exc:  # TorchServe answers 503 when its job groups are full
            raise Unavailable(f"{exc.message}; one closes when its handler ends it or at its idle or total limit",
                              reason="MAX_NUM_SEQUENCE", retry_after_s=1.0) from None
        held.enter(sequence_id, now)
        headers[SEQ_ID] = sequence_id
        return sequence_id

    def leave_held(self, sequence_id: str, client_ended: bool, response_headers: dict[str, str]) -> None:
        """The request of :meth:`enter_held` ended, however: its sequence closes when the handler
        named it in the response header ``ts_request_sequence_end`` (``;``-separated ids, as
        TorchServe's SequenceContinuousBatching) or ``client_ended`` (``ts_request_sequence_end: true``)."""
        self.held.leave(sequence_id, time.monotonic())
        ended = {s.strip() for s in response_headers.get(SEQ_END, "").split(";")} - {""}
        if client_ended:
            ended.add(sequence_id)
        for seq in ended & self.held.held.keys():
            self.close_sequence(seq)

    def close_sequence(self, sequence_id: str, why: str = "it ended") -> None:
        """Forget a sequence (its end, its stream closed, or its limits passed)."""
        self.sequences.pop(sequence_id, None)
        self.held.close(sequence_id, why)

    async def close(self) -> None:
        """Stop every worker, fail queued jobs, remove the extracted archive; scale-downs still running
        are awaited too."""
        self.closed = True
        self.sleep.close()
        self.queue.drain(Unavailable(f"model {self.name} version {self.version} was unregistered"))
        await asyncio.gather(*(self.remove_slot(s, 2.0) for s in list(self.slots.values())))
        if self._stops:
            await asyncio.wait(set(self._stops))
        self.archive.remove()
