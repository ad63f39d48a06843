"""Provider choice and option strings for every configuration (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.models.host import HostInfo
from pipeline.models.providers import (
    CPU,
    CUDA,
    PROVIDER_NAMES,
    TENSORRT,
    ProviderOptions,
    ShapeProfile,
    choose_providers,
    engine_cache_dir,
    engine_cache_key,
    missing_libraries,
    session_fallback_warning,
    shape_string,
    tensorrt_unavailable_reason,
    uses_tensorrt,
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


# ------------------------------------------------------------------ every configuration
PROFILE = ShapeProfile(
    min={"feats": (1, 128, 4), "feats_length": (1,)},
    opt={"feats": (1, 128, 1000), "feats_length": (1,)},
    max={"feats": (1, 128, 3000), "feats_length": (1,)},
)


@pytest.mark.parametrize("requested", ["auto", "cpu", "cuda", "tensorrt"])
@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("mem_limit", [0, 4 << 30])
@pytest.mark.parametrize("search", ["HEURISTIC", "EXHAUSTIVE", "DEFAULT"])
def test_option_strings_for_every_configuration(
    tmp_path: Path, requested: str, fp16: bool, mem_limit: int, search: str
) -> None:
    options = ProviderOptions(
        device_id=1, cuda_mem_limit_bytes=mem_limit, cudnn_conv_algo_search=search, trt_fp16=fp16
    )
    providers = dict(choose_providers(requested, ALL, options, tmp_path, PROFILE).providers)
    assert providers[CPU] == {}
    for values in providers.values():
        assert all(isinstance(v, str) for v in values.values())  # ONNX Runtime takes strings
    if CUDA in providers:
        cuda = providers[CUDA]
        assert cuda["device_id"] == "1" and cuda["cudnn_conv_algo_search"] == search
        assert cuda.get("gpu_mem_limit") == (str(mem_limit) if mem_limit else None)
    if TENSORRT in providers:
        trt = providers[TENSORRT]
        assert trt["device_id"] == "1"
        assert trt["trt_fp16_enable"] == str(fp16)
        assert trt["trt_engine_cache_path"] == trt["trt_timing_cache_path"] == str(tmp_path)
        assert trt["trt_profile_opt_shapes"] == "feats:1x128x1000,feats_length:1"
    expected = {"cpu": [CPU], "cuda": [CUDA, CPU]}.get(requested, [TENSORRT, CUDA, CPU])
    assert list(providers) == expected


def test_tensorrt_without_a_profile_has_no_profile_options(tmp_path: Path) -> None:
    options = dict(choose_providers("tensorrt", ALL, OPTS, tmp_path).providers)[TENSORRT]
    assert not any(key.startswith("trt_profile") for key in options)


def test_tensorrt_cache_defaults_to_the_settings_folder() -> None:
    options = dict(choose_providers("tensorrt", ALL, OPTS).providers)[TENSORRT]
    assert options["trt_engine_cache_path"] == str(OPTS.engine_cache_dir)


# ------------------------------------------------------------------ fallback warnings
@pytest.mark.parametrize(
    ("requested", "available", "serving", "hint"),
    [
        ("cuda", CPU_ONLY, CPU, "onnxruntime-gpu"),
        ("tensorrt", CPU_ONLY, CPU, "tensorrt"),
        ("tensorrt", CUDA_ONLY, CUDA, "libnvinfer"),
    ],
)
def test_one_warning_names_what_is_missing_and_the_provider_used(
    requested: str, available: list[str], serving: str, hint: str
) -> None:
    warning = choose_providers(requested, available, OPTS).warning
    assert warning is not None
    assert f"provider {requested!r} is unavailable" in warning
    assert PROVIDER_NAMES[requested] in warning  # what is missing
    assert warning.endswith(f"running on {serving} instead")  # what serves
    assert hint in warning and "voxmill[gpu]" in warning


def test_auto_falls_back_silently_by_design() -> None:
    assert choose_providers("auto", CPU_ONLY, OPTS).warning is None


def test_failed_start_names_the_missing_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.models.providers as providers

    monkeypatch.setattr(
        providers.ctypes.util, "find_library", lambda lib: None if lib == "cudnn" else f"lib{lib}.so"
    )
    choice = choose_providers("cuda", ALL, OPTS)
    warning = session_fallback_warning(choice, [CPU])
    assert warning == (
        "CUDAExecutionProvider could not start (missing libraries: cudnn; a CUDA/cuDNN version mismatch "
        "is the usual cause); running on CPUExecutionProvider instead"
    )
    trt = choose_providers("tensorrt", ALL, OPTS)
    warning = session_fallback_warning(trt, [CUDA, CPU])
    assert warning is not None and "TensorrtExecutionProvider could not start" in warning
    assert "running on CUDAExecutionProvider instead" in warning


def test_tensorrt_unavailable_reason_says_what_to_install() -> None:
    assert tensorrt_unavailable_reason(ALL) is None
    reason = tensorrt_unavailable_reason(CPU_ONLY)
    assert reason is not None and "pip install 'voxmill[gpu]'" in reason and "libnvinfer" in reason


@pytest.mark.parametrize(
    ("requested", "available", "expected"),
    [
        ("auto", ALL, True),
        ("tensorrt", ALL, True),
        ("cuda", ALL, False),
        ("cpu", ALL, False),
        ("auto", CUDA_ONLY, False),
        ("tensorrt", CPU_ONLY, False),
    ],
)
def test_uses_tensorrt(requested: str, available: list[str], expected: bool) -> None:
    assert uses_tensorrt(requested, available) is expected


# ------------------------------------------------------------------ engine cache folders
def test_engine_cache_dir_is_the_settings_folder_plus_the_key(tmp_path: Path) -> None:
    host = HostInfo("NVIDIA H200", {"onnxruntime": "1.20.1", "tensorrt": "10.4.0"})
    options = ProviderOptions(engine_cache_dir=tmp_path, trt_fp16=True)
    folder = engine_cache_dir(options, "c" * 64, host)
    assert folder == tmp_path / engine_cache_key("c" * 64, "NVIDIA H200", host.versions, True)
    other_gpu = HostInfo("NVIDIA L4", host.versions)
    assert engine_cache_dir(options, "c" * 64, other_gpu) != folder
    newer_ort = HostInfo(host.gpu_name, {**host.versions, "onnxruntime": "1.21.0"})
    assert engine_cache_dir(options, "c" * 64, newer_ort) != folder
    fp32 = ProviderOptions(engine_cache_dir=tmp_path, trt_fp16=False)
    assert engine_cache_dir(fp32, "c" * 64, host) != folder


def test_engine_cache_key_does_not_depend_on_version_order() -> None:
    a = engine_cache_key("d" * 64, "GPU", {"cuda": "12.4", "onnxruntime": "1.20"}, False)
    b = engine_cache_key("d" * 64, "GPU", {"onnxruntime": "1.20", "cuda": "12.4"}, False)
    assert a == b
    assert a != engine_cache_key("d" * 64, "GPU", {"onnxruntime": "1.20"}, False)  # cuDNN/CUDA now unknown
