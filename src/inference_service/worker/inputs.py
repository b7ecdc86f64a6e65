"""A request's input map and headers as its handler gets them, by TorchServe 0.12's backend rules
(``ts/protocol/otf_message_handler.py`` ``_retrieve_input_data``, ``ts/service.py``
``retrieve_data_for_inference``).

With ``decode_input_request`` on (the default), an input whose content type is exactly
``application/json`` arrives as its decoded JSON value and one whose content type starts with
``text`` as a ``str`` (UTF-8); any other input, and one that does not decode (a warning is
logged), arrives as a ``bytearray``. Every input's name is also a request header whose value is
``{"content-type": <its content type, "" for none>}``; the request's own headers win a clash.
Which inputs carry a content type is the frontend's part of the rule (docs/apis.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from inference_service.contracts.wire import Received

log = logging.getLogger("inference_service.worker")

JSON = "application/json"


def _decoded(log_id: str, name: str, value: bytearray, content_type: str) -> Any:
    """``value`` decoded by its content type, or itself when it does not decode."""
    if content_type == JSON:
        try:
            return json.loads(value.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            log.warning("request %s: input %r (%s) is not valid JSON (%s); the handler gets its bytes",
                        log_id, name, content_type, why)
            return value
    if content_type.startswith("text"):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            log.warning("request %s: input %r (%s) is not valid UTF-8; the handler gets its bytes",
                        log_id, name, content_type)
            return value
    return value


def handler_request(request: Received, decode: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(headers, input map)`` of ``request`` for its handler; ``decode``: ``decode_input_request``."""
    content_types = request.content_types
    log_id = request.headers.get("x-request-id") or request.request_id  # the id of its access line
    headers: dict[str, Any] = {}
    inputs: dict[str, Any] = {}
    for name, value in request.inputs.items():
        content_type = content_types.get(name, "")
        headers[name] = {"content-type": content_type}
        inputs[name] = _decoded(log_id, name, value, content_type) if decode and content_type else value
    headers.update(request.headers)
    return headers, inputs
