"""``engine: llamacpp`` end to end: GGUF files served as they are by llama.cpp (``scripts/install
--engine llamacpp``), through the real server, checked against llama.cpp's own generation
(``llama_cpp.Llama``, one request, in a process of its own) on the same file.

Two models: the bundled SmolLM2-135M-Instruct (Q4_1, Llama architecture) and Gemma 3 270M (the base
model, Q4_K_M: a K-quant OpenVINO GenAI cannot read, and whose conversion to transformers garbles
it), given a chat template with ``--chat-template``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
from llm_models import build_llm_archive, gemma3_gguf
from test_chat_template import _post  # the same authorized JSON POST

from conftest import ROOT, read_key, serving
from inference_service.llm.model import find_default_gguf

pytestmark = [pytest.mark.slow, pytest.mark.external]  # llama.cpp's binding, compiled by scripts/install

#: Gemma's turn format (its instruction-tuned models' template), for the base model that has none.
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PROMPT = "The capital of France is"

#: llama.cpp's own greedy completion of a prompt (its high-level API, one sequence).
REFERENCE = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False, seed=0)
out = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0, top_k=1, repeat_penalty=1.0)
print(json.dumps(out["choices"][0]["text"]))
"""


def llama_cpp_greedy(gguf: Path, prompt: str, tokens: int) -> str:
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(gguf), prompt, str(tokens)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gemma() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gemma: Path):
    pytest.importorskip("llama_cpp", reason="run scripts/install --engine llamacpp (scripts/test does)")
    store = tmp_path_factory.mktemp("llamacpp_store")
    template = store.parent / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE, encoding="utf-8")
    build_llm_archive(store, "--engine", "llamacpp", "--name", "smol_cpp", "--batch-size", "4")
    # as a new user builds it: the defaults, the GGUF inside the archive
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                            "--gguf-file", str(gemma), "--name", "gemma3", "--chat-template", str(template),
                            "--batch-size", "4"], capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stderr
    assert "engine llamacpp: the GGUF as it is" in built.stderr, built.stderr
    size_mb = gemma.stat().st_size / 1e6
    assert f"writing gemma3.mar with the model inside ({size_mb:.0f} MB)" in built.stderr, built.stderr
    with zipfile.ZipFile(store / "gemma3.mar") as archive:
        member = archive.getinfo(f"model/{gemma.name}")
        assert member.file_size == gemma.stat().st_size and member.compress_type == zipfile.ZIP_STORED
        config = archive.read("model-config.yaml").decode()
    assert f'model_path: "model/{gemma.name}"' in config and "engine: llamacpp" in config, config
    with serving(tmp_path_factory.mktemp("llamacpp_work"), store, ["smol_cpp", "gemma3"]) as srv:
        yield srv


def _complete(srv: Any, model: str, prompt: str, **fields: Any) -> dict[str, Any]:
    status, body = _post(srv, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0, **fields})
    assert status == 200, body
    return body


@pytest.mark.parametrize("model", ["smol_cpp", "gemma3"])
def test_greedy_text_is_llama_cpps_own_on_the_same_file(server, gemma, model):
    gguf = find_default_gguf() if model == "smol_cpp" else gemma
    expected = llama_cpp_greedy(gguf, PROMPT, 16)
    body = _complete(server, model, PROMPT, max_tokens=16, ignore_eos=True)
    assert body["choices"][0]["text"] == expected, (body, expected)
    assert body["usage"]["completion_tokens"] == 16
    if model == "gemma3":
        assert "Paris" in expected or "capital" in expected, expected  # the file served ungarbled
    engine = server.describe(model)[0]["workers"][0]["engine"]
    assert engine["name"] == "llamacpp", engine
    assert ("Q4_K" if model == "gemma3" else "Q4_1") in engine["weightFormat"], engine


def test_four_requests_at_once_are_batched_and_each_ends(server):
    results: dict[int, dict[str, Any]] = {}

    def one(i: int) -> None:
        results[i] = _complete(server, "gemma3", f"Question {i}: what is {i} plus {i}? Answer:", max_tokens=24,
                               ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["usage"]["completion_tokens"] == 24 and r["choices"][0]["text"] for r in results.values())
    # alone afterwards, the first prompt's greedy text begins as it did in the batch (batched decoding
    # changes the float sums, so only a prefix is held equal)
    alone = _complete(server, "gemma3", "Question 0: what is 0 plus 0? Answer:", max_tokens=24, ignore_eos=True)
    assert alone["choices"][0]["text"][:8] == results[0]["choices"][0]["text"][:8]


def test_chat_with_the_given_template(server):
    status, body = _post(server, "/v1/chat/completions", {
        "model": "gemma3", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].strip(), body
    assert body["usage"]["prompt_tokens"] > 8
    engine = server.describe("gemma3")[0]["workers"][0]["engine"]
    assert engine["chatTemplate"] == "chat_template.jinja (handler config 'chat_template')", engine


def test_sampling_stop_logprobs_and_structured_outputs(server):
    seeded = {"max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    first = _complete(server, "smol_cpp", PROMPT, **seeded)["choices"][0]["text"]
    assert _complete(server, "smol_cpp", PROMPT, **seeded)["choices"][0]["text"] == first

    body = _complete(server, "smol_cpp", PROMPT, max_tokens=8, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"] and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(top) == 3 for top in lp["top_logprobs"])

    whole = _complete(server, "smol_cpp", PROMPT, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    stop = whole.split()[1]
    cut = _complete(server, "smol_cpp", PROMPT, max_tokens=16, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"] and whole.startswith(cut["text"])

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    status, body = _post(server, "/v1/chat/completions", {
        "model": "smol_cpp", "messages": [{"role": "user", "content": "Name the capital of France as JSON."}],
        "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert status == 200, body
    answer = json.loads(body["choices"][0]["message"]["content"])
    assert isinstance(answer["city"], str) and len(answer["city"]) <= 20


def test_a_cancelled_stream_frees_its_sequence_and_the_worker_serves_on(server):
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.status['http_port']}/v1/completions",
        json.dumps({"model": "gemma3", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                    "stream": True}).encode(),
        {"Authorization": f"Bearer {read_key(server.key_file, 'inference')}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.readline().startswith(b"data: ")
    # the stream's client is gone: the next requests are served, and the engine holds no sequence after
    body = _complete(server, "gemma3", PROMPT, max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status['metrics_port']}/metrics", timeout=30) as r:
        text = r.read().decode()
    running = [line for line in text.splitlines()
               if line.startswith("vllm:num_requests_running") and 'model_name="gemma3"' in line]
    assert running and all(line.rsplit(" ", 1)[1] in ("0", "0.0") for line in running), running


def test_a_folder_is_refused_by_the_llamacpp_archive_builder(tmp_path, tiny_llama):
    done = subprocess.run([sys.executable, "scripts/build_llm_archive", "--model-store", str(tmp_path),
                           "--engine", "llamacpp", "--model-path", str(tiny_llama)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1 and "--engine llamacpp serves a GGUF file" in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.mar"))


def test_a_conversion_that_differs_from_llama_cpp_is_refused_with_its_figures(tmp_path, gemma):
    """transformers reads Gemma 3's GGUF tokenizer unlike llama.cpp: converted, it would answer garbled."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store",
                           str(tmp_path / "store"), "--engine", "torch", "--gguf-file", str(gemma), "--name", "conv",
                           "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 1, done.stderr
    assert "tokenizes 4 of 4 committed texts unlike llama.cpp" in done.stderr, done.stderr
    assert "serve the file as it is with --engine llamacpp" in done.stderr, done.stderr
    assert not list((tmp_path / "store").glob("*.mar"))
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith(".")]
