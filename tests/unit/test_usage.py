"""The ``/proc`` reading behind per-model resource accounting (DescribeModel, /metrics)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import wait_for
from inference_service.dispatch.usage import Usage, process_tree_usage


def test_process_tree_usage_counts_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        alone = wait_for(lambda: (u := process_tree_usage(child.pid)).rss_bytes > 1 << 20 and u, timeout=30,
                         what="the child's interpreter loaded")
        tree = process_tree_usage(os.getpid())
        assert alone.processes == 1 and alone.threads >= 1 and alone.rss_bytes > 1 << 20
        assert tree.processes >= 2 and tree.rss_bytes > alone.rss_bytes and tree.threads > alone.threads
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert process_tree_usage(child.pid) == Usage()  # gone
    assert process_tree_usage(None) == Usage()


def test_process_tree_usage_reads_status_files(tmp_path: Path):
    (tmp_path / "7" / "task" / "7").mkdir(parents=True)
    (tmp_path / "7" / "status").write_text("Name:\tw\nVmRSS:\t    2048 kB\nThreads:\t3\n")
    (tmp_path / "7" / "task" / "7" / "children").write_text("8 9 ")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "status").write_text("Name:\tzombie\nThreads:\t1\n")  # a zombie has no VmRSS
    # 9 vanished between the two reads: left out
    assert process_tree_usage(7, tmp_path) == Usage(2048 * 1024, 4, 2)
