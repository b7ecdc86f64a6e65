"""heap.return_large_buffers_to_the_os: glibc's mmap threshold fixed, elsewhere nothing done."""

from __future__ import annotations

import platform

from inference_service.heap import return_large_buffers_to_the_os


def test_sets_the_threshold_under_glibc_only():
    assert return_large_buffers_to_the_os() is (platform.libc_ver()[0] == "glibc")
    assert return_large_buffers_to_the_os() is (platform.libc_ver()[0] == "glibc")  # idempotent
