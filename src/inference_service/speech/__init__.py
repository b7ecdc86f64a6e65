"""Speech to text: Whisper behind OpenAI's /v1/audio routes, on OpenVINO GenAI's WhisperPipeline
(docs/speech.md)."""
