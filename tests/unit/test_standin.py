"""Stand-in ONNX models: deterministic files with CosyVoice's real signatures (tiny profile)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline.models import standin


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(path.read_bytes(), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return standin.make_standins(tmp_path_factory.mktemp("standin"), "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny: dict[str, Path]) -> ort.InferenceSession:
    return _session(tiny["tokenizer"])


@pytest.fixture(scope="module")
def embedder(tiny: dict[str, Path]) -> ort.InferenceSession:
    return _session(tiny["embedder"])


def _tokens(sess: ort.InferenceSession, feats: np.ndarray, length: int) -> np.ndarray:
    (out,) = sess.run(None, {"feats": feats, "feats_length": np.array([length], dtype=np.int32)})
    return np.asarray(out)


def test_files_named_checked_and_stamped(tiny: dict[str, Path]) -> None:
    assert tiny["tokenizer"].name == standin.TOKENIZER_FILE
    assert tiny["embedder"].name == standin.EMBEDDER_FILE
    for path in tiny.values():
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        assert model.ir_version == 8
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
        assert model.producer_name == "voxmill-standin"
        assert "seed 0" in model.doc_string and "profile tiny" in model.doc_string
    # Only the three models were written (the tokenizer, its batch twin, the embedder): no temp files.
    assert sorted(p.name for p in tiny["tokenizer"].parent.iterdir()) == sorted(
        [standin.TOKENIZER_FILE, standin.TOKENIZER_BATCH_FILE, standin.EMBEDDER_FILE]
    )


def test_deterministic_bytes_and_seed_matters(tmp_path: Path) -> None:
    a = standin.make_standins(tmp_path / "a", "tiny", seed=7)
    b = standin.make_standins(tmp_path / "b", "tiny", seed=7)
    c = standin.make_standins(tmp_path / "c", "tiny", seed=8)
    for key in ("tokenizer", "embedder"):
        assert a[key].read_bytes() == b[key].read_bytes()
        assert a[key].read_bytes() != c[key].read_bytes()
        # Different weights, not just a different doc string.
        wa = onnx.load(str(a[key])).graph.initializer
        wc = onnx.load(str(c[key])).graph.initializer
        assert any(x.raw_data != y.raw_data for x, y in zip(wa, wc, strict=True))


def test_tiny_files_are_small(tiny: dict[str, Path]) -> None:
    for path in tiny.values():
        assert 0 < path.stat().st_size < 5 * 1024 * 1024


def test_batch_twin_has_the_same_weights_and_a_batch_axis(tiny: dict[str, Path]) -> None:
    single, batch = (onnx.load(str(tiny[key])) for key in ("tokenizer", "tokenizer_batch"))
    assert tiny["tokenizer_batch"].name == standin.TOKENIZER_BATCH_FILE == "speech_tokenizer_v2.batch.onnx"
    assert [t.raw_data for t in single.graph.initializer] == [t.raw_data for t in batch.graph.initializer]
    assert [n.op_type for n in single.graph.node] == [n.op_type for n in batch.graph.node]
    batch_axes = [
        v.type.tensor_type.shape.dim[0].dim_param for v in (*batch.graph.input, *batch.graph.output)
    ]
    assert batch_axes == ["B", "B", "B"]
    assert single.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1


def test_tokenizer_signature(tokenizer: ort.InferenceSession) -> None:
    inputs = {i.name: i for i in tokenizer.get_inputs()}
    assert list(inputs) == ["feats", "feats_length"]
    assert inputs["feats"].type == "tensor(float)"
    assert inputs["feats"].shape[:2] == [1, 128] and len(inputs["feats"].shape) == 3
    assert inputs["feats_length"].type == "tensor(int32)" and inputs["feats_length"].shape == [1]
    (out,) = tokenizer.get_outputs()
    assert out.name == "indices" and out.type == "tensor(int64)" and len(out.shape) == 2


@pytest.mark.parametrize("frames", [4, 5, 100, 101, 400, 3000])
def test_tokenizer_emits_25_tokens_per_second(tokenizer: ort.InferenceSession, frames: int) -> None:
    feats = np.random.default_rng(frames).standard_normal((1, 128, frames), dtype=np.float32)
    tokens = _tokens(tokenizer, feats, frames)
    assert tokens.dtype == np.int64
    assert tokens.shape == (1, math.ceil(frames / 4))
    assert tokens.min() >= 0 and tokens.max() < 3**8
    if frames >= 100:
        assert len(np.unique(tokens)) > 1


def test_tokenizer_tokens_depend_on_input(tokenizer: ort.InferenceSession) -> None:
    rng = np.random.default_rng(1)
    a = _tokens(tokenizer, rng.standard_normal((1, 128, 400), dtype=np.float32), 400)
    b = _tokens(tokenizer, rng.standard_normal((1, 128, 400), dtype=np.float32), 400)
    assert not np.array_equal(a, b)


def test_tokenizer_honours_feats_length(tokenizer: ort.InferenceSession) -> None:
    feats = np.random.default_rng(2).standard_normal((1, 128, 400), dtype=np.float32)
    assert _tokens(tokenizer, feats, 200).shape == (1, 50)
    assert _tokens(tokenizer, feats, 201).shape == (1, 51)
    assert _tokens(tokenizer, feats, 400).shape == (1, 100)


def test_embedder_signature_and_output(embedder: ort.InferenceSession) -> None:
    (inp,) = embedder.get_inputs()
    assert inp.name == "input" and inp.type == "tensor(float)"
    assert len(inp.shape) == 3 and inp.shape[2] == 80
    (out,) = embedder.get_outputs()
    assert out.name == "output" and out.type == "tensor(float)" and out.shape[1] == 192
    for frames in (1, 50, 300):
        feats = np.random.default_rng(frames).standard_normal((1, frames, 80), dtype=np.float32)
        (emb,) = embedder.run(None, {"input": feats})
        assert emb.shape == (1, 192) and emb.dtype == np.float32
        assert np.isfinite(emb).all()


def test_embedder_batch_items_are_independent(embedder: ort.InferenceSession) -> None:
    rng = np.random.default_rng(3)
    batch = rng.standard_normal((2, 200, 80), dtype=np.float32)
    (both,) = embedder.run(None, {"input": batch})
    (first,) = embedder.run(None, {"input": batch[:1]})
    (second,) = embedder.run(None, {"input": batch[1:]})
    assert both.shape == (2, 192)
    np.testing.assert_allclose(both[0], first[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(both[1], second[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(first, second, rtol=1e-3, atol=1e-3)


def test_full_embedder_graph_has_real_size() -> None:
    model = standin.make_embedder_model("full", seed=0)
    onnx.checker.check_model(model)
    assert 6_000_000 < standin.param_count(model) < 8_000_000


@pytest.mark.parametrize("make", [standin.make_tokenizer_model, standin.make_embedder_model])
def test_unknown_profile_raises(make: Callable[[str], onnx.ModelProto], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown stand-in profile 'huge'"):
        make("huge")
    with pytest.raises(ValueError, match="tiny, full"):
        standin.make_standins(tmp_path / "x", "huge")
    assert not (tmp_path / "x").exists()
