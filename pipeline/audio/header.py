"""A clip's header read without decoding: sample rate, channels, length, and the budgets they imply.

libsndfile reads the header, or `audioread` as a fallback for paths. The sample rate must lie in
the allowed range, the duration the header claims must not exceed `max_duration_s`, and its
decode (frames x channels x 4 bytes of float32) must not exceed `max_decoded_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import soundfile as sf

from pipeline.audio.sources import Opened, Source, open_source
from pipeline.errors import TOO_LARGE, TOO_LONG, UNREADABLE, UNSUPPORTED_RATE, VoxmillError
from pipeline.settings import AudioLimits
from pipeline.units import format_bytes, format_duration

# `AudioInfo.format` of a clip that only the audioread fallback could open.
AUDIOREAD_FORMAT = "audioread"
SAMPLE_BYTES = 4  # a decoded sample is float32
_SNIFF_BYTES = 512


@dataclass(frozen=True)
class AudioInfo:
    """What the file header says, read without decoding the samples."""

    sample_rate_hz: int
    channels: int
    frames: int
    duration_s: float
    format: str
    subtype: str


def probe_audio(source: Source, limits: AudioLimits) -> AudioInfo:
    """Check a path or bytes up to the header (size, format, rate, duration); decode nothing."""
    with open_source(source, limits) as opened:
        return probe(opened, limits)


def codec_name(info: AudioInfo) -> str:
    """`format/subtype` of a probed header (`Audio.codec`)."""
    return AUDIOREAD_FORMAT if info.format == AUDIOREAD_FORMAT else f"{info.format}/{info.subtype}"


def probe(opened: Opened, limits: AudioLimits) -> AudioInfo:
    """Read the header (libsndfile, else audioread for paths) and check rate, duration and the
    decode's size."""
    info = probe_header(opened)
    check_rate(info.sample_rate_hz, limits)
    check_not_too_long(info.duration_s, limits)
    check_decode_budget(info, info.frames, limits)
    return info


def probe_header(opened: Opened) -> AudioInfo:
    """Header of the stream via libsndfile; for paths, audioread when libsndfile refuses it."""
    try:
        sound = opened.soundfile()
    except (sf.SoundFileError, RuntimeError) as exc:
        reason = decoder_reason(exc)
        if opened.path is not None:
            fallback = _probe_with_audioread(opened.path)
            if isinstance(fallback, AudioInfo):
                return fallback
            reason = f"{reason}; {fallback}"
        raise VoxmillError(UNREADABLE, _unrecognised_message(opened, reason)) from exc
    return AudioInfo(
        sample_rate_hz=int(sound.samplerate),
        channels=int(sound.channels),
        frames=int(sound.frames),
        duration_s=int(sound.frames) / sound.samplerate if sound.samplerate > 0 else 0.0,
        format=str(sound.format),
        subtype=str(sound.subtype),
    )


def _probe_with_audioread(path: Path) -> AudioInfo | str:
    """The header according to audioread, or why audioread could not read it."""
    import audioread

    try:
        with audioread.audio_open(str(path)) as af:
            rate, channels, duration = int(af.samplerate), int(af.channels), float(af.duration)
    except audioread.NoBackendError:
        return _no_backend_reason()
    except Exception as exc:  # audioread backends raise a wide variety of errors
        return f"audioread: {str(exc) or type(exc).__name__}"
    return AudioInfo(
        sample_rate_hz=rate,
        channels=channels,
        frames=round(duration * rate),
        duration_s=duration,
        format=AUDIOREAD_FORMAT,
        subtype="PCM_16",
    )


# audioread's decoders beyond the standard library's WAV/AIFF/AU readers, in people's words.
_FALLBACK_DECODERS = {
    "FFmpegAudioFile": "ffmpeg",
    "GstAudioFile": "GStreamer",
    "MadAudioFile": "MAD",
    "ExtAudioFile": "Core Audio",
}


def _no_backend_reason() -> str:
    """Why audioread read nothing, saying which decoders it tried: "ffmpeg could not read it" is
    wrong advice on a machine without ffmpeg, where installing it is the fix."""
    import audioread

    names = [backend.__name__ for backend in audioread.available_backends()]
    tried = [_FALLBACK_DECODERS[name] for name in names if name in _FALLBACK_DECODERS]
    if not tried:
        return "no other decoder was tried: ffmpeg is not installed"
    return f"{' and '.join(tried)} could not read it either"


def _unrecognised_message(opened: Opened, reason: str) -> str:
    """'<name> is not a recognised audio file (...)', saying so when the content looks like text."""
    opened.stream.seek(0)
    head = opened.stream.read(_SNIFF_BYTES)
    hint = "it looks like a text file; " if _looks_like_text(head) else ""
    return f"{opened.name} is not a recognised audio file ({hint}decoder: {reason})"


def _looks_like_text(head: bytes) -> bool:
    """True when the first bytes decode as UTF-8 made of printable characters and whitespace."""
    if not head:
        return False
    text = head.decode("utf-8", errors="ignore")
    return len(text) >= len(head) // 2 and all(ch.isprintable() or ch.isspace() for ch in text)


def decoder_reason(exc: BaseException) -> str:
    """The decoder's own words, without the object repr soundfile puts in front."""
    reason = str(getattr(exc, "error_string", "") or exc).strip()
    return reason.rstrip(".") or type(exc).__name__


def check_rate(rate_hz: int, limits: AudioLimits) -> None:
    """Refuse a sample rate outside [min_sample_rate_hz, max_sample_rate_hz]."""
    if not limits.min_sample_rate_hz <= rate_hz <= limits.max_sample_rate_hz:
        raise VoxmillError(
            UNSUPPORTED_RATE,
            f"sample rate {rate_hz} Hz is not supported; "
            f"{limits.min_sample_rate_hz}-{limits.max_sample_rate_hz} Hz are",
        )


def check_not_too_long(duration_s: float, limits: AudioLimits) -> None:
    """Refuse a clip longer than `max_duration_s`."""
    if duration_s > limits.max_duration_s:
        raise VoxmillError(
            TOO_LONG,
            f"clip is {format_duration(duration_s)}; the limit is {format_duration(limits.max_duration_s)}",
        )


def check_decode_budget(info: AudioInfo, frames: int, limits: AudioLimits) -> None:
    """Refuse decoding `frames` of `info`'s channels when their float32 exceeds `max_decoded_bytes`."""
    if info.channels < 1:
        raise VoxmillError(UNREADABLE, f"the header says the clip has {info.channels} channels")
    need = frames * info.channels * SAMPLE_BYTES
    if need > limits.max_decoded_bytes:
        channels = f"{info.channels} channel{'' if info.channels == 1 else 's'}"
        raise VoxmillError(
            TOO_LARGE,
            f"decoding would take {format_bytes(need)} ({channels} at {info.sample_rate_hz} Hz "
            f"for {format_duration(frames / info.sample_rate_hz)}); "
            f"the limit is {format_bytes(limits.max_decoded_bytes)}",
        )


def budget_frames(channels: int, limits: AudioLimits) -> int:
    """The most frames of `channels` whose float32 fits in `max_decoded_bytes`."""
    return limits.max_decoded_bytes // (SAMPLE_BYTES * max(1, channels))
