"""Speech to text end to end: the Whisper base archive (scripts/build_whisper_archive) on the real
server, driven by the official ``openai`` client, against OpenVINO GenAI's ``WhisperPipeline``
run directly on the same IR and the same public-domain clip (data/speech/README.md).

The server serves ``whisper`` (the defaults) and ``whisper_short`` (``--max-audio-seconds 5``:
the duration limit).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import ROOT, ServerProcess, read_key, serving

pytestmark = pytest.mark.slow

CLIP = Path(__file__).parent / "data" / "speech" / "jfk.wav"
TRANSCRIPT = ("And so my fellow Americans, ask not what your country can do for you, ask what you can do for "
              "your country.")
MODELS = ("whisper", "whisper_short")
#: The word error rate the served model may reach on the clip, and its bound against the pipeline's.
MAX_WER = 0.1
WER_FACTOR = 1.2


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (Whisper's text normalized as WER scorers do)."""
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance over the reference's word count."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1] / len(ref)


def _build(store: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_whisper_archive"), "--model-store", str(store),
                    *args], check=True, timeout=900, capture_output=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("speech_store")
    _build(store)  # joins the model's chunks and converts it to OpenVINO IR once (cached)
    _build(store, "--name", "whisper_short", "--max-audio-seconds", "5")
    with serving(tmp_path_factory.mktemp("speech_work"), store, MODELS) as srv:
        yield srv


@pytest.fixture(scope="module")
def direct():
    """The reference: ``WhisperPipeline`` on the archive's IR, greedy, the clip as 16 kHz floats."""
    import openvino_genai
    import soundfile

    from inference_service.speech.model import default_model_dir, prepare_ir

    ir_dir, _ = prepare_ir(default_model_dir())
    samples, rate = soundfile.read(CLIP, dtype="float32")
    assert rate == 16000
    return openvino_genai.WhisperPipeline(str(ir_dir), "CPU").generate(samples).texts[0]


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.status['http_port']}/v1",
                         api_key=read_key(srv.key_file, "inference"), max_retries=0, timeout=120)


def _form(fields: dict[str, str], file: bytes | None, filename: str = "clip.wav") -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
                    for name, value in fields.items())
    if file is not None:
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n").encode() + file + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _post(srv: ServerProcess, path: str, fields: dict[str, str], file: bytes | None,
          filename: str = "clip.wav") -> tuple[int, bytes]:
    body, content_type = _form(fields, file, filename)
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.status['http_port']}{path}", data=body, method="POST",
        headers={"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def _clip_at(rate: int, channels: int = 1) -> np.ndarray:
    import soundfile
    from scipy.signal import resample_poly

    samples, _ = soundfile.read(CLIP, dtype="float32")
    resampled = resample_poly(samples, rate, 16000).astype(np.float32) if rate != 16000 else samples
    return np.stack([resampled] * channels, axis=1) if channels > 1 else resampled


def test_transcription_word_error_rate_matches_the_pipeline(server, direct):
    answer = client(server).audio.transcriptions.create(model="whisper", file=CLIP.open("rb"))
    ours, theirs = wer(TRANSCRIPT, answer.text), wer(TRANSCRIPT, direct)
    print(f"WER on jfk.wav: served {ours:.3f} ({answer.text!r}), WhisperPipeline directly {theirs:.3f} "
          f"({direct!r})")
    assert ours <= MAX_WER and ours <= WER_FACTOR * theirs + 1e-9, (answer.text, direct)
    assert answer.usage is not None and answer.usage.seconds == 11


@pytest.mark.parametrize(("rate", "channels", "fmt", "subtype"), [
    (44100, 2, "WAV", "PCM_16"), (8000, 1, "WAV", "PCM_16"), (22050, 1, "FLAC", None),
    (48000, 1, "OGG", "VORBIS"), (16000, 1, "MP3", None)])
def test_other_rates_channels_and_formats_are_decoded(server, rate, channels, fmt, subtype):
    audio = _encoded(_clip_at(rate, channels), rate, fmt, subtype)
    answer = client(server).audio.transcriptions.create(model="whisper", file=(f"clip.{fmt.lower()}", audio),
                                                        language="en")
    assert wer(TRANSCRIPT, answer.text) <= MAX_WER, answer.text


def test_every_response_format(server):
    transcriptions = client(server).audio.transcriptions
    text = transcriptions.create(model="whisper", file=CLIP.open("rb"), response_format="text")
    assert isinstance(text, str) and text.endswith("\n") and wer(TRANSCRIPT, text) <= MAX_WER
    srt = transcriptions.create(model="whisper", file=CLIP.open("rb"), response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:1\d,\d{3}\n\S", srt), srt
    vtt = transcriptions.create(model="whisper", file=CLIP.open("rb"), response_format="vtt")
    assert re.match(r"WEBVTT\n\n00:00:00\.000 --> 00:00:1\d\.\d{3}\n\S", vtt), vtt
    verbose = transcriptions.create(model="whisper", file=CLIP.open("rb"), response_format="verbose_json",
                                    timestamp_granularities=["word", "segment"])
    assert verbose.language == "english" and verbose.duration == 11.0 and wer(TRANSCRIPT, verbose.text) <= MAX_WER
    assert verbose.segments and verbose.segments[0].start == 0.0 and verbose.segments[-1].end <= 11.0
    spoken = [w.word for w in verbose.words or []]
    assert [w for w in words(" ".join(spoken))] == words(verbose.text)
    starts = [w.start for w in verbose.words or []]
    assert starts == sorted(starts) and all(w.start <= w.end <= 11.0 for w in verbose.words or [])
    status, body = _post(server, "/v1/audio/transcriptions", {"model": "whisper", "response_format": "verbose_json"},
                         CLIP.read_bytes())
    assert status == 200 and "words" not in json.loads(body) and json.loads(body)["segments"]


def test_translation_is_english_text(server):
    translations = client(server).audio.translations
    answer = translations.create(model="whisper", file=CLIP.open("rb"))
    assert wer(TRANSCRIPT, answer.text) <= 0.2, answer.text
    srt = translations.create(model="whisper", file=CLIP.open("rb"), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> "), srt
    status, body = _post(server, "/v1/audio/translations", {"model": "whisper", "language": "en"}, CLIP.read_bytes())
    assert status == 400 and json.loads(body)["error"]["param"] == "language", body


def test_streamed_deltas_make_the_text(server):
    events = list(client(server).audio.transcriptions.create(model="whisper", file=CLIP.open("rb"), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 5 and events[-1].type == "transcript.text.done"
    assert "".join(deltas).strip() == events[-1].text and wer(TRANSCRIPT, events[-1].text) <= MAX_WER


def test_long_audio_streams_segment_by_segment(server):
    samples = _clip_at(16000)
    long = np.concatenate([samples, np.zeros(8000, np.float32), samples, np.zeros(8000, np.float32), samples])
    events = list(client(server).audio.transcriptions.create(
        model="whisper", file=("long.wav", _encoded(long, 16000, "WAV", "PCM_16")), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and 3 <= len(deltas) <= 6, deltas
    assert done.usage.seconds == 34 and wer(" ".join([TRANSCRIPT] * 3), done.text) <= MAX_WER, done.text


@pytest.mark.parametrize(("fields", "file", "status", "param", "fragment"), [
    ({"model": "whisper"}, None, 400, "file", "no 'file' part"),
    ({}, b"RIFF", 400, "model", "is required"),
    ({"model": "nope"}, b"RIFF", 404, "model", "does not exist"),
    ({"model": "whisper", "response_format": "xml"}, b"RIFF", 400, "response_format", "must be one of"),
    ({"model": "whisper", "temperature": "2"}, b"RIFF", 400, "temperature", "from 0 to 1"),
    ({"model": "whisper", "timestamp_granularities[]": "word"}, b"RIFF", 400, "timestamp_granularities[]",
     "verbose_json"),
    ({"model": "whisper", "stream": "true", "response_format": "srt"}, b"RIFF", 400, "stream", "streams text"),
    ({"model": "whisper"}, b"not audio at all", 400, "file", "not audio"),
    ({"model": "whisper"}, b"\0\0\0\x20ftypM4A " + bytes(64), 400, "file", "MP4/M4A audio is not decoded"),
    ({"model": "whisper", "language": "xx"}, "clip", 400, "language", "not a language"),
    ({"model": "whisper_short"}, "clip", 400, "file", "max_audio_seconds=5"),
    ({"model": "whisper"}, "7 MB", 413, "file", "max_request_size=6553500"),
], ids=lambda value: None if isinstance(value, (dict, bytes)) else str(value)[:40])
def test_refusals_name_the_field(server, fields, file, status, param, fragment):
    audio = {"clip": CLIP.read_bytes(), "7 MB": bytes(7_000_000)}.get(file, file) if isinstance(file, str) else file
    got, body = _post(server, "/v1/audio/transcriptions", fields, audio)
    error = json.loads(body)["error"]
    assert (got, error["param"]) == (status, param) and fragment in error["message"], body[:300]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_sees_the_refusals(server):
    with pytest.raises(openai.NotFoundError):
        client(server).audio.transcriptions.create(model="nope", file=CLIP.open("rb"))
    with pytest.raises(openai.BadRequestError, match="not audio"):
        client(server).audio.transcriptions.create(model="whisper", file=("x.wav", b"garbage"))
    answer = client(server).audio.transcriptions.create(model="whisper", file=CLIP.open("rb"))
    assert wer(TRANSCRIPT, answer.text) <= MAX_WER  # the worker serves on


@pytest.mark.parametrize(("content_type", "body", "fragment"), [
    ("application/json", b'{"model": "whisper"}', "must be multipart/form-data"),
    ("multipart/form-data", b"--x\r\n", "malformed multipart body"),
    ("multipart/form-data; boundary=x", b"garbage", "malformed multipart body"),
])
def test_a_body_that_is_not_a_form_is_refused(server, content_type, body, fragment):
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.status['http_port']}/v1/audio/translations", data=body, method="POST",
        headers={"Authorization": f"Bearer {read_key(server.key_file, 'inference')}", "Content-Type": content_type})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and fragment in json.loads(caught.value.read())["error"]["message"]
