"""What a handler is handed, over HTTP and gRPC, with ``decode_input_request`` on and off: TorchServe
0.12's rules, read from its sources, against the real server.

1. The frontend gives each input a content type (``InferenceRequestHandler.parseRequest``,
   ``NettyUtils.getFormData``, ``InferenceImpl``): a raw HTTP body is the input ``body`` with the
   request's media type (its ``Content-Type`` up to the first ``;``, case kept, as Netty's
   ``HttpUtil.getMimeType``); a ``multipart/form-data`` body (no other multipart type, as Netty's
   ``HttpPostRequestDecoder.isMultipart``) gives one input per part, a part with a ``filename``
   its own media type, ``application/octet-stream`` when it names none (Netty's ``FileUpload``);
   a form field (a part without a ``filename``, an ``application/x-www-form-urlencoded`` field)
   and a gRPC input have none.
2. The worker (``ts/protocol/otf_message_handler.py`` ``_retrieve_input_data``), with
   ``decode_input_request`` true (the default): content type exactly ``application/json``: the
   ``json.loads`` of its UTF-8 text; starting with ``text``: its UTF-8 ``str``; anything else,
   and whatever fails to decode: its ``bytearray``. With ``decode_input_request=false``: always
   the ``bytearray``.
3. Each input's name is also a request header, ``{"content-type": <its content type, "" for
   none>}`` (``ts/service.py`` ``retrieve_data_for_inference``).

The server with decoding off reads ``TS_DECODE_INPUT_REQUEST=false`` from its environment over
``decode_input_request=true`` in its config.properties, as TorchServe does with
``enable_envvars_config=true``.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess, build_mar, read_key
from inference_service._proto import inference_pb2

RAW = object()  # the input arrives as its bytes (a bytearray) even with decoding on
BOUNDARY = "b0undary"


def _part(name: str, value: bytes, filename: str | None = None, content_type: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    return head.encode() + b"\r\n" + value + b"\r\n"


MULTIPART = b"".join([
    _part("meta", b'{"a": 1}', content_type="application/json"),  # no filename: a field
    _part("file", b'{"x": [3]}', "x.json", "application/json"),
    _part("note", "caf\u00e9".encode(), "note.txt", "text/plain; charset=utf-8"),
    _part("blob", b"\x00\x01", "blob.bin"),  # a file naming no type
]) + f"--{BOUNDARY}--\r\n".encode()

#: (what, Content-Type sent or None, body, {input: (its bytes, its content type, its value decoded or RAW)})
CASES: list[tuple[str, str | None, bytes, dict[str, tuple[bytes, str, Any]]]] = [
    ("json", "application/json", b'{"x": [1, 2]}',
     {"body": (b'{"x": [1, 2]}', "application/json", {"x": [1, 2]})}),
    ("json-charset", "application/json; charset=utf-8", b'[1, "a"]',
     {"body": (b'[1, "a"]', "application/json", [1, "a"])}),
    ("json-upper-case", "Application/JSON", b"[1]", {"body": (b"[1]", "Application/JSON", RAW)}),
    ("json-invalid", "application/json", b'{"x":', {"body": (b'{"x":', "application/json", RAW)}),
    ("text", "text/plain; charset=utf-8", "h\u00e9llo".encode(),
     {"body": ("h\u00e9llo".encode(), "text/plain", "h\u00e9llo")}),
    ("text-csv", "text/csv", b"a,b", {"body": (b"a,b", "text/csv", "a,b")}),
    ("text-not-utf8", "text/plain", b"\xff\xfe", {"body": (b"\xff\xfe", "text/plain", RAW)}),
    ("binary", "application/octet-stream", b"\x00\x01", {"body": (b"\x00\x01", "application/octet-stream", RAW)}),
    ("no-content-type", None, b"raw", {"body": (b"raw", "", RAW)}),
    ("multipart", f"multipart/form-data; boundary={BOUNDARY}", MULTIPART, {
        "meta": (b'{"a": 1}', "", RAW),
        "file": (b'{"x": [3]}', "application/json", {"x": [3]}),
        "note": ("caf\u00e9".encode(), "text/plain", "caf\u00e9"),
        "blob": (b"\x00\x01", "application/octet-stream", RAW)}),
    ("multipart-mixed", f"multipart/mixed; boundary={BOUNDARY}", MULTIPART,  # not a form: the body, raw
     {"body": (MULTIPART, "multipart/mixed", RAW)}),
    ("form", "application/x-www-form-urlencoded", b"a=1&b=%7B%7D",
     {"a": (b"1", "", RAW), "b": (b"{}", "", RAW)}),
]


def expected(inputs: dict[str, tuple[bytes, str, Any]], decode: bool) -> dict[str, Any]:
    """What :file:`handlers/inputs_handler.py` answers under the rules of the module docstring."""
    return {"inputs": {name: ["bytearray", raw.decode("latin-1")] if not decode or value is RAW
                       else [type(value).__name__, value] for name, (raw, _, value) in inputs.items()},
            "headers": {name: {"content-type": content_type} for name, (_, content_type, _) in inputs.items()}}


@pytest.fixture(scope="module")
def servers(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, ServerProcess]]:
    """``{True: decoding on (the default), False: off}``, each serving ``scaler2`` and ``inputs``."""
    build_mar(store, "scaler2", "scaler2_handler.py")
    build_mar(store, "inputs", "inputs_handler.py")
    args = ["--workers-per-model", "1", "--models", "scaler2=scaler2.mar", "inputs=inputs.mar"]
    work = tmp_path_factory.mktemp("decode_off")
    (work / "config.properties").write_text("enable_envvars_config=true\ndecode_input_request=true\n")
    started = {True: ServerProcess(tmp_path_factory.mktemp("decode_on"), store, args)}
    try:
        started[False] = ServerProcess(work, store, [*args, "--ts-config", str(work / "config.properties")],
                                       env={"TS_DECODE_INPUT_REQUEST": "false"})
        for server in started.values():
            server.wait_workers("scaler2", 1)
            server.wait_workers("inputs", 1)
        yield started
    finally:
        for server in started.values():
            assert server.stop() == 0, server.log()


def post(server: ServerProcess, path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=30)
    headers = {"Authorization": f"Bearer {read_key(server.key_file, 'inference')}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_handler_written_for_decoded_json_answers_as_on_torchserve(servers):
    request = json.dumps({"x": [1, 2, 3]}).encode()
    status, body = post(servers[True], "/predictions/scaler2", request, "application/json")
    assert status == 200 and json.loads(body) == {"y": [2.0, 4.0, 6.0]}  # TorchServe indents the same JSON
    # decoding off, the handler gets the bytearray, as TorchServe's with decode_input_request=false
    status, body = post(servers[False], "/predictions/scaler2", request, "application/json")
    assert status == 503 and "bytearray indices must be integers" in json.loads(body)["message"]
    assert post(servers[False], "/predictions/scaler2", b"[1]", "application/json")[0] == 503
    assert post(servers[True], "/predictions/scaler2", request, "application/json")[0] == 200  # the worker serves on


@pytest.mark.parametrize("decode", [True, False], ids=["decoding-on", "decoding-off"])
@pytest.mark.parametrize(("content_type", "body", "inputs"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_http_inputs_reach_the_handler_by_torchserves_rules(servers, decode, content_type, body, inputs):
    status, answer = post(servers[decode], "/predictions/inputs", body, content_type)
    assert status == 200, answer
    assert json.loads(answer) == expected(inputs, decode)


def test_a_body_that_does_not_decode_is_handed_over_as_bytes_with_a_warning(servers):
    server = servers[True]
    status, _ = post(server, "/predictions/inputs", b"\x00{not json", "application/json")
    assert status == 200
    assert ("input 'body' (application/json) is not valid JSON (Expecting value: line 1 column 1 (char 0)); "
            "the handler gets its bytes") in server.log()


@pytest.mark.parametrize("decode", [True, False], ids=["decoding-on", "decoding-off"])
def test_grpc_inputs_have_no_content_type_and_stay_bytes(servers, decode):
    request = inference_pb2.PredictionsRequest(model_name="inputs", input={"body": b'{"x": [1]}', "data": b"text"})
    answer = json.loads(servers[decode].inference.Predictions(request, timeout=30).prediction)
    assert answer == expected({"body": (b'{"x": [1]}', "", RAW), "data": (b"text", "", RAW)}, decode)
