"""``engine: vllm``'s handler config: its keys, which Python runs the model's workers, and the refusals
before any worker starts (the engine itself runs in tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError
from inference_service.errors import InvalidArgument
from inference_service.llm.engines import EngineConfigError, build_engine
from inference_service.serving import interpreter
from inference_service.serving.interpreter import InterpreterError, worker_python
from inference_service.serving.model_config import check_handler_section


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_vllm_engine_config_and_python_are_declared_keys():
    engine_args = {"gpu_memory_utilization": 0.3, "dtype": "half"}
    config = HandlerConfig.parse({"engine": "vllm", "vllm_engine_config": engine_args, "python": "/opt/vllm/bin/py"})
    assert config.engine == "vllm" and dict(config.vllm_engine_config or {}) == engine_args
    assert config.python == "/opt/vllm/bin/py" and not config.extra


@pytest.mark.parametrize(("section", "message"), [
    ({"vllm_engine_config": ["enforce_eager"]},
     "'vllm_engine_config' must be a mapping of the engine's own argument names"),
    ({"vllm_engine_config": {"max_model_len": [1]}},
     "'vllm_engine_config.max_model_len' must be a string, number or boolean"),
    ({"python": ""}, "'python' must be a non-empty string"),
    ({"engine": "vLLM-cpu"}, "'engine' must be one of openvino, torch, vllm, llamacpp"),
])
def test_bad_values_are_refused_by_name(section, message):
    with pytest.raises(HandlerConfigError, match=message):
        HandlerConfig.parse(section)


def test_python_names_the_interpreter_of_any_engine(tmp_path):
    python = _executable(tmp_path / "env" / "bin" / "python")
    assert worker_python(HandlerConfig.parse({"python": str(python)})) == str(python)
    assert worker_python(HandlerConfig.parse({"engine": "vllm", "python": str(python)})) == str(python)
    relative = os.path.relpath(python)
    assert worker_python(HandlerConfig.parse({"python": relative})) == str(python)  # from the working directory
    assert worker_python(HandlerConfig.parse({"engine": "torch"})) == sys.executable


def test_vllm_finds_its_environment_beside_the_project(tmp_path, monkeypatch):
    monkeypatch.setattr(interpreter, "_project_dirs", lambda: [tmp_path / "elsewhere", tmp_path])
    python = _executable(tmp_path / ".venv-vllm" / "bin" / "python")
    assert worker_python(HandlerConfig.parse({"engine": "vllm"})) == str(python)


def test_vllm_without_its_environment_is_refused_at_registration(tmp_path, monkeypatch):
    monkeypatch.setattr(interpreter, "_project_dirs", lambda: [tmp_path])
    with pytest.raises(InterpreterError, match=r"needs vLLM's own Python environment: none at .*\.venv-vllm; "
                                               r"run scripts/install --engine vllm"):
        worker_python(HandlerConfig.parse({"engine": "vllm"}))
    with pytest.raises(InvalidArgument, match="scripts/install --engine vllm"):
        check_handler_section({"engine": "vllm"})
    missing = tmp_path / "nowhere" / "python"
    with pytest.raises(InvalidArgument, match="'python' must name an executable file"):
        check_handler_section({"python": str(missing)})
    (tmp_path / "plain").write_text("")
    with pytest.raises(InvalidArgument, match="'python' must name an executable file"):
        check_handler_section({"python": str(tmp_path / "plain")})  # there, but not executable


def test_vllm_engine_config_belongs_to_the_vllm_engine():
    with pytest.raises(EngineConfigError, match="'vllm_engine_config' is for vLLM's engine; this model's engine is "
                                                "torch"):
        build_engine(HandlerConfig.parse({"engine": "torch", "vllm_engine_config": {"dtype": "half"}}), "cpu", 1, True)


def test_a_worker_without_vllm_says_how_to_install_it():
    """The server's own Python has no vLLM: the worker's load fails with the way out."""
    with pytest.raises(EngineConfigError, match="needs vLLM in the worker's Python; install it with "
                                                "scripts/install --engine vllm"):
        build_engine(HandlerConfig.parse({"engine": "vllm"}), "cpu", 1, True)
