"""OpenAI's API end to end: the official ``openai`` client against the real server and LLM workers.

The server is tests/conftest.py's ``llm_server``, shared with ``test_llm_server.py`` (the real SmolLM2
loaded once a session, and ``tiny``, a random-weight Llama with SmolLM2's tokenizer in
the bundled archive's continuous-batching form). The tiny model answers everything that only
needs "an LLM" (its text is gibberish, but greedy and seeded requests are reproducible, so
answers are compared with what gRPC StreamPredictions gives for the same handler request);
SmolLM2 answers one streamed chat with sensible text.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import openai
import pytest
from test_llm_server import _sample
from test_llm_server import _stream as grpc_stream

from conftest import ServerProcess, read_key, wait_for

#: one worker process runs both modules of tests/conftest.py's session-scoped ``llm_server``
pytestmark = [pytest.mark.llm, pytest.mark.slow, pytest.mark.xdist_group("llm_server")]

HELLO = [{"role": "user", "content": "Say hello."}]


def _base_url(srv: ServerProcess) -> str:
    return f"http://127.0.0.1:{srv.status['http_port']}/v1"


def client(srv: ServerProcess, key: str | None = None) -> openai.OpenAI:
    """The official client, as users configure it (``api_key`` = the inference key); no retries."""
    return openai.OpenAI(base_url=_base_url(srv), api_key=key or read_key(srv.key_file, "inference"),
                         max_retries=0, timeout=120)


def async_client(srv: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=_base_url(srv), api_key=read_key(srv.key_file, "inference"),
                              max_retries=0, timeout=120)


def grpc_text(srv: ServerProcess, model: str, body: dict) -> tuple[str, dict]:
    """What StreamPredictions gives for the same handler request: (text, final usage object)."""
    messages, _ = grpc_stream(srv, model, {**body, "include_usage": True})
    final = json.loads(messages[-1])
    return "".join(messages[:-1]) + final["text"], final


def test_models_are_listed(llm_server):
    ids = [m.id for m in client(llm_server).models.list().data]
    assert {"smollm2", "smollm2/1.0", "tiny", "tiny/1.0", "tiny_gen", "tiny_gen/1.0"} <= set(ids)


def test_chat_completion_equals_grpc(llm_server):
    answer = client(llm_server).chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=12, extra_body={"ignore_eos": True})
    text, final = grpc_text(llm_server, "tiny", {"messages": HELLO, "max_new_tokens": 12, "ignore_eos": True})
    assert answer.object == "chat.completion" and answer.model == "tiny" and len(answer.choices) == 1
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 12 == final["usage"]["completion_tokens"]
    assert answer.usage.prompt_tokens == final["usage"]["prompt_tokens"] > 5  # the chat template's tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_chat_stream_with_usage(llm_server):
    request = {"model": "tiny/1.0", "messages": HELLO, "max_completion_tokens": 16, "seed": 5, "temperature": 0.9,
               "extra_body": {"ignore_eos": True}}
    whole = client(llm_server).chat.completions.create(**request)
    with client(llm_server).chat.completions.create(**request, stream=True,
                                                    stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 4  # role, several pieces, finish, usage
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # the same seed gives the same text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk
    with client(llm_server).chat.completions.create(**request, stream=True) as stream:
        chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_completions_stream_and_whole(llm_server):
    prompt = "Once upon a time"
    text, _ = grpc_text(llm_server, "tiny", {"prompt": prompt, "max_new_tokens": 10, "ignore_eos": True})
    whole = client(llm_server).completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                                  extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].text == text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    chunks = list(client(llm_server).completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
    # OpenAI's default of 16 tokens for completions
    default = client(llm_server).completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16


def test_stop_string_ends_with_finish_reason_stop(llm_server):
    full = client(llm_server).completions.create(model="tiny", prompt="Lists", max_tokens=24,
                                                 extra_body={"ignore_eos": True}).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full[len(full) // 3:])
    assert words, full
    stopped = client(llm_server).completions.create(model="tiny", prompt="Lists", max_tokens=24, stop=[words[0]],
                                                    extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert words[0] not in stopped.choices[0].text and full.startswith(stopped.choices[0].text)


def test_async_client_streams_share_the_batch(llm_server):
    """Four concurrent streams through AsyncOpenAI each get the text they get alone (greedy)."""
    prompts = ["Once upon a time", "The weather today is", "In a distant galaxy", "Numbers: 1, 2, 3,"]
    alone = [grpc_text(llm_server, "tiny", {"prompt": p, "max_new_tokens": 12, "ignore_eos": True})[0]
             for p in prompts]

    async def one(api: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        stream = await api.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return text, usage

    async def together() -> list[tuple[str, int]]:
        async with async_client(llm_server) as api:
            whole = await api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
            assert whole.usage.completion_tokens <= 4
            return await asyncio.gather(*(one(api, p) for p in prompts))

    results = asyncio.run(together())
    assert [text for text, _ in results] == alone
    assert all(usage == 12 for _, usage in results)


def test_errors_raise_the_clients_exceptions(llm_server):
    with pytest.raises(openai.AuthenticationError):
        client(llm_server, key="not-the-key").chat.completions.create(model="tiny", messages=HELLO)
    with pytest.raises(openai.NotFoundError) as err:
        client(llm_server).chat.completions.create(model="gpt-4o", messages=HELLO)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client(llm_server).chat.completions.create(model="tiny", messages=HELLO, n=17)
    assert err.value.param == "n"
    # the handler's own checks come back as 400 too: a prompt + max_tokens beyond the context (2048)
    with pytest.raises(openai.BadRequestError) as err:
        client(llm_server).completions.create(model="tiny", prompt="x", max_tokens=4000)
    assert "context length" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # ...and before any stream starts
        client(llm_server).completions.create(model="tiny", prompt="x", max_tokens=4097, stream=True)
    assert "max_new_tokens" in err.value.message


def test_disconnect_mid_stream_stops_generation(llm_server):
    """A client that closes its stream after three chunks: the worker drops the request at once."""
    before = llm_server.describe("tiny")[0]["workers"][0]
    stream = client(llm_server).chat.completions.create(model="tiny", messages=HELLO, max_tokens=1900, stream=True,
                                                        extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, 1):
        if count == 3:
            break
    stream.close()
    closed = time.monotonic()
    llm_server.wait_described("tiny", lambda d: d["workers"][0]["status"] == "READY", timeout=30,
                              what="tiny's worker idle")
    assert time.monotonic() - closed < 10
    dropped = re.findall(r"request \S+ dropped after (\d+) completion tokens", llm_server.log())
    assert dropped and int(dropped[-1]) < 1900, dropped
    after = llm_server.describe("tiny")[0]["workers"][0]
    assert after["pid"] == before["pid"]
    # the worker serves the next request
    assert client(llm_server).completions.create(model="tiny", prompt="next", max_tokens=2).usage.completion_tokens


def test_real_model_streams_a_sensible_chat_answer(llm_server):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    start = time.monotonic()
    arrivals, pieces, usage, finish = [], [], None, None
    with client(llm_server).chat.completions.create(model="smollm2", messages=question, max_tokens=48, stream=True,
                                                    stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            arrivals.append(time.monotonic() - start)
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
    answer = "".join(pieces)
    assert "Paris" in answer, answer
    assert finish in ("stop", "length") and usage.completion_tokens <= 48 and usage.prompt_tokens > 10
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len([g for g in gaps if g > 0.003]) >= 3, arrivals  # the text streams, token by token (about 8 ms each)
    # the same answer as gRPC gives for the same (greedy) request
    text, _ = grpc_text(llm_server, "smollm2", {"messages": question, "max_new_tokens": 48})
    assert answer == text


# ------------------------------------------------------------- issue 42: the fields clients send
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def test_n_gives_distinct_seeded_choices_streamed_and_not(llm_server):
    """n=3 on the OpenVINO engine: 3 choices, distinct when sampled; choice i is the request seeded
    seed + i, so the same request gives the same choices, streamed or not, batched or alone (fp32:
    int8 arithmetic in another batch mix may flip a sampled near-tie, docs/llm.md)."""
    request = {"model": "tiny_fp32", "messages": POEM, "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 42,
               "extra_body": {"ignore_eos": True}}
    whole = client(llm_server).chat.completions.create(**request)
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert whole.usage.completion_tokens == 3 * 12
    assert [c.message.content for c in client(llm_server).chat.completions.create(**request).choices] == texts
    streamed = ["", "", ""]
    with client(llm_server).chat.completions.create(**request, stream=True,
                                                    stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 12
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1, 2]
    alone = grpc_text(llm_server, "tiny_fp32", {"messages": POEM, "max_new_tokens": 12, "temperature": 1.0,
                                                "seed": 43, "ignore_eos": True})[0]
    assert alone == texts[1]
    # the bundled model (int8): three distinct choices
    poems = client(llm_server).chat.completions.create(model="smollm2", messages=POEM, max_tokens=16, n=3,
                                                       temperature=0.8, seed=1)
    assert len({c.message.content for c in poems.choices}) == 3


def test_logprobs_on_the_openvino_engine_streamed_and_not(llm_server):
    """The sampled tokens' log probabilities in OpenAI's chat shape, read by the official client; the
    greedy token is the most likely one; top_logprobs is refused by name on this engine."""
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 32, "logprobs": True}
    whole = client(llm_server).chat.completions.create(**request)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason == "stop"  # the end-of-sequence token: counted, no text, no entry
    assert len(content) == whole.usage.completion_tokens - 1
    assert "".join(e.token for e in content) == choice.message.content and "Paris" in choice.message.content
    assert all(e.logprob <= 0 and bytes(e.bytes).decode() == e.token and e.top_logprobs == [] for e in content)
    assert sum(e.logprob for e in content) / len(content) > -1.0  # a confident greedy answer
    with client(llm_server).chat.completions.create(**request, stream=True) as stream:
        streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    with pytest.raises(openai.BadRequestError) as err:
        client(llm_server).chat.completions.create(**request, top_logprobs=5)
    assert err.value.param == "top_logprobs" and "'engine: torch'" in err.value.message
    completion = client(llm_server).completions.create(model="smollm2", prompt="The capital of France is",
                                                       max_tokens=4, logprobs=0, echo=False)
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.text_offset) == 4
    assert "".join(legacy.tokens) == completion.choices[0].text and legacy.text_offset[0] == 0
    assert [list(top) for top in legacy.top_logprobs] == [[t] for t in legacy.tokens]


def test_top_logprobs_on_the_torch_engine(llm_server):
    """top_logprobs=5 where the engine has the alternatives: the greedy token is the first of them."""
    request = {"model": "tiny_torch", "messages": HELLO, "max_tokens": 8, "logprobs": True, "top_logprobs": 5,
               "extra_body": {"ignore_eos": True}}
    for stream in (False, True):
        if stream:
            with client(llm_server).chat.completions.create(**request, stream=True) as chunks:
                content = [e for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
        else:
            content = client(llm_server).chat.completions.create(**request).choices[0].logprobs.content
        assert len(content) == 8
        for entry in content:
            assert len(entry.top_logprobs) == 5
            assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                      reverse=True)
    legacy = client(llm_server).completions.create(model="tiny_torch", prompt="Once upon a time", max_tokens=6,
                                                   logprobs=3, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert all(3 <= len(top) <= 4 and max(top.values()) == lp for top, lp in
               zip(legacy.top_logprobs, legacy.token_logprobs, strict=True))


def test_best_of_echo_and_a_list_of_prompts(llm_server):
    prompts = ["Once upon a time", "The weather today is"]
    batch = client(llm_server).completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2, echo=True,
                                                  temperature=0.9, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(prompts[c.index // 2]) for c in batch.choices] == [True] * 4
    alone = grpc_text(llm_server, "tiny", {"prompt": prompts[1], "max_new_tokens": 6, "ignore_eos": True,
                                           "temperature": 0.9, "seed": 2})[0]
    assert batch.choices[3].text == prompts[1] + alone  # prompt 1, choice 1: seed 1 + 1
    assert batch.usage.completion_tokens == 4 * 6
    best = client(llm_server).completions.create(model="tiny", prompt=prompts[0], max_tokens=6, n=1, best_of=3,
                                                 temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # ranked by them, not asked for
    assert best.usage.completion_tokens == 3 * 6  # every candidate's tokens
    candidates = [grpc_text(llm_server, "tiny", {"prompt": prompts[0], "max_new_tokens": 6, "ignore_eos": True,
                                                 "temperature": 1.0, "seed": 5 + i})[0] for i in range(3)]
    assert best.choices[0].text in candidates


def test_disconnect_mid_stream_drops_every_choice(llm_server):
    """A client that closes a stream of n=2 choices: the worker drops both requests at once."""
    dropped = re.compile(r"request \S+ dropped after (\d+) completion tokens")
    before = len(dropped.findall(llm_server.log()))
    stream = client(llm_server).chat.completions.create(model="tiny", messages=HELLO, max_tokens=1900, n=2,
                                                        stream=True, extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, 1):
        if count == 6:
            break
    stream.close()
    def both() -> list[str] | None:
        seen = dropped.findall(llm_server.log())[before:]
        return seen if len(seen) >= 2 else None

    found = wait_for(both, timeout=15, what="both choices dropped")
    assert all(int(tokens) < 1900 for tokens in found), found
    assert client(llm_server).completions.create(model="tiny", prompt="next", max_tokens=2).usage.completion_tokens


def test_unknown_fields_are_served_and_named(llm_server):
    raw = client(llm_server).chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=2, extra_body={"temprature": 1.5})
    assert raw.headers["x-ignored-fields"] == "temprature" and raw.parse().usage.completion_tokens <= 2
    assert "ignored unknown field(s) temprature" in llm_server.log()


def test_the_torchserve_doors_stream_one_answer_with_its_logprobs(llm_server):
    """n above 1 is the OpenAI door's; logprobs through gRPC: every message an object with its entries."""
    with pytest.raises(grpc.RpcError) as err:
        grpc_stream(llm_server, "tiny", {"prompt": "x", "n": 2})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'n' above 1" in err.value.details()
    messages, _ = grpc_stream(llm_server, "tiny", {"prompt": "Hi", "max_new_tokens": 5, "ignore_eos": True,
                                                   "logprobs": True})
    objects = [json.loads(m) for m in messages]
    assert objects[-1]["finish_reason"] == "length" and "usage" not in objects[-1]
    assert sum(len(o["logprobs"]) for o in objects) == 5


# ------------------------------------------------------------- issue 38: prefix caching you can see
def _ttft(srv: ServerProcess, messages: list[dict[str, str]]) -> float:
    start = time.monotonic()
    with client(srv).chat.completions.create(model="smollm2", messages=messages, max_tokens=4, stream=True) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                return time.monotonic() - start
    raise AssertionError("no text came back")


def test_a_shared_system_prompt_is_computed_once(llm_server):
    """A 1,500-token system prompt: the second request's first token comes in <= 0.3x the first's time,
    and the prefix cache counters show it (vLLM's prefix_cache_queries / prefix_cache_hits)."""
    import urllib.request

    rules = " ".join(f"Rule {i}: answer in plain words and keep it short." for i in range(150))
    system = {"role": "system", "content": f"Session {time.time_ns()}. {rules}"}
    url = f"http://127.0.0.1:{llm_server.status['http_port']}/tokenize"
    request = urllib.request.Request(url, json.dumps({"model": "smollm2", "messages": [system]}).encode(), {
        "Authorization": f"Bearer {read_key(llm_server.key_file, 'inference')}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        counted = json.loads(response.read())
    assert counted["count"] >= 1500 and counted["max_model_len"] == 8192
    hits = "inference_service_llm_prefix_cache_hits_total"
    queries = "inference_service_llm_prefix_cache_queries_total"
    before = _sample(llm_server, hits, "smollm2"), _sample(llm_server, queries, "smollm2")
    first = _ttft(llm_server, [system, {"role": "user", "content": "What is the capital of France?"}])
    middle = _sample(llm_server, hits, "smollm2")
    second = _ttft(llm_server, [system, {"role": "user", "content": "What is the capital of Italy?"}])
    assert second <= 0.3 * first, (first, second)
    after = wait_for(lambda: (v := _sample(llm_server, hits, "smollm2")) >= middle + 1400 and v, timeout=10,
                     what="the second request's prefix cache hits")
    assert middle - before[0] < 64  # the first request found little: its session line is new
    assert _sample(llm_server, queries, "smollm2") - before[1] >= 2 * counted["count"]
    assert after - middle <= counted["count"] + 40
    # /tokenize counts a chat as the engine does: the prompt_tokens of its completion
    chat = [system, {"role": "user", "content": "What is the capital of Spain?"}]
    request = urllib.request.Request(url, json.dumps({"model": "smollm2", "messages": chat}).encode(), {
        "Authorization": f"Bearer {read_key(llm_server.key_file, 'inference')}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        tokens = json.loads(response.read())["tokens"]
    usage = client(llm_server).chat.completions.create(model="smollm2", messages=chat, max_tokens=1).usage
    assert usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize("model", ["tiny", "tiny_torch"])
def test_one_request_of_many_choices_leaves_room_for_another_client(llm_server, model):
    """Issue 48 item 3: 4 prompts x n=16 became 64 engine requests, 8 running and 56 queued in
    front of everyone else. Now they are one unit of the job queue (one place of job_queue_size,
    taken in turn with other requests) and leave a place of the worker for a newcomer: another
    client's 1-token request is answered at once, not behind the 56."""
    import contextlib
    import http.client
    import socket
    import threading

    solo = []
    for _ in range(3):
        started = time.monotonic()
        client(llm_server).completions.create(model=model, prompt="quick", max_tokens=1)
        solo.append(time.monotonic() - started)
    body = json.dumps({"model": model, "prompt": ["one", "two", "three", "four"], "n": 16, "max_tokens": 1500,
                       "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", llm_server.status["http_port"], timeout=300)

    def big() -> None:
        try:
            conn.request("POST", "/v1/completions", body, {
                "Authorization": f"Bearer {read_key(llm_server.key_file, 'inference')}",
                "Content-Type": "application/json"})
            conn.getresponse().read()
        except OSError:
            pass  # closed by the test

    free = llm_server.describe(model)[0]["jobQueueStatus"]["remainingCapacity"]
    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    try:
        waiting = llm_server.wait_described(
            model, lambda d: d["jobQueueStatus"]["pendingRequests"] >= 50, timeout=60, what="the 64 queued")
        assert waiting["jobQueueStatus"]["remainingCapacity"] == free - 1  # one place of job_queue_size
        started = time.monotonic()
        answer = client(llm_server).completions.create(model=model, prompt="quick", max_tokens=1)
        took = time.monotonic() - started
        assert answer.usage.completion_tokens == 1
        assert took < max(3.0, 5 * max(solo)), (took, solo)
        still = llm_server.describe(model)[0]["jobQueueStatus"]["pendingRequests"]
        assert still >= 40, still  # answered while the big request's choices still waited
    finally:  # the client goes away (a shutdown: the reading thread holds the socket open): every choice is dropped
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        thread.join(timeout=30)
    llm_server.wait_described(model, lambda d: d["jobQueueStatus"]["pendingRequests"] == 0, timeout=60,
                              what="the choices dropped")
