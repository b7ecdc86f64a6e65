"""OpenAI's API end to end: the official ``openai`` client against the real server and LLM workers.

The server is the one of ``test_llm_server.py`` (its ``llm_server`` fixture: the real SmolLM2
loaded once for this module, and ``tiny``, a random-weight Llama with SmolLM2's tokenizer in
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

import openai
import pytest
from test_llm_server import _stream as grpc_stream
from test_llm_server import llm_server  # noqa: F401 - the module's server (SmolLM2 + tiny models)

from conftest import ServerProcess, read_key

pytestmark = pytest.mark.llm

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


def test_models_are_listed(llm_server):  # noqa: F811
    ids = [m.id for m in client(llm_server).models.list().data]
    assert {"smollm2", "smollm2/1.0", "tiny", "tiny/1.0", "tiny_gen", "tiny_gen/1.0"} <= set(ids)


def test_chat_completion_equals_grpc(llm_server):  # noqa: F811
    answer = client(llm_server).chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=12, extra_body={"ignore_eos": True})
    text, final = grpc_text(llm_server, "tiny", {"messages": HELLO, "max_new_tokens": 12, "ignore_eos": True})
    assert answer.object == "chat.completion" and answer.model == "tiny" and len(answer.choices) == 1
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 12 == final["usage"]["completion_tokens"]
    assert answer.usage.prompt_tokens == final["usage"]["prompt_tokens"] > 5  # the chat template's tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_chat_stream_with_usage(llm_server):  # noqa: F811
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


def test_completions_stream_and_whole(llm_server):  # noqa: F811
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


def test_stop_string_ends_with_finish_reason_stop(llm_server):  # noqa: F811
    full = client(llm_server).completions.create(model="tiny", prompt="Lists", max_tokens=24,
                                                 extra_body={"ignore_eos": True}).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full[len(full) // 3:])
    assert words, full
    stopped = client(llm_server).completions.create(model="tiny", prompt="Lists", max_tokens=24, stop=[words[0]],
                                                    extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert words[0] not in stopped.choices[0].text and full.startswith(stopped.choices[0].text)


def test_async_client_streams_share_the_batch(llm_server):  # noqa: F811
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


def test_errors_raise_the_clients_exceptions(llm_server):  # noqa: F811
    with pytest.raises(openai.AuthenticationError):
        client(llm_server, key="not-the-key").chat.completions.create(model="tiny", messages=HELLO)
    with pytest.raises(openai.NotFoundError) as err:
        client(llm_server).chat.completions.create(model="gpt-4o", messages=HELLO)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client(llm_server).chat.completions.create(model="tiny", messages=HELLO, n=2)
    assert err.value.param == "n"
    # the handler's own checks come back as 400 too: a prompt + max_tokens beyond the context (2048)
    with pytest.raises(openai.BadRequestError) as err:
        client(llm_server).completions.create(model="tiny", prompt="x", max_tokens=4000)
    assert "context length" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # ...and before any stream starts
        client(llm_server).completions.create(model="tiny", prompt="x", max_tokens=4097, stream=True)
    assert "max_new_tokens" in err.value.message


def test_disconnect_mid_stream_stops_generation(llm_server):  # noqa: F811
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


def test_real_model_streams_a_sensible_chat_answer(llm_server):  # noqa: F811
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
