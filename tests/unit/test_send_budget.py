"""The per-connection budget of unread gRPC answer bytes (``grpc_max_unread_bytes``): answers
past it wait for room, and end RESOURCE_EXHAUSTED after the pause or when paused ones fill it."""

from __future__ import annotations

import asyncio

import pytest

from inference_service._proto import inference_pb2
from inference_service.errors import ResourceExhausted
from inference_service.frontends.grpc.send_budget import SMALL, SendBudget

MB = 1 << 20


def _answer(size: int) -> inference_pb2.PredictionResponse:
    return inference_pb2.PredictionResponse(prediction=b"x" * size)


def test_answers_that_fit_go_and_the_first_always_goes():
    async def scenario():
        budget = SendBudget(4 * MB, 1.0)
        first, second = budget.call("a"), budget.call("a")
        raw = await first.admit(_answer(5 * MB))  # alone on its connection: goes even when larger
        assert isinstance(raw, bytes) and inference_pb2.PredictionResponse.FromString(raw).prediction
        assert budget.held("a") == (len(raw), 0)
        assert isinstance(await budget.call("b").admit(_answer(MB)), bytes)  # another connection
        first.done()
        first.done()  # idempotent
        await second.admit(_answer(MB))
        second.done()
        assert budget.held("a") == (0, 0)

    asyncio.run(scenario())


def test_small_answers_are_not_counted():
    async def scenario():
        budget = SendBudget(MB, 0.1)
        await budget.call("a").admit(_answer(2 * MB))
        small = _answer(SMALL - 100)
        assert await budget.call("a").admit(small) is small

    asyncio.run(scenario())


def test_a_paused_answer_goes_once_earlier_ones_are_taken():
    async def scenario():
        budget = SendBudget(2 * MB, 5.0)
        held = budget.call("a")
        await held.admit(_answer(2 * MB))
        waiting = asyncio.ensure_future(budget.call("a").admit(_answer(MB)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and budget.held("a")[1] > MB
        held.done()
        assert isinstance(await asyncio.wait_for(waiting, 1), bytes)
        assert budget.held("a")[1] == 0

    asyncio.run(scenario())


def test_paused_answers_end_after_the_pause_or_at_once_when_they_fill_the_budget():
    async def scenario():
        budget = SendBudget(2 * MB, 0.3)
        await budget.call("a").admit(_answer(2 * MB))
        paused = asyncio.ensure_future(budget.call("a").admit(_answer(MB + MB // 2)))
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="grpc_max_unread_bytes") as refused:
            await budget.call("a").admit(_answer(MB))  # the paused ones would pass the budget
        assert refused.value.retry_after_s
        with pytest.raises(ResourceExhausted, match="no room for 0.3 s"):
            await paused
        assert budget.held("a")[1] == 0

    asyncio.run(scenario())


def test_a_stream_holds_its_last_two_messages():
    async def scenario():
        budget = SendBudget(100 * MB, 1.0)
        call = budget.call("a")
        sizes = [len(await call.admit(_answer(MB))) for _ in range(5)]
        assert budget.held("a") == (sum(sizes[-2:]), 0)
        call.done()
        assert budget.held("a") == (0, 0)

    asyncio.run(scenario())


def test_no_budget_when_the_limit_is_0():
    assert SendBudget(0, 1.0).call("a") is None
