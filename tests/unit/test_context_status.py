"""``Context.get_response_status`` answers TorchServe's ``(code, phrase)`` tuple."""

from __future__ import annotations

from inference_service.handler.context import Context, RequestProcessor


def _context(requests: int) -> Context:
    context = Context("m", "/tmp", {}, requests, None, "test")
    context.request_processor = [RequestProcessor({}) for _ in range(requests)]
    return context


def test_default_is_200_without_phrase() -> None:
    assert _context(2).get_response_status(1) == (200, None)


def test_set_status_comes_back_with_its_phrase() -> None:
    context = _context(3)
    context.set_response_status(404, "no such thing", 1)
    assert context.get_response_status(1) == (404, "no such thing")
    assert context.get_response_status(0) == (200, None)
    context.set_all_response_status(503, "busy")
    assert [context.get_response_status(i) for i in range(3)] == [(503, "busy")] * 3
    code, phrase = context.get_response_status(2)  # TorchServe handlers unpack it
    assert (code, phrase) == (503, "busy")
