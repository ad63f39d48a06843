"""Feature parity with CosyVoice's torch stack (reference arrays in tests/fixtures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.features import kaldi_fbank, mean_normalized, mel_filters, power_spectrum, whisper_log_mel

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CLIPS_16K = ["chirp_3s", "noise_1p37s", "speechlike_7p5s"]


def read(name: str) -> np.ndarray:
    wave, rate = sf.read(FIXTURES / f"{name}.wav", dtype="float32")
    assert rate == 16000
    return wave


@pytest.mark.parametrize("name", CLIPS_16K)
@pytest.mark.parametrize("n_mels", [128, 80])
def test_whisper_log_mel_matches_whisper(name: str, n_mels: int) -> None:
    reference = np.load(FIXTURES / f"{name}.logmel{n_mels}.npy")
    got = whisper_log_mel(read(name), n_mels=n_mels)
    assert got.dtype == np.float32
    assert got.shape == reference.shape
    assert np.abs(got - reference).max() <= 1e-4


@pytest.mark.parametrize("name", CLIPS_16K)
def test_kaldi_fbank_matches_torchaudio(name: str) -> None:
    reference = np.load(FIXTURES / f"{name}.fbank80.npy")
    got = kaldi_fbank(read(name))
    assert got.shape == reference.shape
    diff = np.abs(got - reference)
    assert diff.max() <= 1e-2
    assert diff[reference > -5].max() <= 5e-4


def test_resampled_stereo_reference_features_match_on_the_same_wave() -> None:
    wave = np.load(FIXTURES / "stereo44k_2s.resampled16k.npy")
    assert np.abs(whisper_log_mel(wave) - np.load(FIXTURES / "stereo44k_2s.logmel128.npy")).max() <= 1e-4
    fbank = np.load(FIXTURES / "stereo44k_2s.fbank80.npy")
    diff = np.abs(kaldi_fbank(wave) - fbank)
    assert diff[fbank > -5].max() <= 5e-4


def test_frame_counts_follow_the_reference_rules() -> None:
    wave = np.zeros(21920, dtype=np.float32) + 0.1
    assert whisper_log_mel(wave).shape == (128, 21920 // 160)
    assert kaldi_fbank(wave).shape == (1 + (21920 - 400) // 160, 80)
    assert power_spectrum(wave).shape == (201, 137)


def test_short_wave_gives_no_fbank_frames() -> None:
    assert kaldi_fbank(np.ones(399, dtype=np.float32)).shape == (0, 80)


def test_mean_normalized_has_zero_mean_over_time() -> None:
    feats = kaldi_fbank(read("chirp_3s"))
    centered = mean_normalized(feats)
    assert np.abs(centered.mean(axis=0)).max() < 1e-4
    assert not np.allclose(centered, feats)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_are_librosas_bit_for_bit(n_mels: int) -> None:
    librosa = pytest.importorskip("librosa")
    expected = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
    assert mel_filters(n_mels).dtype == np.float32
    assert np.array_equal(mel_filters(n_mels), expected)


def test_log_mel_is_the_dense_product_to_float32_rounding() -> None:
    wave = read("speechlike_7p5s")
    dense = mel_filters(128) @ power_spectrum(wave)
    log_spec = np.log10(np.maximum(dense, np.float32(1e-10)))
    log_spec = np.maximum(log_spec, log_spec.max() - np.float32(8.0))
    expected = (log_spec + np.float32(4.0)) / np.float32(4.0)
    assert np.abs(whisper_log_mel(wave) - expected).max() <= 1e-6
