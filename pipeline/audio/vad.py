"""How much of a clip is speech: Silero VAD's vendored ONNX graph, run without PyTorch.

The model (`pipeline/models/silero_vad/`, see its README) gives one speech probability per 32 ms
frame of 16 kHz audio. Framing, as silero-vad 6.2.3's `OnnxWrapper` (and its torch-free
`sequence_vad.frame_blocks`) feed it:

- frames of 512 samples from the start of the clip, the last one zero-padded;
- each frame fed with the 64 samples before it prepended (zeros before the first frame), so a
  row is 576 samples;
- the recurrent state starts at zero and is carried from frame to frame. The vendored graph
  (`silero_vad_16k_sequence.onnx`) runs a block of rows in one call and hands back its LSTM
  state, which is passed into the next block; its probabilities are bit for bit those of the
  frame-at-a-time `silero_vad.onnx` (the README says how that was checked).

The graph opens with an STFT written as a convolution (258 filters: a periodic Hann window times
the cosines and sines of a 256-point DFT, hop 128, over each row reflect-padded by 128, the first
frame dropped: 4 frames of 129 magnitudes per row), then an encoder of four small convolutions
(kernel 3) over those 4 frames, once per row. Run as convolutions, the two took four fifths of
the graph's time: ONNX Runtime multiplies a row's few frames at a time. `stft_magnitudes` does
the STFT with an FFT instead, and the session runs `DETECTOR_FILE`, derived from the vendored
file by `detector_graph`: the same network from the magnitudes on, with each encoder convolution
written as one matrix product over all the rows of a block (`conv1d_as_matrix`: the same weights,
laid out for a 4-frame input). Probabilities are the whole graph's to float32 rounding.

Speech segments follow Silero's `get_speech_timestamps_from_probs`, simplified to one rule:
speech starts at a frame with p >= `threshold`; it ends where a run of frames below
`threshold - 0.15` begins that lasts `min_silence_ms` (100 ms) with no frame >= `threshold` in
it; a segment still open at the end runs to the end of the clip. Unlike Silero's defaults
nothing is padded (30 ms) and no short segment is dropped (250 ms): the total, `speech_s`, is
what `SpeechCheck.min_speech_ms` is compared with (`no_speech` below it).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.options import SessionOptions
from pipeline.models.sessions import helper_session
from pipeline.settings import Settings

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "silero_vad"  # pipeline/models/silero_vad
MODEL_FILE = MODEL_DIR / "silero_vad_16k_sequence.onnx"  # the wheel's file, unchanged
MODEL_SHA256 = "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85"
DETECTOR_FILE = MODEL_DIR / "silero_vad_16k_sequence.detector.onnx"  # what runs: `detector_graph`
RATE_HZ = 16000
FRAME_SAMPLES = 512
CONTEXT_SAMPLES = 64
ROW_SAMPLES = CONTEXT_SAMPLES + FRAME_SAMPLES
FRAME_S = FRAME_SAMPLES / RATE_HZ
MAGNITUDES = "/stft/Sqrt_output_0"  # the graph's STFT magnitudes, where the encoder starts
LSTM_INPUT = "/Transpose_output_0"  # the encoder's output, [frames, 1, 128]: the graph from here is kept
STFT_SIZE = 256
STFT_HOP = 128
STFT_BINS = STFT_SIZE // 2 + 1
STFT_FRAMES = 4  # per row
STFT_OVERHANG = (STFT_FRAMES - 1) * STFT_HOP + STFT_SIZE - ROW_SAMPLES  # 64: the last frame past the row
# Frames per session call (16.4 s), as silero's sequence front-end: a 10 min clip never holds
# all of its rows and activations at once.
BLOCK_FRAMES = 512
NEG_THRESHOLD_GAP = 0.15  # Silero's default exit threshold: threshold - 0.15
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SpeechCheck:
    """The speech check of a worker or extractor, built from `Settings` (`from_settings`).

    `enabled` False: no detector runs and nothing is refused (stats then have no speech fields).
    """

    enabled: bool = True
    min_speech_ms: float = 80.0
    threshold: float = 0.5
    min_silence_ms: float = 100.0
    model_path: Path = DETECTOR_FILE
    intra_op_threads: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> SpeechCheck:
        return cls(
            enabled=settings.speech_check,
            min_speech_ms=settings.min_speech_ms,
            threshold=settings.speech_threshold,
            intra_op_threads=settings.intra_op_threads,
        )


@dataclass(frozen=True)
class Speech:
    """What the detector found in one clip: segments as [start, end) sample ranges at 16 kHz."""

    segments: tuple[tuple[int, int], ...]
    frames: int

    @property
    def speech_s(self) -> float:
        return sum(end - start for start, end in self.segments) / RATE_HZ


def frame_rows(wave: FloatArray) -> FloatArray:
    """The model's input rows of a 16 kHz wave: [frames, 576] = 64 samples of context + 512 new."""
    n = wave.shape[0]
    frames = -(-n // FRAME_SAMPLES)
    padded = np.zeros(frames * FRAME_SAMPLES, dtype=np.float32)
    padded[:n] = wave
    body = padded.reshape(frames, FRAME_SAMPLES)
    rows = np.zeros((frames, ROW_SAMPLES), dtype=np.float32)
    rows[:, CONTEXT_SAMPLES:] = body
    rows[1:, :CONTEXT_SAMPLES] = body[:-1, -CONTEXT_SAMPLES:]
    return rows


@functools.lru_cache(maxsize=1)
def _hann() -> FloatArray:
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(STFT_SIZE) / STFT_SIZE)
    return window.astype(np.float32)


def stft_magnitudes(rows: FloatArray) -> FloatArray:
    """The STFT magnitudes the vendored graph computes first, float32 [rows, 4 frames, 129 bins].

    A row's frames start at samples 0, 128, 256 and 384 of it; the last one runs 64 samples past
    the row's end, into its reflection (the samples before the last one, in reverse).
    """
    import scipy.fft  # float32 in and out (numpy's FFT computes in float64, twice the time)

    reflected = rows[:, ROW_SAMPLES - 2 : ROW_SAMPLES - 2 - STFT_OVERHANG : -1]
    extended = np.concatenate([rows, reflected], axis=1)
    frames = np.lib.stride_tricks.sliding_window_view(extended, STFT_SIZE, axis=1)[:, ::STFT_HOP]
    magnitudes: FloatArray = np.abs(scipy.fft.rfft(frames * _hann(), axis=-1))
    return magnitudes


def conv1d_as_matrix(weight: FloatArray, length: int, stride: int, pad: int) -> tuple[FloatArray, int]:
    """A 1-D convolution (`weight` [out, in, kernel], zero padding) over `length` input steps as
    one matrix, from the input [length * in] to the output [out_length * out], both flattened
    time-major. Returns the matrix and out_length."""
    out_channels, in_channels, kernel = weight.shape
    out_length = (length + 2 * pad - kernel) // stride + 1
    matrix = np.zeros((length, in_channels, out_length, out_channels), dtype=np.float32)
    for t in range(out_length):
        for k in range(kernel):
            source = t * stride + k - pad
            if 0 <= source < length:
                matrix[source, :, t, :] = weight[:, :, k].T
    return matrix.reshape(length * in_channels, out_length * out_channels), out_length


def detector_graph(model: bytes) -> bytes:
    """`DETECTOR_FILE` from the vendored graph (`MODEL_FILE`'s bytes): its input the STFT
    magnitudes [frames, 4, 129]; the encoder's convolutions as matrix products
    (`_encoder_as_matrices`); the graph from the LSTM on as it is."""
    import onnx
    import onnx.utils
    from onnx import helper

    graph = onnx.shape_inference.infer_shapes(onnx.load_from_string(model))
    if not {MAGNITUDES, LSTM_INPUT} <= {value.name for value in graph.graph.value_info}:
        raise VoxmillError(errors.MODEL_ERROR, f"the model has no {MAGNITUDES} and {LSTM_INPUT} to cut at")
    nodes, initializers = _encoder_as_matrices(graph.graph, "magnitudes", LSTM_INPUT)
    states = [i.name for i in graph.graph.input[1:]]
    outputs = [o.name for o in graph.graph.output]
    tail = onnx.utils.Extractor(graph).extract_model([LSTM_INPUT, *states], outputs).graph
    magnitudes = helper.make_tensor_value_info(
        "magnitudes", onnx.TensorProto.FLOAT, ["frames", STFT_FRAMES, STFT_BINS]
    )
    derived = helper.make_graph(
        [*nodes, *tail.node],
        graph.graph.name,
        [magnitudes, *tail.input[1:]],
        list(tail.output),
        [*initializers, *tail.initializer],
    )
    out = helper.make_model(derived, opset_imports=graph.opset_import, ir_version=graph.ir_version)
    onnx.checker.check_model(out)
    return bytes(out.SerializeToString())


def _encoder_as_matrices(graph: Any, source: str, target: str) -> tuple[list[Any], list[Any]]:
    """The nodes and weights from `source` (magnitudes [frames, 4, 129]) to `target` (the
    encoder's output [frames, 1, channels]): each `/encoder` Conv + Relu as Gemm + Relu on its
    weights laid out by `conv1d_as_matrix`, over a row's frames flattened time-major."""
    from onnx import helper, numpy_helper

    weights = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    convs = [node for node in graph.node if node.op_type == "Conv" and node.name.startswith("/encoder")]

    def shape(name: str, dims: list[int]) -> Any:
        return numpy_helper.from_array(np.array(dims, np.int64), name)

    x, length = "/encoder/rows", STFT_FRAMES
    nodes = [helper.make_node("Reshape", [source, "/encoder/rows_shape"], [x], name="/encoder/Reshape")]
    initializers = [shape("/encoder/rows_shape", [-1, STFT_FRAMES * STFT_BINS])]
    for conv in convs:
        attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
        pads, strides = attrs.get("pads", [0, 0]), attrs.get("strides", [1])
        if attrs.get("group", 1) != 1 or set(attrs.get("dilations", [1])) != {1} or pads[0] != pads[-1]:
            raise VoxmillError(errors.MODEL_ERROR, f"{conv.name} is not a plain 1-D convolution")
        matrix, length = conv1d_as_matrix(weights[conv.input[1]], length, strides[0], pads[0])
        bias = np.tile(weights[conv.input[2]], length).astype(np.float32)
        name = conv.name.rsplit("/", 1)[0]  # /encoder.0
        initializers += [
            numpy_helper.from_array(matrix, f"{name}/matrix"),
            numpy_helper.from_array(bias, f"{name}/bias"),
        ]
        product = f"{name}/Gemm_output_0"
        nodes += [
            helper.make_node("Gemm", [x, f"{name}/matrix", f"{name}/bias"], [product], name=f"{name}/Gemm"),
            helper.make_node("Relu", [product], [f"{name}/Relu_output_0"], name=f"{name}/Relu"),
        ]
        x = f"{name}/Relu_output_0"
    channels = int(weights[convs[-1].input[1]].shape[0])
    initializers.append(shape("/encoder/out_shape", [-1, 1, length * channels]))
    nodes.append(helper.make_node("Reshape", [x, "/encoder/out_shape"], [target], name="/encoder/Out"))
    return nodes, initializers


def segments_from_probs(
    probs: npt.NDArray[np.floating[Any]],
    n_samples: int,
    threshold: float = 0.5,
    min_silence_ms: float = 100.0,
) -> list[tuple[int, int]]:
    """Speech segments ([start, end) samples) from per-frame probabilities (module docstring's rule)."""
    neg_threshold = max(threshold - NEG_THRESHOLD_GAP, 0.01)
    min_silence_samples = RATE_HZ * min_silence_ms / 1000.0
    segments: list[tuple[int, int]] = []
    start: int | None = None
    silence_from: int | None = None
    for index, p in enumerate(np.asarray(probs, dtype=np.float64).tolist()):
        sample = index * FRAME_SAMPLES
        if p >= threshold:
            silence_from = None
            if start is None:
                start = sample
            continue
        if start is None or p >= neg_threshold:
            continue
        if silence_from is None:
            silence_from = sample
        if sample - silence_from >= min_silence_samples:
            segments.append((start, silence_from))
            start = silence_from = None
    if start is not None and start < n_samples:
        segments.append((start, n_samples))
    return [(s, min(e, n_samples)) for s, e in segments if min(e, n_samples) > s]


class SpeechDetector:
    """A loaded speech model; `probabilities(wave)` per frame, `detect(wave, check)` the segments.

    Input and output names are read from the session: input 0 takes the rows, the others are the
    recurrent state, handed back by outputs 1.. in the same order; output 0 is the probabilities.
    """

    def __init__(self, session: Any, path: Path, sha256: str, load_s: float) -> None:
        self.session = session
        self.path = path
        self.sha256 = sha256
        self.load_s = load_s
        inputs, outputs = session.get_inputs(), session.get_outputs()
        self._check_signature(inputs, outputs)
        self.input_names = [i.name for i in inputs]
        self.output_names = [o.name for o in outputs]
        self.state_shapes = [tuple(int(d) for d in i.shape) for i in inputs[1:]]

    def _check_signature(self, inputs: list[Any], outputs: list[Any]) -> None:
        rows = inputs[0].shape if inputs else []
        fixed_states = all(all(isinstance(d, int) for d in i.shape) for i in inputs[1:])
        if (
            len(inputs) < 2
            or len(outputs) != len(inputs)
            or len(rows) != 3
            or list(rows[1:]) != [STFT_FRAMES, STFT_BINS]
            or not fixed_states
        ):
            raise VoxmillError(
                errors.MODEL_ERROR,
                f"{self.path.name} is not a Silero sequence VAD model after its STFT (magnitudes "
                f"[frames, {STFT_FRAMES}, {STFT_BINS}] and a fixed-size recurrent state in and out); "
                f"inputs {[(i.name, i.shape) for i in inputs]}",
            )

    @classmethod
    def load(cls, path: Path = DETECTOR_FILE, intra_op_threads: int = 1) -> SpeechDetector:
        """Build the session (`pipeline.models.options`, CPU) and check it on a warm-up clip."""
        started = time.perf_counter()
        options = SessionOptions(provider="cpu", intra_op_threads=intra_op_threads)
        session, sha256 = helper_session(path, options)
        detector = cls(session, path, sha256, 0.0)
        warm = detector.probabilities(np.zeros(RATE_HZ, dtype=np.float32))
        if not np.isfinite(warm).all():
            raise VoxmillError(errors.MODEL_ERROR, f"{path.name} gives non-finite outputs on silence")
        detector.load_s = time.perf_counter() - started
        return detector

    def probabilities(self, wave: FloatArray) -> FloatArray:
        """Speech probability of every 32 ms frame of a 16 kHz float32 wave, float32 [frames]."""
        rows = frame_rows(np.ascontiguousarray(wave, dtype=np.float32).reshape(-1))
        states = [np.zeros(shape, dtype=np.float32) for shape in self.state_shapes]
        parts: list[FloatArray] = []
        for first in range(0, rows.shape[0], BLOCK_FRAMES):
            magnitudes = stft_magnitudes(rows[first : first + BLOCK_FRAMES])
            feeds = dict(zip(self.input_names, [magnitudes, *states], strict=True))
            try:
                outputs = self.session.run(self.output_names, feeds)
            except Exception as exc:  # ONNX Runtime raises its own exception types
                raise VoxmillError(errors.MODEL_ERROR, f"{self.path.name} failed to run: {exc}") from exc
            parts.append(np.asarray(outputs[0], dtype=np.float32).reshape(-1))
            states = list(outputs[1:])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def detect(self, wave: FloatArray, check: SpeechCheck) -> Speech:
        """The speech segments of a 16 kHz wave under `check`'s threshold and silence rule."""
        probs = self.probabilities(wave)
        segments = segments_from_probs(probs, int(wave.shape[0]), check.threshold, check.min_silence_ms)
        return Speech(segments=tuple(segments), frames=int(probs.shape[0]))


def require_speech(speech_s: float, duration_s: float, check: SpeechCheck) -> None:
    """`no_speech` when the detected speech is shorter than `check.min_speech_ms`."""
    if speech_s * 1000.0 + 1e-9 >= check.min_speech_ms:
        return
    raise VoxmillError(
        errors.NO_SPEECH,
        f"detected speech is {math.floor(speech_s * 1000.0 + 1e-6)} ms of a {duration_s:.2f} s clip "
        f"(Silero VAD, p >= {check.threshold:g}); at least {check.min_speech_ms:g} ms is needed "
        "(speech_check: false accepts any audio)",
    )


# One detector per process and model, built on first use: a session built before a fork is
# never used in the child (the pid is part of the key).
_detectors: dict[tuple[str, int, int], SpeechDetector] = {}
_detectors_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _detectors_lock
    _detectors_lock = threading.Lock()  # a lock held by another thread at the fork stays held


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_detector(check: SpeechCheck) -> SpeechDetector:
    """This process's detector for `check` (loaded once; thread-safe)."""
    key = (str(check.model_path), check.intra_op_threads, os.getpid())
    with _detectors_lock:
        detector = _detectors.get(key)
        if detector is None:
            detector = SpeechDetector.load(check.model_path, check.intra_op_threads)
            for stale in [k for k in _detectors if k[2] != key[2]]:
                del _detectors[stale]
            _detectors[key] = detector
        return detector
