"""Model input features, computed with numpy exactly as CosyVoice's torch code does.

- `whisper_log_mel`: whisper's `log_mel_spectrogram` (speech tokenizer input).
- `kaldi_fbank`: torchaudio's `compliance.kaldi.fbank` (CAM++ input), via kaldi-native-fbank.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

SAMPLE_RATE_HZ = 16000
N_FFT = 400
HOP = 160
FloatArray = npt.NDArray[np.float32]


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> FloatArray:
    """Slaney mel filters [n_mels, 201]; librosa's are bit-identical to whisper's `mel_filters.npz`."""
    import librosa

    filters = librosa.filters.mel(sr=SAMPLE_RATE_HZ, n_fft=N_FFT, n_mels=n_mels)
    return np.ascontiguousarray(filters, dtype=np.float32)


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

    log10 of the mel power floored at 1e-10, clamped to (max - 8), then (x + 4) / 4.
    """
    mel = mel_filters(n_mels) @ power_spectrum(wave)
    log_spec = np.log10(np.maximum(mel, np.float32(1e-10)))
    log_spec = np.maximum(log_spec, log_spec.max() - np.float32(8.0))
    out: FloatArray = ((log_spec + np.float32(4.0)) / np.float32(4.0)).astype(np.float32, copy=False)
    return out


def kaldi_fbank(wave: FloatArray, num_mel_bins: int = 80) -> FloatArray:
    """Kaldi fbank as torchaudio computes it (dither 0, 16 kHz, snip edges): float32 [T', 80].

    The wave is the float one in [-1, 1], not scaled to the int16 range (as CosyVoice feeds it).
    T' = 1 + (N - 400) // 160; an empty array when N < 400.
    """
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = float(SAMPLE_RATE_HZ)
    opts.mel_opts.num_bins = num_mel_bins
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(float(SAMPLE_RATE_HZ), wave.astype(np.float32, copy=False))
    fbank.input_finished()
    n = fbank.num_frames_ready
    if n == 0:
        return np.zeros((0, num_mel_bins), dtype=np.float32)
    feats: FloatArray = np.stack([fbank.get_frame(i) for i in range(n)]).astype(np.float32, copy=False)
    return feats


def mean_normalized(feats: FloatArray) -> FloatArray:
    """Subtract the mean over time (axis 0), as CosyVoice does before CAM++."""
    centered: FloatArray = (feats - feats.mean(axis=0, keepdims=True)).astype(np.float32, copy=False)
    return centered
