"""The speech detector: the vendored Silero VAD model, its framing, the segment rule, real speech."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.audio import vad
from pipeline.audio.vad import (
    BLOCK_FRAMES,
    DETECTOR_FILE,
    FRAME_SAMPLES,
    MODEL_FILE,
    MODEL_SHA256,
    SpeechCheck,
    SpeechDetector,
    conv1d_as_matrix,
    detector_graph,
    frame_rows,
    require_speech,
    segments_from_probs,
    shared_detector,
)
from pipeline.demo import speechlike
from pipeline.errors import VoxmillError
from pipeline.models.standin import make_standins
from tests.speech_audio import (
    ESPEAK,
    NO_ESPEAK,
    burst,
    click,
    dither,
    espeak_wave,
    hum,
    needs_espeak,
    tone,
    white_noise,
    with_noise,
)

WHEEL_ENV = "VOXMILL_SILERO_WHEEL"
# The detector's probabilities against the vendored graph's: the same weights and arithmetic, summed
# in another order in float32 (its encoder as matrix products), so not bit for bit.
PROBABILITY_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def detector() -> SpeechDetector:
    return shared_detector(SpeechCheck())


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    if ESPEAK is None:
        pytest.skip(NO_ESPEAK)
    return espeak_wave()


def test_the_vendored_file_is_the_one_its_readme_names() -> None:
    data = MODEL_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == MODEL_SHA256
    readme = (MODEL_FILE.parent / "README.md").read_text()
    assert MODEL_SHA256 in readme and "silero-vad 6.2.3" in readme and MODEL_FILE.name in readme
    assert (MODEL_FILE.parent / "LICENSE").read_text().startswith("MIT License")


def test_the_detector_file_is_derived_from_the_vendored_graph() -> None:
    import onnx

    derived = onnx.load_from_string(detector_graph(MODEL_FILE.read_bytes()))
    assert onnx.load(str(DETECTOR_FILE)).graph == derived.graph
    ops = [node.op_type for node in derived.graph.node]
    assert not any(node.name.startswith("/stft") for node in derived.graph.node)
    assert ops.count("Gemm") == 4 and ops.count("LSTM") == 1
    assert ops.count("Conv") == 1  # the output's 1x1 convolution, after the LSTM, as it was


@pytest.mark.parametrize(("length", "stride"), [(4, 1), (4, 2), (2, 2), (1, 1), (5, 2)])
def test_a_convolution_as_one_matrix(length: int, stride: int) -> None:
    rng = np.random.default_rng(length * 10 + stride)
    weight = rng.normal(size=(6, 5, 3)).astype(np.float32)
    x = rng.normal(size=(7, 5, length)).astype(np.float32)  # [batch, channels, time]
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1)))
    out_length = (length + 2 - 3) // stride + 1
    steps = [padded[:, :, t * stride : t * stride + 3] for t in range(out_length)]
    expected = np.stack([np.einsum("bck,ock->bo", step, weight) for step in steps], axis=1)  # [b, t, out]
    matrix, found_length = conv1d_as_matrix(weight, length, stride, 1)
    assert found_length == out_length and matrix.shape == (length * 5, out_length * 6)
    found = x.transpose(0, 2, 1).reshape(7, -1) @ matrix
    np.testing.assert_allclose(found.reshape(7, out_length, 6), expected, rtol=1e-5, atol=1e-5)


def test_the_detector_gives_the_whole_vendored_graphs_probabilities(detector: SpeechDetector) -> None:
    """The vendored graph run whole (its STFT and encoder convolutions) against the detector (an
    FFT, then the derived graph's matrix products): the same probabilities to float32 rounding,
    across blocks."""
    import onnxruntime as ort

    whole = ort.InferenceSession(str(MODEL_FILE), providers=["CPUExecutionProvider"])

    def whole_graph_probs(wave: np.ndarray) -> np.ndarray:
        rows = frame_rows(wave)
        h = c = np.zeros((1, 1, 128), np.float32)
        out = []
        for first in range(0, len(rows), BLOCK_FRAMES):
            p, h, c = whole.run(None, {"input": rows[first : first + BLOCK_FRAMES], "h": h, "c": c})
            out.append(p.reshape(-1))
        return np.concatenate(out)

    clips = [
        speechlike(20.0, 16000, 110.0, 2),
        white_noise(1.3),
        hum(0.7)[:12345],
        with_noise(speechlike(3.0, 16000, 150.0, 4), 0.0),
    ]
    if ESPEAK is not None:
        clips.append(np.tile(espeak_wave(), 5))
    for wave in clips:
        found, expected = detector.probabilities(wave), whole_graph_probs(wave)
        assert found.shape == expected.shape and float(expected.max()) > 0.0
        # float32 rounding in another order (measured at most 3.8e-05, on one frame of the speech)
        np.testing.assert_allclose(found, expected, rtol=0, atol=PROBABILITY_TOLERANCE)


def test_rows_are_512_new_samples_after_64_of_context() -> None:
    wave = np.arange(1, 1101, dtype=np.float32)  # 2 full frames and 76 samples
    rows = frame_rows(wave)
    assert rows.shape == (3, 576)
    np.testing.assert_array_equal(rows[0, :64], 0.0)  # no context before the first frame
    np.testing.assert_array_equal(rows[0, 64:], wave[0:512])
    np.testing.assert_array_equal(rows[1, :64], wave[448:512])
    np.testing.assert_array_equal(rows[1, 64:], wave[512:1024])
    np.testing.assert_array_equal(rows[2, :64], wave[960:1024])
    np.testing.assert_array_equal(rows[2, 64 : 64 + 76], wave[1024:1100])
    np.testing.assert_array_equal(rows[2, 64 + 76 :], 0.0)  # the last frame is zero-padded
    assert frame_rows(np.zeros(0, dtype=np.float32)).shape == (0, 576)


def silero_segments(probs: list[float], n_samples: int, threshold: float = 0.5) -> list[tuple[int, int]]:
    """silero-vad 6.2.3 `get_speech_timestamps_from_probs` (MIT), transcribed for 16 kHz with
    min_speech_duration_ms=0, speech_pad_ms=0, max_speech_duration_s=inf: the branches those
    arguments never reach (the max-speech cut, the padding) are left out."""
    window, min_speech, min_silence = 512, 0, 16000 * 100 / 1000
    neg_threshold = max(threshold - 0.15, 0.01)
    triggered, speeches, current, temp_end = False, [], {}, 0
    for i, speech_prob in enumerate(probs):
        cur_sample = window * i
        if (speech_prob >= threshold) and temp_end:
            temp_end = 0
        if (speech_prob >= threshold) and not triggered:
            triggered = True
            current["start"] = cur_sample
            continue
        if (speech_prob < neg_threshold) and triggered:
            if not temp_end:
                temp_end = cur_sample
            if cur_sample - temp_end < min_silence:
                continue
            current["end"] = temp_end
            if (current["end"] - current["start"]) > min_speech:
                speeches.append(current)
            current, temp_end, triggered = {}, 0, False
    if current and (n_samples - current["start"]) > min_speech:
        current["end"] = n_samples
        speeches.append(current)
    return [(s["start"], s["end"]) for s in speeches]


@pytest.mark.parametrize("seed", range(40))
def test_segments_follow_silero_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    frames = int(rng.integers(1, 300))
    # Runs of speech-like and silence-like probabilities, with values between the two thresholds.
    probs = np.repeat(rng.choice([0.05, 0.4, 0.6, 0.95], size=frames // 4 + 1), 4)[:frames]
    probs = np.clip(probs + rng.normal(0, 0.08, frames), 0, 1)
    n_samples = frames * FRAME_SAMPLES - int(rng.integers(0, FRAME_SAMPLES))
    assert segments_from_probs(probs, n_samples) == silero_segments(probs.tolist(), n_samples)


def test_speech_ends_after_100_ms_below_the_exit_threshold() -> None:
    # 3 frames under 0.35 (96 ms) keep the segment open; 4 (128 ms) end it where they began.
    probs = [0.9] * 5 + [0.1] * 3 + [0.9] * 5 + [0.1] * 5 + [0.4] * 3
    segments = segments_from_probs(np.array(probs), len(probs) * FRAME_SAMPLES)
    assert segments == [(0, 13 * FRAME_SAMPLES)]
    between = segments_from_probs(np.array([0.9, 0.4, 0.4, 0.4, 0.4, 0.4]), 6 * FRAME_SAMPLES)
    assert between == [(0, 6 * FRAME_SAMPLES)]  # 0.35 <= p < 0.5 never ends speech


def test_the_detector_reads_its_interface_from_the_session(detector: SpeechDetector) -> None:
    session = detector.session
    assert detector.input_names == [i.name for i in session.get_inputs()]
    assert detector.output_names == [o.name for o in session.get_outputs()]
    assert detector.state_shapes == [tuple(i.shape) for i in session.get_inputs()[1:]]
    assert detector.sha256 == hashlib.sha256(DETECTOR_FILE.read_bytes()).hexdigest()
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_one_detector_per_process(detector: SpeechDetector) -> None:
    assert shared_detector(SpeechCheck()) is detector
    assert shared_detector(SpeechCheck(min_speech_ms=200, threshold=0.7)) is detector  # same model


def test_a_forked_process_builds_its_own_detector(detector: SpeechDetector) -> None:
    """A session built before a fork is never used in the child (a prefork pool's processes)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it got a fresh detector that works
        try:
            mine = shared_detector(SpeechCheck())
            ok = mine is not detector and mine.probabilities(np.zeros(1600, np.float32)).shape == (4,)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert shared_detector(SpeechCheck()) is detector  # the parent keeps its own


def test_a_model_of_another_kind_is_refused(tmp_path: Path) -> None:
    make_standins(tmp_path, profile="tiny")
    with pytest.raises(VoxmillError) as refused:
        SpeechDetector.load(tmp_path / "campplus.onnx")
    assert refused.value.code == "model_error" and "not a Silero sequence VAD model" in refused.value.message


def test_blocks_carry_the_state_exactly(detector: SpeechDetector, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 25 s clip (782 frames) in blocks of 512 gives the probabilities of one call over all frames."""
    wave = np.concatenate([speechlike(12.5, 16000, 110.0, seed) for seed in (1, 2)])
    blocked = detector.probabilities(wave)
    monkeypatch.setattr(vad, "BLOCK_FRAMES", 10_000)
    whole = detector.probabilities(wave)
    assert blocked.shape == (782,)
    np.testing.assert_array_equal(blocked, whole)
    monkeypatch.setattr(vad, "BLOCK_FRAMES", 7)  # and a block size that changes the result if wrong
    np.testing.assert_array_equal(detector.probabilities(wave), whole)


@needs_espeak
def test_synthetic_speech_is_speech(detector: SpeechDetector, speech: np.ndarray) -> None:
    found = detector.detect(speech, SpeechCheck())
    duration = speech.shape[0] / 16000
    print(f"espeak-ng: {found.speech_s:.3f} s of speech in {duration:.3f} s, {len(found.segments)} segments")
    assert 0.6 * duration < found.speech_s <= duration
    assert detector.detect(with_noise(speech, 0.0), SpeechCheck()).speech_s > 0.6 * duration


@pytest.mark.parametrize("name", ["dither", "hum", "tone", "white_noise", "click", "speechlike_220hz"])
def test_non_speech_is_not_speech(detector: SpeechDetector, name: str) -> None:
    waves = {
        "dither": dither(),
        "hum": hum(),
        "tone": tone(),
        "white_noise": white_noise(),
        "click": click(),
        "speechlike_220hz": speechlike(3.0, 16000, 220.0, 0),
    }
    found = detector.detect(waves[name], SpeechCheck())
    assert found.speech_s < 0.08, f"{name}: {found.speech_s} s of speech"
    assert float(detector.probabilities(waves[name]).max()) < 0.5


@needs_espeak
def test_a_60_ms_burst_of_speech_is_too_little(detector: SpeechDetector, speech: np.ndarray) -> None:
    short = detector.detect(burst(speech, 60), SpeechCheck()).speech_s
    longer = detector.detect(burst(speech, 300), SpeechCheck()).speech_s
    assert 0 < short < 0.08 <= longer


def test_require_speech_at_the_limit() -> None:
    check = SpeechCheck(min_speech_ms=80)
    require_speech(0.08, 2.0, check)
    with pytest.raises(VoxmillError) as refused:
        require_speech(0.064, 2.0, check)
    assert refused.value.code == "no_speech"
    assert refused.value.message.startswith("detected speech is 64 ms of a 2.00 s clip")
    assert "at least 80 ms is needed" in refused.value.message


@pytest.mark.skipif(not os.environ.get(WHEEL_ENV), reason=f"{WHEEL_ENV} names no silero-vad wheel")
def test_probabilities_match_the_frame_by_frame_model_of_the_wheel(
    detector: SpeechDetector, tmp_path: Path
) -> None:
    """The reference: silero_vad.onnx run one 512-sample frame at a time as `OnnxWrapper.__call__`
    does (context of the last 64 samples, state carried, sr 16000), transcribed to numpy. Run with
    `pip download silero-vad==6.2.3 --no-deps -d /tmp/sv` and VOXMILL_SILERO_WHEEL=/tmp/sv/<wheel>."""
    import onnxruntime as ort

    with zipfile.ZipFile(os.environ[WHEEL_ENV]) as wheel:
        (tmp_path / "silero_vad.onnx").write_bytes(wheel.read("silero_vad/data/silero_vad.onnx"))
    session = ort.InferenceSession(str(tmp_path / "silero_vad.onnx"), providers=["CPUExecutionProvider"])

    def wrapper_probs(audio: np.ndarray) -> np.ndarray:
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros((1, 64), np.float32)
        out = []
        for i in range(0, len(audio), 512):
            chunk = np.pad(audio[i : i + 512], (0, max(0, 512 - len(audio[i : i + 512]))))
            x = np.concatenate([context, chunk[None].astype(np.float32)], axis=1)
            p, state = session.run(None, {"input": x, "state": state, "sr": np.array(16000, dtype=np.int64)})
            context = x[..., -64:]
            out.append(float(p[0, 0]))
        return np.array(out, np.float32)

    clips = [speechlike(20.0, 16000, 110.0, 2), white_noise(1.3), hum(0.7)[:12345]]
    if ESPEAK is not None:
        clips.append(np.tile(espeak_wave(), 5))  # 640 frames: across a block boundary
    for wave in clips:
        found = detector.probabilities(wave)
        np.testing.assert_allclose(found, wrapper_probs(wave), rtol=0, atol=PROBABILITY_TOLERANCE)
