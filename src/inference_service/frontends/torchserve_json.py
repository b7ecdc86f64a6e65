"""TorchServe's DescribeModel JSON and management status texts, shared by the gRPC and HTTP
management APIs: keys, order and indentation as TorchServe's ``DescribeModelResponse``, plus
``restarts`` per worker."""

from __future__ import annotations

import json
import time
from typing import Any

from inference_service.dispatch.supervisor import WorkerSlot
from inference_service.dispatch.usage import process_tree_usage
from inference_service.serving.model_version import ModelVersion


def describe_worker(slot: WorkerSlot) -> dict[str, Any]:
    """A worker's entry of ``workers[]``: id, start time (local, second precision), status,
    resident memory in bytes (0 without a process), pid (-1 unless running), whether it is on a
    GPU, ``gpuUsage`` (always ``"N/A"``), its restarts, ``threads`` and ``treeMemoryUsage`` (bytes)
    of the process and its descendants, and an LLM handler's ``engine``
    (:class:`~inference_service.contracts.wire.EngineInfo`)."""
    process = slot.process
    alive = process is not None and process.alive
    usage = process_tree_usage(process.pid if alive and process is not None else None)
    described: dict[str, Any] = {
        "id": str(slot.id),
        "startTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(slot.start_time)),
        "status": slot.state.value,
        "memoryUsage": process.memory_usage() if process is not None else 0,
        "pid": process.pid if alive and process is not None else -1,
        "gpu": slot.gpu is not None,
        "gpuUsage": "N/A",
        "restarts": slot.restarts,
        "threads": usage.threads,
        "treeMemoryUsage": usage.rss_bytes,
    }
    if process is not None and process.engine_info is not None:
        described["engine"] = process.engine_info.as_json()
    return described


def describe_version(model: ModelVersion, is_default: bool) -> dict[str, Any]:
    """DescribeModel's object for one version: every key TorchServe 0.12's ``DescribeModelResponse``
    sends, in its order and types (Gson leaves out the null ones: ``engine``, ``status``, ``metrics``,
    ``deviceIds`` when unset), plus ``isDefault``, its workers, its job queue, and its sleep
    (``state``, ``idleTimeoutSec``, ``wakes``, ``wakeSeconds``, ``wakeError`` when the latest failed)."""
    c = model.config
    yaml = model.archive.config
    parallel_type = str(yaml.get("parallelType") or "")
    described: dict[str, Any] = {
        "modelName": model.name,
        "modelVersion": model.version,
        "modelUrl": model.archive.url,
        "runtime": str(model.archive.manifest.get("runtime", "python")),
        **c.torchserve_fields(),
        "maxRetryTimeoutInSec": c.max_retry_timeout_s,
        "clientTimeoutInMills": _int(yaml.get("clientTimeoutInMills")),
        "parallelType": parallel_type,
        "parallelLevel": model.world_size if parallel_type else 0,
        "deviceType": c.device_type or ("gpu" if model.gpu_count and model.gpus.count else "cpu"),
    }
    if model.device_ids:  # Gson leaves a null list out
        described["deviceIds"] = list(model.device_ids)
    described.update({
        "continuousBatching": c.continuous_batching,
        "useJobTicket": _bool(yaml.get("useJobTicket")),
        "useVenv": _bool(yaml.get("useVenv")),
        "stateful": c.sequence_batching,
        "sequenceMaxIdleMSec": c.sequence_max_idle_ms,
        "sequenceTimeoutMSec": c.sequence_timeout_ms,
        "maxNumSequence": c.max_num_sequence,
        "maxSequenceJobQueueSize": c.max_sequence_job_queue_size,
        "loadedAtStartup": model.loaded_at_startup,
        "isDefault": is_default,
        "workers": [describe_worker(s) for s in model.slots.values()],
        "jobQueueStatus": {
            "remainingCapacity": model.queue.remaining_capacity(),
            "pendingRequests": len(model.queue),
        },
        "state": model.sleep.state.value,
        "idleTimeoutSec": c.idle_timeout_s,
        "wakes": model.sleep.wakes,
        "wakeSeconds": round(model.sleep.wake_seconds, 3),
    })
    if model.sleep.wake_error is not None:
        described["wakeError"] = model.sleep.wake_error
    return described


def _int(value: Any) -> int:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        return 0


def _bool(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def describe_json(versions: list[tuple[ModelVersion, bool]]) -> str:
    """DescribeModel's ``msg``: the JSON array of ``(version, is_default)`` descriptions, indented as
    TorchServe prints it."""
    return json.dumps([describe_version(model, is_default) for model, is_default in versions], indent=2)


PROCESSING = "Processing worker updates..."
"""TorchServe's status text for a register or scale that is not synchronous."""


def register_status(model: ModelVersion, synchronous: bool) -> str:
    """TorchServe's RegisterModel status text (``ApiUtils.handleRegister``): registered with 0
    initial workers (and a hint), with N initial workers (synchronous), or :data:`PROCESSING`."""
    workers = model.config.min_workers
    registered = f'Model "{model.name}" Version: {model.version} registered with {workers} initial workers'
    if not workers:
        return registered + ". Use scale workers API to add workers for the model."
    return registered if synchronous else PROCESSING


def scale_status(model: ModelVersion, version: str, synchronous: bool) -> str:
    """TorchServe's ScaleWorker status text: ``Workers scaled to N for model: m[, version: v]``
    (``version`` as the request named it), or :data:`PROCESSING` when not synchronous."""
    if not synchronous:
        return PROCESSING
    status = f"Workers scaled to {model.config.min_workers} for model: {model.name}"
    return status + (f", version: {version}" if version else "")


def unregister_status(name: str) -> str:
    """TorchServe's UnregisterModel status text: ``Model "name" unregistered``."""
    return f'Model "{name}" unregistered'
