"""TorchServe 0.12's input decoding in the worker and its ``decode_input_request`` setting, without
a server (tests/integration/test_torchserve_inputs.py runs the same rules over HTTP and gRPC)."""

from __future__ import annotations

from inference_service.config import Settings, apply_properties
from inference_service.contracts.wire import Received
from inference_service.launch.torchserve import environment_properties
from inference_service.worker.inputs import handler_request


def _request(inputs: dict[str, bytes], content_types: dict[str, str],
             headers: dict[str, str] | None = None) -> Received:
    return Received("rid", None, headers or {}, {k: bytearray(v) for k, v in inputs.items()}, content_types)


def test_json_and_text_are_decoded_the_rest_stays_a_bytearray():
    # otf_message_handler._retrieve_input_data: == "application/json" -> json.loads,
    # .startswith("text") -> str, else the bytearray; a failed decoding keeps the bytearray
    request = _request({"j": b'{"a": [1]}', "t": b"\xc3\xa9", "tx": b"x", "b": b"\x00", "n": b"{}",
                        "bad": b"{", "deep": b"[" * 100_000, "latin": b"\xe9"},
                       {"j": "application/json", "t": "text/plain", "tx": "textual/x", "b": "image/png",
                        "bad": "application/json", "deep": "application/json", "latin": "text/plain"})
    headers, inputs = handler_request(request, decode=True)
    assert inputs == {"j": {"a": [1]}, "t": "\u00e9", "tx": "x", "b": bytearray(b"\x00"), "n": bytearray(b"{}"),
                      "bad": bytearray(b"{"), "deep": bytearray(b"[" * 100_000), "latin": bytearray(b"\xe9")}
    assert all(type(inputs[name]) is bytearray for name in ("b", "n", "bad", "deep", "latin"))  # == bytes too
    assert headers["j"] == {"content-type": "application/json"} and headers["n"] == {"content-type": ""}


def test_decoding_off_hands_over_every_input_as_a_bytearray():
    _, inputs = handler_request(_request({"j": b"[1]", "t": b"x"}, {"j": "application/json", "t": "text/plain"}),
                                decode=False)
    assert inputs == {"j": bytearray(b"[1]"), "t": bytearray(b"x")}
    assert all(type(value) is bytearray for value in inputs.values())


def test_the_request_headers_win_over_an_inputs_content_type_header():
    headers, _ = handler_request(_request({"body": b"x", "url_path": b"y"}, {"body": "text/plain"},
                                          {"url_path": "a/b", "x-request-id": "abc"}), decode=True)
    assert headers == {"body": {"content-type": "text/plain"}, "url_path": "a/b", "x-request-id": "abc"}


def test_decode_input_request_is_on_only_for_true_as_torchserves_worker_reads_it():
    for value, decode in (("true", True), (" true", True), ("false", False), ("True", False), ("no", False)):
        settings = Settings()
        assert apply_properties(settings, {"decode_input_request": value}, "config.properties") == []
        assert settings.decode_input_request is decode, value
    assert Settings().decode_input_request is True


def test_ts_environment_variables_count_only_with_enable_envvars_config():
    environ = {"TS_DECODE_INPUT_REQUEST": "false", "TS_JOB_QUEUE_SIZE": "7", "TS_ALLOWED_URLS": "https://.*",
               "TS_TOKEN_EXPIRATION_TIME_MIN": "5", "TS_MAX_JSON_DEPTH": "3"}
    settings = Settings()
    assert environment_properties(settings, environ) == {}
    apply_properties(settings, {"enable_envvars_config": "true"}, "config.properties")
    # TS_ALLOWED_URLS only with use_env_allowed_urls=true; TS_MAX_JSON_DEPTH is no TorchServe variable
    assert environment_properties(settings, environ) == {"decode_input_request": "false", "job_queue_size": "7",
                                                         "token_expiration_min": "5"}
    apply_properties(settings, {"use_env_allowed_urls": "true"}, "config.properties")
    assert environment_properties(settings, environ)["allowed_urls"] == "https://.*"
