"""An uploaded audio file as Whisper reads it: mono float32 samples in [-1, 1] at 16 kHz.

Files are decoded by libsndfile (the ``soundfile`` wheels ship it): WAV (any PCM width, float,
mu-law, A-law), FLAC, Ogg (Vorbis, Opus), MP3 and AIFF, at any sample rate; channels are averaged
and the rate is changed to 16 kHz with a polyphase filter. MP4/M4A (AAC) and WebM, which OpenAI
also takes, need codecs libsndfile lacks and are refused by name.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

from inference_service.contracts.speech import InvalidSpeechRequest

SAMPLE_RATE = 16000
#: The formats decoded, as OpenAI's file extensions name them.
ACCEPTED = ("wav", "flac", "ogg", "mp3", "mpga", "mpeg", "aiff")
#: Container signatures of formats refused by name: (offset, bytes, name).
_REFUSED = ((4, b"ftyp", "MP4/M4A"), (0, b"\x1a\x45\xdf\xa3", "WebM/Matroska"))


def decode(data: bytes, max_seconds: float) -> np.ndarray:
    """The mono 16 kHz samples of a file.

    Raises:
        InvalidSpeechRequest: field ``file``: an empty, unknown or refused format, or audio longer
            than ``max_seconds`` (checked from the header, before decoding).
    """
    import soundfile

    if not data:
        raise InvalidSpeechRequest("file", "the audio file is empty")
    for offset, magic, name in _REFUSED:
        if data[offset:offset + len(magic)] == magic:
            raise InvalidSpeechRequest("file", f"{name} audio is not decoded here; send one of: {', '.join(ACCEPTED)}")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            rate = sound.samplerate
            if sound.frames > 0 and sound.frames / rate > max_seconds:
                raise InvalidSpeechRequest("file", f"the audio lasts {sound.frames / rate:.1f} s, more than "
                                                   f"max_audio_seconds={max_seconds:g}")
            samples = sound.read(dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise InvalidSpeechRequest("file", f"the file is not audio in a format decoded here ({', '.join(ACCEPTED)}): "
                                           f"{exc}") from None
    if len(samples) / rate > max_seconds:  # formats whose header states no length (MP3 streams)
        raise InvalidSpeechRequest("file", f"the audio lasts {len(samples) / rate:.1f} s, more than "
                                           f"max_audio_seconds={max_seconds:g}")
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if not len(mono):
        raise InvalidSpeechRequest("file", "the audio file holds no samples")
    return resample(mono, rate)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """``samples`` at ``rate`` Hz, as float32 at :data:`SAMPLE_RATE`."""
    if rate == SAMPLE_RATE:
        return np.ascontiguousarray(samples, dtype=np.float32)
    from scipy.signal import resample_poly

    ratio = Fraction(SAMPLE_RATE, rate).limit_denominator(1000)
    return resample_poly(samples, ratio.numerator, ratio.denominator).astype(np.float32)
