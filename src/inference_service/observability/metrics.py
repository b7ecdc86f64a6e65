"""Prometheus metrics (TorchServe's metrics API): what the server records and exposes.

Recording happens on the event loop thread; scrapes run on the HTTP server's thread and read
snapshots, so a scrape never waits for the loop. See docs/observability.md.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from inference_service.contracts.stats import SERVING_PREFIX, STAT_TYPES, StatSpec, VersionStats, specs
from inference_service.observability import model_metrics
from inference_service.observability.handler_metrics import HandlerMetricsExporter, HandlerUpdate
from inference_service.observability.llm_metrics import LLMMetrics
from inference_service.observability.metrics_http import MetricsEndpoint
from inference_service.observability.system_metrics import SystemMetricsCollector, query_nvidia_smi

if TYPE_CHECKING:
    from inference_service.observability.accesslog import AccessLog

TTFR_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
METRICS_MODES = ("log", "prometheus", "legacy")

_TS_COUNTERS = (
    ("ts_inference_requests_total", "requests", "Total number of inference requests received."),
    ("ts_inference_latency_microseconds", "latency_us",
     "Total inference latency in microseconds (receipt to final response, successful requests)."),
    ("ts_queue_latency_microseconds", "queue_us",
     "Total queue latency in microseconds (receipt until a worker took the request)."),
)
_OK = grpc.StatusCode.OK
#: TorchServe's frontend counters of HTTP answers by status class (its ``NettyUtils``: 2xx, 4xx, and
#: every other status as 5XX), labels ``Level="Host"`` and ``Hostname``.
_HTTP_COUNTERS = ("Requests2XX", "Requests4XX", "Requests5XX")

class StatsSource(Protocol):
    """What the collector reads the serving state from (the core implements it)."""

    def stats(self) -> tuple[int, Iterable[VersionStats]]:
        """``(requests in flight, one VersionStats per version)``; called on the scrape thread."""
        ...


class ModelStats:
    """The hot-path numbers of one ``(model_name, model_version label)`` pair.

    Written only on the event loop thread (no lock); ``latency_us`` / ``queue_us`` are total
    microseconds (TorchServe's two latency counters).
    """

    __slots__ = ("requests", "latency_us", "queue_us", "messages", "cancellations", "llm", "_ttfr", "_gap",
                 "slo_requests", "goodput")

    def __init__(self, ttfr: Any, gap: Any) -> None:
        self.requests = 0
        self.latency_us = 0.0
        self.queue_us = 0.0
        self.messages = 0
        self.cancellations = 0
        self.slo_requests = 0  # streams of a model with SLOs that ended well
        self.goodput = 0  # those that met them
        #: the LLM histograms' children ``(ttft, itl, e2e)`` once the model is known as an LLM
        self.llm: tuple[Any, Any, Any] | None = None
        self._ttfr = ttfr
        self._gap = gap

    def message(self, enqueued: float, last: float, final: bool = False) -> float:
        """One stream message is sent: observe time to first response (``last`` 0.0) or the gap.

        ``enqueued`` and the result are ``time.monotonic()`` values; pass the result as ``last``
        next time. A ``final`` message is left out of the LLM's inter-token latency.
        """
        now = time.monotonic()
        llm = self.llm
        if last:
            self._gap.observe(now - last)
            if llm is not None and not final:
                llm[1].observe(now - last)
        else:
            self._ttfr.observe(now - enqueued)
            if llm is not None:
                llm[0].observe(now - enqueued)
        self.messages += 1
        return now

    def finish(self, enqueued: float, dispatched: float, ok: bool, cancelled: bool = False,
               met_slo: bool | None = None) -> None:
        """A request ended: queue latency if a worker took it, latency if ``ok``, the cancel count.

        ``enqueued`` / ``dispatched``: ``time.monotonic()`` values (``dispatched`` 0.0: no worker took it).
        """
        if dispatched:
            self.queue_us += (dispatched - enqueued) * 1e6
        if ok:
            elapsed = time.monotonic() - enqueued
            self.latency_us += elapsed * 1e6
            if self.llm is not None:
                self.llm[2].observe(elapsed)
        if cancelled:
            self.cancellations += 1
        if met_slo is not None:
            self.slo_requests += 1
            self.goodput += met_slo


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(names: Iterable[str], values: Iterable[str]) -> str:
    return ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))


class ServerMetrics:
    """Every metric of one server, its registry and its HTTP endpoint.

    ``number_of_gpu`` at or below 0: no GPU system metrics (TorchServe's rule); ``None`` or above:
    the GPUs ``nvidia-smi`` lists.
    """

    def __init__(self, hostname: str | None = None, system_metrics: bool = True,
                 number_of_gpu: int | None = None, stat_types: Iterable[type] = STAT_TYPES) -> None:
        self.hostname = hostname or socket.gethostname()
        #: the engine statistics workers may report (their fields), each an LLM family
        self.stats: dict[str, StatSpec] = specs(stat_types)
        self.registry = CollectorRegistry(auto_describe=False)
        self._ttfr = Histogram(
            "inference_service_time_to_first_response_seconds",
            "Seconds from receipt of a streaming request to its first response message.",
            ("model_name", "model_version"), registry=self.registry, buckets=TTFR_BUCKETS)
        self._gap = Histogram(
            "inference_service_response_gap_seconds",
            "Seconds between consecutive response messages of a stream.",
            ("model_name", "model_version"), registry=self.registry, buckets=GAP_BUCKETS)
        self._models: dict[str, dict[str, ModelStats]] = {}
        self._errors: dict[tuple[str, str, str], int] = {}
        self._http = [0, 0, 0]  # HTTP answers: 2xx, 4xx, others (TorchServe's Requests2XX/4XX/5XX)
        self._handler = HandlerMetricsExporter(self.registry, self.hostname)
        self.llm = LLMMetrics(self.registry, self.stats, self._handler.warn_once)
        self.source: StatsSource | None = None
        self.registry.register(_Collector(self))
        if system_metrics:
            gpus = None if number_of_gpu is not None and number_of_gpu <= 0 else query_nvidia_smi
            self.registry.register(SystemMetricsCollector(self.hostname, gpus=gpus))
        self._endpoint = MetricsEndpoint(self.render)

    # ------------------------------------------------------------- recording
    def model(self, name: str, version: str) -> ModelStats:
        """The cached :class:`ModelStats` of a model version (the one serving, never "default")."""
        versions = self._models.get(name)
        if versions is not None:
            stats = versions.get(version)
            if stats is not None:
                return stats
        stats = ModelStats(self._ttfr.labels(name, version), self._gap.labels(name, version))
        if name in self.llm.models:
            stats.llm = self.llm.children(name, version)
        self._models.setdefault(name, {})[version] = stats
        return stats

    def _mark_llm(self, name: str) -> None:
        """``name`` reported serving statistics: its requests feed the LLM histograms from now on."""
        self.llm.models.add(name)
        for version, stats in self._models.get(name, {}).items():
            if stats.llm is None:
                stats.llm = self.llm.children(name, version)

    def serving_stat(self, model_name: str, model_version: str, name: str, metric_type: str,
                     dims: Mapping[str, str], value: float) -> None:
        """Apply one serving statistic a worker forwarded (see :data:`SERVING_PREFIX`).

        A gauge is per worker (``dims["pid"]``), summed at exposition; bad updates are dropped
        with one warning per name and cause.
        """
        if model_name not in self.llm.models:
            self._mark_llm(model_name)
        self.llm.record(model_name, model_version, name, metric_type, dims, value)

    def error(self, method: str, code: grpc.StatusCode, reason: str) -> None:
        """Count an RPC that ended with status ``code`` (``inference_service_errors_total``)."""
        key = (method, code.name, reason)
        self._errors[key] = self._errors.get(key, 0) + 1

    def http_response(self, status: int) -> None:
        """Count one HTTP answer of the inference or management API (its head sent) by status class."""
        self._http[0 if 200 <= status < 300 else 1 if 400 <= status < 500 else 2] += 1

    def attach(self, source: StatsSource) -> None:
        """Read in-flight requests, queue depths, workers and restarts from ``source`` at scrape time."""
        self.source = source

    def handler_metrics(self, model_name: str, model_version: str, updates: list[HandlerUpdate]) -> None:
        """Apply the metric updates a worker forwarded (serving statistics and handler metrics); never raises."""
        handler: list[HandlerUpdate] = []
        for update in updates:
            name, metric_type, _unit, dims, value = update
            if name.startswith(SERVING_PREFIX):
                self.serving_stat(model_name, model_version, name[len(SERVING_PREFIX):], metric_type, dims, value)
            else:
                handler.append(update)
        if handler:
            self._handler.apply(model_name, model_version, handler)

    # ------------------------------------------------------------- exposition
    def render(self, names: set[str] | None = None) -> bytes:
        """The Prometheus text exposition (0.0.4), limited to the families in ``names`` if given."""
        out: list[str] = []
        models = [(n, list(v.items())) for n, v in list(self._models.items())]
        for metric, attr, help_text in _TS_COUNTERS:
            if names is not None and metric not in names:
                continue
            out.append(f"# HELP {metric} {help_text}\n# TYPE {metric} counter\n")
            for name, versions in models:
                for version, stats in versions:
                    labels = _labels(("model_name", "model_version", "hostname"), (name, version, self.hostname))
                    out.append(f"{metric}{{{labels}}} {floatToGoString(getattr(stats, attr))}\n")
        host = _labels(("Level", "Hostname"), ("Host", self.hostname))
        for metric, count in zip(_HTTP_COUNTERS, list(self._http), strict=True):
            if names is None or metric in names:
                out.append(f"# HELP {metric} HTTP answers of the inference and management APIs with a "
                           f"{metric[-3:]} status (TorchServe's frontend counter).\n# TYPE {metric} counter\n"
                           f"{metric}{{{host}}} {floatToGoString(count)}\n")
        registry = self.registry if names is None else self.registry.restricted_registry(
            {f"{n}{suffix}" for n in names for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created")})
        return "".join(out).encode() + generate_latest(registry)

    def serve(self, address: str, port: int, access_log: AccessLog | None = None, cap: int = 1000,
              timeout_s: float | None = None, ssl_context: Any = None) -> int:
        """Serve ``GET /metrics`` on ``address:port`` (over TLS with ``ssl_context``); returns the bound
        port; OSError if it cannot bind."""
        return self._endpoint.serve(address, port, access_log, cap, timeout_s, ssl_context)

    def stop(self) -> None:
        """Stop the HTTP endpoint (blocks up to the server's poll interval)."""
        self._endpoint.stop()


class _Collector:
    """``prometheus_client`` collector of the counters kept as plain numbers and of the
    :class:`StatsSource`'s state."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        """The families :meth:`collect` yields, without samples (names for the registry's filter)."""
        for name in ("inference_service_stream_messages", "inference_service_cancellations",
                     "inference_service_slo_requests", "inference_service_goodput_requests",
                     "inference_service_errors", "inference_service_worker_restarts",
                     *self.metrics.llm.counter_names(), *model_metrics.COUNTERS):
            yield CounterMetricFamily(name, "")
        for name in ("inference_service_requests_in_flight", "inference_service_job_queue_depth",
                     "inference_service_workers", *self.metrics.llm.gauge_names(), *model_metrics.GAUGES):
            yield GaugeMetricFamily(name, "")

    def collect(self) -> Iterator[Metric]:
        """Yield the families, from snapshots taken under the GIL (never raises on concurrent changes)."""
        m = self.metrics
        labels = ["model_name", "model_version"]
        messages = CounterMetricFamily("inference_service_stream_messages",
                                       "Response messages sent on streaming RPCs.", labels=labels)
        cancels = CounterMetricFamily("inference_service_cancellations",
                                      "Requests the client cancelled (or whose deadline passed) while "
                                      "queued or running.", labels=labels)
        slo = CounterMetricFamily("inference_service_slo_requests", "Streams of a model with SLOs "
                                  "(sloTtftMSec, sloTpotMSec) that ended well.", labels=labels)
        goodput = CounterMetricFamily("inference_service_goodput_requests",
                                      "Of those, the streams that met the SLOs (goodput).", labels=labels)
        for name, versions in list(m._models.items()):
            for version, stats in list(versions.items()):
                messages.add_metric([name, version], stats.messages)
                cancels.add_metric([name, version], stats.cancellations)
                if stats.slo_requests:
                    slo.add_metric([name, version], stats.slo_requests)
                    goodput.add_metric([name, version], stats.goodput)
        yield from (messages, cancels, slo, goodput)
        errors = CounterMetricFamily("inference_service_errors", "RPCs that ended with an error status.",
                                     labels=["method", "code", "reason"])
        for (method, code, reason), count in list(m._errors.items()):
            errors.add_metric([method, code, reason], count)
        yield errors
        source = m.source
        if source is None:
            return
        inflight, stats_view = source.stats()
        version_stats = list(stats_view)
        yield GaugeMetricFamily("inference_service_requests_in_flight",
                                "Inference requests being served (queued or running).", value=inflight)
        depth = GaugeMetricFamily("inference_service_job_queue_depth",
                                  "Requests waiting in the model version's job queue.", labels=labels)
        workers = GaugeMetricFamily("inference_service_workers", "Workers of the model version by state.",
                                    labels=[*labels, "state"])
        restarts = CounterMetricFamily("inference_service_worker_restarts",
                                       "Worker process restarts of the model version (monotonic).",
                                       labels=labels)
        for v in version_stats:
            depth.add_metric([v.model_name, v.model_version], v.queue_depth)
            for state, count in v.workers.items():
                workers.add_metric([v.model_name, v.model_version, state], count)
            restarts.add_metric([v.model_name, v.model_version], v.restarts)
        yield depth
        yield workers
        yield restarts
        yield from model_metrics.collect(version_stats)
        yield from m.llm.collect(version_stats)


class Telemetry:
    """What the core and the servicers record into: metrics (``None``: off) and the access log (``None``: off)."""

    def __init__(self, metrics: ServerMetrics | None = None, access_log: AccessLog | None = None) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def model(self, name: str, version: str) -> ModelStats | None:
        """The :class:`ModelStats` to record a request of a registered model into (``None``: metrics off)."""
        metrics = self.metrics
        return None if metrics is None else metrics.model(name, version)

    def http_response(self, status: int) -> None:
        """One HTTP answer was sent with ``status`` (TorchServe's ``Requests2XX`` counters)."""
        if self.metrics is not None:
            self.metrics.http_response(status)

    def peer(self, context: Any) -> str:
        """The client's address for the access log ("" when the access log is off).

        Call it while the RPC runs: grpc's ``context.peer()`` crashes the process after a cancel.
        """
        return context.peer() if self.access_log is not None else ""

    def rpc_done(self, method: str, request: Any, peer: str, code: grpc.StatusCode, reason: str,
                 start: float, messages: int, request_id: str = "", version: str = "") -> None:
        """One RPC ended: count an error status; write its access-log line.

        ``start`` is the ``time.perf_counter()`` of the RPC's beginning; ``reason`` is "" when OK;
        ``version``: the model version that served it ("": the request's).
        """
        if code is not _OK and self.metrics is not None:
            self.metrics.error(method, code, reason)
        if self.access_log is not None:
            self.access_log.record(method, request, peer, code, reason, start, messages, request_id, version)
