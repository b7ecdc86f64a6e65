"""Frontend side of one worker process: spawn, load, run batches, route responses, stop.

One routing task per worker reads the IPC socket and hands every response to
its job's mailbox by request id; nothing else reads the socket. It also hands
the handler metrics a worker forwards (``METRIC`` frames) to
:attr:`WorkerProcess.metrics_sink`.
"""

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
from typing import Any, ClassVar

import grpc

from inference_service.errors import (
    DeadlineExceeded,
    InferenceError,
    Unavailable,
    WorkerLoadError,
    error_for_code,
)
from inference_service.jobs import CHUNK, FINAL, Job
from inference_service.worker import protocol

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}


class WorkerDied(Exception):
    """The worker process exited while it held requests."""


class WorkerProcess:
    """One worker OS process serving one model version.

    Args:
        spec: what the worker loads (sent as its ``INIT`` frame).
        env: environment of the process (thread counts, ``CUDA_VISIBLE_DEVICES``...).
        log_name: logger name for the worker's stdout/stderr lines.

    Server-wide settings (class attributes, set once by the server at start):
        metrics_sink: called with ``(spec, METRIC frame body)`` for the handler metrics a
            worker forwards; ``None`` (the default) makes workers log them instead.
        log_level: the workers' logging level name.
    """

    metrics_sink: ClassVar[Callable[[protocol.WorkerSpec, bytes], None] | None] = None
    log_level: ClassVar[str] = "INFO"

    def __init__(self, spec: protocol.WorkerSpec, env: dict[str, str], log_name: str) -> None:
        self.spec = spec
        spec.forward_metrics = WorkerProcess.metrics_sink is not None
        spec.log_level = WorkerProcess.log_level
        self.env = env
        self.pid: int | None = None
        self.start_time = time.time()
        self.proc: asyncio.subprocess.Process | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._ready_count = 0
        self._closed = False
        self.dead = asyncio.Event()
        self._jobs: dict[str, Job] = {}
        self._ready: asyncio.Future[str | None] | None = None
        self._batch_done: asyncio.Future[None] | None = None
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._log = logging.getLogger(log_name)
        self.exit_code: int | None = None
        self.on_exit: Callable[[WorkerProcess], None] | None = None

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.proc is not None and self.proc.returncode is None

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
            raise WorkerLoadError(
                f"worker of model {self.spec.model_name} did not load within startup_timeout="
                f"{startup_timeout:g}s"
            ) from None
        if error is not None:
            await self.kill()
            raise WorkerLoadError(f"model {self.spec.model_name} failed to load: {error}")

    def _watch_output(self) -> None:
        assert self.proc is not None
        self._tasks += [
            asyncio.create_task(self._relay(self.proc.stdout, logging.INFO)),
            asyncio.create_task(self._relay(self.proc.stderr, logging.INFO)),
        ]

    def _attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        self._tasks.append(asyncio.create_task(self._route(reader), name=f"route-{self.spec.worker_id}"))
        writer.write(self.spec.to_frame())

    async def _spawn_single(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference_service.worker.main", "--fd", str(child.fileno()),
                pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env)
        finally:
            child.close()
        self.pid = self.proc.pid
        self.start_time = time.time()
        self._watch_output()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        self._attach(reader, writer)

    async def _spawn_group(self, startup_timeout: float) -> None:
        """torchrun group: every rank connects to a private Unix socket of this worker."""
        world = self.spec.world_size
        directory = tempfile.mkdtemp(prefix="inference-service-")  # mode 0700
        path = os.path.join(directory, "group.sock")
        connected = asyncio.Event()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._attach(reader, writer)
            if len(self._writers) == world:
                connected.set()

        listener = await asyncio.start_unix_server(on_connect, path=path, limit=1 << 20)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference_service.worker.launch", "--nproc-per-node", str(world),
                "--connect", path, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env, start_new_session=True)
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
                    f"only {len(self._writers)} of {world} ranks connected (launcher "
                    f"{'exited' if exited in done else 'timed out'})")
        finally:
            listener.close()
            shutil.rmtree(directory, ignore_errors=True)

    async def _relay(self, stream: asyncio.StreamReader | None, level: int) -> None:
        """Log each line of the worker's stdout/stderr as ``[<model> worker-<id> pid <pid>] <line>``.

        Blank lines are skipped. A line the worker's logging wrote (``LEVEL logger: message``) keeps its level;
        traceback lines keep the level of the line they follow; any other line
        (``print`` output) gets ``level``. The record carries ``model``,
        ``model_version``, ``worker_id`` and ``worker_pid`` for the JSON log format.
        """
        if stream is None:
            return
        spec = self.spec
        prefix = f"[{spec.model_name} worker-{spec.worker_id} pid {self.pid}]"
        extra = {"model": spec.model_name, "model_version": spec.model_version, "worker_id": spec.worker_id,
                 "worker_pid": self.pid}
        current, in_traceback = level, False
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip()
            if not text:
                continue
            head = text.split(" ", 1)[0]
            if head in _LEVELS:
                current, in_traceback = _LEVELS[head], False
            elif text.startswith("Traceback ("):
                in_traceback = True
            elif text[:1].isspace():
                pass
            elif in_traceback:  # the exception line ends a traceback
                in_traceback = False
            else:
                current = level
            self._log.log(current, "%s %s", prefix, text, extra=extra)

    async def _route(self, reader: asyncio.StreamReader) -> None:
        """The single reader of one rank's socket: route each frame to its job or future.

        Only rank 0 answers clients; the other ranks' responses are dropped.
        """
        jobs = self._jobs
        header = protocol.HEADER
        answers = self.spec.world_size == 1
        try:
            while True:
                head = await reader.readexactly(header.size)
                length, kind = header.unpack(head)
                body = await reader.readexactly(length - 1) if length > 1 else b""
                if kind == protocol.READY:
                    info = json.loads(body)
                    if int(info.get("rank", 0)) == 0:
                        answers = True
                        self.pid = int(info.get("pid", self.pid))
                    self._ready_count += 1
                    if self._ready_count == self.spec.world_size and self._ready is not None \
                            and not self._ready.done():
                        self._ready.set_result(None)
                    continue
                if kind == protocol.LOAD_FAILED:
                    if self._ready is not None and not self._ready.done():
                        self._ready.set_result(body.decode("utf-8", "replace"))
                    continue
                if not answers:
                    continue
                self._progress.set()
                if kind == protocol.CHUNK or kind == protocol.FINAL:
                    rid, payload = protocol.decode_response(body)
                    job = jobs.get(rid)
                    if job is None or job.cancelled:
                        continue
                    item = (CHUNK, payload)
                    if kind == protocol.FINAL:
                        job.finished = True
                        del jobs[rid]
                        item = (FINAL, payload)
                    if job.mailbox.full():  # the client lags: back-pressure the worker
                        await job.mailbox.put(item)
                    else:
                        job.mailbox.put_nowait(item)
                elif kind == protocol.ERROR:
                    rid, code, message = protocol.decode_error(body)
                    job = jobs.pop(rid, None)
                    if job is not None:
                        job.fail(error_for_code(_CODES.get(code, grpc.StatusCode.INTERNAL), message))
                elif kind == protocol.DONE:
                    if self._batch_done is not None and not self._batch_done.done():
                        self._batch_done.set_result(None)
                elif kind == protocol.METRIC:
                    sink = WorkerProcess.metrics_sink
                    if sink is not None:
                        try:
                            sink(self.spec, body)
                        except Exception:  # noqa: BLE001 - a bad metric must not stop the routing
                            log.exception("model %s: cannot export handler metrics", self.spec.model_name)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            await self._on_channel_closed()

    async def _on_channel_closed(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.dead.set()
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
        self._fail_all(error)
        if self._batch_done is not None and not self._batch_done.done():
            self._batch_done.set_exception(WorkerDied(error.message))
        if self.on_exit is not None:
            self.on_exit(self)

    def _fail_all(self, error: InferenceError) -> None:
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.fail(error)

    async def run_batch(self, jobs: list[Job], response_timeout: float) -> None:
        """Send ``jobs`` to the worker and wait until it has answered them all.

        Each job's responses reach its mailbox as they arrive. The
        ``response_timeout`` clock restarts at every response, so a stream
        that makes progress is never cut.

        Raises:
            WorkerDied: the process died (its jobs already failed with UNAVAILABLE).
            DeadlineExceeded: no response for ``response_timeout`` seconds
                (the jobs failed with DEADLINE_EXCEEDED and the worker is killed).
        """
        if self._closed:
            raise WorkerDied(f"worker {self.spec.worker_id} of model {self.spec.model_name} is gone")
        loop = asyncio.get_running_loop()
        done = self._batch_done = loop.create_future()
        requests = []
        now = time.monotonic()
        for job in jobs:
            job.worker = self
            job.dispatched = now
            self._jobs[job.request_id] = job
            requests.append(protocol.Request(job.request_id, job.inputs, job.headers, job.sequence_id))
        self._send(protocol.encode_batch(requests))
        for job in jobs:
            if job.cancelled:
                self.cancel(job.request_id)
        while not done.done():
            self._progress.clear()
            progress = asyncio.ensure_future(self._progress.wait())
            finished, _ = await asyncio.wait({done, progress}, timeout=response_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            progress.cancel()
            if not finished:
                error = DeadlineExceeded(
                    f"model {self.spec.model_name} gave no response within response_timeout="
                    f"{response_timeout:g}s; its worker was replaced", reason="RESPONSE_TIMEOUT")
                self._fail_all(error)
                await self.kill()
                raise error
        done.result()

    def _send(self, data: bytes) -> None:
        """Write a frame to every rank (all ranks see every request)."""
        for writer in self._writers:
            if not writer.is_closing():
                writer.write(data)

    def cancel(self, request_id: str) -> None:
        """Tell the worker that the client of ``request_id`` went away."""
        if request_id in self._jobs:
            self._send(protocol.frame(protocol.CANCEL, request_id.encode()))

    async def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to exit; its exit code or ``None``."""
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            self.exit_code = await asyncio.wait_for(self.proc.wait(), timeout)
        return self.proc.returncode

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit (``STOP``), killing it after ``timeout`` seconds."""
        self._send(protocol.frame(protocol.STOP))
        for writer in self._writers:
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        if await self.wait_exit(timeout) is None:
            await self.kill()
        await self._close()

    async def kill(self) -> None:
        """SIGKILL the process and wait for it."""
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                if self.spec.world_size > 1:  # the launcher leads its own process group
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.send_signal(signal.SIGKILL)
            await self.wait_exit(5.0)
        await self._close()

    async def _close(self) -> None:
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            if task is not asyncio.current_task():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 2.0)

    def memory_usage(self) -> int:
        """Resident memory of the process in bytes (0 if it is gone)."""
        if not self.alive or self.pid is None:
            return 0
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0
