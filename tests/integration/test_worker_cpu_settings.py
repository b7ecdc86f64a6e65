"""A worker's CPU settings (worker/cpu.py) from model-config.yaml and the server defaults, as the
handler sees them, and a malformed value failing the load while the server keeps serving."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from conftest import build_dir
from inference_service.contracts.cpu import default_threads


def settings_of(server, name: str) -> dict:
    return json.loads(server.predict(name, "x", timeout=60))


def test_server_defaults_passive_wait_and_quota_threads(server) -> None:
    url = build_dir(server.store, "cpu_default", "cpu_settings_handler.py", model_name="cpu_default",
                    config_yaml="minWorkers: 1\nmaxWorkers: 1\n", handler_entry="cpu_settings_handler:handle")
    server.register(url, model_name="cpu_default")
    got = settings_of(server, "cpu_default")
    assert got["policy"] == "PASSIVE"
    # one worker gets every CPU this process may use (same affinity mask and cgroup as the server)
    assert got["threads"] == default_threads(1)
    server.unregister("cpu_default")


def test_model_config_sets_threads_policy_and_affinity(server) -> None:
    cpu = min(os.sched_getaffinity(0))
    config = f"minWorkers: 1\nhandler:\n  torch_threads: 4\n  omp_wait_policy: active\n  cpu_affinity: [{cpu}]\n"
    url = build_dir(server.store, "cpu_pinned", "cpu_settings_handler.py", model_name="cpu_pinned",
                    config_yaml=config, handler_entry="cpu_settings_handler:handle")
    server.register(url, model_name="cpu_pinned")
    assert settings_of(server, "cpu_pinned") == {"threads": 1, "policy": "ACTIVE", "affinity": [cpu]}
    server.unregister("cpu_pinned")


@pytest.mark.parametrize(("value", "message"), [
    ("omp_wait_policy: spin", "'omp_wait_policy' must be one of"),
    ("cpu_affinity: \"0-\"", "'cpu_affinity' must look like"),
    ("torch_threads: 0", "'torch_threads' must be an integer from 1 to"),
])
def test_malformed_setting_fails_the_load(server, value: str, message: str) -> None:
    url = build_dir(server.store, "cpu_bad", "cpu_settings_handler.py", model_name="cpu_bad",
                    config_yaml=f"minWorkers: 1\nhandler:\n  {value}\n", handler_entry="cpu_settings_handler:handle")
    with pytest.raises(grpc.RpcError) as caught:
        server.register(url, model_name="cpu_bad")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
    assert server.predict("echo", "still serving", timeout=30) == b"still serving"


def test_threads_above_the_cpus_are_warned(server) -> None:
    """Each model's default takes every CPU for its one worker: a second model doubles the
    threads asked for, and the server says workers x threads exceeds the usable CPUs."""
    since = len(server.log())
    for name in ("cpu_a", "cpu_b"):
        url = build_dir(server.store, name, "cpu_settings_handler.py", model_name=name,
                        config_yaml="minWorkers: 1\nmaxWorkers: 1\n", handler_entry="cpu_settings_handler:handle")
        server.register(url, model_name=name)
    threads = default_threads(1)
    warnings = [line for line in server.log()[since:].splitlines() if "usable CPUs: they slow each other down" in line]
    assert any(f"cpu_a 1x{threads}" in line and f"cpu_b 1x{threads}" in line and " WARNING " in line
               for line in warnings), warnings
    for name in ("cpu_a", "cpu_b"):
        server.unregister(name)
