"""Worker processes started the same way under any event loop (:func:`spawn`).

``asyncio.create_subprocess_exec`` is the loop's own: under uvloop it is libuv's ``uv_spawn``,
which calls ``fork()``. ``fork()`` runs gRPC's ``pthread_atfork`` handlers, and while the
server's gRPC threads are busy (a model registered at run time, under load) gRPC skips them
("Other threads are currently calling into gRPC, skipping fork() handlers", written to the
server's stderr) and the child starts from a copy of a process in the middle of gRPC calls.
:func:`spawn` starts the child with :class:`subprocess.Popen` instead (CPython's ``vfork``,
which runs no fork handlers), reads its stdout/stderr through the running loop, and learns of
its exit from a pidfd (Linux 5.3+; elsewhere a thread waits), so no loop-specific child
watcher is involved either.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence


class ChildProcess:
    """A started child: its pid, exit code, output streams, and an awaitable exit.

    The subset of ``asyncio.subprocess.Process`` the worker supervision uses.

    Attributes:
        pid: the process id.
        stdout / stderr: the child's output (``asyncio.StreamReader``).
    """

    def __init__(self, popen: subprocess.Popen[bytes], stdout: asyncio.StreamReader,
                 stderr: asyncio.StreamReader) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self.stderr = stderr
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._watch()

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal), ``None`` while it runs."""
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait for the process to exit; its exit code. Cancelling the wait leaves it running."""
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process was already reaped (so never to a reused pid)."""
        self._popen.send_signal(sig)

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): a thread waits
            waiting = loop.run_in_executor(None, self._popen.wait)
            waiting.add_done_callback(lambda _f: self._reaped())
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._popen.wait()  # exited: returns at once and reaps it
            self._reaped()

        loop.add_reader(pidfd, readable)

    def _reaped(self) -> None:
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode if self._popen.returncode is not None else -1)


def _pipe_reader(fd: int) -> asyncio.StreamReader:
    """A stream of what arrives on the pipe ``fd`` (this function owns and closes ``fd``).

    Read with ``add_reader`` and ``os.read`` rather than ``loop.connect_read_pipe``: the
    loop's pipe transport closes the descriptor it was given, and a file object holding the
    same number would close it a second time later, by then perhaps another descriptor of
    the loop's own (uvloop aborts the process on that).
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            reader.feed_data(data)
            return
        loop.remove_reader(fd)
        os.close(fd)
        reader.feed_eof()

    loop.add_reader(fd, readable)
    return reader


async def spawn(argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = (),
                start_new_session: bool = False) -> ChildProcess:
    """Start ``argv`` with stdin from ``/dev/null`` and piped stdout/stderr, keeping ``pass_fds``
    open in the child (and leading a new session when ``start_new_session``).

    Raises:
        OSError: the program cannot be started.
    """
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out_write, stderr=err_write,
                                 pass_fds=tuple(pass_fds), env=env, start_new_session=start_new_session)
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return ChildProcess(popen, _pipe_reader(out_read), _pipe_reader(err_read))
