"""Many users at once: the bundled LLM archive (continuous batching, batchSize 8) serving several
streams on one worker, through the real server.

A tiny random-weight Llama checks the mechanics quickly (concurrent streams each get exactly their
tokens and equal what the same request gets alone, a cancelled stream leaves the others running);
the real SmolLM2 answers four different questions streamed at the same time.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from llm_models import ENGINES

from conftest import ServerProcess
from inference_service._proto import inference_pb2

pytestmark = [pytest.mark.llm, pytest.mark.slow]


@pytest.fixture(scope="module", params=sorted(ENGINES))
def cb_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama, llm_archives):
    store = tmp_path_factory.mktemp("cb_store")
    llm_archives.build(store, *ENGINES[request.param])  # the bundled archive: continuousBatching, batchSize 8
    llm_archives.build(store, "--model-path", str(tiny_llama), "--name", "tiny", "--batch-size", "4",
                       *ENGINES[request.param])
    srv = ServerProcess(tmp_path_factory.mktemp("cb_work"), store,
                        ["--models", "smollm2=smollm2.mar", "tiny=tiny.mar"])
    try:
        for name in ("smollm2", "tiny"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _stream(srv: ServerProcess, model: str, body: dict, timeout: float = 120):
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(body).encode()})
    return srv.inference.StreamPredictions(req, timeout=timeout)


def _collect(srv: ServerProcess, model: str, body: dict) -> tuple[str, dict]:
    messages = [r.prediction.decode() for r in _stream(srv, model, body)]
    final = json.loads(messages[-1])
    return "".join(messages[:-1]) + final["text"], final


def _parallel(fn, args_list) -> list:
    results: list = [None] * len(args_list)
    errors: list = []

    def run(i: int, args: tuple) -> None:
        try:
            results[i] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


PROMPTS = ["Once upon a time", "The weather today is", "In a distant galaxy, a small robot",
           "Lists of numbers: 1, 2, 3,"]


def test_tiny_model_concurrent_streams_equal_each_request_alone(cb_server):
    bodies = [{"prompt": p, "max_new_tokens": 12 + 4 * i, "ignore_eos": True, "include_usage": True}
              for i, p in enumerate(PROMPTS)]
    alone = [_collect(cb_server, "tiny", b) for b in bodies]
    together = _parallel(lambda b: _collect(cb_server, "tiny", b), [(b,) for b in bodies])
    for (text_alone, _), (text_together, final_together), body in zip(alone, together, bodies,
                                                                                strict=True):
        assert final_together["usage"]["completion_tokens"] == body["max_new_tokens"]
        assert final_together["finish_reason"] == "length"
        assert text_together == text_alone


def test_tiny_model_cancel_one_stream_others_finish(cb_server):
    pid = cb_server.describe("tiny")[0]["workers"][0]["pid"]
    doomed = _stream(cb_server, "tiny", {"prompt": "Forever", "max_new_tokens": 2000, "ignore_eos": True})
    next(doomed)
    body = {"prompt": "Short one", "max_new_tokens": 16, "ignore_eos": True, "include_usage": True}
    survivor = _parallel(lambda: _collect(cb_server, "tiny", body), [()])[0]
    doomed.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(doomed)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert survivor[1]["usage"]["completion_tokens"] == 16
    deadline = time.monotonic() + 30  # the worker takes new requests at once, the same process
    text, final = _collect(cb_server, "tiny", body)
    assert time.monotonic() < deadline and final["usage"]["completion_tokens"] == 16
    assert cb_server.describe("tiny")[0]["workers"][0]["pid"] == pid


CAPITALS = {"France": "Paris", "Japan": "Tokyo", "England": "London", "Germany": "Berlin"}  # what the 135M model knows


def test_real_model_answers_four_users_at_once(cb_server):
    def ask(country: str) -> tuple[str, dict]:
        return _collect(cb_server, "smollm2", {
            "messages": [{"role": "user", "content": f"What is the capital of {country}?"}],
            "max_new_tokens": 32, "include_usage": True})

    answers = _parallel(ask, [(c,) for c in CAPITALS])
    for (text, final), capital in zip(answers, CAPITALS.values(), strict=True):
        assert capital in text, text
        assert final["finish_reason"] in ("stop", "length")
