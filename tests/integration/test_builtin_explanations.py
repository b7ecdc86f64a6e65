"""The built-in handlers' explanations (``/explanations``), against a real server: Captum's
Integrated Gradients where Captum is installed (the ``explain`` extra), else 501 naming it.

Models: the image classifier example's ColorNet (``image_classifier``), the sentiment model
of test_builtin_handlers.py (``text_classifier``), a segmenter (501: no explanations).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import ARCHIVER, HANDLERS, ROOT, ServerProcess, read_key

CAPTUM = importlib.util.find_spec("captum") is not None  # the workers run this same environment
EXAMPLE = ROOT / "examples" / "image_classifier"
VOCAB = ["<unk>", "good", "great", "love", "bad", "awful", "boring", "movie", "this", "not", "not good", "i"]
RED, WHITE = 0, 8  # ColorNet's classes (examples/image_classifier/index_to_name.json)


def _archive(store: Path, name: str, handler: str, **files: Path | tuple[Path, ...]) -> str:
    import subprocess

    cmd = [ARCHIVER, "--model-name", name, "--version", "1.0", "--handler", handler, "--export-path", str(store)]
    for flag, value in files.items():
        cmd += [f"--{flag.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60, cwd=store)
    return f"{name}={name}.mar"


def _colornet_state() -> dict[str, Any]:
    """The example's weights, as scripts/build_image_classifier_example computes them."""
    script = ROOT / "scripts" / "build_image_classifier_example"
    loader = importlib.machinery.SourceFileLoader("build_image_classifier_example", str(script))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module.colornet_state_dict()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("explain_store")
    torch.save(_colornet_state(), store / "colornet.pth")
    embedding = torch.zeros(len(VOCAB), 2)  # dimension 0 negative, 1 positive
    for token, column in (("good", 1), ("great", 1), ("love", 1), ("bad", 0), ("awful", 0), ("boring", 0)):
        embedding[VOCAB.index(token), column] = 1.0
    torch.save({"embedding.weight": embedding, "fc.weight": 4.0 * torch.eye(2), "fc.bias": torch.zeros(2)},
               store / "sentiment.pt")
    (store / "source_vocab.json").write_text(json.dumps({token: i for i, token in enumerate(VOCAB)}))
    models = [
        _archive(store, "colornet", "image_classifier", model_file=EXAMPLE / "model.py",
                 serialized_file=store / "colornet.pth", extra_files=(EXAMPLE / "index_to_name.json",)),
        _archive(store, "sentiment", "text_classifier", model_file=HANDLERS / "sentiment_model.py",
                 serialized_file=store / "sentiment.pt", extra_files=(store / "source_vocab.json",)),
        _archive(store, "segmenter", "image_segmenter", model_file=HANDLERS / "red_segmenter.py"),
    ]
    server = ServerProcess(tmp_path_factory.mktemp("explain_server"), store,
                           ["--workers-per-model", "1", "--models", *models])
    try:
        for model in models:
            server.wait_workers(model.split("=")[0], 1, timeout=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def explain(server: ServerProcess, model: str, data: bytes, target: str | None = None) -> tuple[int, Any]:
    """``POST /explanations/<model>`` of a form with ``data`` (and ``target``); ``(status, JSON answer)``."""
    boundary = uuid.uuid4().hex
    fields = {"data": data, **({"target": target.encode()} if target is not None else {})}
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value
                    + b"\r\n" for name, value in fields.items()) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.status['http_port']}/explanations/{model}", data=body, method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}",
                 "Authorization": f"Bearer {read_key(server.key_file, 'inference')}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_no_captum(answer: tuple[int, Any]) -> None:
    status, body = answer
    assert status == 501 and body["message"].startswith("explanations need Captum, which is not installed"), body


def half_red_png() -> bytes:
    image = Image.new("RGB", (224, 224), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((0, 0, 111, 223), fill=(255, 0, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_image_classifier_integrated_gradients(srv):
    answer = explain(srv, "colornet", half_red_png(), str(RED))
    if not CAPTUM:
        return assert_no_captum(answer)
    status, attributions = answer
    assert status == 200, attributions
    pixels = torch.tensor(attributions)
    assert pixels.shape == (3, 224, 224)  # the request's C x H x W attribution, as TorchServe's
    per_column = pixels.sum(dim=(0, 1))
    assert per_column[:112].sum() > 0 and per_column[:112].sum() > 10 * per_column[112:].abs().sum()
    status, white = explain(srv, "colornet", half_red_png(), str(WHITE))
    assert status == 200 and torch.tensor(white).sum(dim=(0, 1))[112:].sum() > 0


def test_text_classifier_token_importances(srv):
    answer = explain(srv, "sentiment", b"Great movie, awful!", "1")
    if not CAPTUM:
        return assert_no_captum(answer)
    status, body = answer
    assert status == 200, body
    words, scores = body["words"], body["importances"]
    assert words == ["great", "movie", "awful", "great movie", "movie awful"] and len(scores) == len(words)
    assert scores[0] == pytest.approx(1.0) and all(s == pytest.approx(0.0) for s in scores[1:])
    status, body = explain(srv, "sentiment", b"Great movie, awful!", "0")  # negative: awful alone counts
    assert status == 200 and body["importances"][2] == pytest.approx(1.0)


def test_bad_target_is_400_and_segmenter_has_no_explanations(srv):
    status, body = explain(srv, "sentiment", b"great", "positive")
    assert (status, body["message"]) == (400, "target must be an integer class index, got 'positive'")
    status, body = explain(srv, "segmenter", half_red_png())
    assert (status, body["message"]) == (501, "ImageSegmenter gives no explanations: a class index names no "
                                              "single score of a per-pixel output")
