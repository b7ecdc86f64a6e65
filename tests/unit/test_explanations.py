"""The explanation flag and helpers without a server: who may set ``explain``, the ``target`` input,
Captum missing, and the job queue's rule that an explanation is a batch of its own."""

from __future__ import annotations

import asyncio
import sys

import pytest

from inference_service.contracts.explain import is_explanation, set_explain
from inference_service.dispatch.jobs import Job, JobQueue
from inference_service.frontends.request_ids import handler_headers
from inference_service.handler.base_handler import BaseHandler
from inference_service.handler.context import Context, RequestProcessor
from inference_service.handler.explanations import captum_attr, request_target
from inference_service.handler.util import PredictionException


def test_only_the_route_sets_the_flag():
    headers = handler_headers([("Explain", "True"), ("EXPLAIN", "True"), ("X-Trace", "a")], "rid")
    assert "Explain" not in headers and "EXPLAIN" not in headers
    assert set_explain(headers, False) == {"X-Trace": "a", "x-request-id": "rid", "explain": "False"}
    assert set_explain({"Explain": "False"}, True) == {"explain": "True"}
    assert is_explanation({"explain": "True"}) and not is_explanation({"explain": "true"})  # TorchServe's test


@pytest.mark.parametrize(("row", "target"), [
    ({}, 0), ({"target": None}, 0), ({"target": b""}, 0), ({"target": 3}, 3), ({"target": b"2"}, 2),
    ({"target": bytearray(b" 5 ")}, 5), ({"target": "-1"}, -1), ("not a dict", 0)])
def test_request_target(row, target):
    assert request_target(row) == target


@pytest.mark.parametrize("value", [b"cat", "1.5", True, 2.0, [1]])
def test_a_target_that_is_no_class_index_is_400(value):
    with pytest.raises(PredictionException) as info:
        request_target({"target": value})
    assert info.value.error_code == 400 and info.value.message.startswith("target must be an integer class index")


def test_captum_missing_is_501(monkeypatch):
    monkeypatch.setitem(sys.modules, "captum.attr", None)  # what import finds when Captum is not installed
    with pytest.raises(PredictionException) as info:
        captum_attr("IntegratedGradients")
    assert info.value.error_code == 501 and "install the 'explain' extra" in info.value.message


def test_base_handler_routes_on_the_first_requests_header():
    class Handler(BaseHandler):
        def preprocess(self, data):
            return data

        def inference(self, data, *args, **kwargs):
            return ["predicted"] * len(data)

        def postprocess(self, data):
            return data

        def get_insights(self, tensor_data, raw_input, target=0):
            return [f"explained {raw_input!r} for {target}"]

    context = Context("m", "/tmp", {"model": {}}, 0, None, "1.0")
    handler = Handler()
    for flag, expected in (("True", ["explained b'x' for 4"]), ("False", ["predicted"])):
        context.request_processor = [RequestProcessor({"explain": flag})]
        assert handler.handle([{"body": b"x", "target": b"4"}], context) == expected
        assert handler.explain is (flag == "True")
    with pytest.raises(PredictionException) as info:  # BaseHandler's own: no explanations
        BaseHandler().get_insights(None, None)
    assert info.value.error_code == 501


def test_an_explanation_is_a_batch_of_its_own():
    async def scenario():
        queue = JobQueue(capacity=10, batch_size=4, max_batch_delay_ms=60_000)
        sent: list[list[Job]] = []

        class Worker:
            id = 1

            def take(self, batch):
                sent.append(batch)
                return True

        predictions = [Job({"body": b"p"}, {"explain": "False"}) for _ in range(2)]
        explanation = Job({"body": b"e"}, {"explain": "True"})
        later = Job({"body": b"p"}, {"explain": "False"})
        for job in (*predictions, explanation, later):
            queue.put(job)
        for _ in range(3):  # the worker is free again after each batch
            queue.offer(Worker())
        # the waiting predictions leave at once (the explanation cannot join them), then the
        # explanation alone; the last prediction waits for its batch to fill
        assert sent == [predictions, [explanation]]

    asyncio.run(scenario())
