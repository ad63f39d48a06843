"""Model registry: detection by sha256 and by name, CosyVoice folders, profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import VoxmillError
from pipeline.models.registry import Registry

V2_SHA = "d43342aa12163a80bf07bffb94c9de2e120a8df2f9917cd2f642e7f4219c6f71"
V1_25HZ_SHA = "56285ddd4a83e883ee0cb9f8d69c1089b53a94b1f78ff7e4a0224a27eb4cb486"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load()


def test_known_tokenizers_are_recognised_by_sha256_whatever_their_name(registry: Registry) -> None:
    found = registry.identify("tokenizer", "renamed.onnx", V2_SHA)
    assert (found.variant.name, found.by, found.variant.token_rate_hz) == ("v2", "sha256", 25)
    found = registry.identify("tokenizer", "speech_tokenizer_v1.onnx", V1_25HZ_SHA)
    assert (found.variant.name, found.variant.token_rate_hz) == ("v1_25hz", 25)


def test_unknown_hash_falls_back_to_the_file_name(registry: Registry) -> None:
    assert registry.identify("tokenizer", "speech_tokenizer_v1.onnx", "0" * 64).variant.token_rate_hz == 50
    found = registry.identify("tokenizer", "speech_tokenizer_v3.onnx", "0" * 64)
    assert (found.variant.name, found.by) == ("v3", "name")
    assert registry.identify("embedder", "campplus.onnx", "0" * 64).variant.embedding_dim == 192


def test_unknown_file_is_a_model_error(registry: Registry) -> None:
    with pytest.raises(VoxmillError) as caught:
        registry.identify("tokenizer", "whatever.onnx", "0" * 64)
    assert caught.value.code == "model_error"


def test_all_four_known_hashes_are_registered(registry: Registry) -> None:
    hashes = {v.sha256 for v in registry.role("tokenizer").variants}
    assert len(hashes) == 4 and None not in hashes


def test_cosyvoice_model_folder_is_recognised_as_it_is(tmp_path: Path, registry: Registry) -> None:
    folder = tmp_path / "pretrained_models" / "CosyVoice2-0.5B"
    folder.mkdir(parents=True)
    for name in ["campplus.onnx", "speech_tokenizer_v2.onnx", "flow.pt", "llm.pt", "cosyvoice2.yaml"]:
        (folder / name).write_bytes(b"x")
    assert registry.find_model("tokenizer", folder).name == "speech_tokenizer_v2.onnx"
    assert registry.find_model("embedder", folder).name == "campplus.onnx"
    (folder / "speech_tokenizer_v3.onnx").write_bytes(b"x")
    assert registry.find_model("tokenizer", folder).name == "speech_tokenizer_v3.onnx"


def test_missing_model_says_how_to_make_one(tmp_path: Path, registry: Registry) -> None:
    with pytest.raises(VoxmillError) as caught:
        registry.find_model("embedder", tmp_path)
    assert caught.value.code == "not_found"
    assert "make-standin" in caught.value.message


def test_tensorrt_profiles_come_from_the_registry(registry: Registry) -> None:
    assert registry.role("embedder").profiles == {
        "min": (1, 4, 80),
        "opt": (1, 500, 80),
        "max": (1, 3000, 80),
    }
    assert registry.role("tokenizer").profiles["max"] == (1, 128, 3000)


def test_role_of_file(registry: Registry) -> None:
    assert registry.role_of_file("speech_tokenizer_v2.onnx") == "tokenizer"
    assert registry.role_of_file("campplus.onnx") == "embedder"
    assert registry.role_of_file("flow.pt") is None
