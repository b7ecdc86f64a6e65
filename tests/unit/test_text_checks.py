"""Lone surrogates are refused per request, naming where they are (issue 48 item 2)."""

from __future__ import annotations

import json

import pytest

from inference_service.contracts.sampling import InvalidRequest, parse_request
from inference_service.contracts.text import lone_surrogate


@pytest.mark.parametrize(("value", "where"), [
    ("plain", None),
    ("caf\u00e9 \U0001f600", None),  # a real astral character: a surrogate pair in JSON, one code point here
    ("a\ud800b", ("", 1)),
    ("\udfff", ("", 0)),
    ({"prompt": "ok", "messages": [{"role": "user", "content": "x\udc00"}]}, ("messages[0].content", 1)),
    ({"a\ud801": "ok"}, ("a\ud801 (the key)", 1)),
    ([["ok"], ["fine", "\ud800"]], ("[1][1]", 0)),
    ({"n": 3, "stop": None, "logit_bias": {"1": 2.0}}, None),
])
def test_lone_surrogate_names_the_first(value, where):
    assert lone_surrogate(value) == where


def test_a_json_escape_of_a_lone_surrogate_is_refused_with_its_field():
    for body, field in ((b'{"prompt": "What is \\ud800?"}', "prompt"),
                        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
                        ("\ud800 as a raw prompt", "prompt"),
                        ({"prompt": "dict \ud800"}, "prompt")):
        with pytest.raises(InvalidRequest) as refused:
            parse_request(body)
        assert refused.value.field == field, body
        assert "lone surrogate" in str(refused.value) and "at character" in str(refused.value)
    # a surrogate pair written as two escapes is one real character, and is served
    assert parse_request(json.dumps({"prompt": "smile \U0001f600"}).encode()).prompt == "smile \U0001f600"


def test_the_embedding_encoder_refuses_the_input_that_holds_one():
    from inference_service.contracts.embeddings import InvalidEmbeddingRequest
    from inference_service.embeddings.model import default_model_dir
    from inference_service.embeddings.tokens import InputEncoder

    encoder = InputEncoder(default_model_dir() / "tokenizer.json", 256, need_text=True)
    with pytest.raises(InvalidEmbeddingRequest) as refused:
        encoder.encode(["fine", "bad \ud800 text"], ["input[0]", "input[1]"])
    assert refused.value.field == "input[1]" and "lone surrogate" in str(refused.value)
    assert len(encoder.encode(["fine", "also fine"], ["input[0]", "input[1]"])) == 2
