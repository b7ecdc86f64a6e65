"""The continuous-batching scheduler through the real server and worker, with the tiny random Llama:
a client that stops reading gives its place back (preemption, then the full text when it reads
again) or, past the second bound, is ended; a prompt too long for the context is refused at once
on gRPC and /v1; a prompt prefilled in chunks gives the same text as in one piece."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from llm_models import ENGINES
from test_llm_server import _sample

from conftest import BearerAuth, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2, inference_pb2_grpc

pytestmark = [pytest.mark.llm, pytest.mark.slow]

# A client channel with a small HTTP/2 window and no window growth: a client that stops reading
# fills it after a few hundred bytes, so the server's writes (then the worker's credits) stop.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 256)]
LONG = 400  # tokens of a paused stream: far beyond the worker's window of 64 messages plus the buffers


def _with_config(mar: Path, top: str = "", handler: str = "") -> None:
    """Rewrite the archive's model-config.yaml: ``handler`` lines go under ``handler:``, ``top`` after."""
    with zipfile.ZipFile(mar) as archive:
        entries = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    config = entries["model-config.yaml"].decode()
    assert config.rstrip().splitlines()[-1].startswith("  "), config  # the handler section is last
    entries["model-config.yaml"] = (config + handler + top).encode()
    with zipfile.ZipFile(mar, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


@pytest.fixture(scope="module", params=sorted(ENGINES))
def sched_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama,
                 llm_archives):
    store = tmp_path_factory.mktemp("sched_store")
    # "paused": 2 places, a paused stream preempted after 0.3 s, ended after 60 s;
    # "abort": ended after 1.5 s; "whole": prompts prefilled in one piece (no chunking)
    for name, top, handler in (
        ("paused", "streamPausePreemptMSec: 300\nstreamPauseAbortMSec: 60000\n", "  max_num_batched_tokens: 16\n"),
        ("abort", "streamPausePreemptMSec: 0\nstreamPauseAbortMSec: 1500\n", ""),
        ("whole", "", "  max_num_batched_tokens: 100000\n"),
    ):
        llm_archives.build(store, "--model-path", str(tiny_llama), "--name", name, "--batch-size", "2",
                           *ENGINES[request.param])
        _with_config(store / f"{name}.mar", top, handler)
    srv = ServerProcess(tmp_path_factory.mktemp("sched_work"), store,
                        ["--models", "paused=paused.mar", "abort=abort.mar", "whole=whole.mar"])
    try:
        for name in ("paused", "abort", "whole"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _request(model: str, body: dict | bytes) -> inference_pb2.PredictionsRequest:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return inference_pb2.PredictionsRequest(model_name=model, input={"data": data})


def _small_window_stub(srv: ServerProcess) -> tuple[grpc.Channel, inference_pb2_grpc.InferenceAPIsServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.inference_port}", options=SMALL_WINDOW)
    authorized = grpc.intercept_channel(channel, BearerAuth(srv.key_file, "inference"))
    return channel, inference_pb2_grpc.InferenceAPIsServiceStub(authorized)


def _text(messages: list[bytes]) -> tuple[str, dict]:
    final = json.loads(messages[-1])
    return "".join(m.decode() for m in messages[:-1]) + final["text"], final


def _body(prompt: str, tokens: int) -> dict:
    return {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True, "include_usage": True}


def test_paused_readers_give_their_place_back_and_resume_with_the_full_text(sched_server):
    bodies = [_body("A slow reader", LONG), _body("Another slow reader", LONG)]
    want = [_text(sched_server.stream("paused", json.dumps(b), timeout=120))[0] for b in bodies]
    preempted = sched_server.log().count("preempted: its client stopped reading")
    channel, stub = _small_window_stub(sched_server)
    try:
        calls = [stub.StreamPredictions(_request("paused", b), timeout=120) for b in bodies]
        firsts = [next(c).prediction for c in calls]  # both run; then their clients stop reading
        wait_for(lambda: sched_server.log().count("preempted: its client stopped reading") >= preempted + 2,
                 timeout=30, what="both paused streams preempted")
        # the worker runs no step now; the gauges say what the engine holds all the same
        gauges = lambda: (_sample(sched_server, "inference_service_llm_num_requests_running", "paused"),  # noqa: E731
                          _sample(sched_server, "inference_service_llm_num_requests_waiting", "paused"))
        wait_for(lambda: gauges() == (0.0, 2.0), timeout=10, what=f"running 0, waiting 2 (last {gauges()})")
        # both places are held by paused streams: a third request is served once they are preempted
        # (without preemption it would wait for the model's responseTimeout, 300 s, then fail)
        text, final = _text(sched_server.stream("paused", json.dumps(_body("Third", 8)), timeout=120))
        assert final["usage"]["completion_tokens"] == 8
        # the paused clients read again: their streams are recomputed and go on to the end
        got = [_text([first] + [r.prediction for r in call])[0] for first, call in zip(firsts, calls, strict=True)]
    finally:
        channel.close()
    assert got == want
    assert "preempted: its client stopped reading" in sched_server.log()


def _routing(srv: ServerProcess, model: str) -> tuple[float, float, float]:
    """``(vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc)`` of ``model``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = []
    for family in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        found = re.search(rf'^{family}\{{model_name="{model}"\}} (\S+)$', text, re.M)
        values.append(float(found.group(1)) if found else -1.0)
    return values[0], values[1], values[2]


def test_routing_gauges_move_with_more_requests_than_max_num_seqs(sched_server):
    """Five requests on a model running two at once (batchSize 2): the endpoint picker's gauges show
    two running and three waiting with the KV cache in use, then none running or waiting."""
    seen: list[tuple[float, float, float]] = []

    def busy() -> bool:
        seen.append(_routing(sched_server, "whole"))
        return seen[-1][:2] == (2.0, 3.0) and seen[-1][2] > 0

    with ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(sched_server.stream, "whole", json.dumps(_body(f"Reader {i}", 300)), 300)
                   for i in range(5)]
        wait_for(busy, timeout=60, interval=0.05, what=f"2 running, 3 waiting (last {seen[-1:]})")
        texts = [_text(f.result(timeout=300)) for f in streams]
    assert all(final["usage"]["completion_tokens"] == 300 for _, final in texts)
    assert max(running for running, _, _ in seen) == 2  # never above max_num_seqs
    assert all(0 <= usage <= 1 for _, _, usage in seen)
    wait_for(lambda: _routing(sched_server, "whole")[:2] == (0.0, 0.0), timeout=10,
             what=f"none running or waiting (last {_routing(sched_server, 'whole')})")


def test_a_stream_paused_past_the_second_bound_ends_resource_exhausted(sched_server):
    channel, stub = _small_window_stub(sched_server)
    try:
        call = stub.StreamPredictions(_request("abort", _body("Never read", LONG)), timeout=120)
        next(call)
        start = time.monotonic()
        time.sleep(4)  # the client does not read: the scenario under test, not a wait for the server
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "streamPauseAbortMSec" in (err.value.details() or "")
        assert time.monotonic() - start < 30
    finally:
        channel.close()
    # the worker serves on, the same process
    after = _text(sched_server.stream("abort", json.dumps(_body("after", 4)), timeout=30))
    assert after[1]["finish_reason"] == "length"


def _http(srv: ServerProcess, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if srv.key_file.exists():
            headers["Authorization"] = f"Bearer {read_key(srv.key_file, 'inference')}"
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _tokenizing_time(model_dir: Path, prompt: str) -> float:
    """Seconds this process takes to tokenize ``prompt`` with the model's tokenizer, now."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    start = time.monotonic()
    tokenizer(prompt)
    return time.monotonic() - start


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(sched_server, tiny_llama):
    prompt = "word " * 1_200_000  # 6 MB
    # the bound is relative: the refusal takes under half the time tokenizing the prompt takes on
    # this machine under the same load (3.3 s quiet on a 2-core EPYC; the refusal, about 0.3 s)
    bound = _tokenizing_time(tiny_llama, prompt) / 2
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        sched_server.stream("paused", json.dumps({"prompt": prompt}), timeout=30)
    elapsed = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt too long" in (err.value.details() or "")
    assert elapsed < bound, (elapsed, bound)
    body = json.dumps({"model": "paused", "prompt": prompt, "max_tokens": 4}).encode()
    start = time.monotonic()
    status, answer = _http(sched_server, "/v1/completions", body)
    elapsed = time.monotonic() - start
    error = json.loads(answer)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and "prompt too long" in error["message"]
    assert elapsed < bound, (elapsed, bound)
    # a prompt within the character bound but over the context in tokens: refused after tokenizing
    with pytest.raises(grpc.RpcError) as err:
        sched_server.stream("paused", json.dumps({"prompt": "word " * 5000}), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the model's context length" in (err.value.details() or "")


def test_chunked_prefill_gives_the_text_of_a_whole_prefill(sched_server):
    prompt = " ".join(f"item {i}," for i in range(120))  # a few hundred tokens: many 16-token chunks
    body = json.dumps(_body(prompt, 24))
    chunked = _text(sched_server.stream("paused", body, timeout=60))
    whole = _text(sched_server.stream("whole", body, timeout=60))
    assert chunked == whole and chunked[1]["usage"]["prompt_tokens"] > 200


@pytest.fixture(scope="module", params=sorted(ENGINES))
def smol_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llm_archives):
    store = tmp_path_factory.mktemp("smol_store")
    for name, budget in (("chunked", 16), ("whole", 100000)):
        llm_archives.build(store, "--name", name, *ENGINES[request.param])
        _with_config(store / f"{name}.mar", handler=f"  max_num_batched_tokens: {budget}\n")
    srv = ServerProcess(tmp_path_factory.mktemp("smol_work"), store,
                        ["--models", "chunked=chunked.mar", "whole=whole.mar"])
    try:
        for name in ("chunked", "whole"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def test_real_model_greedy_text_is_the_same_with_and_without_chunked_prefill(smol_server):
    body = json.dumps({"messages": [{"role": "user", "content": (
        "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, "
        "lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. "
        "Which of them are yellow? Answer in one sentence.")}], "max_new_tokens": 48, "include_usage": True})
    chunked = _text(smol_server.stream("chunked", body, timeout=120))
    whole = _text(smol_server.stream("whole", body, timeout=120))
    assert chunked[1]["usage"]["prompt_tokens"] > 4 * 16  # the chunked prompt took several steps
    assert chunked == whole


def test_a_slow_but_steady_reader_keeps_the_kv_cache_within_its_capacity(sched_server):
    """Issue 34 item 9: a reader that pauses just under ``streamPausePreemptMSec`` (300 ms here) each
    time is never preempted while another place serves one request after another. Each step it
    misses used to add a padding column to the shared cache; what the cache takes stays within
    the capacity (torch engine: packed, then paused requests preempted)."""
    import threading

    family = "inference_service_llm_kv_cache_{}_tokens"
    stop = threading.Event()
    served: list[int] = []

    def others() -> None:
        while not stop.is_set():
            final = _text(sched_server.stream("paused", json.dumps(_body("Busy", 120)), timeout=120))[1]
            served.append(final["usage"]["completion_tokens"])

    channel, stub = _small_window_stub(sched_server)
    worker = threading.Thread(target=others, daemon=True)
    peak = capacity = 0.0
    try:
        call = stub.StreamPredictions(_request("paused", _body("A slow but steady reader", 1800)), timeout=120)
        next(call)
        worker.start()
        # until enough steps ran beside the reader (a slow machine takes longer), at most 90 s
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (capacity and sum(served) > capacity / 2):
            time.sleep(0.2)  # the client's reading pace, under the 300 ms preemption bound
            if next(call, None) is None:
                break
            peak = max(peak, _sample(sched_server, family.format("allocated"), "paused"))
            capacity = _sample(sched_server, family.format("capacity"), "paused")
    finally:
        stop.set()
        channel.close()
        worker.join(timeout=120)
    assert not worker.is_alive()
    assert served and all(n == 120 for n in served), served
    # enough steps ran beside the reader that one padding column per missed step would pass capacity
    assert sum(served) > capacity / 2, (sum(served), capacity)
    assert 0 < peak <= capacity, (peak, capacity)


def test_a_preempted_seeded_stream_gives_the_text_of_the_stream_alone(smol_server):
    """Issue 34 item 10, through the real server and model: a seeded sampled stream whose client
    stops reading until it is preempted (``streamPausePreemptMSec``, 1 s by default), then reads
    on, gives the text of the same request run alone (the sampler's state travels with it)."""
    body = json.dumps({"prompt": "Write a story about a lighthouse keeper.", "max_new_tokens": LONG,
                       "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True,
                       "include_usage": True})
    alone = _text(smol_server.stream("whole", body, timeout=300))
    preempted = smol_server.log().count("preempted: its client stopped reading")
    channel, stub = _small_window_stub(smol_server)
    try:
        call = stub.StreamPredictions(_request("whole", body.encode()), timeout=300)
        first = next(call).prediction
        wait_for(lambda: smol_server.log().count("preempted: its client stopped reading") > preempted,
                 timeout=60, what="the paused stream preempted")
        got = _text([first] + [r.prediction for r in call])
    finally:
        channel.close()
    assert got[1]["usage"]["completion_tokens"] == LONG
    assert got == alone


def test_an_earlier_priority_is_served_at_once_and_the_yielded_stream_keeps_its_text(sched_server):
    """Both places of "whole" (batch 2) hold long greedy streams; a request of priority -1 takes one
    of their places (the stream is preempted, recomputed later) and answers long before they end."""
    bodies = [_body("A long story", LONG), _body("Another long story", LONG)]
    want = [_text(sched_server.stream("whole", json.dumps(b), timeout=300))[0] for b in bodies]
    got: dict[int, str] = {}
    started: list[int] = []

    def long(i: int) -> None:
        req = inference_pb2.PredictionsRequest(model_name="whole", input={"data": json.dumps(bodies[i]).encode()})
        messages = []
        for response in sched_server.inference.StreamPredictions(req, timeout=300):
            if not messages:
                started.append(i)
            messages.append(response.prediction)
        got[i] = _text(messages)[0]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(long, i) for i in range(2)]
        wait_for(lambda: len(started) == 2, timeout=120, what="both long streams running")
        begun = time.monotonic()
        req = inference_pb2.PredictionsRequest(model_name="whole",
                                               input={"data": json.dumps(_body("Urgent", 4)).encode()})
        urgent = list(sched_server.inference.StreamPredictions(req, metadata=[("x-request-priority", "-1")],
                                                               timeout=300))
        urgent_s = time.monotonic() - begun
        for future in futures:
            future.result(timeout=300)
        long_s = time.monotonic() - begun
    assert json.loads(urgent[-1].prediction)["usage"]["completion_tokens"] == 4
    assert urgent_s < long_s / 2, (urgent_s, long_s)  # served while the long streams still ran
    assert [got[0], got[1]] == want  # the yielded stream, recomputed, gave the text it gives alone
