"""Extraction on tiny stand-ins: token rates, embeddings, determinism, the 30 s window merge."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline import Extractor
from pipeline.errors import VoxmillError
from pipeline.features import whisper_log_mel
from pipeline.inference import (
    STRIDE_FRAMES,
    WINDOW_FRAMES,
    merge_windows,
    run_clip,
    tokenizer_inputs,
    window_starts,
)
from pipeline.settings import AudioLimits
from pipeline.standin import make_standins

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="module")
def extractor(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("models")
    make_standins(folder)
    with Extractor.from_model_dir(folder, provider="cpu") as ex:
        yield ex


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (150 + 50 * np.sin(t)) * t) + rng.normal(0, 0.02, len(t))
    return wave.astype(np.float32)


@pytest.mark.parametrize("name", ["chirp_3s", "noise_1p37s", "speechlike_7p5s", "stereo44k_2s"])
def test_token_count_is_25_per_second(extractor: Extractor, name: str) -> None:
    wav = FIXTURES / f"{name}.wav"
    seconds = extractor.wave(wav).size / 16000
    tokens = extractor.tokenize(wav)
    assert abs(len(tokens) - 25 * seconds) <= 1
    assert all(0 <= t < 6561 for t in tokens)


def test_embedding_is_192_finite_floats_and_deterministic(extractor: Extractor) -> None:
    wav = FIXTURES / "speechlike_7p5s.wav"
    first, second = extractor.embed(wav), extractor.embed(wav)
    assert first.shape == (192,) and first.dtype == np.float32 and np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)
    assert extractor.tokenize(wav) == extractor.tokenize(wav)
    assert not np.allclose(first, extractor.embed(FIXTURES / "chirp_3s.wav"))


def test_path_bytes_and_array_inputs_agree(extractor: Extractor) -> None:
    wav = FIXTURES / "chirp_3s.wav"
    by_path = extractor.tokenize(wav)
    assert extractor.tokenize(wav.read_bytes()) == by_path
    assert extractor.tokenize(extractor.wave(wav)) == by_path


def test_window_plan() -> None:
    assert window_starts(3000) == [0]
    assert window_starts(3001) == [0, STRIDE_FRAMES]
    assert window_starts(7500) == [0, 2600, 5200]
    for n in (3001, 5600, 5601, 7500, 12000):
        starts = window_starts(n)
        assert starts[-1] + WINDOW_FRAMES >= n and starts[-2] + WINDOW_FRAMES < n


def test_merge_drops_half_the_overlap_on_inner_sides() -> None:
    windows = [list(range(0, 750)), list(range(650, 1400)), list(range(1300, 1875))]
    assert merge_windows(windows, token_rate_hz=25) == list(range(0, 1875))


def test_75_s_clip_is_tokenized_in_windows_and_merged(extractor: Extractor) -> None:
    wave = speech(75.0)
    tokens = extractor.tokenize(wave)
    assert len(tokens) == 75 * 25
    session = extractor.sessions["tokenizer"]
    log_mel = whisper_log_mel(wave)
    windows = [
        session.run(tokenizer_inputs(np.ascontiguousarray(log_mel[:, s : s + WINDOW_FRAMES])))[0]
        .flatten()
        .tolist()
        for s in window_starts(log_mel.shape[1])
    ]
    assert len(windows) == 3
    assert tokens[:700] == windows[0][:700]  # first window: all but the last 2 s
    assert tokens[700:1350] == windows[1][50:700]  # inner window: 2 s dropped on each side
    assert tokens[1350:] == windows[2][50:]  # last window: all but the first 2 s


def test_30_s_clip_is_one_window(extractor: Extractor) -> None:
    wave = speech(30.0, seed=1)
    session = extractor.sessions["tokenizer"]
    direct = session.run(tokenizer_inputs(whisper_log_mel(wave)))[0].flatten().tolist()
    assert extractor.tokenize(wave) == direct and len(direct) == 750


def test_process_returns_errors_as_data(extractor: Extractor, tmp_path: Path) -> None:
    limits = AudioLimits()
    result = run_clip("x", tmp_path / "missing.wav", "extract", extractor.sessions, limits)
    assert result.error == {"code": "not_found", "message": f"no such file: {tmp_path / 'missing.wav'}"}
    assert set(result.models) == {"tokenizer", "embedder"}
    ok = run_clip("y", FIXTURES / "chirp_3s.wav", "extract", extractor.sessions, limits)
    assert ok.error is None and ok.audio_seconds == 3.0 and len(ok.embedding or []) == 192
    bad = run_clip("z", FIXTURES / "chirp_3s.wav", "transcribe", extractor.sessions, limits)
    assert bad.error is not None and bad.error["code"] == "bad_request"


def test_extractor_without_a_role_says_so(tmp_path: Path) -> None:
    make_standins(tmp_path)
    with Extractor.from_model_dir(tmp_path, roles=["embedder"]) as ex, pytest.raises(VoxmillError) as caught:
        ex.tokenize(FIXTURES / "chirp_3s.wav")
    assert caught.value.code == "model_error" and "tokenizer" in caught.value.message



@pytest.mark.parametrize("blas", ["dot", "vdot", "inner", "matmul", "tensordot"])
def test_a_clip_calls_no_blas(tiny_models: Path, blas: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes run one single-threaded model each, one per core: a BLAS call in the per-clip
    path (np.dot of a long vector, a dense matmul) wakes a thread per core that competes with them
    (each clip of a 2-process run took 15x longer)."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"np.{blas} called in the per-clip path")

    with Extractor.from_model_dir(tiny_models, provider="cpu") as extractor:
        monkeypatch.setattr(np, blas, refused)
        for op in ("tokenize", "embed", "extract"):
            assert run_clip("x", FIXTURES / "chirp_3s.wav", op, extractor.sessions, AudioLimits()).ok


def test_an_unexpected_exception_fails_that_clip_alone_as_internal(
    extractor: Extractor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import soundfile as sf

    import pipeline.inference as inference

    sf.write(tmp_path / "short.wav", speech(1.0), 16000)

    real = inference.run_op

    def broken_on_z(op: str, audio: object, sessions: object, timings: object) -> object:
        if audio.duration_s < 3.0:  # type: ignore[attr-defined]
            raise RuntimeError("a bug")
        return real(op, audio, sessions, timings)  # type: ignore[arg-type]

    monkeypatch.setattr(inference, "run_op", broken_on_z)
    broken = run_clip("z", tmp_path / "short.wav", "extract", extractor.sessions, AudioLimits())
    assert broken.error == {"code": "internal", "message": "RuntimeError: a bug"}
    assert broken.stats is not None  # what was known before the bug is kept
    assert run_clip("y", FIXTURES / "chirp_3s.wav", "extract", extractor.sessions, AudioLimits()).ok
