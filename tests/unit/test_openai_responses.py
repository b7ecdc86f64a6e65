"""The Responses API's pure parts: the bounded store, output items and events read from the text,
and the fields a refusal of the chat request names."""

from __future__ import annotations

import json

import pytest

from inference_service.contracts.sampling import InvalidRequest
from inference_service.frontends.openai import responses_schemas, schemas
from inference_service.frontends.openai.responses import prepare
from inference_service.frontends.openai.responses_output import OutputBuilder, output_messages
from inference_service.frontends.openai.responses_schemas import ResponsesRequest
from inference_service.frontends.openai.responses_store import ENTRY_OVERHEAD, ResponseStore, StoreLimits
from inference_service.frontends.openai.tool_calls import HermesReader, NamedCallReader
from inference_service.llm.requests import parse_request

schemas.build_shapes()
responses_schemas.build_shapes()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ten_thousand_responses_leave_the_store_within_its_bounds():
    limits = StoreLimits(max_entries=500, max_bytes=300_000, max_age_s=60.0)
    clock = Clock()
    store = ResponseStore(limits, clock)
    for i in range(10_000):
        clock.now += 0.001
        size = 100 + (i * 37) % 900  # 100 to 999 bytes of JSON, besides the overhead
        assert store.put(f"resp_{i}", "key", b"r" * size, b"c" * 10)
        assert len(store) <= limits.max_entries and store.bytes <= limits.max_bytes
    assert store.bytes == sum(e.size for e in store._entries.values())
    assert store.get("resp_9999", "key") is not None and store.get("resp_0", "key") is None
    kept = [i for i in range(10_000) if store.get(f"resp_{i}", "key") is not None]
    assert kept == list(range(kept[0], 10_000))  # the oldest went first
    # the age bound: a minute later, everything has expired
    clock.now += 61
    assert store.get("resp_9999", "key") is None and len(store) == 0 and store.bytes == 0


def test_store_owners_entry_size_and_delete():
    store = ResponseStore(StoreLimits(max_entries=10, max_bytes=10_000, max_age_s=60.0), Clock())
    assert store.put("a", "key1", b"{}", b"[]")
    assert store.get("a", "key2") is None and not store.delete("a", "key2")  # another key's entry is absent
    assert store.get("a", "key1").conversation == b"[]"
    assert store.bytes == 4 + ENTRY_OVERHEAD
    assert not store.put("big", "key1", b"x" * 10_000, b"")  # alone above the byte bound: not stored
    assert store.get("a", "key1") is not None  # and nothing was evicted for it
    assert store.delete("a", "key1") and len(store) == 0 and store.bytes == 0


def request(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"model": "m", "input": "hi", **body}))


def test_the_request_becomes_the_llm_request():
    prepared = prepare(request(instructions="sys", max_output_tokens=7, temperature=0.2,
                               text={"format": {"type": "json_object"}}), [{"role": "user", "content": "before"}])
    llm = parse_request(prepared.body)  # what the worker reads back
    assert [m["content"] for m in llm.messages] == ["sys", "before", "hi"]
    assert (llm.params.max_new_tokens, llm.params.temperature) == (7, 0.2)
    assert llm.params.structured_outputs.json_object and llm.params.include_usage
    assert prepared.translation.origins == ["instructions", "previous_response_id", "input"]


def test_a_refusal_names_the_responses_field():
    weather = {"type": "function", "name": "w", "parameters": {"type": "object"}}
    items = [{"role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c2", "output": "x"}]
    deep = {"type": "object", "properties": {"a": {"type": "array", "items": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]
                                                                                ]]]]]]]]]]]]]]]]]]]]]]]]}}}
    cases = [
        ({"max_output_tokens": 4097}, "max_output_tokens"),
        ({"input": items}, "input[2].call_id"),
        ({"tools": [weather, weather]}, "tools[1].name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}}, "text.format.schema"),
        ({"tools": [{**weather, "parameters": deep}], "tool_choice": "required"}, "tools[0].parameters"),
    ]
    for body, param in cases:
        with pytest.raises(InvalidRequest) as err:
            prepare(request(**body), [])
        assert err.value.field == param and str(err.value).startswith(f"'{param}'"), (body, str(err.value))
    # the handler's refusal of a constraint names where the constraint came from
    assert prepare(request(text={"format": {"type": "json_object"}}), []).param("structured_outputs") == "text.format"
    named = prepare(request(tools=[weather], tool_choice={"type": "function", "name": "w"}), [])
    assert named.param("structured_outputs.json") == "tools" and named.param("max_new_tokens") == "max_output_tokens"
    history = [{"role": "user", "content": "a"}]
    assert prepare(request(input=items[:2]), history).translation.param("messages[0].content") == "previous_response_id"
    assert prepare(request(input=items[:2]), history).translation.param(
        "messages[2].tool_calls[0].function.arguments") == "input[1].arguments"


def events_of(builder: OutputBuilder, pieces: list[str], incomplete: bool = False) -> list[dict]:
    events = [event for piece in pieces for event in builder.feed(piece)]
    return events + builder.finish(incomplete)


def test_text_and_calls_become_items_and_events():
    builder = OutputBuilder(HermesReader())
    events = events_of(builder, ["Let me ", "check.", '<tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>',
                                 '<tool_call>{"name": "w", "arguments": {"c": 2}}</tool_call>'])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    message, first, second = builder.items
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (first["arguments"], second["arguments"]) == ('{"c": 1}', '{"c": 2}')
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"  # as it stood
    assert output_messages(builder.items) == [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": first["call_id"], "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}},
        {"id": second["call_id"], "type": "function", "function": {"name": "w", "arguments": '{"c": 2}'}}]}]


def test_named_call_and_an_answer_cut_short():
    builder = OutputBuilder(NamedCallReader("w"))
    events = events_of(builder, ['{"c"', ": 1"], incomplete=True)
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"] == ['{"c"', ": 1"]
    (call,) = builder.items
    assert (call["arguments"], call["status"]) == ('{"c": 1', "incomplete")
    empty = OutputBuilder(None)
    events_of(empty, [""])
    assert empty.items[0]["content"][0]["text"] == ""  # no text at all: one empty message
