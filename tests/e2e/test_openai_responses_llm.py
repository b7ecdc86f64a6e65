"""OpenAI's Responses API end to end: the official ``openai`` client against real LLM workers.

The server holds the real SmolLM2 and ``tiny`` (a random-weight Llama with SmolLM2's tokenizer,
the bundled archive's continuous-batching form), one worker each. ``tiny`` answers what only
needs "an LLM": its greedy text is reproducible, so an answer is compared with what gRPC
StreamPredictions gives for the same chat. SmolLM2 answers the questions whose answers must make
sense: a fact, structured output parsed into a pydantic model, a function call round trip and a
conversation chained by ``previous_response_id``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from test_llm_server import _stream as grpc_stream

from conftest import ServerProcess, read_key, wait_for

pytestmark = [pytest.mark.llm, pytest.mark.slow]

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_llama, llm_archives) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("responses_llm_store")
    llm_archives.build(store)  # smollm2.mar
    llm_archives.build(store, "--model-path", str(tiny_llama), "--name", "tiny")
    server = ServerProcess(tmp_path_factory.mktemp("responses_llm"), store,
                           ["--models", "smollm2=smollm2.mar", "tiny=tiny.mar"])
    try:
        for name in ("smollm2", "tiny"):
            server.wait_workers(name, 1, timeout=600)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.status['http_port']}/v1", max_retries=0, timeout=120,
                         api_key=read_key(srv.key_file, "inference"))


def tokens(srv: ServerProcess, messages: list[dict]) -> int:
    """The prompt tokens of a chat, by the model's tokenizer and chat template (vLLM's ``/tokenize``)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.status['http_port']}/tokenize",
        json.dumps({"model": "smollm2", "messages": messages}).encode(),
        {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["count"]


def test_tiny_answers_as_grpc_does_streamed_and_not(srv):
    whole = client(srv).responses.create(model="tiny", input="Say hello.", instructions="Be brief.",
                                         max_output_tokens=12)
    messages, _ = grpc_stream(srv, "tiny", {"messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Say hello."}],
                                            "max_new_tokens": 12, "include_usage": True})
    final = json.loads(messages[-1])
    assert whole.output_text == "".join(messages[:-1]) + final["text"]
    assert whole.usage.input_tokens == final["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == final["usage"]["completion_tokens"] <= 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    cut = final["finish_reason"] == "length"
    assert whole.status == ("incomplete" if cut else "completed")
    assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == (
        "max_output_tokens" if cut else None)
    with client(srv).responses.stream(model="tiny", input="Say hello.", instructions="Be brief.",
                                      max_output_tokens=12) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 3


def test_smollm2_answers_a_question_streamed_and_not(srv):
    question = "What is the capital of France?"
    whole = client(srv).responses.create(model="smollm2", input=question, max_output_tokens=48)
    assert "Paris" in whole.output_text and whole.status == "completed"
    events = list(client(srv).responses.create(model="smollm2", input=question, max_output_tokens=48, stream=True))
    assert events[-1].type == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text  # greedy: the same text


class City(BaseModel):
    name: str
    country: str
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]


PROMPTS = ["Describe Paris as JSON.", "Give me the city of Tokyo.", "Tell me about Nairobi."]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_parse_gives_a_valid_pydantic_object(srv, prompt):
    parsed = client(srv).responses.parse(model="smollm2", input=prompt, text_format=City, max_output_tokens=96)
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    assert parsed.status == "completed"


def test_function_call_round_trip(srv):
    api = client(srv)
    asked = api.responses.create(model="smollm2", input="What is the weather like in Paris today?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48)
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"}, arguments
    answer = api.responses.create(model="smollm2", previous_response_id=asked.id, tools=[WEATHER],
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": json.dumps({"city": arguments["city"], "sky": "sunny",
                                                                "temperature_c": 21})}],
                                  max_output_tokens=64)
    assert answer.output[0].type == "message" and answer.status == "completed"
    assert "21" in answer.output_text or "sunny" in answer.output_text.lower(), answer.output_text
    assert answer.usage.input_tokens > asked.usage.input_tokens + asked.usage.output_tokens
    # streamed: the arguments come as deltas, and the helper parses them (a strict tool)
    with api.responses.stream(model="smollm2", input="What is the weather like in Paris today?", tools=[WEATHER],
                              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output[0].arguments == call.arguments and final.output[0].parsed_arguments == arguments


def test_previous_response_id_carries_the_conversation(srv):
    """The second turn sees the first: its prompt is the whole chat's (counted by the tokenizer),
    and the model repeats the word it was told, which it does not know alone."""
    api = client(srv)
    first = api.responses.create(model="smollm2", input="The secret word is pineapple.", max_output_tokens=32)
    second = api.responses.create(model="smollm2", previous_response_id=first.id, input="What is the secret word?",
                                  max_output_tokens=32)
    chat = [{"role": "user", "content": "The secret word is pineapple."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is the secret word?"}]
    assert second.usage.input_tokens == tokens(srv, chat)
    assert "pineapple" in second.output_text and second.previous_response_id == first.id
    alone = api.responses.create(model="smollm2", input="What is the secret word?", max_output_tokens=32, store=False)
    assert alone.usage.input_tokens == tokens(srv, chat[2:]) and "pineapple" not in alone.output_text


def test_disconnect_mid_stream_stops_generation(srv):
    """A client that closes its stream after a few events: the worker drops the request at once."""
    dropped = re.compile(r"request \S+ dropped after (\d+) completion tokens")
    before = len(dropped.findall(srv.log()))
    stream = client(srv).responses.create(model="tiny", input="Say hello.", max_output_tokens=1900, stream=True)
    for count, _ in enumerate(stream, 1):
        if count == 8:
            break
    stream.close()
    found = wait_for(lambda: dropped.findall(srv.log())[before:], timeout=15, what="the request dropped")
    assert int(found[0]) < 1900, found
    assert client(srv).responses.create(model="tiny", input="next", max_output_tokens=2).usage.output_tokens <= 2
