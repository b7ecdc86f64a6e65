"""A chat template for a model that has none (issue 47 item 4): ``build_llm_archive --chat-template
FILE`` carries a Jinja template in the archive, the handler renders ``messages`` with it, and
DescribeModel and ``/v1/models`` say which template is used; without one, chat is refused with a
400 naming the option. Through the real server, with the tiny Llama stripped of its template
(the torch engine: the template is the handler's, the same on every engine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from llm_models import ROOT, build_llm_archive

from conftest import read_key, serving

pytestmark = pytest.mark.slow  # one server, two archives of the tiny model

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """The tiny Llama, its tokenizer without a chat template."""
    target = tmp_path_factory.mktemp("untemplated") / "tiny-base"
    shutil.copytree(tiny_llama, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, untemplated: Path):
    store = tmp_path_factory.mktemp("template_store")
    template = store.parent / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    build_llm_archive(store, "--model-path", str(untemplated), "--engine", "torch", "--name", "base")
    build_llm_archive(store, "--model-path", str(untemplated), "--engine", "torch", "--name", "templated",
                      "--chat-template", str(template))
    with serving(tmp_path_factory.mktemp("template_work"), store, ["base", "templated"]) as srv:
        yield srv


def _post(srv: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.status['http_port']}{path}", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}",
                                      "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get(srv: Any, path: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.status['http_port']}{path}",
                                     headers={"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_a_model_without_a_template_refuses_chat_naming_the_option(server):
    status, body = _post(server, "/v1/chat/completions", {"model": "base", "messages": MESSAGES, "max_tokens": 4})
    assert status == 400, body
    assert "no chat template" in body["error"]["message"] and "'chat_template'" in body["error"]["message"] \
        and "--chat-template FILE" in body["error"]["message"], body
    status, body = _post(server, "/v1/completions", {"model": "base", "prompt": "Hello", "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    engine = server.describe("base")[0]["workers"][0]["engine"]
    assert engine["chatTemplate"] == "none: chat is refused (set 'chat_template' in the handler config)", engine


def test_the_archives_template_renders_chat_and_is_named(server, untemplated: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(untemplated))
    rendered = "<<user>> What is the capital of France?\n<<assistant>> "
    status, body = _post(server, "/v1/chat/completions", {"model": "templated", "messages": MESSAGES,
                                                          "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    assert body["usage"]["prompt_tokens"] == len(tokenizer(rendered, add_special_tokens=False)["input_ids"]), body
    status, body = _post(server, "/tokenize", {"model": "templated", "messages": MESSAGES})
    assert status == 200, body
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"], body
    named = "chat_template.jinja (handler config 'chat_template')"
    assert server.describe("templated")[0]["workers"][0]["engine"]["chatTemplate"] == named
    cards = {card["id"]: card for card in _get(server, "/v1/models")["data"]}
    assert cards["templated"]["chat_template"] == named and cards["base"]["chat_template"].startswith("none"), cards


def test_a_chat_template_file_that_cannot_be_read_is_refused_before_building(tmp_path, untemplated: Path):
    for given, words in ((tmp_path / "missing.jinja", "cannot read it"), (tmp_path / "empty.jinja", "non-empty")):
        if "empty" in given.name:
            given.write_text("  \n", encoding="utf-8")
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store",
                                 str(tmp_path / "store"), "--model-path", str(untemplated), "--engine", "torch",
                                 "--chat-template", str(given)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and f"error: --chat-template {given}: " in result.stderr \
            and words in result.stderr, result.stderr
        assert not list((tmp_path / "store").glob("*.mar"))
