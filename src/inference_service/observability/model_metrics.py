"""Per model version families of sleep and wake (``serving/sleep.py``) and of what its workers
cost, from :class:`~inference_service.contracts.stats.VersionStats` at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inference_service.contracts.stats import VersionStats

STATES = ("READY", "SLEEPING", "WAKING")
COUNTERS = ("inference_service_model_wakes", "inference_service_model_wake_seconds",
            "inference_service_model_woken_requests")
GAUGES = ("inference_service_model_state", "inference_service_worker_memory_bytes",
          "inference_service_worker_threads")


def collect(version_stats: Iterable[VersionStats]) -> Iterator[Metric]:
    """The families of :data:`COUNTERS` and :data:`GAUGES`."""
    labels = ["model_name", "model_version"]
    state = GaugeMetricFamily(GAUGES[0], "1 for the model version's sleep state (READY, SLEEPING, WAKING), "
                              "0 for the others.", labels=[*labels, "state"])
    memory = GaugeMetricFamily(GAUGES[1], "Resident memory (bytes) of the model version's worker processes "
                               "and their descendants.", labels=labels)
    threads = GaugeMetricFamily(GAUGES[2], "Threads of the model version's worker processes and their "
                                "descendants.", labels=labels)
    wakes = CounterMetricFamily(COUNTERS[0], "Wakes of the model version from sleep (failed ones too).",
                                labels=labels)
    wake_seconds = CounterMetricFamily(COUNTERS[1], "Seconds the model version's wakes took.", labels=labels)
    woken = CounterMetricFamily(COUNTERS[2], "Requests that arrived while the model version slept or woke "
                                "(and waited for its wake).", labels=labels)
    for v in version_stats:
        key = [v.model_name, v.model_version]
        for name in STATES:
            state.add_metric([*key, name], 1.0 if v.state == name else 0.0)
        memory.add_metric(key, v.rss_bytes)
        threads.add_metric(key, v.threads)
        wakes.add_metric(key, v.wakes)
        wake_seconds.add_metric(key, v.wake_seconds)
        woken.add_metric(key, v.woken_requests)
    yield from (state, memory, threads, wakes, wake_seconds, woken)
