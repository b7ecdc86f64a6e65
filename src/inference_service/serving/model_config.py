"""The effective settings of one model version (model-config.yaml, RegisterModel and server
defaults merged and range-checked) and TorchServe's distributed-worker keys."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from inference_service.contracts import wire
from inference_service.contracts.cpu import parse_affinity
from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError
from inference_service.errors import InvalidArgument, shorten
from inference_service.serving.interpreter import InterpreterError, worker_python


@dataclass
class ModelConfig:
    """Effective settings of one model version (units in the names); defaults are TorchServe's. See
    docs/configuration.md."""

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
    worker_wait_policy: str = "passive"  # OMP_WAIT_POLICY of the workers (worker/cpu.py)
    continuous_batching: bool = False
    async_communication: bool = False
    stream_pause_preempt_ms: int = 1000
    stream_pause_abort_ms: int = 60_000
    idle_timeout_s: float = 0.0  # sleep after this long without requests (0: never; serving/sleep.py)
    slo_ttft_ms: int = 0  # goodput: a stream's time to first message at most this (0: no bound)
    slo_tpot_ms: int = 0  # goodput: its mean time per message after the first at most this (0: no bound)

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
        "continuousBatching": "continuous_batching",
        "asyncCommunication": "async_communication",
        "streamPausePreemptMSec": "stream_pause_preempt_ms",
        "streamPauseAbortMSec": "stream_pause_abort_ms",
        "idleTimeoutSec": "idle_timeout_s",
        "sloTtftMSec": "slo_ttft_ms",
        "sloTpotMSec": "slo_tpot_ms",
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
        "stream_pause_preempt_ms": (0, 86_400_000),
        "stream_pause_abort_ms": (0, 86_400_000),
        "idle_timeout_s": (0, 604_800),
        "slo_ttft_ms": (0, 86_400_000),
        "slo_tpot_ms": (0, 86_400_000),
    }

    def met_slo(self, enqueued: float, first: float, last: float, messages: int) -> bool | None:
        """Whether a stream met the model's SLOs (``time.monotonic()`` values of its receipt, first
        and last message), ``None`` when the model sets none: goodput, as ``vllm bench serve``'s."""
        if not (self.slo_ttft_ms or self.slo_tpot_ms) or not messages:
            return None
        tpot = (last - first) / (messages - 1) if messages > 1 else 0.0
        return ((not self.slo_ttft_ms or (first - enqueued) * 1000 <= self.slo_ttft_ms)
                and (not self.slo_tpot_ms or tpot * 1000 <= self.slo_tpot_ms))

    @property
    def worker_mode(self) -> str:
        """How workers run requests: ``continuous`` (``continuousBatching``), ``async``
        (``asyncCommunication``) or ``batch`` (TorchServe's default)."""
        if self.async_communication:
            return wire.MODE_ASYNC
        return wire.MODE_CONTINUOUS if self.continuous_batching else wire.MODE_BATCH

    @property
    def streams_in_batches(self) -> bool:
        """Whether a streaming request still shares its worker with others: true for continuous
        batching and async workers (a stream joins the running requests), false for the batch
        mode, where a streaming request forms a batch of one."""
        return self.worker_mode != wire.MODE_BATCH

    @property
    def max_running(self) -> int:
        """Most requests one worker runs at once: ``batch_size`` for a continuous batch (as
        TorchServe; twice that with ``sequenceBatching``, as TorchServe), ``job_queue_size``
        for async handlers (TorchServe sets no bound), one batch otherwise."""
        mode = self.worker_mode
        if mode == wire.MODE_CONTINUOUS:
            # TorchServe's SequenceContinuousBatching runs 2 x batchSize (a request of a sequence,
            # e.g. a cancel, must get in beside that sequence's running stream)
            return self.batch_size * 2 if self.sequence_batching else self.batch_size
        if mode == wire.MODE_ASYNC:
            return self.job_queue_size
        return 1

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
        """``defaults`` < model-config.yaml < ``overrides`` (non-zero request fields).

        Raises:
            InvalidArgument: a wrong type or out of range (names the setting and its range).
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
            except (TypeError, ValueError, OverflowError):
                raise InvalidArgument(f"{name} must be a number, got {shorten(repr(value), 60)}") from None
            low, high = cls.LIMITS.get(name, (None, None))
            if low is not None and high is not None and not low <= value <= high:
                raise InvalidArgument(f"{name} must be between {low} and {high}, got {value}")
            setattr(config, name, value)
        config.max_workers = max(config.max_workers, config.min_workers)
        check_handler_section(yaml_config.get("handler"))
        return config


def check_handler_section(section: Any) -> HandlerConfig:
    """The typed ``handler:`` section (:class:`HandlerConfig`), checked before any worker starts so a
    bad value is a clear refusal rather than a failed load (``torch_threads`` above the usable CPUs
    is capped later by the worker, with a warning).

    Raises:
        InvalidArgument: names the key, the allowed values and at most 60 characters of the value.
    """
    try:
        config = HandlerConfig.parse(section)
        worker_python(config)
    except (HandlerConfigError, InterpreterError) as exc:
        raise InvalidArgument(shorten(str(exc), 300)) from None
    affinity = config.cpu_affinity
    if affinity is None or affinity == "":
        return config
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        cpus = parse_affinity(affinity, max(allowed))
    except ValueError as exc:
        raise InvalidArgument(shorten(str(exc), 200)) from None
    if cpus is not None and not cpus <= allowed:
        raise InvalidArgument(f"handler config: 'cpu_affinity' must name CPUs of {_ranges(allowed)}, "
                              f"got {shorten(repr(affinity), 60)}")
    return config


def _ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``, at most 60 characters."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return shorten(",".join(parts), 60)



PARALLEL_TYPES = ("tp", "pp", "pptp", "custom")


def parallel_settings(yaml_config: dict[str, Any]) -> tuple[int, int, list[int]]:
    """``(world_size, threads per rank, device ids)`` from TorchServe's distributed-worker keys
    (``parallelType``, ``torchrun``/``parallelLevel``, ``deviceIds``; ``custom``: one process, all
    devices; ``OMP_NUMBER_THREADS`` per rank defaults to 1, as TorchServe).

    Raises:
        InvalidArgument: an unknown parallelType or a bad process count.
    """
    parallel = yaml_config.get("parallelType")
    torchrun = yaml_config.get("torchrun") or {}
    if not isinstance(torchrun, dict):
        raise InvalidArgument("model config key torchrun must be a mapping")
    device_ids = [int(d) for d in yaml_config.get("deviceIds") or []]
    threads = int(str(torchrun.get("OMP_NUMBER_THREADS", torchrun.get("omp-num-threads", 1))))
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
