"""Prometheus metrics, served over HTTP on the metrics port (TorchServe's metrics API).

``GET http://127.0.0.1:8082/metrics`` (``metrics_address``, ``--metrics-port``)
answers the Prometheus text format (0.0.4); ``?name[]=a&name[]=b`` keeps only
those families, as TorchServe's API does. What is exported:

- TorchServe's frontend counters, under TorchServe's names and labels
  (``model_name``, ``model_version`` — the request's, ``"default"`` when it names
  none — and ``hostname``): ``ts_inference_requests_total`` (requests received
  for a registered model), ``ts_inference_latency_microseconds`` (total µs from
  receipt to the final response of successful requests) and
  ``ts_queue_latency_microseconds`` (total µs from receipt until a worker took
  the request). Like TorchServe's they are rendered without a ``_total`` suffix
  on the ``_microseconds`` counters, which ``prometheus_client`` would add: this
  module renders them itself, beside ``prometheus_client``'s exposition of the rest.
- For streaming users (labels ``model_name``, ``model_version``):
  ``inference_service_time_to_first_response_seconds`` and
  ``inference_service_response_gap_seconds`` (histograms),
  ``inference_service_stream_messages_total``, ``inference_service_cancellations_total``.
- ``inference_service_errors_total{method, code, reason}``: RPCs that ended with an
  error status (``reason`` is the ``ErrorInfo`` reason).
- Read at scrape time from a :class:`StatsSource` (the core's read-only stats view,
  :meth:`InferenceCore.stats <inference_service.serving.core.InferenceCore.stats>`):
  ``inference_service_requests_in_flight``, ``inference_service_job_queue_depth``,
  ``inference_service_workers{state}``, ``inference_service_worker_restarts_total``.
- For LLMs (models whose workers report serving statistics, as the bundled LLM handler
  does), in every ``metrics_mode``, named after vLLM's metrics (``vllm:`` becomes
  ``inference_service_llm_``; labels ``model_name``, ``model_version``): one family per
  field of the engine statistics (``contracts.stats``: counters added up, gauges summed over
  the version's running workers; ``..._generation_tokens_total`` grows at each engine step)
  and ``..._kv_cache_usage_perc`` (used / capacity, 0 to 1), from the workers
  (``model_version`` the worker's version); and measured here per
  streamed message (``model_version`` the request's label, as the streaming histograms):
  ``..._time_to_first_token_seconds`` (receipt to the first message),
  ``..._inter_token_latency_seconds`` (between consecutive text messages, the final one
  left out; a message is one text piece, about one token) and
  ``..._e2e_request_latency_seconds`` (receipt to the final response, successful
  requests, streamed or not), all histograms.
- Handler metrics (``context.metrics``; ``metrics_mode=prometheus``), handed over
  already decoded by the worker side (:meth:`ServerMetrics.handler_metrics`):
  ``prometheus_client`` metric objects created on first sight, under the handler's
  name, labelled with the metric's dimensions plus ``Hostname`` (TorchServe's form):
  a ``Counter`` (exposed as ``<name>_total``, as ``prometheus_client`` names counters),
  a ``Gauge``, or for ``histogram`` metrics a ``Histogram`` with the default buckets.
- TorchServe's system metrics, read at scrape time (:mod:`inference_service.observability.system_metrics`):
  gauges ``CPUUtilization``, ``MemoryUsed``, ``MemoryAvailable``, ``MemoryUtilization``,
  ``DiskUsage``, ``DiskUtilization``, ``DiskAvailable`` (labels ``Level="Host"``,
  ``Hostname``) and, only when ``nvidia-smi`` lists a GPU, ``GPUMemoryUtilization``,
  ``GPUMemoryUsed``, ``GPUUtilization`` (also ``DeviceId``).

This module knows neither the core nor jobs: it reads the :class:`StatsSource` and
``contracts.stats.VersionStats`` values, and is handed plain numbers when requests end.

Quick start::

    metrics = ServerMetrics()
    metrics.attach(core)                   # anything with .stats() (a StatsSource)
    port = metrics.serve("127.0.0.1", 0)   # the bound port
    stats = metrics.model("echo", "")      # cached per (model, version label)
    ...
    metrics.stop()

Recording happens on the event loop thread; scrapes run on the HTTP server's
thread and read snapshots, so a scrape never waits for the loop.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

import grpc
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from inference_service.connection_limits import BoundedThreadingHTTPServer
from inference_service.contracts.stats import SERVING_PREFIX, STAT_TYPES, StatSpec, VersionStats, specs
from inference_service.errors import shorten
from inference_service.observability.handler_metrics import HandlerMetricsExporter, HandlerUpdate
from inference_service.observability.system_metrics import SystemMetricsCollector, query_nvidia_smi

if TYPE_CHECKING:
    from inference_service.observability.accesslog import AccessLog

log = logging.getLogger(__name__)

TTFR_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for its TTFT, inter-token and end-to-end histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LLM = "inference_service_llm_"
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
METRICS_MODES = ("log", "prometheus", "legacy")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what render() writes

_TS_COUNTERS = (
    ("ts_inference_requests_total", "requests", "Total number of inference requests received."),
    ("ts_inference_latency_microseconds", "latency_us",
     "Total inference latency in microseconds (receipt to final response, successful requests)."),
    ("ts_queue_latency_microseconds", "queue_us",
     "Total queue latency in microseconds (receipt until a worker took the request)."),
)
_OK = grpc.StatusCode.OK

#: A decoded handler metric update: ``(name, type, unit, dimensions, value)``, as
#: ``contracts.wire.decode_metrics`` gives it.

class StatsSource(Protocol):
    """What the collector reads the serving state from (the core implements it)."""

    def stats(self) -> tuple[int, Iterable[VersionStats]]:
        """``(requests in flight, one VersionStats per registered model version)``.

        Called on the scrape thread: it must only read, and not fail on concurrent changes.
        """
        ...


class ModelStats:
    """The hot-path numbers of one ``(model_name, model_version label)`` pair.

    Plain attributes, written only on the event loop thread (no lock, no label
    lookup per request); the scrape thread reads them.

    Attributes:
        requests: requests received (``ts_inference_requests_total``).
        latency_us / queue_us: total microseconds (TorchServe's two latency counters).
        messages: messages sent on streams. cancellations: requests the client cancelled.
    """

    __slots__ = ("requests", "latency_us", "queue_us", "messages", "cancellations", "llm", "_ttfr", "_gap")

    def __init__(self, ttfr: Any, gap: Any) -> None:
        self.requests = 0
        self.latency_us = 0.0
        self.queue_us = 0.0
        self.messages = 0
        self.cancellations = 0
        #: the LLM histograms' children ``(ttft, itl, e2e)`` once the model is known as an LLM
        self.llm: tuple[Any, Any, Any] | None = None
        self._ttfr = ttfr
        self._gap = gap

    def message(self, enqueued: float, last: float, final: bool = False) -> float:
        """One stream message is sent: observe time to first response (``last`` 0.0) or the gap.

        Args:
            enqueued: ``time.monotonic()`` when the request was received.
            last: the previous call's answer (0.0 for the first message).
            final: it is the stream's last message (left out of the LLM's inter-token latency:
                it carries the rest of the text or the usage, right after the last piece).

        Returns:
            The ``time.monotonic()`` of this message (pass it as ``last`` next time).
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

    def finish(self, enqueued: float, dispatched: float, ok: bool, cancelled: bool = False) -> None:
        """A request ended: queue latency if a worker took it, latency if ``ok``, the cancel count.

        Args:
            enqueued / dispatched: ``time.monotonic()`` when it was received / a worker took
                it (``dispatched`` 0.0: no worker did).
            ok: it answered its final response. cancelled: the client went away first.
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


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(names: Iterable[str], values: Iterable[str]) -> str:
    return ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))


class ServerMetrics:
    """Every metric of one server, its registry and its HTTP endpoint.

    Args:
        hostname: the ``hostname`` label of TorchServe's counters (default: this host's name).
        system_metrics: serve TorchServe's system metrics (TorchServe: ``metrics_mode=prometheus``
            only; the server passes that).
        number_of_gpu: at or below 0, no GPU system metrics (TorchServe's rule); ``None`` or above
            0: the GPUs ``nvidia-smi`` lists.
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
        self._ttft = Histogram(
            LLM + "time_to_first_token_seconds",
            "LLM: seconds from receipt of a streaming request to its first message.",
            ("model_name", "model_version"), registry=self.registry, buckets=TTFT_BUCKETS)
        self._itl = Histogram(
            LLM + "inter_token_latency_seconds",
            "LLM: seconds between consecutive text messages of a stream (one message is about one token).",
            ("model_name", "model_version"), registry=self.registry, buckets=ITL_BUCKETS)
        self._e2e = Histogram(
            LLM + "e2e_request_latency_seconds",
            "LLM: seconds from receipt of a request to its final response (successful requests).",
            ("model_name", "model_version"), registry=self.registry, buckets=E2E_BUCKETS)
        self._models: dict[str, dict[str, ModelStats]] = {}
        self._llm_models: set[str] = set()
        # (model, version) -> serving counter totals; (model, version) -> worker pid -> gauges
        self._serving_counts: dict[tuple[str, str], dict[str, float]] = {}
        self._serving_gauges: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
        self._errors: dict[tuple[str, str, str], int] = {}
        self._handler = HandlerMetricsExporter(self.registry, self.hostname)
        self.source: StatsSource | None = None
        self.registry.register(_Collector(self))
        if system_metrics:
            gpus = None if number_of_gpu is not None and number_of_gpu <= 0 else query_nvidia_smi
            self.registry.register(SystemMetricsCollector(self.hostname, gpus=gpus))
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- recording
    def model(self, name: str, version: str) -> ModelStats:
        """The cached :class:`ModelStats` of a model and the request's version (``""``: "default")."""
        versions = self._models.get(name)
        if versions is not None:
            stats = versions.get(version)
            if stats is not None:
                return stats
        label = version or "default"
        stats = ModelStats(self._ttfr.labels(name, label), self._gap.labels(name, label))
        if name in self._llm_models:
            stats.llm = self._llm_children(name, label)
        self._models.setdefault(name, {})[version] = stats
        return stats

    def _llm_children(self, name: str, label: str) -> tuple[Any, Any, Any]:
        return self._ttft.labels(name, label), self._itl.labels(name, label), self._e2e.labels(name, label)

    def _mark_llm(self, name: str) -> None:
        """``name`` reported serving statistics: its requests feed the LLM histograms from now on."""
        self._llm_models.add(name)
        for version, stats in self._models.get(name, {}).items():
            if stats.llm is None:
                stats.llm = self._llm_children(name, version or "default")

    def serving_stat(self, model_name: str, model_version: str, name: str, metric_type: str,
                     dims: Mapping[str, str], value: float) -> None:
        """Apply one serving statistic a worker forwarded (see :data:`SERVING_PREFIX`).

        A counter adds its increment to the version's total; a gauge replaces the value of
        the worker named by ``dims["pid"]`` (the exposition sums the version's running
        workers). Unknown names or types and negative increments are dropped with one
        warning per name and cause.
        """
        if model_name not in self._llm_models:
            self._mark_llm(model_name)
        key = (model_name, model_version)
        spec = self.stats.get(name)
        counter = spec is not None and spec.counter
        if counter and metric_type == "counter" and value >= 0:
            counts = self._serving_counts.setdefault(key, {})
            counts[name] = counts.get(name, 0.0) + value
        elif spec is not None and not counter and metric_type == "gauge":
            worker = dims.get("pid", "")
            self._serving_gauges.setdefault(key, {}).setdefault(worker, {})[name] = value
        elif counter and metric_type == "counter":
            self._handler.warn_once(f"serving:{name}:negative", f"model {model_name}: serving counter {name!r} "
                                                            "cannot decrease; negative increments are dropped")
        else:
            self._handler.warn_once(f"serving:{name}", f"model {model_name}: serving statistic {name!r} "
                                                   f"({metric_type}) is not known; dropped")

    def error(self, method: str, code: grpc.StatusCode, reason: str) -> None:
        """Count an RPC that ended with status ``code`` (``inference_service_errors_total``)."""
        key = (method, code.name, reason)
        self._errors[key] = self._errors.get(key, 0) + 1

    def attach(self, source: StatsSource) -> None:
        """Read in-flight requests, queue depths, workers and restarts from ``source`` at scrape time."""
        self.source = source

    def handler_metrics(self, model_name: str, model_version: str, updates: list[HandlerUpdate]) -> None:
        """Apply the metric updates a worker of ``model_name`` / ``model_version`` forwarded (the
        worker side's ``metrics_sink``): serving statistics (names under
        :data:`SERVING_PREFIX`, every ``metrics_mode``) through :meth:`serving_stat`, handler
        metrics (``metrics_mode=prometheus``) through
        :meth:`HandlerMetricsExporter.apply <.handler_metrics.HandlerMetricsExporter.apply>`.
        Never raises."""
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
                    labels = _labels(("model_name", "model_version", "hostname"),
                                     (name, version or "default", self.hostname))
                    out.append(f"{metric}{{{labels}}} {floatToGoString(getattr(stats, attr))}\n")
        registry = self.registry if names is None else self.registry.restricted_registry(
            {f"{n}{suffix}" for n in names for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created")})
        return "".join(out).encode() + generate_latest(registry)

    def serve(self, address: str, port: int, access_log: AccessLog | None = None, cap: int = 1000,
              timeout_s: float | None = None) -> int:
        """Serve ``GET /metrics`` on ``address:port`` in a daemon thread; returns the bound port.
        Each request gets an ``access_log`` line (``None``: none); at most ``cap`` connections,
        each given ``timeout_s`` per read (``request_head_timeout_sec``).

        Raises:
            OSError: the address cannot be bound.
        """
        host = address.strip("[]")
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsHTTPServer", (BoundedThreadingHTTPServer,), {"address_family": family, "cap": cap})
        handler = type("MetricsHandler", (_MetricsHandler,),
                       {"metrics": self, "access_log": access_log, "timeout": timeout_s})
        self._httpd = server_class((host, port), handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        """Stop the HTTP endpoint (blocks up to the server's poll interval)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


class _MetricsHandler(BaseHTTPRequestHandler):
    """``GET /metrics`` (``/`` too): the exposition; anything else 404."""

    metrics: ServerMetrics
    access_log: AccessLog | None = None
    server_version = "inference-service-metrics"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        start = time.perf_counter()
        self._status = 500
        try:
            self._answer()
        finally:
            if self.access_log is not None:
                host, port = self.client_address[0], self.client_address[1]
                peer = f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
                self.access_log.record_http("GET", shorten(urlsplit(self.path).path), "", "", self._status, start,
                                            1 if self._status < 400 else 0, peer)

    def send_response(self, code: int, message: str | None = None) -> None:
        """As ``BaseHTTPRequestHandler``'s, keeping the status for the access log."""
        self._status = code
        super().send_response(code, message)

    def _answer(self) -> None:
        url = urlsplit(self.path)
        if url.path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        query = parse_qs(url.query)
        wanted = query.get("name[]") or query.get("name")
        try:
            body = self.metrics.render(set(wanted) if wanted else None)
        except Exception:  # noqa: BLE001 - a scrape must answer, the cause goes to the log
            log.exception("metrics scrape failed")
            self.send_error(500, "metrics scrape failed; see the server log")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_allowed(self) -> None:
        """405 with ``Allow: GET`` for any other method (http.server would answer 501)."""
        self.send_response(405)
        body = b"only GET is served here\n"
        self.send_header("Allow", "GET")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("metrics scrape from %s: " + format, self.client_address[0], *args)


class _Collector:
    """``prometheus_client`` collector of the counters kept as plain numbers and of the
    :class:`StatsSource`'s state."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        """The families :meth:`collect` yields, without samples (names for the registry's filter)."""
        stats = self.metrics.stats.values()
        for name in ("inference_service_stream_messages", "inference_service_cancellations",
                     "inference_service_errors", "inference_service_worker_restarts",
                     *(LLM + s.family for s in stats if s.counter)):
            yield CounterMetricFamily(name, "")
        for name in ("inference_service_requests_in_flight", "inference_service_job_queue_depth",
                     "inference_service_workers", *(LLM + s.family for s in stats if not s.counter),
                     LLM + "kv_cache_usage_perc"):
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
        for name, versions in list(m._models.items()):
            for version, stats in list(versions.items()):
                messages.add_metric([name, version or "default"], stats.messages)
                cancels.add_metric([name, version or "default"], stats.cancellations)
        yield messages
        yield cancels
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
        yield from self._llm(version_stats)

    def _llm(self, version_stats: Iterable[VersionStats]) -> Iterator[Metric]:
        """The LLM families: the workers' serving counters, and their gauges summed over each
        version's running workers (a gone worker's values are forgotten)."""
        m = self.metrics
        labels = ["model_name", "model_version"]
        counters = [spec for spec in m.stats.values() if spec.counter]
        for spec in counters:
            counter = CounterMetricFamily(LLM + spec.family, spec.help, labels=labels)
            for (name, version), counts in list(m._serving_counts.items()):
                counter.add_metric([name, version], counts.get(spec.name, 0.0))
            yield counter
        gauges = {spec.name: GaugeMetricFamily(LLM + spec.family, spec.help, labels=labels)
                  for spec in m.stats.values() if not spec.counter}
        usage = GaugeMetricFamily(LLM + "kv_cache_usage_perc",
                                  "LLM: fraction of the KV cache capacity in use (0 to 1).", labels=labels)
        live = {(v.model_name, v.model_version): {str(pid) for pid in v.worker_pids} for v in version_stats}
        for key, per_worker in list(m._serving_gauges.items()):
            pids = live.get(key)
            if pids is None:  # the version is gone
                m._serving_gauges.pop(key, None)
                continue
            for gone in [pid for pid in list(per_worker) if pid not in pids]:
                per_worker.pop(gone, None)
            totals = dict.fromkeys(gauges, 0.0)
            for values in list(per_worker.values()):
                for stat, value in list(values.items()):
                    totals[stat] += value
            for stat, gauge in gauges.items():
                gauge.add_metric(list(key), totals[stat])
            capacity = totals["kv_cache_capacity_tokens"]
            usage.add_metric(list(key), totals["kv_cache_used_tokens"] / capacity if capacity else 0.0)
        yield from gauges.values()
        yield usage


class Telemetry:
    """What the core and the servicers record into: metrics (``None``: off) and the access log (``None``: off).

    Args:
        metrics: the server's metrics, or ``None`` (``enable_metrics_api=false``).
        access_log: the access log, or ``None`` (``--no-access-log``).
    """

    def __init__(self, metrics: ServerMetrics | None = None, access_log: AccessLog | None = None) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def model(self, name: str, version: str) -> ModelStats | None:
        """The :class:`ModelStats` to record a request of a registered model into (``None``: metrics off)."""
        metrics = self.metrics
        return None if metrics is None else metrics.model(name, version)

    def peer(self, context: Any) -> str:
        """The client's address for the access log ("" when the access log is off).

        Call it while the RPC runs: grpc's ``context.peer()`` is not safe once the call
        has ended (it crashes the process after a cancel).
        """
        return context.peer() if self.access_log is not None else ""

    def rpc_done(self, method: str, request: Any, peer: str, code: grpc.StatusCode, reason: str,
                 start: float, messages: int, request_id: str = "") -> None:
        """One RPC ended: count an error status; write its access-log line.

        Args:
            method: the RPC's name (``Predictions``...).
            request: the request message (its ``model_name`` / ``model_version`` are logged).
            peer: :meth:`peer`'s answer, taken when the RPC began.
            code / reason: the final status and the ``ErrorInfo`` reason ("" when OK).
            start: ``time.perf_counter()`` when the RPC began.
            messages: response messages sent.
            request_id: the call's request id (the client's ``x-request-id`` or a made one).
        """
        if code is not _OK and self.metrics is not None:
            self.metrics.error(method, code, reason)
        if self.access_log is not None:
            self.access_log.record(method, request, peer, code, reason, start, messages, request_id)
