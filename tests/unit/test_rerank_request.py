"""The rerank and score request (contracts/rerank.py), the handler's answers and the model folder
rules (rerank/model.py), without a model: every body form, every refusal's field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inference_service.contracts.rerank import InvalidRerankRequest, RerankRequest, parse_body, refused_field
from inference_service.llm.model import ModelPreparationError
from inference_service.rerank.handler import answer, answer_bound
from inference_service.rerank.model import model_dir_of, settings_of


def test_rerank_bodies():
    request = RerankRequest.build({"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 0})
    assert (request.kind, request.pairs, request.top_n, request.return_documents) == (
        "rerank", [("q", "a"), ("q", "b")], None, True)
    assert request.fields == ["documents[0]", "documents[1]"]
    assert RerankRequest.build({"query": "q", "documents": ["a"], "top_n": 5, "return_documents": False}).top_n == 5


def test_score_bodies_pair_one_with_all_or_one_with_one():
    one = RerankRequest.build({"text_1": "q", "text_2": ["a", "b"]})
    assert (one.kind, one.pairs, one.fields) == ("score", [("q", "a"), ("q", "b")], ["text_2[0]", "text_2[1]"])
    assert RerankRequest.build({"text_1": ["x", "y"], "text_2": ["a", "b"]}).pairs == [("x", "a"), ("y", "b")]
    assert RerankRequest.build({"text_1": "x", "text_2": "a"}).fields == ["text_2"]


@pytest.mark.parametrize(("body", "field"), [
    ({}, "query"),
    ({"query": "q"}, "documents"),
    ({"documents": ["a"]}, "query"),
    ({"query": 3, "documents": ["a"]}, "query"),
    ({"query": "q", "documents": [None]}, "documents[0]"),
    ({"query": "q", "documents": [{"text": ""}]}, "documents[0].text"),
    ({"query": "q", "documents": ["a"] * 1001}, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
    ({"query": "q", "documents": ["a"], "top_n": True}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents"),
    ({"query": "q", "documents": ["a"], "model": 7}, "model"),
    ({"text_1": "q"}, "text_2"),
    ({"text_1": [], "text_2": ["a"]}, "text_1"),
    ({"text_1": ["a", "b"], "text_2": ["a"]}, "text_2"),
])
def test_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRerankRequest) as refused:
        RerankRequest.build(body)
    assert refused.value.field == field and refused.value.status == 400
    assert refused_field(str(refused.value)) == field


def test_handler_bodies():
    assert parse_body(b'{"query": "q", "documents": ["a"]}').pairs == [("q", "a")]
    for body, start in ((b"\xff", "query: the request body is not UTF-8"), (b"plain text", "query: the request body "
                        "is not valid JSON"), (b"[1]", "query: the request body must be a JSON object")):
        with pytest.raises(InvalidRerankRequest) as refused:
            parse_body(body)
        assert str(refused.value).startswith(start)


def test_rerank_answer_sorts_cuts_and_leaves_documents_out():
    request = RerankRequest.build({"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
    got = json.loads(answer(request, np.array([0.1, 0.9, 0.1], dtype=np.float32), 12, "served"))
    assert got["model"] == "served" and got["usage"] == {"total_tokens": 12}
    assert [(r["index"], r["document"]["text"]) for r in got["results"]] == [(1, "b"), (0, "a")]
    bare = RerankRequest.build({"query": "q", "documents": ["a"], "return_documents": False, "model": "m"})
    assert json.loads(answer(bare, np.array([0.5]), 3, "served"))["results"] == [{"index": 0, "relevance_score": 0.5}]
    scored = json.loads(answer(RerankRequest.build({"text_1": "q", "text_2": ["a", "b"]}), np.array([0.2, 0.7]), 9,
                               "m"))
    assert [(d["index"], d["object"], round(d["score"], 6)) for d in scored["data"]] == [(0, "score", 0.2),
                                                                                         (1, "score", 0.7)]


def test_the_answer_bound_holds_the_answer():
    texts = ["\u00e9\n\"" * 50, "x" * 300, "short"]
    for top_n in (None, 1, 2):
        request = RerankRequest.build({"query": "q", "documents": texts, "top_n": top_n, "model": "m" * 40})
        written = answer(request, np.array([-1.2345678e-05, 0.5, 1e-30]), 999, "m")
        assert len(written) <= answer_bound(request)


def _folder(tmp_path, config: dict, **files: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return str(tmp_path)


def test_model_folder_rules(tmp_path):
    base = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"},
            "max_position_embeddings": 512}
    path = model_dir_of({"model_path": _folder(tmp_path, base, tokenizer_config={"model_max_length": 512})})
    assert (settings_of(path, {}).activation, settings_of(path, {}).max_length) == ("sigmoid", 512)
    assert settings_of(path, {"max_length": 128, "activation": "identity"}).max_length == 128
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"activation_fn": "torch.nn.modules.linear.Identity"}))
    assert settings_of(path, {}).activation == "identity"
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "my.Tanh"}))
    with pytest.raises(ValueError, match="neither Sigmoid nor Identity"):
        settings_of(path, {})
    assert settings_of(path, {"activation": "sigmoid"}).activation == "sigmoid"  # the config's word wins
    (tmp_path / "config_sentence_transformers.json").unlink()
    with pytest.raises(ValueError, match="'max_length'"):
        settings_of(path, {"max_length": 1024, "activation": "sigmoid"})
    with pytest.raises(ModelPreparationError, match="2 labels"):
        model_dir_of({"model_path": _folder(tmp_path, {**base, "id2label": {"0": "a", "1": "b"}})})
    with pytest.raises(ModelPreparationError, match="ForSequenceClassification"):
        model_dir_of({"model_path": _folder(tmp_path, {**base, "architectures": ["BertModel"]})})
    with pytest.raises(ModelPreparationError, match="'model_path' is required"):
        model_dir_of({})
