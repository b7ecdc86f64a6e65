"""A request's service level, read from its headers on every door (HTTP headers, gRPC metadata):

- ``x-request-timeout``: seconds the client will wait (the gRPC deadline wins where one is set).
  A request still queued when it passes leaves the queue with DEADLINE_EXCEEDED (HTTP 504) before
  any work; a running one is stopped in its worker (an LLM's engine request is aborted).
- ``x-request-priority``: an integer, lower first, as vLLM's ``priority`` (default 0): the job
  queue orders waiting requests by priority, then arrival. The OpenAI door also takes the body
  field ``priority``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from inference_service.errors import InvalidArgument

TIMEOUT_HEADER = "x-request-timeout"
PRIORITY_HEADER = "x-request-priority"
#: The largest timeout taken (a week, in seconds) and the priority range (vLLM takes any integer).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_LENGTHS = frozenset((len(TIMEOUT_HEADER), len(PRIORITY_HEADER)))


def header_values(headers: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """The headers named (lower case) in ``names`` that ``headers`` holds, in one pass (a client may
    send any case)."""
    found = {}
    for key, value in headers.items():
        if len(key) in _LENGTHS and (low := key.lower()) in names:
            found[low] = value
    return found


def request_controls(headers: Mapping[str, str]) -> tuple[float | None, int]:
    """``(timeout in seconds or None, priority)`` of a request's headers.

    Raises:
        InvalidArgument: a timeout that is not a positive number of seconds up to a week
            (BAD_REQUEST_TIMEOUT), a priority that is not an integer (BAD_PRIORITY).
    """
    timeout = None
    values = header_values(headers, (TIMEOUT_HEADER, PRIORITY_HEADER))
    raw = values.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            timeout = math.nan
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidArgument(f"{TIMEOUT_HEADER} must be a number of seconds above 0 and at most "
                                  f"{MAX_TIMEOUT_S:g}, got {raw[:40]!r}", reason="BAD_REQUEST_TIMEOUT")
    priority = 0
    raw = values.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            priority = int(raw)
        except ValueError:
            priority = PRIORITY_RANGE[1] + 1
        if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            raise InvalidArgument(f"{PRIORITY_HEADER} must be an integer (lower first), got {raw[:40]!r}",
                                  reason="BAD_PRIORITY")
    return timeout, priority
