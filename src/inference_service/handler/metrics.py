"""TorchServe's ``context.metrics`` API for handlers.

Each update is logged on the worker's ``metrics`` logger (``metrics_mode=log``) or queued for
the frontend's ``/metrics`` (``prometheus``) as a ``METRIC`` frame. Engine statistics
(:meth:`Metrics.add_stats`, an addition) are always queued. See docs/observability.md.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from inference_service.contracts.stats import SERVING_PREFIX as _PREFIX
from inference_service.contracts.stats import StatSpec, specs, stat_values

log = logging.getLogger("inference_service.metrics")


class MetricTypes(enum.Enum):
    """Metric types (TorchServe's ``ts.metrics.metric_type_enum.MetricTypes``); the ``metric_type``
    arguments take these or their string values."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Dimension:
    """One name/value dimension of a metric (TorchServe's ``ts.metrics.dimension.Dimension``)."""

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}:{self.value}"

    def to_dict(self) -> dict[str, str]:
        """``{"Name": name, "Value": value}``, as TorchServe's."""
        return {"Name": self.name, "Value": self.value}


@dataclass
class Metric:
    """One handler metric: its latest value, unit, dimensions and type."""

    name: str
    value: float
    unit: str
    dimensions: dict[str, str] = field(default_factory=dict)
    metric_type: str = "counter"

    def update(self, value: float) -> None:
        """Add ``value`` to a counter, or replace the value of a gauge."""
        self.value = self.value + value if self.metric_type == "counter" else value


# One queued update: (name, metric type, unit, dimensions, value).
Update = tuple[str, str, str, dict[str, str], float]

#: Name prefix of the serving statistics in a ``METRIC`` frame (``serving:prompt_tokens``).
SERVING_PREFIX = _PREFIX
#: The serving statistics a handler may report (the fields of the engine statistics).
SERVING_STATS: dict[str, StatSpec] = specs()
#: Least seconds between two log metrics lines of the engine statistics (``metrics_mode=log``).
STATS_LOG_INTERVAL_S = 10.0


class Metrics:
    """The ``context.metrics`` object of a worker (TorchServe's ``MetricsCache``); every metric has the
    dimension ``ModelName``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.request_ids: dict[int, str] = {}
        self._metrics: dict[tuple[str, str], Metric] = {}
        self._host = socket.gethostname()
        self._forward = False
        self._worker = {"pid": str(os.getpid())}
        #: updates waiting for the next frame to the frontend (serving statistics, and the
        #: handler's metrics once :meth:`forward` was called)
        self.pending: list[Update] = []
        self._stats: dict[str, float] = {}  # engine statistics: counter totals, gauge values
        self._stat_specs: dict[str, StatSpec] = {}
        self._stat_totals: dict[str, float] = {}  # the engine's own totals last seen (kind ``total``)
        self._logged: tuple[float, dict[str, float]] | None = None  # last log metrics line: when, totals
        self.stats_log_interval_s = STATS_LOG_INTERVAL_S

    def forward(self) -> None:
        """Queue handler metrics for the frontend instead of logging them (``metrics_mode=prometheus``)."""
        self._forward = True

    def drain(self) -> list[Update]:
        """The updates queued since the last call."""
        pending = self.pending
        if not pending:
            return []
        self.pending = []
        return pending

    def add_stats(self, *stats: Any) -> None:
        """Report engine statistics (``contracts.stats.SchedulerStats``, ``IterationStats``):
        counters as increments, totals as their increase since the last report, gauges when
        they changed. Queued for the server's ``/metrics`` in every ``metrics_mode``."""
        for one in stats:
            for spec, value in stat_values(one):
                if spec.kind == "total":
                    value, self._stat_totals[spec.name] = value - self._stat_totals.get(spec.name, 0.0), value
                changed = self._stats.get(spec.name) != value if spec.kind == "gauge" else value > 0
                if changed:
                    self._serving(spec, value)
        self._log_stats()

    def add_serving_stat(self, name: str, value: float) -> None:
        """Queue one serving statistic (:data:`SERVING_STATS`) for the server's ``/metrics``: a counter's
        increment (>= 0) or a gauge's value for this worker (the server sums a version's workers).
        ValueError for an unknown name."""
        spec = SERVING_STATS.get(name)
        if spec is None:
            raise ValueError(f"unknown serving statistic {name!r}; known: {sorted(SERVING_STATS)}")
        self._serving(spec, float(value))
        self._log_stats()

    def _serving(self, spec: StatSpec, value: float) -> None:
        metric_type = "gauge" if spec.kind == "gauge" else "counter"
        self.pending.append((_PREFIX + spec.name, metric_type, "", self._worker, value))
        self._stats[spec.name] = value if spec.kind == "gauge" else self._stats.get(spec.name, 0.0) + value
        self._stat_specs[spec.name] = spec

    def _log_stats(self) -> None:
        """The log metrics line of the engine statistics (``metrics_mode=log``): every statistic
        reported so far, counters as totals with their rate since the previous line."""
        if self._forward or not self._stats:
            return
        now = time.monotonic()
        last = self._logged
        if last is not None and now - last[0] < self.stats_log_interval_s:
            return
        parts = []
        for name, value in self._stats.items():
            if self._stat_specs[name].kind == "gauge":
                parts.append(f"{name}={value:g}")
            elif last is not None:
                parts.append(f"{name}={value:g} ({(value - last[1].get(name, 0.0)) / max(now - last[0], 1e-9):.1f}/s)")
            else:
                parts.append(f"{name}={value:g}")
        self._logged = (now, dict(self._stats))
        log.info("engine stats of %s: %s", self.model_name, ", ".join(parts))

    def _record(
        self,
        name: str,
        value: float,
        unit: str,
        idx: int | None,
        metric_type: str,
        dimensions: list[Any] | None = None,
    ) -> Metric:
        dims = {"ModelName": self.model_name, "Level": "Model"}
        for dim in dimensions or []:
            dims[str(getattr(dim, "name", dim))] = str(getattr(dim, "value", ""))
        metric_type = str(getattr(metric_type, "value", metric_type)).lower()  # ts MetricTypes enum too
        key = (name, metric_type)
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = Metric(name, 0.0, unit, dims, metric_type)
        metric.update(float(value))
        if self._forward:
            self.pending.append((name, metric_type, unit, dims, float(value)))
            return metric
        req = self.request_ids.get(idx if idx is not None else 0, "")
        dim_text = ",".join(f"{k}:{v}" for k, v in dims.items())
        log.info(
            "%s.%s:%s|#%s|#hostname:%s,requestID:%s,timestamp:%d",
            name, unit, value, dim_text, self._host, req, int(time.time()),
        )
        return metric

    def add_time(
        self, name: str, value: float, idx: int | None = None, unit: str = "ms",
        dimensions: list[Any] | None = None, metric_type: str = "gauge",
    ) -> Metric:
        """Record a duration (``unit`` "ms", "s", "us" or "ns"; TorchServe default ms)."""
        return self._record(name, value, unit, idx, metric_type, dimensions)

    def add_counter(
        self, name: str, value: float, idx: int | None = None,
        dimensions: list[Any] | None = None, metric_type: str = "counter",
    ) -> Metric:
        """Increase counter ``name`` by ``value``."""
        return self._record(name, value, "Count", idx, metric_type, dimensions)

    def add_size(
        self, name: str, value: float, idx: int | None = None, unit: str = "MB",
        dimensions: list[Any] | None = None, metric_type: str = "gauge",
    ) -> Metric:
        """Record a size (``unit`` "MB", "kB", "GB" or "B")."""
        return self._record(name, value, unit, idx, metric_type, dimensions)

    def add_percent(
        self, name: str, value: float, idx: int | None = None,
        dimensions: list[Any] | None = None, metric_type: str = "gauge",
    ) -> Metric:
        """Record a percentage."""
        return self._record(name, value, "Percent", idx, metric_type, dimensions)

    def add_metric(
        self, name: str, value: float, unit: str, idx: int | None = None,
        dimensions: list[Any] | None = None, metric_type: str = "counter",
    ) -> Metric:
        """Record a metric with an explicit unit and type ("counter" or "gauge")."""
        return self._record(name, value, unit, idx, metric_type, dimensions)

    def get_metric(self, metric_name: str, metric_type: str = "counter") -> Metric:
        """A metric recorded before; KeyError when none of that name and type was."""
        return self._metrics[(metric_name, str(getattr(metric_type, "value", metric_type)).lower())]
