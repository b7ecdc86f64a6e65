"""``engine: vllm`` end to end on vLLM's CPU build: the bundled SmolLM2 served by vLLM's engine in a
worker under vLLM's own Python (``.venv-vllm/``, made by ``scripts/install --engine vllm``), through
gRPC StreamPredictions and OpenAI's door, beside the same model on the OpenVINO engine; and the
engine interface driven directly in that Python.

The server's tests take about a minute on two cores (measured: 60 s), half of it the server's start
(vLLM's import and load); the OpenVINO model's int8 IR, when not cached yet, adds its conversion.
The engine interface driven in vLLM's Python (fp32 steps) took 167 s more, under a load average of 12.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import openai
import pytest
from llm_models import build_llm_archive as _build
from test_llm_scheduling import _with_config
from test_llm_server import QUESTION, _sample, _stream

from conftest import ROOT, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2, management_pb2
from inference_service.serving.interpreter import VLLM_VENV

pytestmark = [pytest.mark.llm, pytest.mark.external]  # vLLM's environment

PARIS = "The capital of France is Paris."
#: vLLM's CPU build compiles the model with torch.compile by default (minutes on two cores): eager.
EAGER = "  vllm_engine_config:\n    enforce_eager: true\n"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, llm_archives):
    if not (ROOT / VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"{VLLM_VENV}/ is missing: run scripts/install --engine vllm (scripts/test does)")
    store = tmp_path_factory.mktemp("vllm_store")
    llm_archives.build(store, "--engine", "vllm", "--name", "on_vllm", "--batch-size", "4")
    _with_config(store / "on_vllm.mar", handler=EAGER)
    llm_archives.build(store, "--name", "on_openvino")  # the bundled archive's default: OpenVINO, int8
    srv = ServerProcess(tmp_path_factory.mktemp("vllm_work"), store,
                        ["--enable-model-api", "--models", "on_vllm=on_vllm.mar", "on_openvino=on_openvino.mar"])
    try:
        for name in ("on_vllm", "on_openvino"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


#: The engine interface driven in vLLM's own Python (fp32, so that greedy tokens do not depend on the
#: batch): greedy alone and beside another, a preempted request recomputed, a seeded sampled request
#: repeated, a request vLLM refuses ending alone, and the statistics along the way.
INTERFACE = """
import json
from inference_service.contracts.handler_config import HandlerConfig
from inference_service.llm.engine_protocol import add_request
from inference_service.llm.engines import build_engine
from inference_service.llm.params import GenerationParams

config = {"engine": "vllm", "vllm_engine_config": {"enforce_eager": True, "dtype": "float32"}}
built = build_engine(HandlerConfig.parse(config), "cpu", 4, True)
engine = built.engine
ids = lambda text: list(built.tokenizer(text)["input_ids"])

def run(active=None):
    done = {}
    for _ in range(500):
        for key, out in engine.step(active).items():
            if out.finished:
                done[key] = out.result.token_ids
        if not any(engine.has(k) for k in (active or engine.keys())):
            return done
    raise RuntimeError("the requests did not end")

greedy = GenerationParams(max_new_tokens=12, ignore_eos=True)
engine.add("alone", ids("Once upon a time"), greedy)
out = {"alone": run()["alone"]}
engine.add("a", ids("Once upon a time"), greedy)
engine.add("b", ids("The weather today"), greedy)
for _ in range(3):
    engine.step()
out["preempted"], out["twice"] = engine.preempt("a"), engine.preempt("a")
out["stats_preempted"] = engine.stats().preempted_total
out["b"] = run(["b"])["b"]
out["a_kept"] = engine.has("a")
out["a"] = run()["a"]
seeded = GenerationParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=7)
engine.add("s1", ids("A story"), seeded)
engine.add("s2", ids("A story"), seeded)
fault = add_request(engine, "long", [1] * 9000, greedy)
out["fault"] = fault.error if fault is not None else None
runs = run()
out["seeded_equal"] = runs["s1"] == runs["s2"]
stats = engine.stats()
out["end"] = [len(engine), stats.running, stats.waiting, stats.kv_cache_used_tokens]
print(json.dumps(out))
"""


def test_the_engine_interface_in_vllms_python():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INFERENCE_SERVICE_SERVER_PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / VLLM_VENV / "bin" / "python"), "-c", INTERFACE], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["alone"]) == 12 and out["a"] == out["alone"]  # recomputed, the same greedy tokens
    assert out["preempted"] is True and out["twice"] is False and out["stats_preempted"] == 1
    assert out["a_kept"] and len(out["b"]) == 12
    assert out["seeded_equal"]
    assert out["fault"] == "the engine failed on this request; the other requests go on (the worker log names " \
                           "the cause)"
    assert out["end"] == [0, 0, 0, 0]


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


def test_logprobs_and_top_logprobs_from_vllm(vllm_server):
    """Each sampled token's log probability and its two most likely alternatives, as vLLM computed them."""
    answer = _openai(vllm_server).chat.completions.create(
        model="on_vllm", messages=QUESTION["messages"], max_tokens=48, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.content == PARIS
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == PARIS  # the end of turn has no text and no entry
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2, entry
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-4  # greedy: the sampled one is the likeliest
        assert entry.top_logprobs[0].token == entry.token


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


def test_structured_outputs_and_tool_calls_on_vllms_grammar_backend(vllm_server):
    """Issue 47 item 6: the vLLM engine gives vLLM's own structured outputs. Every committed prompt
    under each committed JSON schema answers JSON that validates (100 %); a choice and a regex hold;
    tool_choice required returns calls and a named tool_choice that tool's arguments, each valid
    against the function's parameters."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import jsonschema

    data = Path(__file__).resolve().parent / "data"
    structured = json.loads((data / "structured_outputs.json").read_text(encoding="utf-8"))
    tools = json.loads((data / "tool_calls.json").read_text(encoding="utf-8"))
    client = _openai(vllm_server)
    jobs = [(prompt, name, schema) for prompt in structured["prompts"]
            for name, schema in structured["schemas"].items()]

    def one(job: tuple[str, str, dict]) -> str | None:
        prompt, name, schema = job
        text = client.chat.completions.create(
            model="on_vllm", messages=[{"role": "user", "content": prompt}], max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        ).choices[0].message.content or ""
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{name} / {prompt[:40]!r}: {exc} in {text[:200]!r}"
        return None

    with ThreadPoolExecutor(4) as pool:  # the archive's batch size
        failures = [f for f in pool.map(one, jobs) if f is not None]
    assert not failures, failures
    choice = client.completions.create(model="on_vllm", prompt="Is the sky blue? Answer:", max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    digits = client.completions.create(model="on_vllm", prompt="The year is", max_tokens=8,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(digits.choices[0].text) == 4 and digits.choices[0].text.isdigit(), digits.choices[0].text
    case = tools["cases"][0]
    listed = [{"type": "function", "function": {"name": name, **tools["tools"][name]}} for name in case["tools"]]
    messages = [{"role": "user", "content": case["prompt"]}]
    for tool_choice in ("required", {"type": "function", "function": {"name": case["function"]}}):
        # one call: allowed more, the 135M model repeats its call until max_tokens (docs/llm.md, "Tool calls")
        answer = client.chat.completions.create(model="on_vllm", messages=messages, tools=listed,
                                                tool_choice=tool_choice, max_tokens=256,
                                                parallel_tool_calls=False).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, (tool_choice, answer)
        for call in answer.message.tool_calls:
            assert call.function.name in case["tools"], call
            if tool_choice != "required":
                assert call.function.name == case["function"], call
            jsonschema.validate(json.loads(call.function.arguments), tools["tools"][call.function.name]["parameters"])
