"""The server-wide settings every worker process is started with (:class:`WorkerOptions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MetricsSink = Callable[[str, str, list[tuple[str, str, str, dict[str, str], float]]], None]
"""Takes ``(model_name, model_version, updates)``: handler metric updates a worker forwarded
(decoded ``METRIC`` frames: name, type, unit, dimensions, value)."""


@dataclass(frozen=True)
class WorkerOptions:
    """Server-wide settings of every worker process, read once in ``main()``.

    Args:
        log_level: the workers' logging level name (the server's ``--log-level``).
        metrics_sink: where the metric updates workers forward go: serving statistics in every
            ``metrics_mode``, handler metrics with ``forward_handler_metrics``; ``None`` (the
            default): nowhere (metrics off).
        forward_handler_metrics: workers forward handler metrics to ``metrics_sink``
            (``metrics_mode=prometheus``) instead of logging them in TorchServe's format.
        service_envelope: the request envelope wrapped around every handler
            (``service_envelope``; ``None``: none).
        decode_input_request: handlers get JSON and text inputs decoded (TorchServe's rule).
        max_response_size: the largest answer the server sends, in bytes (``max_response_size``):
            handlers read it as ``system_properties["max_response_size"]`` to refuse a request
            whose answer cannot fit before computing it.
    """

    log_level: str = "INFO"
    metrics_sink: MetricsSink | None = None
    forward_handler_metrics: bool = False
    service_envelope: str | None = None
    decode_input_request: bool = True
    max_response_size: int = 6_553_500
