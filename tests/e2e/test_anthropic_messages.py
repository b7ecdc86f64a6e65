"""Anthropic's Messages API end to end: the official ``anthropic`` client against the real server
and LLM workers (tests/conftest.py's ``llm_server``: the bundled SmolLM2 and the tiny random Llama).

SmolLM2 answers the sensible texts and the tool round trip; greedy answers are compared with what
gRPC StreamPredictions gives for the same LLM request, so the door adds nothing to the text.
"""

from __future__ import annotations

import http.client
import json

import anthropic
import jsonschema
import pydantic
import pytest
from test_openai_llm import grpc_text

from conftest import ServerProcess, read_key

pytestmark = [pytest.mark.llm, pytest.mark.slow, pytest.mark.xdist_group("llm_server")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather now in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(srv: ServerProcess, key: str | None = None) -> anthropic.Anthropic:
    """The official client as users configure it (``ANTHROPIC_BASE_URL``, the inference key); no retries."""
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.status['http_port']}",
                               api_key=key or read_key(srv.key_file, "inference"), max_retries=0, timeout=120)


def _raw(srv: ServerProcess, body: dict, path: str = "/v1/messages") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={
            "x-api-key": read_key(srv.key_file, "inference"), "anthropic-version": "2023-06-01",
            "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_a_whole_and_a_streamed_answer_are_the_models_own(llm_server):
    whole = client(llm_server).messages.create(model="smollm2", max_tokens=48, messages=QUESTION)
    text = "".join(block.text for block in whole.content if block.type == "text")
    assert "Paris" in text, whole
    assert whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens") and whole.id.startswith("msg_")
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 48
    assert text == grpc_text(llm_server, "smollm2", {"messages": QUESTION, "max_new_tokens": 48})[0]
    # stream=True: the events in Anthropic's order, the same text
    events = list(client(llm_server).messages.create(model="smollm2", max_tokens=48, messages=QUESTION, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"], kinds
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == whole.stop_reason
    # the client's stream helper: text as it comes, then the whole message with its usage
    with client(llm_server).messages.stream(model="smollm2", max_tokens=48, messages=QUESTION) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_equals_the_usage_of_the_same_request(llm_server):
    asked = {"model": "smollm2", "system": "You answer in one word.", "messages": QUESTION, "tools": [WEATHER]}
    counted = client(llm_server).messages.count_tokens(**asked)
    used = client(llm_server).messages.create(max_tokens=4, **asked).usage.input_tokens
    assert counted.input_tokens == used
    longer = client(llm_server).messages.count_tokens(**{**asked, "system": "You answer in one word, in French."})
    assert longer.input_tokens > counted.input_tokens  # the system prompt is counted


def test_a_tool_use_round_trip(llm_server):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client(llm_server).messages.create(model="smollm2", max_tokens=64, messages=asked, tools=[WEATHER],
                                               tool_choice={"type": "tool", "name": "get_weather"})
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1, first
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    conversation = [*asked, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "Sunny, 21 degrees."}]}]
    second = client(llm_server).messages.create(model="smollm2", max_tokens=48, messages=conversation,
                                                tools=[WEATHER])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content, second
    counted = client(llm_server).messages.count_tokens(model="smollm2", messages=conversation, tools=[WEATHER])
    assert counted.input_tokens == second.usage.input_tokens
    # streamed, the tool call arrives as input_json_delta pieces the client joins
    with client(llm_server).messages.stream(model="smollm2", max_tokens=64, messages=asked, tools=[WEATHER],
                                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]


def test_a_stop_sequence_ends_the_answer_and_is_named(llm_server):
    asked = {"model": "tiny", "max_tokens": 24, "messages": QUESTION}
    free = client(llm_server).messages.create(**asked)
    text = free.content[0].text
    stop = text[8:12]
    assert len(stop) == 4 and stop.strip(), text
    cut = client(llm_server).messages.create(**asked, stop_sequences=[stop, "never-in-the-text"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


class City(pydantic.BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("prompt", ["Name a large city in Japan.", "Name the capital of Italy.",
                                    "Which city is the Eiffel Tower in?"])
def test_parse_gives_an_answer_valid_under_the_model(llm_server, prompt):
    parsed = client(llm_server).messages.parse(model="smollm2", max_tokens=64, output_format=City,
                                               messages=[{"role": "user", "content": prompt}])
    assert parsed.stop_reason == "end_turn", parsed
    assert isinstance(parsed.parsed_output, City) and parsed.parsed_output.name, parsed


def test_bad_requests_get_anthropics_errors_naming_the_field(llm_server):
    c = client(llm_server)
    cases = [
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 8, "messages": QUESTION, "extra_body": {"temperature": 1.5}}, "temperature"),
        ({"max_tokens": 8, "messages": QUESTION, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "output_config.format"),
        ({"max_tokens": 8, "messages": QUESTION, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
         "tool_choice"),
        ({"max_tokens": 8, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "web_search_20250305"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x",
                                                                      "input": {}}]}]}, "messages[0].content[0]"),
        ({"max_tokens": 100000, "messages": QUESTION}, "max_tokens"),
    ]
    for body, field in cases:
        with pytest.raises(anthropic.BadRequestError) as err:
            c.messages.create(model="smollm2", **body)
        assert err.value.status_code == 400 and err.value.body["type"] == "error", err.value.body
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert field in err.value.body["error"]["message"], (field, err.value.body)
    status, _, raw = _raw(llm_server, {"model": "smollm2", "messages": QUESTION})  # max_tokens is required
    assert status == 400 and "max_tokens" in json.loads(raw)["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=8, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(llm_server, key="wrong").messages.create(model="smollm2", max_tokens=8, messages=QUESTION)
    assert denied.value.body["error"]["type"] == "authentication_error"
    # the server serves on, and names a field it does not know
    status, headers, raw = _raw(llm_server, {"model": "tiny", "max_tokens": 4, "messages": QUESTION, "colour": 1})
    assert status == 200 and headers["x-ignored-fields"] == "colour" and json.loads(raw)["type"] == "message"
