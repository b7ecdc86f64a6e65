"""One request id per request (frontends/request_ids.py): a client's valid id kept, else one made."""

from __future__ import annotations

import re

import pytest

from inference_service.frontends.request_ids import REQUEST_ID_HEADER, handler_headers, request_id

MADE = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize("client", ["abc-123", "a", "tenant/req:42@eu+1=x", "A" * 128])
def test_a_valid_client_id_is_kept(client: str) -> None:
    assert request_id(client) == client


@pytest.mark.parametrize("client", [None, "", "has space", "line\nbreak", "A" * 129, "quote\"d", "é"])
def test_anything_else_gets_a_made_id(client: str | None) -> None:
    made = request_id(client)
    assert MADE.fullmatch(made) and made != request_id(client)  # fresh each time


def test_handler_headers_drop_credentials_and_set_the_id() -> None:
    headers = handler_headers([("Authorization", "Bearer k"), ("X-Request-Id", "client"), ("Accept", "*/*")], "rid")
    assert headers == {"Accept": "*/*", REQUEST_ID_HEADER: "rid"}
