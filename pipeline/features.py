"""Model input features, computed with numpy exactly as CosyVoice's torch code does.

- `whisper_log_mel`: whisper's `log_mel_spectrogram` (speech tokenizer input).
- `kaldi_fbank`: torchaudio's `compliance.kaldi.fbank` (CAM++ input), vectorised over frames
  (about 3x faster than kaldi-native-fbank, and nearer torch's numbers).

Neither calls BLAS: the mel products are sparse. Worker processes run one single-threaded model
each, one per core; a BLAS call would start a thread per core that then competes with them.
The FFT and the sparse products are scipy's (imported on first use: a producer importing this
module pays nothing for them).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

SAMPLE_RATE_HZ = 16000
N_FFT = 400
HOP = 160
WINDOW_FRAMES = 3000  # the tokenizer's window: 30 s of 10 ms frames
STRIDE_FRAMES = 2600  # 26 s: windows overlap by 4 s
KALDI_FRAME = 400  # 25 ms
KALDI_SHIFT = 160  # 10 ms
KALDI_FFT = 512  # the frame zero-padded to a power of two
KALDI_LOW_HZ = 20.0
PREEMPHASIS = 0.97
FLOAT32_EPS = float(np.finfo(np.float32).eps)
FBANK_BLOCK_FRAMES = 256  # frames per block: about 2.5 s of audio, small enough to stay in cache
FloatArray = npt.NDArray[np.float32]


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> FloatArray:
    """Slaney mel filters [n_mels, 201]: whisper's `mel_filters.npz`, which is librosa's
    `filters.mel(sr=16000, n_fft=400, n_mels=n_mels)`.

    The same operations as librosa's, in the same order, so the result is bit-identical
    (`benchmarks/parity.py` checks it), without importing librosa (about 1 s at worker start).
    """
    f_sp = 200.0 / 3  # Slaney: linear below 1 kHz, 200/3 Hz per mel
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    max_mel = min_log_mel + np.log((SAMPLE_RATE_HZ / 2) / min_log_hz) / logstep  # hz_to_mel(8000)
    mels = np.linspace(0.0, max_mel, n_mels + 2)
    mel_hz = f_sp * mels
    log_t = mels >= min_log_mel
    mel_hz[log_t] = min_log_hz * np.exp(logstep * (mels[log_t] - min_log_mel))
    fft_hz = np.fft.rfftfreq(n=N_FFT, d=1.0 / SAMPLE_RATE_HZ)
    fdiff = np.diff(mel_hz)
    ramps = np.subtract.outer(mel_hz, fft_hz)
    weights = np.zeros((n_mels, 1 + N_FFT // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_hz[2 : n_mels + 2] - mel_hz[:n_mels]))[:, np.newaxis]
    return weights


@lru_cache(maxsize=4)
def _sparse_mel_filters(n_mels: int) -> Any:
    """`mel_filters` as a float64 CSR matrix (about 400 of 25728 weights are non-zero).

    A dense float32 product would go to BLAS, and OpenBLAS wakes one thread per core for it:
    threads that then spin on the cores the other worker processes' models run on (measured in
    BENCHMARKS.md). This product needs no BLAS and is exact to float32 rounding (within one ulp
    of the BLAS one).
    """
    import scipy.sparse

    return scipy.sparse.csr_matrix(mel_filters(n_mels).astype(np.float64))


@lru_cache(maxsize=1)
def hann_window() -> FloatArray:
    """Periodic Hann window of N_FFT samples (torch.hann_window default)."""
    n = np.arange(N_FFT, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * n / N_FFT)).astype(np.float32)


def power_spectrum(wave: FloatArray) -> FloatArray:
    """|STFT|^2 [201, T] with T = len(wave) // 160, centered with reflect padding, last frame dropped."""
    pad = N_FFT // 2
    if len(wave) <= pad:
        raise ValueError(f"need more than {pad} samples for a centered STFT, got {len(wave)}")
    padded = np.pad(wave.astype(np.float32, copy=False), pad, mode="reflect")
    n_frames = 1 + (len(padded) - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][: n_frames - 1]
    spectrum = np.fft.rfft(frames * hann_window(), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    return np.ascontiguousarray(power.T, dtype=np.float32)


def whisper_log_mel(wave: FloatArray, n_mels: int = 128) -> FloatArray:
    """Whisper log-mel spectrogram: 16 kHz float32 [N] -> float32 [n_mels, N // 160].

    log10 of the mel power floored at 1e-10, clamped to (max - 8), then (x + 4) / 4. The mel
    product is sparse and in float64 (`_sparse_mel_filters`): no BLAS call, so no BLAS threads.
    """
    mel = np.asarray(_sparse_mel_filters(n_mels) @ power_spectrum(wave).astype(np.float64)).astype(np.float32)
    log_spec = np.log10(np.maximum(mel, np.float32(1e-10)))
    log_spec = np.maximum(log_spec, log_spec.max() - np.float32(8.0))
    out: FloatArray = ((log_spec + np.float32(4.0)) / np.float32(4.0)).astype(np.float32, copy=False)
    return out


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_mel_bins: int) -> npt.NDArray[np.float64]:
    """Kaldi's triangular mel filters [num_mel_bins, 256] (20 Hz to Nyquist, 512-point FFT).

    Computed in float32 exactly as torchaudio's `get_mel_banks` does (the filters' near-zero
    tails set how a pure tone leaks into neighbouring bins), returned as float64.
    """
    f32 = np.float32
    low_mel = 1127.0 * math.log(1.0 + KALDI_LOW_HZ / 700.0)
    high_mel = 1127.0 * math.log(1.0 + (SAMPLE_RATE_HZ / 2) / 700.0)
    delta = (high_mel - low_mel) / (num_mel_bins + 1)
    bins = np.arange(num_mel_bins, dtype=f32)[:, np.newaxis]
    left = f32(low_mel) + bins * f32(delta)
    center = f32(low_mel) + (bins + f32(1.0)) * f32(delta)
    right = f32(low_mel) + (bins + f32(2.0)) * f32(delta)
    fft_hz = f32(SAMPLE_RATE_HZ / KALDI_FFT) * np.arange(KALDI_FFT // 2, dtype=f32)
    mel = (f32(1127.0) * np.log(f32(1.0) + fft_hz / f32(700.0)))[np.newaxis, :]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks: npt.NDArray[np.float64] = np.maximum(f32(0.0), np.minimum(up, down)).astype(np.float64)
    return banks


@lru_cache(maxsize=4)
def _sparse_mel_banks(num_mel_bins: int) -> Any:
    """`kaldi_mel_banks` as a CSR matrix: each filter covers a few FFT bins (about 500 of 20480
    weights are non-zero), and a sparse product never starts BLAS threads."""
    import scipy.sparse

    return scipy.sparse.csr_matrix(kaldi_mel_banks(num_mel_bins).astype(np.float32))


@lru_cache(maxsize=1)
def povey_window() -> npt.NDArray[np.float64]:
    """Kaldi's Povey window of 400 samples: a symmetric Hann window to the power 0.85."""
    n = np.arange(KALDI_FRAME, dtype=np.float64)
    window: npt.NDArray[np.float64] = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / (KALDI_FRAME - 1))) ** 0.85
    return window


def frame_sums(samples: FloatArray, n_frames: int) -> npt.NDArray[np.float64]:
    """The float64 sum of each of the first `n_frames` Kaldi frames (400 samples, shift 160) of
    `samples`: a frame is five 80-sample chunks, each summed once (ten times faster than a running
    sum over a float64 copy of the wave, and no cancellation on long waves)."""
    chunk = math.gcd(KALDI_FRAME, KALDI_SHIFT)
    per_frame, per_shift = KALDI_FRAME // chunk, KALDI_SHIFT // chunk
    n_chunks = (n_frames - 1) * per_shift + per_frame
    sums = samples[: n_chunks * chunk].reshape(n_chunks, chunk).sum(axis=1, dtype=np.float64)
    span = (n_frames - 1) * per_shift + 1
    total: npt.NDArray[np.float64] = sums[0:span:per_shift].copy()
    for offset in range(1, per_frame):
        total += sums[offset : offset + span : per_shift]
    return total


def kaldi_fbank(wave: FloatArray, num_mel_bins: int = 80) -> FloatArray:
    """Kaldi fbank as torchaudio computes it (dither 0, 16 kHz, snip edges): float32 [T', 80].

    The wave is the float one in [-1, 1], not scaled to the int16 range (as CosyVoice feeds it).
    T' = 1 + (N - 400) // 160; an empty array when N < 400.

    Per 25 ms frame: remove the mean, pre-emphasise (0.97; the first sample against itself),
    apply the Povey window, zero-pad to 512, |FFT|^2, Kaldi mel filters, log floored at float32
    epsilon. Vectorised over blocks of frames: the pre-emphasis runs once over the wave (it is
    the same for every frame but the first sample, which the window zeroes) and frame means are
    sums of 80-sample chunks (`frame_sums`), both in float64; the frames, FFT and mel product are
    float32, as torch computes them (twice as fast as float64, and as near torch's output where
    it matters: numbers in BENCHMARKS.md).
    """
    import scipy.fft

    samples = np.asarray(wave, dtype=np.float32).reshape(-1)
    n_frames = 1 + (len(samples) - KALDI_FRAME) // KALDI_SHIFT if len(samples) >= KALDI_FRAME else 0
    feats: FloatArray = np.empty((n_frames, num_mel_bins), dtype=np.float32)
    if n_frames == 0:
        return feats
    # (x[i] - m) - 0.97 (x[i-1] - m) = x[i] - 0.97 x[i-1] - 0.03 m for i >= 1
    offsets32 = (frame_sums(samples, n_frames) * ((1.0 - PREEMPHASIS) / KALDI_FRAME)).astype(np.float32)
    wave64 = samples.astype(np.float64)
    emphasised = (wave64[1:] - PREEMPHASIS * wave64[:-1]).astype(np.float32)
    frames = np.lib.stride_tricks.sliding_window_view(emphasised, KALDI_FRAME - 1)[::KALDI_SHIFT]
    window = povey_window()[1:].astype(np.float32)  # window[0] == 0: sample 0 of every frame stays 0
    banks = _sparse_mel_banks(num_mel_bins)
    padded = np.zeros((min(FBANK_BLOCK_FRAMES, n_frames), KALDI_FFT), dtype=np.float32)
    for first in range(0, n_frames, FBANK_BLOCK_FRAMES):
        last = min(n_frames, first + FBANK_BLOCK_FRAMES)
        block = padded[: last - first]
        np.subtract(frames[first:last], offsets32[first:last, np.newaxis], out=block[:, 1:KALDI_FRAME])
        block[:, 1:KALDI_FRAME] *= window
        spectrum = scipy.fft.rfft(block, axis=-1)[:, : KALDI_FFT // 2]
        power = np.square(spectrum.real)
        power += np.square(spectrum.imag)
        energies = np.asarray(banks @ power.T)  # [bins, frames]
        np.log(np.maximum(energies, FLOAT32_EPS).T, out=feats[first:last], casting="same_kind")
    return feats


def mean_normalized(feats: FloatArray) -> FloatArray:
    """Subtract the mean over time (axis 0), as CosyVoice does before CAM++."""
    centered: FloatArray = (feats - feats.mean(axis=0, keepdims=True)).astype(np.float32, copy=False)
    return centered


def frontend_parameters() -> dict[str, Any]:
    """The front-end every token and embedding of this voxmill comes from (a run's provenance)."""
    return {
        "sample_rate_hz": SAMPLE_RATE_HZ,
        "resampler": "soxr HQ",
        "tokenizer_features": {
            "kind": "whisper log-mel",
            "n_mels": 128,
            "n_fft": N_FFT,
            "hop": HOP,
            "window_frames": WINDOW_FRAMES,
            "stride_frames": STRIDE_FRAMES,
        },
        "embedder_features": {
            "kind": "kaldi fbank, mean-normalised over time",
            "num_mel_bins": 80,
            "frame_length": KALDI_FRAME,
            "frame_shift": KALDI_SHIFT,
            "dither": 0.0,
            "preemphasis": PREEMPHASIS,
        },
    }
