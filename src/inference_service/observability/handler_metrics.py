"""Handler metrics forwarded by workers (``context.metrics``, ``metrics_mode=prometheus``),
exported as ``prometheus_client`` objects (:class:`HandlerMetricsExporter`)."""

from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("inference_service.metrics")

HANDLER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
NAME_RE = re.compile(r"[^a-zA-Z0-9_:]")  # metric names may hold ':'
LABEL_RE = re.compile(r"[^a-zA-Z0-9_]")  # label names may not
HandlerUpdate = tuple[str, str, str, dict[str, str], float]
"""One handler metric update: ``(name, type, unit, dimensions, value)``."""


def sanitize(name: str, pattern: re.Pattern[str]) -> str:
    """``name`` with every character ``pattern`` matches replaced by ``_`` (Prometheus-safe)."""
    cleaned = pattern.sub("_", name)
    return "_" + cleaned if not cleaned or cleaned[0].isdigit() else cleaned


class HandlerMetricsExporter:
    """Handler metric updates applied to ``prometheus_client`` metrics of ``registry``."""

    def __init__(self, registry: CollectorRegistry, hostname: str) -> None:
        self.registry = registry
        self.hostname = hostname
        # handler metric name -> (type, label names, the prometheus_client metric), or None
        # when the name could not be registered (its updates are dropped)
        self._handler: dict[str, tuple[str, tuple[str, ...], Any] | None] = {}
        self._warned: set[str] = set()

    def apply(self, model_name: str, model_version: str, updates: list[HandlerUpdate]) -> None:
        """Apply the ``(name, type, unit, dimensions, value)`` updates a worker forwarded
        (``metrics_mode=prometheus``): counters add, gauges set, histograms observe; labels are the
        sanitised dimension names plus ``Hostname``; unknown types become gauges. Runs on the event
        loop; never raises: an update that cannot be exported (one of our names, a clash, bad or
        changed dimensions or type, a negative counter increment) is dropped with one warning per name
        and cause."""
        for name, metric_type, unit, dims, value in updates:
            try:
                self._apply(name, metric_type, unit, dims, value)
            except Exception:  # noqa: BLE001 - a bad metric must not stop the worker's routing
                self.warn_once(f"{name}:error", f"model {model_name} version {model_version}: handler metric "
                                            f"{name!r} dropped")
                log.debug("handler metric %r dropped", name, exc_info=True)

    def _apply(self, raw_name: str, metric_type: str, unit: str, dims: dict[str, str], value: float) -> None:
        name = sanitize(raw_name, NAME_RE)
        if metric_type not in ("counter", "gauge", "histogram"):
            self.warn_once(name + ":type", f"handler metric {raw_name!r} has type {metric_type!r}; exported as a gauge")
            metric_type = "gauge"
        labels = (*(sanitize(k, LABEL_RE) for k in dims), "Hostname")
        if name not in self._handler:
            self._handler[name] = self._create(raw_name, name, metric_type, unit, labels)
        family = self._handler[name]
        if family is None:
            return
        kind, names, metric = family
        if kind != metric_type or names != labels:
            self.warn_once(name + ":changed", f"handler metric {raw_name!r} changed its type or dimension names "
                                          f"({kind} {names[:-1]} first); update dropped")
            return
        child = metric.labels(*dims.values(), self.hostname)
        if kind == "counter":
            if value < 0:
                self.warn_once(name + ":negative", f"handler counter {raw_name!r} cannot decrease in Prometheus; "
                                               "negative increments are dropped")
                return
            child.inc(value)
        elif kind == "gauge":
            child.set(value)
        else:
            child.observe(value)

    def _create(self, raw_name: str, name: str, metric_type: str, unit: str,
                labels: tuple[str, ...]) -> tuple[str, tuple[str, ...], Any] | None:
        """The metric object of a handler metric's first update (``None``: it cannot be exported)."""
        if name.startswith(("ts_inference_", "ts_queue_", "inference_service_")):
            self.warn_once(name + ":reserved",
                       f"handler metric {raw_name!r} uses a name of the server's own metrics; dropped")
            return None
        if len(set(labels)) != len(labels):
            self.warn_once(name + ":labels", f"handler metric {raw_name!r}: its dimension names {labels[:-1]} "
                                         "repeat (or include Hostname) once made Prometheus-safe; dropped")
            return None
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[metric_type]
        extra = {"buckets": HANDLER_BUCKETS} if metric_type == "histogram" else {}
        try:
            metric = cls(name, f"handler metric, unit: {unit}", labels, registry=self.registry, **extra)
        except ValueError as exc:  # a series name taken by another metric, a reserved label (``le``)
            self.warn_once(name + ":clash", f"handler metric {raw_name!r} cannot be exported ({exc}); dropped")
            return None
        return metric_type, labels, metric

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)
