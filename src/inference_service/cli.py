"""Command line: ``inference-service`` (and ``python -m inference_service``).

Accepts the ``torchserve`` flags users' scripts already pass (``--start``,
``--stop``, ``--foreground``, ``--model-store``, ``--models``, ``--ts-config``,
``--ncs``, ``--disable-token-auth``, ``--enable-model-api``) plus options of
its own. ``--foreground`` keeps the server attached; ``--stop`` stops the
instance of this working directory (or ``--run-dir``).

``--start`` (the default) runs the server in the background, logging to
``<working dir>/logs/inference_service.log``, and says what happened:

1. before starting, it refuses (exit 1, the cause on stderr) a model store that
   does not exist (TorchServe's ``ts/model_server.py`` text, "--model-store
   directory not found"; checked in the foreground too), a startup archive that
   is missing or unreadable, and a port that is already in use (naming the port
   and, from ``/proc/net/tcp`` and ``/proc/<pid>/fd``, the pid holding it);
2. it waits until the server listens (its ``status.json``); a server that exits
   meanwhile is reported with the errors of its log;
3. it waits until every startup model (``--models``, ``load_models`` or a
   restored snapshot) is registered and has its minimum workers READY, polling
   DescribeModel on the management port, at most ``--wait-ready`` seconds
   (300; ``0``: only until they are registered). A model that cannot register
   or whose worker fails to load stops the server again, and the cause, taken
   from the log, is printed; a model still loading at the deadline leaves the
   server running and exits 1.

TorchServe's ``torchserve --start`` returns before anything is loaded; scripts
that poll for readiness afterwards keep working, they just find it ready.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_service import tls
from inference_service.accesslog import configure_logging
from inference_service.config import ConfigError, Settings, apply_properties, read_properties

log = logging.getLogger("inference_service")

#: How long ``--start`` waits for the startup models to be READY unless ``--wait-ready`` says (s).
DEFAULT_WAIT_READY_S = 300.0
#: How long ``--start`` waits for the server to listen (s).
LISTEN_TIMEOUT_S = 60.0
#: Polling interval of ``--start``'s waits (s); each model poll is one DescribeModel call.
POLL_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (TorchServe's flags first, then this server's)."""
    p = argparse.ArgumentParser(
        prog="inference-service",
        description="gRPC model server, wire-compatible with TorchServe's gRPC APIs.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--start", action="store_true",
                      help="start the server (default) in the background; returns once the startup models are "
                           "ready (see --wait-ready)")
    mode.add_argument("--stop", action="store_true", help="stop the running server of this working directory")
    p.add_argument("--foreground", action="store_true", help="run in the foreground (logs to stderr)")
    p.add_argument("--wait-ready", type=float, default=None, metavar="SECONDS",
                   help=f"--start: wait at most this long for every startup model to be READY "
                        f"({DEFAULT_WAIT_READY_S:g}; 0: return once they are registered)")
    p.add_argument("--model-store", type=Path, help="directory holding model archives")
    p.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                   help="models to load at startup: name=archive.mar, archive.mar, or 'all'")
    p.add_argument("--ts-config", type=Path, help="TorchServe config.properties file")
    p.add_argument("--ncs", "--no-config-snapshots", action="store_true", dest="ncs",
                   help="do not write or restore config snapshots")
    p.add_argument("--disable-token-auth", action="store_true", help="turn token authorization off")
    p.add_argument("--enable-model-api", action="store_true",
                   help="allow RegisterModel and UnregisterModel")
    for name in ("--log-config", "--workflow-store", "--plugins-path", "--cpp-log-config"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--grpc-inference-address", help="inference API bind address (127.0.0.1)")
    p.add_argument("--grpc-inference-port", type=int, help="inference API port (7070; 0 = any free port)")
    p.add_argument("--grpc-management-address", help="management API bind address (127.0.0.1)")
    p.add_argument("--grpc-management-port", type=int, help="management API port (7071; 0 = any free port)")
    p.add_argument("--grpc-health-address", help="plaintext health-only port's bind address (127.0.0.1)")
    p.add_argument("--grpc-health-port", type=int,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes when TLS is on)")
    p.add_argument("--http-address", help="HTTP/1.1 inference API (TorchServe's REST API) bind address (127.0.0.1)")
    p.add_argument("--http-port", type=int, help="HTTP/1.1 inference API port (8080; 0 = any free port)")
    p.add_argument("--no-http", action="store_true", help="do not serve the HTTP/1.1 inference API")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve both gRPC ports over TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    p.add_argument("--run-dir", type=Path,
                   help="per-instance directory for pid/status files and extracted archives "
                        "(default <working dir>/.inference_service)")
    p.add_argument("--workers-per-model", type=int, help="default_workers_per_model")
    p.add_argument("--worker-threads", type=int, help="torch threads per worker (default cores / workers)")
    p.add_argument("--drain-timeout", type=float, help="seconds in-flight requests get at shutdown (30)")
    p.add_argument("--max-backoff", type=float,
                   help="cap of the worker restart back-off in seconds (30)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (INFO)")
    p.add_argument("--log-format", choices=("plain", "json"), default=None,
                   help="plain lines (default) or one JSON object per line (log_format)")
    p.add_argument("--no-access-log", action="store_true",
                   help="do not write the access log (one inference_service.access line per RPC)")
    p.add_argument("--metrics-address", help="Prometheus /metrics bind address (127.0.0.1)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (8082; 0 = any free port)")
    p.add_argument("--metrics-mode", choices=("log", "prometheus", "legacy"), default=None,
                   help="handler metrics: logged by the worker (log, default) or exported on /metrics "
                        "(prometheus)")
    p.add_argument("--disable-metrics-api", action="store_true",
                   help="no /metrics endpoint and no metrics recorded (enable_metrics_api=false)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings`: defaults < ``--ts-config`` < command line.

    Raises:
        ConfigError: the config file is unreadable or has a malformed value, or
            the TLS settings do not fit together (:func:`inference_service.tls.validate`).
    """
    settings = Settings()
    if args.ts_config is not None:
        apply_properties(settings, read_properties(args.ts_config), str(args.ts_config))
        settings.ts_config = args.ts_config
    if args.model_store is not None:
        settings.model_store = args.model_store
    if settings.model_store is not None:
        settings.model_store = settings.model_store.resolve()
    if args.models is not None:
        settings.load_models = [m for item in args.models for m in item.split(",") if m]
    overrides = {
        "inference_address": args.grpc_inference_address,
        "inference_port": args.grpc_inference_port,
        "management_address": args.grpc_management_address,
        "management_port": args.grpc_management_port,
        "run_dir": args.run_dir.resolve() if args.run_dir else None,
        "default_workers_per_model": args.workers_per_model,
        "worker_threads": args.worker_threads,
        "drain_timeout_s": args.drain_timeout,
        "max_backoff_s": args.max_backoff,
        "log_level": args.log_level.upper() if args.log_level else None,
        "log_format": args.log_format,
        "metrics_address": args.metrics_address,
        "metrics_port": args.metrics_port,
        "metrics_mode": args.metrics_mode,
        "health_address": args.grpc_health_address,
        "health_port": args.grpc_health_port,
        "http_address": args.http_address,
        "http_port": args.http_port,
        "certificate_file": args.tls_cert,
        "private_key_file": args.tls_key,
        "client_ca_file": args.tls_client_ca,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(settings, key, value)
    if args.tls_cert is not None or args.tls_key is not None:
        settings.enable_grpc_ssl = True
    for key in ("certificate_file", "private_key_file", "client_ca_file"):
        if getattr(settings, key) is not None:
            setattr(settings, key, getattr(settings, key).expanduser().resolve())
    tls.validate(settings)
    if args.no_http:
        settings.http_port = None
    elif settings.http_tls and (settings.certificate_file is None or settings.private_key_file is None):
        raise ConfigError("an https:// inference_address needs certificate_file and private_key_file "
                          "(or --tls-cert and --tls-key)")
    if args.ncs:
        settings.snapshot = False
    if args.disable_token_auth:
        settings.disable_token_auth = True
    if args.enable_model_api:
        settings.enable_model_api = True
    if args.no_access_log:
        settings.access_log = False
    if args.disable_metrics_api:
        settings.enable_metrics_api = False
    settings.inference_key = os.environ.get("INFERENCE_SERVICE_INFERENCE_KEY") or None
    settings.management_key = os.environ.get("INFERENCE_SERVICE_MANAGEMENT_KEY") or None
    for name, env_key in (("INFERENCE_SERVICE_INFERENCE_KEY", settings.inference_key),
                          ("INFERENCE_SERVICE_MANAGEMENT_KEY", settings.management_key)):
        if env_key is not None and len(env_key) < 16:
            raise ConfigError(f"{name} must have at least 16 characters")
    for port in (settings.inference_port, settings.management_port, settings.health_port or 0,
                 settings.http_port or 0, settings.metrics_port):
        if not 0 <= port <= 65535:
            raise ConfigError(f"port {port} is out of range 0..65535")
    return settings


def _pid_file(settings: Settings) -> Path:
    return settings.instance_dir / "inference_service.pid"


def _running_pid(settings: Settings) -> int | None:
    try:
        pid = int(_pid_file(settings).read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _stop(settings: Settings, timeout: float) -> int:
    pid = _running_pid(settings)
    if pid is None:
        print("inference-service is not running", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            print(f"inference-service (pid {pid}) stopped")
            return 0
        time.sleep(0.1)
    print(f"inference-service (pid {pid}) did not stop within {timeout:.0f}s", file=sys.stderr)
    return 1


# ------------------------------------------------------------------ --start: what happened
def model_store_problem(settings: Settings) -> str | None:
    """TorchServe's refusal of a model store that is not a directory (``ts/model_server.py``)."""
    store = settings.model_store
    if store is not None and not store.is_dir():
        return f"--model-store directory not found: {store}"
    return None


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``: ``"pid 1234 (python -m inference_service ...)"``.

    Found through the listening sockets of ``/proc/net/tcp`` and ``/proc/net/tcp6`` and the
    ``socket:[inode]`` links of ``/proc/<pid>/fd``; ``None`` when there is no ``/proc``, no
    listener, or the holder is another user's process (its fds cannot be read).
    """
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


def _port_taken(address: str, port: int) -> bool:
    """Whether binding ``address:port`` fails with EADDRINUSE (with SO_REUSEADDR, as gRPC binds)."""
    try:
        infos = socket.getaddrinfo(address.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return False  # the server reports an address it cannot resolve
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def port_in_use_message(api: str, address: str, port: int) -> str:
    """``"port 7070 (inference API, 127.0.0.1) is already in use by pid 1234 (...)"``."""
    holder = port_holder(port)
    return f"port {port} ({api} API, {address}) is already in use" + (f" by {holder}" if holder else "")


def busy_ports(settings: Settings) -> list[str]:
    """A message per configured (non-zero) port that another process already listens on."""
    binds = [("inference", settings.inference_address, settings.inference_port),
             ("management", settings.management_address, settings.management_port)]
    if settings.http_port is not None:
        binds.append(("HTTP inference", settings.http_address, settings.http_port))
    if settings.enable_metrics_api:
        binds.append(("metrics", settings.metrics_address, settings.metrics_port))
    if settings.health_port is not None:
        binds.append(("health", settings.health_address, settings.health_port))
    return [port_in_use_message(api, address, port) for api, address, port in binds
            if port and _port_taken(address, port)]


@dataclass
class StartupModel:
    """A model the server registers at startup, as ``--start`` waits for it.

    Attributes:
        ident: how the server's log names it (the given name, else the URL).
        name: the model name (``None`` when it cannot be known beforehand: a remote URL).
        version: the version to describe (``""``: the default one).
    """

    ident: str
    name: str | None
    version: str = ""


def startup_models(settings: Settings) -> tuple[list[StartupModel], list[str]]:
    """The models the server will register at startup, and the problems that will stop them.

    Follows the server's rules: ``load_models`` entries (``name=url`` or ``url``; ``all``
    for every archive in the store), else, with snapshots on and neither ``--ts-config``
    nor ``--models``, the latest snapshot. A local archive is looked up in the store
    (:func:`inference_service.archive.resolve_in_store`) and its manifest read for the
    model's name (:func:`inference_service.archive.read_manifest`).

    Returns:
        ``(models, problems)``: one problem message per archive that is missing or unreadable.
    """
    from inference_service.archive import MANIFEST, is_remote_url, read_manifest, resolve_in_store
    from inference_service.errors import InferenceError

    store = settings.model_store
    entries = list(settings.load_models)
    if "all" in entries:
        entries = sorted(p.name for p in (store.iterdir() if store is not None and store.is_dir() else [])
                         if p.suffix == ".mar" or p.name.endswith((".tar.gz", ".tgz"))
                         or (p.is_dir() and (p / MANIFEST).is_file()))
    elif not entries and settings.snapshot and settings.ts_config is None:
        return _snapshot_models(settings), []
    models, problems = [], []
    for entry in entries:
        name, sep, url = entry.partition("=")
        name, url = (name.strip(), url.strip()) if sep else ("", entry.strip())
        if is_remote_url(url):
            models.append(StartupModel(name or url, name or None))
            continue
        try:
            manifest = read_manifest(resolve_in_store(url, store))
        except InferenceError as exc:
            problems.append(f"startup model {name or url}: {exc.message}")
            continue
        models.append(StartupModel(name or url, name or str(manifest.get("model", {}).get("modelName") or "")
                                   or None))
    return models, problems


def _snapshot_models(settings: Settings) -> list[StartupModel]:
    """The model versions of the snapshot the server will restore (none if it cannot be read)."""
    from inference_service.snapshot import SnapshotError, SnapshotStore

    snapshots = SnapshotStore(settings.files_dir / "logs" / "config")
    latest = snapshots.latest()
    if latest is None:
        return []
    try:
        return [StartupModel(m.name, m.name, m.version) for m in snapshots.load(latest)]
    except SnapshotError:
        return []  # the server sets it aside and starts without it


def log_messages(log_path: Path, offset: int) -> list[str]:
    """The log's messages written after byte ``offset`` (plain lines, or the ``message`` of JSON lines)."""
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


def _errors(messages: list[str]) -> list[str]:
    return [m for m in messages if re.search(r"\b(ERROR|CRITICAL)\b", m)]


def _after(message: str, marker: str) -> str:
    """``message`` from ``marker`` on (drops the time, level and logger prefix)."""
    return message[message.index(marker):]


def load_failure(messages: list[str], model: StartupModel) -> str | None:
    """The log's reason why ``model`` failed to register or load, if it has one."""
    markers = [f"startup model {model.ident} failed to register"]
    if model.name:
        markers += [f"model {model.name} failed to load", f"worker of model {model.name} did not load within"]
    for message in reversed(messages):
        for marker in markers:
            if marker in message:
                return _after(message, marker)
    return None


def _connect_address(address: str) -> str:
    """Where to reach a server bound to ``address`` from this machine."""
    address = address.strip("[]")
    if address in ("0.0.0.0", ""):
        return "127.0.0.1"
    if address == "::":
        return "[::1]"
    return f"[{address}]" if ":" in address else address


def _management_key(info: dict[str, Any], settings: Settings) -> str | None:
    if info.get("key_file"):
        try:
            return str(json.loads(Path(info["key_file"]).read_text())["management"]["key"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return settings.management_key


class CannotFollow(Exception):
    """DescribeModel answers something ``--start`` cannot wait on (e.g. UNAUTHENTICATED)."""


def _describe(stub: Any, model: StartupModel, key: str | None) -> dict[str, Any] | None:
    """DescribeModel's entry for ``model``; ``None`` while it is not registered (NOT_FOUND) or the
    call did not get through (UNAVAILABLE, DEADLINE_EXCEEDED).

    Raises:
        CannotFollow: any other answer (the message has its code and details).
    """
    import grpc

    from inference_service._proto import management_pb2

    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    request = management_pb2.DescribeModelRequest(model_name=model.name or "", model_version=model.version)
    try:
        described = json.loads(stub.DescribeModel(request, timeout=5, metadata=metadata).msg)
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None
        raise CannotFollow(f"{getattr(code, 'name', code)}: {err.details() if hasattr(err, 'details') else err}") \
            from err
    return described[0] if isinstance(described, list) and described else None


def _model_state(desc: dict[str, Any]) -> str:
    """``"ready"`` (its minimum workers READY), ``"failed"`` (a worker failed to load) or ``"loading"``."""
    workers = desc.get("workers") or []
    ready = sum(1 for w in workers if w.get("status") in ("READY", "BUSY"))
    if ready >= int(desc.get("minWorkers") or 0):
        return "ready"
    if any(w.get("status") in ("RESTARTING", "FAILED") or int(w.get("restarts") or 0) > 0 for w in workers):
        return "failed"
    return "loading"


def _start_background(argv: list[str], settings: Settings, wait_ready_s: float) -> int:
    """``--start``: the steps of the module docstring. Returns the exit status (0: started)."""
    pid = _running_pid(settings)
    if pid is not None:
        print(f"inference-service is already running (pid {pid}); stop it with --stop", file=sys.stderr)
        return 1
    models, problems = startup_models(settings)
    problems += busy_ports(settings)
    if problems:
        for problem in problems:
            print(f"inference-service: {problem}", file=sys.stderr)
        print("inference-service: not started", file=sys.stderr)
        return 1
    logs = settings.files_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "inference_service.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    child_argv = [a for a in argv if a != "--start"] + ["--foreground"]
    with open(log_path, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "inference_service", *child_argv],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    info = _wait_listening(child, settings, log_path, offset)
    if info is None:
        return 1
    keys = f"; keys: {info['key_file']}" if info.get("key_file") else ""
    http = f", HTTP {info['http_address']}:{info['http_port']}" if info.get("http_port") else ""
    if info.get("metrics_port"):
        http += f", metrics http://{info['metrics_address']}:{info['metrics_port']}/metrics"
    ready = _wait_models(child, settings, info, models, wait_ready_s, log_path, offset)
    if ready is None:
        return 1
    print(f"inference-service started (pid {child.pid}): inference "
          f"{info['inference_address']}:{info['inference_port']}, management "
          f"{info['management_address']}:{info['management_port']}{http}{ready}; log: {log_path}{keys}")
    return 0


def _report_exit(child: subprocess.Popen[bytes], log_path: Path, offset: int) -> None:
    """Print why the server exited: its log's errors, and who holds a port it could not bind."""
    errors = _errors(log_messages(log_path, offset))
    print(f"inference-service failed to start (exit {child.returncode}); log: {log_path}", file=sys.stderr)
    for message in errors[-10:]:
        print(f"  {message}", file=sys.stderr)
        bind = re.search(r"cannot bind the (.+?) API to (.+):(\d+)", message)
        if bind:
            print(f"inference-service: {port_in_use_message(bind[1], bind[2], int(bind[3]))}", file=sys.stderr)


def _wait_listening(child: subprocess.Popen[bytes], settings: Settings, log_path: Path,
                    offset: int) -> dict[str, Any] | None:
    """Wait (at most :data:`LISTEN_TIMEOUT_S`) for the child's status file; ``None`` (reported) if it
    exited or did not listen in time."""
    status = settings.instance_dir / "status.json"
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            _report_exit(child, log_path, offset)
            return None
        try:
            info = json.loads(status.read_text())
            if info.get("pid") == child.pid:
                return dict(info)
        except (OSError, ValueError):
            pass
        time.sleep(POLL_S)
    print(f"inference-service did not listen within {LISTEN_TIMEOUT_S:g}s (pid {child.pid} keeps running); "
          f"see {log_path}", file=sys.stderr)
    return None


def _wait_models(child: subprocess.Popen[bytes], settings: Settings, info: dict[str, Any],
                 models: list[StartupModel], wait_ready_s: float, log_path: Path, offset: int) -> str | None:
    """Wait for the startup models (registered, then READY unless ``wait_ready_s`` is 0).

    Returns:
        What to add to the "started" line, or ``None`` when it failed (reported; a model that
        cannot load stops the server).
    """
    if not models:
        return ""
    named = [m for m in models if m.name]
    unknown = [m.ident for m in models if not m.name]
    note = f"; not waited for: {', '.join(unknown)}" if unknown else ""
    if info.get("tls"):
        return f"; startup models not waited for (TLS): {', '.join(m.ident for m in models)}"
    import grpc

    from inference_service._proto import management_pb2_grpc

    what = "ready" if wait_ready_s > 0 else "registered"
    target = f"{_connect_address(str(info['management_address']))}:{info['management_port']}"
    limit = wait_ready_s if wait_ready_s > 0 else DEFAULT_WAIT_READY_S
    print(f"waiting for the startup models to be {what}: {', '.join(m.ident for m in named)} "
          f"(at most {limit:g} s)", flush=True)
    deadline = time.monotonic() + limit
    states = ["registering"] * len(named)
    done = ("ready", "registered")
    with grpc.insecure_channel(target) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        while True:
            if child.poll() is not None:
                _report_exit(child, log_path, offset)
                return None
            messages = log_messages(log_path, offset)
            key = _management_key(info, settings)
            for i, model in enumerate(named):
                if states[i] in done:
                    continue
                try:
                    desc = _describe(stub, model, key)
                except CannotFollow as exc:
                    print(f"inference-service: cannot follow the startup models ({exc}); not waiting for them",
                          file=sys.stderr)
                    return f"; startup models not waited for: {', '.join(m.ident for m in models)}"
                state = "registering" if desc is None else "registered" if wait_ready_s <= 0 else _model_state(desc)
                if state == "failed" or (desc is None and load_failure(messages, model)):
                    reason = load_failure(messages, model) or "its workers keep failing to load"
                    _fail_start(child, settings, f"startup model {model.ident} cannot load: {reason}", log_path)
                    return None
                states[i] = state
            if all(state in done for state in states):
                return f"; models {what}: {', '.join(m.ident for m in named)}{note}"
            if time.monotonic() > deadline:
                pending = ", ".join(f"{m.ident} ({state})" for m, state in zip(named, states, strict=True)
                                    if state not in done)
                print(f"inference-service: startup models not {what} within {limit:g} s: {pending}; "
                      f"the server keeps running (pid {child.pid}): wait longer with --wait-ready SECONDS, "
                      f"stop it with --stop; log: {log_path}", file=sys.stderr)
                return None
            time.sleep(POLL_S)


def _fail_start(child: subprocess.Popen[bytes], settings: Settings, cause: str, log_path: Path) -> None:
    """Report ``cause`` and stop the server just started (SIGTERM, then at most the drain timeout + 15 s)."""
    print(f"inference-service: {cause}", file=sys.stderr)
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(settings.drain_timeout_s + 15)
        print(f"inference-service: the server (pid {child.pid}) was stopped; log: {log_path}", file=sys.stderr)
    except subprocess.TimeoutExpired:
        print(f"inference-service: the server (pid {child.pid}) did not stop; log: {log_path}", file=sys.stderr)


def _foreground(settings: Settings) -> int:
    from inference_service.server import serve

    settings.instance_dir.mkdir(parents=True, exist_ok=True)
    pid_file = _pid_file(settings)
    other = _running_pid(settings)
    if other is not None and other != os.getpid():
        log.error("another instance (pid %d) uses %s; pass --run-dir to run side by side",
                  other, settings.instance_dir)
        return 1
    pid_file.write_text(str(os.getpid()))
    try:
        return asyncio.run(serve(settings))
    finally:
        if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    faulthandler.enable()  # a crash in native code still leaves a Python traceback in the log
    args = build_parser().parse_args(argv)
    level = (args.log_level or "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        print(f"inference-service: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"inference-service: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    for name in ("log_config", "workflow_store", "plugins_path", "cpp_log_config"):
        if getattr(args, name):
            log.warning("--%s is not supported by this server; ignored", name.replace("_", "-"))
    if args.stop:
        return _stop(settings, settings.drain_timeout_s + 15)
    if (problem := model_store_problem(settings)) is not None:
        print(f"inference-service: {problem}", file=sys.stderr)
        return 1
    if args.foreground:
        return _foreground(settings)
    wait_ready_s = DEFAULT_WAIT_READY_S if args.wait_ready is None else args.wait_ready
    if wait_ready_s < 0:
        print("inference-service: --wait-ready must not be negative", file=sys.stderr)
        return 2
    return _start_background(argv, settings, wait_ready_s)  # the child ignores --wait-ready


if __name__ == "__main__":
    sys.exit(main())
