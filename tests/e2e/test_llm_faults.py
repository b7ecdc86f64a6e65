"""One request fails alone (issue: a tiny temperature failed every stream of its worker).

Through the real server, on both engines, with the tiny random Llama:

- every number field of the typed request, fed the extreme doubles a hostile client sends, through
  every door (gRPC Predictions and StreamPredictions, HTTP /predictions, OpenAI chat and
  completions), is served or refused by name (400 / INVALID_ARGUMENT), never INTERNAL;
- a request the engine fails on (a fault planted in the engine by tests/handlers/faulty_llm_handler.py)
  ends alone with our own message, while three long streams beside it stream to their end.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from llm_models import ENGINES

from conftest import HANDLERS, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2
from inference_service.llm.engine_protocol import REQUEST_FAULT

pytestmark = pytest.mark.slow  # two servers of the tiny model, on each engine

#: The number fields of the typed request, as the TorchServe JSON body and OpenAI's body name them.
FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
          "top_k": "top_k", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty"}
#: Zero, the smallest positive double, denormals, float32's edges, 1e+-308, NaN and the infinities.
EXTREMES = (0.0, 5e-324, 1e-310, 1e-300, 1e-46, 1e-39, 1e-38, 1e38, 1e308, -1e-300, -1e308,
            float("nan"), float("inf"), float("-inf"))
FAULT_SEED = 4242
#: The responseTimeout (s) of the ``hasty`` model: the tiny model's, shorter than a long stream of it.
HASTY_TIMEOUT = 1


def _with_handler(mar: Path, handler_file: Path | None = None, config: tuple[str, str] | None = None,
                  target: Path | None = None) -> None:
    """Write ``mar`` (to ``target``, else over itself) with its handler module replaced by
    ``handler_file`` and its model-config.yaml's ``config[0]`` text replaced by ``config[1]``."""
    with zipfile.ZipFile(mar) as archive:
        entries = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    if handler_file is not None:
        entries["llm_handler.py"] = handler_file.read_bytes()
    if config is not None:
        old, new = config
        assert old.encode() in entries["model-config.yaml"]
        entries["model-config.yaml"] = entries["model-config.yaml"].replace(old.encode(), new.encode())
    with zipfile.ZipFile(target or mar, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


@pytest.fixture(scope="module", params=sorted(ENGINES))
def fault_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama,
                 llm_archives):
    store = tmp_path_factory.mktemp("fault_store")
    llm_archives.build(store, "--model-path", str(tiny_llama), "--name", "tiny", *ENGINES[request.param])
    llm_archives.build(store, "--model-path", str(tiny_llama), "--name", "faulty", *ENGINES[request.param])
    _with_handler(store / "faulty.mar", HANDLERS / "faulty_llm_handler.py")
    _with_handler(store / "tiny.mar", config=("responseTimeout: 300", f"responseTimeout: {HASTY_TIMEOUT}"),
                  target=store / "hasty.mar")
    srv = ServerProcess(tmp_path_factory.mktemp("fault_work"), store,
                        ["--models", "tiny=tiny.mar", "faulty=faulty.mar", "hasty=hasty.mar"])
    try:
        for name in ("tiny", "faulty", "hasty"):
            srv.wait_workers(name, 1, timeout=600)
        srv.engine = request.param
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _http(srv: ServerProcess, path: str, body: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=60)
    try:
        conn.request("POST", path, body.encode(), {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}",
                                                   "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _grpc(srv: ServerProcess, body: str, stream: bool, model: str = "tiny") -> tuple[grpc.StatusCode, str]:
    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": body.encode()})
    try:
        if stream:
            for _ in srv.inference.StreamPredictions(request, timeout=60):
                pass
        else:
            srv.inference.Predictions(request, timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _door_answers(srv: ServerProcess, field: str, value: float) -> dict[str, tuple[bool, str]]:
    """``{door: (served, error text)}`` for one field set to ``value`` (a short, greedy-or-sampled request)."""
    ours = {"prompt": "The sky is", "max_new_tokens": 2, field: value}
    openai_field = FIELDS[field]
    oai = {"model": "tiny", "max_tokens": 2, openai_field: value}
    answers: dict[str, tuple[bool, str]] = {}
    for door, stream in (("grpc Predictions", False), ("grpc StreamPredictions", True)):
        code, details = _grpc(srv, json.dumps(ours), stream)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (door, field, value, code, details)
        answers[door] = (code == grpc.StatusCode.OK, details)
    for door, path, body in (
        ("http /predictions", "/predictions/tiny", ours),
        ("openai chat", "/v1/chat/completions", {**oai, "messages": [{"role": "user", "content": "Hi"}]}),
        ("openai completions", "/v1/completions", {**oai, "prompt": "The sky is"}),
    ):
        status, text = _http(srv, path, json.dumps(body))
        assert status in (200, 400), (door, field, value, status, text)
        answers[door] = (status == 200, "" if status == 200 else text)
    return answers


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_extreme_doubles_are_served_or_refused_by_name_at_every_door(fault_server, field):
    for value in EXTREMES:
        for door, (served, error) in _door_answers(fault_server, field, value).items():
            if not served:
                name = FIELDS[field] if door.startswith("openai") else field
                assert name in error, (door, field, value, error)
                assert "Check" not in error and ".cpp" not in error, error  # never the engine's own text
    # and the worker still serves
    code, details = _grpc(fault_server, json.dumps({"prompt": "The sky is", "max_new_tokens": 4}), stream=True)
    assert code == grpc.StatusCode.OK, details


def test_a_tiny_temperature_is_served_greedy(fault_server):
    greedy = fault_server.predict("tiny", json.dumps({"prompt": "The sky is", "max_new_tokens": 8}))
    for temperature in (1e-46, 1e-300, 9e-6):
        body = {"prompt": "The sky is", "max_new_tokens": 8, "temperature": temperature, "top_p": 1e-30}
        assert fault_server.predict("tiny", json.dumps(body)) == greedy


def _victim(srv: ServerProcess, prompt: str, tokens: int, out: dict[str, Any], model: str = "faulty") -> None:
    body = {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True, "include_usage": True}
    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(body).encode()})
    messages = []
    try:
        for response in srv.inference.StreamPredictions(request, timeout=300):
            messages.append(response.prediction.decode())
            out["streamed"] = len(messages)
        out["final"] = json.loads(messages[-1])
    except grpc.RpcError as err:
        out["error"] = (err.code(), err.details())
    finally:
        out["done"] = time.monotonic()


def test_a_request_the_engine_fails_on_ends_alone_while_three_streams_go_on(fault_server):
    srv = fault_server
    tokens = 1500
    victims: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=_victim, args=(srv, f"Story {i}: once upon a time", tokens, victims[i]))
               for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(v.get("streamed", 0) > 2 for v in victims), timeout=60, what="the three streams started")
    faults = []
    deadline = time.monotonic() + 240
    next_fault = time.monotonic()
    while any("done" not in v for v in victims) and time.monotonic() < deadline:
        if time.monotonic() >= next_fault:
            body = {"prompt": "Break here", "max_new_tokens": 8, "temperature": 1.0, "top_k": 50, "seed": FAULT_SEED}
            request = inference_pb2.PredictionsRequest(model_name="faulty", input={"data": json.dumps(body).encode()})
            with pytest.raises(grpc.RpcError) as err:
                for _ in srv.inference.StreamPredictions(request, timeout=60):
                    pass
            faults.append((err.value.code(), err.value.details(), all("done" not in v for v in victims)))
            next_fault += 1.0
        time.sleep(0.02)  # pacing the one-a-second faults, not a synchronisation point
    for thread in threads:
        thread.join(timeout=60)
    assert all("final" in v for v in victims), victims
    for victim in victims:
        assert victim["final"]["finish_reason"] == "length", victim
        assert victim["final"]["usage"]["completion_tokens"] == tokens, victim
    assert sum(1 for *_, mid_stream in faults if mid_stream) >= 2, f"too few faults landed mid-stream: {faults}"
    for code, details, _ in faults:
        assert code == grpc.StatusCode.INTERNAL and details == REQUEST_FAULT, (code, details)
    log = srv.log()
    assert ("planted sampler fault" if srv.engine == "torch" else "temperature") in log
    # the worker serves on: a request without the fault is answered
    assert srv.predict("faulty", json.dumps({"prompt": "The sky is", "max_new_tokens": 4}))


def _three_victims(srv: ServerProcess, tokens: int) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
    """Three greedy streams of ``tokens`` tokens on ``tiny``, started and streaming."""
    victims: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=_victim, args=(srv, f"Story {i}: once upon a time", tokens, victims[i], "tiny"))
               for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(v.get("streamed", 0) > 2 for v in victims), timeout=60, what="the three streams started")
    return victims, threads


def test_a_lone_surrogate_is_refused_alone_at_every_door_while_three_streams_go_on(fault_server):
    """Issue 48 item 2: ``"\\ud800"`` in a prompt made the tokenizer raise inside the shared step, and
    every stream batched with it ended INTERNAL. Now each door refuses that request alone."""
    srv = fault_server
    tokens = 400
    victims, threads = _three_victims(srv, tokens)
    ours = '{"prompt": "What is \\ud800 here?", "max_new_tokens": 4}'
    chat = '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi \\udfff"}]}'
    refusals: dict[str, tuple[Any, str]] = {
        door: _grpc(srv, ours, stream) for door, stream in (("Predictions", False), ("StreamPredictions", True))}
    for door, path, body in (("/predictions", "/predictions/tiny", ours), ("chat", "/v1/chat/completions", chat),
                             ("completions", "/v1/completions", ours.replace('"prompt"', '"model": "tiny", "prompt"'))):
        refusals[door] = _http(srv, path, body)
    mid_stream = all("done" not in v for v in victims)
    for thread in threads:
        thread.join(timeout=120)
    for door in ("Predictions", "StreamPredictions"):
        assert refusals[door][0] == grpc.StatusCode.INVALID_ARGUMENT, refusals[door]
    for door in ("/predictions", "chat", "completions"):
        assert refusals[door][0] == 400, refusals[door]
    assert "lone surrogate" in refusals["Predictions"][1] and "prompt" in refusals["Predictions"][1], refusals
    assert "lone surrogate" in refusals["/predictions"][1], refusals
    assert mid_stream, "the streams ended before the refusals: nothing was batched with them"
    for victim in victims:
        assert victim.get("final", {}).get("usage", {}).get("completion_tokens") == tokens, victim


#: Over the 5 s budget on every CPU measured: 10.1 s of CPU time to compile on an AVX512 AMD EPYC,
#: where the issue's ``.{0,5000}`` takes 2.3 s and passes (benchmarks/RESULTS.md, "Constraint budget").
COSTLY = "[^\\n]{0,5000}\\n[^,]{0,5000},[^;]{0,5000}"


def test_a_costly_constraint_is_refused_by_its_budget_while_three_streams_go_on(fault_server):
    """Issue 48 item 1: ``.{0,5000}`` compiled against the 49,152-token vocabulary inside the shared
    step (about 11 s on a loaded Xeon, then seconds a token) stalled every stream of the worker. Now
    the grammar checker refuses a constraint over its CPU budget (5 s; :data:`COSTLY`, as the
    issue's regex is on a slower CPU), on every door, before it reaches the engine."""
    srv = fault_server
    cheap = json.dumps({"prompt": "Year:", "max_new_tokens": 4, "structured_outputs": {"regex": "[0-9]+"}})
    assert _grpc(srv, cheap, False) == (grpc.StatusCode.OK, "")  # the first one starts the checker
    tokens = 2000  # the context's length: as long as the tiny model streams
    victims, threads = _three_victims(srv, tokens)
    ours = json.dumps({"prompt": "Say anything", "max_new_tokens": 64, "structured_outputs": {"regex": COSTLY}})
    oai = {"model": "tiny", "max_tokens": 64, "structured_outputs": {"regex": COSTLY}}
    refusals: dict[str, tuple[Any, str, float]] = {}
    for door, stream in (("Predictions", False), ("StreamPredictions", True)):
        before = [v.get("streamed", 0) for v in victims]
        start = time.monotonic()
        refusals[door] = (*_grpc(srv, ours, stream), time.monotonic() - start)
        if door == "Predictions":  # the streams went on while the checker spent its budget (or ended)
            went_on = all("done" in v or v.get("streamed", 0) > seen for v, seen in zip(victims, before, strict=True))
    for door, path, body in (("/predictions", "/predictions/tiny", ours),
                             ("chat", "/v1/chat/completions",
                              json.dumps({**oai, "messages": [{"role": "user", "content": "Hi"}]})),
                             ("completions", "/v1/completions", json.dumps({**oai, "prompt": "Say anything"}))):
        start = time.monotonic()
        refusals[door] = (*_http(srv, path, body), time.monotonic() - start)
    for thread in threads:
        thread.join(timeout=120)
    budget = "takes over 5000 ms of CPU time to compile against this model's vocabulary (the budget, " \
             "structured_outputs_budget_ms)"
    for door, (code, text, elapsed) in refusals.items():
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, 400), (door, code, text)
        assert "'structured_outputs.regex'" in text and budget in text, (door, text)
        assert elapsed < 21.5, (door, elapsed)  # the budget or its backstop on the clock (21 s), not the compile
    assert went_on, f"the streams stalled while the first refusal was made {refusals}"
    for victim in victims:
        assert victim.get("final", {}).get("usage", {}).get("completion_tokens") == tokens, victim
    assert _grpc(srv, cheap, True) == (grpc.StatusCode.OK, "")


def test_a_stream_past_response_timeout_ends_alone_and_the_worker_serves_on(fault_server):
    """Issue 48 item 1: a stream that made progress was never cut, so one request could hold a
    worker's place past ``responseTimeout`` for as long as it generated. Now it ends with
    DEADLINE_EXCEEDED at ``responseTimeout`` (1 s on ``hasty``), and the worker is not replaced."""
    srv = fault_server
    assert _grpc(srv, json.dumps({"prompt": "Hi", "max_new_tokens": 2}), False, "hasty")[0] == grpc.StatusCode.OK
    pids = srv.worker_pids()
    long: dict[str, Any] = {}
    body = {"prompt": "Tell a long story", "max_new_tokens": 2000, "ignore_eos": True}
    request = inference_pb2.PredictionsRequest(model_name="hasty", input={"data": json.dumps(body).encode()})

    def stream() -> None:
        try:
            for _ in srv.inference.StreamPredictions(request, timeout=120):
                long["streamed"] = long.get("streamed", 0) + 1
        except grpc.RpcError as err:
            long["error"] = (err.code(), err.details())
        long["done"] = time.monotonic()

    thread = threading.Thread(target=stream)
    start = time.monotonic()
    thread.start()
    wait_for(lambda: long.get("streamed", 0) > 2 or "done" in long, timeout=60, what="the long stream started")
    short = _grpc(srv, json.dumps({"prompt": "Hi", "max_new_tokens": 4}), True, "hasty")
    thread.join(timeout=120)
    assert short == (grpc.StatusCode.OK, ""), short
    assert long.get("error", (None, ""))[0] == grpc.StatusCode.DEADLINE_EXCEEDED, long
    assert f"ran past model hasty's response_timeout={HASTY_TIMEOUT}s and was ended" in long["error"][1], long
    assert long["streamed"] > 2 and long["done"] - start < 30, long
    assert _grpc(srv, json.dumps({"prompt": "Hi", "max_new_tokens": 4}), False, "hasty") == (grpc.StatusCode.OK, "")
    assert srv.worker_pids() == pids  # no worker was replaced
    assert "ran past response_timeout=1s" in srv.log()
