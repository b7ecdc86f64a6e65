"""The LLM metric families, named after vLLM's (``vllm:`` becomes ``inference_service_llm_``;
labels ``model_name``, ``model_version``).

From the workers (the engine statistics of ``contracts.stats``): one family per field,
counters added up, gauges summed over the version's running workers, and
``..._kv_cache_usage_perc``. Measured per streamed message by
:class:`~inference_service.observability.metrics.ModelStats`: the time to first token,
inter-token latency and end-to-end latency histograms. See docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inference_service.contracts.stats import StatSpec, VersionStats
from inference_service.observability import routing_metrics

LLM = "inference_service_llm_"
# vLLM's buckets for its TTFT, inter-token and end-to-end histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class LLMMetrics:
    """The LLM families of one server: the request histograms (in ``registry``) and the serving
    statistics the workers forward (collected by :meth:`collect`).

    Args:
        registry: where the histograms are registered.
        stats: the engine statistics workers may report, by name (each a family).
        warn_once: ``(key, message)``: logs ``message`` the first time ``key`` is seen.
    """

    def __init__(self, registry: CollectorRegistry, stats: dict[str, StatSpec],
                 warn_once: Callable[[str, str], None]) -> None:
        self.stats = stats
        self._warn_once = warn_once
        self._ttft = Histogram(
            LLM + "time_to_first_token_seconds",
            "LLM: seconds from receipt of a streaming request to its first message.",
            ("model_name", "model_version"), registry=registry, buckets=TTFT_BUCKETS)
        self._itl = Histogram(
            LLM + "inter_token_latency_seconds",
            "LLM: seconds between consecutive text messages of a stream (one message is about one token).",
            ("model_name", "model_version"), registry=registry, buckets=ITL_BUCKETS)
        self._e2e = Histogram(
            LLM + "e2e_request_latency_seconds",
            "LLM: seconds from receipt of a request to its final response (successful requests).",
            ("model_name", "model_version"), registry=registry, buckets=E2E_BUCKETS)
        #: the models known as LLMs (they reported serving statistics)
        self.models: set[str] = set()
        # (model, version) -> serving counter totals; (model, version) -> worker pid -> gauges
        self._counts: dict[tuple[str, str], dict[str, float]] = {}
        self._gauges: dict[tuple[str, str], dict[str, dict[str, float]]] = {}

    def children(self, name: str, label: str) -> tuple[Any, Any, Any]:
        """The histograms' children ``(ttft, itl, e2e)`` of a model and version label."""
        return self._ttft.labels(name, label), self._itl.labels(name, label), self._e2e.labels(name, label)

    def record(self, model_name: str, model_version: str, name: str, metric_type: str,
               dims: Mapping[str, str], value: float) -> None:
        """Apply one serving statistic (see
        :meth:`ServerMetrics.serving_stat <inference_service.observability.metrics.ServerMetrics.serving_stat>`)."""
        key = (model_name, model_version)
        spec = self.stats.get(name)
        counter = spec is not None and spec.counter
        if counter and metric_type == "counter" and value >= 0:
            counts = self._counts.setdefault(key, {})
            counts[name] = counts.get(name, 0.0) + value
        elif spec is not None and not counter and metric_type == "gauge":
            worker = dims.get("pid", "")
            self._gauges.setdefault(key, {}).setdefault(worker, {})[name] = value
        elif counter and metric_type == "counter":
            self._warn_once(f"serving:{name}:negative", f"model {model_name}: serving counter {name!r} "
                                                        "cannot decrease; negative increments are dropped")
        else:
            self._warn_once(f"serving:{name}", f"model {model_name}: serving statistic {name!r} "
                                               f"({metric_type}) is not known; dropped")

    def counter_names(self) -> list[str]:
        """The counter families :meth:`collect` yields (without ``_total``)."""
        return [LLM + s.family for s in self.stats.values() if s.counter]

    def gauge_names(self) -> list[str]:
        """The gauge families :meth:`collect` yields."""
        return [*(LLM + s.family for s in self.stats.values() if not s.counter), LLM + "kv_cache_usage_perc",
                *routing_metrics.NAMES]

    def collect(self, version_stats: Iterable[VersionStats]) -> Iterator[Metric]:
        """The workers' serving counters, and their gauges summed over each version's running
        workers (a gone worker's values are forgotten), and the routing gauges
        (:mod:`~inference_service.observability.routing_metrics`). Runs on the scrape thread."""
        labels = ["model_name", "model_version"]
        for spec in [spec for spec in self.stats.values() if spec.counter]:
            counter = CounterMetricFamily(LLM + spec.family, spec.help, labels=labels)
            for (name, version), counts in list(self._counts.items()):
                counter.add_metric([name, version], counts.get(spec.name, 0.0))
            yield counter
        gauges = {spec.name: GaugeMetricFamily(LLM + spec.family, spec.help, labels=labels)
                  for spec in self.stats.values() if not spec.counter}
        usage = GaugeMetricFamily(LLM + "kv_cache_usage_perc",
                                  "LLM: fraction of the KV cache capacity in use (0 to 1).", labels=labels)
        version_stats = list(version_stats)
        live = {(v.model_name, v.model_version): {str(pid) for pid in v.worker_pids} for v in version_stats}
        depth = {(v.model_name, v.model_version): v.queue_depth for v in version_stats}
        routing = []
        for key, per_worker in list(self._gauges.items()):
            pids = live.get(key)
            if pids is None:  # the version is gone
                self._gauges.pop(key, None)
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
            routing.append((key[0], totals, depth.get(key, 0)))
        yield from gauges.values()
        yield usage
        yield from routing_metrics.routing_families(routing)
