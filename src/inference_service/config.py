"""Typed server settings, built once in ``main()`` from the command line and a TorchServe
``config.properties`` file (``--ts-config``; keys this server does not support are logged and
ignored). Precedence: command line > config.properties > defaults. See docs/configuration.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import javaproperties

from inference_service.archive.model_archive import UrlPolicy
from inference_service.connection_limits import CONNECTION_KEYS, ConnectionLimits, parser

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 6_553_500
DEFAULT_MAX_DOWNLOAD_BYTES = 10 * 1024**3


class ConfigError(Exception):
    """A setting is malformed (the message names the key and the file)."""


#: The command-line flag that moves each port of :meth:`Settings.binds`.
PORT_FLAGS = {"inference": "--grpc-inference-port", "management": "--grpc-management-port",
              "HTTP inference": "--http-port", "HTTP management": "--http-management-port",
              "metrics": "--metrics-port", "health": "--grpc-health-port"}


@dataclass
class Settings:
    """Every server setting (units in names: ms, s, bytes); keys and defaults: docs/configuration.md.

    Attributes:
        load_models: startup models: ``"all"``, ``"name=archive"`` or ``"archive"`` entries.
        models_config: TorchServe's ``models`` JSON (per model, per version settings).
        model_snapshot: TorchServe's ``model_snapshot`` JSON: the startup models with their
            settings (``load_models`` is then ignored, as in TorchServe).
        enable_envvars_config: read TorchServe's ``TS_*`` environment variables over the file.
        max_request_size / max_response_size: gRPC message limits in bytes.
        max_request_parts / max_json_depth / max_json_nodes: caps of an HTTP body (more: 400).
        inference_max_connection_age_ms and its twins: ``None`` is gRPC's default, unlimited.
        run_dir: per-instance directory (pid file, status file, extracted archives).
        worker_threads: torch threads per worker (0: usable CPUs / workers, where usable CPUs
            are the affinity mask capped by the cgroup CPU quota).
        worker_omp_wait_policy: the workers' ``OMP_WAIT_POLICY``; ``bounded`` spins
            ``GOMP_SPINCOUNT`` times, then sleeps.
        token_expiration_min: key lifetime in minutes (``None``: keys never expire); keys are
            rotated at half their lifetime.
        allowed_urls: full-match, case-insensitive regexes an ``http(s)://`` register URL must
            match (empty: no remote URL; local paths are always confined to the model store).
        client_ca_file: PEM CA bundle; set, clients must present a certificate it signed (mTLS).
        health_port: an optional plaintext port serving only ``grpc.health.v1``, for probes.
        http_port / http_management_port: ``None``: off; any port 0 is ephemeral.
        ts_config: the ``--ts-config`` file given, if any (disables snapshot restore).
        number_of_gpu: ``None``: all that ``nvidia-smi`` lists.
        inference_key / management_key: fixed token keys, from ``INFERENCE_SERVICE_INFERENCE_KEY``
            / ``INFERENCE_SERVICE_MANAGEMENT_KEY``; unset: random keys per start.
        metrics_mode: ``"log"`` (``"legacy"`` the same) logs handler metrics in the worker,
            ``"prometheus"`` forwards them to ``/metrics``.
        grpc_status_codes: ``"torchserve"``: the gRPC refusals carry TorchServe 0.12's codes.
        http_management_status_codes: ``"torchserve"``: HTTP management refusals carry TorchServe 0.12's statuses.
        decode_input_request: handlers get ``application/json`` inputs decoded and ``text/*``
            ones as ``str`` (TorchServe's ``decode_input_request``).
        max_engine_requests: most engine requests one OpenAI request may become (prompts x
            ``max(n, best_of)``); each may generate ``max_tokens``.
        responses_store_max_entries / _bytes / _age_s: bounds of the stored ``/v1/responses``.
    """

    inference_address: str = "127.0.0.1"
    inference_port: int = 7070
    management_address: str = "127.0.0.1"
    management_port: int = 7071
    model_store: Path | None = None
    load_models: list[str] = field(default_factory=list)
    models_config: dict[str, Any] = field(default_factory=dict)
    model_snapshot: dict[str, Any] | None = None
    enable_envvars_config: bool = False
    use_env_allowed_urls: bool = False
    default_workers_per_model: int = field(default_factory=lambda: os.cpu_count() or 1)
    job_queue_size: int = 100
    default_response_timeout_s: int = 120
    default_startup_timeout_s: int = 120
    max_request_size: int = DEFAULT_MAX_MESSAGE_BYTES
    max_response_size: int = DEFAULT_MAX_MESSAGE_BYTES
    max_request_parts: int = 1000
    max_json_depth: int = 64
    max_json_nodes: int = 100_000
    inference_max_connection_age_ms: int | None = None
    inference_max_connection_age_grace_ms: int | None = None
    management_max_connection_age_ms: int | None = None
    management_max_connection_age_grace_ms: int | None = None
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    working_dir: Path = field(default_factory=Path.cwd)
    run_dir: Path | None = None
    worker_threads: int = 0
    worker_omp_wait_policy: str = "passive"
    install_py_dep_per_model: bool = False
    snapshot: bool = True
    disable_token_auth: bool = False
    enable_model_api: bool = False
    token_expiration_min: float | None = None
    allowed_urls: list[str] = field(default_factory=list)
    max_download_size: int = DEFAULT_MAX_DOWNLOAD_BYTES
    download_timeout_s: float = 300.0
    enable_grpc_ssl: bool = False
    certificate_file: Path | None = None
    private_key_file: Path | None = None
    client_ca_file: Path | None = None
    health_address: str = "127.0.0.1"
    health_port: int | None = None
    http_address: str = "127.0.0.1"
    http_port: int | None = 8080
    http_tls: bool = False
    http_management_address: str = "127.0.0.1"
    http_management_port: int | None = 8081
    http_management_tls: bool = False
    drain_timeout_s: float = 30.0
    max_backoff_s: float = 30.0
    max_archive_bytes: int = 10 * 1024**3
    ts_config: Path | None = None
    number_of_gpu: int | None = None
    inference_key: str | None = None
    management_key: str | None = None
    log_level: str = "INFO"
    log_format: str = "plain"
    log_file: Path | None = None
    log_max_bytes: int = 100 * 1024**2
    log_config: Path | None = None
    access_log: bool = True
    metrics_address: str = "127.0.0.1"
    metrics_tls: bool = False  # metrics_address=https://... (certificate_file / private_key_file)
    metrics_port: int = 8082
    enable_metrics_api: bool = True
    metrics_mode: str = "log"
    service_envelope: str | None = None
    event_loop: str = "uvloop"
    grpc_status_codes: str = "default"
    http_management_status_codes: str = "default"
    decode_input_request: bool = True
    max_engine_requests: int = 64
    responses_store_max_entries: int = 10_000
    responses_store_max_bytes: int = 128 * 1024 * 1024
    responses_store_max_age_s: float = 3600.0

    @property
    def instance_dir(self) -> Path:
        """The per-instance directory (``run_dir``, default ``<working_dir>/.inference_service``)."""
        return self.run_dir or self.working_dir / ".inference_service"

    def binds(self) -> list[tuple[str, str, int]]:
        """``(API name, address, port)`` of every port the server listens on (0: any free port)."""
        out = [("inference", self.inference_address, self.inference_port),
               ("management", self.management_address, self.management_port)]
        if self.http_port is not None:
            out.append(("HTTP inference", self.http_address, self.http_port))
        if self.http_management_port is not None and not self.http_shared:
            out.append(("HTTP management", self.http_management_address, self.http_management_port))
        if self.enable_metrics_api:
            out.append(("metrics", self.metrics_address, self.metrics_port))
        if self.health_port is not None:
            out.append(("health", self.health_address, self.health_port))
        return out

    def ports_message(self) -> str:
        """Every port of :meth:`binds` with the flag that moves it (said with each port clash)."""
        return "the server's ports: " + ", ".join(
            f"{api} {port or 'any'} ({PORT_FLAGS[api]})" for api, _, port in self.binds())

    @property
    def http_shared(self) -> bool:
        """Whether both HTTP APIs share one port: ``inference_address`` and ``management_address``
        name the same host and port (not 0), as KServe's config.properties has them."""
        return (self.http_port is not None and self.http_port != 0
                and (self.http_address, self.http_port) == (self.http_management_address, self.http_management_port))

    @property
    def files_dir(self) -> Path:
        """Where ``key_file.json``, ``logs/`` and snapshots go: the working directory, as TorchServe,
        or ``--run-dir``, so servers sharing a working directory never share them."""
        return self.run_dir or self.working_dir

    @property
    def url_policy(self) -> UrlPolicy:
        """Which ``http(s)://`` register URLs are fetched, and how."""
        return UrlPolicy(tuple(self.allowed_urls), self.max_download_size, self.download_timeout_s)

    @property
    def inference_http_url(self) -> str:
        """The HTTP inference API in TorchServe's ``inference_address`` form (``http://127.0.0.1:8080``)."""
        return _http_url(self.http_tls, self.http_address, self.http_port)

    @inference_http_url.setter
    def inference_http_url(self, bind: tuple[bool, str, int]) -> None:
        """Set ``http_tls``, ``http_address`` and ``http_port`` from :func:`parse_http_url`'s result."""
        self.http_tls, self.http_address, self.http_port = bind

    @property
    def management_http_url(self) -> str:
        """The HTTP management API in TorchServe's ``management_address`` form (``http://127.0.0.1:8081``)."""
        return _http_url(self.http_management_tls, self.http_management_address, self.http_management_port)

    @management_http_url.setter
    def management_http_url(self, bind: tuple[bool, str, int]) -> None:
        """Set ``http_management_tls``, ``_address`` and ``_port`` from :func:`parse_http_url`'s result."""
        self.http_management_tls, self.http_management_address, self.http_management_port = bind

    @property
    def metrics_url(self) -> str:
        """The metrics API in TorchServe's ``metrics_address`` form (``http://127.0.0.1:8082``)."""
        return _http_url(self.metrics_tls, self.metrics_address, self.metrics_port)

    @metrics_url.setter
    def metrics_url(self, bind: tuple[bool, str, int]) -> None:
        """Set ``metrics_tls``, ``metrics_address`` and ``metrics_port`` (config.properties' ``metrics_address``)."""
        self.metrics_tls, self.metrics_address, self.metrics_port = bind


def _http_url(tls: bool, host: str, port: int | None) -> str:
    """``http(s)://host:port`` as TorchServe's ``*_address`` keys spell it (IPv6 hosts in brackets)."""
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


# config.properties key -> (Settings field, parser)
def _int(value: str) -> int:
    return int(value.strip())


def _bool(value: str) -> bool:
    return value.strip().lower() == "true"


def _exactly_true(value: str) -> bool:
    # TorchServe's worker decodes only when TS_DECODE_INPUT_REQUEST is "true": "True" turns it off
    return value.strip() == "true"


def _path(value: str) -> Path:
    return Path(value.strip()).expanduser()


def _models(value: str) -> list[str]:
    value = value.strip()
    if value in ("", "standalone"):
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


def _positive_float(value: str) -> float:
    number = float(value.strip())
    if not number > 0 or number == float("inf"):
        raise ValueError("must be a positive number")
    return number


def _positive_int(value: str) -> int:
    number = int(value.strip())
    if number < 1:
        raise ValueError("must be an integer >= 1")
    return number


def _regexes(value: str) -> list[str]:
    patterns = [item.strip() for item in value.split(",") if item.strip()]
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from exc
    return patterns


_HTTP_URL = re.compile(r"(?i)(https?)://(\[[0-9a-f:.]+\]|[^:/\[\]]+)(?::(\d+))?/?")


def parse_http_url(value: str) -> tuple[bool, str, int]:
    """TorchServe's ``inference_address`` (``http(s)://host[:port]``) as ``(tls, host, port)``.

    As TorchServe, a missing port is 80 or 443. Raises ValueError for another form (``unix:``).
    """
    match = _HTTP_URL.fullmatch(value.strip())
    if match is None:
        raise ValueError("must be http://host:port or https://host:port")
    tls = match.group(1).lower() == "https"
    port = int(match.group(3)) if match.group(3) is not None else (443 if tls else 80)
    if port > 65535:
        raise ValueError(f"port {port} is out of range 0..65535")
    return tls, match.group(2).strip("[]"), port


def _json(value: str) -> dict[str, Any]:
    loaded = json.loads(value)
    if not isinstance(loaded, dict):
        raise ValueError("must be a JSON object")
    return loaded


def _model_snapshot(value: str) -> dict[str, Any]:
    """TorchServe's ``model_snapshot``: ``{"models": {name: {version: {"marName": ..., ...}}}}``."""
    snapshot = _json(value)
    models = snapshot.get("models")
    if not isinstance(models, dict):
        raise ValueError('must hold a "models" object')
    for name, versions in models.items():
        if not isinstance(versions, dict) or not versions:
            raise ValueError(f"model {name!r}: must map versions to settings")
        for version, entry in versions.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("marName"), str):
                raise ValueError(f"model {name!r} version {version!r}: needs a marName")
            _check_integers(entry, f"model {name!r} version {version!r}")
    return snapshot


#: The integer settings of a model version in the ``models`` and ``model_snapshot`` JSON.
_INTEGER_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")


def _check_integers(entry: dict[str, Any], where: str) -> None:
    """ValueError naming the key of ``entry`` that is not an integer."""
    for key in _INTEGER_KEYS:
        value = entry.get(key)
        if key in entry and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}: {key} must be an integer, got {json.dumps(value)[:40]}")


def _models_json(value: str) -> dict[str, Any]:
    """TorchServe's ``models``: ``{name: {version: {"marName": ..., "minWorkers": ..., ...}}}``."""
    models = _json(value)
    for name, versions in models.items():
        if not isinstance(versions, dict):
            raise ValueError(f"model {name!r}: must map versions to settings")
        for version, entry in versions.items():
            if not isinstance(entry, dict):
                raise ValueError(f"model {name!r} version {version!r}: must be an object of settings")
            _check_integers(entry, f"model {name!r} version {version!r}")
    return models


def _choice(*choices: str) -> Any:
    def parse(value: str) -> str:
        text = value.strip().lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


def _level(value: str) -> str:
    return str(_choice("debug", "info", "warning", "error", "critical")(value)).upper()


PROPERTY_KEYS: dict[str, tuple[str, Any]] = {
    **{key: (f"connections.{name}", parser(key)) for key, (name, _, _) in CONNECTION_KEYS.items()},
    "grpc_inference_address": ("inference_address", str.strip),
    "grpc_inference_port": ("inference_port", _int),
    "grpc_management_address": ("management_address", str.strip),
    "grpc_management_port": ("management_port", _int),
    "model_store": ("model_store", _path),
    "load_models": ("load_models", _models),
    "models": ("models_config", _models_json),
    "model_snapshot": ("model_snapshot", _model_snapshot),
    "enable_envvars_config": ("enable_envvars_config", _bool),
    "use_env_allowed_urls": ("use_env_allowed_urls", _bool),
    "default_workers_per_model": ("default_workers_per_model", _int),
    "job_queue_size": ("job_queue_size", _int),
    "default_response_timeout": ("default_response_timeout_s", _int),
    "default_startup_timeout": ("default_startup_timeout_s", _int),
    "max_request_size": ("max_request_size", _int),
    "max_response_size": ("max_response_size", _int),
    "max_request_parts": ("max_request_parts", _positive_int),
    "max_json_depth": ("max_json_depth", _positive_int),
    "max_json_nodes": ("max_json_nodes", _positive_int),
    "grpc_inference_max_connection_age_ms": ("inference_max_connection_age_ms", _int),
    "grpc_inference_max_connection_age_grace_ms": ("inference_max_connection_age_grace_ms", _int),
    "grpc_management_max_connection_age_ms": ("management_max_connection_age_ms", _int),
    "grpc_management_max_connection_age_grace_ms": ("management_max_connection_age_grace_ms", _int),
    "install_py_dep_per_model": ("install_py_dep_per_model", _bool),
    "disable_token_authorization": ("disable_token_auth", _bool),
    "enable_model_api": ("enable_model_api", _bool),
    "token_expiration_min": ("token_expiration_min", _positive_float),
    "allowed_urls": ("allowed_urls", _regexes),
    "max_download_size": ("max_download_size", _int),
    "download_timeout": ("download_timeout_s", _positive_float),
    "enable_grpc_ssl": ("enable_grpc_ssl", _bool),
    "certificate_file": ("certificate_file", _path),
    "private_key_file": ("private_key_file", _path),
    "client_ca_file": ("client_ca_file", _path),
    "grpc_health_address": ("health_address", str.strip),
    "grpc_health_port": ("health_port", _int),
    "inference_address": ("inference_http_url", parse_http_url),
    "management_address": ("management_http_url", parse_http_url),
    "drain_timeout_sec": ("drain_timeout_s", float),
    "number_of_gpu": ("number_of_gpu", _int),
    "worker_restart_max_backoff_sec": ("max_backoff_s", float),
    "max_archive_size": ("max_archive_bytes", _int),
    "metrics_address": ("metrics_url", parse_http_url),
    "enable_metrics_api": ("enable_metrics_api", _bool),
    "metrics_mode": ("metrics_mode", _choice("log", "prometheus", "legacy")),
    "enable_access_log": ("access_log", _bool),
    "log_format": ("log_format", _choice("plain", "json")),
    "log_level": ("log_level", _level),
    "service_envelope": ("service_envelope", _choice("body", "json", "kserve", "kservev2")),
    "event_loop": ("event_loop", _choice("uvloop", "asyncio")),
    "grpc_status_codes": ("grpc_status_codes", _choice("default", "torchserve")),
    "http_management_status_codes": ("http_management_status_codes", _choice("default", "torchserve")),
    "decode_input_request": ("decode_input_request", _exactly_true),
    "max_engine_requests": ("max_engine_requests", _positive_int),
    "responses_store_max_entries": ("responses_store_max_entries", _positive_int),
    "responses_store_max_bytes": ("responses_store_max_bytes", _positive_int),
    "responses_store_max_age_sec": ("responses_store_max_age_s", _positive_float),
    "worker_omp_wait_policy": ("worker_omp_wait_policy", _choice("passive", "active", "bounded")),
}


def read_properties(path: Path) -> dict[str, str]:
    """Parse a Java-properties file (TorchServe's ``config.properties``); ConfigError if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return dict(javaproperties.load(f))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc


def apply_properties(settings: Settings, props: dict[str, str], source: str) -> list[str]:
    """Set ``settings`` fields from config.properties entries; returns the unsupported keys (logged).

    Raises ConfigError for a supported key with a malformed value.
    """
    unsupported = []
    for key, value in props.items():
        target = PROPERTY_KEYS.get(key)
        if target is None or not target[0]:
            unsupported.append(key)
            log.warning("config key %r in %s is not supported by this server; ignored", key, source)
            continue
        name, parse = target
        owner, _, name = name.rpartition(".")  # "connections.idle_timeout_s": a field of a field
        try:
            setattr(getattr(settings, owner) if owner else settings, name, parse(value))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: invalid value for {key}: {value!r} ({exc})") from exc
    return unsupported
