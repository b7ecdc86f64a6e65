"""The ``context`` object passed to handlers, compatible with TorchServe's ``ts.context.Context``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from inference_service.contracts.handler_config import HandlerConfig
from inference_service.handler.metrics import Metrics


class Channel(Protocol):
    """The worker's transport, as seen by handler-side helpers (private)."""

    def send_intermediate(self, request_id: str, payload: bytes, headers: dict[str, Any] | None = None) -> None:
        """Send one intermediate response of ``request_id`` (and its response headers) to the frontend."""

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the client of ``request_id`` went away."""


class RequestProcessor:
    """Headers in and status/headers out of one request of a batch (TorchServe's name).

    Args:
        request_header: the request's headers, and each input's ``{"content-type": ...}`` by its
            name (as TorchServe's ``retrieve_data_for_inference``).
    """

    def __init__(self, request_header: dict[str, Any]) -> None:
        self._request_header = request_header
        self._status_code = 200
        self._reason_phrase: str | None = None
        self._response_header: dict[str, str] = {}

    def get_request_property(self, key: str) -> Any:
        """One request header, or ``None``."""
        return self._request_header.get(key)

    def get_request_properties(self) -> dict[str, Any]:
        """All request headers."""
        return self._request_header

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        """Set the response status (HTTP code and phrase)."""
        self._status_code = int(code)
        self._reason_phrase = reason_phrase

    def get_response_status_code(self) -> int:
        """The HTTP status the handler set (200 by default)."""
        return self._status_code

    def get_response_status_phrase(self) -> str | None:
        """The phrase the handler set with the status, if any."""
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        """Set one response header."""
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        """All response headers set by the handler."""
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        """One response header, or ``None``."""
        return self._response_header.get(key)


class Context:
    """What a handler learns of its model and of the current batch.

    Attribute and method names are TorchServe's, so existing handlers run unchanged;
    ``request_ids`` maps batch index to request id, ``stopping_criteria`` (continuous batching)
    holds one callable per request, set by the handler. The sequence header names default to
    TorchServe's, or the environment variables ``TS_REQUEST_SEQUENCE_ID`` / ``_START`` / ``_END``.
    Added here: :meth:`is_cancelled`.
    """

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any],
        batch_size: int,
        gpu: int | None,
        server_version: str,
        limit_max_image_pixels: bool = True,
        max_response_size: int = 6_553_500,
        metrics: Metrics | None = None,
        model_yaml_config: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "MMS",
            "server_version": server_version,
            "limit_max_image_pixels": limit_max_image_pixels,
            "max_response_size": max_response_size,
        }
        self.request_ids: dict[int, str] = {}
        self.request_processor: list[RequestProcessor] = []
        self._metrics = metrics if metrics is not None else Metrics(model_name)
        self.model_yaml_config: dict[str, Any] = model_yaml_config or {}
        self._handler_config: HandlerConfig | None = None
        self._sequence_ids: dict[int, str] = {}
        self._channel: Channel | None = None
        # TorchServe's rule, read once: in a torchrun group only LOCAL_RANK 0 answers clients
        local_rank = os.environ.get("LOCAL_RANK")
        self.answers_clients: bool = local_rank is None or local_rank == "0"
        self.cl_socket = None  # TorchServe's attribute; handlers must not write to it here.
        self.stopping_criteria: Sequence[Callable[[Any], bool | None]] | None = None
        self.header_key_sequence_id = os.environ.get("TS_REQUEST_SEQUENCE_ID", "ts_request_sequence_id")
        self.header_key_sequence_start = os.environ.get("TS_REQUEST_SEQUENCE_START", "ts_request_sequence_start")
        self.header_key_sequence_end = os.environ.get("TS_REQUEST_SEQUENCE_END", "ts_request_sequence_end")

    # --- TorchServe's properties -------------------------------------------------
    @property
    def system_properties(self) -> dict[str, Any]:
        """``model_dir``, ``gpu_id``, ``batch_size``, ``server_name``, ``server_version``,
        ``limit_max_image_pixels`` (TorchServe's), and ``max_response_size`` (bytes; not TorchServe's)."""
        return self._system_properties

    @property
    def handler_config(self) -> HandlerConfig:
        """The ``handler:`` section of ``model_yaml_config``, typed (as the worker applied it: a
        ``torch_threads`` over the usable CPUs is capped). Raises HandlerConfigError when invalid."""
        if self._handler_config is None:
            self._handler_config = HandlerConfig.parse(self.model_yaml_config.get("handler"))
        return self._handler_config

    @handler_config.setter
    def handler_config(self, config: HandlerConfig) -> None:
        self._handler_config = config

    @property
    def metrics(self) -> Metrics:
        """The handler metrics API (``add_time``, ``add_counter``, ...)."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        self._metrics = metrics

    # --- per-request accessors (``idx`` is the index in the batch) -----------------
    def get_request_id(self, idx: int = 0) -> str | None:
        """The request id of batch entry ``idx``."""
        return self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> Any:
        """One header of batch entry ``idx``: the HTTP headers or gRPC metadata, or an input's
        ``{"content-type": ...}`` by the input's name."""
        return self.request_processor[idx].get_request_property(key)

    def get_all_request_header(self, idx: int) -> dict[str, Any]:
        """All headers of batch entry ``idx``."""
        return self.request_processor[idx].get_request_properties()

    def set_response_content_type(self, idx: int, value: str) -> None:
        """Set the content type of batch entry ``idx``'s response."""
        self.set_response_header(idx, "Content-Type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        """The content type set for batch entry ``idx``."""
        return self.get_response_headers(idx).get("Content-Type")

    def get_response_status(self, idx: int) -> tuple[int, str | None]:
        """``(code, phrase)``: the HTTP status set for batch entry ``idx`` and its phrase, as
        TorchServe's ``Context.get_response_status`` returns them (``(200, None)`` unless the
        handler set one)."""
        processor = self.request_processor[idx]
        return processor.get_response_status_code(), processor.get_response_status_phrase()

    def get_response_status_phrase(self, idx: int) -> str | None:
        """The phrase set with batch entry ``idx``'s status (``None``: none set)."""
        return self.request_processor[idx].get_response_status_phrase()

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        """Set an HTTP status for batch entry ``idx``.

        A status >= 400 turns that request into an error: its gRPC code comes from TorchServe
        0.12's table (``errors.grpc_code_for_http``), the HTTP API answers ``code`` itself, and
        ``phrase`` becomes the message.
        """
        if idx < len(self.request_processor):
            self.request_processor[idx].report_status(code, phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        """Set the same HTTP status for every request of the batch."""
        for processor in self.request_processor:
            processor.report_status(code, phrase)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        """All response headers set for batch entry ``idx``."""
        return self.request_processor[idx].get_response_headers()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        """Set one response header for batch entry ``idx``."""
        self.request_processor[idx].add_response_property(key, value)

    def get_sequence_id(self, idx: int) -> str | None:
        """The sequence id of batch entry ``idx`` (StreamPredictions2, or the request's
        ``header_key_sequence_id`` header as TorchServe reads it), else ``None``."""
        seq = self._sequence_ids.get(idx)
        if seq is None and idx < len(self.request_processor):
            header = self.request_processor[idx].get_request_property(self.header_key_sequence_id)
            seq = header if isinstance(header, str) else None  # not an input's {"content-type": ...}
        return seq

    # --- added by inference-service ----------------------------------------------
    def is_cancelled(self, idx: int = 0) -> bool:
        """Whether the client of batch entry ``idx`` cancelled or its deadline passed.

        Long-running handlers may poll this between steps and stop early.
        """
        request_id = self.request_ids.get(idx)
        if request_id is None or self._channel is None:
            return False
        return self._channel.is_cancelled(request_id)

    # --- for the worker's modes ---------------------------------------------------
    def bind_channel(self, channel: Channel) -> None:
        """Route intermediate responses and cancel checks through ``channel`` (the worker's socket end)."""
        self._channel = channel

    def begin_batch(
        self,
        request_ids: list[str],
        headers: list[dict[str, Any]],
        sequence_ids: list[str | None],
    ) -> None:
        """Reset the per-batch state before a handler call: ``request_ids[i]``, ``headers[i]`` and
        ``sequence_ids[i]`` (``None``: no sequence) belong to batch entry ``i``."""
        self.request_ids = dict(enumerate(request_ids))
        self.request_processor = [RequestProcessor(h) for h in headers]
        self._sequence_ids = {i: s for i, s in enumerate(sequence_ids) if s is not None}
        # metric lines name the id the access line names: the request's x-request-id
        client_ids = [h.get("x-request-id") for h in headers]
        self._metrics.request_ids = {i: client if isinstance(client, str) and client else request_ids[i]
                                     for i, client in enumerate(client_ids)}

    def __repr__(self) -> str:
        return f"Context(model_name={self.model_name!r}, model_dir={self.system_properties['model_dir']!r})"

