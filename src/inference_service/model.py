"""A registered model version: its effective config, job queue and workers.

Each :class:`WorkerSlot` keeps one worker process alive: it starts it, feeds
it batches from the version's :class:`~inference_service.jobs.JobQueue`, and
restarts it with bounded exponential back-off when it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from inference_service.archive import ModelArchive
from inference_service.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WorkerLoadError,
)
from inference_service.jobs import Job, JobQueue
from inference_service.worker import protocol
from inference_service.worker.process import WorkerProcess

log = logging.getLogger(__name__)

_worker_ids = itertools.count(9000)


class GpuAllocator:
    """Hands out GPU ids round-robin across all workers of the server (as TorchServe).

    Args:
        count: GPUs on the machine (``number_of_gpu``); 0 places every worker on the CPU.
    """

    def __init__(self, count: int) -> None:
        self.count = max(0, count)
        self._next = itertools.count()

    def next(self) -> int | None:
        """The next GPU id, or ``None`` without GPUs."""
        return next(self._next) % self.count if self.count else None


def detect_gpus() -> int:
    """Number of NVIDIA GPUs from ``nvidia-smi --list-gpus`` (0 when it is missing or fails)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@dataclass
class ModelConfig:
    """Effective settings of one model version (units in the names).

    Defaults are TorchServe's: batch_size 1, max_batch_delay 100 ms,
    response_timeout 120 s, startup_timeout 120 s, no workers,
    maxRetryTimeoutInSec 300 s, job queue 100.
    """

    batch_size: int = 1
    max_batch_delay_ms: int = 100
    response_timeout_s: int = 120
    startup_timeout_s: int = 120
    min_workers: int = 0
    max_workers: int = 0
    device_type: str = ""  # "cpu", "gpu", or "" (GPUs where there are any, as TorchServe)
    max_retry_timeout_s: int = 300
    max_backoff_s: float = 30.0
    job_queue_size: int = 100
    sequence_batching: bool = False
    max_num_sequence: int = 1000
    max_sequence_job_queue_size: int = 1
    sequence_max_idle_ms: int = 0
    sequence_timeout_ms: int = 0
    worker_threads: int = 0

    # model-config.yaml key -> field
    YAML_KEYS = {
        "batchSize": "batch_size",
        "maxBatchDelay": "max_batch_delay_ms",
        "responseTimeout": "response_timeout_s",
        "startupTimeout": "startup_timeout_s",
        "minWorkers": "min_workers",
        "maxWorkers": "max_workers",
        "deviceType": "device_type",
        "maxRetryTimeoutInSec": "max_retry_timeout_s",
        "jobQueueSize": "job_queue_size",
        "sequenceBatching": "sequence_batching",
        "maxNumSequence": "max_num_sequence",
        "maxSequenceJobQueueSize": "max_sequence_job_queue_size",
        "sequenceMaxIdleMSec": "sequence_max_idle_ms",
        "sequenceTimeoutMSec": "sequence_timeout_ms",
    }
    LIMITS = {
        "batch_size": (1, 1024),
        "max_batch_delay_ms": (0, 600_000),
        "response_timeout_s": (1, 86_400),
        "startup_timeout_s": (1, 86_400),
        "min_workers": (0, 64),
        "max_workers": (0, 64),
        "max_retry_timeout_s": (0, 86_400),
        "job_queue_size": (1, 1_000_000),
        "max_num_sequence": (1, 1_000_000),
        "max_sequence_job_queue_size": (1, 1_000_000),
        "sequence_max_idle_ms": (0, 86_400_000),
        "sequence_timeout_ms": (0, 86_400_000),
    }

    def torchserve_fields(self) -> dict[str, int]:
        """The worker and batch settings under TorchServe's names (DescribeModel, snapshots)."""
        return {
            "minWorkers": self.min_workers,
            "maxWorkers": self.max_workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": self.startup_timeout_s,
        }

    @classmethod
    def resolve(cls, yaml_config: dict[str, Any], overrides: dict[str, Any],
                defaults: dict[str, Any] | None = None) -> ModelConfig:
        """Build the config: ``defaults`` < model-config.yaml < ``overrides`` (non-zero request fields).

        Raises:
            InvalidArgument: a value has the wrong type or is out of range
                (the message names the setting and its range).
        """
        values: dict[str, Any] = dict(defaults or {})
        for key, name in cls.YAML_KEYS.items():
            if key in yaml_config and yaml_config[key] is not None:
                values[name] = yaml_config[key]
        values.update({k: v for k, v in overrides.items() if v not in (None, 0, "")})
        types = {f.name: f.type for f in fields(cls)}
        config = cls()
        for name, value in values.items():
            if name not in types:
                continue
            current = getattr(config, name)
            try:
                if isinstance(current, bool):
                    value = value if isinstance(value, bool) else str(value).lower() == "true"
                elif isinstance(current, int):
                    if isinstance(value, bool) or int(value) != float(value):
                        raise ValueError
                    value = int(value)
                elif isinstance(current, float):
                    value = float(value)
                else:
                    value = str(value)
            except (TypeError, ValueError):
                raise InvalidArgument(f"{name} must be a number, got {value!r}") from None
            low, high = cls.LIMITS.get(name, (None, None))
            if low is not None and high is not None and not low <= value <= high:
                raise InvalidArgument(f"{name} must be between {low} and {high}, got {value}")
            setattr(config, name, value)
        config.max_workers = max(config.max_workers, config.min_workers)
        return config


PARALLEL_TYPES = ("tp", "pp", "pptp", "custom")


def parallel_settings(yaml_config: dict[str, Any]) -> tuple[int, int, list[int]]:
    """Read TorchServe's distributed-worker keys from a model config.

    ``parallelType: tp | pp | pptp`` with ``torchrun: {nproc-per-node: N}`` (or
    ``parallelLevel: N``) makes each worker a torchrun group of N processes;
    ``custom`` is one process given all devices. ``torchrun.OMP_NUMBER_THREADS``
    sets the threads per rank (default 1, as TorchServe); ``deviceIds`` the GPUs.

    Returns:
        ``(world_size, threads per rank, device ids)``.

    Raises:
        InvalidArgument: an unknown parallelType or a bad process count.
    """
    parallel = yaml_config.get("parallelType")
    torchrun = yaml_config.get("torchrun") or {}
    if not isinstance(torchrun, dict):
        raise InvalidArgument("model config key torchrun must be a mapping")
    device_ids = [int(d) for d in yaml_config.get("deviceIds") or []]
    threads = int(torchrun.get("OMP_NUMBER_THREADS", torchrun.get("omp-num-threads", 1)))
    if parallel is None:
        return 1, threads, device_ids
    if parallel not in PARALLEL_TYPES:
        raise InvalidArgument(f"parallelType must be one of {', '.join(PARALLEL_TYPES)}, got {parallel!r}")
    if parallel == "custom":
        return 1, threads, device_ids
    nproc = torchrun.get("nproc-per-node", torchrun.get("nproc_per_node", yaml_config.get("parallelLevel", 1)))
    try:
        world = int(nproc)
    except (TypeError, ValueError):
        raise InvalidArgument(f"torchrun nproc-per-node must be an integer, got {nproc!r}") from None
    if not 1 <= world <= 64:
        raise InvalidArgument(f"torchrun nproc-per-node must be between 1 and 64, got {world}")
    return world, max(1, threads), device_ids


class WorkerState(enum.Enum):
    """A worker slot's state as DescribeModel shows it."""

    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    BACKOFF = "RESTARTING"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"


class WorkerSlot:
    """Keeps one worker process of a model version alive and fed with batches.

    Args:
        model: the owning version.
        worker_id: unique id (TorchServe numbers workers from 9000).
    """

    def __init__(self, model: ModelVersion, worker_id: int) -> None:
        self.model = model
        self.id = worker_id
        self.state = WorkerState.STARTING
        self.process: WorkerProcess | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.first_outcome: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.stopping = False
        self.task: asyncio.Task[None] | None = None
        self.start_time = time.time()
        self.gpu: int | None = None

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
                                    f"inference_service.worker.{self.model.name}")
            self.process = process
            try:
                await process.start(config.startup_timeout_s)
            except WorkerLoadError as exc:
                self.last_error = exc.message
                log.error("%s", exc.message)
                self._outcome(exc.message)
            else:
                self.start_time = process.start_time
                failures, first_failure = 0, None
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
        """Offer ``process`` to the job queue until it dies or the slot stops.

        Batches reach the worker without this task: the queue calls ``send`` when a batch is
        ready and the worker is free, and the worker's routing calls ``done`` when it has
        answered one, which offers the worker again (see :mod:`inference_service.jobs`).
        """
        model = self.model
        queue = model.queue
        timeout = model.config.response_timeout_s
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def end(_process: object = None) -> None:
            if not ended.done():
                ended.set_result(None)

        def send(batch: list[Job]) -> bool:
            if self.stopping or not process.send_batch(batch, timeout, done):
                return False
            self.state = WorkerState.BUSY
            return True

        def done() -> None:
            if self.state is WorkerState.BUSY:
                self.state = WorkerState.READY
            if self.stopping:
                end()
            else:
                queue.offer(self.id, send)

        process.on_exit = end
        queue.offer(self.id, send)
        try:
            await ended
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

    async def stop(self, timeout: float) -> None:
        """Stop after the running batch (waiting at most ``timeout`` s), then stop the process."""
        busy = self.process is not None and self.process.busy
        self.stopping = True
        self.model.queue.withdraw(self.id)
        self._set_state(WorkerState.UNLOADING)
        if self.task is not None:
            if not busy:
                self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(self.task), timeout)
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self.process is not None:
            await self.process.stop(timeout=2.0)
        self._outcome("worker stopped")

    def describe(self) -> dict[str, Any]:
        """DescribeModel's ``workers[]`` entry (TorchServe's keys, plus restarts)."""
        process = self.process
        alive = process is not None and process.alive
        return {
            "id": str(self.id),
            "startTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.start_time)),
            "status": self.state.value,
            "memoryUsage": process.memory_usage() if process is not None else 0,
            "pid": process.pid if alive and process is not None else -1,
            "gpu": self.gpu is not None,
            "gpuUsage": "N/A",
            "restarts": self.restarts,
        }


class ModelVersion:
    """One version of a registered model.

    Args:
        name: model name.
        archive: the opened archive.
        config: effective settings.
        handler: entry point (RegisterModel's, else the manifest's).
        server_version: reported to handlers.
        on_change: called when worker states change (health updates).
        loaded_at_startup: whether it came from ``--models``/``load_models``.
        extra_paths: extra ``sys.path`` entries for the workers.
        base_env: environment for worker processes.
    """

    def __init__(self, name: str, archive: ModelArchive, config: ModelConfig, handler: str,
                 server_version: str, on_change: Callable[[], None], loaded_at_startup: bool = False,
                 extra_paths: list[str] | None = None, base_env: dict[str, str] | None = None,
                 gpus: GpuAllocator | None = None) -> None:
        self.name = name
        self.version = archive.version
        self.archive = archive
        self.config = config
        self.handler = handler
        self.server_version = server_version
        self._on_change = on_change
        self.loaded_at_startup = loaded_at_startup
        self.extra_paths = extra_paths or []
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self.queue = JobQueue(config.job_queue_size, config.batch_size, config.max_batch_delay_ms)
        self.slots: dict[int, WorkerSlot] = {}
        self.sequences: dict[str, int] = {}
        self.sequence_last_used: dict[str, float] = {}
        self.restarts_total = 0  # worker restarts of this version, kept when workers are removed
        self.gpus = gpus or GpuAllocator(0)
        # workers placed on GPUs: all of them where there are GPUs, unless deviceType is cpu
        self.gpu_count = 1 << 30 if self.gpus.count and config.device_type != "cpu" else 0
        self.closed = False
        self.world_size, self.rank_threads, self.device_ids = parallel_settings(archive.config)

    def on_change(self) -> None:
        """Propagate a worker state change (health)."""
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
        """At least ``min_workers`` workers are ready (TorchServe's Ping rule)."""
        return self.ready_workers >= self.config.min_workers

    def worker_spec(self, slot: WorkerSlot) -> protocol.WorkerSpec:
        """The INIT message for a worker of this version."""
        return protocol.WorkerSpec(
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
        )

    def worker_env(self, slot: WorkerSlot) -> dict[str, str]:
        """Environment of a worker: torch threads = cores / workers unless configured."""
        env = dict(self.base_env)
        if self.world_size > 1:
            threads = self.rank_threads  # per rank; TorchServe's default is 1
        else:
            threads = self.config.worker_threads or max(1, (os.cpu_count() or 1) // max(1, len(self.slots)))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("MKL_NUM_THREADS", str(threads))
        if self.device_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.device_ids)
        elif slot.gpu is None:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    async def scale(self, min_workers: int, max_workers: int, synchronous: bool,
                    timeout: float = 10.0, number_gpu: int | None = None) -> None:
        """Run ``min_workers`` workers (ScaleWorker / RegisterModel's initial_workers).

        Args:
            min_workers: workers to keep running.
            max_workers: recorded maximum (at least ``min_workers``).
            synchronous: wait until new workers loaded (or failed) / old ones stopped.
            timeout: seconds a stopped worker may finish its batch.
            number_gpu: how many of the workers go on GPUs (``None``: keep the
                current rule). Without GPUs every worker runs on the CPU.

        Raises:
            WorkerLoadError: synchronous, and a new worker failed to load
                (the message is the handler's error).
        """
        if self.closed:
            raise FailedPrecondition(f"model {self.name} version {self.version} is being unregistered")
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
        stops = [self._remove(slot, timeout) for slot in removed]
        self.on_change()
        if synchronous:
            await asyncio.gather(*stops)
            outcomes = await asyncio.gather(*(slot.first_outcome for slot in new))
            errors = [e for e in outcomes if e]
            if errors:
                raise WorkerLoadError(errors[0])
        else:
            for coro in stops:
                asyncio.create_task(coro)

    async def _remove(self, slot: WorkerSlot, timeout: float) -> None:
        await slot.stop(timeout)
        self.slots.pop(slot.id, None)
        for seq, wid in list(self.sequences.items()):
            if wid == slot.id:
                del self.sequences[seq]
        self.on_change()

    def submit(self, job: Job) -> None:
        """Queue ``job`` for this version.

        Raises:
            Unavailable: no worker is scheduled (0 workers, or all gave up).
            ResourceExhausted: the job queue is full.
        """
        if self.closed:
            raise Unavailable(f"model {self.name} version {self.version} is being unregistered")
        if not any(s.state is not WorkerState.FAILED and not s.stopping for s in self.slots.values()):
            raise Unavailable(
                f"model {self.name} version {self.version} has no worker; scale it with ScaleWorker",
                reason="NO_WORKER", retry_after_s=5.0)
        worker_id = None
        if job.sequence_id is not None:
            worker_id = self.sequences.get(job.sequence_id)
        self.queue.put(job, worker_id)

    def open_sequence(self, sequence_id: str) -> None:
        """Pin a new sequence to the least-loaded worker (StreamPredictions2).

        Raises:
            FailedPrecondition: the model has no sequence batching configured.
            ResourceExhausted: ``maxNumSequence`` sequences are open.
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
        self.sequence_last_used[sequence_id] = time.monotonic()

    def close_sequence(self, sequence_id: str) -> None:
        """Forget a sequence (its end, or its stream closed)."""
        self.sequences.pop(sequence_id, None)
        self.sequence_last_used.pop(sequence_id, None)

    async def close(self) -> None:
        """Stop every worker and fail queued jobs; remove the extracted archive."""
        self.closed = True
        self.queue.drain(Unavailable(f"model {self.name} version {self.version} was unregistered"))
        await asyncio.gather(*(self._remove(s, 2.0) for s in list(self.slots.values())))
        self.archive.remove()

    def describe(self, is_default: bool) -> dict[str, Any]:
        """DescribeModel's object for this version (TorchServe's keys)."""
        c = self.config
        return {
            "modelName": self.name,
            "modelVersion": self.version,
            "modelUrl": self.archive.url,
            "runtime": str(self.archive.manifest.get("runtime", "python")),
            **c.torchserve_fields(),
            "maxRetryTimeoutInSec": c.max_retry_timeout_s,
            "deviceType": c.device_type or ("gpu" if self.gpu_count and self.gpus.count else "cpu"),
            "loadedAtStartup": self.loaded_at_startup,
            "isDefault": is_default,
            "workers": [s.describe() for s in self.slots.values()],
            "jobQueueStatus": {
                "remainingCapacity": self.queue.remaining_capacity(),
                "pendingRequests": len(self.queue),
            },
        }
