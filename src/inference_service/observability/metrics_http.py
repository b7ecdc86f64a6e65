"""The metrics port's HTTP endpoint: ``GET /metrics`` (``/`` too) answers the Prometheus text
exposition, ``?name[]=a&name[]=b`` keeps only those families (TorchServe's metrics API).

Served by a bounded ``http.server`` in a daemon thread, so a scrape never waits for the event
loop. See docs/observability.md.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from inference_service.connection_limits import BoundedThreadingHTTPServer
from inference_service.errors import shorten

if TYPE_CHECKING:
    from inference_service.observability.accesslog import AccessLog

log = logging.getLogger("inference_service.observability.metrics")  # the name scrape errors always had

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what the exposition is written in
Render = Callable[[set[str] | None], bytes]
"""The exposition, limited to the families named (``None``: all)."""


class MetricsEndpoint:
    """``GET /metrics`` on one address, answered by ``render``."""

    def __init__(self, render: Render) -> None:
        self.render = render
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, address: str, port: int, access_log: AccessLog | None = None, cap: int = 1000,
              timeout_s: float | None = None, ssl_context: ssl.SSLContext | None = None) -> int:
        """Serve on ``address:port`` in a daemon thread; returns the bound port. Each request gets
        an ``access_log`` line (``None``: none); at most ``cap`` connections, each given
        ``timeout_s`` per read (``request_head_timeout_sec``); over TLS with ``ssl_context`` (the
        handshake in the connection's own thread, so a slow client holds no other).

        Raises:
            OSError: the address cannot be bound.
        """
        host = address.strip("[]")
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsHTTPServer", (BoundedThreadingHTTPServer,), {"address_family": family, "cap": cap})
        handler = type("MetricsHandler", (_MetricsHandler,),
                       {"render": staticmethod(self.render), "access_log": access_log, "timeout": timeout_s})
        self._httpd = server_class((host, port), handler)
        if ssl_context is not None:
            self._httpd.socket = ssl_context.wrap_socket(self._httpd.socket, server_side=True,
                                                         do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        """Stop serving (blocks up to the server's poll interval)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


class _MetricsHandler(BaseHTTPRequestHandler):
    """``GET /metrics`` (``/`` too): the exposition; anything else 404."""

    render: Render
    access_log: AccessLog | None = None
    server_version = "inference-service-metrics"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        start = time.perf_counter()
        self._status = 500
        try:
            self._answer()
        finally:
            if self.access_log is not None:
                host, port = self.client_address[0], self.client_address[1]
                peer = f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
                self.access_log.record_http("GET", shorten(urlsplit(self.path).path), "", "", self._status, start,
                                            1 if self._status < 400 else 0, peer)

    def send_response(self, code: int, message: str | None = None) -> None:
        """As ``BaseHTTPRequestHandler``'s, keeping the status for the access log."""
        self._status = code
        super().send_response(code, message)

    def _answer(self) -> None:
        url = urlsplit(self.path)
        if url.path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        query = parse_qs(url.query)
        wanted = query.get("name[]") or query.get("name")
        try:
            body = self.render(set(wanted) if wanted else None)
        except Exception:  # noqa: BLE001 - a scrape must answer, the cause goes to the log
            log.exception("metrics scrape failed")
            self.send_error(500, "metrics scrape failed; see the server log")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_allowed(self) -> None:
        """405 with ``Allow: GET`` for any other method (http.server would answer 501)."""
        self.send_response(405)
        body = b"only GET is served here\n"
        self.send_header("Allow", "GET")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("metrics scrape from %s: " + format, self.client_address[0], *args)
