"""Event-loop lag: how late the frontend's event loop runs what is due, and who held it.

A heartbeat every ``interval_s`` (50 ms) records its lateness in
``inference_service_event_loop_lag_seconds``; a watchdog thread names the HTTP route or gRPC
method holding the loop, and one warning a stall past ``warn_s`` (100 ms) says how long and who
held it, at most one a ``quiet_s`` (60 s; the stalls in between are counted in the next). A stall
still going on after ``long_s`` (5 s) is warned about while it lasts. Install
:meth:`LoopLagMonitor.middleware` first, then :meth:`LoopLagMonitor.start` in the running loop.
See docs/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("inference_service.loop_lag")

METRIC = "inference_service_event_loop_lag_seconds"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The holder of a stall in which no request's task ran on the loop.
NO_REQUEST = ("no request: the process waited for a CPU, another thread held the interpreter, or a "
              "callback outside any request ran")


class LoopLagMonitor:
    """Measures the running loop's lag and names who holds it; ``registry`` ``None``: logged only.
    Periods in seconds."""

    def __init__(self, registry: CollectorRegistry | None, interval_s: float = 0.05, warn_s: float = 0.1,
                 quiet_s: float = 60.0, long_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.quiet_s = quiet_s
        self.long_s = long_s
        self._warned_at = -float("inf")  # time.monotonic() of the last warning
        self._unwarned = 0  # stalls past warn_s since it
        self._unwarned_longest = 0.0
        self.histogram = Histogram(METRIC, "How late the frontend's event loop ran a callback due at a "
                                   "given time (s): the time every request waits behind the one holding it",
                                   registry=registry, buckets=BUCKETS) if registry is not None else None
        self._routes: weakref.WeakKeyDictionary[asyncio.Task[object], str] = weakref.WeakKeyDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # loop.time() the next heartbeat is due
        self._beat = 0.0  # time.monotonic() of the last heartbeat
        self._holder: str | None = None  # what the watchdog saw holding the loop during this stall
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the heartbeat on the running loop and the watchdog thread."""
        self._loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        self._schedule()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="loop-lag-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and the watchdog (waits for its thread, at most one period)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def name_current_task(self, route: str) -> None:
        """Name the running task's request ``route`` in warnings about the loop (until it ends)."""
        task = asyncio.current_task()
        if task is not None:
            self._routes[task] = route

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """aiohttp middleware naming the request's route (``POST /predictions/{model_name}``)."""
        resource = request.match_info.route.resource
        task = asyncio.current_task()
        if task is None:
            return await handler(request)
        self._routes[task] = f"{request.method} {resource.canonical if resource is not None else request.path}"
        try:
            return await handler(request)
        finally:
            self._routes.pop(task, None)

    # ---------------------------------------------------------------- heartbeat (loop thread)
    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._heartbeat)

    def _heartbeat(self) -> None:
        assert self._loop is not None
        lag = max(0.0, self._loop.time() - self._due)
        if self.histogram is not None:
            self.histogram.observe(lag)
        if lag > self.warn_s:
            self._stalled(lag)
        self._holder = None
        self._beat = time.monotonic()
        self._schedule()

    def _stalled(self, lag: float) -> None:
        """One stall past ``warn_s`` ended: warn, or count it until ``quiet_s`` has passed."""
        now = time.monotonic()
        if now - self._warned_at < self.quiet_s:
            self._unwarned += 1
            self._unwarned_longest = max(self._unwarned_longest, lag)
            return
        holder = self._holder or NO_REQUEST
        since = (f"; {self._unwarned} more since the last warning, the longest {self._unwarned_longest * 1000:.0f} ms"
                 if self._unwarned else "")
        log.warning("the event loop ran %.0f ms late, held by %s%s", lag * 1000, holder, since)
        self._warned_at, self._unwarned, self._unwarned_longest = now, 0, 0.0

    # ---------------------------------------------------------------- watchdog (its own thread)
    def _watch(self) -> None:
        period = self.interval_s / 2
        reported = 0.0  # the heartbeat time of the stall already reported
        while not self._stop.wait(period):
            beat = self._beat
            held = time.monotonic() - beat - self.interval_s
            if held <= self.warn_s:
                continue
            if self._holder is None or self._holder.startswith(NO_REQUEST):  # until a request is seen holding it
                self._holder = self._holding()
            if held > self.long_s and beat != reported:
                reported = beat
                log.warning("the event loop has been held %.0f ms so far by %s", held * 1000, self._holder)

    def _holding(self) -> str:
        """The request whose task runs on the loop now (:data:`NO_REQUEST` when none does)."""
        loop = self._loop
        if loop is None:
            return NO_REQUEST
        try:
            task = asyncio.current_task(loop)
        except RuntimeError:
            task = None
        if task is None:
            try:  # read from this thread while the loop may change it
                in_flight = sorted(set(self._routes.values()))[:3]
            except RuntimeError:
                in_flight = []
            return f"{NO_REQUEST} (in flight: {', '.join(in_flight)})" if in_flight else NO_REQUEST
        route = self._routes.get(task)
        if route is not None:
            return route
        name = task.get_name()
        if name.startswith("HandleExceptions[") and name.endswith("]"):
            return f"gRPC {name[len('HandleExceptions['):-1]}"  # grpc.aio names an RPC's task after its method
        return f"task {name}"
