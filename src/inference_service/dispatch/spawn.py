"""Worker processes started the same way under any event loop (:func:`spawn`).

Under uvloop ``asyncio.create_subprocess_exec`` calls ``fork()``, whose ``pthread_atfork``
handlers gRPC skips while its threads are busy ("Other threads are currently calling into gRPC,
skipping fork() handlers"), so the child starts mid-call. :func:`spawn` uses
:class:`subprocess.Popen` (CPython's ``vfork``, no fork handlers), reads output through the
running loop and learns of the exit from a pidfd (Linux 5.3+; elsewhere a thread waits).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence


class ChildProcess:
    """A started child: the subset of ``asyncio.subprocess.Process`` worker supervision uses."""

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
    """A stream of what arrives on the pipe ``fd``, which this owns and closes: ``add_reader`` and
    ``os.read``, because the loop's pipe transport would close ``fd`` a second time later, by then
    perhaps a descriptor of the loop's own (uvloop aborts on that)."""
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
    """Start ``argv`` with stdin ``/dev/null``, piped stdout/stderr, ``pass_fds`` kept open (and a new
    session when ``start_new_session``); OSError when it cannot be started."""
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
