"""Real speech for tests: Debian's espeak-ng synthesises it (a formant voice Silero VAD takes for
speech), and the non-speech signals the speech check must refuse."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

RATE = 16000
ESPEAK = shutil.which("espeak-ng")
NO_ESPEAK = "espeak-ng is not installed (apt-get install -y espeak-ng; .ci/run installs it)"
SENTENCE = "Please call Stella. Ask her to bring these things with her from the store."

needs_espeak = pytest.mark.skipif(ESPEAK is None, reason=NO_ESPEAK)


def espeak_wav(text: str, path: Path) -> Path:
    """`espeak-ng -w path text`: a 22.05 kHz 16-bit mono WAV."""
    assert ESPEAK is not None, NO_ESPEAK
    subprocess.run([ESPEAK, "-w", str(path), text], check=True, capture_output=True, timeout=60)
    return path


def espeak_wave(text: str = SENTENCE) -> np.ndarray:
    """Synthetic speech as 16 kHz float32 samples."""
    with tempfile.TemporaryDirectory() as folder:
        data, rate = sf.read(espeak_wav(text, Path(folder) / "speech.wav"), dtype="float32")
    return np.asarray(soxr.resample(data, rate, RATE), dtype=np.float32)


def with_noise(wave: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """`wave` plus white noise at `snr_db` (RMS ratio), scaled down only if it would clip."""
    noise = np.random.default_rng(seed).normal(0.0, 1.0, wave.shape[0])
    noise *= np.sqrt(np.mean(wave.astype(np.float64) ** 2) / np.mean(noise**2)) / 10 ** (snr_db / 20)
    mixed = wave + noise
    return (mixed / max(1.0, float(np.max(np.abs(mixed))))).astype(np.float32)


def seconds(n: float) -> np.ndarray:
    return np.arange(int(n * RATE)) / RATE


def dither(duration_s: float = 2.0, seed: int = 0) -> np.ndarray:
    """'Silence' as a recording has it: +-1 LSB of 16-bit dither (about -95 dBFS), never all zero."""
    return (np.random.default_rng(seed).integers(-1, 2, int(duration_s * RATE)) / 32768).astype(np.float32)


def hum(duration_s: float = 2.0) -> np.ndarray:
    """50 Hz mains hum with its third harmonic, -10 dBFS."""
    t = seconds(duration_s)
    return (0.3 * np.sin(2 * np.pi * 50 * t) + 0.1 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)


def tone(duration_s: float = 2.0, hz: float = 1000.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * seconds(duration_s))).astype(np.float32)


def white_noise(duration_s: float = 2.0, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.1, int(duration_s * RATE)).astype(np.float32)


def click(duration_s: float = 2.0) -> np.ndarray:
    """One full-height sample in the middle of digital silence."""
    wave = np.zeros(int(duration_s * RATE), dtype=np.float32)
    wave[wave.shape[0] // 2] = 0.9
    return wave


def burst(speech: np.ndarray, ms: int, duration_s: float = 2.0) -> np.ndarray:
    """`ms` of `speech` (from 0.5 s into it) in the middle of `duration_s` of digital silence."""
    piece = speech[RATE // 2 : RATE // 2 + RATE * ms // 1000]
    wave = np.zeros(int(duration_s * RATE), dtype=np.float32)
    start = (wave.shape[0] - piece.shape[0]) // 2
    wave[start : start + piece.shape[0]] = piece
    return wave
