"""Provider choice and option strings for every configuration (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.providers import (
    CPU,
    CUDA,
    TENSORRT,
    ProviderOptions,
    ShapeProfile,
    choose_providers,
    engine_cache_key,
    missing_libraries,
    session_fallback_warning,
    shape_string,
)

ALL = [TENSORRT, CUDA, CPU]
CUDA_ONLY = [CUDA, CPU]
CPU_ONLY = [CPU]
OPTS = ProviderOptions()


@pytest.mark.parametrize(
    ("requested", "available", "expected", "warns"),
    [
        ("cpu", ALL, [CPU], False),
        ("cuda", ALL, [CUDA, CPU], False),
        ("tensorrt", ALL, [TENSORRT, CUDA, CPU], False),
        ("auto", ALL, [TENSORRT, CUDA, CPU], False),
        ("auto", CUDA_ONLY, [CUDA, CPU], False),
        ("auto", CPU_ONLY, [CPU], False),
        ("cuda", CPU_ONLY, [CPU], True),
        ("tensorrt", CUDA_ONLY, [CUDA, CPU], True),
        ("tensorrt", CPU_ONLY, [CPU], True),
    ],
)
def test_provider_chain(requested: str, available: list[str], expected: list[str], warns: bool) -> None:
    choice = choose_providers(requested, available, OPTS)
    assert choice.names == expected
    assert choice.serving == expected[0]
    assert (choice.warning is not None) == warns
    assert choice.names[-1] == CPU  # providers are always named, CPU always last


def test_fallback_warning_names_what_is_missing_and_what_serves() -> None:
    warning = choose_providers("cuda", CPU_ONLY, OPTS).warning
    assert warning is not None
    assert "CUDAExecutionProvider" in warning and "CPUExecutionProvider instead" in warning
    assert "onnxruntime-gpu" in warning


def test_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, cpu, cuda or tensorrt"):
        choose_providers("rocm", ALL, OPTS)


def test_cuda_options_default_to_heuristic_conv_search_and_honour_settings() -> None:
    options = dict(choose_providers("cuda", ALL, OPTS).providers)[CUDA]
    assert options["cudnn_conv_algo_search"] == "HEURISTIC"
    assert "gpu_mem_limit" not in options
    custom = ProviderOptions(device_id=3, cuda_mem_limit_bytes=2 << 30, cudnn_conv_algo_search="EXHAUSTIVE")
    options = dict(choose_providers("cuda", ALL, custom).providers)[CUDA]
    assert options == {
        "device_id": "3",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "arena_extend_strategy": "kSameAsRequested",
        "gpu_mem_limit": str(2 << 30),
    }


def test_tensorrt_options_carry_precision_cache_and_profiles(tmp_path: Path) -> None:
    profile = ShapeProfile(
        min={"feats": (1, 128, 4), "feats_length": (1,)},
        opt={"feats": (1, 128, 1000), "feats_length": (1,)},
        max={"feats": (1, 128, 3000), "feats_length": (1,)},
    )
    choice = choose_providers("tensorrt", ALL, ProviderOptions(trt_fp16=True), tmp_path, profile)
    options = dict(choice.providers)[TENSORRT]
    assert options["trt_fp16_enable"] == "True"
    assert options["trt_engine_cache_enable"] == "True"
    assert options["trt_engine_cache_path"] == str(tmp_path)
    assert options["trt_profile_min_shapes"] == "feats:1x128x4,feats_length:1"
    assert options["trt_profile_max_shapes"] == "feats:1x128x3000,feats_length:1"
    assert (
        dict(choose_providers("tensorrt", ALL, OPTS, tmp_path).providers)[TENSORRT]["trt_fp16_enable"]
        == "False"
    )


def test_shape_string() -> None:
    assert shape_string({"input": (1, 500, 80)}) == "input:1x500x80"


def test_engine_cache_key_changes_with_model_gpu_versions_and_precision() -> None:
    versions = {"onnxruntime": "1.20.0", "tensorrt": "10.4"}
    base = engine_cache_key("a" * 64, "NVIDIA H200", versions, False)
    assert base == engine_cache_key("a" * 64, "NVIDIA H200", dict(versions), False)
    assert base != engine_cache_key("b" * 64, "NVIDIA H200", versions, False)
    assert base != engine_cache_key("a" * 64, "NVIDIA A10", versions, False)
    assert base != engine_cache_key("a" * 64, "NVIDIA H200", {**versions, "tensorrt": "10.5"}, False)
    assert base != engine_cache_key("a" * 64, "NVIDIA H200", versions, True)
    assert base.startswith("a" * 12)


def test_missing_libraries_named() -> None:
    present = {"cudart", "cublas"}
    missing = missing_libraries(TENSORRT, lambda lib: lib if lib in present else None)
    assert missing == ["cudnn", "nvinfer"]
    assert missing_libraries(CPU) == []


def test_session_fallback_warning_when_the_built_session_runs_elsewhere() -> None:
    choice = choose_providers("cuda", ALL, OPTS)
    assert session_fallback_warning(choice, [CUDA, CPU]) is None
    warning = session_fallback_warning(choice, [CPU])
    assert warning is not None and "cuDNN" in warning and "running on CPUExecutionProvider" in warning
