"""``ts.metrics.metric_type_enum``: ``MetricTypes`` (counter, gauge, histogram)."""

from inference_service.handler.metrics import MetricTypes

__all__ = ["MetricTypes"]
