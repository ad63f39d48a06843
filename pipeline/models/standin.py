"""Stand-in ONNX models with the exact signatures of CosyVoice's tokenizer and speaker embedder.

The weights are seeded random numbers, so tokens and embeddings are meaningless; the interface
and the compute cost (for the ``full`` profile) match the real models.

=========  =======  ===========  ======
model      profile  parameters   file
=========  =======  ===========  ======
tokenizer  tiny          87,632  355 KB
tokenizer  full     123,486,736  494 MB
embedder   tiny          45,920  185 KB
embedder   full       6,828,224   27 MB
=========  =======  ===========  ======

Tokenizer: ``feats`` float32 [1, 128, T] + ``feats_length`` int32 [1] -> ``indices`` int64
[1, ceil(feats_length / 4)] in [0, 6561). Its batch twin (``speech_tokenizer_v2.batch.onnx``, the
signature of CosyVoice's batch tokenizers) is the same graph and weights declared with a dynamic
batch axis: ``feats`` [B, 128, T] zero-padded, ``feats_length`` [B] -> [B, T'], a row's first
(len - 1) // 4 + 1 tokens valid. Embedder: ``input`` float32 [B, T, 80] -> ``output`` float32
[B, 192].

Every op of the tokenizer that mixes time steps is masked with ``feats_length`` and reduces over
time only inside a matrix product (mean, convolutions, softmax sum), whose sums run in the same
order whatever the padding: a padded row's valid tokens are bit for bit those of the row alone.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

PROFILES = ("tiny", "full")
TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
TOKENIZER_BATCH_FILE = "speech_tokenizer_v2.batch.onnx"  # CosyVoice's name for the batch twin
EMBEDDER_FILE = "campplus.onnx"

OPSET = 17
IR_VERSION = 8
PRODUCER = "voxmill-standin"
PRODUCER_VERSION = "1"
CODEBOOK = 3**8  # FSQ: 8 dimensions, 3 levels each
MASKED = -1e9  # added to a padded key's attention score: its weight underflows to exactly 0
EMBED_DIM = 192

# d_model, transformer blocks, attention heads (FFN is 4 * d_model).
_TOKENIZER = {"tiny": (64, 1, 4), "full": (1280, 6, 20)}
# channels, hidden (kernel, dilation) layers, pooled channels.
_EMBEDDER: dict[str, tuple[int, tuple[tuple[int, int], ...], int]] = {
    "tiny": (32, ((3, 1), (3, 2)), 64),
    "full": (512, ((5, 1), (5, 2), (5, 3), (5, 1)), 1536),
}
_TOKENIZER_STREAM = 1
_EMBEDDER_STREAM = 2


def _check_profile(profile: str) -> str:
    """Return profile if known, else raise ValueError."""
    if profile not in PROFILES:
        raise ValueError(f"unknown stand-in profile {profile!r}; expected one of {', '.join(PROFILES)}")
    return profile


class _Builder:
    """Accumulates the nodes and initializers of one graph, naming them in order."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.proto = onnx.ModelProto()  # built in place: copying ~500 MB of weights costs seconds
        self.graph = self.proto.graph
        self._scalars: dict[float, str] = {}
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, value: npt.ArrayLike, dtype: npt.DTypeLike = np.float32, prefix: str = "const") -> str:
        """Add an initializer holding value; return its name."""
        name = self._name(prefix)
        arr = np.asarray(value, dtype=dtype)
        tensor = self.graph.initializer.add()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        tensor.dims.extend(arr.shape)
        tensor.raw_data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        return name

    def scalar(self, value: float) -> str:
        """Return a shared float32 scalar constant."""
        if value not in self._scalars:
            self._scalars[value] = self.const(value, prefix="scalar")
        return self._scalars[value]

    def draw(self, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
        """The next normal(0, std) float32 weights of the seeded stream."""
        arr = self.rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(std)
        return arr

    def weight(self, shape: tuple[int, ...], std: float, prefix: str) -> str:
        """Add a normal(0, std) float32 initializer."""
        return self.const(self.draw(shape, std), prefix=prefix)

    def ints(self, *values: int) -> str:
        """An int64 [len(values)] constant (axes, shapes, pads)."""
        return self.const(list(values), np.int64, "ints")

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        """Append a node with one output; return the output name."""
        name = out or self._name(op_type.lower())
        self.graph.node.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def conv1d(
        self, x: str, cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1, gain: float = 1.0
    ) -> str:
        """Conv1d over [B, C, T] with 'same'-style padding."""
        w = self.weight((cout, cin, k), gain / np.sqrt(cin * k), "conv_w")
        b = self.weight((cout,), 0.02, "conv_b")
        pad = dilation * (k - 1) // 2
        return self.op(
            "Conv", x, w, b, kernel_shape=[k], strides=[stride], dilations=[dilation], pads=[pad, pad]
        )

    def strided_conv(self, x: str, cin: int, cout: int) -> str:
        """Conv1d (kernel 3, stride 2, padding 1) over [B, T, C] -> [B, (T + 1) // 2, cout].

        Built as one matrix product of stacked frames [x(2j-1), x(2j), x(2j+1)]: its sums run over
        a fixed 3 * cin whatever T, so padding a batch cannot reorder them (ONNX Runtime's Conv
        blocks its sums by output length). Tap k of output j is padded frame 2j + k. The weights
        are drawn as `conv1d` draws them.
        """
        w = self.draw((cout, cin, 3), 1.0 / np.sqrt(cin * 3))
        stacked_w = self.const(w.transpose(2, 1, 0).reshape(3 * cin, cout), prefix="conv_w")
        b = self.weight((cout,), 0.02, "conv_b")
        padded = self.op("Pad", x, self.ints(0, 1, 0, 0, 2, 0))
        doubled = self.op("Mul", self.halved(self.op("Shape", x, start=1, end=2)), self.ints(2))
        taps = [
            self.op(
                "Slice",
                padded,
                self.ints(k),
                self.op("Add", doubled, self.ints(k)),
                self.ints(1),
                self.ints(2),
            )
            for k in range(3)
        ]
        return self.op("Add", self.op("MatMul", self.op("Concat", *taps, axis=2), stacked_w), b)

    def halved(self, frames: str) -> str:
        """(n + 1) // 2 of an int64 tensor: a length after a stride-2 convolution."""
        return self.op("Div", self.op("Add", frames, self.ints(1)), self.ints(2))

    def time_mask(self, lengths: str, size: str) -> str:
        """float32 [B, size]: 1 at frames below the row's length, 0 beyond."""
        steps = self.op("Range", self.const(0, np.int64), self.op("Squeeze", size), self.const(1, np.int64))
        below = self.op(
            "Less", self.op("Unsqueeze", steps, self.ints(0)), self.op("Unsqueeze", lengths, self.ints(1))
        )
        return self.op("Cast", below, to=TensorProto.FLOAT)

    def linear(self, x: str, din: int, dout: int, gain: float = 1.0, out: str | None = None) -> str:
        """x @ W + b over the last axis."""
        w = self.weight((din, dout), gain / np.sqrt(din), "linear_w")
        b = self.weight((dout,), 0.02, "linear_b")
        return self.op("Add", self.op("MatMul", x, w), b, out=out)

    def layer_norm(self, x: str, d: int) -> str:
        """LayerNormalization over the last axis, unit scale and zero bias."""
        scale = self.const(np.ones(d), prefix="ln_scale")
        bias = self.const(np.zeros(d), prefix="ln_bias")
        return self.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=1e-5)

    def gelu(self, x: str) -> str:
        """Exact GELU, x * 0.5 * (1 + erf(x / sqrt 2)), from basic ops (opset 17 has no Gelu)."""
        erf = self.op("Erf", self.op("Mul", x, self.scalar(float(1.0 / np.sqrt(2.0)))))
        return self.op("Mul", self.op("Mul", x, self.op("Add", erf, self.scalar(1.0))), self.scalar(0.5))

    def attention(self, x: str, d: int, heads: int, keys: KeyMask, out_gain: float = 1.0) -> str:
        """Multi-head self-attention over [B, T, d], attending only to each row's valid frames.

        The softmax is spelled out so that its sum over keys is a matrix product too (ONNX
        Runtime's Softmax sums in vector lanes that shift with the padded length).
        """
        split = self.const([0, -1, heads, d // heads], np.int64, "shape")
        q, k, v = (self.op("Reshape", self.linear(x, d, d), split) for _ in range(3))
        scale = self.scalar(float(1.0 / np.sqrt(d // heads)))
        q = self.op("Mul", self.op("Transpose", q, perm=[0, 2, 1, 3]), scale)
        scores = self.op("MatMul", q, self.op("Transpose", k, perm=[0, 2, 3, 1]))
        scores = self.op("Add", scores, keys.bias)
        top = self.op("ReduceMax", scores, axes=[-1], keepdims=1)
        weights = self.op("Mul", self.op("Exp", self.op("Sub", scores, top)), keys.row)
        probs = self.op("Div", weights, self.op("MatMul", weights, keys.column))
        ctx = self.op("MatMul", probs, self.op("Transpose", v, perm=[0, 2, 1, 3]))
        ctx = self.op("Transpose", ctx, perm=[0, 2, 1, 3])
        ctx = self.op("Reshape", ctx, self.const([0, -1, d], np.int64, "shape"))
        return self.linear(ctx, d, d, gain=out_gain)

    def model(
        self,
        name: str,
        inputs: list[onnx.ValueInfoProto],
        outputs: list[onnx.ValueInfoProto],
        profile: str,
        seed: int,
    ) -> onnx.ModelProto:
        """Wrap the graph into a deterministic opset-17 / IR-8 model."""
        model, graph = self.proto, self.graph
        graph.name = name
        graph.input.extend(inputs)
        graph.output.extend(outputs)
        model.ir_version = IR_VERSION
        model.opset_import.append(helper.make_opsetid("", OPSET))
        model.producer_name = PRODUCER
        model.producer_version = PRODUCER_VERSION
        model.doc_string = f"voxmill stand-in, meaningless weights, seed {seed}, profile {profile}"
        return model


@dataclass(frozen=True)
class KeyMask:
    """Which attention keys are a row's own frames: `row` [B,1,1,T] and `column` [B,1,T,1] hold 1
    or 0, `bias` [B,1,1,T] 0 or `MASKED`."""

    row: str
    column: str
    bias: str


def _rng(seed: int, stream: int) -> np.random.Generator:
    """Per-model generator derived deterministically from the user seed."""
    return np.random.default_rng([seed, stream])


def make_tokenizer_model(profile: str = "tiny", seed: int = 0, batch: bool = False) -> onnx.ModelProto:
    """Build the S3 speech tokenizer v2 stand-in: 128-bin log-mel at 100 Hz -> 25 Hz FSQ codes.

    `batch` declares the batch twin's signature (`as_batch`); graph and weights are the same.
    """
    d, blocks, heads = _TOKENIZER[_check_profile(profile)]
    b = _Builder(_rng(seed, _TOKENIZER_STREAM))
    frames = b.op("Shape", "feats", start=2, end=3)
    length = b.op("Min", b.op("Cast", "feats_length", to=TensorProto.INT64), frames)
    valid = b.time_mask(length, frames)
    # Per-utterance mean removal over the row's own frames, so tokens follow how the features
    # change rather than their level; padding is zero before and after.
    x = b.op("Mul", "feats", b.op("Unsqueeze", valid, b.ints(1)))
    count = b.op("Max", b.op("Cast", length, to=TensorProto.FLOAT), b.scalar(1.0))
    mean = b.op(
        "Div",
        b.op("MatMul", x, b.op("Unsqueeze", valid, b.ints(2))),
        b.op("Reshape", count, b.ints(-1, 1, 1)),
    )
    x = b.op("Mul", b.op("Sub", x, mean), b.op("Unsqueeze", valid, b.ints(1)))
    x = b.gelu(b.strided_conv(b.op("Transpose", x, perm=[0, 2, 1]), 128, d))
    length, frames = b.halved(length), b.halved(frames)
    x = b.op("Mul", x, b.op("Unsqueeze", b.time_mask(length, frames), b.ints(2)))  # the conv's padding
    x = b.gelu(b.strided_conv(x, d, d))
    length, frames = b.halved(length), b.halved(frames)
    valid = b.time_mask(length, frames)
    row = b.op("Unsqueeze", valid, b.ints(1, 2))
    keys = KeyMask(
        row,
        b.op("Unsqueeze", valid, b.ints(1, 3)),
        b.op("Mul", b.op("Sub", b.scalar(1.0), row), b.scalar(MASKED)),
    )
    res_gain = float(1.0 / np.sqrt(2 * blocks))  # GPT-2-style residual scaling keeps tokens varied
    for _ in range(blocks):
        x = b.op("Add", x, b.attention(b.layer_norm(x, d), d, heads, keys, out_gain=res_gain))
        hidden = b.gelu(b.linear(b.layer_norm(x, d), d, 4 * d))
        x = b.op("Add", x, b.linear(hidden, 4 * d, d, gain=res_gain))
    z = b.op("Tanh", b.linear(b.layer_norm(x, d), d, 8))
    levels = b.op("Add", b.op("Round", z), b.scalar(1.0))  # {-1, 0, 1} -> {0, 1, 2}
    powers = b.const((3.0 ** np.arange(8)).reshape(8, 1), prefix="fsq_powers")
    codes = b.op("Reshape", b.op("MatMul", levels, powers), b.ints(0, -1))
    codes = b.op("Cast", codes, to=TensorProto.INT64)
    n_out = b.op("ReduceMax", length, keepdims=1)  # the longest row's (len - 1) // 4 + 1
    b.op("Slice", codes, b.ints(0), n_out, b.ints(1), out="indices")
    inputs = [
        helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
        helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
    ]
    outputs = [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T_out"])]
    model = b.model("speech_tokenizer_v2_standin", inputs, outputs, profile, seed)
    return as_batch(model) if batch else model


def as_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    """The tokenizer's batch twin, in place: a dynamic batch axis "B" on feats, feats_length, indices."""
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "B"  # replaces the fixed 1
    model.graph.name = "speech_tokenizer_v2_batch_standin"
    return model


def make_embedder_model(profile: str = "tiny", seed: int = 0) -> onnx.ModelProto:
    """Build the CAM++ stand-in: 80-bin fbank [B, T, 80] -> speaker embedding [B, 192]."""
    channels, hidden, pooled = _EMBEDDER[_check_profile(profile)]
    b = _Builder(_rng(seed, _EMBEDDER_STREAM))
    relu_gain = float(np.sqrt(2.0))
    x = b.op("Transpose", "input", perm=[0, 2, 1])
    x = b.op("Relu", b.conv1d(x, 80, channels, 5, gain=relu_gain))
    for k, dilation in hidden:
        x = b.op("Relu", b.conv1d(x, channels, channels, k, dilation=dilation, gain=relu_gain))
    x = b.op("Relu", b.conv1d(x, channels, pooled, 1, gain=relu_gain))
    mean = b.op("ReduceMean", x, axes=[2], keepdims=0)
    mean_sq = b.op("ReduceMean", b.op("Mul", x, x), axes=[2], keepdims=0)
    var = b.op("Relu", b.op("Sub", mean_sq, b.op("Mul", mean, mean)))
    std = b.op("Sqrt", b.op("Add", var, b.scalar(1e-5)))
    stats = b.op("Concat", mean, std, axis=1)
    b.linear(stats, 2 * pooled, EMBED_DIM, out="output")
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", EMBED_DIM])]
    return b.model("campplus_standin", inputs, outputs, profile, seed)


def param_count(model: onnx.ModelProto) -> int:
    """Number of float values in the model's initializers of rank >= 1."""
    return sum(
        int(np.prod(t.dims))
        for t in model.graph.initializer
        if t.data_type == TensorProto.FLOAT and len(t.dims) > 0
    )


def write_model(model: onnx.ModelProto, path: Path) -> Path:
    """Serialize model to path atomically (temp file in the same folder, then os.replace)."""
    path = Path(path)
    data = model.SerializeToString()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; models are shared read-only files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_standins(out_dir: Path, profile: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """Write the stand-ins into out_dir (created if needed); return their paths by key."""
    _check_profile(profile)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer_model(profile, seed)
    written = {"tokenizer": write_model(tokenizer, out_dir / TOKENIZER_FILE)}
    # The twin is the same proto re-declared: no second copy of ~500 MB of weights.
    written["tokenizer_batch"] = write_model(as_batch(tokenizer), out_dir / TOKENIZER_BATCH_FILE)
    written["embedder"] = write_model(make_embedder_model(profile, seed), out_dir / EMBEDDER_FILE)
    return written
