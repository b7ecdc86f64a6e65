"""Port checks before a start: is a configured port already in use, and by which process.

``--start`` refuses to start when a port it would bind is taken (:func:`busy_ports`), and
names the holder (:func:`port_holder`, Linux ``/proc`` only) so the user knows what to stop.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from inference_service.config import Settings


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port`` (``"pid 1234 (command line, cut to 120)"``), from ``/proc/net/tcp*``
    and ``/proc/<pid>/fd``; ``None`` without ``/proc``, listener, or access (another user's process)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                continue
            cmdline = " ".join((proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            continue
        return f"pid {proc.name}" + (f" ({cmdline[:120]})" if cmdline else "")
    return None


def port_taken(address: str, port: int) -> bool:
    """Whether binding ``address:port`` fails with EADDRINUSE (with SO_REUSEADDR, as gRPC binds); an
    address that does not resolve counts as free (the server reports it)."""
    try:
        infos = socket.getaddrinfo(address.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return False
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def port_in_use_message(api: str, address: str, port: int) -> str:
    """``"port 7070 (inference API, 127.0.0.1) is already in use by pid 1234 (...)"`` (without
    ``by ...`` when the holder cannot be found)."""
    holder = port_holder(port)
    return f"port {port} ({api} API, {address}) is already in use" + (f" by {holder}" if holder else "")


def busy_ports(settings: Settings) -> list[str]:
    """A :func:`port_in_use_message` per configured (non-zero) port another process already listens
    on, among :meth:`Settings.binds`."""
    return [port_in_use_message(api, address, port) for api, address, port in settings.binds()
            if port and port_taken(address, port)]
