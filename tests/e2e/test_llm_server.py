"""The main job end to end: a real LLM (SmolLM2-135M-Instruct) streamed through the real server.

The server is tests/conftest.py's ``llm_server``, one a session (test_openai_llm.py shares it):
the real model loaded once (one worker), and a tiny random-weight Llama with the same tokenizer
for the faster checks of both handler forms (``tiny``, ``tiny_gen``), of the torch engine
(``tiny_torch``) and of the OpenVINO engine's exact weight format (``tiny_fp32``).
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from conftest import ROOT, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2

#: one worker process runs both modules of tests/conftest.py's session-scoped ``llm_server``
pytestmark = [pytest.mark.llm, pytest.mark.slow, pytest.mark.xdist_group("llm_server")]

QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 48}


def _stream(srv: ServerProcess, model: str, body: dict | str, timeout: float = 120):
    data = body if isinstance(body, str) else json.dumps(body)
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": data.encode()})
    start = time.monotonic()
    messages, arrivals = [], []
    for response in srv.inference.StreamPredictions(req, timeout=timeout):
        messages.append(response.prediction.decode())
        arrivals.append(time.monotonic() - start)
    return messages, arrivals


def test_real_model_streams_paris(llm_server):
    messages, _ = _stream(llm_server, "smollm2", QUESTION)
    answer = "".join(messages)
    assert "Paris" in answer
    assert len(messages) > 2, messages
    unary = llm_server.predict("smollm2", json.dumps(QUESTION), timeout=120).decode()
    assert unary == answer
    # the loading time is reported in the log, and the real model was loaded once (one worker)
    loads = [line for line in llm_server.log().splitlines() if "loaded " in line and "SmolLM2" in line]
    assert len(loads) == 1 and ("M parameters" in loads[0] or "OpenVINO IR" in loads[0]) and " s" in loads[0]


def test_first_token_arrives_early(llm_server):
    body = {"prompt": "Once upon a time", "max_new_tokens": 32, "ignore_eos": True}
    messages, arrivals = _stream(llm_server, "smollm2", body)
    assert len(messages) > 8
    assert arrivals[0] < arrivals[-1] / 2, arrivals


def _http_chunks(srv: ServerProcess, model: str, body: dict,
                 timeout: float = 120) -> tuple[http.client.HTTPResponse, list[bytes], list[float]]:
    """POST ``/predictions/<model>``; the response, the pieces read as they arrived and their arrival times."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=timeout)
    try:
        start = time.monotonic()
        conn.request("POST", f"/predictions/{model}", json.dumps(body).encode(),
                     {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}",
                      "Content-Type": "application/json"})
        response = conn.getresponse()
        pieces, arrivals = [], []
        while piece := response.read1(65536):
            pieces.append(piece)
            arrivals.append(time.monotonic() - start)
        return response, pieces, arrivals
    finally:
        conn.close()


def test_http_predictions_stream_chunked(llm_server):
    """smollm2 has continuousBatching and batchSize 8: /predictions answers chunked, as the
    tokens are generated, not one body at the end."""
    body = {"prompt": "Once upon a time", "max_new_tokens": 32, "ignore_eos": True}
    response, pieces, arrivals = _http_chunks(llm_server, "smollm2", body)
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    assert len(pieces) > 8, pieces
    assert arrivals[0] < arrivals[-1] / 2, arrivals  # the first chunk came long before the end
    text = b"".join(pieces).decode()
    assert text == "".join(_stream(llm_server, "smollm2", body)[0])  # the same text as gRPC (greedy)


def test_max_new_tokens_and_usage(llm_server):
    body = {"prompt": "Count: one, two, three,", "max_new_tokens": 5, "ignore_eos": True, "include_usage": True}
    messages, _ = _stream(llm_server, "smollm2", body)
    final = json.loads(messages[-1])
    assert final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] <= 5 and final["usage"]["prompt_tokens"] > 0
    text = "".join(messages[:-1]) + final["text"]
    assert 0 < len(text) < 60


@pytest.mark.parametrize("model", ["smollm2", "tiny_gen"])
def test_usage_is_a_message_of_its_own(llm_server, model):
    """With include_usage every text piece comes first and the last message is the usage
    object alone (its text empty): continuous batching (smollm2) and a static batch (tiny_gen)."""
    body = {"prompt": "Count: one, two, three,", "max_new_tokens": 6, "ignore_eos": True}
    plain, _ = _stream(llm_server, model, body)
    messages, _ = _stream(llm_server, model, {**body, "include_usage": True})
    final = json.loads(messages[-1])
    assert final == {"text": "", "finish_reason": "length", "usage": {"prompt_tokens": final["usage"]["prompt_tokens"],
                                                                      "completion_tokens": 6}}
    assert all(piece and not piece.startswith("{") for piece in messages[:-1]), messages
    assert "".join(messages[:-1]) == "".join(plain)  # the same text as without usage (greedy)


def test_bundled_client_prints_clean_text(llm_server, tmp_path):
    """clients/torchserve_grpc_client.py infer_stream: the text on stdout, the usage on stderr."""
    body = {"prompt": "Count: one, two, three,", "max_new_tokens": 6, "ignore_eos": True}
    text = "".join(_stream(llm_server, "smollm2", body)[0])
    (tmp_path / "body.json").write_text(json.dumps({**body, "include_usage": True}))
    proc = subprocess.run([sys.executable, str(ROOT / "clients" / "torchserve_grpc_client.py"),
                           "--inference-port", str(llm_server.inference_port), "--key-file", str(llm_server.key_file),
                           "infer_stream", "smollm2", str(tmp_path / "body.json")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text + "\n"
    assert "finish_reason: length" in proc.stderr and "completion_tokens: 6" in proc.stderr


def test_llm_metrics_and_log_lines_per_request(llm_server):
    """Default metrics_mode (log): one line per request and metric, none per token; the token
    counts and engine gauges on /metrics."""
    before = llm_server.log().count("GenerationTokens.Count:12|")
    assert len(_stream(llm_server, "tiny", {"prompt": "hello", "max_new_tokens": 12, "ignore_eos": True})[0]) > 2
    log_text = wait_for(lambda: (t := llm_server.log()).count("GenerationTokens.Count:12|") > before and t,
                        timeout=10, what="the request's metric line")
    assert "HandlerTime" not in log_text
    assert "RequestGenerationTime.ms:" in log_text and "PromptTokens.Count:" in log_text
    assert "engine stats of tiny: running=" in log_text  # the engine statistics' log metrics line
    url = f"http://127.0.0.1:{llm_server.status['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        metrics = response.read().decode()
    for name in ("inference_service_llm_generation_tokens_total", "inference_service_llm_prompt_tokens_total",
                 "inference_service_llm_kv_cache_capacity_tokens", "inference_service_llm_num_requests_running",
                 "inference_service_llm_time_to_first_token_seconds_count",
                 "inference_service_llm_inter_token_latency_seconds_count"):
        assert f'{name}{{model_name="tiny",' in metrics, name
    capacity = re.search(r'inference_service_llm_kv_cache_capacity_tokens\{model_name="smollm2",[^}]*\} (\S+)', metrics)
    assert capacity is not None and float(capacity.group(1)) > 0


def _sample(srv: ServerProcess, family: str, model: str) -> float:
    """The value of ``family``'s series for ``model`` on /metrics (0.0 when it has none yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics", timeout=10) as response:
        found = re.search(rf'^{family}\{{model_name="{model}",[^}}]*\}} (\S+)$', response.read().decode(), re.M)
    return float(found.group(1)) if found else 0.0


def test_generated_tokens_are_counted_while_they_are_generated(llm_server):
    """A scrape 2 s into a 200-token generation shows its tokens already (counted per engine step,
    so rate() shows throughput live); when it ends the counters hold its exact token counts."""
    generated, prompt = "inference_service_llm_generation_tokens_total", "inference_service_llm_prompt_tokens_total"
    before, prompt_before = _sample(llm_server, generated, "smollm2"), _sample(llm_server, prompt, "smollm2")
    body = {"prompt": "Once upon a time", "max_new_tokens": 200, "ignore_eos": True, "include_usage": True}
    req = inference_pb2.PredictionsRequest(model_name="smollm2", input={"data": json.dumps(body).encode()})
    start = time.monotonic()
    messages: list[bytes] = []
    during = None
    for response in llm_server.inference.StreamPredictions(req, timeout=300):
        messages.append(response.prediction)
        if during is None and (time.monotonic() - start >= 2.0 or len(messages) >= 100):
            during = _sample(llm_server, generated, "smollm2"), len(messages)  # the stream is still running
    assert during is not None and during[1] < len(messages)
    assert during[0] > before, f"no token counted {time.monotonic() - start:.1f} s into the generation"
    usage = json.loads(messages[-1])["usage"]
    assert usage["completion_tokens"] == 200
    wait_for(lambda: _sample(llm_server, generated, "smollm2") == before + 200, timeout=10,
             what="the generated-token counter at +200")
    assert _sample(llm_server, prompt, "smollm2") == prompt_before + usage["prompt_tokens"]


def test_stop_string_ends_generation(llm_server):
    base = {"messages": QUESTION["messages"], "max_new_tokens": 48, "include_usage": True}
    full_messages, _ = _stream(llm_server, "smollm2", base)
    full = "".join(full_messages[:-1]) + json.loads(full_messages[-1])["text"]
    assert "Paris" in full
    stopped_messages, _ = _stream(llm_server, "smollm2", {**base, "stop": ["Paris"]})
    final = json.loads(stopped_messages[-1])
    text = "".join(stopped_messages[:-1]) + final["text"]
    assert final["finish_reason"] == "stop"
    assert "Paris" not in text and full.startswith(text)


@pytest.mark.parametrize("body,fragment", [
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "max_new_tokens": 0}', "max_new_tokens"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": "x", "bogus": 1}', "bogus"),
    ('{"messages": [{"role": "moderator", "content": "x"}]}', "'messages[0].role' must be one of system, developer"),
    ("{not json", "JSON"),
])
def test_bad_input_is_invalid_argument(llm_server, body, fragment):
    for call in (lambda: llm_server.predict("tiny", body), lambda: _stream(llm_server, "tiny", body)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in err.value.details()
    assert llm_server.predict("tiny", '{"prompt": "ok", "max_new_tokens": 2}')  # the worker lives on


@pytest.mark.parametrize("model", ["tiny", "tiny_gen"])
def test_both_handler_forms_stream_and_match_unary(llm_server, model):
    body = {"prompt": "hello", "max_new_tokens": 12, "ignore_eos": True, "temperature": 0.8, "seed": 7}
    messages, _ = _stream(llm_server, model, body)
    assert len(messages) > 2
    assert "".join(messages) == llm_server.predict(model, json.dumps(body)).decode()


@pytest.mark.parametrize("model", ["tiny", "tiny_gen"])
def test_cancel_frees_the_worker(llm_server, model):
    before = llm_server.describe(model)[0]["workers"][0]
    body = {"prompt": "go", "max_new_tokens": 2000, "ignore_eos": True}
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(body).encode()})
    call = llm_server.inference.StreamPredictions(req, timeout=120)
    for count, _ in enumerate(call, 1):
        if count == 3:
            call.cancel()
            break
    start = time.monotonic()
    assert llm_server.predict(model, '{"prompt": "next", "max_new_tokens": 1}', timeout=30)
    assert time.monotonic() - start < 5.0
    after = llm_server.describe(model)[0]["workers"][0]
    assert after["pid"] == before["pid"] and after["restarts"] == 0


def test_describe_and_the_log_name_the_weight_format_and_why(llm_server):
    """An archive that names no format (``weight_format: auto``) serves this CPU's default: each
    worker's DescribeModel entry and its load log line say which format, why and for which CPU."""
    from inference_service.llm.cpu_defaults import defaults_for, this_cpu

    cpu = this_cpu()
    row = defaults_for(cpu.kind)
    for model in ("smollm2", "tiny"):
        engine = llm_server.describe(model)[0]["workers"][0]["engine"]
        assert engine["name"] == "openvino" and engine["weightFormat"] == row.weight_format, engine
        assert engine["reason"].startswith(f"the default for this CPU, {cpu} (row {cpu.kind}, "), engine
        assert engine["cpu"] == f"{cpu}, kind {cpu.kind}"
    assert f"weight format {row.weight_format}: the default for this CPU, {cpu}" in llm_server.log()


def test_an_option_the_engine_cannot_honour_is_refused_by_name(llm_server):
    """The OpenVINO engine's presence/frequency penalties follow another rule than OpenAI's: a
    request for them is refused (400 / INVALID_ARGUMENT naming the field and the torch engine),
    never served with another rule; top_k and repetition_penalty are honoured."""
    for name in ("presence_penalty", "frequency_penalty"):
        body = json.dumps({**QUESTION, name: 0.5}).encode()
        with pytest.raises(grpc.RpcError) as refused:
            list(llm_server.inference.StreamPredictions(
                inference_pb2.PredictionsRequest(model_name="smollm2", input={"data": body}), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"'{name}'" in refused.value.details() and "engine: torch" in refused.value.details()
    greedy, _ = _stream(llm_server, "smollm2", {**QUESTION, "max_new_tokens": 16})
    top1, _ = _stream(llm_server, "smollm2", {**QUESTION, "max_new_tokens": 16, "temperature": 1.0, "top_k": 1,
                                              "repetition_penalty": 1.0, "seed": 5})
    assert "".join(top1) == "".join(greedy)  # top_k 1 samples the most likely token: greedy
