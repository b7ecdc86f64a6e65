"""The speech request's form checks, the subtitle and JSON answers, the audio decoder's refusals
and resampling, and the CTranslate2 reader on a hand-written ``model.bin``."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest

from inference_service.contracts.speech import InvalidSpeechRequest, SpeechRequest, refused_field
from inference_service.speech.audio import decode
from inference_service.speech.ct2 import NotCTranslate2, read_model_bin
from inference_service.speech.formats import Segment, Transcript, answer, subtitles


def test_a_form_becomes_a_request_and_back():
    asked = SpeechRequest.build("transcribe", {"model": ["whisper"], "language": ["EN"], "temperature": ["0.2"],
                                               "response_format": ["verbose_json"],
                                               "timestamp_granularities[]": ["word", "segment", "word"]})
    assert (asked.language, asked.temperature, asked.timestamp_granularities) == ("en", 0.2, ("word", "segment"))
    assert SpeechRequest.from_body(asked.to_body()) == asked


@pytest.mark.parametrize(("task", "fields", "field"), [
    ("transcribe", {}, "model"),
    ("transcribe", {"model": ["w", "w"]}, "model"),
    ("translate", {"model": ["w"], "language": ["de"]}, "language"),
    ("transcribe", {"model": ["w"], "language": ["english"]}, "language"),
    ("transcribe", {"model": ["w"], "temperature": ["hot"]}, "temperature"),
    ("transcribe", {"model": ["w"], "temperature": ["nan"]}, "temperature"),
    ("transcribe", {"model": ["w"], "stream": ["yes"]}, "stream"),
    ("transcribe", {"model": ["w"], "timestamp_granularities[]": ["char"], "response_format": ["verbose_json"]},
     "timestamp_granularities[]"),
])
def test_a_bad_field_is_named(task, fields, field):
    with pytest.raises(InvalidSpeechRequest) as caught:
        SpeechRequest.build(task, fields)
    assert caught.value.field == field and refused_field(str(caught.value)) == field


def test_subtitles_and_verbose_json():
    segments = [Segment(0.0, 2.5, " Hello there."), Segment(2.5, 3661.25, " Bye.")]
    assert subtitles(segments, "srt") == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                                          "2\n00:00:02,500 --> 01:01:01,250\nBye.\n")
    assert subtitles(segments, "vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n")
    asked = SpeechRequest("transcribe", "w", response_format="verbose_json", timestamp_granularities=("word",))
    heard = Transcript(" Hello there. Bye.", 3.2, "en", segments, [Segment(0, 1, " Hello")])
    verbose = json.loads(answer(asked, heard))
    assert verbose["language"] == "english" and verbose["usage"] == {"type": "duration", "seconds": 4}
    assert "segments" not in verbose and verbose["words"] == [{"word": "Hello", "start": 0, "end": 1}]


def _wav(samples: np.ndarray, rate: int) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_audio_is_mixed_down_resampled_and_bounded():
    tone = np.sin(np.linspace(0, 2 * np.pi * 440, 44100)).astype(np.float32) * 0.5
    samples = decode(_wav(np.stack([tone, tone], axis=1), 44100), 60)
    assert samples.dtype == np.float32 and abs(len(samples) - 16000) <= 1 and 0.45 < np.abs(samples).max() < 0.55
    with pytest.raises(InvalidSpeechRequest, match="max_audio_seconds=0.5"):
        decode(_wav(tone, 44100), 0.5)
    for data, fragment in [(b"", "empty"), (b"\0\0\0\x18ftypmp42" + bytes(32), "MP4/M4A"), (b"hello", "not audio")]:
        with pytest.raises(InvalidSpeechRequest, match=fragment):
            decode(data, 60)


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def test_model_bin_variables_and_aliases(tmp_path):
    weight = np.arange(6, dtype=np.float16).reshape(2, 3)
    body = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<II", 3, 1)
    body += _string("decoder/embeddings/weight") + struct.pack("<BIIBI", 2, 2, 3, 4, weight.nbytes) + weight.tobytes()
    body += struct.pack("<I", 1) + _string("decoder/projection/weight") + _string("decoder/embeddings/weight")
    (tmp_path / "model.bin").write_bytes(body)
    variables = read_model_bin(tmp_path / "model.bin")
    assert np.array_equal(variables["decoder/projection/weight"], weight)
    (tmp_path / "other.bin").write_bytes(struct.pack("<I", 6) + _string("TransformerSpec") + bytes(8))
    with pytest.raises(NotCTranslate2, match="not Whisper"):
        read_model_bin(tmp_path / "other.bin")
