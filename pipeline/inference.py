"""Tokens and embeddings from a 16 kHz wave and a warm session, exactly as CosyVoice computes them.

- `tokenize`: whisper log-mel (128) -> `[feats [1,128,T], feats_length [1]]` -> tokens. Clips over
  30 s are tokenized in 30 s windows every 26 s (4 s overlap) over one log-mel of the whole
  clip, dropping half of each overlap on both inner sides (s3tokenizer's merge).
- `embed`: Kaldi fbank (80) minus its mean over time -> `[1, T, 80]` -> 192 floats.

Nothing that is not a number leaves here: non-finite features are `non_finite`, and a token id
outside the tokenizer's codebook or a non-finite embedding is `model_error` (each one min/max
pass over an array the model already read or wrote).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.audio.decode import Audio, ClipRefused, Segment, load_audio
from pipeline.audio.quality import clip_stats
from pipeline.audio.sources import Source
from pipeline.audio.vad import SpeechCheck, require_speech, shared_detector
from pipeline.errors import ErrorRecord, VoxmillError
from pipeline.features import (
    HOP,
    SAMPLE_RATE_HZ,
    STRIDE_FRAMES,
    WINDOW_FRAMES,
    kaldi_fbank,
    mean_normalized,
    whisper_log_mel,
)
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER, ROLES_BY_OP, ModelRef, TaskResult
from pipeline.settings import AudioLimits

log = logging.getLogger("voxmill.inference")

OVERLAP_S = (WINDOW_FRAMES - STRIDE_FRAMES) * HOP // SAMPLE_RATE_HZ  # 4 s of the windows' overlap
WARMUP_SECONDS = 3.0
# What serving imports lazily. A process that forks serving processes (a prefork worker, the
# watcher's validator) imports them first, once: importing builds no session and starts no
# thread, so it is fork-safe, and each forked process is spared about 0.5 s of CPU (scipy's FFT
# and sparse modules, which `pipeline.features` imports on first use, are 0.15-0.2 s of it).
SERVING_IMPORTS = ("onnxruntime", "pipeline.inference", "scipy.fft", "scipy.sparse")
FloatArray = npt.NDArray[np.float32]
# Token ids lie in [0, size) of the tokenizer variant's codebook: CosyVoice 1's VQ (4096), the FSQ
# 3^8 of CosyVoice 2 and 3 and of the stand-ins (6561). Any other file gets the largest.
CODEBOOK_SIZES = {"v1": 4096, "v1_25hz": 4096, "v2": 6561, "v3": 6561}
DEFAULT_CODEBOOK_SIZE = 6561


@dataclass
class Timings:
    """Milliseconds spent per stage of one request.

    Stages partition the request's time: `decode` and `resample` (audio), `speech` (the speech
    detector) and `stats` (quality statistics), `log_mel` and `tokenize` (tokenizer features and
    inference), `fbank` and `embed` (embedder features and inference).
    """

    stages: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, started: float) -> float:
        now = time.perf_counter()
        self.stages[stage] = round(self.stages.get(stage, 0.0) + (now - started) * 1000.0, 3)
        return now


def window_starts(n_frames: int) -> list[int]:
    """Start frames of the 30 s windows covering `n_frames`; one window when it fits."""
    starts = [0]
    while starts[-1] + WINDOW_FRAMES < n_frames:
        starts.append(starts[-1] + STRIDE_FRAMES)
    return starts


def merge_windows(windows: list[list[int]], token_rate_hz: int) -> list[int]:
    """s3tokenizer's merge: drop half of the overlap's tokens on each inner side of every window."""
    half = (OVERLAP_S // 2) * token_rate_hz
    merged: list[int] = []
    for index, tokens in enumerate(windows):
        left = 0 if index == 0 else half
        right = len(tokens) if index == len(windows) - 1 else len(tokens) - half
        merged.extend(tokens[left:right])
    return merged


def tokenizer_inputs(log_mel: FloatArray) -> list[npt.NDArray[Any]]:
    """Session inputs for one log-mel window [128, T]: feats [1,128,T] float32, feats_length [1] int32."""
    return [log_mel[np.newaxis, :, :], np.array([log_mel.shape[1]], dtype=np.int32)]


def embedder_inputs(wave: FloatArray) -> list[npt.NDArray[Any]]:
    """Session inputs for one wave: mean-normalised fbank [1, T, 80] float32."""
    return [mean_normalized(kaldi_fbank(wave))[np.newaxis, :, :]]


def all_finite(values: npt.NDArray[Any]) -> bool:
    """True when no element is NaN or Inf (a min and a max: no temporary array)."""
    if values.size == 0:
        return True
    return bool(np.isfinite(values.min()) and np.isfinite(values.max()))


def require_finite_features(features: npt.NDArray[Any], kind: str) -> None:
    """`non_finite` when model input features hold a NaN or Inf (the audio was not audio)."""
    if not all_finite(features):
        bad = int(features.size - np.count_nonzero(np.isfinite(features)))
        raise VoxmillError(
            errors.NON_FINITE, f"{kind} features have {bad} non-finite values (NaN or Inf) of {features.size}"
        )


def codebook_size(session: ModelSession) -> int:
    """How many token ids the tokenizer of `session` has (`CODEBOOK_SIZES`)."""
    return CODEBOOK_SIZES.get(session.identified.variant.name, DEFAULT_CODEBOOK_SIZE)


def checked_tokens(session: ModelSession, output: npt.NDArray[Any]) -> list[int]:
    """The token ids of one tokenizer output, or `model_error` when any is not an id of its codebook."""
    size = codebook_size(session)
    if output.size and not np.issubdtype(output.dtype, np.integer):
        raise VoxmillError(
            errors.MODEL_ERROR, f"{session.path.name} gave {output.dtype} tokens, not integers"
        )
    if output.size and (output.min() < 0 or output.max() >= size):
        outside = int(np.count_nonzero((output < 0) | (output >= size)))
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{session.path.name} gave {outside} token ids outside [0, {size}) "
            f"(from {int(output.min())} to {int(output.max())})",
        )
    tokens: list[int] = output.flatten().tolist()  # Python ints
    return tokens


def checked_embedding(session: ModelSession, output: npt.NDArray[Any]) -> FloatArray:
    """One embedder output as float32 [D], or `model_error` when any value is NaN or Inf."""
    embedding = np.asarray(output, dtype=np.float32).flatten()
    if not all_finite(embedding):
        bad = int(embedding.size - np.count_nonzero(np.isfinite(embedding)))
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{session.path.name} gave an embedding with {bad} non-finite values (NaN or Inf) "
            f"of {embedding.size}",
        )
    return embedding


def log_mel_windows(wave: FloatArray) -> list[FloatArray]:
    """The tokenizer's inputs of a 16 kHz wave: its log-mel [128, T] cut into the 30 s windows.

    `non_finite` when the log-mel holds a NaN or Inf. What `tokenize` and the batched path
    (`pipeline.batching`) both run, so the two see the very same features.
    """
    log_mel = np.ascontiguousarray(whisper_log_mel(wave, n_mels=128))
    require_finite_features(log_mel, "log-mel")
    return [
        np.ascontiguousarray(log_mel[:, start : start + WINDOW_FRAMES])
        for start in window_starts(log_mel.shape[1])
    ]


def tokenize(session: ModelSession, wave: FloatArray, timings: Timings | None = None) -> list[int]:
    """Speech tokens of a 16 kHz float32 wave (any length; windows beyond 30 s).

    With `timings`, adds the features' time to `log_mel` and the model's to `tokenize`.
    """
    started = time.perf_counter()
    features = log_mel_windows(wave)
    if timings is not None:
        started = timings.add("log_mel", started)
    windows = [checked_tokens(session, session.run(tokenizer_inputs(window))[0]) for window in features]
    result = windows[0] if len(windows) == 1 else merge_windows(windows, session.token_rate_hz)
    if timings is not None:
        timings.add("tokenize", started)
    return result


def embed(session: ModelSession, wave: FloatArray, timings: Timings | None = None) -> FloatArray:
    """Speaker embedding of a 16 kHz float32 wave: float32 [192].

    With `timings`, adds the features' time to `fbank` and the model's to `embed`.
    """
    started = time.perf_counter()
    inputs = embedder_inputs(wave)
    require_finite_features(inputs[0], "fbank")
    if timings is not None:
        started = timings.add("fbank", started)
    embedding = checked_embedding(session, session.run(inputs)[0])
    if timings is not None:
        timings.add("embed", started)
    return embedding


def warmup_wave(seconds: float = WARMUP_SECONDS) -> FloatArray:
    """A fixed, speech-like clip (harmonics with a wandering pitch plus noise) for warm-up."""
    rng = np.random.default_rng(7)
    t = np.arange(int(seconds * 16000)) / 16000.0
    f0 = 140.0 + 40.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000.0
    wave = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.2 + rng.normal(0, 0.01, len(t))
    return np.asarray(wave, dtype=np.float32)


def warm_up(session: ModelSession, runs: int) -> float:
    """Run the role's warm-up clip through `session`; returns the warm latency (ms)."""
    wave = warmup_wave()
    if session.role == ROLE_TOKENIZER:
        inputs = tokenizer_inputs(whisper_log_mel(wave))
    else:
        inputs = embedder_inputs(wave)
    return session.warm_up(inputs, runs)


def open_session(
    path: Path,
    role: str,
    options: SessionOptions,
    registry: Registry,
    expected_sha256: str | None = None,
) -> ModelSession:
    """Load and warm up a model: what every worker, extractor and validator calls."""
    session = ModelSession.load(path, role, options, registry, expected_sha256)
    warm_up(session, options.warmup_runs)
    return session


def run_op(op: str, audio: Audio, sessions: Mapping[str, ModelSession], timings: Timings) -> dict[str, Any]:
    """Tokens and/or embedding of decoded audio for `op`; the result fields of `TaskResult`."""
    fields: dict[str, Any] = {}
    if ROLE_TOKENIZER in ROLES_BY_OP[op]:
        fields["speech_token"] = tokenize(sessions[ROLE_TOKENIZER], audio.samples, timings)
    if ROLE_EMBEDDER in ROLES_BY_OP[op]:
        fields["embedding"] = embed(sessions[ROLE_EMBEDDER], audio.samples, timings).tolist()
    return fields


def audio_stats(audio: Audio, speech: SpeechCheck | None, timings: Timings) -> dict[str, Any]:
    """The clip's quality statistics; with an enabled `speech` check, its detected speech too.

    The detector is this process's (`shared_detector`: loaded on first use, then kept).
    """
    speech_s = None
    if speech is not None and speech.enabled:
        started = time.perf_counter()
        speech_s = shared_detector(speech).detect(audio.samples, speech).speech_s
        timings.add("speech", started)
    started = time.perf_counter()
    stats = clip_stats(
        audio.samples,
        source_rate_hz=audio.source_rate_hz,
        channels=audio.channels,
        codec=audio.codec or None,
        speech_s=speech_s,
    )
    timings.add("stats", started)
    return stats


@dataclass
class ClipRun:
    """One clip on its way to a result: each step runs unless an earlier one failed, and the first
    error (a code, or `internal` for a bug) becomes the clip's result, with what is known of it."""

    label: str
    op: str
    models: dict[str, ModelRef]
    timings: Timings = field(default_factory=Timings)
    audio: Audio | None = None
    seconds: float = 0.0
    stats: dict[str, Any] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    error: ErrorRecord | None = None

    def step(self, work: Callable[[], object]) -> bool:
        """Run `work` unless the clip already failed; whether the clip is still good."""
        if self.error is not None:
            return False
        try:
            work()
        except VoxmillError as exc:
            self.error = exc.record()
            if isinstance(exc, ClipRefused):  # decoded, then refused: what is known of it
                self.stats = exc.stats
        except Exception as exc:  # a bug fails this clip alone, with a code, instead of its whole batch
            log.exception("clip %s (%s) failed unexpectedly", self.label, self.op)
            self.error = ErrorRecord(errors.INTERNAL, f"{type(exc).__name__}: {exc}")
        return self.error is None

    def decode(
        self, source: Source, limits: AudioLimits, speech: SpeechCheck | None, segment: Segment | None
    ) -> None:
        """Decode (with `segment`: only that part), the stats, and the speech check when enabled."""
        if self.op not in ROLES_BY_OP:
            raise VoxmillError(errors.BAD_REQUEST, f"unknown op {self.op!r}; use tokenize, embed or extract")
        self.audio = load_audio(source, limits, self.timings.stages, segment)
        self.seconds = self.audio.duration_s
        self.stats = audio_stats(self.audio, speech, self.timings)
        if speech is not None and speech.enabled:
            require_speech(float(self.stats["speech_s"]), self.audio.duration_s, speech)

    def run_models(self, sessions: Mapping[str, ModelSession]) -> None:
        """Tokens and/or embedding of the decoded clip (`run_op`)."""
        if self.audio is None:
            raise RuntimeError(f"clip {self.label} runs its models before it is decoded")
        self.fields.update(run_op(self.op, self.audio, sessions, self.timings))

    def result(self) -> TaskResult:
        if self.error is not None:
            return TaskResult(
                input=self.label,
                op=self.op,
                models=self.models,
                error=self.error,
                timings_ms=self.timings.stages,
                stats=self.stats,
            )
        return TaskResult(
            input=self.label,
            op=self.op,
            audio_seconds=round(self.seconds, 4),
            models=self.models,
            timings_ms=self.timings.stages,
            stats=self.stats,
            **self.fields,
        )


def run_clip(
    label: str,
    source: Source,
    op: str,
    sessions: Mapping[str, ModelSession],
    limits: AudioLimits,
    speech: SpeechCheck | None = None,
    segment: Segment | None = None,
) -> TaskResult:
    """Decode `source` (with `segment`: only that part of it) and run `op`; never raises for bad
    input: errors come back as data.

    Every decoded clip gets `stats` (one refused once decoded, such as `too_short`, what is known
    of it); with an enabled `speech` check, one with less detected
    speech than `speech.min_speech_ms` is `no_speech` (its stats still come back). Without
    `speech` no detector runs.
    """
    clip = ClipRun(label, op, models_of(op, sessions))
    if clip.step(lambda: clip.decode(source, limits, speech, segment)):
        clip.step(lambda: clip.run_models(sessions))
    return clip.result()


def models_of(op: str, sessions: Mapping[str, ModelSession]) -> dict[str, ModelRef]:
    """{role: the file that serves it} of the roles `op` needs."""
    return {role: sessions[role].ref for role in ROLES_BY_OP.get(op, ()) if role in sessions}
