"""Quality statistics: levels in dBFS, the clipping rule, and what `run_clip` reports per clip."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline import Extractor
from pipeline.audio.quality import CLIP_LEVEL, DBFS_FLOOR, STAT_FIELDS, clip_stats, dbfs
from pipeline.audio.vad import SpeechCheck
from pipeline.demo import speechlike
from pipeline.inference import run_clip
from pipeline.records import TaskResult
from pipeline.settings import AudioLimits

RATE = 16000


def test_full_scale_square_is_0_dbfs_and_all_clipped() -> None:
    square = np.where(np.arange(RATE) % 40 < 20, 1.0, -1.0).astype(np.float32)
    stats = clip_stats(square)
    assert stats["rms_dbfs"] == 0.0 and stats["peak_dbfs"] == 0.0
    assert stats["clipped_fraction"] == 1.0
    assert stats["duration_s"] == 1.0 and stats["speech_s"] is None and stats["speech_ratio"] is None


def test_a_half_scale_sine_is_minus_9_dbfs_rms_minus_6_peak() -> None:
    sine = (0.5 * np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE)).astype(np.float32)
    stats = clip_stats(sine)
    assert stats["rms_dbfs"] == pytest.approx(20 * math.log10(0.5 / math.sqrt(2)), abs=0.01)  # -9.03
    assert stats["peak_dbfs"] == pytest.approx(-6.02, abs=0.01)
    assert stats["clipped_fraction"] == 0.0


def test_clipped_fraction_counts_samples_at_or_above_0999() -> None:
    wave = np.zeros(1000, dtype=np.float32)
    wave[:10] = 1.0  # full scale
    wave[10:20] = -CLIP_LEVEL  # exactly the level, negative
    wave[20:30] = 0.998  # just below: not clipped
    assert clip_stats(wave)["clipped_fraction"] == pytest.approx(20 / 1000)
    driven = np.clip(2.0 * np.sin(2 * np.pi * 5 * np.arange(RATE) / RATE), -1, 1).astype(np.float32)
    expected = np.mean(np.abs(2.0 * np.sin(2 * np.pi * 5 * np.arange(RATE) / RATE)) >= CLIP_LEVEL)
    assert clip_stats(driven)["clipped_fraction"] == pytest.approx(expected, abs=1e-4)  # about 2/3


def test_silence_and_nothing_stay_finite() -> None:
    assert dbfs(0.0) == DBFS_FLOOR and dbfs(float("nan")) == DBFS_FLOOR
    stats = clip_stats(np.zeros(RATE, dtype=np.float32), speech_s=0.0)
    assert (
        stats["rms_dbfs"] == DBFS_FLOOR and stats["peak_dbfs"] == DBFS_FLOOR and stats["speech_ratio"] == 0.0
    )
    empty = clip_stats(np.zeros(0, dtype=np.float32))
    assert empty["duration_s"] == 0.0 and empty["rms_dbfs"] == DBFS_FLOOR and empty["clipped_fraction"] == 0.0


def test_levels_equal_a_float64_reference_on_random_clips() -> None:
    """The squares are summed from float32 products and the clipped samples counted only past the
    level: on clips of every length and level, some clipped, the columns equal a plain float64
    computation's."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 60_000))
        wave = rng.standard_normal(n).astype(np.float32) * np.float32(10 ** rng.uniform(-6, 0.5))
        wave = np.clip(wave, -1.0, 1.0)
        exact = wave.astype(np.float64)
        stats = clip_stats(wave)
        assert stats["rms_dbfs"] == dbfs(math.sqrt(float(np.mean(exact * exact))))
        assert stats["peak_dbfs"] == dbfs(float(np.abs(exact).max()))
        assert stats["clipped_fraction"] == float(np.mean(np.abs(exact) >= CLIP_LEVEL))


def test_speech_ratio_and_source_fields() -> None:
    stats = clip_stats(
        np.full(2 * RATE, 0.1, dtype=np.float32),
        source_rate_hz=44100,
        channels=2,
        codec="FLAC/PCM_16",
        speech_s=0.5,
    )
    assert list(stats) == list(STAT_FIELDS)
    assert stats["speech_ratio"] == 0.25
    assert (stats["source_rate_hz"], stats["source_channels"], stats["source_codec"]) == (
        44100,
        2,
        "FLAC/PCM_16",
    )
    assert stats["rms_dbfs"] == -20.0


@pytest.fixture(scope="module")
def sessions(tiny_models: Path) -> Iterator[dict]:
    with Extractor.from_model_dir(tiny_models) as extractor:
        yield extractor.sessions


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("fmt", "subtype", "rate", "channels", "codec"),
    [
        ("WAV", "PCM_16", 16000, 1, "WAV/PCM_16"),
        ("FLAC", "PCM_24", 44100, 2, "FLAC/PCM_24"),
        ("OGG", "VORBIS", 48000, 1, "OGG/VORBIS"),
        ("MP3", "MPEG_LAYER_III", 24000, 1, "MP3/MPEG_LAYER_III"),
    ],
)
def test_run_clip_reports_the_source_and_levels(
    sessions: dict, fmt: str, subtype: str, rate: int, channels: int, codec: str, tmp_path: Path
) -> None:
    samples = speechlike(1.5, rate, 140.0, 3, channels)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(encoded(samples, rate, fmt, subtype))
    result = run_clip("clip", path, "embed", sessions, AudioLimits())
    assert result.error is None and result.stats is not None
    stats = result.stats
    assert (stats["source_rate_hz"], stats["source_channels"], stats["source_codec"]) == (
        rate,
        channels,
        codec,
    )
    assert stats["duration_s"] == pytest.approx(1.5, abs=0.01) and stats["duration_s"] == result.audio_seconds
    assert stats["peak_dbfs"] == pytest.approx(-6.02, abs=1.5)  # speechlike peaks at 0.5
    assert stats["speech_s"] is None  # no speech check asked for: no detector ran
    assert "speech" not in result.timings_ms and "stats" in result.timings_ms
    assert TaskResult.from_dict(result.to_dict()).stats == stats


def test_a_clip_that_never_decoded_has_no_stats(sessions: dict, tmp_path: Path) -> None:
    (tmp_path / "text.wav").write_text("not audio\n" * 10)
    result = run_clip("x", tmp_path / "text.wav", "embed", sessions, AudioLimits(), SpeechCheck())
    assert result.error is not None and result.error.code == "unreadable" and result.stats is None
    assert TaskResult.from_dict({"input": "a", "op": "embed"}).stats is None  # an older result
