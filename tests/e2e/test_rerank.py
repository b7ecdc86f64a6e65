"""Rerank and score end to end: the example cross-encoder archive (scripts/build_rerank_archive
--example: all-MiniLM-L6-v2 with a seeded one-label head) on the real server, on both engines,
against sentence-transformers' ``CrossEncoder.predict`` on the same folder.

The server serves ``reranker`` (the OpenVINO engine, the archive's default) and ``reranker_torch``
(``--engine torch``). The 5 queries and 10 passages are committed in ``data/rerank_passages.json``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import ROOT, ServerProcess, read_key, serving
from inference_service._proto import inference_pb2

pytestmark = pytest.mark.slow

DATA = json.loads((Path(__file__).parent / "data" / "rerank_passages.json").read_text())
QUERIES, PASSAGES = DATA["queries"], DATA["passages"]
MODELS = ("reranker", "reranker_torch")
DEADLINE_S = 120


def _build(store: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_rerank_archive"), "--example", "--model-store",
                    str(store), *args], check=True, timeout=600, capture_output=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("rerank_store")
    _build(store)  # writes the example model and its OpenVINO IR once (cached), then reranker.mar
    _build(store, "--engine", "torch", "--name", "reranker_torch")
    with serving(tmp_path_factory.mktemp("rerank_work"), store, MODELS) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server):
    """sentence-transformers' ``CrossEncoder`` on the archive's folder (default activation: Sigmoid)."""
    from sentence_transformers import CrossEncoder

    from inference_service.llm.model import default_cache_root
    from inference_service.rerank.model import example_model

    model = CrossEncoder(str(example_model(default_cache_root())), device="cpu", local_files_only=True)
    assert type(model.activation_fn).__name__ == "Sigmoid"
    return model


def _post(srv: ServerProcess, path: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.status['http_port']}{path}", data=data, method="POST",
        headers={"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("model", MODELS)
def test_rerank_orders_the_passages_as_cross_encoder_does(server, reference, model):
    for query in QUERIES:
        expected = reference.predict([(query, passage) for passage in PASSAGES])
        status, answer = _post(server, "/v1/rerank", {"model": model, "query": query, "documents": PASSAGES})
        assert status == 200, answer
        assert answer["model"] == model and answer["id"].startswith("rerank-")
        results = answer["results"]
        order = [item["index"] for item in results]
        assert sorted(order) == list(range(10))
        scores = [item["relevance_score"] for item in results]
        assert scores == sorted(scores, reverse=True)
        assert max(abs(item["relevance_score"] - expected[item["index"]]) for item in results) <= 1e-3
        assert order == sorted(range(10), key=lambda i: -expected[i]), (order, expected)
        assert all(item["document"] == {"text": PASSAGES[item["index"]]} for item in results)
        tokens = sum(len(ids) for ids in reference.tokenizer([query] * 10, PASSAGES)["input_ids"])
        assert answer["usage"] == {"total_tokens": tokens}


@pytest.mark.parametrize("model", MODELS)
def test_score_answers_each_pair_in_order(server, reference, model):
    status, answer = _post(server, "/v1/score", {"model": model, "text_1": QUERIES[0], "text_2": PASSAGES[:4]})
    assert status == 200, answer
    assert answer["object"] == "list" and answer["model"] == model and isinstance(answer["created"], int)
    assert [(item["index"], item["object"]) for item in answer["data"]] == [(i, "score") for i in range(4)]
    expected = reference.predict([(QUERIES[0], passage) for passage in PASSAGES[:4]])
    assert np.abs(np.array([item["score"] for item in answer["data"]]) - expected).max() <= 1e-3
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    status, answer = _post(server, "/v1/score", {"model": model, "text_1": QUERIES, "text_2": PASSAGES[:5]})
    expected = reference.predict(list(zip(QUERIES, PASSAGES[:5], strict=True)))
    assert status == 200 and np.abs(np.array([item["score"] for item in answer["data"]]) - expected).max() <= 1e-3


def test_the_other_paths_and_options(server, reference):
    body = {"model": "reranker", "query": QUERIES[1], "documents": [{"text": p} for p in PASSAGES], "top_n": 3,
            "return_documents": False}
    answers = [_post(server, path, body) for path in ("/v1/rerank", "/rerank", "/v2/rerank")]
    assert all(status == 200 for status, _ in answers), answers
    tops = [[(item["index"], round(item["relevance_score"], 5)) for item in answer["results"]] for _, answer in answers]
    assert tops[0] == tops[1] == tops[2] and len(tops[0]) == 3
    assert all("document" not in item for item in answers[0][1]["results"])
    expected = reference.predict([(QUERIES[1], passage) for passage in PASSAGES])
    assert [index for index, _ in tops[0]] == list(np.argsort(-expected)[:3])
    status, answer = _post(server, "/predictions/reranker", {"query": QUERIES[1], "documents": PASSAGES})
    assert status == 200 and answer["results"][0]["index"] == tops[0][0][0], answer
    request = inference_pb2.PredictionsRequest(model_name="reranker", input={"data": json.dumps(
        {"text_1": QUERIES[1], "text_2": PASSAGES[:2]}).encode()})
    scored = json.loads(server.inference.Predictions(request, timeout=DEADLINE_S).prediction)
    assert np.abs(np.array([item["score"] for item in scored["data"]]) - expected[:2]).max() <= 1e-3


@pytest.mark.parametrize("model", MODELS)
def test_a_pair_longer_than_the_model_is_cut_as_cross_encoder_cuts_it(server, reference, model):
    long = " ".join(PASSAGES) * 12  # about 2,600 tokens: cut to 512, the longer text first
    status, answer = _post(server, "/v1/score", {"model": model, "text_1": QUERIES[0] * 4, "text_2": [long, "short"]})
    assert status == 200, answer
    expected = reference.predict([(QUERIES[0] * 4, long), (QUERIES[0] * 4, "short")])
    assert np.abs(np.array([item["score"] for item in answer["data"]]) - expected).max() <= 1e-3
    tokens = sum(len(ids) for ids in reference.tokenizer([QUERIES[0] * 4] * 2, [long, "short"], truncation=True,
                                                         max_length=512)["input_ids"])
    assert answer["usage"]["total_tokens"] == tokens and tokens > 512


def test_8_clients_are_batched_and_answered_as_alone(server):
    alone = {query: _post(server, "/v1/rerank", {"model": "reranker", "query": query, "documents": PASSAGES})[1]
             for query in QUERIES}
    calls = [QUERIES[i % 5] for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: (q, *_post(server, "/v1/rerank", {"model": "reranker", "query": q,
                                                                           "documents": PASSAGES})), calls))
    for query, status, answer in answers:
        assert status == 200, answer
        assert [item["index"] for item in answer["results"]] == [item["index"] for item in alone[query]["results"]]
        assert max(abs(a["relevance_score"] - b["relevance_score"])
                   for a, b in zip(answer["results"], alone[query]["results"], strict=True)) <= 1e-5
    sizes = [int(n) for n in re.findall(r"rerank\.handler: batch of (\d+) requests", server.log())]
    assert max(sizes) > 1, sizes  # requests of different clients shared a handler call


BAD = [
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": "a"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 7]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a", {"txt": "b"}]}, "documents[1].text"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 1001}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ("/v1/rerank", {"query": "q", "documents": ["fine", "bad \ud800"]}, "documents[1]"),  # the handler's check
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_2": ["a"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2[0]"),
]


@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_name_the_field_and_the_worker_serves_on(server, model):
    pid = server.describe(model)[0]["workers"][0]["pid"]
    for path, body, param in BAD:
        status, answer = _post(server, path, {**body, "model": model})
        error = answer["error"]
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), (body, error)
        assert error["message"].startswith(param + ":"), error
    status, answer = _post(server, "/v1/rerank", {"query": "q", "documents": ["a"]})
    assert status == 400 and answer["error"]["param"] == "model"
    status, answer = _post(server, "/v1/rerank", {"model": "nothing", "query": "q", "documents": ["a"]})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, answer = _post(server, "/v1/rerank", b"[1, 2]")
    assert status == 400 and answer["error"]["param"] is None
    status, answer = _post(server, "/v1/rerank", {"model": model, "query": "still", "documents": ["serving"]})
    assert status == 200 and len(answer["results"]) == 1
    assert server.describe(model)[0]["workers"][0]["pid"] == pid


def test_an_answer_that_cannot_fit_is_refused_before_any_work(server):
    documents = ["\u00e9" * 1100] * 1000  # 2.2 MB of UTF-8, 6.6 MB of JSON escapes in the answer
    started = time.monotonic()
    body = json.dumps({"model": "reranker", "query": "q", "documents": documents}, ensure_ascii=False).encode()
    status, answer = _post(server, "/v1/rerank", body)
    error = answer["error"]
    assert status == 413 and error["param"] == "documents", error
    assert "max_response_size=6553500" in error["message"] and "return_documents false" in error["message"]
    assert time.monotonic() - started < 10  # refused before scoring 1,000 pairs of 512 tokens
    request = inference_pb2.PredictionsRequest(model_name="reranker", input={"data": body})
    with pytest.raises(grpc.RpcError) as refused:
        server.inference.Predictions(request, timeout=DEADLINE_S)
    assert "max_response_size" in refused.value.details(), refused.value.details()
