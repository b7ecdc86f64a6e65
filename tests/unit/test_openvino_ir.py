"""The OpenVINO IR cache without running the exporter: keyed by content, trimmed by last use,
leftovers removed, the exporter's environment and failure reason, and the checks of an IR
directory at load (tests/e2e/test_llm_conversion.py runs the exporter itself)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from inference_service.llm.model import ModelPreparationError
from inference_service.llm.openvino_ir import (
    MAX_CONTEXT_LENGTH,
    _remove_leftovers,
    evict,
    export_command,
    exporter_environment,
    failure_reason,
    ir_cache_dir,
    prepare_ir,
    read_ir_config,
)

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 32, "max_position_embeddings": 2048, "vocab_size": 49152}


def _model(path: Path, weights: bytes = b"\0" * 4096) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def _ir(path: Path, config: object = CONFIG, tokenizer: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "openvino_model.xml").write_text("<net/>")
    (path / "openvino_model.bin").write_bytes(b"\0" * 64)
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def test_the_cache_is_keyed_by_content_not_by_path(tmp_path):
    one = _model(tmp_path / "extracted-1" / "model")
    two = tmp_path / "extracted-2" / "model"
    shutil.copytree(one, two)
    os.utime(two / "model.safetensors", (1, 1))  # another extraction: other times, same bytes
    assert ir_cache_dir(one, "int8", tmp_path) == ir_cache_dir(two, "int8", tmp_path)
    assert ir_cache_dir(one, "int8", tmp_path).name.startswith("model-int8-")
    assert ir_cache_dir(one, "int8", tmp_path) != ir_cache_dir(one, "fp32", tmp_path)
    renamed = tmp_path / "My Model"
    shutil.copytree(one, renamed)
    assert ir_cache_dir(renamed, "int8", tmp_path).name.startswith("My-Model-int8-")  # none yet: its own name
    _ir(ir_cache_dir(one, "int8", tmp_path))
    assert ir_cache_dir(renamed, "int8", tmp_path) == ir_cache_dir(one, "int8", tmp_path)  # then the IR made
    (two / "model.safetensors").write_bytes(b"\1" + b"\0" * 4095)  # same size, other weights
    assert ir_cache_dir(one, "int8", tmp_path) != ir_cache_dir(two, "int8", tmp_path)


def test_large_weights_are_told_apart_by_their_samples(tmp_path):
    size = 40 << 20  # over the whole-hash limit: sampled at the start, middle and end
    one = _model(tmp_path / "a", b"\0" * size)
    two = _model(tmp_path / "b", b"\0" * (size // 2) + b"\1" + b"\0" * (size // 2 - 1))
    assert ir_cache_dir(one, "int8", tmp_path) != ir_cache_dir(two, "int8", tmp_path)


def test_a_cached_ir_is_used_without_converting(tmp_path):
    model = _model(tmp_path / "model")
    target = ir_cache_dir(model, "fp32", tmp_path / "cache")
    _ir(target)
    assert prepare_ir(model, "fp32", tmp_path / "cache") == (target, None)
    with pytest.raises(ModelPreparationError, match="weight format 'nf4' is not offered"):
        prepare_ir(model, "nf4", tmp_path / "cache")


def test_leftovers_of_an_ended_conversion_are_removed(tmp_path):
    target = tmp_path / "openvino" / "tiny-int8-0123456789ab"
    stale = tmp_path / "openvino" / f".{target.name}.tmp-k2j3h4"
    (stale / "sub").mkdir(parents=True)
    renamed = tmp_path / "openvino" / ".model-int8-0123456789ab.tmp-a"  # the same key under another name
    renamed.mkdir()
    other = tmp_path / "openvino" / ".tiny-fp32-ba9876543210.tmp-x"  # another key's: not this call's
    other.mkdir()
    target.mkdir()
    (target / "openvino_model.xml").write_text("<net/>")  # incomplete: no .bin, no config
    _remove_leftovers(target)
    assert not stale.exists() and not renamed.exists() and not target.exists() and other.exists()


def _aged(entry: Path, age_s: float) -> Path:
    marker = entry / "inference_service_ir.json"
    marker.write_text("{}")
    when = 1_700_000_000 - age_s
    os.utime(marker, (when, when))
    return entry


def test_eviction_removes_the_least_recently_used_irs_past_the_limit(tmp_path):
    root = tmp_path / "openvino"
    old = _aged(_ir(root / "llama-int8-000000000001"), 300)
    recent = _aged(_ir(root / "llama-int8-000000000002"), 100)
    new = _aged(_ir(root / "llama-int8-000000000003"), 0)
    orphan = root / ".llama-int8-000000000009.tmp-abc"  # no process holds its lock
    orphan.mkdir()
    entry_size = sum(p.stat().st_size for p in new.rglob("*") if p.is_file())
    removed = evict(root, keep=new, limit_bytes=2 * entry_size)
    assert set(removed) == {old, orphan}
    assert recent.exists() and new.exists()
    assert evict(root, keep=new, limit_bytes=0) == [recent]  # the kept one stays even past the limit
    assert new.exists()


def test_an_ir_being_converted_is_not_evicted(tmp_path):
    import fcntl

    root = tmp_path / "openvino"
    busy = _aged(_ir(root / "llama-int8-000000000001"), 300)
    keep = _aged(_ir(root / "llama-int8-000000000002"), 0)
    tmp = root / ".llama-int8-000000000001.tmp-abc"
    tmp.mkdir()
    with open(root / ".int8-000000000001.lock", "a+b") as lock:  # the key's lock, whatever the name
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        assert evict(root, keep=keep, limit_bytes=0) == []
    assert busy.exists() and tmp.exists()


def test_the_exporter_runs_with_torch_and_ends_with_its_parent(monkeypatch, tmp_path):
    monkeypatch.setenv("USE_TORCH", "0")  # what the OpenVINO worker sets for its own imports
    env = exporter_environment()
    assert "USE_TORCH" not in env and env["HF_HUB_OFFLINE"] == "1" and env["TQDM_DISABLE"] == "1"
    command = export_command(tmp_path / "model", tmp_path / "out", "int8")
    assert command[1:5] == ["-m", "inference_service.llm.ir_export", str(os.getpid()), str(tmp_path / "out")]
    assert command[5:8] == ["--", "export", "openvino"] and command[-1] == str(tmp_path / "out")


def test_int4_runs_the_calibrated_compression_and_is_keyed_by_its_recipe(monkeypatch, tmp_path):
    """``int4`` is exported by int4_export (NNCF with the committed calibration text), for a causal LM
    only; its cache key holds the recipe and the calibration text, so changing either converts again."""
    from inference_service.llm import int4_export

    command = export_command(tmp_path / "model", tmp_path / "out", "int4")
    assert command[5:] == ["--", "int4", str(tmp_path / "model"), str(tmp_path / "out")]
    with pytest.raises(ModelPreparationError, match="weight format 'int4' is not offered"):
        export_command(tmp_path / "model", tmp_path / "out", "int4", task="feature-extraction")
    texts = int4_export.calibration_texts()
    assert len(texts) >= 30 and all(texts)
    assert "model server" not in " ".join(texts).lower()  # not the perplexity text's subject
    model = _model(tmp_path / "model")
    key = ir_cache_dir(model, "int4", tmp_path)
    assert key.name.startswith("model-int4-") and key != ir_cache_dir(model, "int8", tmp_path)
    monkeypatch.setattr(int4_export, "INT4_RECIPE", int4_export.Int4Recipe(ratio=0.5, group_size=32))
    assert ir_cache_dir(model, "int4", tmp_path) != key
    monkeypatch.undo()
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("Other text.\n\nAnd more.\n")
    monkeypatch.setattr(int4_export, "CALIBRATION_FILE", calibration)
    assert ir_cache_dir(model, "int4", tmp_path) != key
    assert int4_export.calibration_texts(calibration) == ["Other text.", "And more."]


@pytest.mark.parametrize(("output", "code", "reason"), [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
     "ImportError: cannot import name 'GenerationMixin' from 'transformers.generation'\n", 1,
     "ImportError: cannot import name 'GenerationMixin' from 'transformers.generation'"),
    ("loading\nTraceback (most recent call last):\nsafetensors_rust.SafetensorError: Error while deserializing "
     "header: HeaderTooLarge\n\nsome note after it\n", 1,
     "safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge"),
    ("usage: optimum-cli\n", 2, "usage: optimum-cli"),
    ("", 3, "the exporter exited with status 3 and printed nothing"),
    ("half done", -signal.SIGTERM, "the exporter was killed by SIGTERM"),
])
def test_the_failure_reason_is_the_exporters_own_error(output, code, reason):
    assert failure_reason(output, code) == reason


def test_a_killed_exporter_names_its_peak_memory_and_the_next_step():
    reason = failure_reason("half done", -signal.SIGKILL, peak_rss=2_660_000_000)
    assert reason.startswith("the exporter was killed by SIGKILL after reaching 2.66 GB (out of memory? "), reason
    assert "--engine llamacpp" in reason and "serve the IR" in reason


def test_the_conversion_estimate_scales_with_the_parameters(tmp_path):
    """Issue 47 item 7: the estimate was SmolLM2's half a minute whatever the model."""
    from inference_service.llm.exporter_run import estimate, parameters

    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size, dtype in ((small, 540_000_000, "float32"), (large, 2_000_000_000, "bfloat16")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
        with open(folder / "model.safetensors", "wb") as f:
            f.truncate(size)  # sparse: the size is what counts
    assert (parameters(small), parameters(large)) == (135_000_000, 1_000_000_000)
    assert estimate(small, "int8") == "135M parameters, about 40 s on 2 cores"
    assert estimate(large, "int8") == "1.0B parameters, about 5 min on 2 cores"
    assert estimate(large, "int4") == "1.0B parameters, about 8 min on 2 cores"
    assert estimate(tmp_path, "int8") == "its size unknown"


def test_a_long_conversion_logs_its_progress_and_peak_memory(monkeypatch, tmp_path, caplog):
    import logging

    from inference_service.llm import exporter_run

    monkeypatch.setattr(exporter_run, "PROGRESS_S", 0.5)
    command = [sys.executable, "-c", "import time; data = bytearray(50_000_000); time.sleep(2.5); print('done')"]
    with caplog.at_level(logging.INFO, "inference_service.llm.openvino_ir"):
        code, output, peak = exporter_run.run_exporter(command, tmp_path / "model", 60)
    assert (code, output.strip()) == (0, "done") and peak > 50_000_000
    progress = [r.getMessage() for r in caplog.records if "so far, the exporter's peak memory" in r.getMessage()]
    assert len(progress) >= 2, progress
    with pytest.raises(ModelPreparationError, match="took over 1 s"):
        exporter_run.run_exporter([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "model", 1)


def test_a_complete_ir_directory_passes_its_checks(tmp_path):
    assert read_ir_config(_ir(tmp_path / "ir"))["max_position_embeddings"] == 2048


@pytest.mark.parametrize(("change", "message"), [
    ({"config": None}, "has no config.json"),
    ({"tokenizer": False}, "has no tokenizer (tokenizer.json or tokenizer_config.json)"),
    ({"config": "{not json"}, "config.json cannot be read as JSON"),
    ({"config": "[1, 2]"}, "config.json must hold a JSON object, not list"),
    ({"config": {**CONFIG, "max_position_embeddings": 0}}, "'max_position_embeddings' must be a positive integer"),
    ({"config": {**CONFIG, "max_position_embeddings": -5}}, "got -5"),
    ({"config": {**CONFIG, "max_position_embeddings": MAX_CONTEXT_LENGTH + 1}},
     f"up to {MAX_CONTEXT_LENGTH:,}, got {MAX_CONTEXT_LENGTH + 1}"),
    ({"config": {**CONFIG, "max_position_embeddings": "2048"}}, "got '2048'"),
    ({"config": {**CONFIG, "num_hidden_layers": 2.5}}, "config.json: 'num_hidden_layers' must be a positive integer"),
    ({"config": {**CONFIG, "num_key_value_heads": True}}, "'num_key_value_heads' must be a positive integer, got True"),
    ({"config": {**CONFIG, "hidden_size": "thirty-two"}}, "'hidden_size' must be a positive integer"),
])
def test_an_ir_directory_with_a_missing_file_or_a_bad_value_is_named(tmp_path, change, message):
    ir = _ir(tmp_path / "ir", **change)
    with pytest.raises(ModelPreparationError) as failure:
        read_ir_config(ir)
    assert message in str(failure.value) and str(ir) in str(failure.value)


def test_an_exporter_stopped_by_a_sigterm_names_its_sender_and_removes_its_output(tmp_path):
    """A SIGTERM (its parent's death, or anyone's) ends the exporter's process group; the reason
    names the sender instead of guessing at memory."""
    import subprocess
    import sys

    out = tmp_path / "out"
    (out / "part").mkdir(parents=True)
    watch = (f"import sys, time\nfrom inference_service.llm.ir_export import _die_with\n"
             f"_die_with({os.getpid()}, {str(out)!r})\nprint('armed', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", watch], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "armed\n"  # the watch runs (as in the exporter)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    reason = failure_reason(output, proc.returncode)
    assert reason.startswith(f"the exporter was stopped by a SIGTERM from pid {os.getpid()} ("), (reason, output)
