"""``engine: vllm`` end to end on vLLM's CPU build: the bundled SmolLM2 served by vLLM's engine in a
worker under vLLM's own Python (``.venv-vllm/``, made by ``scripts/install --engine vllm``), through
gRPC StreamPredictions and OpenAI's door, beside the same model on the OpenVINO engine.

About a minute on two cores (measured: 60 s), half of it the server's start (vLLM's import and load,
about 25 s); the OpenVINO model's int8 IR, when not cached yet, adds its conversion (about 20 s).
"""

from __future__ import annotations

import json
import time

import grpc
import openai
import pytest
from test_llm_scheduling import _with_config
from test_llm_server import QUESTION, _build, _sample, _stream

from conftest import ROOT, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2, management_pb2
from inference_service.serving.interpreter import VLLM_VENV

pytestmark = pytest.mark.llm

PARIS = "The capital of France is Paris."
#: vLLM's CPU build compiles the model with torch.compile by default (minutes on two cores): eager.
EAGER = "  vllm_engine_config:\n    enforce_eager: true\n"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    if not (ROOT / VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"{VLLM_VENV}/ is missing: run scripts/install --engine vllm (scripts/test does)")
    store = tmp_path_factory.mktemp("vllm_store")
    _build(store, "--engine", "vllm", "--name", "on_vllm", "--batch-size", "4")
    _with_config(store / "on_vllm.mar", handler=EAGER)
    _build(store, "--name", "on_openvino")  # the bundled archive's default: OpenVINO, int8
    srv = ServerProcess(tmp_path_factory.mktemp("vllm_work"), store,
                        ["--enable-model-api", "--models", "on_vllm=on_vllm.mar", "on_openvino=on_openvino.mar"])
    try:
        for name in ("on_vllm", "on_openvino"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _openai(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.status['http_port']}/v1",
                         api_key=read_key(srv.key_file, "inference"), max_retries=0, timeout=120)


def test_the_worker_runs_vllm_in_its_own_environment(vllm_server):
    log = vllm_server.log()
    assert "on vLLM 0.32.0" in log and "SmolLM2-135M-Instruct" in log, log[-3000:]
    pid = vllm_server.describe("on_vllm")[0]["workers"][0]["pid"]
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        argv = cmdline.read().split(b"\0")
    assert argv[0].decode() == str(ROOT / VLLM_VENV / "bin" / "python")


def test_grpc_streams_paris(vllm_server):
    messages, _ = _stream(vllm_server, "on_vllm", QUESTION)
    assert "".join(messages) == PARIS and len(messages) > 2, messages
    final = json.loads(vllm_server.stream("on_vllm", json.dumps({**QUESTION, "include_usage": True}),
                                          timeout=120)[-1])
    assert final["finish_reason"] == "stop" and final["usage"]["completion_tokens"] == 8  # 7 + end of turn


def test_openai_door_answers_paris(vllm_server):
    client = _openai(vllm_server)
    answer = client.chat.completions.create(model="on_vllm", messages=QUESTION["messages"], max_tokens=48)
    assert answer.choices[0].message.content == PARIS and answer.choices[0].finish_reason == "stop"
    with client.chat.completions.create(model="on_vllm", messages=QUESTION["messages"], max_tokens=48,
                                        stream=True) as stream:
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PARIS
    assert len(chunks) > 4


def test_stop_strings_and_sampling_fields_map_to_the_request(vllm_server):
    """Stop strings are ours (the text ends before them, as on every engine); a seeded sampled request
    repeats; top_k 1 is greedy; penalties are honoured (no refusal)."""
    cut = "".join(_stream(vllm_server, "on_vllm", {**QUESTION, "stop": [" is"]})[0])
    assert cut == "The capital of France"
    seeded = {**QUESTION, "temperature": 1.0, "seed": 2**64 - 1, "max_new_tokens": 24, "ignore_eos": True}
    assert _stream(vllm_server, "on_vllm", seeded)[0] == _stream(vllm_server, "on_vllm", seeded)[0]
    top1 = {**QUESTION, "temperature": 1.0, "top_k": 1, "seed": 3, "presence_penalty": 0.5}
    assert "".join(_stream(vllm_server, "on_vllm", {**top1, "presence_penalty": 0.0})[0]) == PARIS
    assert _stream(vllm_server, "on_vllm", top1)[0]


def test_cancel_frees_the_request_in_vllm(vllm_server):
    running = "inference_service_llm_num_requests_running"
    body = {"prompt": "Once upon a time", "max_new_tokens": 2000, "ignore_eos": True}
    call = vllm_server.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="on_vllm", input={"data": json.dumps(body).encode()}),
        timeout=120)
    for count, _ in enumerate(call, 1):
        if count == 3:
            assert _sample(vllm_server, running, "on_vllm") == 1.0
            call.cancel()
            break
    wait_for(lambda: _sample(vllm_server, running, "on_vllm") == 0.0, timeout=10, what="running gauge back to 0")
    assert _sample(vllm_server, "inference_service_llm_kv_cache_used_tokens", "on_vllm") == 0.0
    assert _sample(vllm_server, "inference_service_llm_kv_cache_capacity_tokens", "on_vllm") > 0
    wait_for(lambda: "dropped after" in vllm_server.log(), timeout=10, what="the worker's drop")
    start = time.monotonic()
    assert "".join(_stream(vllm_server, "on_vllm", QUESTION)[0]) == PARIS  # the worker serves on
    assert time.monotonic() - start < 30


def test_the_openvino_engine_serves_beside_it(vllm_server):
    assert "Paris" in "".join(_stream(vllm_server, "on_openvino", QUESTION)[0])
    models = {m.id for m in _openai(vllm_server).models.list().data}
    assert {"on_vllm", "on_openvino"} <= models


def test_a_missing_interpreter_is_refused_at_registration(vllm_server, tmp_path):
    """A handler config naming a Python that is not there is refused before any worker starts."""
    store = vllm_server.store
    _build(store, "--engine", "vllm", "--name", "nowhere")
    _with_config(store / "nowhere.mar", handler=f"  python: {tmp_path / 'missing' / 'python'}\n")
    with pytest.raises(grpc.RpcError) as refused:
        vllm_server.management.RegisterModel(
            management_pb2.RegisterModelRequest(url="nowhere.mar", initial_workers=1, synchronous=True),
            timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'python' must name an executable file" in refused.value.details()
