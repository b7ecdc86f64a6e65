"""A true first run, as scripts/demo makes it after its install step: an empty cache (the GGUF
converted, then the OpenVINO IR), the archive built, the server started with ``--start``, an
answer streamed by the gRPC client, then a first and a second ``/v1`` request. Nothing on the
console or in the log reads as an error when nothing is wrong, and the first ``/v1`` request
holds the event loop no more than the second."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.llm, pytest.mark.slow]

BIN = Path(sys.executable).parent
#: What a user reads as a failure: an error, transformers' framework notice, a traceback, a
#: progress bar (tqdm's "37%|███" or "12.3it/s").
ALARMS = re.compile(r"Error|ERROR|None of PyTorch|Traceback|\d+%\||\d+(\.\d+)?it/s|legacy behaviour")
PORTS = ["--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
         "--http-management-port", "0", "--metrics-port", "0"]


def _run(args: list[str], env: dict[str, str], timeout: float = 900) -> str:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _chat(port: int, key: str) -> float:
    body = json.dumps({"model": "smollm2", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["content"]
    return time.monotonic() - start


@pytest.mark.timeout(1500)
def test_a_first_run_prints_no_alarm_and_its_first_v1_request_is_no_slower(tmp_path):
    env = {**os.environ, "INFERENCE_SERVICE_CACHE": str(tmp_path / "empty-cache")}
    store, run_dir = tmp_path / "model_store", tmp_path / "run"
    console = _run([sys.executable, "scripts/build_llm_archive", "--model-store", str(store), "--force"], env)
    assert "converting" in console  # the conversion is announced, in our words
    server = [str(BIN / "inference-service"), "--run-dir", str(run_dir)]
    console += _run([*server, "--start", "--ncs", "--model-store", str(store), "--models", "smollm2=smollm2.mar",
                     *PORTS], env)
    try:
        status = json.loads((run_dir / "status.json").read_text())
        question = tmp_path / "question.json"
        question.write_text(json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                        "max_new_tokens": 32}))
        answer = _run([sys.executable, "clients/torchserve_grpc_client.py", "--run-dir", str(run_dir),
                       "infer_stream", "smollm2", str(question)], env, timeout=300)
        assert "Paris" in answer
        console += answer
        key = json.loads(Path(status["key_file"]).read_text())["inference"]["key"]
        first, second = _chat(status["http_port"], key), _chat(status["http_port"], key)
    finally:
        console += _run([*server, "--stop"], env, timeout=120)
    log = (run_dir / "logs" / "inference_service.log").read_text()
    assert not [line for line in console.splitlines() if ALARMS.search(line)], console
    assert not [line for line in log.splitlines() if ALARMS.search(line)], log
    assert log.count("POST /v1/chat/completions model=smollm2") == 2
    lag = [line for line in log.splitlines() if "loop_lag" in line and "/v1/" in line]
    assert not lag, lag  # no import or first-use work of /v1 on the event loop
    assert first < 2 * second + 0.5, (first, second)  # nor in the worker: its first prefill was warmed up
