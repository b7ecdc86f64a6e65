"""Typed server settings, built once in ``main()`` from the command line and a
TorchServe ``config.properties`` file (``--ts-config``).

Precedence: command line > config.properties > defaults (TorchServe's where it
has one). Keys of config.properties this server does not support are logged
once at WARNING and otherwise ignored, so a real TorchServe file starts it.
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

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 6_553_500
DEFAULT_MAX_DOWNLOAD_BYTES = 10 * 1024**3


class ConfigError(Exception):
    """A setting is malformed (the message names the key and the file)."""


@dataclass
class Settings:
    """Every server setting (units in names: ms, s, bytes).

    Attributes:
        inference_address / inference_port: inference API bind (127.0.0.1:7070; port 0 = ephemeral).
        management_address / management_port: management API bind (127.0.0.1:7071).
        model_store: directory archives are read from.
        load_models: startup models: ``"all"``, ``"name=archive"`` or ``"archive"`` entries.
        models_config: TorchServe's ``models`` JSON (per model, per version settings).
        default_workers_per_model: workers of each startup model without minWorkers
            (TorchServe's default: the number of CPUs).
        job_queue_size: bound of each model's job queue (100).
        default_response_timeout_s / default_startup_timeout_s: 120 s each.
        max_request_size / max_response_size: gRPC message limits in bytes (6553500).
        inference_max_connection_age_ms / ..._grace_ms, and management twins: gRPC
            connection age settings (``None``: gRPC's default, unlimited).
        working_dir: where logs and snapshots go (the current directory).
        run_dir: per-instance directory (pid file, status file, extracted archives).
        worker_threads: torch threads per worker (0: cores / workers).
        install_py_dep_per_model: install archives' requirements.txt (false, as TorchServe).
        snapshot: write config snapshots (``--ncs`` turns off).
        disable_token_auth / enable_model_api: security switches.
        token_expiration_min: key lifetime in minutes (fractions allowed; ``None``: keys never
            expire); keys are rotated at half their lifetime (see :mod:`inference_service.auth`).
        allowed_urls: full-match, case-insensitive regexes an ``http(s)://`` register URL must
            match (empty: no remote URL; local paths are always confined to the model store).
        max_download_size / download_timeout_s: caps of one remote archive download (bytes, s).
        enable_grpc_ssl / certificate_file / private_key_file: TLS on both gRPC ports (PEM files).
        client_ca_file: PEM CA bundle; set, clients must present a certificate it signed (mTLS).
        health_address / health_port: an optional plaintext port serving only
            ``grpc.health.v1`` (``None``: none), for probes when the main ports use TLS.
        drain_timeout_s: how long in-flight requests may finish at shutdown.
        max_backoff_s: cap of the worker restart back-off (s).
        max_archive_bytes: cap on a model archive's uncompressed size (10 GiB).
        ts_config: the ``--ts-config`` file given, if any (disables snapshot restore).
        number_of_gpu: GPUs to use (TorchServe's key; ``None``: all that ``nvidia-smi`` lists).
        inference_key / management_key: fixed token keys, from the environment variables
            ``INFERENCE_SERVICE_INFERENCE_KEY`` / ``INFERENCE_SERVICE_MANAGEMENT_KEY`` (e.g. a
            Kubernetes Secret shared by all replicas); unset: random keys per start.
        log_level: logging level name.
    """

    inference_address: str = "127.0.0.1"
    inference_port: int = 7070
    management_address: str = "127.0.0.1"
    management_port: int = 7071
    model_store: Path | None = None
    load_models: list[str] = field(default_factory=list)
    models_config: dict[str, Any] = field(default_factory=dict)
    default_workers_per_model: int = field(default_factory=lambda: os.cpu_count() or 1)
    job_queue_size: int = 100
    default_response_timeout_s: int = 120
    default_startup_timeout_s: int = 120
    max_request_size: int = DEFAULT_MAX_MESSAGE_BYTES
    max_response_size: int = DEFAULT_MAX_MESSAGE_BYTES
    inference_max_connection_age_ms: int | None = None
    inference_max_connection_age_grace_ms: int | None = None
    management_max_connection_age_ms: int | None = None
    management_max_connection_age_grace_ms: int | None = None
    working_dir: Path = field(default_factory=Path.cwd)
    run_dir: Path | None = None
    worker_threads: int = 0
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
    drain_timeout_s: float = 30.0
    max_backoff_s: float = 30.0
    max_archive_bytes: int = 10 * 1024**3
    ts_config: Path | None = None
    number_of_gpu: int | None = None
    inference_key: str | None = None
    management_key: str | None = None
    log_level: str = "INFO"

    @property
    def instance_dir(self) -> Path:
        """The per-instance directory (``run_dir``, default ``<working_dir>/.inference_service``)."""
        return self.run_dir or self.working_dir / ".inference_service"


# config.properties key -> (Settings field, parser)
def _int(value: str) -> int:
    return int(value.strip())


def _bool(value: str) -> bool:
    return value.strip().lower() == "true"


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


def _regexes(value: str) -> list[str]:
    patterns = [item.strip() for item in value.split(",") if item.strip()]
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from exc
    return patterns


def _json(value: str) -> dict[str, Any]:
    loaded = json.loads(value)
    if not isinstance(loaded, dict):
        raise ValueError("must be a JSON object")
    return loaded


PROPERTY_KEYS: dict[str, tuple[str, Any]] = {
    "grpc_inference_address": ("inference_address", str.strip),
    "grpc_inference_port": ("inference_port", _int),
    "grpc_management_address": ("management_address", str.strip),
    "grpc_management_port": ("management_port", _int),
    "model_store": ("model_store", _path),
    "load_models": ("load_models", _models),
    "models": ("models_config", _json),
    "default_workers_per_model": ("default_workers_per_model", _int),
    "job_queue_size": ("job_queue_size", _int),
    "default_response_timeout": ("default_response_timeout_s", _int),
    "default_startup_timeout": ("default_startup_timeout_s", _int),
    "max_request_size": ("max_request_size", _int),
    "max_response_size": ("max_response_size", _int),
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
    "drain_timeout_sec": ("drain_timeout_s", float),
    "number_of_gpu": ("number_of_gpu", _int),
    "worker_restart_max_backoff_sec": ("max_backoff_s", float),
    "max_archive_size": ("max_archive_bytes", _int),
}


def read_properties(path: Path) -> dict[str, str]:
    """Parse a Java-properties file (TorchServe's ``config.properties``).

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return dict(javaproperties.load(f))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc


def apply_properties(settings: Settings, props: dict[str, str], source: str) -> list[str]:
    """Set ``settings`` fields from config.properties entries.

    Returns:
        The keys this server does not support (each logged once at WARNING).

    Raises:
        ConfigError: a supported key has a malformed value.
    """
    unsupported = []
    for key, value in props.items():
        target = PROPERTY_KEYS.get(key)
        if target is None or not target[0]:
            unsupported.append(key)
            log.warning("config key %r in %s is not supported by this server; ignored", key, source)
            continue
        name, parse = target
        try:
            setattr(settings, name, parse(value))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: invalid value for {key}: {value!r} ({exc})") from exc
    return unsupported
