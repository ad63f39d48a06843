"""Feature parity against the torch reference arrays in `tests/fixtures`, and the cost of features.

- log-mel (128 and 80 bins) against whisper's `log_mel_spectrogram`;
- Kaldi fbank against torchaudio's `compliance.kaldi.fbank`: max abs difference overall and
  where the reference is above -5 (near-silent cells sit at the float32 log floor), for the
  current `pipeline.features.kaldi_fbank` and for kaldi-native-fbank (the implementation it
  replaced, kept here as the reference for the before/after);
- embeddings from the full CAM++ stand-in: cosine similarity between the two fbank
  implementations on every fixture clip (must be >= 0.9999);
- soxr against torchaudio's resampler on the 44.1 kHz stereo fixture;
- milliseconds per audio second of each feature (median of repeated runs on a 10 s clip).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import soundfile as sf

from benchmarks.common import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
CLIPS_16K = ("chirp_3s", "noise_1p37s", "speechlike_7p5s")
FloatArray = npt.NDArray[np.float32]


def knf_fbank(wave: FloatArray, num_mel_bins: int = 80) -> FloatArray:
    """kaldi-native-fbank, frame by frame: voxmill's fbank before the vectorised one."""
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = 16000.0
    opts.mel_opts.num_bins = num_mel_bins
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000.0, wave.astype(np.float32, copy=False))
    fbank.input_finished()
    n = fbank.num_frames_ready
    if n == 0:
        return np.zeros((0, num_mel_bins), dtype=np.float32)
    return np.stack([fbank.get_frame(i) for i in range(n)]).astype(np.float32, copy=False)


def fixture_waves() -> dict[str, FloatArray]:
    waves = {}
    for name in CLIPS_16K:
        wave, rate = sf.read(FIXTURES / f"{name}.wav", dtype="float32")
        assert rate == 16000
        waves[name] = wave
    waves["stereo44k_2s"] = np.load(FIXTURES / "stereo44k_2s.resampled16k.npy").astype(np.float32)
    return waves


def fbank_errors(fbank: Callable[[FloatArray], FloatArray], waves: dict[str, FloatArray]) -> dict[str, Any]:
    out = {}
    for name, wave in waves.items():
        reference = np.load(FIXTURES / f"{name}.fbank80.npy")
        diff = np.abs(fbank(wave) - reference)
        out[name] = {"overall": float(diff.max()), "above_minus5": float(diff[reference > -5].max())}
    return out


def log_mel_errors(waves: dict[str, FloatArray]) -> dict[str, Any]:
    from pipeline.features import whisper_log_mel

    out: dict[str, Any] = {}
    for name, wave in waves.items():
        for n_mels in (128, 80):
            reference = np.load(FIXTURES / f"{name}.logmel{n_mels}.npy")
            out.setdefault(name, {})[str(n_mels)] = float(
                np.abs(whisper_log_mel(wave, n_mels) - reference).max()
            )
    return out


def resample_error(cutoff_hz: float = 6000.0) -> dict[str, float]:
    """soxr (voxmill's `load_audio`) vs torchaudio's sinc resampler on the 44.1 kHz stereo fixture:
    over the whole band, and below `cutoff_hz` (torchaudio's default filter rolls off early)."""
    from pipeline.audio import load_audio
    from pipeline.settings import AudioLimits

    ours = load_audio(FIXTURES / "stereo44k_2s.wav", AudioLimits()).samples.astype(np.float64)
    reference = np.load(FIXTURES / "stereo44k_2s.resampled16k.npy").astype(np.float64)
    n = min(len(ours), len(reference))
    diff = ours[:n] - reference[:n]
    snr_db = 10 * np.log10(np.sum(reference[:n] ** 2) / np.sum(diff**2))
    band = np.fft.rfftfreq(n, 1 / 16000) <= cutoff_hz
    spectrum_ref, spectrum_diff = np.fft.rfft(reference[:n])[band], np.fft.rfft(diff)[band]
    band_snr_db = 10 * np.log10(np.sum(np.abs(spectrum_ref) ** 2) / np.sum(np.abs(spectrum_diff) ** 2))
    return {
        "max_abs": float(np.abs(diff).max()),
        "snr_db": round(float(snr_db), 2),
        "snr_below_6khz_db": round(float(band_snr_db), 2),
        "length_diff": len(ours) - len(reference),
    }


def embedding_cosines(models: Path, waves: dict[str, FloatArray]) -> dict[str, float]:
    """Cosine similarity of CAM++ embeddings: current fbank vs kaldi-native-fbank, per fixture."""
    from pipeline.features import kaldi_fbank, mean_normalized
    from pipeline.registry import Registry
    from pipeline.sessions import ModelSession, SessionOptions

    registry = Registry.load()
    session = ModelSession.load(
        registry.find_model("embedder", models), "embedder", SessionOptions("cpu"), registry
    )
    out = {}
    for name, wave in waves.items():
        a = session.run([mean_normalized(kaldi_fbank(wave))[np.newaxis]])[0].flatten().astype(np.float64)
        b = session.run([mean_normalized(knf_fbank(wave))[np.newaxis]])[0].flatten().astype(np.float64)
        out[name] = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return out


def ms_per_audio_s(
    function: Callable[[FloatArray], Any], seconds: float = 10.0, runs: int = 15
) -> dict[str, float]:
    from pipeline.demo import speechlike

    wave = speechlike(seconds, 16000, 150.0, seed=3)
    function(wave)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        function(wave)
        times.append((time.perf_counter() - started) * 1000 / seconds)
    return {
        "median": round(statistics.median(times), 4),
        "min": round(min(times), 4),
        "max": round(max(times), 4),
    }


def measure_parity(models: Path) -> dict[str, Any]:
    from pipeline.features import kaldi_fbank, whisper_log_mel

    waves = fixture_waves()
    fbank_now = fbank_errors(kaldi_fbank, waves)
    fbank_knf = fbank_errors(knf_fbank, waves)
    return {
        "log_mel_max_abs": log_mel_errors(waves),
        "fbank_max_abs": fbank_now,
        "fbank_knf_max_abs": fbank_knf,
        "fbank_worst": {
            "overall": max(v["overall"] for v in fbank_now.values()),
            "above_minus5": max(v["above_minus5"] for v in fbank_now.values()),
        },
        "fbank_knf_worst": {
            "overall": max(v["overall"] for v in fbank_knf.values()),
            "above_minus5": max(v["above_minus5"] for v in fbank_knf.values()),
        },
        "embedding_cosine_vs_knf": embedding_cosines(models, waves),
        "resample_vs_torchaudio": resample_error(),
        "feature_ms_per_audio_s": {
            "whisper_log_mel_128": ms_per_audio_s(whisper_log_mel),
            "kaldi_fbank": ms_per_audio_s(kaldi_fbank),
            "kaldi_native_fbank": ms_per_audio_s(knf_fbank),
        },
    }
