"""The OpenAI API's pure parts: request validation, the handler's final message, error mapping, chunk shapes."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from inference_service.contracts.outputs import Piece, TokenLogprob, TopLogprob
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
from inference_service.frontends.openai.choices import Candidate, ChoiceError, ChoicePlan, total_usage, whole_choices
from inference_service.frontends.openai.format import (
    ChatFormat,
    CompletionFormat,
    Outcome,
    final_outcome,
    piece_of,
    sse_event,
)
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
    # the fields of issue 42: typed and checked with the LLM request's limits
    params = ChatCompletionRequest.model_validate({**CHAT, "n": 3, "logprobs": True, "top_logprobs": 5}) \
        .to_generation_request().params
    assert (params.n, params.logprobs, params.top_logprobs) == (3, True, 5)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "logprobs": 2, "best_of": 2})
    assert [(r.prompt, r.params.logprobs, r.params.top_logprobs, r.params.best_of)
            for r in completion.to_generation_requests()] == [("a", True, 2, 2), ("b", True, 2, 2)]
    for body, field, param in (({**CHAT, "n": 17}, "n", "n"), ({**CHAT, "top_logprobs": 21}, "top_logprobs",
                                                                "top_logprobs"),
                               ({**CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs")):
        with pytest.raises(InvalidRequest) as err:
            ChatCompletionRequest.model_validate(body).to_generation_request()
        assert err.value.field == field and openai_param(ChatCompletionRequest.model_validate(body), field) == param
    wide = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 21})
    with pytest.raises(InvalidRequest) as err:
        wide.to_generation_requests()
    assert openai_param(wide, err.value.field) == "logprobs"
    with pytest.raises(InvalidRequest, match="'best_of' \\(1\\) must be at least 'n' \\(2\\)"):
        CompletionRequest.model_validate({"model": "m", "prompt": "p", "n": 2, "best_of": 1}).to_generation_requests()


@pytest.mark.parametrize("body,expected", [
    (b"not json", (None, "We could not parse the JSON body")),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, ("messages[0].content", "messages[0].content: ")),
    ({**CHAT, "seed": -1}, ("seed", "seed: ")),
    ({**CHAT, "seed": 1.5}, ("seed", "seed: ")),
    ({**CHAT, "top_p": 0}, ("top_p", "top_p: Input should be greater than 0")),
    ({**CHAT, "stream_options": {"include_usage": "yes"}}, ("stream_options.include_usage", "stream_options")),
    ({**CHAT, "presence_penalty": "1"}, ("presence_penalty", "presence_penalty: ")),
    ({**CHAT, "logit_bias": {"1": 2.0}}, ("logit_bias", "logit_bias: logit_bias is not supported")),
    ({**CHAT, "tools": [{}] * 129}, ("tools", "tools: List should have at most 128 items")),
])
def test_validation_problems_name_the_field(body, expected):
    param, message = problem(ChatCompletionRequest, body)
    assert param == expected[0] and message.startswith(expected[1]), (param, message)


def test_final_message_forms():
    final = json.dumps({"text": "end", "finish_reason": "length",
                        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    assert final_outcome(final) == Outcome("end", "length", Usage(prompt_tokens=3, completion_tokens=4,
                                                                  total_tokens=7))
    assert final_outcome(b'{"text": "", "finish_reason": "stop"}') == Outcome("", "stop", None)
    assert final_outcome(b'{"text": "", "finish_reason": "cancelled", "usage": {}}') == Outcome("", "stop", None)
    assert final_outcome(b"plain \xff text") == Outcome("plain \ufffd text", "stop", None)
    assert final_outcome(b'{"other": 1}') == Outcome('{"other": 1}', "stop", None)
    assert final_outcome(b"{broken") == Outcome("{broken", "stop", None)
    entry = {"token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115], "top_logprobs": []}
    with_logprobs = json.dumps({"text": "", "finish_reason": "stop", "logprobs": [entry]}).encode()
    assert final_outcome(with_logprobs).logprobs == (TokenLogprob(" Paris", -0.25, (32, 80, 97, 114, 105, 115)),)


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
    opening = json.loads(sse_event(chat.opening(0)[0], {"usage"})[6:])
    assert opening["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None, "logprobs": None}]
    assert "usage" not in opening and opening["object"] == "chat.completion.chunk"
    closing = [json.loads(sse_event(c)[6:]) for c in chat.closing(2, Outcome("", "stop", None))]
    assert len(closing) == 1 and closing[0]["choices"][0]["delta"] == {} and closing[0]["usage"] is None
    assert closing[0]["choices"][0]["index"] == 2
    usage = json.loads(sse_event(chat.usage(Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)))[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    text = CompletionFormat("m")
    last = [json.loads(sse_event(c, {"usage"})[6:]) for c in text.closing(0, Outcome("tail", "length", None))]
    assert last == [{"id": text.id, "object": "text_completion", "created": text.created, "model": "m",
                     "choices": [{"index": 0, "text": "tail", "finish_reason": "length", "logprobs": None}]}]


PARIS = TokenLogprob(" Paris", -0.25, (32, 80, 97, 114, 105, 115),
                     (TopLogprob(" Paris", -0.25, (32, 80, 97, 114, 105, 115)), TopLogprob(" Lyon", -2.0, (32, 76))))
DOT = TokenLogprob(".", -0.5, (46,))


def test_logprobs_in_openais_chat_and_completion_shapes():
    chat = json.loads(ChatFormat("m").piece(1, " Paris", (PARIS,)).model_dump_json())["choices"][0]
    assert chat["index"] == 1 and chat["logprobs"] == {"content": [{
        "token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115],
        "top_logprobs": [{"token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115]},
                         {"token": " Lyon", "logprob": -2.0, "bytes": [32, 76]}]}]}
    # completions: the legacy shape; text_offset counts into the choice's text (the prompt first, with echo)
    text = CompletionFormat("m", ["Capital:"], n=2, echo=True)
    whole = json.loads(text.whole([(1, " Paris.", Outcome("", "stop", None, (PARIS, DOT)))], None).model_dump_json())
    choice = whole["choices"][0]
    assert choice["index"] == 1 and choice["text"] == "Capital: Paris."
    assert choice["logprobs"] == {"tokens": [" Paris", "."], "token_logprobs": [-0.25, -0.5],
                                  "top_logprobs": [{" Paris": -0.25, " Lyon": -2.0}, {".": -0.5}],
                                  "text_offset": [8, 14]}
    streamed = CompletionFormat("m")
    offsets = [json.loads(streamed.piece(0, e.token, (e,)).model_dump_json())["choices"][0]["logprobs"]["text_offset"]
               for e in (PARIS, DOT)]
    assert offsets == [[0], [6]]
    assert piece_of(json.dumps(Piece(" Paris", (PARIS,)).to_json()).encode(), True) == Piece(" Paris", (PARIS,))
    assert piece_of(b'{"text": "raw"}', True) == Piece('{"text": "raw"}')  # model text that looks like JSON
    assert piece_of(b'{"text": " x", "logprobs": []}', False) == Piece('{"text": " x", "logprobs": []}')


def _candidate(text: str, logprobs: tuple[float, ...], prompt_tokens: int = 5) -> Candidate:
    entries = [TokenLogprob("t", p, (116,)) for p in logprobs]
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(logprobs),
                  total_tokens=prompt_tokens + len(logprobs))
    return Candidate([text], entries, Outcome("", "stop", usage, ()))


def test_n_fans_out_seeded_choices_and_best_of_keeps_the_best():
    chat = ChatCompletionRequest.model_validate({**CHAT, "n": 3, "seed": 2**64 - 2, "temperature": 0.7})
    plan = ChoicePlan.of([chat.to_generation_request()], stream=True)
    bodies = [json.loads(body) for body in plan.bodies]
    assert [b["seed"] for b in bodies] == [2**64 - 2, 2**64 - 1, 0] and all("n" not in b for b in bodies)
    assert (plan.n, plan.best_of, plan.logprobs) == (3, 3, False)
    unseeded = ChoicePlan.of([ChatCompletionRequest.model_validate({**CHAT, "n": 2}).to_generation_request()], False)
    assert all("seed" not in json.loads(body) for body in unseeded.bodies)
    # best_of: candidates ask for log probabilities to be ranked; the n best of each prompt are kept, best first
    completion = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 1, "best_of": 3})
    plan = ChoicePlan.of(completion.to_generation_requests(), stream=False)
    assert len(plan.bodies) == 6 and all(json.loads(b)["logprobs"] for b in plan.bodies)
    candidates = [_candidate("a0", (-1.0,)), _candidate("a1", (-0.1, -0.3)), _candidate("a2", (-2.0,)),
                  _candidate("b0", (-0.5,), 7), _candidate("b1", (-0.4,), 7), _candidate("b2", (-3.0,), 7)]
    chosen = whole_choices(plan, candidates)
    assert [(index, text, outcome.logprobs) for index, text, outcome in chosen] == [(0, "a1", None), (1, "b1", None)]
    assert total_usage(plan, [c.outcome for c in candidates]) == Usage(prompt_tokens=12, completion_tokens=7,
                                                                         total_tokens=19)
    with pytest.raises(ChoiceError) as err:
        ChoicePlan.of(completion.to_generation_requests(), stream=True)
    assert err.value.param == "best_of"
    many = CompletionRequest.model_validate({"model": "m", "prompt": ["p"] * 5, "n": 16})
    with pytest.raises(ChoiceError) as err:
        ChoicePlan.of(many.to_generation_requests(), stream=False)
    assert err.value.param == "prompt" and "64 engine requests" in str(err.value)
    with pytest.raises(ChoiceError) as err:  # config.properties max_engine_requests=8
        ChoicePlan.of(completion.to_generation_requests(), stream=False, limit=4)
    assert "2 prompt(s) x 3 choice(s) exceed the 4 engine requests" in str(err.value)
    assert len(ChoicePlan.of(many.to_generation_requests(), stream=False, limit=80).bodies) == 80


def test_unknown_fields_are_named_and_known_neutral_ones_are_not():
    chat = ChatCompletionRequest.model_validate({
        **CHAT, "temprature": 1.5, "user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
        "messages": [{"role": "user", "content": "hi", "name": "ann"}], "stream_options": {"include_usage": True,
                                                                                           "extra": 1}})
    assert chat.ignored_fields() == ["stream_options.extra", "temprature"]  # a message's name is OpenAI's
    assert ChatCompletionRequest.model_validate(CHAT).ignored_fields() == []


def test_openai_paths():
    assert is_openai_path("/v1") and is_openai_path("/v1/chat/completions") and is_openai_path("/tokenize")
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
