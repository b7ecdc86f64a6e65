"""The OpenAI API's pure parts: request validation, the handler's final message, error mapping, chunk shapes."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from inference_service.contracts.sampling import GenerationParams, InvalidRequest
from inference_service.errors import (
    HandlerError,
    InferenceError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    error_for_code,
)
from inference_service.frontends.http.inference import http_status
from inference_service.frontends.openai.api import OpenAIApi, openai_param
from inference_service.frontends.openai.format import ChatFormat, CompletionFormat, final_outcome, sse_event
from inference_service.frontends.openai.mount import is_openai_path
from inference_service.frontends.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    validation_error_param,
)
from inference_service.llm.requests import REQUEST_FIELDS, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def problem(schema, body: dict | bytes) -> tuple[str | None, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ValidationError) as err:
        schema.model_validate_json(raw)
    return validation_error_param(err.value)


def test_openai_request_becomes_the_typed_llm_request():
    chat = ChatCompletionRequest.model_validate_json(json.dumps({
        **CHAT, "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 2**64 - 1, "stop": "x", "ignore_eos": False}))
    request = chat.to_generation_request()
    assert set(json.loads(request.to_body())) <= REQUEST_FIELDS
    parsed = parse_request(request.to_body())  # what the worker reads back: the same request
    assert parsed == request
    assert (parsed.params.max_new_tokens, parsed.params.temperature, parsed.params.top_p) == (5, 0.0, 0.5)
    assert (parsed.params.seed, parsed.params.stop, parsed.params.include_usage) == (2**64 - 1, ("x",), True)
    # max_completion_tokens wins; nothing set leaves the model's defaults
    both = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5, "max_completion_tokens": 9})
    assert both.token_limit == 9
    plain = ChatCompletionRequest.model_validate(CHAT)
    assert json.loads(plain.to_generation_request().to_body()) == {
        "messages": [{"role": "user", "content": "hi"}], "include_usage": True}
    defaults = GenerationParams(max_new_tokens=7, temperature=0.3)  # the model's, applied by the worker
    assert parse_request(plain.to_generation_request().to_body(), defaults).params == \
        GenerationParams(max_new_tokens=7, temperature=0.3, include_usage=True)
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["p"]}).token_limit == 16


@pytest.mark.parametrize("body,field,param", [
    ({**CHAT, "max_tokens": 4097}, "max_new_tokens", "max_tokens"),
    ({**CHAT, "max_completion_tokens": 5000}, "max_new_tokens", "max_completion_tokens"),
    ({**CHAT, "stop": [""]}, "stop", "stop"),
    ({**CHAT, "stop": ["s"] * 17}, "stop", "stop"),
])
def test_llm_limits_are_checked_at_the_door(body, field, param):
    chat = ChatCompletionRequest.model_validate(body)
    with pytest.raises(InvalidRequest) as err:
        chat.to_generation_request()
    assert err.value.field == field and f"'{field}'" in str(err.value)
    assert openai_param(chat, err.value.field) == param


def test_neutral_values_of_unsupported_fields_are_accepted():
    ChatCompletionRequest.model_validate({
        **CHAT, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "top_logprobs": 0,
        "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "stream_options": {"include_usage": False}, "user": "u", "unknown_field": [1]})
    CompletionRequest.model_validate({"model": "m", "prompt": "p", "echo": False, "best_of": 1, "logprobs": 0,
                                      "suffix": None})


@pytest.mark.parametrize("body,expected", [
    (b"not json", (None, "We could not parse the JSON body")),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, ("messages[0].content", "messages[0].content: ")),
    ({**CHAT, "seed": -1}, ("seed", "seed: ")),
    ({**CHAT, "seed": 1.5}, ("seed", "seed: ")),
    ({**CHAT, "top_p": 0}, ("top_p", "top_p: Input should be greater than 0")),
    ({**CHAT, "stream_options": {"include_usage": "yes"}}, ("stream_options.include_usage", "stream_options")),
    ({**CHAT, "presence_penalty": "1"}, ("presence_penalty", "presence_penalty: ")),
    ({**CHAT, "logit_bias": {"1": 2.0}}, ("logit_bias", "logit_bias: logit_bias is not supported")),
    ({**CHAT, "tool_choice": "required"}, ("tool_choice", "tool_choice: tool_choice is not supported")),
])
def test_validation_problems_name_the_field(body, expected):
    param, message = problem(ChatCompletionRequest, body)
    assert param == expected[0] and message.startswith(expected[1]), (param, message)


def test_final_message_forms():
    final = json.dumps({"text": "end", "finish_reason": "length",
                        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    assert final_outcome(final) == ("end", "length", Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7))
    assert final_outcome(b'{"text": "", "finish_reason": "stop"}') == ("", "stop", None)
    assert final_outcome(b'{"text": "", "finish_reason": "cancelled", "usage": {}}') == ("", "stop", None)
    assert final_outcome(b"plain \xff text") == ("plain \ufffd text", "stop", None)
    assert final_outcome(b'{"other": 1}') == ('{"other": 1}', "stop", None)
    assert final_outcome(b"{broken") == ("{broken", "stop", None)


def test_inference_errors_map_to_openai_statuses():
    api = OpenAIApi(core=None, http_status=http_status)  # type: ignore[arg-type]
    cases = [
        (NotFound("model 'x' is not registered"), 404, "model_not_found", "model", None),
        (ResourceExhausted("job queue is full", reason="JOB_QUEUE_FULL", retry_after_s=0.5), 429, "job_queue_full",
         None, "1"),
        (Unavailable("no worker", reason="NO_WORKER", retry_after_s=5.0), 503, "no_worker", None, "5"),
        (HandlerError("boom"), 500, "handler_error", None, None),
        (error_for_code(grpc.StatusCode.INVALID_ARGUMENT, "bad", http_status=400), 400, "handler_status", None, None),
        (InferenceError("odd"), 500, "internal", None, None),
    ]
    for exc, status, code, param, retry in cases:
        error = api.error_of(exc)
        assert (error.status, error.code, error.param) == (status, code, param), exc
        assert (error.headers or {}).get("Retry-After") == retry
        body = json.loads(error.response().body)  # type: ignore[arg-type]
        assert body == {"error": {"message": exc.message, "type": body["error"]["type"], "param": param,
                                  "code": code}}
        expected_type = ("rate_limit_error" if status == 429 else "server_error" if status >= 500
                         else "invalid_request_error")
        assert body["error"]["type"] == expected_type
    event = api.error_of(HandlerError("late")).event()
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and b'"late"' in event


def test_chunk_shapes():
    chat = ChatFormat("m")
    opening = json.loads(sse_event(chat.opening()[0], {"usage"})[6:])
    assert opening["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None, "logprobs": None}]
    assert "usage" not in opening and opening["object"] == "chat.completion.chunk"
    closing = [json.loads(sse_event(c)[6:]) for c in chat.closing("", "stop")]
    assert len(closing) == 1 and closing[0]["choices"][0]["delta"] == {} and closing[0]["usage"] is None
    usage = json.loads(sse_event(chat.usage(Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)))[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    text = CompletionFormat("m")
    last = [json.loads(sse_event(c, {"usage"})[6:]) for c in text.closing("tail", "length")]
    assert last == [{"id": text.id, "object": "text_completion", "created": text.created, "model": "m",
                     "choices": [{"index": 0, "text": "tail", "finish_reason": "length", "logprobs": None}]}]


def test_openai_paths():
    assert is_openai_path("/v1") and is_openai_path("/v1/chat/completions")
    assert not is_openai_path("/v10/x") and not is_openai_path("/predictions/v1")


def test_penalties_and_vllm_extensions_reach_the_llm_request():
    request = ChatCompletionRequest.model_validate({
        **CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 4, "repetition_penalty": 1.2,
        "stop_token_ids": [7, 9]})
    params = request.to_generation_request().params
    assert (params.presence_penalty, params.frequency_penalty, params.top_k) == (0.5, -0.5, 4)
    assert params.repetition_penalty == 1.2 and params.stop_token_ids == (7, 9)
    out_of_range = ChatCompletionRequest.model_validate({**CHAT, "presence_penalty": 3})
    with pytest.raises(InvalidRequest) as refused:
        out_of_range.to_generation_request()
    assert refused.value.field == "presence_penalty"
