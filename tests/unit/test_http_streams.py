"""How /predictions writes a streamed answer (frontends/http/streams.py), form by form."""

from __future__ import annotations

import json

import pytest

from inference_service.frontends.http.streams import (
    NDJSON,
    PEEK_BYTES,
    TEXT,
    StreamFraming,
    usage_object,
    wants_ndjson,
)

USAGE = {"text": "", "finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.mark.parametrize(("accept", "expected"), [
    ("application/x-ndjson", True), ("text/plain, application/x-ndjson;q=0.9", True),
    ("APPLICATION/X-NDJSON", True), ("*/*", False), ("", False), ("application/json", False),
])
def test_accept_header(accept: str, expected: bool) -> None:
    assert wants_ndjson(accept) is expected


def test_usage_object_is_recognised_by_its_shape_only() -> None:
    assert usage_object(json.dumps(USAGE).encode()) == USAGE
    for other in (b"plain text", b"{not json", b'{"text": "x"}', b'{"text": 1, "finish_reason": "stop", "usage": {}}',
                  b"[1, 2]", json.dumps({**USAGE, "text": "x" * PEEK_BYTES}).encode()):  # too long to parse
        assert usage_object(other) is None


def test_raw_form_puts_the_usage_on_its_own_line() -> None:
    framing = StreamFraming(ndjson=False)
    assert framing.content_type("Paris".encode()) == TEXT
    assert framing.piece(b"The capital") == b"The capital"
    final = framing.final(json.dumps({**USAGE, "text": " is Paris."}).encode())
    text, _, line = final.decode().partition("\n")
    assert text == " is Paris." and json.loads(line) == USAGE and final.endswith(b"}\n")
    assert framing.final(b"rest of the text") == b"rest of the text"  # no usage: nothing added


def test_raw_form_without_text_before_adds_no_blank_line() -> None:
    assert StreamFraming(ndjson=False).final(json.dumps(USAGE).encode()) == json.dumps(USAGE).encode() + b"\n"


def test_binary_first_chunk_keeps_the_default_content_type() -> None:
    assert StreamFraming(ndjson=False).content_type(b"\xff\xfe\x00") is None
    assert StreamFraming(ndjson=False).content_type("é".encode() * PEEK_BYTES) == TEXT  # a cut character is text


def test_ndjson_form_is_one_object_per_line() -> None:
    framing = StreamFraming(ndjson=True)
    assert framing.content_type(b"\xff") == NDJSON
    out = framing.piece(b"Pa") + framing.piece(b"") + framing.final(json.dumps({**USAGE, "text": "ris"}).encode())
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert lines == [{"text": "Pa"}, {"text": "ris"}, USAGE]
    assert StreamFraming(ndjson=True).final(b"end") == b'{"text": "end"}\n'


@pytest.mark.parametrize("ndjson", [False, True])
def test_piece_objects_of_a_logprobs_request_are_lines_of_their_own(ndjson: bool) -> None:
    """With logprobs every message is an object: each one line, in both forms, the last as it is."""
    entry = {"token": "Pa", "logprob": -0.5, "bytes": [80, 97], "top_logprobs": []}
    piece = json.dumps({"text": "Pa", "logprobs": [entry]}).encode()
    last = {"text": "ris", "finish_reason": "stop", "logprobs": [{**entry, "token": "ris", "bytes": [114, 105, 115]}]}
    framing = StreamFraming(ndjson=ndjson)
    out = framing.piece(piece) + framing.final(json.dumps(last).encode())
    assert [json.loads(line) for line in out.decode().splitlines()] == [json.loads(piece), last]
    assert out.endswith(b"}\n") and b"\n\n" not in out
    # text that only looks like a piece object stays text
    assert StreamFraming(ndjson=False).piece(b'{"text": "x"}') == b'{"text": "x"}'
