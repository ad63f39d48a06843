"""Extraction on tiny stand-ins: token rates, embeddings, determinism, the 30 s window merge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import soundfile as sf
from onnx import TensorProto, helper, numpy_helper

from pipeline import Extractor
from pipeline.errors import MODEL_ERROR, NON_FINITE, OUT_OF_RANGE, ErrorRecord, VoxmillError
from pipeline.features import whisper_log_mel
from pipeline.inference import (
    STRIDE_FRAMES,
    WINDOW_FRAMES,
    merge_windows,
    run_clip,
    tokenize,
    tokenizer_inputs,
    window_starts,
)
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.standin import make_standins, write_model
from pipeline.settings import AudioLimits

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
    assert result.error == ErrorRecord("not_found", f"no such file: {tmp_path / 'missing.wav'}")
    assert set(result.models) == {"tokenizer", "embedder"}
    ok = run_clip("y", FIXTURES / "chirp_3s.wav", "extract", extractor.sessions, limits)
    assert ok.error is None and ok.audio_seconds == 3.0 and len(ok.embedding or []) == 192
    bad = run_clip("z", FIXTURES / "chirp_3s.wav", "transcribe", extractor.sessions, limits)
    assert bad.error is not None and bad.error.code == "bad_request"


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
    assert broken.error == ErrorRecord("internal", "RuntimeError: a bug")
    assert broken.stats is not None  # what was known before the bug is kept
    assert run_clip("y", FIXTURES / "chirp_3s.wav", "extract", extractor.sessions, AudioLimits()).ok


# --------------------------------------------------------------------------- numbers that are not audio


def bad_tokenizer(token: int) -> onnx.ModelProto:
    """A tokenizer with the real signature whose every token is `token` (one per feature frame)."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["feats"], ["level"], axes=[1], keepdims=0),  # [1, T]
            helper.make_node("Mul", ["level", "zero"], ["zeros"]),
            helper.make_node("Cast", ["zeros"], ["zeros_i64"], to=TensorProto.INT64),
            helper.make_node("Add", ["zeros_i64", "token"], ["indices"]),
        ],
        "bad_tokenizer",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T"])],
        [
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
            numpy_helper.from_array(np.array(token, dtype=np.int64), "token"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def nan_embedder() -> onnx.ModelProto:
    """An embedder with the real signature whose embedding is 192 x NaN."""
    weights = np.zeros((80, 192), dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[1], keepdims=0),  # [B, 80]
            helper.make_node("MatMul", ["pooled", "weights"], ["projected"]),
            helper.make_node("Add", ["projected", "nan"], ["output"]),
        ],
        "nan_embedder",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])],
        [
            numpy_helper.from_array(weights, "weights"),
            numpy_helper.from_array(np.full(192, np.nan, dtype=np.float32), "nan"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def loaded(model: onnx.ModelProto, path: Path, role: str) -> ModelSession:
    """`model` loaded as `role` the way a worker loads it, without the warm-up (which would refuse
    a NaN embedder before it serves)."""
    write_model(model, path)
    return ModelSession.load(path, role, SessionOptions(provider="cpu"), Registry.load())


def float_wav(path: Path, value: float) -> Path:
    samples = speech(1.0)
    samples[4000] = value
    sf.write(path, samples, 16000, subtype="FLOAT")
    return path


@pytest.mark.parametrize("value", [1e30, 3e38])
def test_a_clip_of_numbers_not_audio_is_out_of_range_and_its_result_is_json(
    extractor: Extractor, tmp_path: Path, value: float
) -> None:
    """Issue 31: a float WAV of 1e30 gave 192 x NaN and tokens of -2^63 (bare NaN in the JSON)."""
    path = float_wav(tmp_path / "loud.wav", value)
    result = run_clip("loud", path, "extract", extractor.sessions, AudioLimits())
    assert result.error is not None and result.error.code == OUT_OF_RANGE
    assert result.speech_token is None and result.embedding is None
    json.dumps(result.to_dict(), allow_nan=False)


@pytest.mark.parametrize("value", [1e30, np.inf])
def test_features_that_are_not_finite_are_non_finite(extractor: Extractor, value: float) -> None:
    """Waves handed over as arrays skip `load_audio`'s checks; their features are checked."""
    wave = speech(1.0)
    wave[4000] = value
    for extract, kind in ((extractor.tokenize, "log-mel"), (extractor.embed, "fbank")):
        with pytest.raises(VoxmillError) as caught:
            extract(wave)
        assert caught.value.code == NON_FINITE and f"{kind} features have" in caught.value.message


@pytest.mark.parametrize("token", [-1, 6561, -(2**63)])
def test_token_ids_outside_the_codebook_are_a_model_error(tmp_path: Path, token: int) -> None:
    session = loaded(bad_tokenizer(token), tmp_path / "speech_tokenizer_v2.onnx", "tokenizer")
    wave = speech(2.0)
    with pytest.raises(VoxmillError) as caught:
        tokenize(session, wave)
    assert caught.value.code == MODEL_ERROR
    assert f"gave 200 token ids outside [0, 6561) (from {token} to {token})" in caught.value.message
    path = tmp_path / "ok.wav"
    sf.write(path, wave, 16000)
    result = run_clip("clip", path, "tokenize", {"tokenizer": session}, AudioLimits())
    assert result.error is not None and result.error.code == MODEL_ERROR
    assert result.speech_token is None


def test_the_codebook_is_the_variants(tmp_path: Path) -> None:
    """CosyVoice 1's tokenizer has 4096 ids, 2 and 3 have 6561: 5000 is fine only for v2."""
    v2 = loaded(bad_tokenizer(5000), tmp_path / "speech_tokenizer_v2.onnx", "tokenizer")
    assert set(tokenize(v2, speech(1.0))) == {5000}
    v1 = loaded(bad_tokenizer(5000), tmp_path / "speech_tokenizer_v1.onnx", "tokenizer")
    with pytest.raises(VoxmillError) as caught:
        tokenize(v1, speech(1.0))
    assert caught.value.code == MODEL_ERROR and "outside [0, 4096)" in caught.value.message


def test_a_nan_embedding_is_a_model_error_for_that_clip_alone(extractor: Extractor, tmp_path: Path) -> None:
    session = loaded(nan_embedder(), tmp_path / "campplus.onnx", "embedder")
    path = tmp_path / "ok.wav"
    sf.write(path, speech(1.0), 16000)
    sessions = {"tokenizer": extractor.sessions["tokenizer"], "embedder": session}
    result = run_clip("clip", path, "extract", sessions, AudioLimits())
    assert result.error is not None and result.error.code == MODEL_ERROR
    assert "embedding with 192 non-finite values (NaN or Inf) of 192" in result.error.message
    json.dumps(result.to_dict(), allow_nan=False)
    assert run_clip("clip", path, "tokenize", sessions, AudioLimits()).ok  # the other op still serves


def s3tokenizer_030_starts(n_frames: int) -> list[int]:
    """s3tokenizer 0.3.0's long-audio loop: a window at every stride while it starts inside the clip,
    so past 5,200 frames it adds a tail window the one before already covered (docs/models.md)."""
    starts, start = [], 0
    while start < n_frames:
        starts.append(start)
        start += STRIDE_FRAMES
    return starts


@pytest.mark.parametrize(
    ("frames", "tokens", "s3tokenizer_030"),
    [(5201, 1301, 1251), (7801, 1951, 1901), (10401, 2601, 2551), (5600, 1400, 1400)],
)
def test_long_clips_keep_every_token_where_s3tokenizer_0_3_0_drops_50(
    extractor: Extractor, frames: int, tokens: int, s3tokenizer_030: int
) -> None:
    """voxmill's windows end once one reaches the clip's end: (T-1)//4+1 tokens at 25 Hz, as one
    window over the whole clip would give. s3tokenizer 0.3.0's redundant tail window costs it 50
    (2 s) at these lengths; at 5,600 frames the count agrees but its last 2 s come from the tail."""
    wave = (0.1 * np.random.default_rng(frames).standard_normal(frames * 160)).astype(np.float32)
    assert whisper_log_mel(wave).shape[1] == frames
    assert len(extractor.tokenize(wave)) == tokens == (frames - 1) // 4 + 1
    per_window = [(min(WINDOW_FRAMES, frames - s) - 1) // 4 + 1 for s in s3tokenizer_030_starts(frames)]
    merged = merge_windows([[0] * n for n in per_window], token_rate_hz=25)
    assert len(merged) == s3tokenizer_030  # the counts measured with s3tokenizer 0.3.0 (issue 35)
