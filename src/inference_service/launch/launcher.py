"""``--start`` and ``--stop``: run the server in the background and say what happened.

``--start`` (:func:`start_background`) refuses a missing archive or a busy port before starting,
then waits until every startup model is ``ready`` (at most ``--wait-ready`` s); a ``failed``
model stops the server and prints its error. TorchServe's ``--start`` returns before anything
is loaded. ``--stop`` (:func:`stop_instance`) signals the pid file's server only while it holds
the file's lock (:mod:`inference_service.launch.rundir`). See docs/install.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inference_service.config import Settings
from inference_service.launch.ports import busy_ports, port_in_use_message
from inference_service.launch.preflight import startup_problems
from inference_service.launch.rundir import RunDirError, locked_pid, prepare_run_dir, stale_pid
from inference_service.observability.status import (
    FAILED,
    READY,
    REGISTERING,
    STATUS_FILE_NAME,
    UNREGISTERED,
    read_status,
)

#: The words of the server's warning that workers x threads exceed the CPUs (repeated by ``--start``).
CPU_WARNING = "usable CPUs: they slow each other down"
#: How long ``--start`` waits for the startup models to be READY unless ``--wait-ready`` says (s).
DEFAULT_WAIT_READY_S = 300.0
#: The words of the server's warning that workers x threads exceed the CPUs (repeated by ``--start``).
CPU_WARNING = "usable CPUs: they slow each other down"
#: How long ``--start`` waits for the server to listen (s).
LISTEN_TIMEOUT_S = 60.0
#: Polling interval of ``--start``'s waits (s); each poll reads the status file once.
POLL_S = 0.2


def pid_file(settings: Settings) -> Path:
    """``<instance dir>/inference_service.pid``: the pid of the instance's server while it runs."""
    return settings.instance_dir / "inference_service.pid"


def running_pid(settings: Settings) -> int | None:
    """The pid of the instance's running server; ``None`` without a pid file, or when no server
    holds its lock (the process of that pid, if any, is not this instance's server:
    :mod:`inference_service.launch.rundir`; a pid file that is a link names none)."""
    try:
        return locked_pid(pid_file(settings))
    except (OSError, RunDirError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def stop_instance(settings: Settings, timeout: float) -> int:
    """``--stop``: SIGTERM to the instance's server, then wait at most ``timeout`` s; exit status 0
    when it stopped, 1 when none runs or it did not stop in time (said on stderr)."""
    pid = running_pid(settings)
    if pid is None:
        stale = stale_pid(pid_file(settings))
        if stale is not None:  # a server killed without its cleanup; that pid may be anyone's now
            print(f"inference-service: the pid file {pid_file(settings)} (pid {stale[:12]}) is stale: no server "
                  "holds it; nothing signalled", file=sys.stderr)
        print(f"inference-service is not running: no live server in the run directory {settings.instance_dir} "
              "(a server started elsewhere: --stop from its working directory, or --run-dir DIR)", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # the server drops its lock as it exits; then its process ends (or waits as a zombie)
        if running_pid(settings) != pid and not _alive(pid):
            print(f"inference-service (pid {pid}, run directory {settings.instance_dir}) stopped")
            return 0
        time.sleep(0.05)
    print(f"inference-service (pid {pid}) did not stop within {timeout:.0f}s", file=sys.stderr)
    return 1


def log_messages(log_path: Path, offset: int) -> list[str]:
    """The log's messages written after byte ``offset``: plain lines as they are, JSON lines as
    ``"LEVEL logger: message"``; empty when the log cannot be read."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
                line = f"{record.get('level', '')} {record.get('logger', '')}: {record.get('message', '')}"
            except ValueError:
                pass
        out.append(line)
    return out


def start_background(argv: list[str], settings: Settings, wait_ready_s: float) -> int:
    """``--start``: run ``argv`` with ``--foreground`` detached and wait at most ``wait_ready_s`` for
    the startup models to be ready (0: registered). Exit status 0, or 1 with the cause on stderr."""
    try:
        prepare_run_dir(settings.instance_dir)
        pid = running_pid(settings)
    except RunDirError as exc:
        print(f"inference-service: {exc}; not started", file=sys.stderr)
        return 1
    if pid is not None:
        print(f"inference-service is already running (pid {pid}); stop it with --stop", file=sys.stderr)
        return 1
    clashes = busy_ports(settings)
    problems = startup_problems(settings) + clashes
    if problems:
        for problem in problems:
            print(f"inference-service: {problem}", file=sys.stderr)
        if clashes:
            print(f"inference-service: {settings.ports_message()}", file=sys.stderr)
        print("inference-service: not started", file=sys.stderr)
        return 1
    log_path = settings.log_file or settings.files_dir / "logs" / "inference_service.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    offset = log_path.stat().st_size if log_path.exists() else 0
    child_argv = [a for a in argv if a != "--start"] + ["--foreground"]
    if settings.log_file is None:  # the child writes it, rotated (observability/logfiles.py)
        child_argv += ["--log-file", str(log_path)]
    with open(log_path, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "inference_service", *child_argv],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    run = _Run(child, settings, log_path, offset)
    info = run.wait_listening()
    if info is None:
        return 1
    keys = f"; keys: {info['key_file']}" if info.get("key_file") else ""
    ready = run.wait_models(info, wait_ready_s)
    if ready is None:
        return 1
    print(f"inference-service started (pid {child.pid}): {listening(info, settings.health_address)}{ready}; "
          f"log: {log_path}{keys}")
    for message in log_messages(log_path, offset):
        if CPU_WARNING in message:  # serving/cpu_budget.py: workers x threads above the CPUs
            print(f"inference-service: warning: {message.split(': ', 1)[-1]}", file=sys.stderr)
    return 0


def listening(info: dict[str, Any], health_address: str = "") -> str:
    """Every port of a status file: ``"gRPC inference 127.0.0.1:7070, gRPC management ..., HTTP
    inference ..., HTTP management ..., metrics http://.../metrics, health ..."`` (those enabled)."""
    parts = [f"gRPC inference {info['inference_address']}:{info['inference_port']}",
             f"gRPC management {info['management_address']}:{info['management_port']}"]
    if info.get("http_port"):
        parts.append(f"HTTP inference {info['http_address']}:{info['http_port']}")
    if info.get("http_management_port"):
        parts.append(f"HTTP management {info['http_management_address']}:{info['http_management_port']}")
    if info.get("metrics_port"):
        parts.append(f"metrics http://{info['metrics_address']}:{info['metrics_port']}/metrics")
    if info.get("health_port"):
        parts.append(f"health {health_address or info['inference_address']}:{info['health_port']}")
    return ", ".join(parts)


class _Run:
    """The server ``--start`` started, followed through its status file and log (from ``offset`` bytes)."""

    def __init__(self, child: subprocess.Popen[bytes], settings: Settings, log_path: Path, offset: int) -> None:
        self.child = child
        self.settings = settings
        self.status_path = settings.instance_dir / STATUS_FILE_NAME
        self.log_path = log_path
        self.offset = offset

    def status(self) -> dict[str, Any] | None:
        """The status file, when it is this server's (an older one may still be there)."""
        info = read_status(self.status_path)
        return info if info is not None and info.get("pid") == self.child.pid else None

    def wait_listening(self) -> dict[str, Any] | None:
        """Wait (at most :data:`LISTEN_TIMEOUT_S`) for the server's status file; ``None`` (reported)
        if it exited or did not listen in time."""
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                self.report_exit()
                return None
            if (info := self.status()) is not None:
                return info
            time.sleep(POLL_S)
        print(f"inference-service did not listen within {LISTEN_TIMEOUT_S:g}s (pid {self.child.pid} keeps "
              f"running); see {self.log_path}", file=sys.stderr)
        return None

    def wait_models(self, info: dict[str, Any], wait_ready_s: float) -> str | None:
        """Wait for the status file's startup models; returns what to add to the "started" line, or
        ``None`` when it failed (reported; a failed model stops the server)."""
        models: dict[str, dict[str, Any]] = info.get("models") or {}
        if not models:
            return ""
        what = "ready" if wait_ready_s > 0 else "registered"
        limit = wait_ready_s if wait_ready_s > 0 else DEFAULT_WAIT_READY_S
        print(f"waiting for the startup models to be {what}: {', '.join(models)} (at most {limit:g} s)",
              flush=True)
        deadline = time.monotonic() + limit
        while True:
            if self.child.poll() is not None:
                self.report_exit()
                return None
            models = {**models, **((self.status() or {}).get("models") or {})}
            for key, entry in models.items():
                if entry.get("state") == FAILED and (wait_ready_s > 0 or not entry.get("version")):
                    verb = "cannot load" if entry.get("version") else "failed to register"
                    self.fail(f"startup model {key} {verb}: {entry.get('error') or 'no error given'}")
                    return None
            pending = {key: entry.get("state", REGISTERING) for key, entry in models.items()
                       if not _settled(entry, wait_ready_s)}
            if not pending:  # named as registered: load_models=tiny.mar is the model tiny
                return f"; models {what}: {', '.join(entry.get('model_name') or key for key, entry in models.items())}"
            if time.monotonic() > deadline:
                print(f"inference-service: startup models not {what} within {limit:g} s: "
                      f"{', '.join(f'{key} ({state})' for key, state in pending.items())}; the server keeps "
                      f"running (pid {self.child.pid}): wait longer with --wait-ready SECONDS, stop it with "
                      f"--stop; log: {self.log_path}", file=sys.stderr)
                return None
            time.sleep(POLL_S)

    def report_exit(self) -> None:
        """Print why the server exited: its log's errors, and who holds a port it could not bind."""
        errors = [m for m in log_messages(self.log_path, self.offset) if re.search(r"\b(ERROR|CRITICAL)\b", m)]
        print(f"inference-service failed to start (exit {self.child.returncode}); log: {self.log_path}",
              file=sys.stderr)
        for message in errors[-10:]:  # a bind failure's includes the server's "the server's ports: ..."
            print(f"  {message}", file=sys.stderr)
            bind = re.search(r"cannot bind the (.+?) API to (.+):(\d+)", message)
            if bind:
                print(f"inference-service: {port_in_use_message(bind[1], bind[2], int(bind[3]))}",
                      file=sys.stderr)

    def fail(self, cause: str) -> None:
        """Report ``cause`` and stop the server (SIGTERM, then at most the drain timeout + 15 s)."""
        print(f"inference-service: {cause}", file=sys.stderr)
        self.child.send_signal(signal.SIGTERM)
        try:
            self.child.wait(self.settings.drain_timeout_s + 15)
            outcome = "was stopped"
        except subprocess.TimeoutExpired:
            outcome = "did not stop"
        print(f"inference-service: the server (pid {self.child.pid}) {outcome}; log: {self.log_path}",
              file=sys.stderr)


def _settled(entry: dict[str, Any], wait_ready_s: float) -> bool:
    """Whether ``--start`` has no more to wait for on a startup model's status entry: READY (or,
    with ``wait_ready_s`` 0, registered), or unregistered meanwhile."""
    state = entry.get("state")
    if state == UNREGISTERED:
        return True
    return state == READY if wait_ready_s > 0 else bool(entry.get("version"))
