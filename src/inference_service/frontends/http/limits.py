"""The HTTP APIs' bounds on form bodies (see :mod:`inference_service.frontends.limits` for the table).

aiohttp parses a ``multipart/*`` body part by part as it arrives; once the body is buffered,
no part waits for the network, so a body of many small parts would be parsed in one go on the
event loop (65,536 empty parts held it for 6.6 s). :class:`PartCounter` refuses a body beyond
``max_request_parts`` parts and hands the loop back every :data:`PARTS_PER_TURN` parts.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from urllib.parse import parse_qsl

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from inference_service.errors import InvalidArgument
from inference_service.frontends.limits import check_parts, off_loop

AIOHTTP_SERVER_LOGGER = "aiohttp.server"
#: Multipart parts parsed per turn of the event loop (about 2 ms of aiohttp's parser).
PARTS_PER_TURN = 16


class PartCounter:
    """Counts the parts of one multipart body against ``max_request_parts``."""

    def __init__(self, max_parts: int) -> None:
        self.max_parts = max_parts
        self.count = 0

    async def next(self) -> None:
        """Count one more part (InvalidArgument past the limit); every :data:`PARTS_PER_TURN`, yield the loop."""
        self.count += 1
        check_parts(self.count, self.max_parts, "a multipart body")
        if self.count % PARTS_PER_TURN == 0:
            await asyncio.sleep(0)


async def form_fields(request: web.Request, max_fields: int) -> dict[str, bytes]:
    """The fields of an ``application/x-www-form-urlencoded`` body as aiohttp's ``request.post()``
    reads them (values UTF-8, the last repeated name wins); counted before parsing, parsed in a
    thread from 64 KiB.

    Raises:
        InvalidArgument: (400) more than ``max_fields`` fields, or an unknown charset.
    """
    body = await request.read()
    check_parts(body.count(b"&") + 1 if body else 0, max_fields, "a form body")
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise InvalidArgument(f"unknown charset {charset!r} of the form body") from None

    def parse() -> dict[str, bytes]:
        text = body.rstrip().decode(charset, "replace")
        return {key: value.encode("utf-8")
                for key, value in parse_qsl(text, keep_blank_values=True, encoding=charset)}

    return await off_loop(parse, size=len(body))


class BadMessageLogFilter(logging.Filter):
    """aiohttp logs a request that breaks HTTP itself (a bad ``Content-Length``, a header line
    beyond its limit...) at ERROR with a traceback, after answering it 400: a client's mistake,
    logged here as one INFO line naming it, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record of a malformed request; keep the rest."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            message = " ".join(str(exc.message).split())[:200]
            record.msg, record.args = "HTTP request refused with %d: %s", (exc.code, message)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info = record.exc_text = None
            return logging.getLogger(AIOHTTP_SERVER_LOGGER).isEnabledFor(logging.INFO)
        return True


def install_log_filter() -> None:
    """Add :class:`BadMessageLogFilter` to aiohttp's server logger (once)."""
    logger = logging.getLogger(AIOHTTP_SERVER_LOGGER)
    if not any(isinstance(f, BadMessageLogFilter) for f in logger.filters):
        logger.addFilter(BadMessageLogFilter())
