"""TorchServe's ``context.metrics`` API for handlers.

Handlers call ``add_time``, ``add_counter``, ``add_size``, ``add_percent`` and
``add_metric``; each metric is kept for ``get_metric`` and either

- logged at INFO on the worker's ``metrics`` logger (one line per update,
  TorchServe's log form; ``metrics_mode=log``, the default), or
- queued for the frontend (``metrics_mode=prometheus``): the worker sends the
  queued updates as a ``METRIC`` frame with its next response frames, and the
  server exports them on its ``/metrics`` endpoint
  (:mod:`inference_service.observability.metrics`).
"""

from __future__ import annotations

import enum
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("inference_service.metrics")


class MetricTypes(enum.Enum):
    """Metric types (TorchServe's ``ts.metrics.metric_type_enum.MetricTypes``); the ``metric_type``
    arguments take these or their string values."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Dimension:
    """One name/value dimension of a metric (TorchServe's ``ts.metrics.dimension.Dimension``).

    Args:
        name: dimension name (a Prometheus label name once exported).
        value: its value.
    """

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


class Metrics:
    """The ``context.metrics`` object of a worker (TorchServe's ``MetricsCache``).

    Args:
        model_name: dimension ``ModelName`` of every metric.
        request_ids: the current batch's ``{index: request_id}`` (updated per batch).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.request_ids: dict[int, str] = {}
        self._metrics: dict[tuple[str, str], Metric] = {}
        self._host = socket.gethostname()
        self.pending: list[Update] | None = None

    def forward(self) -> None:
        """Queue updates for the frontend instead of logging them (``metrics_mode=prometheus``)."""
        if self.pending is None:
            self.pending = []

    def drain(self) -> list[Update]:
        """The updates queued since the last call (empty when not forwarding)."""
        pending = self.pending
        if not pending:
            return []
        self.pending = []
        return pending

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
        if self.pending is not None:
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
        """Return a metric recorded before.

        Raises:
            KeyError: no metric of that name and type was recorded.
        """
        return self._metrics[(metric_name, str(getattr(metric_type, "value", metric_type)).lower())]
