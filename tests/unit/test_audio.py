"""Decoding, resampling and every refusal of `pipeline.audio`."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio import decode, header, sources
from pipeline.audio.decode import (
    TARGET_RATE_HZ,
    Audio,
    ClipRefused,
    Segment,
    check_samples,
    load_audio,
    resample,
    to_mono,
)
from pipeline.audio.header import AUDIOREAD_FORMAT, AudioInfo, probe_audio
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
from pipeline.settings import AudioLimits

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
LIMITS = AudioLimits()


def sine(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.5, channels: int = 1) -> np.ndarray:
    """float32 [frames] (or [frames, channels]) sine wave."""
    t = np.arange(round(rate * seconds)) / rate
    wave = (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return wave if channels == 1 else np.repeat(wave[:, None], channels, axis=1)


def write(path: Path, data: np.ndarray, rate: int, **kwargs: Any) -> Path:
    sf.write(path, data, rate, **kwargs)
    return path


def dominant_hz(samples: np.ndarray, rate: int = TARGET_RATE_HZ) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


def refused(source: str | Path | bytes, code: str, limits: AudioLimits = LIMITS) -> VoxmillError:
    with pytest.raises(VoxmillError) as info:
        load_audio(source, limits)
    assert info.value.code == code, info.value.message
    return info.value


def fake_header(monkeypatch: pytest.MonkeyPatch, frames: int) -> None:
    """libsndfile's header of every clip opened from now on says `frames` (decoding reads the file)."""
    real = sources.Opened.soundfile

    def soundfile(self: Any) -> Any:
        sound = real(self)
        fields = {name: getattr(sound, name) for name in ("samplerate", "channels", "format", "subtype")}
        return SimpleNamespace(**fields, frames=frames, seek=sound.seek, read=sound.read)

    monkeypatch.setattr(sources.Opened, "soundfile", soundfile)


def refuse_header(monkeypatch: pytest.MonkeyPatch, refuse: Any) -> None:
    """Opening a clip with libsndfile calls `refuse` instead."""
    monkeypatch.setattr(sources.Opened, "soundfile", lambda self: refuse())


def forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every decoding entry point fail the test."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("samples were decoded")

    monkeypatch.setattr(sf, "read", boom)
    monkeypatch.setattr(sf.SoundFile, "read", boom)
    monkeypatch.setattr(decode, "_read_into", boom)
    monkeypatch.setattr(decode, "_decode_with_audioread", boom)


# --------------------------------------------------------------------------- formats and rates

FORMATS = [
    pytest.param("wav", {"subtype": "PCM_U8"}, 1e-2, id="wav-PCM_U8"),
    pytest.param("wav", {"subtype": "PCM_16"}, 1e-3, id="wav-PCM_16"),
    pytest.param("wav", {"subtype": "PCM_24"}, 1e-3, id="wav-PCM_24"),
    pytest.param("wav", {"subtype": "PCM_32"}, 1e-3, id="wav-PCM_32"),
    pytest.param("wav", {"subtype": "FLOAT"}, 1e-3, id="wav-FLOAT"),
    pytest.param("wav", {"subtype": "DOUBLE"}, 1e-3, id="wav-DOUBLE"),
    pytest.param("flac", {"format": "FLAC"}, 1e-3, id="flac"),
    pytest.param("ogg", {"format": "OGG", "subtype": "VORBIS"}, 0.05, id="ogg-vorbis"),
    pytest.param("mp3", {"format": "MP3"}, 0.05, id="mp3"),
]


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
@pytest.mark.parametrize(("ext", "kwargs", "rms_tol"), FORMATS)
def test_format_and_rate_matrix(
    tmp_path: Path, ext: str, kwargs: dict[str, str], rms_tol: float, rate: int
) -> None:
    seconds = 0.5
    path = write(tmp_path / f"sine.{ext}", sine(rate, seconds), rate, **kwargs)
    clip = load_audio(path, LIMITS)
    assert isinstance(clip, Audio)
    assert clip.samples.dtype == np.float32
    assert clip.samples.ndim == 1
    assert clip.source_rate_hz == rate
    assert clip.channels == 1
    assert abs(len(clip.samples) - seconds * TARGET_RATE_HZ) <= 1
    assert clip.duration_s == pytest.approx(seconds, abs=1 / TARGET_RATE_HZ)
    assert abs(dominant_hz(clip.samples) - 440.0) <= 2.0
    assert rms(clip.samples[800:-800]) == pytest.approx(0.5 / np.sqrt(2), abs=rms_tol)


@pytest.mark.parametrize(("ext", "kwargs", "rms_tol"), FORMATS)
def test_formats_at_16k_need_no_resampling(
    tmp_path: Path, ext: str, kwargs: dict[str, str], rms_tol: float
) -> None:
    path = write(tmp_path / f"sine.{ext}", sine(16000, 0.5), 16000, **kwargs)
    clip = load_audio(path, LIMITS)
    assert len(clip.samples) == 8000
    assert abs(dominant_hz(clip.samples) - 440.0) <= 2.0
    assert rms(clip.samples[800:-800]) == pytest.approx(0.5 / np.sqrt(2), abs=rms_tol)


def test_16k_pcm16_is_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    pcm = rng.integers(-32768, 32767, size=4000, dtype=np.int16)
    path = write(tmp_path / "exact.wav", pcm, 16000, subtype="PCM_16")
    clip = load_audio(path, LIMITS)
    assert clip.samples.dtype == np.float32
    np.testing.assert_array_equal(clip.samples, pcm.astype(np.float32) / np.float32(32768))


def test_192k_is_supported(tmp_path: Path) -> None:
    path = write(tmp_path / "hi.wav", sine(192000, 0.25), 192000, subtype="PCM_24")
    clip = load_audio(path, LIMITS)
    assert clip.source_rate_hz == 192000
    assert len(clip.samples) == 4000
    assert abs(dominant_hz(clip.samples) - 440.0) <= 4.0


@pytest.mark.parametrize(
    ("ext", "kwargs"),
    [("wav", {"subtype": "PCM_16"}), ("flac", {"format": "FLAC"}), ("mp3", {"format": "MP3"})],
)
def test_bytes_give_the_same_samples_as_the_path(tmp_path: Path, ext: str, kwargs: dict[str, str]) -> None:
    path = write(tmp_path / f"sine.{ext}", sine(22050, 0.3), 22050, **kwargs)
    from_path = load_audio(path, LIMITS)
    from_bytes = load_audio(path.read_bytes(), LIMITS)
    np.testing.assert_array_equal(from_bytes.samples, from_path.samples)
    assert from_bytes.source_rate_hz == from_path.source_rate_hz == 22050


def test_str_path_is_accepted(tmp_path: Path) -> None:
    path = write(tmp_path / "sine.wav", sine(16000, 0.2), 16000)
    np.testing.assert_array_equal(load_audio(str(path), LIMITS).samples, load_audio(path, LIMITS).samples)


def test_stereo_mixdown_is_the_channel_mean(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    stereo = rng.uniform(-0.5, 0.5, size=(3200, 2)).astype(np.float32)
    path = write(tmp_path / "stereo.wav", stereo, 16000, subtype="FLOAT")
    clip = load_audio(path, LIMITS)
    assert clip.channels == 2
    np.testing.assert_allclose(clip.samples, (stereo[:, 0] + stereo[:, 1]) / 2, rtol=0, atol=1e-7)


def test_to_mono_shapes() -> None:
    one = np.arange(6, dtype=np.float64).reshape(6, 1)
    np.testing.assert_array_equal(to_mono(one), np.arange(6, dtype=np.float32))
    assert to_mono(one).dtype == np.float32
    three = np.array([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]], dtype=np.float32)
    np.testing.assert_allclose(to_mono(three), [3.0, 1.0])
    with pytest.raises(ValueError):
        to_mono(np.zeros(4, dtype=np.float32))


def test_resample_identity_and_length() -> None:
    x = sine(16000, 0.1)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x)
    y = resample(sine(44100, 1.0), 44100)
    assert y.dtype == np.float32 and len(y) == 16000
    assert len(resample(np.zeros(12345, dtype=np.float32), 22050)) == round(12345 * 16000 / 22050)


def test_probe_reads_the_header_without_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "s.flac", sine(22050, 0.5, channels=2), 22050, format="FLAC")
    forbid_decoding(monkeypatch)
    info = probe_audio(path, LIMITS)
    assert info == AudioInfo(
        sample_rate_hz=22050, channels=2, frames=11025, duration_s=0.5, format="FLAC", subtype="PCM_16"
    )
    assert probe_audio(path.read_bytes(), LIMITS) == info


# --------------------------------------------------------------------------- resampler parity


def test_resampler_parity_with_torchaudio_reference() -> None:
    """soxr vs the torchaudio sinc reference; the fixture is broadband noise up to ~11 kHz.

    Below 6 kHz the two agree closely; between 6 and 8 kHz they differ by design: torchaudio's
    hann-windowed sinc (rolloff 0.99, width 6) starts attenuating early and lets the band near
    8 kHz alias in, while soxr is flat and steep. So the full-band numbers are loose and the
    in-band number is tight.
    """
    clip = load_audio(FIXTURES / "stereo44k_2s.wav", LIMITS)
    reference = np.load(FIXTURES / "stereo44k_2s.resampled16k.npy")
    assert clip.source_rate_hz == 44100 and clip.channels == 2
    assert clip.samples.shape == reference.shape == (32000,)
    middle = slice(1600, -1600)
    diff = clip.samples[middle] - reference[middle]
    max_diff = float(np.max(np.abs(diff)))
    snr_db = 10 * np.log10(np.sum(reference[middle] ** 2) / np.sum(diff**2))
    ours, ref = np.fft.rfft(clip.samples), np.fft.rfft(reference)
    band = np.fft.rfftfreq(len(reference), 1 / TARGET_RATE_HZ) < 6000
    error = ref[band] - ours[band]
    in_band_snr_db = 10 * np.log10(np.sum(np.abs(ref[band]) ** 2) / np.sum(np.abs(error) ** 2))
    print(
        f"soxr vs torchaudio: max|diff| {max_diff:.4f}, SNR {snr_db:.2f} dB, <6 kHz {in_band_snr_db:.2f} dB"
    )
    assert max_diff < 0.15
    assert snr_db > 15.0
    assert in_band_snr_db > 45.0


# --------------------------------------------------------------------------- path refusals


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    error = refused(tmp_path / "nope.wav", NOT_FOUND)
    assert error.message == f"no such file: {tmp_path / 'nope.wav'}"


def test_missing_parent_that_is_a_file_is_not_found(tmp_path: Path) -> None:
    parent = tmp_path / "file"
    parent.write_bytes(b"x")
    refused(parent / "child.wav", NOT_FOUND)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    error = refused(tmp_path, UNREADABLE)
    assert error.message == f"{tmp_path} is a directory, not an audio file"


@pytest.mark.timeout(20)
def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    outcome: dict[str, BaseException] = {}

    def attempt() -> None:
        try:
            load_audio(fifo, LIMITS)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=5)
    if worker.is_alive():  # release a reader stuck in open() before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_audio blocked on a FIFO")
    error = outcome["error"]
    assert isinstance(error, VoxmillError) and error.code == UNREADABLE
    assert "FIFO" in error.message


def test_character_device_is_unreadable() -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    error = refused("/dev/zero", UNREADABLE)
    assert "character device" in error.message


def test_nul_byte_in_path_is_a_bad_request() -> None:
    refused("clip\x00.wav", BAD_REQUEST)


def test_zero_byte_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "zero.wav"
    path.write_bytes(b"")
    assert "0 bytes" in refused(path, EMPTY).message


def test_file_over_the_size_limit_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "big.wav", sine(16000, 0.1), 16000)  # 3244 bytes
    refuse_header(monkeypatch, lambda: pytest.fail("the header was read"))
    forbid_decoding(monkeypatch)
    error = refused(path, TOO_LARGE, AudioLimits(max_file_bytes=1024))
    assert error.message == "file is 3.2 KB; the limit is 1.0 KB"


def test_size_limit_message_uses_readable_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "big.wav", sine(16000, 0.1), 16000)
    real_stat = os.stat

    def huge_stat(p: Any, *args: Any, **kwargs: Any) -> Any:
        st = real_stat(p, *args, **kwargs)
        if os.fspath(p) != os.fspath(path):
            return st
        fields = list(st)
        fields[6] = 2 * 1024**3  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", huge_stat)
    error = refused(path, TOO_LARGE)
    assert error.message == "file is 2.0 GB; the limit is 256 MB"


# --------------------------------------------------------------------------- payload refusals


def test_empty_payload_is_empty() -> None:
    refused(b"", EMPTY)


def test_payload_over_the_limit_is_too_large(tmp_path: Path) -> None:
    payload = write(tmp_path / "p.wav", sine(16000, 0.1), 16000).read_bytes()
    error = refused(payload, TOO_LARGE, AudioLimits(max_payload_bytes=len(payload) - 1))
    assert error.message.startswith("payload is 3.2 KB; the limit is")
    assert load_audio(payload, AudioLimits(max_payload_bytes=len(payload))).samples.size == 1600


# --------------------------------------------------------------------------- header refusals


def test_text_file_named_wav_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "notes.wav"
    path.write_text("these are my notes, not audio\n" * 20)
    error = refused(path, UNREADABLE)
    assert error.message.startswith(f"{path} is not a recognised audio file (it looks like a text file")
    assert "Format not recognised" in error.message


def test_text_payload_is_unreadable() -> None:
    error = refused(b"hello, world\n" * 10, UNREADABLE)
    assert error.message.startswith("payload is not a recognised audio file (it looks like a text file")


def test_binary_garbage_is_unreadable_without_the_text_hint(tmp_path: Path) -> None:
    path = tmp_path / "garbage.wav"
    path.write_bytes(np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    error = refused(path, UNREADABLE)
    assert "text file" not in error.message


def test_truncated_header_is_unreadable(tmp_path: Path) -> None:
    whole = write(tmp_path / "whole.wav", sine(16000, 0.2), 16000).read_bytes()
    path = tmp_path / "head.wav"
    path.write_bytes(whole[:20])
    error = refused(path, UNREADABLE)
    assert "not a recognised audio file" in error.message
    refused(whole[:20], UNREADABLE)


def test_4k_rate_is_unsupported(tmp_path: Path) -> None:
    path = write(tmp_path / "low.wav", sine(4000, 0.5, freq=300), 4000)
    error = refused(path, UNSUPPORTED_RATE)
    assert error.message == "sample rate 4000 Hz is not supported; 8000-192000 Hz are"


def test_rate_limits_come_from_the_limits_passed_in(tmp_path: Path) -> None:
    path = write(tmp_path / "s.wav", sine(22050, 0.2), 22050)
    error = refused(path, UNSUPPORTED_RATE, AudioLimits(max_sample_rate_hz=16000))
    assert error.message == "sample rate 22050 Hz is not supported; 8000-16000 Hz are"


def test_too_long_is_decided_from_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "long.flac", sine(8000, 3.0), 8000, format="FLAC")
    forbid_decoding(monkeypatch)
    error = refused(path, TOO_LONG, AudioLimits(max_duration_s=1.0))
    assert error.message == "clip is 3 s; the limit is 1 s"
    refused(path.read_bytes(), TOO_LONG, AudioLimits(max_duration_s=1.0))


def test_too_long_message_in_hours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "s.wav", sine(16000, 0.2), 16000)
    fake_header(monkeypatch, 3 * 3600 * 16000)
    forbid_decoding(monkeypatch)
    assert refused(path, TOO_LONG).message == "clip is 3 h 0 min; the limit is 10 min"


def test_header_that_understates_the_length_is_caught_while_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libsndfile never decodes past the frames its header gives; the audioread fallback's header
    is an estimate, so its decoding stops one frame past the limit."""
    path = write(tmp_path / "s.wav", sine(16000, 2.0), 16000)
    fallback_with_header(monkeypatch, frames=8000)
    mixed: list[int] = []
    real_mix = decode._mix_pcm16

    def counting_mix(pending: bytearray, channels: int, cap: int, into: Any, skip: int) -> int:
        before = into.frames
        left = real_mix(pending, channels, cap, into, skip)
        mixed.append(into.frames - before)
        return left

    monkeypatch.setattr(decode, "_mix_pcm16", counting_mix)
    error = refused(path, TOO_LONG, AudioLimits(max_duration_s=1.0))
    assert error.message == "clip is longer than its header says (500 ms); the limit is 1 s"
    assert sum(mixed) == 16001  # decoding stopped one frame past the limit, not at 2 s


def fallback_with_header(monkeypatch: pytest.MonkeyPatch, frames: int | None = None) -> None:
    """libsndfile refuses every clip, so paths go to audioread, whose header says `frames`."""
    refuse_header(monkeypatch, lambda: (_ for _ in ()).throw(sf.LibsndfileError(1, "Error opening: ")))
    if frames is None:
        return
    real = header._probe_with_audioread

    def probe(path: Path) -> Any:
        info = real(path)
        assert isinstance(info, AudioInfo)
        return dataclasses.replace(info, frames=frames, duration_s=frames / info.sample_rate_hz)

    monkeypatch.setattr(header, "_probe_with_audioread", probe)


# --------------------------------------------------------------------------- decoding quirks


def test_wav_header_claiming_more_data_is_accepted_as_decoded(tmp_path: Path) -> None:
    whole = bytearray(write(tmp_path / "w.wav", sine(16000, 0.5), 16000, subtype="PCM_16").read_bytes())
    data_at = whole.find(b"data")
    whole[data_at + 4 : data_at + 8] = struct.pack("<I", 10**9)  # claims ~8.7 h of samples
    path = tmp_path / "claims.wav"
    path.write_bytes(bytes(whole))
    assert probe_audio(path, LIMITS).frames == 8000  # libsndfile clamps to the bytes present
    assert len(load_audio(path, LIMITS).samples) == 8000


def test_truncated_wav_decodes_what_is_there(tmp_path: Path) -> None:
    whole = write(tmp_path / "w.wav", sine(16000, 0.5), 16000, subtype="PCM_16").read_bytes()
    path = tmp_path / "cut.wav"
    path.write_bytes(whole[: 44 + 2 * 3000 + 1])  # odd byte count: half a sample at the end
    assert len(load_audio(path, LIMITS).samples) == 3000


def test_truncated_mp3_decodes_the_frames_it_holds(tmp_path: Path) -> None:
    whole = write(tmp_path / "m.mp3", sine(16000, 1.0), 16000, format="MP3").read_bytes()
    path = tmp_path / "cut.mp3"
    path.write_bytes(whole[: len(whole) // 2])
    assert probe_audio(path, LIMITS).frames == 16000  # the Xing tag still claims the whole clip
    clip = load_audio(path, LIMITS)
    assert 0.1 < clip.duration_s < 0.9
    assert abs(dominant_hz(clip.samples) - 440.0) <= 4.0


@pytest.mark.parametrize(("ext", "fmt"), [("mp3", "MP3"), ("flac", "FLAC"), ("ogg", "OGG")])
def test_truncated_then_garbage_is_unreadable(tmp_path: Path, ext: str, fmt: str) -> None:
    """A stream cut mid-frame and followed by junk fails in the decoder.

    mpg123 gives up after 1 KiB without a frame header, so 3000 zero bytes fail reliably; random
    bytes sometimes contain a plausible header, and then it resyncs and decodes the good prefix.
    """
    whole = write(tmp_path / f"x.{ext}", sine(16000, 1.0), 16000, format=fmt).read_bytes()
    garbage = bytes(3000)
    path = tmp_path / f"broken.{ext}"
    path.write_bytes(whole[: len(whole) // 2] + garbage)
    error = refused(path, UNREADABLE)
    assert str(path) in error.message


@pytest.mark.parametrize(("ext", "fmt"), [("mp3", "MP3"), ("flac", "FLAC"), ("ogg", "OGG")])
def test_garbage_after_a_whole_stream_is_ignored(tmp_path: Path, ext: str, fmt: str) -> None:
    whole = write(tmp_path / f"x.{ext}", sine(16000, 0.5), 16000, format=fmt).read_bytes()
    garbage = np.random.default_rng(4).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    path = tmp_path / f"tail.{ext}"
    path.write_bytes(whole + garbage)
    assert len(load_audio(path, LIMITS).samples) == 8000


def test_audioread_fallback_for_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    pcm = rng.integers(-20000, 20000, size=(3200, 2), dtype=np.int16)
    path = write(tmp_path / "s.wav", pcm, 16000, subtype="PCM_16")
    expected = load_audio(path, LIMITS)

    def refuse() -> Any:
        raise sf.LibsndfileError(1, "Error opening: ")

    refuse_header(monkeypatch, refuse)
    info = probe_audio(path, LIMITS)
    assert (info.format, info.sample_rate_hz, info.channels) == (AUDIOREAD_FORMAT, 16000, 2)
    assert info.frames == 3200
    clip = load_audio(path, LIMITS)
    np.testing.assert_allclose(clip.samples, expected.samples, rtol=0, atol=1e-7)
    assert clip.channels == 2
    refused(path.read_bytes(), UNREADABLE)  # no fallback for payloads


def test_no_fallback_decoder_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "clip.m4a"
    path.write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(range(256)) * 4)
    error = refused(path, UNREADABLE)
    assert "not a recognised audio file" in error.message
    assert "text file" not in error.message


NO_BACKEND_PROBE = """
import sys
from pipeline.audio.decode import load_audio
from pipeline.errors import VoxmillError
from pipeline.settings import AudioLimits
try:
    load_audio(sys.argv[1], AudioLimits())
except VoxmillError as exc:
    print(exc.code, exc.message)
"""
# An ffmpeg that is installed but reads nothing (as on a file no decoder knows).
FAILING_FFMPEG = """#!/bin/sh
[ "$1" = "-version" ] && echo "ffmpeg version 0" && exit 0
echo "Invalid data found when processing input" >&2
exit 1
"""


@pytest.mark.parametrize("ffmpeg", ["missing", "failing"])
def test_the_fallback_message_says_whether_ffmpeg_was_tried(tmp_path: Path, ffmpeg: str) -> None:
    """audioread picks its decoders from the PATH once per process: each case runs in its own."""
    path = tmp_path / "clip.m4a"
    path.write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(range(256)) * 4)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if ffmpeg == "failing":
        (bin_dir / "ffmpeg").write_text(FAILING_FFMPEG)
        (bin_dir / "ffmpeg").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}
    done = subprocess.run(
        [sys.executable, "-c", NO_BACKEND_PROBE, str(path)],
        env=env,
        cwd=FIXTURES.parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.startswith(f"{UNREADABLE} {path} is not a recognised audio file"), done.stderr
    if ffmpeg == "missing":
        assert "no other decoder was tried: ffmpeg is not installed" in done.stdout
        assert "could not read it" not in done.stdout
    else:
        assert "ffmpeg could not read it either" in done.stdout


# --------------------------------------------------------------------------- sample refusals


@pytest.mark.parametrize("rate", [16000, 22050, 44100])
def test_79_ms_is_too_short_and_81_ms_is_fine(tmp_path: Path, rate: int) -> None:
    short = write(tmp_path / "short.wav", sine(rate, 0.079), rate)
    error = refused(short, TOO_SHORT)
    assert error.message == "clip is 79 ms; at least 80 ms of audio is needed"
    ok = write(tmp_path / "ok.wav", sine(rate, 0.081), rate)
    assert load_audio(ok, LIMITS).duration_s == pytest.approx(0.081, abs=1 / TARGET_RATE_HZ)


def test_a_refused_clip_says_what_is_known_of_it(tmp_path: Path) -> None:
    short = refused(write(tmp_path / "s.wav", sine(22050, 0.042, channels=2), 22050), TOO_SHORT)
    assert isinstance(short, ClipRefused)
    assert short.stats["duration_s"] == pytest.approx(0.042, abs=1 / 22050)
    assert (short.stats["source_rate_hz"], short.stats["source_channels"]) == (22050, 2)
    assert short.stats["source_codec"] == "WAV/PCM_16" and short.stats["speech_s"] is None
    assert -10.0 < short.stats["peak_dbfs"] < 0.0 and short.stats["rms_dbfs"] < short.stats["peak_dbfs"]
    silent = refused(write(tmp_path / "z.wav", np.zeros(8000, dtype=np.int16), 16000), EMPTY)
    assert isinstance(silent, ClipRefused) and silent.stats["duration_s"] == 0.5
    assert silent.stats["rms_dbfs"] is None  # no levels claimed for a refused clip but a short one


def test_exactly_80_ms_is_fine(tmp_path: Path) -> None:
    path = write(tmp_path / "80.wav", sine(16000, 0.08), 16000)
    assert len(load_audio(path, LIMITS).samples) == 1280


def test_too_short_message_for_42_ms(tmp_path: Path) -> None:
    path = write(tmp_path / "s.wav", sine(16000, 0.042), 16000)
    assert refused(path, TOO_SHORT).message == "clip is 42 ms; at least 80 ms of audio is needed"


def test_all_zero_is_empty(tmp_path: Path) -> None:
    path = write(tmp_path / "silence.wav", np.zeros(16000, dtype=np.int16), 16000, subtype="PCM_16")
    assert refused(path, EMPTY).message == "clip is digital silence (every sample is 0)"


def test_channels_that_cancel_are_silence(tmp_path: Path) -> None:
    left = sine(16000, 0.2)
    path = write(tmp_path / "cancel.wav", np.stack([left, -left], axis=1), 16000, subtype="FLOAT")
    refused(path, EMPTY)


def test_quiet_but_not_zero_is_fine(tmp_path: Path) -> None:
    samples = np.zeros(1600, dtype=np.int16)
    samples[800] = 1
    path = write(tmp_path / "quiet.wav", samples, 16000, subtype="PCM_16")
    assert np.count_nonzero(load_audio(path, LIMITS).samples) == 1


def test_header_only_wav_is_empty(tmp_path: Path) -> None:
    path = write(tmp_path / "none.wav", np.zeros(0, dtype=np.int16), 16000, subtype="PCM_16")
    assert path.stat().st_size > 0
    refused(path, EMPTY)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_float_wav_is_refused(tmp_path: Path, bad: float) -> None:
    samples = sine(16000, 0.2)
    samples[[10, 20, 30]] = bad
    path = write(tmp_path / "nan.wav", samples, 16000, subtype="FLOAT")
    error = refused(path, NON_FINITE)
    assert error.message == "clip has 3 non-finite samples (NaN or Inf)"


def test_non_finite_is_counted_over_all_channels(tmp_path: Path) -> None:
    stereo = sine(16000, 0.2, channels=2).astype(np.float64)
    stereo[5, 0] = np.nan
    stereo[5, 1] = np.inf
    path = write(tmp_path / "nan2.wav", stereo, 16000, subtype="DOUBLE")
    assert refused(path.read_bytes(), NON_FINITE).message.startswith("clip has 2 ")


def test_check_samples() -> None:
    check_samples(sine(16000, 0.1), LIMITS)
    for samples, code in [
        (np.zeros(0, dtype=np.float32), EMPTY),
        (np.array([0.1, np.nan] * 1000, dtype=np.float32), NON_FINITE),
        (sine(16000, 0.05), TOO_SHORT),
        (np.zeros(1600, dtype=np.float32), EMPTY),
        (np.zeros((1600, 2), dtype=np.float32), BAD_REQUEST),
        (np.array([0.1, 1e30] * 1000, dtype=np.float32), OUT_OF_RANGE),
    ]:
        with pytest.raises(VoxmillError) as info:
            check_samples(samples, LIMITS)
        assert info.value.code == code


@pytest.mark.parametrize("channels", [2, 3])
def test_to_mono_equals_numpys_channel_mean_exactly(channels: int) -> None:
    frames = np.random.default_rng(11).normal(0.0, 0.3, (4410, channels)).astype(np.float32)
    mono = to_mono(frames)
    assert mono.dtype == np.float32
    assert np.array_equal(mono, frames.mean(axis=1, dtype=np.float32))


# --------------------------------------------------------------------------- amplitude


def out_of_range_message(shown: str, limit: str = "100") -> str:
    return (
        f"clip has a sample of magnitude {shown}; the limit is {limit} (1.0 is full scale): "
        "numbers, not audio"
    )


@pytest.mark.parametrize(
    ("value", "shown"), [(1e30, "1e+30"), (3e38, "3e+38"), (-1e30, "1e+30"), (101.0, "101")]
)
def test_samples_beyond_the_amplitude_limit_are_out_of_range(
    tmp_path: Path, value: float, shown: str
) -> None:
    samples = sine(16000, 0.2)
    samples[100] = value
    path = write(tmp_path / "loud.wav", samples, 16000, subtype="FLOAT")
    assert refused(path, OUT_OF_RANGE).message == out_of_range_message(shown)
    assert refused(path.read_bytes(), OUT_OF_RANGE).message == out_of_range_message(shown)


def test_a_stereo_pair_whose_mean_would_overflow_is_out_of_range(tmp_path: Path) -> None:
    stereo = np.full((3200, 2), 3e38, dtype=np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(to_mono(stereo)).any()  # (a + b) / 2 overflows float32 to Inf
    path = write(tmp_path / "huge.wav", stereo, 16000, subtype="FLOAT")
    assert refused(path, OUT_OF_RANGE).message == out_of_range_message("3e+38")


def test_the_amplitude_limit_is_inclusive_and_comes_from_the_limits(tmp_path: Path) -> None:
    samples = sine(16000, 0.2)
    samples[[100, 200]] = [100.0, -100.0]
    path = write(tmp_path / "edge.wav", samples, 16000, subtype="FLOAT")
    assert float(np.max(np.abs(load_audio(path, LIMITS).samples))) == 100.0
    refused(path, OUT_OF_RANGE, AudioLimits(max_amplitude=99.5))
    # after the decoder's own scaling: full-scale 16-bit PCM is 1.0 at most
    full = write(tmp_path / "full.wav", np.full(3200, -32768, dtype=np.int16), 16000, subtype="PCM_16")
    assert float(load_audio(full, AudioLimits(max_amplitude=1.0)).samples.min()) == -1.0


def test_non_finite_is_reported_before_out_of_range(tmp_path: Path) -> None:
    samples = sine(16000, 0.2)
    samples[10], samples[20] = np.nan, 1e30
    path = write(tmp_path / "both.wav", samples, 16000, subtype="FLOAT")
    assert refused(path, NON_FINITE).message == "clip has 1 non-finite samples (NaN or Inf)"


def test_a_segment_judges_the_amplitude_of_the_channel_it_keeps(tmp_path: Path) -> None:
    stereo = sine(16000, 1.0, channels=2)
    stereo[8000, 1] = 1e30
    path = write(tmp_path / "one_loud.wav", stereo, 16000, subtype="FLOAT")
    assert load_audio(path, LIMITS, segment=Segment(0.0, 1.0, 0)).duration_s == 1.0
    with pytest.raises(VoxmillError) as loud:
        load_audio(path, LIMITS, segment=Segment(0.0, 1.0, 1))
    assert loud.value.code == OUT_OF_RANGE
    with pytest.raises(VoxmillError) as mixed:
        load_audio(path, LIMITS, segment=Segment(0.25, 0.75))
    assert mixed.value.code == OUT_OF_RANGE


# --------------------------------------------------------------------------- decode budget


def constant(frames: int, channels: int, value: float = 0.25) -> np.ndarray:
    return np.full((frames, channels), value, dtype=np.float32)


def test_the_decode_budget_is_judged_from_the_header_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "eight.flac", constant(16000, 8), 16000, format="FLAC")  # 512,000 bytes decoded
    forbid_decoding(monkeypatch)
    limits = AudioLimits(max_decoded_bytes=256 * 1024)
    expected = "decoding would take 500 KB (8 channels at 16000 Hz for 1 s); the limit is 256 KB"
    assert refused(path, TOO_LARGE, limits).message == expected
    assert refused(path.read_bytes(), TOO_LARGE, limits).message == expected
    with pytest.raises(VoxmillError) as probed:
        probe_audio(path, limits)
    assert probed.value.code == TOO_LARGE


def test_a_clip_at_exactly_the_budget_decodes(tmp_path: Path) -> None:
    path = write(tmp_path / "eight.flac", constant(16000, 8), 16000, format="FLAC")
    clip = load_audio(path, AudioLimits(max_decoded_bytes=16000 * 8 * 4))
    assert clip.channels == 8 and len(clip.samples) == 16000
    refused(path, TOO_LARGE, AudioLimits(max_decoded_bytes=16000 * 8 * 4 - 1))


def test_eight_channels_at_192k_for_10_minutes_are_too_large_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adversarial FLAC of issue 31 (952 KB; 4.6 GB decoded), told from its header."""
    path = write(tmp_path / "s.flac", constant(19200, 8), 192000, format="FLAC")
    fake_header(monkeypatch, 599 * 192000)
    forbid_decoding(monkeypatch)
    assert refused(path, TOO_LARGE).message == (
        "decoding would take 3.4 GB (8 channels at 192000 Hz for 9 min 59 s); the limit is 256 MB"
    )


def test_a_header_that_understates_the_length_is_stopped_at_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pcm = np.random.default_rng(6).integers(-20000, 20000, size=(32000, 2), dtype=np.int16)
    path = write(tmp_path / "s.wav", pcm, 16000, subtype="PCM_16")  # 2 s: 256,000 bytes decoded
    fallback_with_header(monkeypatch, frames=8000)  # says 0.5 s: 64,000 bytes
    limits = AudioLimits(max_decoded_bytes=100_000)  # 12,500 stereo frames
    mixed: list[int] = []
    real_add = decode._Mixdown.add

    def counting_add(self: Any, block: Any) -> None:
        mixed.append(len(block))
        real_add(self, block)

    monkeypatch.setattr(decode._Mixdown, "add", counting_add)
    error = refused(path, TOO_LARGE, limits)
    assert error.message == (
        "clip is longer than its header says (500 ms): decoding would take more than 97.7 KB, the limit"
    )
    assert sum(mixed) == 12_501  # one frame past the budget, not the whole 2 s


def test_a_segment_is_budgeted_on_its_own_frames(tmp_path: Path) -> None:
    path = write(tmp_path / "eight.wav", constant(32000, 8), 16000, subtype="FLOAT")  # 1,024,000 bytes
    limits = AudioLimits(max_decoded_bytes=600_000)
    refused(path, TOO_LARGE, limits)
    assert load_audio(path, limits, segment=Segment(0.5, 1.5)).duration_s == 1.0
    with pytest.raises(VoxmillError) as over:
        load_audio(path, limits, segment=Segment(0.0, 1.5))
    assert over.value.code == TOO_LARGE and "(8 channels at 16000 Hz for 1.5 s)" in over.value.message


def test_the_audioread_fallback_keeps_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pcm = np.random.default_rng(6).integers(-20000, 20000, size=(16000, 2), dtype=np.int16)
    path = write(tmp_path / "s.wav", pcm, 16000, subtype="PCM_16")  # 128,000 bytes decoded
    fallback_with_header(monkeypatch)
    limits = AudioLimits(max_decoded_bytes=100_000)
    assert refused(path, TOO_LARGE, limits).message == (
        "decoding would take 125 KB (2 channels at 16000 Hz for 1 s); the limit is 97.7 KB"
    )
    part = load_audio(path, limits, segment=Segment(0.25, 0.75))
    assert part.duration_s == 0.5 and part.codec == AUDIOREAD_FORMAT


# --------------------------------------------------------------------------- decoding in blocks

BLOCK_FORMATS = [
    pytest.param("wav", {"subtype": "FLOAT"}, 8, id="wav-float"),
    pytest.param("wav", {"subtype": "PCM_24"}, 8, id="wav-pcm24"),
    pytest.param("flac", {"format": "FLAC"}, 8, id="flac"),
    pytest.param("ogg", {"format": "OGG", "subtype": "VORBIS"}, 8, id="ogg"),
    pytest.param("mp3", {"format": "MP3"}, 2, id="mp3"),
]


@pytest.mark.parametrize("channels", [1, 2, 3, 6, 8])
@pytest.mark.parametrize(("ext", "kwargs", "most_channels"), BLOCK_FORMATS)
def test_decoding_in_blocks_gives_the_numbers_of_one_read_exactly(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ext: str,
    kwargs: dict[str, str],
    most_channels: int,
    channels: int,
) -> None:
    if channels > most_channels:
        pytest.skip(f"{ext} holds at most {most_channels} channels")
    frames = np.random.default_rng(channels).uniform(-0.5, 0.5, (11025, channels)).astype(np.float32)
    path = write(tmp_path / f"x.{ext}", frames, 22050, **kwargs)
    block_bytes = 4 * channels * 1000 + 12  # blocks of 1000 frames: the last one is short
    monkeypatch.setattr(decode, "DECODE_BLOCK_BYTES", block_bytes)
    assert np.array_equal(load_audio(path, LIMITS).samples, resample(one_read(path), 22050))
    part = load_audio(path, LIMITS, segment=Segment(0.1, 0.4))
    assert np.array_equal(part.samples, resample(one_read(path, 2205, 6615), 22050))


def one_read(path: Path, first: int = 0, frames: int = -1) -> np.ndarray:
    """The mono mix of one read from a fresh handle (soundfile's `sf.read` seeks to 0 first, and a
    seek restarts an MP3 decoder, which then gives slightly different samples)."""
    with sf.SoundFile(path) as sound:
        if first:
            sound.seek(first)
        return to_mono(sound.read(frames, dtype="float32", always_2d=True))


def test_the_audioread_fallback_decodes_in_blocks_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pcm = np.random.default_rng(7).integers(-32768, 32767, size=(10007, 3), dtype=np.int16)
    path = write(tmp_path / "s.wav", pcm, 16000, subtype="PCM_16")
    expected = to_mono(pcm.astype(np.float32) / np.float32(32768.0))
    fallback_with_header(monkeypatch)
    monkeypatch.setattr(decode, "DECODE_BLOCK_BYTES", 1001)  # 83 frames, a fraction of a chunk
    assert np.array_equal(load_audio(path, LIMITS).samples, expected)
    assert np.array_equal(load_audio(path, LIMITS, segment=Segment(0.1, 0.4)).samples, expected[1600:6400])
    third = load_audio(path, LIMITS, segment=Segment(0.5, None, 2))
    assert np.array_equal(third.samples, pcm[8000:, 2] / np.float32(32768.0))


def test_a_multichannel_clip_costs_its_mono_samples_plus_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 channels, 20 s: 10 MB decoded at once before; now 1.3 MB of mono plus one block."""
    frames = 20 * 16000
    path = write(tmp_path / "eight.flac", sine(16000, 20.0, channels=8), 16000, format="FLAC")
    monkeypatch.setattr(decode, "DECODE_BLOCK_BYTES", 256 * 1024)
    tracemalloc.start()
    try:
        clip = load_audio(path, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(clip.samples) == frames
    mono_bytes = 4 * frames
    mib = 2**20
    print(f"peak {peak / mib:.2f} MiB; mono {mono_bytes / mib:.2f} MiB, decoded {8 * mono_bytes / mib:.1f}")
    assert peak < mono_bytes + 3 * decode.DECODE_BLOCK_BYTES
