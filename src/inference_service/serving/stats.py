"""What the core and the metrics exchange, as small protocols and plain values.

The core records each request into a :class:`RequestTelemetry` it is given
(``metrics.Telemetry`` implements it) and offers ``contracts.stats.VersionStats`` snapshots through
``InferenceCore.stats()``; neither side imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from inference_service.contracts.stats import VersionStats
from inference_service.dispatch.supervisor import WorkerState
from inference_service.dispatch.usage import Usage, process_tree_usage

if TYPE_CHECKING:
    from inference_service.serving.model_version import ModelVersion


class RequestStats(Protocol):
    """What the core records one request of a model into (``metrics.ModelStats`` is one); ``requests``
    counts requests looked up successfully."""

    requests: int

    def message(self, enqueued: float, last: float, final: bool = False) -> float:
        """A stream message is about to be sent (``time.monotonic()`` values; ``final``: the
        stream's last message); returns the new ``last``."""
        ...

    def finish(self, enqueued: float, dispatched: float, ok: bool, cancelled: bool = False,
               met_slo: bool | None = None) -> None:
        """The request ended (``dispatched`` 0.0: no worker took it; ``met_slo``: whether a stream
        met its model's SLOs, ``None`` when it sets none)."""
        ...


class RequestTelemetry(Protocol):
    """Where the core records requests (``metrics.Telemetry`` is one)."""

    def model(self, name: str, version: str) -> RequestStats | None:
        """The stats of ``name`` and the request's ``version`` ("": the default), or ``None``: not recorded."""
        ...

    def http_response(self, status: int) -> None:
        """One HTTP answer of the inference or management API was sent with ``status``."""
        ...


__all__ = ["RequestStats", "RequestTelemetry", "VersionStats", "version_stats"]


def version_stats(name: str, version: str, model: ModelVersion) -> VersionStats:
    """The :class:`VersionStats` of one model version, read at one instant (plain attribute
    reads over copies, so the metrics scrape thread may call it while the loop changes things)."""
    workers = dict.fromkeys((state.value for state in WorkerState), 0)
    pids = set()
    usage = Usage()
    for slot in list(model.slots.values()):
        workers[slot.state.value] += 1
        process = slot.process
        if process is not None and process.pid is not None:
            pids.add(process.pid)
            usage = usage + process_tree_usage(process.pid)
    sleep = model.sleep
    return VersionStats(name, version, len(model.queue), workers, model.restarts_total, frozenset(pids),
                        sleep.state.value, sleep.wakes, sleep.wake_seconds, sleep.woken_requests,
                        usage.rss_bytes, usage.threads)
