"""GPU name and library version detection, with the machine stubbed out (no GPU needed)."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable, Sequence

import pytest

from pipeline.models.host import (
    UNKNOWN_GPU,
    HostInfo,
    detect_gpu_name,
    detect_host,
    detect_versions,
    parse_gpu_names,
    pick_gpu_name,
    run_command,
    tensorrt_version_from_int,
)

SMI_OUTPUT = "NVIDIA H200\nNVIDIA H200\n"


def fake_versions(installed: dict[str, str]) -> Callable[[str], str]:
    def version_of(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    return version_of


def test_parse_and_pick_gpu_names() -> None:
    assert parse_gpu_names(" NVIDIA A10 \n\nNVIDIA L4\n") == ["NVIDIA A10", "NVIDIA L4"]
    assert pick_gpu_name(["NVIDIA A10", "NVIDIA L4"], 1) == "NVIDIA L4"
    assert pick_gpu_name(["NVIDIA A10"], 3) == "NVIDIA A10"  # CUDA_VISIBLE_DEVICES renumbered it
    assert pick_gpu_name([], 0) == UNKNOWN_GPU


def test_detect_gpu_name_asks_nvidia_smi() -> None:
    calls: list[Sequence[str]] = []

    def run(argv: Sequence[str]) -> str | None:
        calls.append(argv)
        return SMI_OUTPUT

    assert detect_gpu_name(0, run) == "NVIDIA H200"
    assert calls == [["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]]
    assert detect_gpu_name(0, lambda argv: None) == UNKNOWN_GPU  # no nvidia-smi, or it failed


def test_without_nvidia_smi_detection_is_harmless_and_fast() -> None:
    started = time.perf_counter()
    assert run_command(["voxmill-no-such-command-xyz", "--version"]) is None
    assert run_command(["false"]) is None
    assert time.perf_counter() - started < 1.0


def test_tensorrt_version_from_the_library_integer() -> None:
    assert tensorrt_version_from_int(100300) == "10.3.0"
    assert tensorrt_version_from_int(101200) == "10.12.0"
    assert tensorrt_version_from_int(8601) == "8.6.1"


def test_detect_versions_prefers_the_gpu_build_and_adds_cuda_and_cudnn() -> None:
    versions = detect_versions(
        fake_versions({"onnxruntime-gpu": "1.20.1", "onnxruntime": "1.19.0", "tensorrt": "10.4.0"}),
        build_versions=lambda: {"cuda": "12.4", "cudnn": "9.1"},
        tensorrt_library=lambda: None,
    )
    assert versions == {"onnxruntime": "1.20.1", "tensorrt": "10.4.0", "cuda": "12.4", "cudnn": "9.1"}


def test_detect_versions_falls_back_to_libnvinfer_and_omits_the_unknown() -> None:
    versions = detect_versions(
        fake_versions({"onnxruntime": "1.19.0"}), build_versions=dict, tensorrt_library=lambda: "10.3.0"
    )
    assert versions == {"onnxruntime": "1.19.0", "tensorrt": "10.3.0"}
    assert detect_versions(fake_versions({}), build_versions=dict, tensorrt_library=lambda: None) == {}


def test_detect_host_on_this_machine_reports_onnxruntime() -> None:
    host = detect_host(0, run=lambda argv: None)
    assert isinstance(host, HostInfo) and host.gpu_name == UNKNOWN_GPU
    assert host.versions["onnxruntime"]


@pytest.mark.parametrize("device_id", [0, 1])
def test_detect_host_names_the_configured_gpu(device_id: int) -> None:
    host = detect_host(device_id, run=lambda argv: "NVIDIA A100-SXM4-80GB\nNVIDIA L4\n")
    assert host.gpu_name == ["NVIDIA A100-SXM4-80GB", "NVIDIA L4"][device_id]
