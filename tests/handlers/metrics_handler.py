"""Publishes handler metrics through ``context.metrics`` (TorchServe's custom metrics API).

At load: counter ``LoadCount`` += 1. Per request: counter ``EchoRequests`` += 1 with
dimension ``kind`` (``stream`` or ``plain``); per batch: gauge ``LastBatchSize`` and the
histogram ``PayloadBytes``. ``stream:N`` sends N intermediate responses, counting each in
``StreamSteps`` before sending it. Answers the body.
"""
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes


class MetricsHandler:
    def initialize(self, context):
        context.metrics.add_counter("LoadCount", 1)

    def handle(self, data, context):
        metrics = context.metrics
        out = []
        for row in data:
            text = bytes(row.get("data") or b"").decode()
            kind = "stream" if text.startswith("stream:") else "plain"
            metrics.add_counter("EchoRequests", 1, dimensions=[Dimension("kind", kind)])
            metrics.add_metric("PayloadBytes", len(text), "Bytes", metric_type=MetricTypes.HISTOGRAM)
            if kind == "stream":
                for i in range(int(text.split(":")[1])):
                    metrics.add_counter("StreamSteps", 1)
                    send_intermediate_predict_response([f"step{i}"], context.request_ids, "ok", 200, context)
            out.append(text)
        metrics.add_metric("LastBatchSize", len(data), "Count", metric_type=MetricTypes.GAUGE)
        return out
