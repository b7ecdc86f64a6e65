"""The OpenVINO exporter's process, started by :func:`inference_service.llm.openvino_ir.convert`:
``python -m inference_service.llm.ir_export PARENT_PID OUTPUT_DIR -- ARGS`` runs optimum-intel's
``optimum-cli ARGS`` (``int4 MODEL_DIR OUTPUT_DIR``: :mod:`inference_service.llm.int4_export`) in its
own session and ends with its parent. When the parent dies (a worker
killed, a model unregistered mid-conversion), the kernel sends this process SIGTERM (Linux's
``PR_SET_PDEATHSIG``; elsewhere a thread watches the parent's pid); it then removes OUTPUT_DIR,
its unfinished output, and kills its process group."""

from __future__ import annotations

import ctypes
import os
import runpy
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: How often the fallback watchdog (no ``prctl``) looks at the parent's pid (s).
_WATCH_INTERVAL_S = 0.5


def _end(output_dir: str) -> None:
    shutil.rmtree(output_dir, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)  # this session's group: the exporter and anything it started


#: The line the exporter prints when a SIGTERM stops it, naming its sender (read by
#: :func:`inference_service.llm.exporter_run.failure_reason`).
STOPPED_BY = "ir_export: stopped by SIGTERM from "


def _sender(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "gone"
    return f"pid {pid} ({command[:200] or 'no command line'})"


def _watch_sigterm(output_dir: str) -> None:
    """SIGTERM ends this process; its sender is printed first (a thread waits for it, so a
    signal is never delivered to a thread of the exporter's)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before any other thread starts

    def wait() -> None:
        info = signal.sigwaitinfo({signal.SIGTERM})
        try:  # the reader may be gone with the parent: a broken pipe must not keep the end from running
            print(f"{STOPPED_BY}{_sender(info.si_pid)}", file=sys.stderr, flush=True)
        except OSError:
            pass
        finally:
            _end(output_dir)

    threading.Thread(target=wait, name="sigterm-watch", daemon=True).start()


def _die_with(parent: int, output_dir: str) -> None:
    """End this process (see the module docstring) when ``parent`` is no longer its parent."""
    if hasattr(signal, "sigwaitinfo"):
        _watch_sigterm(output_dir)
    else:
        def on_signal(_signum: int, _frame: FrameType | None) -> None:
            _end(output_dir)

        signal.signal(signal.SIGTERM, on_signal)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        armed = False
    if os.getppid() != parent:  # the parent died before the signal was armed
        _end(output_dir)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(_WATCH_INTERVAL_S)
            _end(output_dir)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str]) -> None:
    """Arm the parent watch, then run optimum-cli with the arguments after ``--``."""
    if len(argv) < 3 or argv[2] != "--":
        sys.exit("usage: python -m inference_service.llm.ir_export PARENT_PID OUTPUT_DIR -- OPTIMUM_CLI_ARGS")
    _die_with(int(argv[0]), argv[1])
    if argv[3:4] == ["int4"]:
        sys.argv = ["int4_export", *argv[4:]]
        runpy.run_module("inference_service.llm.int4_export", run_name="__main__", alter_sys=True)
        return
    sys.argv = ["optimum-cli", *argv[3:]]
    runpy.run_module("optimum.commands.optimum_cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
