"""Command line: ``inference-service`` (and ``python -m inference_service``).

Accepts the ``torchserve`` flags users' scripts already pass plus options of its own, and builds
the run's one :class:`~inference_service.config.Settings` (:func:`settings_from_args`).
See docs/configuration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from inference_service import __version__
from inference_service.config import ConfigError, Settings, apply_properties, read_properties
from inference_service.launch import torchserve
from inference_service.launch.launcher import (
    DEFAULT_WAIT_READY_S,
    pid_file,
    running_pid,
    start_background,
    stop_instance,
)
from inference_service.launch.preflight import model_store_problem
from inference_service.launch.rundir import PidLock, RunDirError, prepare_run_dir, stale_pid
from inference_service.observability.accesslog import configure_logging
from inference_service.observability.logfiles import apply_log_config, log_to_file, read_log_config
from inference_service.security import tls

log = logging.getLogger("inference_service")

def build_parser() -> argparse.ArgumentParser:
    """The argument parser (TorchServe's flags first, then this server's)."""
    p = argparse.ArgumentParser(
        prog="inference-service",
        description="gRPC model server, wire-compatible with TorchServe's gRPC APIs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the version and exit")
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
    p.add_argument("--api-key", metavar="KEY",
                   help="a fixed inference key, kept across restarts, as vLLM's and llama.cpp's --api-key (at "
                        "least 16 characters; the process list shows it: prefer --api-key-file or "
                        "INFERENCE_SERVICE_INFERENCE_KEY); default: a new random key at every start")
    p.add_argument("--api-key-file", type=Path, metavar="FILE", help="read the fixed inference key from FILE")
    p.add_argument("--management-key-file", type=Path, metavar="FILE",
                   help="read a fixed management key from FILE (or INFERENCE_SERVICE_MANAGEMENT_KEY)")
    p.add_argument("--enable-model-api", action="store_true",
                   help="allow RegisterModel and UnregisterModel")
    p.add_argument("--log-config", type=Path,
                   help="a Python logging configuration (dictConfig, YAML or JSON) applied over the defaults")
    p.add_argument("--log-file", type=Path, help="write the log to this file, rotated by size (--start: "
                                                "logs/inference_service.log)")
    p.add_argument("--log-max-bytes", type=int, help="size at which the log file rotates (104857600)")
    for name in ("--workflow-store", "--plugins-path", "--cpp-log-config"):
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
    p.add_argument("--http-management-address",
                   help="HTTP/1.1 management API (TorchServe's REST management API) bind address (127.0.0.1)")
    p.add_argument("--http-management-port", type=int,
                   help="HTTP/1.1 management API port (8081; 0 = any free port)")
    p.add_argument("--no-http-management", action="store_true", help="do not serve the HTTP/1.1 management API")
    p.add_argument("--no-http", action="store_true",
                   help="do not serve the HTTP/1.1 APIs (neither inference nor management)")
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
    p.add_argument("--event-loop", choices=("uvloop", "asyncio"), default=None,
                   help="the frontend's event loop: uvloop (default) or the standard library's asyncio "
                        "(event_loop)")
    p.add_argument("--grpc-status-codes", choices=("default", "torchserve"), default=None,
                   help="status codes of refused gRPC calls: this server's (default) or TorchServe 0.12's "
                        "code and message for every refusal (grpc_status_codes)")
    p.add_argument("--http-management-status-codes", choices=("default", "torchserve"), default=None,
                   help="status codes of refused HTTP management calls: this server's (default) or "
                        "TorchServe 0.12's where they differ (http_management_status_codes)")
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


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The ``event_loop`` setting's loop constructor (uvloop's or asyncio's); ConfigError if uvloop is missing."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(f"event_loop=uvloop, but uvloop cannot be imported ({exc}); install it or "
                          "choose --event-loop asyncio") from exc
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings`: defaults < ``--ts-config`` < command line; ConfigError for an
    unreadable or malformed config, or TLS settings that do not fit together."""
    settings = Settings()
    if args.ts_config is not None:
        apply_properties(settings, read_properties(args.ts_config), str(args.ts_config))
        settings.ts_config = args.ts_config
        # enable_envvars_config=true: TorchServe's TS_* variables over the file
        apply_properties(settings, torchserve.environment_properties(settings, os.environ), "the TS_* environment")
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
        "log_file": args.log_file.resolve() if args.log_file else None,
        "log_max_bytes": args.log_max_bytes,
        "log_config": args.log_config,
        "event_loop": args.event_loop,
        "grpc_status_codes": args.grpc_status_codes,
        "http_management_status_codes": args.http_management_status_codes,
        "metrics_address": args.metrics_address,
        "metrics_port": args.metrics_port,
        "metrics_mode": args.metrics_mode,
        "health_address": args.grpc_health_address,
        "health_port": args.grpc_health_port,
        "http_address": args.http_address,
        "http_port": args.http_port,
        "http_management_address": args.http_management_address,
        "http_management_port": args.http_management_port,
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
    if args.no_http or args.no_http_management:
        settings.http_management_port = None
    for key, port, https in (("inference_address", settings.http_port, settings.http_tls),
                             ("management_address", settings.http_management_port, settings.http_management_tls),
                             ("metrics_address", settings.metrics_port, settings.metrics_tls)):
        if port is not None and https and (settings.certificate_file is None or settings.private_key_file is None):
            raise ConfigError(f"an https:// {key} needs certificate_file and private_key_file "
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
    settings.inference_key, source = _fixed_key(args.api_key, "--api-key", args.api_key_file, "--api-key-file",
                                                "INFERENCE_SERVICE_INFERENCE_KEY")
    settings.management_key, management_source = _fixed_key(
        None, "", args.management_key_file, "--management-key-file", "INFERENCE_SERVICE_MANAGEMENT_KEY")
    for name, fixed in ((source, settings.inference_key), (management_source, settings.management_key)):
        if fixed is not None and len(fixed) < 16:
            raise ConfigError(f"{name} must have at least 16 characters")
    if settings.http_shared and settings.http_tls != settings.http_management_tls:
        raise ConfigError("inference_address and management_address name one port, but only one of them "
                          "is https://")
    for port in (settings.inference_port, settings.management_port, settings.health_port or 0,
                 settings.http_port or 0, settings.http_management_port or 0, settings.metrics_port):
        if not 0 <= port <= 65535:
            raise ConfigError(f"port {port} is out of range 0..65535")
    return settings


def _fixed_key(value: str | None, flag: str, path: Path | None, file_flag: str, env: str) -> tuple[str | None, str]:
    """A fixed key and where it came from: the flag, else the file (stripped), else the environment."""
    if value:
        return value, flag
    if path is not None:
        try:
            key = path.expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {file_flag} {path}: {exc}") from exc
        if not key:
            raise ConfigError(f"{file_flag} {path} is empty")
        return key, f"{file_flag} {path}"
    return os.environ.get(env) or None, env


def _foreground(settings: Settings) -> int:
    """``--foreground``: serve in this process until SIGTERM/SIGINT, with the instance's pid file
    written meanwhile. Returns the exit status (1: another instance runs in the same instance dir;
    2: the event loop chosen cannot be had)."""
    from inference_service.server import serve

    try:
        new_loop = loop_factory(settings.event_loop)
    except ConfigError as exc:
        print(f"inference-service: {exc}", file=sys.stderr)
        return 2
    pid_path = pid_file(settings)
    try:
        prepare_run_dir(settings.instance_dir)
        stale = stale_pid(pid_path)
        lock = PidLock.acquire(pid_path)
    except (RunDirError, OSError) as exc:
        log.error("%s", exc)
        return 1
    if lock is None:
        log.error("another instance (pid %s) uses %s; pass --run-dir to run side by side",
                  running_pid(settings), settings.instance_dir)
        return 1
    if stale:
        log.warning("replaced the stale pid file %s (pid %s: no server held it)", pid_path, stale[:12])
    log.info("event loop: %s", settings.event_loop)
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            return runner.run(serve(settings))
    finally:
        lock.release()


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
    try:
        log_config = read_log_config(settings.log_config) if settings.log_config else None
    except ValueError as exc:
        print(f"inference-service: {exc}", file=sys.stderr)
        return 2
    if settings.log_max_bytes < 1:
        print("inference-service: --log-max-bytes must be positive", file=sys.stderr)
        return 2
    if args.foreground:
        if settings.log_file is not None:
            log_to_file(settings.log_file, settings.log_max_bytes)
        if log_config is not None and settings.log_config is not None:
            try:
                apply_log_config(log_config, settings.log_config)
            except ValueError as exc:
                log.error("%s", exc)
                return 2
    for name in ("workflow_store", "plugins_path", "cpp_log_config"):
        if getattr(args, name):
            log.warning("--%s is not supported by this server; ignored", name.replace("_", "-"))
    if args.stop:
        return stop_instance(settings, settings.drain_timeout_s + 15)
    if (problem := model_store_problem(settings)) is not None:
        print(f"inference-service: {problem}", file=sys.stderr)
        return 1
    if args.foreground:
        return _foreground(settings)
    wait_ready_s = DEFAULT_WAIT_READY_S if args.wait_ready is None else args.wait_ready
    if wait_ready_s < 0:
        print("inference-service: --wait-ready must not be negative", file=sys.stderr)
        return 2
    return start_background(argv, settings, wait_ready_s)  # the child ignores --wait-ready


def torchserve_main(argv: list[str] | None = None) -> int:
    """The ``torchserve`` command: TorchServe 0.12's arguments, served by :func:`main`
    (:mod:`inference_service.launch.torchserve`). Returns the process exit status."""
    args = torchserve.build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        print(f"TorchServe Version is {torchserve.TORCHSERVE_VERSION} (inference-service {__version__})")
        return 0
    server_args, notes = torchserve.server_argv(args, os.environ, os.getpid())
    for note in notes:
        print(f"torchserve: {note}", file=sys.stderr, flush=True)
    return main(server_args)


if __name__ == "__main__":
    sys.exit(main())
