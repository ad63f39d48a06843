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
    from pipeline.audio.decode import load_audio
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
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.models.sessions import ModelSession

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


def mixdown_ms_per_audio_s(seconds: float = 10.0, runs: int = 15) -> dict[str, Any]:
    """Stereo 44.1 kHz to mono: numpy's mean over the channel axis (before) vs `to_mono` (after)."""
    from pipeline.audio.decode import to_mono

    stereo = np.random.default_rng(5).normal(0.0, 0.1, (int(seconds * 44100), 2)).astype(np.float32)
    out: dict[str, Any] = {}
    for name, function in (
        ("mean_axis_1", lambda: stereo.mean(axis=1, dtype=np.float32)),
        ("to_mono", lambda: to_mono(stereo)),
    ):
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            function()
            times.append((time.perf_counter() - started) * 1000 / seconds)
        out[name] = {
            "median": round(statistics.median(times), 4),
            "min": round(min(times), 4),
            "max": round(max(times), 4),
        }
    out["identical"] = bool(np.array_equal(to_mono(stereo), stereo.mean(axis=1, dtype=np.float32)))
    return out


def dense_blas_log_mel(wave: FloatArray, n_mels: int = 128) -> FloatArray:
    """`whisper_log_mel` before its mel product became sparse: a dense float32 BLAS product."""
    from pipeline.features import mel_filters, power_spectrum

    mel = mel_filters(n_mels) @ power_spectrum(wave)
    log_spec = np.log10(np.maximum(mel, np.float32(1e-10)))
    log_spec = np.maximum(log_spec, log_spec.max() - np.float32(8.0))
    out: FloatArray = ((log_spec + np.float32(4.0)) / np.float32(4.0)).astype(np.float32, copy=False)
    return out


def log_mel_change(models: Path, paths: list[str], calls: int = 30) -> dict[str, Any]:
    """The sparse mel product against the dense BLAS one: differences in log-mel and in tokens on
    corpus clips, and the process CPU milliseconds per call, each in a fresh process (BLAS
    threads' spinning included; a 10 ms pause after each call, as a model run would leave)."""
    from pipeline.audio.decode import load_audio
    from pipeline.features import whisper_log_mel
    from pipeline.inference import tokenizer_inputs
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.models.sessions import ModelSession
    from pipeline.settings import AudioLimits

    registry = Registry.load()
    session = ModelSession.load(
        registry.find_model("tokenizer", models), "tokenizer", SessionOptions("cpu"), registry
    )
    max_diff, cells, cells_diff, tokens, tokens_diff = 0.0, 0, 0, 0, 0
    for path in paths:
        wave = load_audio(path, AudioLimits()).samples
        new, old = whisper_log_mel(wave), dense_blas_log_mel(wave)
        max_diff = max(max_diff, float(np.abs(new - old).max()))
        cells += new.size
        cells_diff += int((new != old).sum())
        a = session.run(tokenizer_inputs(new))[0].flatten()
        b = session.run(tokenizer_inputs(old))[0].flatten()
        tokens += a.size
        tokens_diff += int((a != b).sum())
    from benchmarks.common import child_env, python_command, run_json_child

    cpu_ms = {}
    for name in ("dense_blas", "sparse"):
        command = python_command("benchmarks.parity", "log-mel-cpu", name, str(calls))
        cpu_ms[name] = run_json_child(command, child_env(), timeout_s=120)["cpu_ms"]
    return {
        "clips": len(paths),
        "max_abs_diff": max_diff,
        "cells_differing": cells_diff,
        "cells": cells,
        "tokens_differing": tokens_diff,
        "tokens": tokens,
        "cpu_ms_per_10s_clip": cpu_ms,
    }


def mel_filters_match_librosa() -> bool:
    """`pipeline.features.mel_filters` (no librosa import) is bit-identical to librosa's."""
    import librosa

    from pipeline.features import mel_filters

    return all(
        np.array_equal(mel_filters(n), librosa.filters.mel(sr=16000, n_fft=400, n_mels=n)) for n in (80, 128)
    )


def measure_parity(models: Path, corpus_paths: list[str] | None = None) -> dict[str, Any]:
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
        "stereo_mixdown_ms_per_audio_s": mixdown_ms_per_audio_s(),
        "mel_filters_identical_to_librosa": mel_filters_match_librosa(),
        "log_mel_sparse_vs_blas": log_mel_change(models, corpus_paths or []),
        "feature_ms_per_audio_s": {
            "whisper_log_mel_128": ms_per_audio_s(whisper_log_mel),
            "kaldi_fbank": ms_per_audio_s(kaldi_fbank),
            "kaldi_native_fbank": ms_per_audio_s(knf_fbank),
        },
    }


def log_mel_cpu_ms(kind: str, calls: int) -> float:
    """Process CPU milliseconds per `whisper_log_mel` call of a 10 s clip (`kind`: sparse or dense_blas)."""
    from pipeline.demo import speechlike
    from pipeline.features import whisper_log_mel

    function = dense_blas_log_mel if kind == "dense_blas" else whisper_log_mel
    wave = speechlike(10.0, 16000, 150.0, seed=3)
    function(wave)
    started = time.process_time()
    for _ in range(calls):
        function(wave)
        time.sleep(0.01)
    return round((time.process_time() - started) * 1000 / calls, 3)


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["log-mel-cpu"]:
        print(json.dumps({"cpu_ms": log_mel_cpu_ms(sys.argv[2], int(sys.argv[3]))}))
