"""The access log (one line per RPC or HTTP request) and the server's log formats (plain or JSON).

Access lines go to the logger ``inference_service.access`` at INFO, in one format for every
front door (``-`` for a missing model, version or reason). See docs/observability.md.
"""

from __future__ import annotations

import datetime
import http
import json
import logging
import sys
import time
from typing import Any

import grpc

ACCESS_LOGGER = "inference_service.access"
LOG_FORMATS = ("plain", "json")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LINE = "%s model=%s version=%s status=%s reason=%s latency_ms=%s messages=%d peer=%s request_id=%s"
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
#: Control characters (C0, DEL, C1) and Unicode line/paragraph separators, written escaped.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})
#: Characters of a client's name (model, version, path) an access line keeps at most.
MAX_FIELD = 300


def escape_controls(text: str) -> str:
    """``text`` with control characters written as ``\\n``, ``\\r``, ``\\t``, ``\\xNN``: a
    name holding a newline cannot start a forged log line."""
    return text if text.isprintable() else text.translate(_ESCAPES)


class PlainFormatter(logging.Formatter):
    """``time LEVEL logger: message``, the message's control characters escaped
    (:func:`escape_controls`); a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The record's line with its message escaped."""
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601 with ms), ``level``, ``logger``,
    ``message``, ``exc_info`` (the traceback, when there is one) and every field passed
    with ``extra=``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line (values that are not JSON types are written with ``str``)."""
        data: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(data, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "plain") -> None:
    """Set the root logger's level and its handlers' format, ``"plain"`` or ``"json"`` (a stderr
    handler if it has none). ValueError for an unknown level or format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    # Neither format shows the caller's file/line, thread or process, so records skip
    # collecting them (the logging HOWTO's "Optimization" switches): an access line is
    # written per RPC, on the serving thread.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    formatter = JsonFormatter() if log_format == "json" else PlainFormatter(PLAIN_FORMAT)
    for handler in root.handlers:
        handler.setFormatter(formatter)


class AccessLog:
    """Writes one line per RPC on the ``inference_service.access`` logger, whose level is INFO, so
    ``--log-level WARNING`` does not quiet it (``--no-access-log`` does). ``json_fields``: pass the
    fields as record attributes (the JSON format); plain logs skip building them."""

    def __init__(self, json_fields: bool = False) -> None:
        self.json_fields = json_fields
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self.logger.setLevel(logging.INFO)

    def record(self, method: str, request: Any, peer: str, code: grpc.StatusCode, reason: str,
               start: float, messages: int, request_id: str = "", version: str = "") -> None:
        """Log one RPC (arguments as :meth:`inference_service.observability.metrics.Telemetry.rpc_done`)."""
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        latency_ms = round((time.perf_counter() - start) * 1000.0, 3)
        model = getattr(request, "model_name", "")
        version = version or getattr(request, "model_version", "")
        model = model[:MAX_FIELD] if isinstance(model, str) and model else "-"
        version = version[:MAX_FIELD] if isinstance(version, str) and version else "-"
        self._write(method, model, version, code.name, code.value[0], reason, latency_ms, messages, peer,
                    request_id)

    def record_http(self, method: str, path: str, model: str, version: str, status: int, start: float,
                    messages: int, peer: str, request_id: str = "") -> None:
        """Log one HTTP request: ``path`` as sent without the query, ``start`` a ``time.perf_counter()``,
        ``peer`` in gRPC's form (``ipv4:127.0.0.1:50312``), "" for what is missing."""
        if not self.logger.isEnabledFor(logging.INFO):
            return
        latency_ms = round((time.perf_counter() - start) * 1000.0, 3)
        try:
            reason = http.HTTPStatus(status).name if status >= 400 else ""
        except ValueError:  # a status outside the standard list (a handler's own 499...)
            reason = f"HTTP_{status}"
        self._write(f"{method} {path}", model or "-", version or "-", str(status), status, reason, latency_ms,
                    messages, peer, request_id)

    def _write(self, method: str, model: str, version: str, status: str, code: int, reason: str,
               latency_ms: float, messages: int, peer: str, request_id: str) -> None:
        logger = self.logger
        peer = peer or "-"
        request_id = request_id or "-"
        if self.json_fields:
            extra = {"method": method, "model": model, "version": version, "status": status,
                     "code": code, "reason": reason or "-", "latency_ms": latency_ms,
                     "messages": messages, "peer": peer, "request_id": request_id}
            logger.info(_LINE, method, model, version, status, reason or "-", latency_ms, messages, peer, request_id,
                        extra=extra)
        else:
            logger.info(_LINE, method, model, version, status, reason or "-", latency_ms, messages, peer, request_id)
