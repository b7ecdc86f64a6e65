"""The embedding request (contracts/embeddings.py) and the bodies and answers of the embedding
handler (embeddings/formats.py), without a model: every input form, every refusal and the field
it names, the OIP base64 rule, the answers' shapes, and the matryoshka cut."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from inference_service.contracts.embeddings import (
    MAX_INPUTS,
    EmbeddingRequest,
    InvalidEmbeddingRequest,
    parse_body,
    refused_field,
)
from inference_service.embeddings.formats import answer, read_row
from inference_service.embeddings.handler import EmbeddingHandler, _dimensions, length_groups
from inference_service.embeddings.model import EmbeddingSettings
from inference_service.errors import InvalidArgument
from inference_service.frontends.openai.embeddings import NotAnObject, parse_embedding_body


@pytest.mark.parametrize("value, inputs, fields", [
    ("a text", ["a text"], ["input"]),
    (["one", "two"], ["one", "two"], ["input[0]", "input[1]"]),
    ([101, 7592, 102], [[101, 7592, 102]], ["input"]),
    ([[101], [7592, 2088]], [[101], [7592, 2088]], ["input[0]", "input[1]"]),
])
def test_input_forms(value, inputs, fields):
    request = EmbeddingRequest.build({"input": value, "model": "m"})
    assert (request.inputs, request.fields(), request.model) == (inputs, fields, "m")
    assert (request.encoding_format, request.dimensions) == ("float", None)


@pytest.mark.parametrize("body, field, words", [
    ({}, "input", "is required"),
    ({"input": []}, "input", "empty list"),
    ({"input": ""}, "input", "empty string"),
    ({"input": None}, "input", "got null"),
    ({"input": {"text": "x"}}, "input", "got an object"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"more than {MAX_INPUTS}"),
    ({"input": ["x", 1]}, "input[1]", "must be a string"),
    ({"input": ["x", ""]}, "input[1]", "empty string"),
    ({"input": [1, "x"]}, "input[1]", "token id"),
    ({"input": [1, True]}, "input[1]", "got True"),
    ({"input": [1, -1]}, "input[1]", "got -1"),
    ({"input": [[1], []]}, "input[1]", "empty list of token ids"),
    ({"input": [[1], [2, 2.5]]}, "input[1][1]", "got 2.5"),
    ({"input": [[1], "x"]}, "input[1]", "list of token ids"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'int8'"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "x", "dimensions": True}, "dimensions", "positive integer"),
    ({"input": "x", "dimensions": "8"}, "dimensions", "positive integer"),
    ({"input": "x", "model": 3}, "model", "must be a string"),
])
def test_refusals_name_the_field(body, field, words):
    with pytest.raises(InvalidEmbeddingRequest) as refused:
        EmbeddingRequest.build(body)
    assert refused.value.field == field and words in refused.value.message
    assert str(refused.value).startswith(field + ": ")
    assert refused_field(str(refused.value)) == field


def test_refused_field_reads_only_field_prefixes():
    assert refused_field("input[3]: 300 tokens, more than this model takes") == "input[3]"
    assert refused_field("prompt too long: 9000 characters") is None
    assert refused_field("inputs: the embedding model takes one input tensor") is None


DEEP = b"[" * 100000 + b"]" * 100000  # json.loads raises RecursionError


def test_bodies_the_handler_takes():
    assert parse_body(b"plain text").inputs == ["plain text"]
    assert parse_body({"input": "x", "user": "ignored"}).inputs == ["x"]
    assert parse_body(b'"a JSON string is text"').inputs == ['"a JSON string is text"']
    for body, words in ((b"", "empty"), (b"\xff\xfe", "not UTF-8"), (b'{"input": ', "not valid JSON"),
                        ("  {not json", "not valid JSON"), (b'{"input": ' + DEEP + b"}", "too deep"),
                        (5, "got an integer")):
        with pytest.raises(InvalidEmbeddingRequest, match=words):
            parse_body(body)


def test_the_openai_door_needs_a_model_and_an_object():
    assert parse_embedding_body(b'{"model": "m", "input": "x"}', 64, 1000).model == "m"
    with pytest.raises(InvalidEmbeddingRequest) as refused:
        parse_embedding_body(b'{"input": "x"}', 64, 1000)
    assert refused.value.field == "model"
    with pytest.raises(NotAnObject):
        parse_embedding_body(b"[1]", 64, 1000)
    for raw, words in ((b"{oops", "not JSON"), (b"[" * 100 + b"]" * 100, "max_json_depth=64"),
                       (b'{"input": [' + b"[1]," * 2000 + b"[1]]}", "max_json_nodes=1000")):
        with pytest.raises(InvalidArgument, match=words):
            parse_embedding_body(raw, 64, 1000)


def _oip(tensor: dict) -> dict:
    return {"body": json.dumps({"id": "1", "model_name": "m", "inputs": [tensor]}).encode()}


def test_oip_bytes_are_decoded_only_when_every_element_is_base64_text():
    encoded = [base64.b64encode(t.encode()).decode() for t in ("hello world", "café")]
    job = read_row(_oip({"name": "t", "datatype": "BYTES", "shape": [2], "data": encoded}))
    assert job.request.inputs == ["hello world", "café"] and job.oip == {"id": "1", "model_name": "m"}
    as_sent = ["hello world", "test", "aGVsbG8="]  # "test" is base64, of bytes that are not UTF-8
    assert read_row(_oip({"name": "t", "datatype": "BYTES", "shape": [3], "data": as_sent})).request.inputs == as_sent


def test_oip_token_ids_and_refusals():
    job = read_row(_oip({"name": "ids", "datatype": "INT64", "shape": [2, 3], "data": [101, 1, 102, 101, 2, 102]}))
    assert job.request.inputs == [[101, 1, 102], [101, 2, 102]]
    assert job.fields == ["inputs[0] ('ids').data[0]", "inputs[0] ('ids').data[1]"]
    for tensor, words in (({"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}, "send BYTES texts"),
                          ({"name": "x", "datatype": "BYTES", "shape": [1], "data": [""]}, r"data\[0\]: is an empty")):
        with pytest.raises(InvalidEmbeddingRequest, match=words):
            read_row(_oip(tensor))
    two = {"body": json.dumps({"inputs": [{"name": "a"}, {"name": "b"}]}).encode()}
    with pytest.raises(InvalidEmbeddingRequest, match="one input tensor"):
        read_row(two)
    with pytest.raises(InvalidEmbeddingRequest, match="no 'data' or 'body'"):
        read_row({"other": b"x"})
    with pytest.raises(InvalidEmbeddingRequest, match="too deep"):
        read_row({"body": b'{"inputs": ' + DEEP + b"}"})


def test_answers():
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    job = read_row({"body": json.dumps({"input": ["a", "b"], "model": "asked/1.0"}).encode()})
    whole = json.loads(answer(job, vectors, 7, "served"))
    assert whole == {"object": "list", "model": "asked/1.0", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                     "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                              {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}]}
    job = read_row({"body": b'{"input": "a", "encoding_format": "base64"}'})
    packed = json.loads(answer(job, vectors[:1], 1, "served"))
    assert packed["model"] == "served"
    assert np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4").tolist() == [0.5, -0.25]
    job = read_row(_oip({"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a b", "c d"]}))
    v2 = json.loads(answer(job, vectors, 4, "served"))
    assert v2["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [2, 2], "data": [0.5, -0.25, 1, 0]}]
    assert (v2["id"], v2["model_name"], v2["parameters"]) == ("1", "m", {"prompt_tokens": 4})


def test_dimensions_are_cut_only_where_the_config_allows():
    handler = EmbeddingHandler()
    handler.settings = EmbeddingSettings("mean", True, 256, 4)
    handler.cut_dimensions = _dimensions([2], 4)
    vectors = np.array([[3.0, 4.0, 1.0, 1.0]], dtype=np.float32)
    assert np.allclose(handler._cut(vectors, 2), [[0.6, 0.8]])  # normalized again
    assert handler._cut(vectors, 4) is vectors and handler._cut(vectors, None) is vectors
    handler._check_dimensions(read_row({"body": b'{"input": "a", "dimensions": 2}'}))
    with pytest.raises(InvalidEmbeddingRequest, match="can be cut to 2 only; got 3"):
        handler._check_dimensions(read_row({"body": b'{"input": "a", "dimensions": 3}'}))
    for bad in ([0], [5], "2", [True]):
        with pytest.raises(ValueError, match="matryoshka_dimensions"):
            _dimensions(bad, 4)


def test_settings_come_from_the_sentence_transformers_files_unless_configured(tmp_path):
    from inference_service.embeddings.model import settings_of

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "max_position_embeddings": 512}))
    assert settings_of(tmp_path, {}) == EmbeddingSettings("mean", True, 512, 8)  # a plain transformers directory
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                    "word_embedding_dimension": 8}))
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"}]))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    assert settings_of(tmp_path, {}) == EmbeddingSettings("cls", False, 128, 8)
    configured = {"pooling": "last_token", "normalize": True, "max_length": 300}
    assert settings_of(tmp_path, configured) == EmbeddingSettings("last_token", True, 300, 8)
    for key, bad in (("pooling", "max"), ("normalize", "yes"), ("max_length", 513), ("max_length", 1)):
        with pytest.raises(ValueError, match=f"'{key}'"):
            settings_of(tmp_path, {key: bad})


@pytest.mark.parametrize("lengths, max_inputs, groups", [
    ([], 32, []),
    ([5], 32, [[0]]),
    # like lengths share a pass up to max_inputs, longest first
    ([10, 12, 11, 10, 12, 11], 4, [[1, 4, 2, 5], [0, 3]]),
    # the first 4 of a pass join whatever their length; then an input under 0.8x the longest starts a pass
    ([60, 10, 50, 40, 30, 25, 24, 8], 32, [[0, 2, 3, 4], [5, 6, 1, 7]]),
    ([61, 60, 59, 48, 47, 20], 32, [[0, 1, 2, 3], [4, 5]]),
])
def test_length_groups_pad_little_and_cover_every_input(lengths, max_inputs, groups):
    got = length_groups(lengths, max_inputs)
    assert got == groups
    assert sorted(i for group in got for i in group) == list(range(len(lengths)))
