"""Sessions: load from bytes, sha256 of what was loaded, signature checks, warm-up, clear refusals."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pipeline.errors import VoxmillError
from pipeline.inference import open_session
from pipeline.models.files import PinnedModelFile
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.standin import make_standins

REGISTRY = Registry.load()
OPTIONS = SessionOptions(provider="cpu", warmup_runs=2)


def refusal(path: Path, role: str) -> VoxmillError:
    with pytest.raises(VoxmillError) as caught:
        open_session(path, role, OPTIONS, REGISTRY)
    assert caught.value.code == "model_error"
    return caught.value


def test_session_names_the_sha256_of_the_bytes_it_loaded(models: Path) -> None:
    session = open_session(models / "campplus.onnx", "embedder", OPTIONS, REGISTRY)
    assert session.sha256 == hashlib.sha256((models / "campplus.onnx").read_bytes()).hexdigest()
    assert session.ref.file == "campplus.onnx" and session.role == "embedder"
    assert session.active_providers == ["CPUExecutionProvider"]
    assert (
        session.warm and session.load_s > 0 and session.warm_latency_ms is not None and session.warmup_s > 0
    )
    assert session.input_names and session.output_names  # read from the model, not hard-coded


def test_expected_sha256_mismatch_is_refused(models: Path) -> None:
    with pytest.raises(VoxmillError) as caught:
        ModelSession.load(models / "campplus.onnx", "embedder", OPTIONS, REGISTRY, expected_sha256="0" * 64)
    assert caught.value.code == "model_error" and "sha256" in caught.value.message


def test_a_model_renamed_over_the_path_leaves_the_pinned_file(models: Path, tmp_path: Path) -> None:
    path = shutil.copy(models / "campplus.onnx", tmp_path / "campplus.onnx")
    other = tmp_path / "other.onnx"
    make_standins(tmp_path / "seed7", seed=7)
    shutil.copy(tmp_path / "seed7" / "campplus.onnx", other)
    first = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    with PinnedModelFile(Path(path)) as pinned:
        assert pinned.sha256 == first
        os.replace(other, path)  # the atomic rename a deployment does, while the session is being built
        assert hashlib.sha256(Path(pinned.source).read_bytes()).hexdigest() == first
        pinned.check_unchanged()  # a rename leaves the open file as it was
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() != first


def test_a_model_written_in_place_while_it_is_read_is_refused(models: Path, tmp_path: Path) -> None:
    path = Path(shutil.copy(models / "campplus.onnx", tmp_path / "campplus.onnx"))
    with PinnedModelFile(path) as pinned:
        with path.open("ab") as stream:  # a copy still being written in place
            stream.write(b"\0" * 16)
        with pytest.raises(VoxmillError) as caught:
            pinned.check_unchanged()
    assert caught.value.code == "model_error" and "changed while it was read" in caught.value.message


def wrong_rank_embedder(path: Path) -> Path:
    """A valid ONNX whose input is [T, 80] instead of [B, T, 80]."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["T", 80])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["T", 80])
    graph = helper.make_graph([helper.make_node("Identity", ["input"], ["output"])], "wrong", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_wrong_input_rank_is_refused_with_a_precise_message(tmp_path: Path) -> None:
    error = refusal(wrong_rank_embedder(tmp_path / "campplus.onnx"), "embedder")
    assert "input 0" in error.message and "rank 2" in error.message and "expected rank 3" in error.message


def test_tokenizer_with_a_float_length_input_is_refused(tmp_path: Path) -> None:
    feats = helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"])
    length = helper.make_tensor_value_info("feats_length", TensorProto.FLOAT, [1])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["feats_length"], ["out"])], "g", [feats, length], [out]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "speech_tokenizer_v2.onnx")
    error = refusal(tmp_path / "speech_tokenizer_v2.onnx", "tokenizer")
    assert "input 1" in error.message and "tensor(int32)" in error.message


def test_git_lfs_pointer_is_named_as_such(tmp_path: Path) -> None:
    pointer = tmp_path / "campplus.onnx"
    pointer.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4e3a2c8b7f1d0e9a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a\nsize 28303423\n"
    )
    error = refusal(pointer, "embedder")
    assert "git-lfs pointer" in error.message and "git lfs pull" in error.message


def test_truncated_and_random_files_are_refused(tmp_path: Path, models: Path) -> None:
    truncated = tmp_path / "campplus.onnx"
    truncated.write_bytes((models / "campplus.onnx").read_bytes()[:5000])
    assert "not a loadable ONNX model" in refusal(truncated, "embedder").message
    noise = tmp_path / "noise" / "campplus.onnx"
    noise.parent.mkdir()
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    message = refusal(noise, "embedder").message
    # The user's file is named, never the descriptor ONNX Runtime read it through.
    assert message.startswith(f"{noise} is not a loadable ONNX model") and "/proc/self/fd" not in message
    assert "truncated, corrupted" in message


def test_a_wrong_signature_reads_as_a_sentence(tmp_path: Path, models: Path) -> None:
    tokenizer_as_embedder = tmp_path / "campplus.onnx"
    tokenizer_as_embedder.write_bytes((models / "speech_tokenizer_v2.onnx").read_bytes())
    message = refusal(tokenizer_as_embedder, "embedder").message
    assert "not an embedder model" in message and " a embedder" not in message and " an float" not in message


def test_missing_and_empty_files_are_refused(tmp_path: Path) -> None:
    assert "does not exist" in refusal(tmp_path / "campplus.onnx", "embedder").message
    (tmp_path / "campplus.onnx").write_bytes(b"")
    assert "empty" in refusal(tmp_path / "campplus.onnx", "embedder").message


def test_describe_is_json_ready(models: Path) -> None:
    import json

    session = open_session(models / "speech_tokenizer_v2.onnx", "tokenizer", OPTIONS, REGISTRY)
    described = json.loads(json.dumps(session.describe()))
    assert described["variant"] == "v2" and described["recognised_by"] == "name"
