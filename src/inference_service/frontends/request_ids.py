"""One request id per request: in its access line, in the handler's headers, in the answer.

A client's ``x-request-id`` (1 to 128 of ``A-Z a-z 0-9 . _ : / + = @ -``) is kept, else 32 hex
digits are made; echoed as ``X-Request-Id`` / gRPC trailing metadata. A log key only: workers
route by their own ids, so two requests with one client id never mix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextvars import ContextVar

from inference_service.contracts.explain import EXPLAIN_HEADER
from inference_service.dispatch.jobs import new_request_id

REQUEST_ID_HEADER = "x-request-id"
_VALID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
#: Where a route that reads its model from the body (``/v1``) leaves it for the access line.
ACCESS_MODEL = "access_log_model"
#: The id of the gRPC call the current task serves ("" outside one).
current: ContextVar[str] = ContextVar("request_id", default="")


def request_id(client_value: str | None) -> str:
    """The client's id when it is valid, else a new one."""
    if client_value is not None and _VALID.fullmatch(client_value):
        return client_value
    return new_request_id()


def handler_headers(items: Iterable[tuple[str, str]], rid: str) -> dict[str, str]:
    """The request headers a handler gets: ``Authorization`` and ``explain`` (the route's to set) left
    out, ``x-request-id`` = ``rid``."""
    headers = {key: value for key, value in items
               if key.lower() not in ("authorization", REQUEST_ID_HEADER, EXPLAIN_HEADER)}
    headers[REQUEST_ID_HEADER] = rid
    return headers
