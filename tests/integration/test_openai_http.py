"""The HTTP API's routes for OpenAI clients and TorchServe's vLLM handler, without an LLM.

A real server runs ``tests/handlers/route_handler.py``, which answers the ``url_path`` header
and the request body it received: enough to check TorchServe's ``/predictions/{m}/{v}/{rest}``
form, what an OpenAI request becomes for the handler, and every error status of ``/v1`` in
OpenAI's shape (raw ``http.client`` for the bodies, the official ``openai`` client for the
exceptions it raises). The LLM itself is exercised in ``tests/e2e/test_openai_llm.py``.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import openai
import pytest

from conftest import ServerProcess, build_mar, read_key, wait_for

CONFIG = "max_request_size=16384\n"
BUSY_CONFIG = "batchSize: 1\njobQueueSize: 1\nminWorkers: 1\nmaxWorkers: 1\n"
CHAT = {"model": "router", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """router (1.0 default, 2.0), busy (1 worker, batchSize 1, jobQueueSize 1); the model API on."""
    store = tmp_path_factory.mktemp("openai_store")
    build_mar(store, "router", "route_handler.py")
    build_mar(store, "router_v2", "route_handler.py", version="2.0")
    (store / "busy.yaml").write_text(BUSY_CONFIG)
    build_mar(store, "busy", "route_handler.py", config=str(store / "busy.yaml"))
    work = tmp_path_factory.mktemp("openai_http")
    (work / "config.properties").write_text(CONFIG)
    server = ServerProcess(work, store, ["--ts-config", str(work / "config.properties"), "--enable-model-api",
                                         "--workers-per-model", "1", "--models", "router=router.mar",
                                         "busy=busy.mar"])
    try:
        for name in ("router", "busy"):
            server.wait_workers(name, 1)
        server.register("router_v2.mar", model_name="router")  # version 2.0 beside the default 1.0
        yield server
    finally:
        assert server.stop() == 0, server.log()


def call(server: ServerProcess, method: str, path: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None, key: bool = True) -> tuple[int, http.client.HTTPResponse, bytes]:
    """One request on a fresh connection (``body`` a dict is sent as JSON); returns (status, response, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=30)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key:
            sent["Authorization"] = f"Bearer {read_key(server.key_file, 'inference')}"
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return response.status, response, response.read()
    finally:
        conn.close()


def openai_error(body: bytes) -> dict:
    """OpenAI's error object, checked for its shape."""
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    return parsed["error"]


def client(server: ServerProcess, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.status['http_port']}/v1", max_retries=0, timeout=30,
                         api_key=key or read_key(server.key_file, "inference"))


# ------------------------------------------------------------- TorchServe's url_path
def test_url_path_reaches_the_handler(srv):
    for path, url_path in (("/predictions/router/1.0/v1/chat/completions", "v1/chat/completions"),
                           ("/predictions/router/2.0/v1/models", "v1/models"),
                           ("/predictions/router/1.0/v1/completions", "v1/completions")):
        status, _, body = call(srv, "POST", path, b'{"prompt": "x"}')
        assert status == 200, body
        assert json.loads(body) == {"url_path": url_path, "body": '{"prompt": "x"}'}
    # the shorter forms carry an empty url_path, as TorchServe's, whatever header the client sent
    for path in ("/predictions/router", "/predictions/router/1.0"):
        status, _, body = call(srv, "POST", path, b"plain", headers={"url_path": "v1/models"})
        assert (status, json.loads(body)) == (200, {"url_path": "", "body": "plain"})
    # the handler's own 404 for a path it does not serve, in TorchServe's JSON
    status, _, body = call(srv, "POST", "/predictions/router/1.0/v1/embeddings", b"x")
    assert status == 404 and json.loads(body)["message"] == "Unknown API endpoint: v1/embeddings"
    # an unknown version is the server's 404, never the handler's
    status, _, body = call(srv, "POST", "/predictions/router/9.9/v1/models", b"x")
    assert status == 404 and json.loads(body)["type"] == "ModelNotFoundException"


# ------------------------------------------------------------- what the handler receives
def test_openai_request_becomes_the_llm_handler_request(srv):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    status, response, body = call(srv, "POST", "/v1/chat/completions", {
        **CHAT, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts},
                             {"role": "assistant", "content": None}],
        "max_tokens": 7, "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n",
        "n": 1, "frequency_penalty": 0, "logprobs": False, "user": "someone", "metadata": {"a": "b"},
        "ignore_eos": True, "X-extra": 1})
    assert status == 200, body
    assert response.getheader("Content-Type").startswith("application/json")
    assert response.getheader("x-ignored-fields") == "X-extra"  # served, as vLLM serves it, and said so
    assert "ignored unknown field(s) X-extra" in srv.log()
    answer = json.loads(body)
    assert answer["object"] == "chat.completion" and answer["model"] == "router"
    assert answer["id"].startswith("chatcmpl-") and isinstance(answer["created"], int)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    seen = json.loads(choice["message"]["content"])  # the route handler answers what it got
    assert seen["url_path"] is None
    assert json.loads(seen["body"]) == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                     {"role": "assistant", "content": ""}],
        "include_usage": True, "max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"],
        "ignore_eos": True, "frequency_penalty": 0.0, "logprobs": False}  # what the client set, neutral values too
    assert answer["usage"] is None  # a handler that reports no token counts
    # completions: the prompt as raw text, OpenAI's default of 16 tokens; name/version picks a version
    status, _, body = call(srv, "POST", "/v1/completions", {"model": "router/2.0", "prompt": ["Once"]})
    answer = json.loads(body)
    assert status == 200 and answer["object"] == "text_completion" and answer["model"] == "router/2.0"
    assert json.loads(json.loads(answer["choices"][0]["text"])["body"]) == {
        "prompt": "Once", "include_usage": True, "max_new_tokens": 16}


def test_streaming_from_a_plain_handler(srv):
    """A handler without intermediate messages: the whole answer is one chunk, then the end."""
    with client(srv).chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert json.loads(chunks[1].choices[0].delta.content)["url_path"] is None
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].delta.content is None
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_handler_messages_stream_as_chunks_and_a_late_error_as_an_event(srv):
    request = {"model": "router", "prompt": "parts:3", "stream": True}
    chunks = list(client(srv).completions.create(**request))
    assert [c.choices[0].text for c in chunks[:3]] == ["p0 ", "p1 ", "p2 "]
    assert json.loads(chunks[3].choices[0].text)["body"].startswith('{"prompt": "parts:3"')
    assert chunks[3].choices[0].finish_reason == "stop" and len(chunks) == 4
    # an error after the first chunk: the status line is gone, an error event ends the stream
    status, response, body = call(srv, "POST", "/v1/completions", {**request, "prompt": "parts:2 raise"})
    assert status == 200 and response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    events = body.decode().split("\n\n")
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["p0 ", "p1 "]
    assert json.loads(events[2][6:]) == {"error": {"message": "failed mid-stream", "type": "server_error",
                                                   "param": None, "code": "handler_error"}}
    assert events[3:] == [""]  # no [DONE]
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        list(client(srv).completions.create(**{**request, "prompt": "parts:2 raise"}))
    # before the first message, the same failure has its own status
    with pytest.raises(openai.InternalServerError, match="failed mid-stream"):
        list(client(srv).completions.create(**{**request, "prompt": "parts:0 raise"}))


def test_models_list_and_retrieve(srv):
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["busy", "busy/1.0", "router", "router/1.0", "router/2.0"]
    assert all(m.object == "model" and m.owned_by == "inference-service" and m.created > 0 for m in models.data)
    assert {getattr(m, "state", None) for m in models.data} == {"READY"}  # an addition: the sleep state
    assert client(srv).models.retrieve("router/2.0").id == "router/2.0"
    with pytest.raises(openai.NotFoundError):
        client(srv).models.retrieve("router/7.0")


# ------------------------------------------------------------- errors, in OpenAI's shape
def test_key_is_required_and_answered_as_openai_does(srv):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing")):
            status, response, body = call(srv, method, path, CHAT, headers=headers, key=False)
            assert status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
            error = openai_error(body)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as err:
        client(srv, key="wrong").chat.completions.create(**CHAT)
    assert err.value.code == "invalid_api_key"
    # the TorchServe routes keep TorchServe's 401 body
    status, _, body = call(srv, "POST", "/predictions/router", b"x", key=False)
    assert status == 401 and json.loads(body)["type"] == "InvalidKeyException"


@pytest.mark.parametrize("body,param,fragment", [
    (b"{not json", None, "could not parse the JSON body"),
    (b"[1, 2]", None, "object"),
    ({"messages": CHAT["messages"]}, "model", "Field required"),
    ({"model": "router", "messages": []}, "messages", "at least 1"),
    ({**CHAT, "temperature": "hot"}, "temperature", "number"),
    ({**CHAT, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "stream": "yes"}, "stream", "boolean"),
    ({**CHAT, "n": 17}, "n", "'n' must be between 1 and 16, got 17"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs' must be between 0 and 20"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]", "'tools[0]' must be"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object or json_schema"),
    ({**CHAT, "stop": [1]}, "stop[0]", "string"),
    ({**CHAT, "priority": "high"}, "priority", "integer"),
    # the LLM request's own limits (contracts/sampling.py), checked at the door
    ({**CHAT, "max_tokens": 4097}, "max_tokens", "'max_new_tokens' must be between 1 and 4096, got 4097"),
    ({**CHAT, "max_completion_tokens": 5000}, "max_completion_tokens", "'max_new_tokens' must be between 1"),
    ({**CHAT, "stop": ["x"] * 17}, "stop", "'stop' may hold at most 16 strings, got 17"),
    ({"model": "router", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "Input should be"),
    ({"model": "router", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text content parts are supported, got 'image_url'"),
])
def test_bad_chat_requests_are_400(srv, body, param, fragment):
    status, _, answer = call(srv, "POST", "/v1/chat/completions", body)
    error = openai_error(answer)
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), error
    assert fragment in error["message"], error


@pytest.mark.parametrize("body,param", [
    ({"model": "router", "prompt": []}, "prompt"),
    ({"model": "router", "prompt": [1, 2, 3]}, "prompt"),
    ({"model": "router", "prompt": ""}, "prompt"),
    ({"model": "router", "prompt": ["a", ""]}, "prompt"),
    ({"model": "router", "prompt": "x", "echo": True, "logprobs": 0}, "echo"),
    ({"model": "router", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"model": "router", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"model": "router", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "router", "prompt": ["x"] * 5, "n": 16}, "prompt"),
])
def test_bad_completion_requests_are_400(srv, body, param):
    status, _, answer = call(srv, "POST", "/v1/completions", body)
    assert (status, openai_error(answer)["param"]) == (400, param)


def test_choices_fan_out_one_handler_request_each(srv):
    """n choices: n handler requests, seeded seed, seed + 1, ...; a list of prompts: n choices each,
    indexed prompt index * n + i; echo starts each text with its prompt (the official client reads them)."""
    answer = client(srv).chat.completions.create(**CHAT, n=3, seed=7, temperature=0.5)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    seen = [json.loads(json.loads(c.message.content)["body"]) for c in answer.choices]
    assert [s["seed"] for s in seen] == [7, 8, 9] and all("n" not in s for s in seen)
    batch = client(srv).completions.create(model="router", prompt=["first", "second"], n=2, echo=True)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    prompts = [c.text[:c.text.index("{")] for c in batch.choices]
    assert prompts == ["first", "first", "second", "second"]
    assert [json.loads(json.loads(c.text[len(p):])["body"])["prompt"] for c, p in zip(batch.choices, prompts,
                                                                                          strict=True)] == prompts
    # streamed: every choice opens with the assistant role and ends with its own finish reason
    with client(srv).chat.completions.create(**CHAT, n=2, stream=True) as stream:
        chunks = list(stream)
    roles = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant")
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "stop")
    assert roles == ends == [0, 1]
    # a TorchServe door streams one answer: n above 1 is refused there by the LLM handler (tests/e2e)


def test_tokenizer_routes_reach_the_models_handler(srv):
    """vLLM's /tokenize and /detokenize: the request kind the LLM handler answers, sent to the model's worker."""
    status, response, body = call(srv, "POST", "/tokenize", {"model": "router", "prompt": "hi", "typo": 1})
    assert status == 200 and response.getheader("x-ignored-fields") == "typo"
    assert json.loads(json.loads(body)["body"]) == {"tokenize": {"prompt": "hi", "add_special_tokens": True,
                                                                 "return_token_strs": False}}
    status, response, _ = call(srv, "POST", "/v1/completions", {"model": "router", "prompt": "x",
                                                                "a\r\nSet-Cookie: x": 1, "é": 2})
    assert status == 200 and response.getheader("x-ignored-fields") == "'a\\r\\nSet-Cookie: x', '\\xe9'"
    assert response.getheader("Set-Cookie") is None
    status, _, body = call(srv, "POST", "/detokenize", {"model": "router", "tokens": [1, 2]})
    assert status == 200 and json.loads(json.loads(body)["body"]) == {"detokenize": {"tokens": [1, 2]}}
    for path, sent, param in (("/tokenize", {"model": "router"}, None),
                              ("/tokenize", {"model": "router", "prompt": "x", "messages": CHAT["messages"]}, None),
                              ("/detokenize", {"model": "router", "tokens": [-1]}, "tokens"),
                              ("/detokenize", {"model": "nope", "tokens": [1]}, "model"),
                              ("/detokenize", {"tokens": [1]}, "model")):
        status, _, body = call(srv, "POST", path, sent)
        assert status in (400, 404) and openai_error(body)["param"] == param, body
    status, _, body = call(srv, "POST", "/tokenize", {"model": "router", "prompt": "x"}, key=False)
    assert status == 401 and openai_error(body)["code"] == "invalid_api_key"


def test_unknown_model_path_method_and_size(srv):
    with pytest.raises(openai.NotFoundError) as err:
        client(srv).chat.completions.create(**{**CHAT, "model": "nope"})
    assert (err.value.code, err.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client(srv).completions.create(model="router/9.9", prompt="x")
    status, _, body = call(srv, "POST", "/v1/audio/speech", {"model": "router", "input": "x"})
    assert status == 404 and openai_error(body)["message"] == "Invalid URL (POST /v1/audio/speech)"
    status, response, body = call(srv, "GET", "/v1/chat/completions")
    assert status == 405 and openai_error(body)["type"] == "invalid_request_error"
    assert response.getheader("Allow") == "POST"
    status, _, body = call(srv, "POST", "/v1/chat/completions", {**CHAT, "pad": "x" * 20000})
    assert status == 413 and "max_request_size=16384" in openai_error(body)["message"]


def test_handler_status_is_answered_in_openai_shape(srv):
    """A status the handler sets keeps its HTTP status, in OpenAI's shape (the LLM handler's 400s go this way)."""
    for code, error_type in ((400, "invalid_request_error"), (503, "server_error"), (418, "invalid_request_error")):
        status, response, body = call(srv, "POST", "/v1/completions", {"model": "router", "prompt": f"status:{code}"})
        error = openai_error(body)
        assert (status, error["type"], error["code"], error["message"]) == (
            code, error_type, "handler_status", "handler says no")
        assert response.getheader("Retry-After") == ("1" if code == 503 else None)
    with pytest.raises(openai.BadRequestError):
        client(srv).chat.completions.create(model="router", messages=[{"role": "user", "content": "status:400"}])


def test_full_queue_is_429_and_no_worker_is_503(srv):
    """busy: one worker, batchSize 1, jobQueueSize 1: one running, one waiting, the third is refused."""
    done: list[str] = []

    def ask(content: str) -> None:
        done.append(client(srv).chat.completions.create(
            model="busy", messages=[{"role": "user", "content": content}]).choices[0].message.content)

    threads = [threading.Thread(target=ask, args=("sleep:3",))]
    threads[0].start()
    srv.wait_busy("busy", 1, pending=0)
    threads.append(threading.Thread(target=ask, args=("second",)))
    threads[1].start()
    srv.wait_busy("busy", 1, pending=1)
    with pytest.raises(openai.RateLimitError) as err:
        client(srv).chat.completions.create(model="busy", messages=[{"role": "user", "content": "third"}])
    assert err.value.code == "job_queue_full" and err.value.type == "rate_limit_error"
    assert err.value.response.headers["Retry-After"] == "1"
    for thread in threads:
        thread.join(30)
    assert len(done) == 2
    # a version with no worker: 503, retryable
    srv.register("router_v2.mar", model_name="idle", initial_workers=0)
    with pytest.raises(openai.InternalServerError) as err:
        client(srv).completions.create(model="idle", prompt="x")
    assert err.value.status_code == 503 and err.value.code == "no_worker"
    assert err.value.response.headers["Retry-After"] == "5"
    srv.unregister("idle")
    wait_for(lambda: "idle" not in [m.id for m in client(srv).models.list().data], what="idle unregistered")


def test_frontend_log_has_no_traceback(srv):
    """Every failure above was answered, none escaped (the workers log the handler's own exceptions)."""
    frontend = [line for line in srv.log().splitlines()
                if "inference_service.worker." not in line and "inference_service.access:" not in line]
    assert not [line for line in frontend if "Traceback" in line or "ERROR" in line]

