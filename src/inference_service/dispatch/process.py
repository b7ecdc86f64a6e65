"""Frontend side of one worker process: spawn, load, run requests, route responses, stop.

One routing callback per worker connection (:class:`FrameChannel`, an asyncio protocol: no task, no
await) parses the IPC frames as they arrive and hands every response (and the headers a handler set)
to its job by request id. When the worker has room for more requests, :attr:`WorkerProcess.on_free`
runs right there; handler metrics (``METRIC`` frames) go to :attr:`WorkerProcess.metrics_sink`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc

from inference_service.contracts import wire
from inference_service.dispatch.ipc import FrameChannel, relay_output
from inference_service.dispatch.jobs import Job, Kind, overdue
from inference_service.dispatch.spawn import ChildProcess, spawn
from inference_service.dispatch.worker_options import WorkerOptions
from inference_service.errors import (
    DeadlineExceeded,
    InferenceError,
    Unavailable,
    WorkerLoadError,
    error_for_code,
)

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerProcess:
    """One worker OS process serving one model version.

    Args:
        spec: what the worker loads (sent as its ``INIT`` frame).
        env: environment of the process (thread counts, ``CUDA_VISIBLE_DEVICES``...).
        log_name: logger name for the worker's stdout/stderr lines.
        options: the server-wide worker settings (log level, handler metrics sink).
        python: the interpreter that runs it (an engine's own environment; default: the server's).

    In ``batch`` mode (:attr:`wire.WorkerSpec.mode`) the worker takes one batch at a time; in
    ``continuous`` and ``async`` mode up to ``spec.max_running`` requests, each freeing its place
    when it ends (:attr:`room`).
    """

    def __init__(self, spec: wire.WorkerSpec, env: dict[str, str], log_name: str,
                 options: WorkerOptions = WorkerOptions(), python: str = sys.executable) -> None:
        self.spec = spec
        self.python = python
        # killed as a group: a torchrun launcher's ranks, or the processes an engine of another Python
        # starts (vLLM's engine core on a GPU), go with it
        self._own_group = spec.world_size > 1 or python != sys.executable
        self.metrics_sink = options.metrics_sink
        spec.forward_metrics = options.forward_handler_metrics  # prometheus mode: never logged (no sink: dropped)
        spec.log_level = options.log_level
        spec.envelope = options.service_envelope
        spec.decode_input_request = options.decode_input_request
        spec.max_response_size = options.max_response_size
        self.concurrent = spec.mode != wire.MODE_BATCH
        # async handlers call send_intermediate_predict_response from the event loop, which must not block
        spec.stream_window = 0 if spec.mode == wire.MODE_ASYNC else wire.STREAM_WINDOW
        self.env = env
        self.pid: int | None = None
        #: the handler takes the typed LLM request (its READY says so): the OpenAI door lists it
        self.accepts_generation = False
        self.start_time = time.time()
        self.proc: ChildProcess | None = None
        self._channels: list[FrameChannel] = []
        self._connected: asyncio.Event | None = None  # torchrun group: every rank connected
        self._ready_count = 0
        self._closed = False
        self._jobs: dict[str, Job] = {}
        self._ready: asyncio.Future[str | None] | None = None
        self.on_free: Callable[[WorkerProcess], None] | None = None  # called when the worker has room again
        self._last_progress = 0.0  # time.monotonic() of the last frame of the running batch
        self._preempted: set[str] = set()  # continuous: requests that gave their place back (PREEMPTED)
        self._response_timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._batch_running = False
        self.failure: str | None = None  # why the process is being replaced
        self.died_busy = self.timed_out = False  # timed_out: killed for response_timeout
        self._tasks: list[asyncio.Task[Any]] = []
        self._log = logging.getLogger(log_name)
        self.exit_code: int | None = None
        self.on_exit: Callable[[WorkerProcess], None] | None = None
        self.uses_threads: bool | None = None  # READY: its handler loaded a library with a thread pool
        self.engine_info: wire.EngineInfo | None = None  # READY: what an LLM handler's engine serves with

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.proc is not None and self.proc.returncode is None

    @property
    def busy(self) -> bool:
        """Whether the worker has requests in hand."""
        return bool(self._jobs) if self.concurrent else self._batch_running

    def runs(self, unit: str) -> bool:
        """Whether a request of ``unit`` (:attr:`Job.unit`) is in hand (at most ``max_running``)."""
        return any(job.unit == unit for job in self._jobs.values() if not job.cancelled)

    @property
    def room(self) -> int:
        """How many more requests (``continuous``/``async``) or batches (``batch``) it takes now."""
        if self._closed:
            return 0
        if self.concurrent:
            preempted = self._preempted
            if preempted:
                preempted.intersection_update(self._jobs)
            return max(0, self.spec.max_running - len(self._jobs) + len(preempted))
        return 0 if self._batch_running else 1

    async def start(self, startup_timeout: float) -> None:
        """Spawn the process (or torchrun group) and wait until its handler is loaded.

        Raises:
            WorkerLoadError: the handler failed to load (with its message), the
                process exited, or ``startup_timeout`` seconds passed.
        """
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        if self.spec.world_size > 1:
            await self._spawn_group(startup_timeout)
        else:
            await self._spawn_single()
        try:
            error = await asyncio.wait_for(asyncio.shield(self._ready), startup_timeout)
        except TimeoutError:
            await self.kill()
            raise WorkerLoadError(f"worker of model {self.spec.model_name} did not load within "
                                  f"startup_timeout={startup_timeout:g}s") from None
        if error is not None:
            await self.kill()
            raise WorkerLoadError(f"model {self.spec.model_name} failed to load: {error}")

    def _watch_output(self) -> None:
        assert self.proc is not None
        self._tasks += [
            asyncio.create_task(self._relay(self.proc.stdout, logging.INFO)),
            asyncio.create_task(self._relay(self.proc.stderr, logging.INFO)),
        ]

    def attach_channel(self, channel: FrameChannel) -> None:
        self._channels.append(channel)
        channel.write(self.spec.to_frame())
        if self._connected is not None and len(self._channels) >= self.spec.world_size:
            self._connected.set()

    async def _spawn_single(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = await spawn(
                [self.python, "-m", "inference_service.worker.main", "--fd", str(child.fileno())],
                self.env, pass_fds=(child.fileno(),), start_new_session=self._own_group)
        finally:
            child.close()
        self.pid = self.proc.pid
        self.start_time = time.time()
        self._watch_output()
        await asyncio.get_running_loop().create_unix_connection(lambda: FrameChannel(self), sock=parent)

    async def _spawn_group(self, startup_timeout: float) -> None:
        """torchrun group: every rank connects to a private Unix socket of this worker."""
        world = self.spec.world_size
        directory = tempfile.mkdtemp(prefix="inference-service-")  # mode 0700
        path = os.path.join(directory, "group.sock")
        connected = self._connected = asyncio.Event()
        listener = await asyncio.get_running_loop().create_unix_server(lambda: FrameChannel(self), path=path)
        try:
            self.proc = await spawn(
                [self.python, "-m", "inference_service.worker.launch", "--nproc-per-node", str(world),
                 "--connect", path], self.env, start_new_session=True)
            self.pid = self.proc.pid
            self.start_time = time.time()
            self._watch_output()
            exited = asyncio.create_task(self.proc.wait())
            waiter = asyncio.create_task(connected.wait())
            done, _ = await asyncio.wait({exited, waiter}, timeout=startup_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            exited.cancel()
            if waiter not in done and self._ready is not None and not self._ready.done():
                self._ready.set_result(
                    f"only {len(self._channels)} of {world} ranks connected (launcher "
                    f"{'exited' if exited in done else 'timed out'})")
        finally:
            listener.close()
            shutil.rmtree(directory, ignore_errors=True)

    async def _relay(self, stream: asyncio.StreamReader | None, level: int) -> None:
        """Relay the worker's stdout/stderr lines as ``[<model> worker-<id> pid <pid>] <line>``
        (:func:`~inference_service.dispatch.ipc.relay_output`)."""
        spec = self.spec
        await relay_output(stream, level, self._log, f"[{spec.model_name} worker-{spec.worker_id} pid {self.pid}]",
                           {"model": spec.model_name, "model_version": spec.model_version,
                            "worker_id": spec.worker_id, "worker_pid": self.pid})

    def on_frame(self, channel: FrameChannel, kind: int, body: bytes) -> None:
        """Route one frame of ``channel``: a response to its job, a batch end to :attr:`on_free`."""
        if kind == wire.CHUNK or kind == wire.FINAL:
            if not channel.answers:
                return
            self._last_progress = time.monotonic()
            rid, payload = wire.decode_response(body)
            job = self._jobs.get(rid)
            if job is None or job.cancelled:
                if job is not None and kind == wire.FINAL:
                    del self._jobs[rid]
                    self._request_ended()
                return
            if kind == wire.FINAL:
                job.finished = True
                del self._jobs[rid]
                ok = job.mailbox.put((Kind.FINAL, payload))
                self._request_ended()
            else:
                ok = job.mailbox.put((Kind.CHUNK, payload))
            if not ok:  # the client lags: back-pressure the worker
                channel.pause()
                job.mailbox.on_space = channel.resume
        elif kind == wire.DONE:
            if channel.answers:
                self._batch_finished()
        elif kind == wire.ERROR:
            if not channel.answers:
                return
            self._last_progress = time.monotonic()
            rid, code, message, http_status = wire.decode_error(body)
            job = self._jobs.pop(rid, None)
            if job is not None:
                job.fail(error_for_code(_CODES.get(code, grpc.StatusCode.INTERNAL), message, http_status or None))
                self._request_ended()
        elif kind == wire.HEADERS:
            rid, headers = wire.decode_headers(body)
            if channel.answers and (job := self._jobs.get(rid)) is not None:
                job.response_headers.update(headers)
        elif kind == wire.PREEMPTED or kind == wire.RESUMED:
            if not channel.answers:
                return
            rid = body.decode()
            if kind == wire.RESUMED:
                self._preempted.discard(rid)
            elif rid in self._jobs and rid not in self._preempted:  # (a yield's place was counted at once)
                self._preempted.add(rid)
                self._request_ended()  # its place is free: the dispatcher may send another request
        elif kind == wire.METRIC and (sink := self.metrics_sink) is not None and channel.answers:
            try:
                sink(self.spec.model_name, self.spec.model_version, wire.decode_metrics(body))
            except Exception:  # noqa: BLE001 - a bad metric must not stop the routing
                log.exception("model %s: cannot export handler metrics", self.spec.model_name)
        elif kind == wire.READY:
            info = json.loads(body)
            if int(info.get("rank", 0)) == 0:
                channel.answers = True
                self.pid = int(info.get("pid", self.pid))
                self.accepts_generation = info.get("generation") is True
                self.uses_threads = bool(info.get("threads", True))
                self.engine_info = wire.EngineInfo.from_json(info.get("engine"))
            self._ready_count += 1
            if self._ready_count == self.spec.world_size and self._ready is not None \
                    and not self._ready.done():
                self._ready.set_result(None)
        elif kind == wire.LOAD_FAILED:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(body.decode("utf-8", "replace"))

    def on_channel_closed(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._channel_closed()))

    async def _channel_closed(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.spec.world_size > 1:
            await self.kill()  # one rank gone takes the group down
        code = await self.wait_exit(2.0)
        reason = f"exit code {code}" if code is not None and code >= 0 else (
            f"killed by signal {-code}" if code is not None else "channel closed")
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(f"worker process exited during load ({reason})")
        error = Unavailable(
            f"worker {self.spec.worker_id} of model {self.spec.model_name} died ({reason}); "
            "it is being restarted", reason="WORKER_DIED")
        self.died_busy = self.busy
        if self.failure is None:
            self.failure = error.message
        self._stop_clock()
        self._fail_all(error)
        if self.on_exit is not None:
            self.on_exit(self)

    def _fail_all(self, error: InferenceError) -> None:
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.fail(error)

    def send_batch(self, jobs: list[Job], response_timeout: float) -> bool:
        """Send ``jobs`` to the worker (never blocks): one batch, or in ``continuous``/``async`` mode
        requests that join those it runs (at most :attr:`room`); False (nothing sent) when the
        process is gone. Responses reach each job's mailbox as they arrive; :attr:`on_free` runs when
        the worker has room again. No response for ``response_timeout`` s while the worker has
        requests (the clock restarts at every response): its jobs fail with DEADLINE_EXCEEDED and
        the process is killed; if it dies, with UNAVAILABLE. ValueError, struct.error: a request does
        not fit the IPC framing (nothing sent)."""
        if self._closed:
            return False
        frame = wire.encode_batch(
            [wire.Request(job.request_id, job.inputs, job.headers, job.sequence_id, job.content_types)
             for job in jobs])
        now = time.monotonic()
        jobs_by_id = self._jobs
        for job in jobs:  # registered only once the frame exists: an encoding error leaves no trace
            job.worker = self
            job.dispatched = now
            jobs_by_id[job.request_id] = job
        self._send(frame)
        if not self.concurrent:
            self._batch_running = True
        self._last_progress = now
        self._response_timeout = response_timeout
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(response_timeout, self._check_timeout)
        return True

    def _request_ended(self) -> None:
        """A request of a ``continuous``/``async`` worker ended: its place is free."""
        if self.concurrent and self.on_free is not None:
            self.on_free(self)

    def _batch_finished(self) -> None:
        self._batch_running = False
        if self.on_free is not None:
            self.on_free(self)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _check_timeout(self) -> None:
        """The response_timeout timer: re-armed while responses come, else the worker is replaced; a
        ``continuous``/``async`` worker's request running past it is ended alone (docs/operations.md)."""
        self._timer = None
        if not self.busy or self._closed:
            return
        now = time.monotonic()
        due = self._last_progress + self._response_timeout
        if self.concurrent:
            ended, next_due = overdue(self._jobs.values(), now, self._response_timeout)
            due = min(due, next_due)
            for job in ended:
                job.end(DeadlineExceeded(f"the request ran past model {self.spec.model_name}'s response_timeout="
                                         f"{self._response_timeout:g}s and was ended", reason="RESPONSE_TIMEOUT"))
                self._log.warning("request %s ended: it ran past response_timeout=%gs", job.request_id,
                                  self._response_timeout)
        if now < due:
            self._timer = asyncio.get_running_loop().call_later(due - now, self._check_timeout)
            return
        error = DeadlineExceeded(
            f"model {self.spec.model_name} gave no response within response_timeout="
            f"{self._response_timeout:g}s; its worker was replaced", reason="RESPONSE_TIMEOUT")
        self.failure = error.message
        self.timed_out = True
        self.on_free = None
        self._fail_all(error)
        self._tasks.append(asyncio.ensure_future(self.kill()))

    def _send(self, data: bytes) -> None:
        """Write a frame to every rank (all ranks see every request)."""
        for channel in self._channels:
            channel.write(data)

    def credit(self, request_id: str, count: int) -> None:
        """Let the worker send ``count`` more intermediate responses of ``request_id`` (flow control)."""
        if self.spec.stream_window and request_id in self._jobs:
            self._send(wire.encode_credit(request_id, count))

    def displace(self, priority: int) -> bool:
        """Free a place for a request of ``priority``: the running request of the latest later priority
        (then the latest dispatched) yields its place (YIELD); False when none runs."""
        jobs = [j for j in self._jobs.values() if j.priority > priority and j.request_id not in self._preempted
                and not j.cancelled] if self.concurrent else []
        if not jobs:
            return False
        victim = max(jobs, key=lambda j: (j.priority, j.dispatched)).request_id
        self._preempted.add(victim)  # its place counts as free now: its PREEMPTED then changes nothing
        self._send(wire.frame(wire.YIELD, victim.encode()))
        self._request_ended()
        return True

    def cancel(self, request_id: str) -> None:
        """Tell the worker that the client of ``request_id`` went away."""
        if request_id in self._jobs:
            self._send(wire.frame(wire.CANCEL, request_id.encode()))

    async def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to exit; its exit code or ``None``."""
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            self.exit_code = await asyncio.wait_for(self.proc.wait(), timeout)
        return self.proc.returncode

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit (``STOP``), killing it after ``timeout`` seconds."""
        self._send(wire.frame(wire.STOP))
        if await self.wait_exit(timeout) is None:
            await self.kill()
        await self._close()

    async def kill(self) -> None:
        """SIGKILL the process and wait for it."""
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                # the launcher, or an engine's own Python, leads its own process group
                os.killpg(self.proc.pid, signal.SIGKILL) if self._own_group else self.proc.send_signal(signal.SIGKILL)
            await self.wait_exit(5.0)
        await self._close()

    async def _close(self) -> None:
        self._stop_clock()
        for channel in self._channels:
            if channel.transport is not None:
                channel.transport.close()
        others = {task for task in self._tasks if task is not asyncio.current_task()}
        if others:  # asyncio.wait: the tasks' own errors stay theirs, a cancel of ours propagates
            await asyncio.wait(others, timeout=2.0)

    def memory_usage(self) -> int:
        """Resident memory of the process in bytes (0 if it is gone)."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:  # no pid: OSError
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") if self.alive else 0
        except (OSError, ValueError, IndexError):
            return 0
