"""Structured outputs and tool calls without a model: the typed constraint and its bounds, the tool
plan of OpenAI's fields, the readers that find tool calls in streamed text, and XGrammar's checks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from inference_service.contracts.outputs import TokenLogprob
from inference_service.contracts.sampling import GenerationRequest, InvalidRequest, parse_request
from inference_service.contracts.structured import (
    MAX_CONSTRAINT_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    StructuredOutputs,
)
from inference_service.frontends.openai.format import Outcome
from inference_service.frontends.openai.schemas import ChatCompletionRequest, validation_error_param
from inference_service.frontends.openai.tool_calls import (
    CallListReader,
    CallPiece,
    HermesReader,
    NamedCallReader,
    ToolChatFormat,
)
from inference_service.frontends.openai.tools import tool_plan

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _refusal(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(json.dumps(body).encode())
    return refused.value


# ------------------------------------------------------------------ the constraint
@pytest.mark.parametrize(("given", "expected"), [
    ({"json": SCHEMA}, StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
    ({"json": json.dumps(SCHEMA)}, StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
    ({"regex": "[0-9]+"}, StructuredOutputs(regex="[0-9]+")),
    ({"choice": ["yes", "no", "yes"]}, StructuredOutputs(choice=("yes", "no"))),
    ({"grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"')),
    ({"json_object": True, "regex": None}, StructuredOutputs(json_object=True)),
])
def test_structured_outputs_are_typed_and_cross_to_the_worker(given, expected):
    request = parse_request(json.dumps({"prompt": "x", "structured_outputs": given}).encode())
    assert request.params.structured_outputs == expected
    assert parse_request(request.to_body()).params == request.params  # the worker reads the same request


@pytest.mark.parametrize(("response_format", "expected"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredOutputs(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
     StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
])
def test_response_format_is_read_into_the_constraint(response_format, expected):
    request = GenerationRequest.build({"messages": [{"role": "user", "content": "x"}],
                                       "response_format": response_format})
    assert request.params.structured_outputs == expected
    assert StructuredOutputs(json_object=True).schema() == '{"type":"object","additionalProperties":true}'


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"structured_outputs": {"json": 3}}, "structured_outputs", "'structured_outputs.json' must be a JSON schema"),
    ({"structured_outputs": {"json": "{no"}}, "structured_outputs", "is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "'structured_outputs.structural_tag'"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown key 'jsn'"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", "non-empty strings"),
    ({"structured_outputs": {"choice": ["a"] * 257}}, "structured_outputs", "at most 256"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", "non-empty string"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "true or false"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'response_format.type' must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "'response_format.json_schema' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "is required"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "one of 'response_format' and 'structured_outputs'"),
])
def test_a_bad_constraint_is_refused_naming_its_field(body, field, words):
    refused = _refusal({"prompt": "x", **body})
    assert refused.field == field and words in str(refused)


def test_constraints_are_bounded_before_they_are_walked():
    """A 1 MB schema and one nested past the bound are refused at once, by name."""
    huge = {"type": "object", "properties": {f"f{i}": {"type": "string", "description": "x" * 40}
                                             for i in range(16_000)}}
    body = json.dumps({"prompt": "x", "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": huge}}})
    assert len(body) > 1_000_000
    start = time.monotonic()
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body)
    assert time.monotonic() - start < 1.0
    limit = f"'response_format.json_schema.schema' must be at most {MAX_CONSTRAINT_CHARS} characters"
    assert limit in str(refused.value)
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "nests deeper than 32" in str(_refusal({"prompt": "x", "structured_outputs": {"json": deep}}))
    assert "at most 65536 characters" in str(_refusal({"prompt": "x", "structured_outputs": {"regex": "a" * 70_000}}))


# ------------------------------------------------------------------ tools and messages
def test_tools_and_tool_messages_are_checked_by_name():
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    request = GenerationRequest.build({"messages": chat, "tools": [WEATHER, TIME]})
    assert request.messages[1] == {"role": "assistant", "content": "", "tool_calls": chat[1]["tool_calls"]}
    assert request.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert parse_request(request.to_body()) == request
    tool_result = {"role": "tool", "tool_call_id": "call_9", "content": "1"}
    cases = [
        ({"messages": [chat[0], tool_result]}, "messages[1].tool_call_id"),
        ({"messages": [chat[0], {**tool_result, "role": "user"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [chat[0], {"role": "user", "content": "", "tool_calls": []}]}, "messages[1].tool_calls"),
        ({"messages": [chat[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {
            "name": "f", "arguments": {}}}]}]}, "messages[1].tool_calls[0].function.arguments"),
        ({"messages": chat, "tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
        ({"messages": chat, "tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"messages": chat, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"messages": chat, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"prompt": "x", "tools": [WEATHER]}, None),
    ]
    for body, field in cases:
        assert _refusal(body).field == field, body


def test_the_tool_plan_of_each_tool_choice():
    assert tool_plan(None, None, None).mode == "none"
    assert tool_plan([WEATHER], None, None).mode == "auto"
    assert tool_plan([WEATHER], "none", None).constraint is None
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert (named.mode, named.name, named.constraint) == ("named", "get_weather", {"json": SCHEMA})
    required = tool_plan([WEATHER, TIME], "required", False)
    schema = required.constraint["json"]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [v["properties"]["name"] for v in schema["items"]["anyOf"]] == [{"enum": ["get_weather"]},
                                                                          {"enum": ["get_time"]}]
    assert "maxItems" not in tool_plan([WEATHER], "required", None).constraint["json"]
    for tools, choice, words in [([WEATHER], {"type": "function", "function": {"name": "launch"}}, "'launch'"),
                                 (None, "required", "lists none"), ([WEATHER], "sometimes", "must be none, auto")]:
        with pytest.raises(InvalidRequest, match=words) as refused:
            tool_plan(tools, choice, None)
        assert refused.value.field == "tool_choice"


def test_the_openai_request_becomes_the_llm_request():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "tools": [WEATHER], "tool_choice": "required"})
    request = chat.to_generation_request()
    assert request.messages[0]["role"] == "system" and request.tools[0]["function"]["name"] == "get_weather"
    assert request.params.structured_outputs is not None and request.params.structured_outputs.kind == "json"
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
            "tool_choice": "required", "response_format": {"type": "json_object"}}).to_generation_request()
    assert refused.value.field == "tool_choice"
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as too_many:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                              "tools": [WEATHER] * 10_000})
    assert validation_error_param(too_many.value)[0] == "tools"


# ------------------------------------------------------------------ reading tool calls
def _feed(reader: Any, pieces: list[str]) -> list[Any]:
    items: list[Any] = []
    for piece in pieces:
        items += reader.feed(piece)
    return items + reader.finish()


def test_the_hermes_reader_finds_calls_in_any_split_of_the_text():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    for size in (1, 3, 7, len(text)):
        items = _feed(HermesReader(), [text[i:i + size] for i in range(0, len(text), size)])
        content = "".join(i for i in items if isinstance(i, str))
        calls = [i for i in items if isinstance(i, CallPiece)]
        assert content == "Let me check."
        assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "get_weather", {"city": "Oslo"})]
    assert "".join(_feed(HermesReader(), ["a <tool", "_", "b"])) == "a <tool_b"  # a tag prefix, then not
    broken = _feed(HermesReader(), ["<tool_call>not json</tool_call> after"])
    assert "".join(broken) == "<tool_call>not json</tool_call> after"  # not a call: the text as it came
    unclosed = _feed(HermesReader(), ['<tool_call>{"name": "f", "arguments": "{}"}'])
    assert [(c.name, c.arguments) for c in unclosed] == [("f", "{}")]


def test_the_call_list_reader_sends_each_call_when_its_object_closes():
    reader = CallListReader()
    assert reader.feed('[{"name": "a", "arguments": {"s": "}]\\"{"}') == []
    first = reader.feed('}, {"name"')
    assert [(c.index, c.name, json.loads(c.arguments)) for c in first] == [(0, "a", {"s": '}]"{'})]
    second = reader.feed(': "b", "arguments": {}}]')
    assert [(c.index, c.name, c.arguments) for c in second] == [(1, "b", "{}")] and reader.finish() == []
    assert _feed(CallListReader(), ['[{"name": "a", "argu']) == ['[{"name": "a", "argu']  # cut short: text


def test_answers_with_tool_calls_in_openai_shape():
    plan = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    fmt = ToolChatFormat("m", plan)
    first, second = fmt.piece(0, '{"city":', None), fmt.piece(0, ' "Oslo"}', None)
    start, more = first.choices[0].delta.tool_calls[0], second.choices[0].delta.tool_calls[0]
    assert start.id.startswith("call_") and start.function.name == "get_weather" and start.type == "function"
    assert more.id is None and more.function.name is None and more.function.arguments == ' "Oslo"}'
    assert fmt.closing(0, Outcome("", "stop", None))[-1].choices[0].finish_reason == "tool_calls"
    assert ToolChatFormat("m", plan).closing(0, Outcome("", "length", None))[-1].choices[0].finish_reason == "length"
    whole = json.loads(ToolChatFormat("m", plan).whole([(0, '{"city": "Oslo"}', Outcome("", "stop", None))],
                                                       None).model_dump_json())
    message = whole["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    auto = json.loads(ToolChatFormat("m", tool_plan([WEATHER], None, None)).whole(
        [(0, "Hi", Outcome("", "stop", None))], None).model_dump_json())
    assert auto["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert auto["choices"][0]["finish_reason"] == "stop"
    assert _feed(NamedCallReader("f"), [])[0].name == "f"  # nothing generated: the call, no arguments


def test_tool_call_chunks_of_several_choices_keep_their_readers_and_log_probabilities():
    """Each choice has its reader; entries of text a reader holds go out with its next chunk."""
    fmt = ToolChatFormat("m", tool_plan([WEATHER], None, None))  # auto: content until <tool_call>
    entry = TokenLogprob(token="<", logprob=-0.1, bytes=(60,))
    assert fmt.piece(0, "<tool", (entry,)) is None  # may open a tag: held, its entry too
    assert fmt.piece(1, "Hi", (entry,)).choices[0].index == 1  # the other choice is content
    chunks = fmt.closing(0, Outcome('_call>{"name": "get_weather", "arguments": {}}</tool_call>', "stop", None,
                                    (entry, entry)))
    call = chunks[0].choices[0]
    assert call.delta.tool_calls[0].function.name == "get_weather" and len(call.logprobs.content) == 3
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].index == 0
    assert fmt.closing(1, Outcome("", "stop", None, ()))[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ XGrammar
def test_a_constraint_that_does_not_compile_is_refused_by_name():
    from inference_service.llm.grammar import check_constraint

    for spec, words in [(StructuredOutputs(json='{"type":"bogus"}'), "'structured_outputs.json': the JSON schema "
                                                                      'does not compile: Unsupported type "bogus"'),
                        (StructuredOutputs(regex="[a-"), "'structured_outputs.regex': the regular expression"),
                        (StructuredOutputs(grammar="root ::= foo"), "'structured_outputs.grammar': the grammar")]:
        with pytest.raises(InvalidRequest) as refused:
            check_constraint(spec)
        assert refused.value.field == "structured_outputs" and str(refused.value).startswith(words)
    check_constraint(StructuredOutputs(choice=('say "hi"', "back\\slash", "new\nline")))
    check_constraint(StructuredOutputs(json_object=True))


def test_the_torch_engine_masks_accept_exactly_the_constraint(smollm2_tokenizer):
    """The GGUF-read SmolLM2 tokenizer is byte-level to XGrammar (its decoder lists ByteFallback
    first): the tokens of each choice, and only them, are accepted, then the end of sequence."""
    from inference_service.llm.grammar import GrammarMasks

    tokenizer = smollm2_tokenizer
    masks = GrammarMasks(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    choices = ('say "hi"', "back\\slash", "new\nline", "café 😀")
    for choice in choices:
        mask = masks.matcher(StructuredOutputs(choice=choices))
        for token in tokenizer(choice, add_special_tokens=False)["input_ids"]:
            assert mask._matcher.accept_token(token), choice
        assert mask._matcher.accept_token(tokenizer.eos_token_id) and mask._matcher.is_terminated()
    mask = masks.matcher(StructuredOutputs(choice=choices))
    assert not mask._matcher.accept_token(tokenizer(" no", add_special_tokens=False)["input_ids"][0])


@pytest.fixture(scope="module")
def smollm2_tokenizer(tokenizer):
    """SmolLM2's tokenizer (tests/unit/conftest.py: the converted folder's, else the GGUF's: a
    machine that has not converted it yet)."""
    return tokenizer


# ------------------------------------------------------------------ the grammar checker's budget
@pytest.fixture(scope="module")
def checker(smollm2_tokenizer):
    """A grammar checker over SmolLM2's 49,152-token vocabulary with the default budget."""
    from inference_service.llm.grammar import tokenizer_info
    from inference_service.llm.grammar_check import ConstraintBudget, GrammarChecker

    tokenizer = smollm2_tokenizer
    info = tokenizer_info(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    made = GrammarChecker(info.serialize_json, ConstraintBudget())
    yield made
    made.close()


def _refusal_of(checker: Any, spec: StructuredOutputs, budget: Any = None) -> str | None:
    """The checker's 400 message for ``spec`` under ``budget`` (``None``: it passed)."""
    default = checker.budget
    checker.budget = budget or default
    try:
        checker.check(spec)
        return None
    except InvalidRequest as refused:
        assert refused.field == "structured_outputs"
        return str(refused)
    finally:
        checker.budget = default


def test_the_checker_passes_ordinary_constraints_and_refuses_what_does_not_compile(checker):
    for spec in (StructuredOutputs(regex="[0-9]+"), StructuredOutputs(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
                 StructuredOutputs(json=json.dumps(SCHEMA)), StructuredOutputs(json_object=True),
                 StructuredOutputs(choice=("positive", "negative", 'say "hi"')),
                 StructuredOutputs(grammar='root ::= "yes" | "no"')):
        assert _refusal_of(checker, spec) is None, spec
    assert _refusal_of(checker, StructuredOutputs(regex="[a-")) == (
        "'structured_outputs.regex': the regular expression does not compile: "
        "Regex parsing error at position 4: Unclosed '['")


def test_a_costly_constraint_is_refused_by_its_cpu_budget_and_its_child_is_gone(checker):
    """Issue 48: ``.{0,5000}`` takes about 11 s to compile against this vocabulary; the kernel stops
    the check at the budget's CPU time, and the refusal names the field and the budget."""
    import os

    from inference_service.llm.grammar_check import ConstraintBudget

    budget = ConstraintBudget(cpu_s=0.2)
    for regex in (".{0,5000}", ".{0,500}"):
        message = _refusal_of(checker, StructuredOutputs(regex=regex), budget)
        assert message == ("'structured_outputs.regex': takes over 200 ms of CPU time to compile against this "
                           "model's vocabulary (the budget, structured_outputs_budget_ms)"), message
    pid = checker._proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert children == [], children  # each check's child was reaped
    assert os.path.exists(f"/proc/{pid}")  # the checker itself serves on
    assert _refusal_of(checker, StructuredOutputs(regex="[0-9]{2}")) is None


def test_a_verdict_is_kept_so_a_constraint_sent_again_is_not_tried_again(checker):
    from inference_service.llm.grammar_check import ConstraintBudget

    budget = ConstraintBudget(cpu_s=0.2)
    first = _refusal_of(checker, StructuredOutputs(regex=".{0,300}"), budget)
    assert first is not None and "takes over 200 ms of CPU time" in first
    checker._proc.kill()
    checker._proc.wait()
    assert _refusal_of(checker, StructuredOutputs(regex=".{0,300}"), budget) == first
    assert _refusal_of(checker, StructuredOutputs(regex="[0-9]{2}")) is None  # kept from before
    assert checker._proc.poll() is not None  # neither asked the (dead) checker


def test_the_token_mask_and_size_budgets_refuse_by_name(checker):
    from inference_service.llm.grammar_check import ConstraintBudget

    spec = StructuredOutputs(regex="[A-Za-z ]{1,8}")
    per_token = _refusal_of(checker, spec, ConstraintBudget(cpu_s=5.0, token_s=1e-7))
    assert per_token is not None and "of CPU time per generated token, over the budget of 0.0001 ms " \
                                     "(structured_outputs_token_budget_ms)" in per_token, per_token
    size = _refusal_of(checker, spec, ConstraintBudget(cpu_s=5.0, max_bytes=1024))
    assert size is not None and size.startswith("'structured_outputs.regex': compiles to ") \
        and size.endswith("MB against this model's vocabulary, over the budget of 0.000976562 MB "
                          "(structured_outputs_max_mb)"), size


def test_a_checker_process_that_died_is_started_anew(checker):
    checker._proc.kill()
    checker._proc.wait()
    assert _refusal_of(checker, StructuredOutputs(choice=("a", "b"))) is None
    assert checker._proc.poll() is None
