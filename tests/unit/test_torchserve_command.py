"""TorchServe 0.12's command line and config keys as this server reads them: ``torchserve``'s
arguments, the ``TS_*`` environment (``enable_envvars_config``), ``model_snapshot`` and one port for
both HTTP APIs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from inference_service.cli import build_parser, settings_from_args, torchserve_main
from inference_service.config import ConfigError, Settings, apply_properties
from inference_service.launch import torchserve
from inference_service.serving.snapshot import snapshot_models
from inference_service.serving.startup import snapshot_to_restore, startup_requests


def _argv(args: list[str], environ: dict[str, str] | None = None, pid: int = 4242) -> tuple[list[str], list[str]]:
    return torchserve.server_argv(torchserve.build_parser().parse_args(args), environ or {}, pid)


def test_kserve_runtime_argv_maps_onto_the_server():
    argv, notes = _argv(["--start", "--model-store=/mnt/models/model-store",
                         "--ts-config=/mnt/models/config/config.properties", "--disable-token-auth",
                         "--enable-model-api"])
    assert argv == ["--start", "--ts-config", "/mnt/models/config/config.properties", "--model-store",
                    "/mnt/models/model-store", "--disable-token-auth", "--enable-model-api"]
    assert notes == []
    build_parser().parse_args(argv)  # inference-service takes them


def test_start_as_a_containers_main_process_stays_in_the_foreground():
    argv, notes = _argv(["--start", "--model-store=/m"], pid=1)
    assert argv[0] == "--foreground" and "--start" not in argv
    assert notes == ["running as a container's main process (pid 1): serving in the foreground"]
    assert _argv(["--model-store=/m"])[0][0] == "--start"  # TorchServe starts without --start too
    assert _argv(["--start", "--foreground"])[0] == ["--foreground"]
    assert _argv(["--stop"], pid=1)[0] == ["--stop"]


def test_aliases_environment_and_ignored_flags():
    argv, notes = _argv(["--dt", "--ncs", "--ts-config", "a.properties", "--models", "a=a.mar", "b.mar",
                         "--log-config", "log4j2.xml", "--ppath", "/plugins"], {"TS_CONFIG_FILE": "env.properties"})
    assert argv == ["--start", "--ts-config", "env.properties", "--models", "a=a.mar", "b.mar",
                    "--plugins-path", "/plugins", "--ncs", "--disable-token-auth"]
    assert notes == ["--log-config log4j2.xml is a Log4j configuration: ignored (this server reads a Python "
                     "logging configuration in YAML or JSON)"]
    assert _argv(["--log-config", "logging.yaml"])[0][-2:] == ["--log-config", "logging.yaml"]


def test_version_and_refused_arguments(capsys):
    assert torchserve_main(["-v"]) == 0
    assert capsys.readouterr().out.startswith("TorchServe Version is 0.12.0 (inference-service ")
    for bad in (["--start", "--stop"], ["--workers", "2"]):
        with pytest.raises(SystemExit) as exc:
            torchserve_main(bad)
        assert exc.value.code == 2


def _settings(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None,
              args: tuple[str, ...] = ()) -> Settings:
    config = tmp_path / "config.properties"
    config.write_text(text)
    for name in [n for n in torchserve.TS_ENVIRONMENT if n in os.environ]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return settings_from_args(build_parser().parse_args(["--ts-config", str(config), *args]))


def test_ts_environment_overrides_the_file_only_when_enabled(tmp_path, monkeypatch):
    env = {"TS_SERVICE_ENVELOPE": "kservev2", "TS_GRPC_INFERENCE_ADDRESS": "0.0.0.0", "TS_JOB_QUEUE_SIZE": "7",
           "TS_ALLOWED_URLS": "https://evil/.*", "TS_TOKEN_EXPIRATION_TIME_MIN": "30"}
    on = _settings(tmp_path, "enable_envvars_config=true\njob_queue_size=3\n", monkeypatch, env)
    assert (on.service_envelope, on.inference_address, on.job_queue_size) == ("kservev2", "0.0.0.0", 7)
    assert on.token_expiration_min == 30
    assert on.allowed_urls == []  # TS_ALLOWED_URLS only with use_env_allowed_urls=true, as TorchServe
    allowed = _settings(tmp_path, "enable_envvars_config=true\nuse_env_allowed_urls=true\n", monkeypatch, env)
    assert allowed.allowed_urls == ["https://evil/.*"]
    empty = _settings(tmp_path, "enable_envvars_config=true\n", monkeypatch, {"TS_SERVICE_ENVELOPE": ""})
    assert empty.service_envelope is None
    off = _settings(tmp_path, "job_queue_size=3\n", monkeypatch, env)
    assert (off.service_envelope, off.inference_address, off.job_queue_size) == (None, "127.0.0.1", 3)
    # the command line wins over both
    assert _settings(tmp_path, "enable_envvars_config=true\n", monkeypatch, env,
                     ("--grpc-inference-address", "127.0.0.1")).inference_address == "127.0.0.1"
    with pytest.raises(ConfigError, match="TS_\\* environment: invalid value for service_envelope"):
        _settings(tmp_path, "enable_envvars_config=true\n", monkeypatch, {"TS_SERVICE_ENVELOPE": "soap"})


def test_one_address_for_both_http_apis(tmp_path, monkeypatch):
    shared = _settings(tmp_path, "inference_address=http://0.0.0.0:8085\nmanagement_address=http://0.0.0.0:8085\n",
                       monkeypatch)
    assert shared.http_shared
    assert [api for api, _, _ in shared.binds()] == ["inference", "management", "HTTP inference", "metrics"]
    apart = _settings(tmp_path, "inference_address=http://0.0.0.0:8085\nmanagement_address=http://127.0.0.1:8085\n",
                      monkeypatch)
    assert not apart.http_shared  # another host: two binds (the second one fails if the first is 0.0.0.0)
    assert not Settings(http_port=0, http_management_port=0).http_shared  # port 0: two free ports
    with pytest.raises(ConfigError, match="only one of them is https"):
        _settings(tmp_path, "inference_address=https://0.0.0.0:8085\nmanagement_address=http://0.0.0.0:8085\n"
                  "certificate_file=c.pem\nprivate_key_file=k.pem\n", monkeypatch)


SNAPSHOT = {"name": "startup.cfg", "modelCount": 2, "models": {
    "mnist": {"1.0": {"defaultVersion": True, "marName": "mnist.mar", "minWorkers": 1, "maxWorkers": 5,
                      "batchSize": 2, "maxBatchDelay": 500, "responseTimeout": 60}},
    "llm": {"2.0": {"marName": "llm.mar"}}}}


def test_model_snapshot_names_the_startup_models(caplog):
    settings = Settings(load_models=["other.mar"])
    apply_properties(settings, {"model_snapshot": json.dumps(SNAPSHOT)}, "config.properties")
    models = snapshot_to_restore(settings, snapshots=None)  # type: ignore[arg-type]  # no snapshot file read
    assert models is not None
    assert [(m.name, m.version, m.default, m.max_workers) for m in models] == [
        ("mnist", "1.0", True, 5), ("llm", "2.0", False, 0)]
    mnist = models[0].request
    assert (mnist.url, mnist.initial_workers, mnist.batch_size, mnist.max_batch_delay, mnist.response_timeout) == (
        "mnist.mar", 1, 2, 500, 60)
    assert startup_requests(settings) == []  # load_models is ignored, as TorchServe
    assert "load_models / --models other.mar ignored" in caplog.text
    assert snapshot_models(SNAPSHOT)[1].request.url == "llm.mar"


@pytest.mark.parametrize(("value", "fragment"), [
    ("[1]", "must be a JSON object"),
    ('{"name": "x"}', 'must hold a "models" object'),
    ('{"models": {"m": {}}}', "model 'm': must map versions to settings"),
    ('{"models": {"m": {"1.0": {"minWorkers": 1}}}}', "model 'm' version '1.0': needs a marName"),
    ('{"models": {"m": {"1.0": {"marName": "m.mar", "batchSize": "2"}}}}', "batchSize must be an integer"),
    ("{", "invalid value for model_snapshot"),
])
def test_a_malformed_model_snapshot_is_a_config_error(value, fragment):
    with pytest.raises(ConfigError, match="invalid value for model_snapshot") as exc:
        apply_properties(Settings(), {"model_snapshot": value}, "config.properties")
    assert fragment in str(exc.value)


@pytest.mark.parametrize(("value", "fragment"), [
    ('{"m": {"1.0": {"minWorkers": "x"}}}', "model 'm' version '1.0': minWorkers must be an integer, got \"x\""),
    ('{"m": {"1.0": {"marName": "m.mar", "responseTimeout": 1.5}}}', "responseTimeout must be an integer"),
    ('{"m": {"1.0": {"maxWorkers": true}}}', "maxWorkers must be an integer"),
    ('{"m": ["1.0"]}', "model 'm': must map versions to settings"),
    ('{"m": {"1.0": 3}}', "model 'm' version '1.0': must be an object of settings"),
    ("[]", "must be a JSON object"),
])
def test_a_malformed_models_json_is_a_config_error_naming_the_key(value, fragment):
    """TorchServe's ``models`` JSON, read at startup: a wrong type names the model, version and key."""
    with pytest.raises(ConfigError, match="invalid value for models") as exc:
        apply_properties(Settings(), {"models": value}, "config.properties")
    assert fragment in str(exc.value)
    settings = Settings()
    apply_properties(settings, {"models": '{"m": {"1.0": {"marName": "m.mar", "minWorkers": 2}}}'}, "config.properties")
    assert settings.models_config["m"]["1.0"]["minWorkers"] == 2
