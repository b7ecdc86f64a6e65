"""OpenAI's Responses API (``/v1/responses``) on a real server, without an LLM.

The model is ``tests/handlers/route_handler.py``: it answers the handler request it received as
JSON text, so each answer shows what a Responses request became (the chat messages, tools,
constraint and limits of the one LLM request), and a chain of ``previous_response_id`` shows
exactly which turns the next request sees. ``parts:N`` makes it stream N pieces first, and
``raise`` then fail: a late failure. The store's bounds are set small in config.properties. The
LLM itself answers in tests/e2e/test_openai_responses_llm.py.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator

import openai
import pytest

from conftest import ServerProcess, build_mar, read_key

#: the store's bounds for this module: 10 entries, 64 KiB
CONFIG = "responses_store_max_entries=10\nresponses_store_max_bytes=65536\n"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("responses_store")
    build_mar(store, "router", "route_handler.py")
    work = tmp_path_factory.mktemp("responses_http")
    (work / "config.properties").write_text(CONFIG)
    server = ServerProcess(work, store, ["--ts-config", str(work / "config.properties"), "--workers-per-model", "1",
                                         "--models", "router=router.mar"])
    try:
        server.wait_workers("router", 1)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def call(server: ServerProcess, method: str, path: str, body: dict | None = None,
         key: str | None = None) -> tuple[int, http.client.HTTPResponse, bytes]:
    """One request on a fresh connection (``body`` sent as JSON); returns (status, response, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=30)
    try:
        headers = {"Content-Type": "application/json",
                   "Authorization": f"Bearer {key or read_key(server.key_file, 'inference')}"}
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        return response.status, response, response.read()
    finally:
        conn.close()


def create(server: ServerProcess, **body) -> dict:
    status, _, answer = call(server, "POST", "/v1/responses", {"model": "router", **body})
    assert status == 200, answer
    return json.loads(answer)


def seen(response: dict) -> dict:
    """The handler request the route handler answered with (the text of the response's message)."""
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    return json.loads(json.loads(message["content"][0]["text"])["body"])


def openai_error(body: bytes) -> dict:
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    return parsed["error"]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.status['http_port']}/v1", max_retries=0, timeout=30,
                         api_key=read_key(server.key_file, "inference"))


def test_a_response_request_becomes_the_chat_request(srv):
    status, raw, body = call(srv, "POST", "/v1/responses", {
        "model": "router", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "input": [{"role": "developer", "content": "Use tools."},
                  {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                               {"type": "input_text", "text": "Paris?"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}],
        "tools": [WEATHER], "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                                                "schema": {"type": "object", "properties": {"t": {"type": "string"}}}},
                                     "verbosity": "low"},
        "metadata": {"run": "1"}, "user": "someone", "temprature": 1})
    assert status == 200, body
    assert raw.getheader("x-ignored-fields") == "temprature, text.verbosity"
    answer = json.loads(body)
    assert answer["id"].startswith("resp_") and answer["object"] == "response" and answer["status"] == "completed"
    assert (answer["model"], answer["instructions"], answer["metadata"], answer["user"]) == (
        "router", "Be brief.", {"run": "1"}, "someone")
    assert (answer["max_output_tokens"], answer["temperature"], answer["top_p"]) == (9, 0.5, 0.9)
    assert answer["tools"] == [WEATHER] and answer["tool_choice"] == "auto" and answer["parallel_tool_calls"] is True
    assert answer["text"]["format"]["type"] == "json_schema" and answer["text"]["format"]["name"] == "answer"
    assert answer["usage"] is None and answer["incomplete_details"] is None and answer["store"] is True
    (item,) = answer["output"]
    assert item["id"].startswith("msg_") and (item["role"], item["status"]) == ("assistant", "completed")
    assert seen(answer) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                    "parameters": WEATHER["parameters"]}}],
        "max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "include_usage": True,
        "structured_outputs": {"json": {"type": "object", "properties": {"t": {"type": "string"}}}}}
    # a named function constrains the answer to its arguments, as /v1/chat/completions does
    named = create(srv, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert seen_call(named)["structured_outputs"] == {"json": WEATHER["parameters"]}


def seen_call(response: dict) -> dict:
    """The handler request of a response whose answer was read as a function call's arguments."""
    (call_item,) = response["output"]
    assert call_item["type"] == "function_call" and call_item["name"] == "get_weather"
    assert call_item["call_id"].startswith("call_") and call_item["id"].startswith("fc_")
    return json.loads(json.loads(call_item["arguments"])["body"])


def test_previous_response_id_chains_the_turns(srv):
    first = create(srv, instructions="First rules.", input="one")
    second = create(srv, instructions="Second rules.", input="two", previous_response_id=first["id"])
    first_text = first["output"][0]["content"][0]["text"]
    # the earlier turn's input and output, not its instructions (as OpenAI's)
    assert seen(second)["messages"] == [{"role": "system", "content": "Second rules."},
                                        {"role": "user", "content": "one"},
                                        {"role": "assistant", "content": first_text},
                                        {"role": "user", "content": "two"}]
    assert second["previous_response_id"] == first["id"]
    third = create(srv, input=[{"role": "user", "content": "three"}], previous_response_id=second["id"])
    assert [m["content"] for m in seen(third)["messages"]] == [
        "one", first_text, "two", second["output"][0]["content"][0]["text"], "three"]
    # GET answers the stored object; DELETE removes it, and then neither GET nor a chain finds it
    status, _, body = call(srv, "GET", f"/v1/responses/{second['id']}")
    assert status == 200 and json.loads(body) == second
    status, _, body = call(srv, "DELETE", f"/v1/responses/{second['id']}")
    assert (status, json.loads(body)) == (200, {"id": second["id"], "object": "response", "deleted": True})
    status, _, body = call(srv, "GET", f"/v1/responses/{second['id']}")
    assert status == 404 and openai_error(body)["message"] == f"Response with id '{second['id']}' not found."
    assert call(srv, "DELETE", f"/v1/responses/{second['id']}")[0] == 404
    status, _, body = call(srv, "POST", "/v1/responses", {"model": "router", "input": "x",
                                                          "previous_response_id": second["id"]})
    assert status == 404 and openai_error(body) == {
        "message": f"Previous response with id '{second['id']}' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}
    # the official client's calls
    api = client(srv)
    assert api.responses.retrieve(third["id"]).output_text == third["output"][0]["content"][0]["text"]
    api.responses.delete(third["id"])
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(third["id"])


def test_store_false_is_neither_kept_nor_chained(srv):
    unstored = create(srv, input="secret", store=False)
    assert unstored["store"] is False
    assert call(srv, "GET", f"/v1/responses/{unstored['id']}")[0] == 404
    status, _, body = call(srv, "POST", "/v1/responses", {"model": "router", "input": "x",
                                                          "previous_response_id": unstored["id"]})
    assert status == 404 and openai_error(body)["param"] == "previous_response_id"


def test_the_store_keeps_its_bounds(srv):
    """config.properties: 10 entries, 64 KiB. 30 responses leave the 10 newest; one larger than
    the byte bound alone is answered with store false."""
    ids = [create(srv, input=f"turn {i}")["id"] for i in range(30)]
    kept = [i for i, rid in enumerate(ids) if call(srv, "GET", f"/v1/responses/{rid}")[0] == 200]
    assert kept == list(range(20, 30))
    big = create(srv, input="x" * 40_000)
    assert big["store"] is False and call(srv, "GET", f"/v1/responses/{big['id']}")[0] == 404
    assert call(srv, "GET", f"/v1/responses/{ids[-1]}")[0] == 200  # it evicted nothing


def test_streamed_events_are_typed_and_numbered(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    conn.request("POST", "/v1/responses", json.dumps({"model": "router", "input": "parts:3", "stream": True}),
                 {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}",
                  "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    raw = response.read().decode()
    conn.close()
    events = []
    for block in raw.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == kind[7:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 4,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas.startswith("p0 p1 p2 ") and events[-4]["text"] == deltas
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == deltas
    assert call(srv, "GET", f"/v1/responses/{final['id']}")[0] == 200
    # the official client's streaming helper builds the same response
    with client(srv).responses.stream(model="router", input="parts:2") as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert streamed.output_text.startswith("p0 p1 ") and streamed.status == "completed"


def test_a_late_failure_ends_the_stream_with_error_events(srv):
    stream = client(srv).responses.create(model="router", input="parts:2 raise", stream=True)
    events = list(stream)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "failed mid-stream" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert call(srv, "GET", f"/v1/responses/{failed.id}")[0] == 404  # a failed response is not stored
    # not streamed: the failure is the answer's status
    status, _, body = call(srv, "POST", "/v1/responses", {"model": "router", "input": "parts:2 raise"})
    assert status >= 500 and openai_error(body)["message"] == "failed mid-stream", body
    # the handler's refusal before any answer keeps its status, streamed or not
    for stream_it in (False, True):
        status, _, body = call(srv, "POST", "/v1/responses", {"model": "router", "input": "status:400",
                                                              "stream": stream_it})
        assert status == 400 and openai_error(body)["message"] == "handler says no"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": "1"}, "top_p"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nowhere", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
      "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "priority": "high"}, "priority"),
])
def test_bad_requests_name_the_field(srv, body, param):
    status, _, answer = call(srv, "POST", "/v1/responses", {"model": "router", **body})
    error = openai_error(answer)
    assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
    assert error["message"].startswith(f"'{param}'") or error["message"].startswith(f"{param}:"), error


def test_unknown_model_and_neutral_fields(srv):
    status, _, answer = call(srv, "POST", "/v1/responses", {"model": "gpt-4o", "input": "x"})
    assert status == 404 and openai_error(answer)["param"] == "model"
    # what the Agents SDK and the client may send at its neutral value is served
    neutral = create(srv, input="x", background=False, reasoning={"effort": None}, truncation="disabled",
                     include=["reasoning.encrypted_content"], parallel_tool_calls=False, store=True,
                     service_tier="auto", prompt_cache_key="k", safety_identifier="s", stream_options={}, priority=1)
    assert neutral["parallel_tool_calls"] is False and neutral["status"] == "completed"


def test_responses_belong_to_the_key_that_made_them(srv):
    """A response made with the inference key is not found with its replacement (the token API
    renews the key): the store keeps each key's responses apart."""
    made = create(srv, input="mine")
    api_key = json.loads(srv.key_file.read_text())["API"]["key"]
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_management_port"], timeout=30)
    conn.request("POST", "/token?type=inference", headers={"Authorization": f"Bearer {api_key}"})
    assert conn.getresponse().status == 200
    conn.close()
    deadline = time.monotonic() + 10
    while call(srv, "GET", "/v1/models")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)  # the key file is rewritten as the key changes
    status, _, body = call(srv, "GET", f"/v1/responses/{made['id']}")
    assert status == 404, body
    assert create(srv, input="new")["store"] is True
