"""TorchServe's built-in handlers and BaseHandler model loading, against a real server.

Every archive is built by torch-model-archiver 0.12.0; the example archive by
``scripts/build_image_classifier_example`` (TorchServe's densenet161 flow, with
a small CNN). One module-scoped server serves them all.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import grpc
import pytest
import torch
from PIL import Image, ImageDraw

from conftest import ARCHIVER, HANDLERS, ROOT, ServerProcess
from inference_service.handler import Context, image_processing, text_processing
from inference_service.handler.base_handler import ModelLoadError
from inference_service.handler.vision_handlers import ImageClassifier

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "image_classifier"
BUILD_EXAMPLE = ROOT / "scripts" / "build_image_classifier_example"
CLIENT = ROOT / "clients" / "torchserve_grpc_client.py"

# Vocabulary and weights of tests/handlers/sentiment_model.py: embedding dim 0 = negative, 1 = positive.
VOCAB = ["<unk>", "good", "great", "love", "bad", "awful", "boring", "movie", "this", "not", "not good", "i"]
POSITIVE = {"good", "great", "love"}
NEGATIVE = {"bad", "awful", "boring"}
STARTUP_MODELS = ["colornet_ts", "custom", "detector", "segmenter", "sentiment", "sentiment_pt", "sentiment_pickled"]


def _archive(store: Path, name: str, handler: str, *, serialized: Path | None = None,
             model_file: Path | None = None, extra_files: tuple[Path, ...] = (), config: str | None = None) -> str:
    """Run torch-model-archiver; returns the archive file name in ``store``."""
    cmd = [ARCHIVER, "--model-name", name, "--version", "1.0", "--handler", handler,
           "--export-path", str(store), "--force"]
    if serialized is not None:
        cmd += ["--serialized-file", str(serialized)]
    if model_file is not None:
        cmd += ["--model-file", str(model_file)]
    if extra_files:
        cmd += ["--extra-files", ",".join(str(f) for f in extra_files)]
    if config is not None:
        path = store / f"{name}-config.yaml"
        path.write_text(config)
        cmd += ["--config-file", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60, cwd=store)
    return f"{name}.mar"


def _png(size: tuple[int, int], background: tuple[int, int, int],
         rects: list[tuple[tuple[int, int, int, int], tuple[int, int, int]]] = ()) -> bytes:
    """A PNG of ``size`` with filled rectangles ``((x1, y1, x2, y2) inclusive, colour)``."""
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    for box, colour in rects:
        draw.rectangle(box, fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _build_script() -> ModuleType:
    """scripts/build_image_classifier_example as a module (its weights and drawing functions)."""
    loader = importlib.machinery.SourceFileLoader("build_image_classifier_example", str(BUILD_EXAMPLE))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _colornet_class() -> type[torch.nn.Module]:
    spec = importlib.util.spec_from_file_location("example_colornet_model", EXAMPLE / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ColorNet


def _sentiment_state_dict() -> dict[str, torch.Tensor]:
    embedding = torch.zeros(len(VOCAB), 2)
    for i, token in enumerate(VOCAB):
        if token in NEGATIVE:
            embedding[i, 0] = 1.0
        elif token in POSITIVE:
            embedding[i, 1] = 1.0
    embedding[VOCAB.index("not good"), 0] = 3.0
    return {"embedding.weight": embedding, "fc.weight": 4.0 * torch.eye(2), "fc.bias": torch.zeros(2)}


@pytest.fixture(scope="module")
def builtin_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example archive (by the build script) and one archive per built-in handler / loading path."""
    store = tmp_path_factory.mktemp("builtin_store")
    work = tmp_path_factory.mktemp("builtin_work")
    # the example archive and apple.png, built by the script (in the background meanwhile)
    example = subprocess.Popen([sys.executable, str(BUILD_EXAMPLE), "--model-store", str(store)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = _build_script().colornet_state_dict()
    colornet = _colornet_class()()
    colornet.load_state_dict(state)
    mapping = EXAMPLE / "index_to_name.json"

    # TorchScript (no --model-file), batching, handler options topk and profile
    torch.jit.script(colornet.eval()).save(work / "colornet.pt")
    _archive(store, "colornet_ts", "image_classifier", serialized=work / "colornet.pt", extra_files=(mapping,),
             config="batchSize: 4\nmaxBatchDelay: 300\nhandler:\n  topk: 3\n  profile: true\n")
    # safetensors state dict + eager model, under a custom handler subclassing the built-in; pt2 compile
    from safetensors.torch import save_file

    save_file(state, str(work / "colornet.safetensors"))
    _archive(store, "custom", str(HANDLERS / "custom_image_classifier.py"),
             serialized=work / "colornet.safetensors", model_file=EXAMPLE / "model.py", extra_files=(mapping,),
             config="pt2:\n  compile:\n    enable: true\n    backend: eager\n")
    # object detector (model file only, no weights) with the object_type_names mapping
    names = work / "detector" / "index_to_name.json"
    names.parent.mkdir()
    names.write_text(json.dumps({"object_type_names": ["__background__", "red_square", "noise"]}))
    _archive(store, "detector", "object_detector", model_file=HANDLERS / "red_box_detector.py", extra_files=(names,))
    _archive(store, "segmenter", "image_segmenter", model_file=HANDLERS / "red_segmenter.py")

    # text classifier: JSON vocabulary; plain-data .pt vocabulary; pickled vocabulary (opt-in)
    torch.save(_sentiment_state_dict(), work / "sentiment.pt")
    labels = work / "text" / "index_to_name.json"
    labels.parent.mkdir()
    labels.write_text(json.dumps({"0": "negative", "1": "positive"}))
    vocab_json = work / "text" / "source_vocab.json"
    vocab_json.write_text(json.dumps({token: i for i, token in enumerate(VOCAB)}))
    text_args = {"serialized": work / "sentiment.pt", "model_file": HANDLERS / "sentiment_model.py"}
    _archive(store, "sentiment", "text_classifier", extra_files=(labels, vocab_json),
             config="batchSize: 2\nmaxBatchDelay: 1000\n", **text_args)
    vocab_pt = work / "text_pt" / "source_vocab.pt"
    vocab_pt.parent.mkdir()
    torch.save(VOCAB, vocab_pt)
    _archive(store, "sentiment_pt", "text_classifier", extra_files=(labels, vocab_pt), **text_args)
    sys.path.insert(0, str(HANDLERS))
    try:
        from pickled_vocab import WordIndex
    finally:
        sys.path.remove(str(HANDLERS))
    vocab_pickled = work / "text_pickled" / "source_vocab.pt"
    vocab_pickled.parent.mkdir()
    torch.save(WordIndex({token: i for i, token in enumerate(VOCAB)}), vocab_pickled)
    pickled_files = (labels, vocab_pickled, HANDLERS / "pickled_vocab.py")
    _archive(store, "sentiment_pickled", "text_classifier", extra_files=pickled_files,
             config="handler:\n  weights_only: false\n", **text_args)

    # archives that must fail to load
    _archive(store, "refused_pickled_vocab", "text_classifier", extra_files=pickled_files, **text_args)
    torch.save({"pixel_scores.weight": torch.zeros(5, 3, 1, 1), "pixel_scores.bias": torch.zeros(5)},
               work / "wrong_shape.pth")
    _archive(store, "bad_state_dict", "image_classifier", serialized=work / "wrong_shape.pth",
             model_file=EXAMPLE / "model.py")
    _archive(store, "safetensors_no_model", "image_classifier", serialized=work / "colornet.safetensors")
    torch.save(state, work / "weights_only.pth")
    _archive(store, "state_dict_as_torchscript", "image_classifier", serialized=work / "weights_only.pth")
    _archive(store, "two_model_classes", "image_classifier", model_file=HANDLERS / "two_models.py")

    out, err = example.communicate(timeout=120)
    assert example.returncode == 0, err.decode()
    assert out.decode().split() == [str(store / "colornet.mar"), str(store / "apple.png")]
    with zipfile.ZipFile(store / "colornet.mar") as zf:
        manifest = json.loads(zf.read("MAR-INF/MANIFEST.json"))["model"]
        archived = torch.load(io.BytesIO(zf.read("colornet.pth")), weights_only=True)
    # the shape of TorchServe's densenet161 archive: eager model.py + state dict + image_classifier
    assert (manifest["handler"], manifest["modelFile"], manifest["serializedFile"]) == (
        "image_classifier", "model.py", "colornet.pth")
    assert all(torch.equal(archived[k], v) for k, v in state.items()) and archived.keys() == state.keys()
    return store


def _wait_registered(server: ServerProcess, names: list[str], timeout: float) -> None:
    """Wait until every startup model is registered (the server listens before it registers them)."""
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                server.describe(name)
                break
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def builtin_server(builtin_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server (model API on) with the working built-in handler archives loaded at startup."""
    models = [f"{name}={name}.mar" for name in STARTUP_MODELS]
    srv = ServerProcess(tmp_path_factory.mktemp("builtin_server"), builtin_store,
                        ["--enable-model-api", "--workers-per-model", "1", "--models", *models])
    try:
        _wait_registered(srv, STARTUP_MODELS, timeout=30)
        for name in STARTUP_MODELS:
            srv.wait_workers(name, 1, timeout=90)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


def _rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value


def _client(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CLIENT), "--inference-port", str(server.inference_port),
                           "--management-port", str(server.management_port), "--key-file", str(server.key_file),
                           *args],
                          capture_output=True, text=True, timeout=120, check=False)


# --- the seed's densenet161 flow, through the project's client ---------------------------------
def test_example_register_infer_unregister_with_client(builtin_server, builtin_store):
    reg = _client(builtin_server, "register", "colornet", "colornet.mar")
    assert reg.returncode == 0, reg.stderr
    assert "colornet" in reg.stdout
    out = _client(builtin_server, "infer", "colornet", str(builtin_store / "apple.png"))
    assert out.returncode == 0, (out.stdout, out.stderr, builtin_server.log()[-3000:])
    result = json.loads(out.stdout)
    # image_classifier: the top 5 classes, most likely first, labels from index_to_name.json ([id, label])
    assert list(result)[:3] == ["red", "white", "green"] and len(result) == 5
    probs = list(result.values())
    assert probs == sorted(probs, reverse=True) and 0.55 < probs[0] < 0.7 and sum(probs) <= 1.0001
    assert _client(builtin_server, "unregister", "colornet").returncode == 0
    gone = _client(builtin_server, "infer", "colornet", str(builtin_store / "apple.png"))
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr


# --- loading paths ---------------------------------------------------------------------------------
def test_torchscript_model_with_topk_and_profile_options(builtin_server, builtin_store):
    apple = (builtin_store / "apple.png").read_bytes()
    result = json.loads(builtin_server.predict("colornet_ts", apple))
    assert list(result) == ["red", "white", "green"]  # handler: {topk: 3}
    assert 0.55 < result["red"] < 0.7
    log = builtin_server.log()
    assert "ts_handler_preprocess" in log and "ts_handler_postprocess" in log  # handler: {profile: true}


def test_safetensors_eager_model_under_custom_subclass_handler(builtin_server, builtin_store):
    apple = (builtin_store / "apple.png").read_bytes()
    result = json.loads(builtin_server.predict("custom", apple, timeout=60))
    reference = json.loads(builtin_server.predict("colornet_ts", apple))
    assert result["dominant"] == "red" and result["device"] == "cpu"
    assert list(result["top"]) == ["red", "white"]  # set_max_result_classes(2)
    assert result["top"]["red"] == pytest.approx(reference["red"], abs=1e-5)
    assert "compiled model with torch.compile(backend='eager')" in builtin_server.log()  # pt2.compile


def test_loading_errors_reach_the_client_with_file_and_cause(builtin_server):
    expected = {
        "bad_state_dict.mar": ["'wrong_shape.pth'", "does not fit ColorNet", "size mismatch"],
        "refused_pickled_vocab.mar": ["'source_vocab.pt'", "pickled object", "weights_only: false"],
    }
    with ThreadPoolExecutor(len(expected)) as pool:
        errors = dict(zip(expected, pool.map(lambda url: _rpc_error(builtin_server.register, url), expected),
                          strict=True))
    for url, err in errors.items():
        assert err.code() == grpc.StatusCode.INTERNAL, url
        for text in expected[url]:
            assert text in err.details(), (url, err.details())
        assert _rpc_error(builtin_server.describe, url[:-4]).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("url", "texts"), [
    ("safetensors_no_model.mar", ["'colornet.safetensors'", "safetensors state dict", "--model-file"]),
    ("state_dict_as_torchscript.mar", ["'weights_only.pth'", "cannot load TorchScript file", "state dict"]),
    ("two_model_classes.mar", ["'two_models.py'", "exactly one torch.nn.Module class", "found 2 (First, Second)"]),
])
def test_loading_errors_name_the_file_and_the_cause(builtin_store, tmp_path, url, texts):
    # The archive's handler initialised in this process, as a worker does (a worker start per case costs seconds).
    with zipfile.ZipFile(builtin_store / url) as zf:
        zf.extractall(tmp_path)
    manifest = json.loads((tmp_path / "MAR-INF" / "MANIFEST.json").read_text())
    assert manifest["model"]["handler"] == "image_classifier"
    context = Context(manifest["model"]["modelName"], str(tmp_path), manifest, 1, None, "test")
    try:
        with pytest.raises(ModelLoadError) as err:
            ImageClassifier().initialize(context)
    finally:
        sys.modules.pop(Path(manifest["model"].get("modelFile", "-")).stem, None)
    for text in texts:
        assert text in str(err.value), str(err.value)


# --- image_classifier input errors ---------------------------------------------------------------
def test_corrupt_image_is_invalid_argument_and_the_worker_survives(builtin_server, builtin_store):
    pid = builtin_server.wait_workers("colornet_ts", 1)[0]["pid"]
    apple = (builtin_store / "apple.png").read_bytes()
    for bad, text in [(b"not an image", "not a known image format"), (apple[: len(apple) // 2], "cannot decode image"),
                      (b"", "no image")]:
        err = _rpc_error(builtin_server.predict, "colornet_ts", bad)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.details(), err.details()
    assert "red" in json.loads(builtin_server.predict("colornet_ts", apple))
    assert builtin_server.wait_workers("colornet_ts", 1)[0]["pid"] == pid


def test_bad_image_in_a_batch_fails_only_that_request(builtin_server, builtin_store):
    apple = (builtin_store / "apple.png").read_bytes()
    blue = _png((64, 48), (40, 70, 200))
    bodies = [apple, b"GIF89a broken", blue, apple]  # batchSize 4: one batch

    def call(body: bytes) -> tuple[str, object]:
        try:
            return "ok", json.loads(builtin_server.predict("colornet_ts", body))
        except grpc.RpcError as err:
            return err.code().name, err.details()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, bodies))
    assert results[1][0] == "INVALID_ARGUMENT" and "cannot decode image" in results[1][1]
    assert [r[0] for r in results] == ["ok", "INVALID_ARGUMENT", "ok", "ok"]
    assert next(iter(results[0][1])) == "red" and next(iter(results[2][1])) == "blue"
    assert results[0][1] == results[3][1]


# --- object_detector / image_segmenter ---------------------------------------------------------------
def test_object_detector_boxes_labels_and_scores(builtin_server):
    image = _png((120, 90), (250, 250, 250), [((30, 20, 69, 49), (220, 20, 20))])
    detections = json.loads(builtin_server.predict("detector", image))
    # [{label: [x1, y1, x2, y2], "score": s}], detections under the 0.5 threshold dropped
    assert len(detections) == 1
    assert detections[0]["red_square"] == [30.0, 20.0, 70.0, 50.0]
    assert detections[0]["score"] == pytest.approx(0.93)
    assert json.loads(builtin_server.predict("detector", _png((40, 40), (250, 250, 250)))) == []


def test_image_segmenter_class_and_probability_per_pixel(builtin_server):
    image = _png((256, 256), (250, 250, 250), [((0, 0, 127, 255), (220, 20, 20))])
    pixels = json.loads(builtin_server.predict("segmenter", image))
    assert len(pixels) == 224 and all(len(row) == 224 for row in pixels)
    # Resize(256) keeps 256 x 256, CenterCrop(224) cuts 16 px each side: x < 112 is red
    left, right = pixels[100][50], pixels[100][200]
    assert left[0] == 1.0 and left[1] > 0.9
    assert right[0] == 0.0 and 0.5 <= right[1] <= 1.0


# --- text_classifier ---------------------------------------------------------------------------------
def test_text_classifier_json_vocabulary_batches_requests(builtin_server):
    texts = ["I'd LOVE to watch this movie again, it's great!", "<b>Awful</b>, boring movie."]
    with ThreadPoolExecutor(2) as pool:  # batchSize 2: one batch, one answer per request
        positive, negative = [json.loads(r) for r in pool.map(lambda t: builtin_server.predict("sentiment", t),
                                                               texts)]
    assert set(positive) == {"negative", "positive"}
    assert positive["positive"] > 0.9 and negative["negative"] > 0.9
    assert sum(positive.values()) == pytest.approx(1.0)
    not_good = json.loads(builtin_server.predict("sentiment", "Not good."))  # the 2-gram "not good" counts
    assert not_good["negative"] > not_good["positive"]


def test_text_classifier_plain_and_pickled_vocabularies(builtin_server):
    expected = json.loads(builtin_server.predict("sentiment", "great movie"))
    for model in ("sentiment_pt", "sentiment_pickled"):
        result = json.loads(builtin_server.predict(model, "great movie"))
        assert result == pytest.approx(expected), model
    err = _rpc_error(builtin_server.predict, "sentiment_pt", b"\xff\xfe bad")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details()


# --- processing without torchvision / torchtext (no server) -------------------------------------
def test_imagenet_preprocess_with_or_without_torchvision():
    pre = image_processing.ImageNetPreprocess()
    assert pre.uses_torchvision == image_processing.torchvision_available()  # not installed here
    image = Image.new("RGBA", (320, 240), (255, 0, 0, 128))
    tensor = pre(image)
    assert tensor.shape == (3, 224, 224)
    expected = [(1 - 0.485) / 0.229, (0 - 0.456) / 0.224, (0 - 0.406) / 0.225]
    assert torch.allclose(tensor[:, 0, 0], torch.tensor(expected), atol=1e-5)
    assert image_processing.resize_shorter_side(Image.new("RGB", (500, 333)), 256).size == (384, 256)
    assert image_processing.center_crop(Image.new("RGB", (221, 100)), 224).size == (224, 224)
    with pytest.raises(image_processing.ImageDecodeError):
        image_processing.decode_image(b"\x89PNG\r\n\x1a\n truncated")


def test_text_cleanup_tokens_and_ngrams():
    clean = text_processing.remove_punctuation(text_processing.expand_contractions(
        text_processing.remove_html_tags("<p>I'd say it&amp;s NOT bad</p>").lower()))
    assert text_processing.basic_english_tokenize(clean) == ["i", "would", "say", "its", "not", "bad"]
    assert text_processing.remove_accented_characters("café") == "cafe"
    assert list(text_processing.ngrams(["a", "b", "c"], 2)) == ["a", "b", "c", "a b", "b c"]
    vocab = text_processing.Vocabulary({"<unk>": 3, "x": 1})
    assert vocab["x"] == 1 and vocab["unknown"] == 3
