"""The run directory and its pid file: trusted only when it is this user's alone, and a pid
file that names a server only while that server holds a ``flock`` on it (the kernel drops it
however the process dies), so ``--stop`` never signals a process that reused a stale pid."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

#: Mode of a run directory this server creates (``--run-dir``, default ``.inference_service``).
RUN_DIR_MODE = 0o700


class RunDirError(Exception):
    """The run directory cannot be trusted or used (the message says why and what to do)."""


def prepare_run_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check an existing one.

    Raises:
        RunDirError: not a directory, another user's, or group/other-writable (a writer there could
            plant links the server writes through, or a pid file ``--stop`` would signal).
    """
    try:
        path.mkdir(mode=RUN_DIR_MODE, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise RunDirError(f"run directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"run directory {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise RunDirError(f"run directory {path} belongs to uid {info.st_uid}, not to this user "
                          f"(uid {os.geteuid()}); use a directory of your own (--run-dir)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RunDirError(f"run directory {path} is writable by its group or others (mode "
                          f"{stat.S_IMODE(info.st_mode):04o}); chmod 700 it or use another --run-dir")


def _open_pid_file(path: Path, flags: int) -> int:
    """``os.open`` without following a link (a planted link is refused, not written through)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RunDirError(f"pid file {path} is a symbolic link; remove it") from None
        raise


def locked_pid(path: Path) -> int | None:
    """The pid in ``path`` if a running server holds its lock, else ``None`` (no file, or stale).
    RunDirError when the pid file is a symbolic link."""
    try:
        fd = _open_pid_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: a server runs
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        return None
    finally:
        os.close(fd)


def stale_pid(path: Path) -> str | None:
    """The text of a pid file nobody holds (stripped, at most 32 characters), else ``None``."""
    try:
        fd = _open_pid_file(path, os.O_RDONLY)
    except (OSError, RunDirError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return os.read(fd, 32).decode(errors="replace").strip()
    except BlockingIOError:
        return None
    finally:
        os.close(fd)


class PidLock:
    """This server's pid file, locked while the server runs::

        lock = PidLock.acquire(run_dir / "inference_service.pid")  # None: another server runs
        ...
        lock.release()
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, path: Path) -> PidLock | None:
        """Lock the pid file and write this pid; ``None`` when another server holds it. RunDirError for a
        symbolic link; OSError when it cannot be created."""
        fd = _open_pid_file(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Remove the pid file (while still holding its lock) and drop the lock."""
        try:
            if os.path.samestat(os.fstat(self.fd), os.lstat(self.path)):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
