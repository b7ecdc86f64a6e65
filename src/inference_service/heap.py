"""Keep large request buffers out of the process heap, so their memory goes back to the OS.

glibc's mmap threshold (128 KiB) rises to each freed mmapped chunk's size (up to 32 MiB), after
which megabyte buffers come from the heap, which keeps freed space: tens of MiB grew after a
few hundred large requests of mixed sizes. Fixing the threshold keeps them in own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, kept fixed


def return_large_buffers_to_the_os() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (``mallopt``), turning off its
    dynamic growth. Returns whether it was set: ``False`` without glibc (another libc, another
    OS), where nothing changes. Never raises."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; large buffers may stay in the heap")
    return ok
