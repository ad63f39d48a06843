"""Decode one clip into 16 kHz mono float32, refusing bad input with a stable `VoxmillError` code.

`load_audio` runs its checks cheapest first, so a bad clip is refused before it costs memory:

1. source: a path must be a regular file (FIFOs and devices are refused from `os.stat`, never
   opened in blocking mode), not empty, and at most `max_file_bytes`; raw bytes at most
   `max_payload_bytes`; a URL (`s3://`, `gs://`, `http(s)://`, `pipeline.storage`) is sized by one
   HEAD and refused the same way before a byte of it is read.
2. header (no decoding): libsndfile, or `audioread` as a fallback for paths; the sample rate must
   lie in the allowed range, the duration the header claims must not exceed `max_duration_s`, and
   its decode (frames x channels x 4 bytes of float32) must not exceed `max_decoded_bytes`.
3. decode: in blocks of about `DECODE_BLOCK_BYTES`, each checked and mixed down to mono before
   the next is read, so a clip costs its mono samples plus one block whatever its channel count.
   At most `max_duration_s` and `max_decoded_bytes` worth of frames is ever decoded, whatever the
   header said. libsndfile clamps a WAV whose header claims more data than the file holds, and
   returns the frames a truncated MP3 does hold; both are accepted as decoded. A decoder error
   mid-stream (e.g. an MP3 or FLAC frame followed by garbage) is `unreadable`.
4. samples (as decoded, before mixdown): no frames -> `empty`; NaN/Inf -> `non_finite`; a sample
   beyond `max_amplitude` (1.0 is full scale) -> `out_of_range`; shorter than `min_duration_s`
   (judged on the original frames and rate) -> `too_short`; every sample 0 -> `empty`.

A `Segment` (Kaldi `segments`, lhotse supervisions) decodes only [start_s, end_s) of a recording:
a seek, then the segment's frames; the duration limits judge the segment, not the recording, and
`channel` picks one channel instead of the mean. A segment starting at or after the recording's
end is `empty`; an end past it is clamped (Kaldi's segments often run a few ms over).
"""

from __future__ import annotations

import io
import math
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import soundfile as sf
import soxr

from pipeline.errors import (
    BAD_REQUEST,
    EMPTY,
    NON_FINITE,
    NOT_FOUND,
    OUT_OF_RANGE,
    TOO_LARGE,
    TOO_LONG,
    TOO_SHORT,
    UNREADABLE,
    UNSUPPORTED_RATE,
    VoxmillError,
)
from pipeline.paths import ConfinedPath, open_confined
from pipeline.settings import AudioLimits
from pipeline.storage import fetch_checked, is_url
from pipeline.units import format_bytes, format_duration

TARGET_RATE_HZ = 16000
# soxr recipe. Against torchaudio's sinc resampler both 'HQ' and 'VHQ' agree to > 45 dB below
# 6 kHz and differ only in torchaudio's wide transition band; 'HQ' lands marginally nearer.
RESAMPLE_QUALITY = "HQ"
# `AudioInfo.format` of a clip that only the audioread fallback could open.
AUDIOREAD_FORMAT = "audioread"

FloatArray = npt.NDArray[np.float32]
# A ConfinedPath (a worker's job or utterance) is opened without a window (`pipeline.paths`).
Source = str | Path | bytes | ConfinedPath

# Decoded float32 per block: each block is checked and mixed down before the next is read.
DECODE_BLOCK_BYTES = 4 * 1024 * 1024
_SAMPLE_BYTES = 4  # a decoded sample is float32

_SNIFF_BYTES = 512
_PAYLOAD_NAME = "payload"


@dataclass(frozen=True)
class AudioInfo:
    """What the file header says, read without decoding the samples."""

    sample_rate_hz: int
    channels: int
    frames: int
    duration_s: float
    format: str
    subtype: str


@dataclass(frozen=True)
class Audio:
    """A decoded clip: `samples` is float32 [N], mono, at `TARGET_RATE_HZ`.

    `codec` names the source's container and encoding as `format/subtype` in libsndfile's words
    (`WAV/PCM_16`, `FLAC/PCM_24`, `OGG/VORBIS`, `MP3/MPEG_LAYER_III`), or `audioread` for a file
    only the fallback decoder could open.
    """

    samples: FloatArray
    source_rate_hz: int
    channels: int
    codec: str = ""

    @property
    def duration_s(self) -> float:
        """Length in seconds at 16 kHz."""
        return len(self.samples) / TARGET_RATE_HZ


@dataclass(frozen=True)
class Segment:
    """The part of a recording an utterance is: [start_s, end_s) (None: to the end), one channel
    (None: the mean of all)."""

    start_s: float = 0.0
    end_s: float | None = None
    channel: int | None = None


@dataclass
class _Opened:
    """An open source: the stream to decode, a name for messages and, for paths, the path.

    `sound`: libsndfile's handle, opened once for the header and kept for the decode.
    """

    stream: BinaryIO
    name: str
    path: Path | None
    sound: sf.SoundFile | None = None

    def soundfile(self) -> sf.SoundFile:
        """libsndfile's handle on the stream (sf.SoundFileError or RuntimeError when it refuses it)."""
        if self.sound is None:
            self.stream.seek(0)
            if self.path is None:
                self.sound = sf.SoundFile(self.stream)
            else:  # a regular file: libsndfile reads its descriptor itself, not through Python calls
                fd = self.stream.fileno()
                os.lseek(fd, 0, os.SEEK_SET)
                self.sound = sf.SoundFile(fd, closefd=False)
        return self.sound

    def close(self) -> None:
        if self.sound is not None:
            self.sound.close()
            self.sound = None


# --------------------------------------------------------------------------- public API


def probe_audio(source: Source, limits: AudioLimits) -> AudioInfo:
    """Check a path or bytes up to the header (size, format, rate, duration); decode nothing."""
    with _open_source(source, limits) as opened:
        return _probe(opened, limits)


def load_audio(
    source: Source,
    limits: AudioLimits,
    timings_ms: dict[str, float] | None = None,
    segment: Segment | None = None,
) -> Audio:
    """Decode a path, URL or bytes to float32 [N] mono at 16 kHz after every check (module
    docstring); with `segment`, only that part of it.

    With `timings_ms`, the milliseconds spent are added to its `decode` (open, header, decode,
    checks, mixdown) and `resample` entries.
    """
    started = time.perf_counter()
    with _open_source(source, limits) as opened:
        if segment is None:
            info = _probe(opened, limits)
            mixed = _decode(opened, info, limits)
        else:
            info, mixed = _decode_segment(opened, limits, segment)
    _check_frames(mixed.frames, mixed.non_finite, mixed.peak, info.sample_rate_hz, limits)
    mono = mixed.mono()
    decoded_at = time.perf_counter()
    samples = resample(mono, info.sample_rate_hz)
    resampled_at = time.perf_counter()
    _check_not_silent(samples)
    if timings_ms is not None:
        _add_ms(timings_ms, "decode", started, decoded_at)
        _add_ms(timings_ms, "resample", decoded_at, resampled_at)
    return Audio(
        samples=samples, source_rate_hz=info.sample_rate_hz, channels=info.channels, codec=codec_name(info)
    )


def codec_name(info: AudioInfo) -> str:
    """`format/subtype` of a probed header (`Audio.codec`)."""
    return AUDIOREAD_FORMAT if info.format == AUDIOREAD_FORMAT else f"{info.format}/{info.subtype}"


def _add_ms(timings_ms: dict[str, float], stage: str, started: float, ended: float) -> None:
    """Add the milliseconds between two `perf_counter` readings to `timings_ms[stage]`."""
    timings_ms[stage] = round(timings_ms.get(stage, 0.0) + (ended - started) * 1000.0, 3)


def to_mono(samples_2d: npt.NDArray[np.floating[Any]], out: FloatArray | None = None) -> FloatArray:
    """Mix float [frames, channels] down to float32 [frames] by the channel mean (into `out`, a
    float32 [frames], when given: the same numbers)."""
    if samples_2d.ndim != 2:
        raise ValueError(f"expected [frames, channels], got shape {samples_2d.shape}")
    if out is None:
        out = np.empty(samples_2d.shape[0], dtype=np.float32)
    if samples_2d.shape[1] == 1:
        out[:] = samples_2d[:, 0]
        return out
    if samples_2d.shape[1] == 2:
        # Bit-identical to the mean ((a + b) / 2 in float32), without numpy's slow reduction over a
        # 2-wide axis (about 15x faster on 44.1 kHz stereo).
        np.add(samples_2d[:, 0], samples_2d[:, 1], out=out, dtype=np.float32)
        out /= np.float32(2.0)
        return out
    samples_2d.mean(axis=1, dtype=np.float32, out=out)
    return out


def resample(samples: FloatArray, from_hz: int, to_hz: int = TARGET_RATE_HZ) -> FloatArray:
    """Resample float32 [N] from `from_hz` to `to_hz` with soxr; returns round(N * to/from) samples."""
    mono = np.ascontiguousarray(samples, dtype=np.float32)
    if from_hz == to_hz:
        return mono
    out: FloatArray = soxr.resample(mono, from_hz, to_hz, quality=RESAMPLE_QUALITY)
    return np.ascontiguousarray(out, dtype=np.float32)


def check_samples(samples: FloatArray, limits: AudioLimits) -> None:
    """Refuse float32 [N] 16 kHz mono samples that are empty, non-finite, beyond `max_amplitude`,
    too short or all zero."""
    if samples.ndim != 1:
        raise VoxmillError(BAD_REQUEST, f"expected mono samples of shape [N], got shape {samples.shape}")
    non_finite, peak = _scan(samples)
    _check_frames(len(samples), non_finite, peak, TARGET_RATE_HZ, limits)
    _check_not_silent(samples)


# --------------------------------------------------------------------------- opening sources


@contextmanager
def _open_source(source: Source, limits: AudioLimits) -> Iterator[_Opened]:
    """Yield a seekable stream over a checked path or payload; closes what it opened."""
    with _open_stream(source, limits) as opened:
        try:
            yield opened
        finally:
            opened.close()


@contextmanager
def _open_stream(source: Source, limits: AudioLimits) -> Iterator[_Opened]:
    if isinstance(source, bytes | bytearray):
        _check_payload(bytes(source), limits)
        yield _Opened(io.BytesIO(source), _PAYLOAD_NAME, None)
        return
    if isinstance(source, str) and is_url(source):
        with _open_url(source, limits) as stream:
            yield _Opened(stream, source, None)
        return
    if isinstance(source, ConfinedPath):
        stream = _open_regular_file(source, limits)
        with stream:
            # audioread (the fallback decoder) opens a path by itself: give it the descriptor's
            # name under /proc, which reaches the file opened here and nothing else.
            yield _Opened(stream, str(source), _descriptor_path(stream.fileno()))
        return
    path = Path(source)
    stream = _open_regular_file(path, limits)
    with stream:
        yield _Opened(stream, str(path), path)


def _open_url(url: str, limits: AudioLimits) -> BinaryIO:
    """A stream over an object whose size is checked like a file's before its bytes are read."""
    size, stream = fetch_checked(url, limits.max_file_bytes)
    if size == 0:
        raise VoxmillError(EMPTY, f"{url} is empty (0 bytes)")
    if stream is None:
        raise VoxmillError(
            TOO_LARGE, f"object is {format_bytes(size)}; the limit is {format_bytes(limits.max_file_bytes)}"
        )
    return stream


def _check_payload(payload: bytes, limits: AudioLimits) -> None:
    """Refuse an empty payload or one over `max_payload_bytes`."""
    if not payload:
        raise VoxmillError(EMPTY, "payload is empty (0 bytes)")
    if len(payload) > limits.max_payload_bytes:
        size, limit = format_bytes(len(payload)), format_bytes(limits.max_payload_bytes)
        raise VoxmillError(TOO_LARGE, f"payload is {size}; the limit is {limit}")


def _open_regular_file(source: Path | ConfinedPath, limits: AudioLimits) -> BinaryIO:
    """Open `source` for reading after a stat shows a regular, non-empty file within the size
    limit: `os.stat` for a plain path, the walk's `lstat` for a `ConfinedPath`, which is opened
    from its root without following a symlink (`pipeline.paths.open_confined`)."""
    path = source.path if isinstance(source, ConfinedPath) else source
    if isinstance(source, ConfinedPath):
        fd = open_confined(source, lambda st: _check_file_stat(st, path, limits))
    else:
        _check_file_stat(_stat(path), path, limits)
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, open still returns at
        # once, and the fstat below refuses it; for regular files the flag changes nothing.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:  # removed since the stat
            raise VoxmillError(NOT_FOUND, f"no such file: {path}") from exc
        except OSError as exc:
            raise VoxmillError(UNREADABLE, f"cannot open {path}: {exc.strerror or exc}") from exc
    try:
        _check_file_stat(os.fstat(fd), path, limits)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _descriptor_path(fd: int) -> Path | None:
    """A name that opens exactly the file behind `fd` (this process's /proc entry, which a
    decoder's subprocess may open too); None where there is no /proc."""
    name = Path(f"/proc/{os.getpid()}/fd/{fd}")
    return name if os.path.exists(name) else None


def _stat(path: Path) -> os.stat_result:
    """`os.stat` with its failures turned into voxmill errors."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise VoxmillError(NOT_FOUND, f"no such file: {path}") from exc
    except ValueError as exc:  # embedded NUL byte
        raise VoxmillError(BAD_REQUEST, f"invalid path {str(path)!r}: {exc}") from exc
    except OSError as exc:
        raise VoxmillError(UNREADABLE, f"cannot read {path}: {exc.strerror or exc}") from exc


def _check_file_stat(st: os.stat_result, path: Path, limits: AudioLimits) -> None:
    """Refuse directories, non-regular files, empty files and files over `max_file_bytes`."""
    if stat.S_ISDIR(st.st_mode):
        raise VoxmillError(UNREADABLE, f"{path} is a directory, not an audio file")
    if not stat.S_ISREG(st.st_mode):
        raise VoxmillError(UNREADABLE, f"{path} is not a regular file ({_file_kind(st.st_mode)})")
    if st.st_size == 0:
        raise VoxmillError(EMPTY, f"{path} is empty (0 bytes)")
    if st.st_size > limits.max_file_bytes:
        raise VoxmillError(
            TOO_LARGE,
            f"file is {format_bytes(st.st_size)}; the limit is {format_bytes(limits.max_file_bytes)}",
        )


def _file_kind(mode: int) -> str:
    """A word for a non-regular file type."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "not a plain file")


# --------------------------------------------------------------------------- header


def _probe(opened: _Opened, limits: AudioLimits) -> AudioInfo:
    """Read the header (libsndfile, else audioread for paths) and check rate, duration and the
    decode's size."""
    info = _probe_header(opened)
    _check_rate(info.sample_rate_hz, limits)
    _check_not_too_long(info.duration_s, limits)
    _check_decode_budget(info, info.frames, limits)
    return info


def _probe_header(opened: _Opened) -> AudioInfo:
    """Header of the stream via libsndfile; for paths, audioread when libsndfile refuses it."""
    try:
        sound = opened.soundfile()
    except (sf.SoundFileError, RuntimeError) as exc:
        reason = _decoder_reason(exc)
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
        return "no other decoder (ffmpeg) could read it either"
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


def _unrecognised_message(opened: _Opened, reason: str) -> str:
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


def _decoder_reason(exc: BaseException) -> str:
    """The decoder's own words, without the object repr soundfile puts in front."""
    reason = str(getattr(exc, "error_string", "") or exc).strip()
    return reason.rstrip(".") or type(exc).__name__


def _check_rate(rate_hz: int, limits: AudioLimits) -> None:
    """Refuse a sample rate outside [min_sample_rate_hz, max_sample_rate_hz]."""
    if not limits.min_sample_rate_hz <= rate_hz <= limits.max_sample_rate_hz:
        raise VoxmillError(
            UNSUPPORTED_RATE,
            f"sample rate {rate_hz} Hz is not supported; "
            f"{limits.min_sample_rate_hz}-{limits.max_sample_rate_hz} Hz are",
        )


def _check_not_too_long(duration_s: float, limits: AudioLimits) -> None:
    """Refuse a clip longer than `max_duration_s`."""
    if duration_s > limits.max_duration_s:
        raise VoxmillError(
            TOO_LONG,
            f"clip is {format_duration(duration_s)}; the limit is {format_duration(limits.max_duration_s)}",
        )


def _check_decode_budget(info: AudioInfo, frames: int, limits: AudioLimits) -> None:
    """Refuse decoding `frames` of `info`'s channels when their float32 exceeds `max_decoded_bytes`."""
    if info.channels < 1:
        raise VoxmillError(UNREADABLE, f"the header says the clip has {info.channels} channels")
    need = frames * info.channels * _SAMPLE_BYTES
    if need > limits.max_decoded_bytes:
        channels = f"{info.channels} channel{'' if info.channels == 1 else 's'}"
        raise VoxmillError(
            TOO_LARGE,
            f"decoding would take {format_bytes(need)} ({channels} at {info.sample_rate_hz} Hz "
            f"for {format_duration(frames / info.sample_rate_hz)}); "
            f"the limit is {format_bytes(limits.max_decoded_bytes)}",
        )


def _budget_frames(channels: int, limits: AudioLimits) -> int:
    """The most frames of `channels` whose float32 fits in `max_decoded_bytes`."""
    return limits.max_decoded_bytes // (_SAMPLE_BYTES * max(1, channels))


# --------------------------------------------------------------------------- decoding


class _Mixdown:
    """A clip decoded block by block: its mono float32 samples and what the sample checks need.

    Each block [frames, channels] is scanned (non-finite count, peak magnitude) as decoded, then
    mixed down (`to_mono`: per frame, so the same numbers as one call over the whole clip) or,
    with `channel`, only that channel kept. A mono source is decoded straight into the samples
    (`next_frames`, then `keep`).
    """

    def __init__(self, expected_frames: int, channel: int | None = None) -> None:
        self.samples: FloatArray = np.empty(max(0, expected_frames), dtype=np.float32)
        self.frames = 0
        self.non_finite = 0
        self.peak = 0.0
        self.channel = channel

    def add(self, block: FloatArray) -> None:
        """Scan float32 [frames, channels] and append its mono samples."""
        if self.channel is not None:
            block = block[:, self.channel : self.channel + 1]
        # samples that overflow the mean (3e38) are out of range: the clip is refused after
        with np.errstate(over="ignore", invalid="ignore"):
            to_mono(block, self.next_frames(block.shape[0])[:, 0])
        self._scan(block)
        self.frames += block.shape[0]

    def next_frames(self, frames: int) -> FloatArray:
        """The next `frames` samples, as float32 [frames, 1], for a mono source to be decoded into."""
        end = self.frames + frames
        if end > len(self.samples):  # the header understated the length: grow (virtual until written)
            grown = np.empty(max(end, 2 * len(self.samples)), dtype=np.float32)
            grown[: self.frames] = self.samples[: self.frames]
            self.samples = grown
        return self.samples[self.frames : end].reshape(-1, 1)

    def keep(self, frames: int) -> None:
        """Take the first `frames` decoded into `next_frames` as samples."""
        self._scan(self.samples[self.frames : self.frames + frames])
        self.frames += frames

    def mono(self) -> FloatArray:
        """The mono samples so far, float32 [frames]."""
        return self.samples[: self.frames]

    def _scan(self, decoded: FloatArray) -> None:
        non_finite, peak = _scan(decoded)
        self.non_finite += non_finite
        self.peak = max(self.peak, peak)


def _block_frames(channels: int) -> int:
    """Frames per decoded block of `channels`."""
    return max(1, DECODE_BLOCK_BYTES // (_SAMPLE_BYTES * max(1, channels)))


def _decode(opened: _Opened, info: AudioInfo, limits: AudioLimits) -> _Mixdown:
    """Decode and mix down, never more than `max_duration_s` nor `max_decoded_bytes` (+1 frame)."""
    by_duration = math.floor(limits.max_duration_s * info.sample_rate_hz) + 1
    by_budget = _budget_frames(info.channels, limits) + 1
    cap = min(by_duration, by_budget)
    mixed = _Mixdown(min(info.frames, cap))
    if info.format == AUDIOREAD_FORMAT and opened.path is not None:
        _decode_with_audioread(opened.path, info.channels, cap, mixed)
    else:
        _decode_with_soundfile(opened, cap, mixed)
    if mixed.frames >= cap:  # the header understated the length
        said = format_duration(info.duration_s)
        if by_duration <= by_budget:
            raise VoxmillError(
                TOO_LONG,
                f"clip is longer than its header says ({said}); "
                f"the limit is {format_duration(limits.max_duration_s)}",
            )
        raise VoxmillError(
            TOO_LARGE,
            f"clip is longer than its header says ({said}): decoding would take more than "
            f"{format_bytes(limits.max_decoded_bytes)}, the limit",
        )
    return mixed


def _decode_segment(opened: _Opened, limits: AudioLimits, segment: Segment) -> tuple[AudioInfo, _Mixdown]:
    """The header and the mixed-down frames of `segment` only."""
    info = _probe_header(opened)
    _check_rate(info.sample_rate_hz, limits)
    rate = info.sample_rate_hz
    first = max(0, round(segment.start_s * rate))
    last = info.frames if segment.end_s is None else min(info.frames, round(segment.end_s * rate))
    if first >= info.frames:
        raise VoxmillError(
            EMPTY,
            f"segment starts at {segment.start_s:g} s, after the end of {opened.name} "
            f"({format_duration(info.duration_s)})",
        )
    if segment.channel is not None and not 0 <= segment.channel < info.channels:
        raise VoxmillError(
            BAD_REQUEST, f"channel {segment.channel} asked of {opened.name}, which has {info.channels}"
        )
    _check_not_too_long((last - first) / rate, limits)
    _check_decode_budget(info, last - first, limits)
    mixed = _Mixdown(last - first, segment.channel)
    if info.format == AUDIOREAD_FORMAT and opened.path is not None:
        _decode_with_audioread(opened.path, info.channels, last - first, mixed, first)
    else:
        _decode_with_soundfile(opened, last - first, mixed, first)
    return info, mixed


def _decode_with_soundfile(opened: _Opened, cap: int, mixed: _Mixdown, first: int = 0) -> None:
    """Up to `cap` frames (from frame `first`, never past the frames the header gives) into `mixed`;
    decoder errors become `unreadable`."""
    try:
        sound = opened.soundfile()  # the handle the header was read with
        if first:  # a segment: never decode what comes before it
            sound.seek(first)
        # A FLAC followed by junk fails in the junk when asked for more than its header gives.
        limit = min(cap, sound.frames - first)
        block_frames = max(0, min(limit, _block_frames(sound.channels)))
        mono = sound.channels == 1  # decoded straight into the samples: no block
        block: FloatArray = np.empty((0 if mono else block_frames, sound.channels), dtype=np.float32)
        while mixed.frames < limit:
            wanted = min(block_frames, limit - mixed.frames)
            if mono:
                got = _read_into(sound, mixed.next_frames(wanted))
                mixed.keep(got)
            else:
                got = _read_into(sound, block[:wanted])
                mixed.add(block[:got])
            if got < wanted:
                break
    except (sf.SoundFileError, RuntimeError) as exc:
        raise VoxmillError(
            UNREADABLE, f"{opened.name} could not be decoded ({_decoder_reason(exc)})"
        ) from exc


def _read_into(sound: sf.SoundFile, out: FloatArray) -> int:
    """Decode the next frames of `sound` into C-contiguous float32 [n, channels] `out`; how many.

    libsndfile's own sequential read, through soundfile's handles: `SoundFile.read` seeks to where
    it stopped after every call, and that seek restarts an MP3 decoder, whose samples then differ
    slightly from those of one read of the whole clip.
    """
    frames = sf._snd.sf_readf_float(sound._file, sf._ffi.from_buffer("float[]", out), out.shape[0])
    sf._error_check(sound._errorcode)
    return int(frames)


def _decode_with_audioread(path: Path, channels: int, cap: int, mixed: _Mixdown, first: int = 0) -> None:
    """Up to `cap` frames (after skipping `first`) via audioread (16-bit PCM) into `mixed`."""
    import audioread

    frame_bytes = 2 * channels
    block_bytes = frame_bytes * _block_frames(channels)
    pending = bytearray()  # decoded bytes not yet mixed down (at most a block and a chunk)
    skip = first
    try:
        with audioread.audio_open(str(path)) as af:
            for chunk in af:
                pending += chunk
                if len(pending) >= block_bytes:
                    skip = _mix_pcm16(pending, channels, cap, mixed, skip)
                    if mixed.frames >= cap:
                        return
    except Exception as exc:  # audioread backends raise a wide variety of errors
        reason = str(exc) or type(exc).__name__
        raise VoxmillError(UNREADABLE, f"{path} could not be decoded (audioread: {reason})") from exc
    _mix_pcm16(pending, channels, cap, mixed, skip)


def _mix_pcm16(pending: bytearray, channels: int, cap: int, mixed: _Mixdown, skip: int) -> int:
    """Mix the whole frames of little-endian int16 `pending` into `mixed` (up to `cap` frames,
    after skipping `skip`), keeping a partial frame in `pending`; returns the frames still to skip."""
    whole = len(pending) // (2 * channels)
    skipped = min(skip, whole)
    taken = min(whole - skipped, max(0, cap - mixed.frames))
    if taken:
        pcm = np.frombuffer(pending, dtype="<i2", count=(skipped + taken) * channels)
        block = pcm.reshape(-1, channels)[skipped:].astype(np.float32) / np.float32(32768.0)
        del pcm  # no view of `pending` may outlive this: it is resized below
        mixed.add(block)
    del pending[: whole * 2 * channels]
    return skip - skipped


# --------------------------------------------------------------------------- sample checks


def _scan(samples: FloatArray) -> tuple[int, float]:
    """(NaN/Inf count, largest magnitude) of float samples of any shape: a min and a max, and a
    count only when one of them is not finite."""
    if samples.size == 0:
        return 0, 0.0
    low, high = float(samples.min()), float(samples.max())
    if math.isfinite(low) and math.isfinite(high):
        return 0, max(-low, high)
    return int(samples.size - np.count_nonzero(np.isfinite(samples))), math.inf


def _check_frames(frames: int, non_finite: int, peak: float, rate_hz: int, limits: AudioLimits) -> None:
    """Refuse a clip of `frames` with no frames, any NaN/Inf, a sample beyond `max_amplitude`, or
    under `min_duration_s` (`_scan` gives `non_finite` and `peak`)."""
    if frames == 0:
        raise VoxmillError(EMPTY, "clip has no audio frames")
    if non_finite:
        raise VoxmillError(NON_FINITE, f"clip has {non_finite} non-finite samples (NaN or Inf)")
    if peak > limits.max_amplitude:
        raise VoxmillError(
            OUT_OF_RANGE,
            f"clip has a sample of magnitude {peak:.3g}; the limit is {limits.max_amplitude:g} "
            "(1.0 is full scale): numbers, not audio",
        )
    duration_s = frames / rate_hz
    if duration_s < limits.min_duration_s - 1e-9:
        raise VoxmillError(
            TOO_SHORT,
            f"clip is {format_duration(duration_s)}; "
            f"at least {format_duration(limits.min_duration_s)} of audio is needed",
        )


def _check_not_silent(samples: FloatArray) -> None:
    """Refuse [N] samples that are all exactly zero (or none at all after resampling)."""
    if samples.size == 0:
        raise VoxmillError(EMPTY, "clip has no audio frames")
    if not np.any(samples):
        raise VoxmillError(EMPTY, "clip is digital silence (every sample is 0)")
