"""OpenVINO IR made where it is promised: an archive without an IR, served with an empty cache, is
converted once by its worker (which runs without torch; the exporter has its own environment)
and answers; another registration of the same archive finds the IR by its content; unregistering
during the conversion leaves no exporter process and no temporary directory."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import grpc
import pytest

from conftest import ROOT, ServerProcess, wait_for
from inference_service._proto import inference_pb2

pytestmark = [pytest.mark.llm, pytest.mark.slow]

QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 24}
CONVERTING = "to OpenVINO IR (fp32), once"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference_service.llm.model import prepare_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_gguf()), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    target = tmp_path_factory.mktemp("models") / "tiny"
    LlamaForCausalLM(config).save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def _archive_without_ir(store: Path, name: str, *args: str) -> Path:
    """An OpenVINO-engine archive of ``name`` that carries no IR: built for the torch engine
    (no conversion at build), its config then switched to ``engine: openvino`` in fp32."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--name", name, "--engine", "torch", *args], check=True, timeout=600, capture_output=True)
    archive = store / f"{name}.mar"
    with zipfile.ZipFile(archive) as mar:
        members = {info.filename: mar.read(info) for info in mar.infolist()}
    config = members["model-config.yaml"].decode()
    assert "  engine: torch\n" in config
    members["model-config.yaml"] = config.replace("  engine: torch\n",
                                                  "  engine: openvino\n  weight_format: fp32\n").encode()
    with zipfile.ZipFile(archive, "w") as mar:
        for member, data in members.items():
            mar.writestr(member, data)
    return archive


def _answer(srv: ServerProcess, model: str) -> str:
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(QUESTION).encode()})
    return "".join(r.prediction.decode() for r in srv.inference.StreamPredictions(req, timeout=300))


def _cache_entries(cache: Path) -> tuple[list[str], list[str]]:
    """``(IR directories, temporary directories)`` under the cache's ``openvino`` folder."""
    root = cache / "openvino"
    names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [n for n in names if not n.startswith(".")], [n for n in names if ".tmp-" in n]


def _exporters(srv: ServerProcess) -> set[int]:
    """Processes under the server running the exporter."""
    found = set()
    for pid in srv.worker_pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"inference_service.llm.ir_export" in cmdline:
            found.add(pid)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(1200)
def test_an_archive_without_an_ir_is_converted_at_load_and_answers(tmp_path):
    """The archive names no model directory: its worker, which imports no torch, converts the bundled
    GGUF (in a child process that may) and then exports the IR, into an empty cache."""
    from inference_service.llm.model import prepare_gguf

    store, cache = tmp_path / "store", tmp_path / "empty-cache"
    archive = _archive_without_ir(store, "smollm2", "--model-path", str(prepare_gguf()))
    with zipfile.ZipFile(archive) as mar:
        members = {info.filename: mar.read(info) for info in mar.infolist()}
    config = members["model-config.yaml"].decode()
    members["model-config.yaml"] = "".join(line for line in config.splitlines(True)
                                           if "model_path:" not in line).encode()
    with zipfile.ZipFile(archive, "w") as mar:
        for member, data in members.items():
            mar.writestr(member, data)
    srv = ServerProcess(tmp_path / "work", store, ["--models", "smollm2=smollm2.mar"],
                        env={"INFERENCE_SERVICE_CACHE": str(cache)})
    try:
        srv.wait_workers("smollm2", 1, timeout=1000)
        assert "Paris" in _answer(srv, "smollm2")
        log = srv.log()
        assert log.count(CONVERTING) == 1, log
        assert "None of PyTorch" not in log and "Traceback" not in log, log
        irs, temporary = _cache_entries(cache)
        assert len(irs) == 1 and irs[0].startswith("SmolLM2-135M-Instruct-fp32-") and not temporary
        assert (cache / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()  # the GGUF, converted here
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.timeout(900)
def test_two_registrations_of_one_archive_convert_once(tiny, tmp_path):
    store, cache = tmp_path / "store", tmp_path / "empty-cache"
    _archive_without_ir(store, "tiny", "--model-path", str(tiny), "--self-contained")
    srv = ServerProcess(tmp_path / "work", store, ["--enable-model-api"],
                        env={"INFERENCE_SERVICE_CACHE": str(cache)})
    try:
        srv.register("tiny.mar", timeout=600)
        assert _answer(srv, "tiny")  # random weights: some text
        srv.unregister("tiny")
        srv.register("tiny.mar", timeout=600)  # extracted again, elsewhere: the same files
        assert _answer(srv, "tiny")
        log = srv.log()
        assert log.count(CONVERTING) == 1, log
        irs, temporary = _cache_entries(cache)
        assert len(irs) == 1 and not temporary
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.timeout(900)
def test_unregistering_during_the_conversion_leaves_no_exporter_and_no_temporary_directory(tiny, tmp_path):
    store, cache = tmp_path / "store", tmp_path / "empty-cache"
    _archive_without_ir(store, "tiny", "--model-path", str(tiny), "--self-contained")
    srv = ServerProcess(tmp_path / "work", store, ["--enable-model-api"],
                        env={"INFERENCE_SERVICE_CACHE": str(cache)})
    try:
        srv.register("tiny.mar", synchronous=False)
        exporters = wait_for(lambda: _exporters(srv), 300, 0.05, "the exporter runs")
        wait_for(lambda: _cache_entries(cache)[1], 60, 0.05, "the exporter's temporary directory")
        srv.unregister("tiny")
        wait_for(lambda: not any(_running(pid) for pid in exporters), 30, 0.05, "the exporter ends")
        wait_for(lambda: not _cache_entries(cache)[1], 30, 0.05, "the temporary directory is removed")
        assert _cache_entries(cache) == ([], [])
        with pytest.raises(grpc.RpcError) as gone:
            srv.describe("tiny")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        assert srv.stop() == 0, srv.log()


def _ir_archive(store: Path, name: str, config: dict | None, tokenizer: bool = True) -> str:
    """A model directory in ``store`` whose handler config names a made-up IR directory."""
    ir = store / f"{name}-ir"
    ir.mkdir(parents=True)
    (ir / "openvino_model.xml").write_text("<net/>")  # never read: the checks come first
    (ir / "openvino_model.bin").write_bytes(b"\0" * 64)
    if config is not None:
        (ir / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (ir / "tokenizer.json").write_text("{}")
    target = store / name
    (target / "MAR-INF").mkdir(parents=True)
    (target / "llm_handler.py").write_text("from inference_service.llm.handler import LLMHandler\n\n\n"
                                           "class IRHandler(LLMHandler):\n    pass\n")
    (target / "model-config.yaml").write_text(f"handler:\n  engine: openvino\n  model_path: {json.dumps(str(ir))}\n")
    (target / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"runtime": "python", "model": {
        "modelName": name, "handler": "llm_handler.py", "modelVersion": "1.0", "configFile": "model-config.yaml"}}))
    return name


def test_an_ir_directory_with_a_bad_value_or_no_tokenizer_fails_its_load_by_name(tmp_path):
    store = tmp_path / "store"
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}
    cases = {
        _ir_archive(store, "bad_context", {**config, "max_position_embeddings": -5}):
            "config.json: 'max_position_embeddings' must be a positive integer up to 16,777,216, got -5",
        _ir_archive(store, "bad_layers", {**config, "num_hidden_layers": 2.5}):
            "config.json: 'num_hidden_layers' must be a positive integer, got 2.5",
        _ir_archive(store, "no_tokenizer", config, tokenizer=False):
            "has no tokenizer (tokenizer.json or tokenizer_config.json)",
        _ir_archive(store, "no_config", None): "has no config.json",
    }
    srv = ServerProcess(tmp_path / "work", store, ["--enable-model-api"])
    try:
        for name, message in cases.items():
            with pytest.raises(grpc.RpcError) as failed:
                srv.register(name, timeout=120)
            details = failed.value.details() or ""
            assert message in details and str(store / f"{name}-ir") in details, details
        assert "AttributeError" not in srv.log() and "Traceback" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_an_ir_is_held_to_transformers_before_it_is_kept(tiny, tmp_path_factory):
    """Issue 47 item 2: a transformers folder's IR passes the check (fp32: 16 greedy tokens of
    every prompt equal; int8: each first token within the bar) and records its figures; an IR
    that says something else than the folder (here another model's) is refused with the figures
    and the next step, by the check's own process."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from inference_service.llm import ir_check
    from inference_service.llm.model import ModelPreparationError
    from inference_service.llm.openvino_ir import exporter_environment, prepare_ir

    cache = tmp_path_factory.mktemp("checked_ir")
    for weight_format in ("fp32", "int8"):
        ir_dir, seconds = prepare_ir(tiny, weight_format, cache)
        assert seconds is not None
        record = json.loads((ir_dir / "inference_service_ir.json").read_text())
        assert record["check"].startswith("tokenization equal on 4 texts; "), record
        if weight_format == "fp32":
            assert "all 16 greedy tokens of 4 prompts equal" in record["check"], record
        else:
            assert "the first greedy token of 4 prompts within 1 nats" in record["check"], record
    other = tmp_path_factory.mktemp("models") / "other"
    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(str(tiny))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.save_pretrained(str(other))
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(str(other))
    fp32_ir, _ = prepare_ir(tiny, "fp32", cache)
    with pytest.raises(ModelPreparationError) as refused:
        ir_check.checked(other, fp32_ir, "fp32", exporter_environment(), 600)
    message = str(refused.value)
    assert "differs from transformers: its 16 greedy tokens of 'The capital of France is' are" in message, message
    assert message.endswith(ir_check.NEXT_STEP), message
