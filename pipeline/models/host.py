"""What a TensorRT engine is only valid for: this machine's GPU model and library versions.

`detect_host` is the one function here that touches the machine (it runs `nvidia-smi` and
reads package metadata). It is only called when TensorRT may serve, is fast and harmless on a
machine without a GPU (no `nvidia-smi`: no process is started), and takes its probes as
arguments so tests can stub them. Parsing is pure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

UNKNOWN_GPU = "unknown-gpu"
NVIDIA_SMI_TIMEOUT_S = 5.0
# Distribution names that carry each library's version, first match wins.
ORT_DISTRIBUTIONS = ("onnxruntime-gpu", "onnxruntime")
TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu12", "tensorrt-cu12-libs", "tensorrt-cu11", "tensorrt-libs")

VersionOf = Callable[[str], str]
RunCommand = Callable[[Sequence[str]], str | None]


@dataclass(frozen=True)
class HostInfo:
    """The GPU model name and library versions (`onnxruntime`, `tensorrt`, `cuda`, `cudnn` when known)."""

    gpu_name: str = UNKNOWN_GPU
    versions: dict[str, str] = field(default_factory=dict)


def parse_gpu_names(output: str) -> list[str]:
    """GPU names from `nvidia-smi --query-gpu=name --format=csv,noheader` (one per line)."""
    return [line.strip() for line in output.splitlines() if line.strip()]


def pick_gpu_name(names: Sequence[str], device_id: int) -> str:
    """The name of GPU `device_id`; the first GPU's when the id is out of range, unknown when none.

    nvidia-smi numbers GPUs physically while CUDA numbers them after CUDA_VISIBLE_DEVICES; on a
    host with mixed GPUs and a remapped CUDA_VISIBLE_DEVICES, give the worker one GPU (as the
    compose file does) so both agree.
    """
    if not names:
        return UNKNOWN_GPU
    return names[device_id] if 0 <= device_id < len(names) else names[0]


def tensorrt_version_from_int(value: int) -> str:
    """TensorRT's `getInferLibVersion()` integer (e.g. 100300, or 8601 before 10) as `10.3.0`."""
    if value >= 10000:  # TensorRT >= 10: major * 10000 + minor * 100 + patch
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
    return f"{value // 1000}.{value // 100 % 10}.{value % 100}"


def run_command(argv: Sequence[str]) -> str | None:
    """Stdout of `argv`, or None when it is missing, fails or takes over 5 s."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def detect_gpu_name(device_id: int, run: RunCommand = run_command) -> str:
    """The name of GPU `device_id` according to nvidia-smi; `unknown-gpu` without one."""
    output = run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return pick_gpu_name(parse_gpu_names(output or ""), device_id)


def first_version(distributions: Sequence[str], version_of: VersionOf) -> str | None:
    """The installed version of the first of `distributions` that is installed."""
    for name in distributions:
        try:
            return version_of(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def ort_build_versions() -> dict[str, str]:
    """The CUDA and cuDNN versions onnxruntime-gpu was built for (absent from CPU builds)."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return {}
    found = {key: getattr(info, f"{key}_version", None) for key in ("cuda", "cudnn")}
    return {key: str(value) for key, value in found.items() if value}


def loaded_tensorrt_version() -> str | None:
    """TensorRT's version from libnvinfer itself, for TensorRT installed outside pip."""
    path = ctypes.util.find_library("nvinfer")
    if path is None:
        return None
    try:
        value = int(ctypes.CDLL(path).getInferLibVersion())
    except (OSError, AttributeError):
        return None
    return tensorrt_version_from_int(value)


def detect_versions(
    version_of: VersionOf = importlib.metadata.version,
    build_versions: Callable[[], dict[str, str]] = ort_build_versions,
    tensorrt_library: Callable[[], str | None] = loaded_tensorrt_version,
) -> dict[str, str]:
    """Versions an engine depends on: onnxruntime, TensorRT, and CUDA/cuDNN when the build says."""
    versions = dict(build_versions())
    ort = first_version(ORT_DISTRIBUTIONS, version_of)
    if ort:
        versions["onnxruntime"] = ort
    trt = first_version(TENSORRT_DISTRIBUTIONS, version_of) or tensorrt_library()
    if trt:
        versions["tensorrt"] = trt
    return versions


def detect_host(device_id: int, run: RunCommand = run_command) -> HostInfo:
    """The GPU name and library versions of this machine, for the TensorRT engine cache key."""
    return HostInfo(gpu_name=detect_gpu_name(device_id, run), versions=detect_versions())
