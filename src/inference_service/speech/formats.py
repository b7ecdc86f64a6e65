"""The answers of a transcription or translation in OpenAI's ``response_format`` shapes, and its
streamed events (``transcript.text.delta`` / ``transcript.text.done``). docs/speech.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from inference_service.contracts.speech import SpeechRequest


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of text and its times in seconds from the audio's start."""

    start: float
    end: float
    text: str


@dataclass(slots=True)
class Transcript:
    """What the model heard: the whole ``text``, its segments and words (empty unless asked),
    the ``language`` code (the request's or the one detected) and the audio's ``duration`` (s)."""

    text: str
    duration: float
    language: str | None = None
    segments: list[Segment] = field(default_factory=list)
    words: list[Segment] = field(default_factory=list)


def usage(duration: float) -> dict[str, Any]:
    """OpenAI's usage of a duration-billed model: whole seconds of audio, rounded up."""
    return {"type": "duration", "seconds": math.ceil(duration)}


def language_name(code: str | None) -> str | None:
    """Whisper's English name of a language code (``en`` -> ``english``), the code if unknown."""
    if code is None:
        return None
    try:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
    except ImportError:  # pragma: no cover - transformers is a requirement
        return code
    return str(LANGUAGES.get(code, code))


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def subtitles(segments: list[Segment], fmt: str) -> str:
    """SubRip (``srt``) or WebVTT (``vtt``) cues, one a segment."""
    separator = "," if fmt == "srt" else "."
    cues = []
    for number, segment in enumerate(segments, 1):
        timing = f"{_clock(segment.start, separator)} --> {_clock(segment.end, separator)}"
        cue = f"{timing}\n{segment.text.strip()}\n"
        cues.append(f"{number}\n{cue}" if fmt == "srt" else cue)
    return ("" if fmt == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def answer(request: SpeechRequest, transcript: Transcript) -> str:
    """The body of a whole answer: JSON for ``json`` and ``verbose_json``, else plain text."""
    fmt = request.response_format
    text = transcript.text.strip()
    if fmt == "text":
        return text + "\n"
    if fmt in ("srt", "vtt"):
        return subtitles(transcript.segments, fmt)
    if fmt == "json":
        return json.dumps({"text": text, "usage": usage(transcript.duration)}, ensure_ascii=False)
    verbose: dict[str, Any] = {
        "task": "transcribe" if request.task == "transcribe" else "translate",
        "language": language_name(transcript.language), "duration": round(transcript.duration, 3), "text": text}
    if not request.timestamp_granularities or "segment" in request.timestamp_granularities:
        verbose["segments"] = [
            {"id": i, "seek": 0, "start": round(s.start, 2), "end": round(s.end, 2), "text": s.text, "tokens": [],
             "temperature": request.temperature, "avg_logprob": None, "compression_ratio": None,
             "no_speech_prob": None} for i, s in enumerate(transcript.segments)]
    if "word" in request.timestamp_granularities:
        verbose["words"] = [{"word": w.text.strip(), "start": round(w.start, 2), "end": round(w.end, 2)}
                            for w in transcript.words]
    verbose["usage"] = usage(transcript.duration)
    return json.dumps(verbose, ensure_ascii=False)


def delta_event(text: str) -> str:
    """A streamed piece of text (``transcript.text.delta``)."""
    return json.dumps({"type": "transcript.text.delta", "delta": text}, ensure_ascii=False)


def done_event(transcript: Transcript) -> str:
    """The last streamed event (``transcript.text.done``): the whole text and the usage."""
    return json.dumps({"type": "transcript.text.done", "text": transcript.text.strip(),
                       "usage": usage(transcript.duration)}, ensure_ascii=False)
