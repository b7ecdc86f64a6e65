"""TorchServe 0.12's ``torchserve`` command line and ``TS_*`` environment variables, mapped onto
this server's (``inference-service``'s flags and config.properties keys).

The ``torchserve`` console script parses TorchServe's arguments (its ``ts/arg_parser.py``) and
runs ``inference-service`` with :func:`server_argv`. ``--start`` in the main process of a
container (pid 1) serves in the foreground: TorchServe's ``--start`` returns at once, and a
container whose main process returns stops. See docs/torchserve-compatibility.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from inference_service.config import Settings

#: TorchServe's version whose command line and environment variables these are.
TORCHSERVE_VERSION = "0.12.0"

# config.properties keys TorchServe 0.12 reads from ``TS_<KEY>`` (its ConfigManager's TS_* fields)
_ENV_KEYS = """
    inference_address management_address metrics_address load_models blacklist_env_vars
    default_workers_per_model default_response_timeout default_startup_timeout unregister_model_timeout
    number_of_netty_threads netty_client_threads job_queue_size number_of_gpu metrics_config metrics_mode
    model_metrics_auto_detect disable_system_metrics ipex_enable cpu_launcher_enable cpu_launcher_args
    ipex_gpu_enable async_logging cors_allowed_origin cors_allowed_methods cors_allowed_headers
    decode_input_request keystore keystore_pass keystore_type certificate_file private_key_file
    max_request_size max_response_size limit_max_image_pixels default_service_handler service_envelope
    model_server_home model_store prefer_direct_buffer allowed_urls install_py_dep_per_model
    enable_metrics_api grpc_inference_address grpc_management_address grpc_inference_port
    grpc_management_port grpc_inference_max_connection_age_ms grpc_management_max_connection_age_ms
    grpc_inference_max_connection_age_grace_ms grpc_management_max_connection_age_grace_ms
    enable_grpc_ssl initial_worker_port initial_distribution_port workflow_store cpp_log_config
    disable_token_authorization enable_model_api debug
""".split()
#: Environment variable -> config.properties key (``enable_envvars_config=true``), as TorchServe 0.12.
TS_ENVIRONMENT: dict[str, str] = {
    **{f"TS_{key.upper()}": key for key in _ENV_KEYS},
    "TS_TOKEN_EXPIRATION_TIME_MIN": "token_expiration_min",
    "TS_OPEN_INFERENCE_PROTOCOL": "ts_open_inference_protocol",
    "TS_HEADER_KEY_SEQUENCE_ID": "ts_header_key_sequence_id",
    "TS_HEADER_KEY_SEQUENCE_START": "ts_header_key_sequence_start",
    "TS_HEADER_KEY_SEQUENCE_END": "ts_header_key_sequence_end",
}


def environment_properties(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """The config.properties entries the ``TS_*`` variables of ``environ`` set, when the file said
    ``enable_envvars_config=true`` (else none); ``TS_ALLOWED_URLS`` only with
    ``use_env_allowed_urls=true``, as TorchServe. An empty variable sets nothing (a template KServe
    left empty)."""
    if not settings.enable_envvars_config:
        return {}
    return {key: environ[name] for name, key in TS_ENVIRONMENT.items()
            if environ.get(name) and (key != "allowed_urls" or settings.use_env_allowed_urls)}


def build_parser() -> argparse.ArgumentParser:
    """TorchServe 0.12's ``torchserve`` parser: its flags, aliases and mutually exclusive modes."""
    p = argparse.ArgumentParser(prog="torchserve",
                                description="TorchServe 0.12's command line, served by inference-service")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    mode.add_argument("--start", action="store_true",
                      help="start the server (also without --start); in the background unless --foreground "
                           "or the process is a container's main process (pid 1)")
    mode.add_argument("--stop", action="store_true", help="stop the running server")
    p.add_argument("--ts-config", help="config.properties (the TS_CONFIG_FILE environment variable overrides it)")
    p.add_argument("--model-store", help="directory holding model archives")
    p.add_argument("--workflow-store", help="not supported: ignored with a warning")
    p.add_argument("--models", nargs="+", metavar="MODEL", help="[name=]archive models to load at startup, or all")
    p.add_argument("--log-config", help="a Python logging configuration (YAML or JSON); a Log4j .xml is ignored")
    p.add_argument("--cpp-log-config", help="not supported: ignored with a warning")
    p.add_argument("--foreground", action="store_true", help="run in the foreground")
    p.add_argument("--no-config-snapshots", "--ncs", action="store_true", dest="ncs",
                   help="do not write or restore config snapshots")
    p.add_argument("--plugins-path", "--ppath", help="not supported: ignored with a warning")
    p.add_argument("--disable-token-auth", "--dt", action="store_true", help="turn token authorization off")
    p.add_argument("--enable-model-api", action="store_true", help="allow registering and unregistering models")
    return p


def server_argv(args: argparse.Namespace, environ: Mapping[str, str], pid: int) -> tuple[list[str], list[str]]:
    """``inference-service``'s arguments for TorchServe's ``args``, and the notes to print first.

    ``pid`` is this process's: 1 (a container's main process) keeps ``--start`` in the foreground.
    """
    notes: list[str] = []
    if args.stop:
        return ["--stop"], notes
    argv = ["--foreground"] if args.foreground or pid == 1 else ["--start"]
    if pid == 1 and not args.foreground:
        notes.append("running as a container's main process (pid 1): serving in the foreground")
    ts_config = environ.get("TS_CONFIG_FILE") or args.ts_config
    if ts_config:
        argv += ["--ts-config", ts_config]
    if args.model_store:
        argv += ["--model-store", args.model_store]
    if args.models:
        argv += ["--models", *args.models]
    if args.log_config:
        if args.log_config.lower().endswith(".xml"):
            notes.append(f"--log-config {args.log_config} is a Log4j configuration: ignored (this server "
                         "reads a Python logging configuration in YAML or JSON)")
        else:
            argv += ["--log-config", args.log_config]
    for flag, value in (("--workflow-store", args.workflow_store), ("--cpp-log-config", args.cpp_log_config),
                        ("--plugins-path", args.plugins_path)):
        if value:
            argv += [flag, value]
    for flag, on in (("--ncs", args.ncs), ("--disable-token-auth", args.disable_token_auth),
                     ("--enable-model-api", args.enable_model_api)):
        if on:
            argv.append(flag)
    return argv, notes
