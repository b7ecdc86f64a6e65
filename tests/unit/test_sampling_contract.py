"""contracts/sampling.py and contracts/outputs.py: the one typed LLM request and final message, as
every door builds them and as they cross to the worker and back."""

from __future__ import annotations

import json

import pytest

from inference_service.contracts.outputs import FinalMessage, Piece, TokenLogprob, TopLogprob, Usage
from inference_service.contracts.sampling import (
    CONFIG_FIELDS,
    PARAM_FIELDS,
    REQUEST_FIELDS,
    GenerationParams,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    parse_request,
)
from inference_service.llm import params as llm_params
from inference_service.llm import requests as llm_requests
from inference_service.llm.generation import final_message
from inference_service.llm.params import GenerationResult


def test_one_declaration_of_the_parameters():
    assert SamplingParams is GenerationParams is llm_params.GenerationParams
    assert llm_requests.InvalidRequest is InvalidRequest and llm_requests.parse_request is parse_request
    assert PARAM_FIELDS == ("max_new_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "include_usage",
                            "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids",
                            "cache_salt", "n", "best_of", "logprobs", "top_logprobs", "structured_outputs")
    assert CONFIG_FIELDS == ("max_new_tokens", "temperature", "top_p")
    assert REQUEST_FIELDS == {"prompt", "messages", "tools", "response_format", *PARAM_FIELDS}
    assert GenerationParams().to_json(frozenset(PARAM_FIELDS)) == {
        "max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": [], "ignore_eos": False,
        "include_usage": False, "top_k": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "stop_token_ids": [], "cache_salt": None, "n": 1, "best_of": None,
        "logprobs": False, "top_logprobs": 0, "structured_outputs": None}
    assert GenerationParams().updated({"top_k": 3, "stop_token_ids": [2, 2, 5]}) == \
        GenerationParams(top_k=3, stop_token_ids=(2, 5))
    assert GenerationRequest.build({"prompt": "x", "top_k": 3}).params.top_k == 3
    with pytest.raises(InvalidRequest, match="unknown field"):
        GenerationRequest.build({"prompt": "x", "top_q": 3})
    with pytest.raises(InvalidRequest, match="'presence_penalty' must be between -2 and 2"):
        GenerationParams().updated({"presence_penalty": 3})


def test_the_body_carries_only_what_the_client_set():
    request = GenerationRequest.build({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "a", "b"],
                                       "seed": None, "temperature": 0.5})
    assert request.given == {"stop", "temperature"}
    assert json.loads(request.to_body()) == {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                                             "stop": ["a", "b"]}
    model_defaults = GenerationParams(max_new_tokens=32, temperature=0.9)
    back = parse_request(request.to_body(), model_defaults)
    assert back.params == GenerationParams(max_new_tokens=32, temperature=0.5, stop=("a", "b"))
    assert back.messages == request.messages and back.given == request.given
    plain = parse_request(b"just text", model_defaults)
    assert plain.prompt == "just text" and plain.params is model_defaults and plain.given == frozenset()


@pytest.mark.parametrize("values,field,message", [
    ({"prompt": "x", "top_p": 1.5}, "top_p", "'top_p' must be greater than 0 and at most 1, got 1.5"),
    ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens", "'max_new_tokens' must be an integer, got bool"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "'ignore_eos' must be true or false, got str"),
    ({"prompt": "x", "bogus": 1}, None, "unknown field(s): bogus; allowed: "),
    ({"prompt": "x", "messages": []}, None, "exactly one of 'prompt' and 'messages' must be given"),
])
def test_refusals_name_the_field(values, field, message):
    with pytest.raises(InvalidRequest) as err:
        GenerationRequest.build(values)
    assert err.value.field == field and str(err.value).startswith(message)


def test_choices_and_logprobs_fields():
    """n, best_of, logprobs, top_logprobs: checked alone and together; a choice is one engine request."""
    request = GenerationRequest.build({"prompt": "x", "n": 3, "best_of": 4, "seed": 9, "temperature": 0.5})
    third = request.choice(2)
    assert (third.params.n, third.params.best_of, third.params.seed) == (1, None, 11)
    assert json.loads(third.to_body()) == {"prompt": "x", "temperature": 0.5, "seed": 11}
    ranked = request.choice(0, logprobs=True)
    assert ranked.params.logprobs and json.loads(ranked.to_body())["logprobs"] is True
    assert GenerationRequest.build({"prompt": "x", "seed": 2**64 - 1}).choice(1).params.seed == 0
    for values, field, message in (
            ({"n": 0}, "n", "'n' must be between 1 and 16, got 0"),
            ({"n": 2, "best_of": 1}, "best_of", "'best_of' (1) must be at least 'n' (2)"),
            ({"logprobs": 1}, "logprobs", "'logprobs' must be true or false, got int"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs' must be between 0 and 20"),
            ({"top_logprobs": 3}, "top_logprobs", "'top_logprobs' needs 'logprobs': true")):
        with pytest.raises(InvalidRequest) as err:
            GenerationRequest.build({"prompt": "x", **values})
        assert err.value.field == field and str(err.value).startswith(message), err.value


def test_final_message_round_trip():
    result = GenerationResult(remaining_text="", finish_reason="length", prompt_tokens=3, completion_tokens=4)
    payload = json.dumps(final_message(result, GenerationParams(include_usage=True))).encode()
    assert FinalMessage.parse(payload) == FinalMessage("", "length", Usage(3, 4))
    assert Usage(3, 4).total_tokens == 7
    assert final_message(result, GenerationParams()) == ""  # without include_usage: the remaining text
    assert FinalMessage.parse(b'{"text": "t", "finish_reason": "stop", "usage": {"prompt_tokens": "1"}}') == \
        FinalMessage("t", "stop", None)
    for other in (b"plain", b'{"text": 1, "finish_reason": "stop"}', b"{broken", b'{"text": ""}'):
        assert FinalMessage.parse(other) is None
    # with logprobs: the entries of the tokens not sent before ride with it; usage only with include_usage
    entry = TokenLogprob("a", -0.5, (97,), (TopLogprob("a", -0.5, (97,)), TopLogprob("b", -1.5, (98,))))
    payload = json.dumps(final_message(result, GenerationParams(logprobs=True), [entry])).encode()
    assert FinalMessage.parse(payload) == FinalMessage("", "length", None, (entry,))
    assert Piece.parse(json.dumps(Piece("a", (entry,)).to_json()).encode()) == Piece("a", (entry,))
    for not_a_piece in (payload, b'{"text": "a"}', b'{"text": "a", "logprobs": [{"token": 1}]}', b"a"):
        assert Piece.parse(not_a_piece) is None


#: Every sampling field that takes a number, and the extreme doubles a hostile client sends.
NUMBER_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "top_k", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")
EXTREMES = (0.0, -0.0, 5e-324, 1e-320, 1e-310, 1e-300, 1e-46, 1e-45, 1e-39, 1e-38, 1e-6, 1e38, 1e39,
            1e308, -1e-300, -1e308, float("nan"), float("inf"), float("-inf"))


def _float32(value: float) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def _float32_normal_or_zero(value: float) -> bool:
    import math

    if value == 0:
        return True
    try:
        as32 = _float32(value)
    except OverflowError:
        return False
    return math.isfinite(as32) and abs(as32) >= 2.0**-126


def _check_kept(params: GenerationParams) -> None:
    """What the engines will see is sane: float32 values that are 0 or normal, a temperature that is 0
    or at least vLLM's greedy threshold, and multipliers in their ranges."""
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert _float32_normal_or_zero(getattr(params, name)), (name, getattr(params, name))
    assert params.temperature == 0 or params.temperature >= 1e-5
    assert 0 < _float32(params.top_p) <= 1
    assert 0.01 <= params.repetition_penalty <= 10


@pytest.mark.parametrize("name", NUMBER_FIELDS)
def test_extreme_doubles_are_kept_float32_safe_or_refused_by_name(name):
    for value in EXTREMES:
        try:
            params = GenerationRequest.build({"prompt": "x", name: value}).params
        except InvalidRequest as exc:
            assert exc.field == name, (name, value, exc.field)
            assert f"'{name}'" in str(exc), str(exc)
            continue
        _check_kept(params)


def test_a_tiny_temperature_is_greedy_as_vllm_reads_it():
    assert GenerationParams().updated({"temperature": 1e-300}).temperature == 0.0
    assert GenerationParams().updated({"temperature": 9.9e-6}).temperature == 0.0
    assert GenerationParams().updated({"temperature": 1e-5}).temperature == 1e-5


def test_any_double_is_kept_float32_safe_or_refused_by_name():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400, deadline=None)
    @given(st.sampled_from(NUMBER_FIELDS), st.floats(allow_nan=True, allow_infinity=True) | st.integers())
    def check(name: str, value: float) -> None:
        try:
            params = GenerationRequest.build({"prompt": "x", name: value}).params
        except InvalidRequest as exc:
            assert exc.field == name
            return
        _check_kept(params)

    check()
