"""``ModelVersion.admit``, the one admission check of a request: every refusal, in the order a
client learns of them, and that a refused request leaves the job queue as it was."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inference_service.contracts.wire import MAX_NAME_BYTES
from inference_service.dispatch.jobs import Job
from inference_service.dispatch.supervisor import WorkerState
from inference_service.errors import InferenceError, InvalidArgument, ResourceExhausted, Unavailable
from inference_service.serving.model_config import ModelConfig
from inference_service.serving.model_version import ModelVersion

LIMIT = 100  # max_request_size of these tests (bytes)


def _version(*slots: Any, job_queue_size: int = 2) -> ModelVersion:
    archive = SimpleNamespace(version="1.0", config={}, model_dir=Path("/nonexistent"), manifest={})
    version = ModelVersion("m", archive, ModelConfig(job_queue_size=job_queue_size), "h.py", "test",  # type: ignore[arg-type]
                           on_change=lambda: None)
    for i, slot in enumerate(slots):
        version.slots[9000 + i] = slot  # type: ignore[assignment]
    return version


def _slot(state: WorkerState = WorkerState.READY, load_error: str | None = None, stopping: bool = False) -> Any:
    return SimpleNamespace(state=state, load_error=load_error, stopping=stopping)


def _refusal(version: ModelVersion, job: Job) -> InferenceError:
    with pytest.raises(InferenceError) as err:
        version.admit(job, LIMIT)
    return err.value


def test_each_refusal_in_order():
    big = Job({"data": b"x" * (LIMIT + 1)})
    # too large comes first, whatever the version's state
    refused = _refusal(_version(), big)
    assert isinstance(refused, ResourceExhausted) and refused.reason == "REQUEST_TOO_LARGE"
    assert str(LIMIT) in refused.message
    refused = _refusal(_version(), Job({"data": b"x"}))
    assert isinstance(refused, Unavailable) and refused.reason == "NO_WORKER"
    refused = _refusal(_version(_slot(WorkerState.FAILED), _slot(stopping=True)), Job({"data": b"x"}))
    assert refused.reason == "NO_WORKER"
    refused = _refusal(_version(_slot(WorkerState.BACKOFF, load_error="ModuleNotFoundError: torch")),
                       Job({"data": b"x"}))
    assert isinstance(refused, Unavailable) and refused.reason == "MODEL_LOAD_FAILED"
    assert "ModuleNotFoundError: torch" in refused.message and refused.retry_after_s == 5.0
    refused = _refusal(_version(_slot()), Job({"n" * (MAX_NAME_BYTES + 1): b"x"}))
    assert isinstance(refused, InvalidArgument) and str(MAX_NAME_BYTES) in refused.message
    closed = _version(_slot())
    closed.closed = True
    assert isinstance(_refusal(closed, Job({"data": b"x"})), Unavailable)


def test_a_full_queue_refuses_and_a_refused_request_changes_nothing():
    version = _version(_slot(), job_queue_size=1)  # no worker offered itself: jobs wait in the queue
    version.submit(Job({"data": b"a"}), LIMIT)
    assert len(version.queue) == 1
    refusals = ((Job({"data": b"b"}), "JOB_QUEUE_FULL"), (Job({"data": b"x" * (LIMIT + 1)}), "REQUEST_TOO_LARGE"))
    for job, reason in refusals:
        with pytest.raises(ResourceExhausted) as err:
            version.submit(job, LIMIT)
        assert err.value.reason == reason
        assert len(version.queue) == 1 and version.queue.remaining_capacity() == 0
    assert err.value.retry_after_s is None


def test_a_sequence_is_admitted_to_its_worker():
    version = _version(_slot(), _slot())
    version.sequences["seq-1"] = 9001
    assert version.admit(Job({"data": b"x"}, sequence_id="seq-1"), LIMIT) == 9001
    assert version.admit(Job({"data": b"x"}, sequence_id="unknown"), LIMIT) is None
    assert version.admit(Job({"data": b"x"}), LIMIT) is None
