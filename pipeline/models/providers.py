"""The one place that decides ONNX Runtime execution providers and their options.

`choose_providers` is pure: given what was requested, what is installed and the options, it
returns the provider list to pass to ONNX Runtime, which one will serve, and a warning when
that is not what was asked for. Nothing here creates a session.
"""

from __future__ import annotations

import ctypes.util
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.models.host import HostInfo

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
PROVIDER_NAMES = {"cpu": CPU, "cuda": CUDA, "tensorrt": TENSORRT}
# Shared libraries each provider needs at run time, to name the missing one in warnings.
REQUIRED_LIBRARIES = {
    CUDA: ("cudart", "cublas", "cudnn"),
    TENSORRT: ("cudart", "cublas", "cudnn", "nvinfer"),
}
GPU_INSTALL_HINT = "pip install 'voxmill[gpu]' (onnxruntime-gpu) and remove the CPU-only onnxruntime"
TENSORRT_INSTALL_HINT = (
    "pip install 'voxmill[gpu]' (onnxruntime-gpu and tensorrt; or NVIDIA's libnvinfer packages) "
    "on a machine with an NVIDIA GPU, and remove the CPU-only onnxruntime"
)

ProviderEntry = tuple[str, dict[str, str]]


@dataclass(frozen=True)
class ProviderOptions:
    """Provider settings from `Settings` (device, memory, cuDNN search, TensorRT precision and cache)."""

    device_id: int = 0
    cuda_mem_limit_bytes: int = 0
    cudnn_conv_algo_search: str = "HEURISTIC"
    trt_fp16: bool = False
    engine_cache_dir: Path = Path(".voxmill/engines")


@dataclass(frozen=True)
class ShapeProfile:
    """TensorRT min/opt/max shapes for each named input."""

    min: dict[str, tuple[int, ...]] = field(default_factory=dict)
    opt: dict[str, tuple[int, ...]] = field(default_factory=dict)
    max: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderChoice:
    """What to pass to `InferenceSession(providers=...)`, and what will actually serve."""

    requested: str
    providers: list[ProviderEntry]
    serving: str
    warning: str | None = None

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.providers]


def cuda_options(options: ProviderOptions) -> dict[str, str]:
    """CUDA provider options; cuDNN's conv search defaults to HEURISTIC (variable-length audio)."""
    opts = {
        "device_id": str(options.device_id),
        "cudnn_conv_algo_search": options.cudnn_conv_algo_search,
        "arena_extend_strategy": "kSameAsRequested",
    }
    if options.cuda_mem_limit_bytes > 0:
        opts["gpu_mem_limit"] = str(options.cuda_mem_limit_bytes)
    return opts


def shape_string(shapes: dict[str, tuple[int, ...]]) -> str:
    """ONNX Runtime's profile syntax: `feats:1x128x4,feats_length:1`."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())


def tensorrt_options(options: ProviderOptions, cache_dir: Path, profile: ShapeProfile) -> dict[str, str]:
    """TensorRT provider options: precision, engine and timing caches in `cache_dir`, shape profile."""
    opts = {
        "device_id": str(options.device_id),
        "trt_fp16_enable": "True" if options.trt_fp16 else "False",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
    }
    if profile.min:
        opts["trt_profile_min_shapes"] = shape_string(profile.min)
        opts["trt_profile_opt_shapes"] = shape_string(profile.opt)
        opts["trt_profile_max_shapes"] = shape_string(profile.max)
    return opts


def engine_cache_key(model_sha256: str, gpu_name: str, versions: dict[str, str], fp16: bool) -> str:
    """A folder name that changes when the model, the GPU, a library version or the precision does."""
    parts = [model_sha256, gpu_name, *(f"{k}={versions[k]}" for k in sorted(versions)), f"fp16={fp16}"]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"{model_sha256[:12]}-{digest}"


def engine_cache_dir(options: ProviderOptions, model_sha256: str, host: HostInfo) -> Path:
    """Where TensorRT's engine and timing caches for this model on this GPU live.

    `engine_cache_dir / engine_cache_key(...)`: a new model, GPU, library version or precision
    gets a new folder, so an engine built elsewhere is never loaded by mistake.
    """
    key = engine_cache_key(model_sha256, host.gpu_name, host.versions, options.trt_fp16)
    return options.engine_cache_dir / key


def uses_tensorrt(requested: str, available: Sequence[str]) -> bool:
    """Whether `requested` puts TensorRT first: `tensorrt` or `auto`, with TensorRT installed."""
    return requested in ("tensorrt", "auto") and TENSORRT in available


def tensorrt_unavailable_reason(available: Sequence[str]) -> str | None:
    """Why TensorRT cannot serve here (and what to install), or None when this onnxruntime has it."""
    if TENSORRT in available:
        return None
    return f"this onnxruntime has no {TENSORRT} (installed: {', '.join(available)}); {TENSORRT_INSTALL_HINT}"


def missing_libraries(provider: str, find_library: Callable[[str], str | None] | None = None) -> list[str]:
    """The shared libraries `provider` needs that the loader cannot find (`ctypes.util.find_library`)."""
    find = find_library or ctypes.util.find_library
    return [lib for lib in REQUIRED_LIBRARIES.get(provider, ()) if find(lib) is None]


def choose_providers(
    requested: str,
    available: Sequence[str],
    options: ProviderOptions,
    cache_dir: Path | None = None,
    profile: ShapeProfile | None = None,
) -> ProviderChoice:
    """Decide the provider list for `requested` (`auto|cpu|cuda|tensorrt`).

    `auto` picks TensorRT > CUDA > CPU by what is installed. An explicit request for a
    provider that is not installed falls back down that chain with a warning. CPU is always
    last, so a session can always be built; providers are always named explicitly.
    """
    if requested not in ("auto", *PROVIDER_NAMES):
        raise ValueError(f"provider must be auto, cpu, cuda or tensorrt, not {requested!r}")
    trt = (
        TENSORRT,
        tensorrt_options(options, cache_dir or options.engine_cache_dir, profile or ShapeProfile()),
    )
    cuda = (CUDA, cuda_options(options))
    cpu: ProviderEntry = (CPU, {})
    chain: list[ProviderEntry]
    if requested == "cpu":
        chain = [cpu]
    elif requested == "cuda":
        chain = [cuda, cpu]
    else:  # tensorrt or auto
        chain = [trt, cuda, cpu]
    usable = [entry for entry in chain if entry[0] in available or entry[0] == CPU]
    serving = usable[0][0]
    wanted = PROVIDER_NAMES.get(requested)
    warning = None
    if wanted is not None and serving != wanted:
        warning = fallback_warning(requested, wanted, serving, available)
    return ProviderChoice(requested=requested, providers=usable, serving=serving, warning=warning)


def fallback_warning(requested: str, wanted: str, serving: str, available: Sequence[str]) -> str:
    """One clear sentence: what was asked, why it cannot serve, what serves instead."""
    if wanted not in available:
        hint = TENSORRT_INSTALL_HINT if wanted == TENSORRT else GPU_INSTALL_HINT
        reason = f"this onnxruntime has no {wanted} (installed: {', '.join(available)}); {hint}"
    else:
        missing = missing_libraries(wanted)
        reason = f"missing libraries: {', '.join(missing)}" if missing else "it failed to start"
    return f"provider {requested!r} is unavailable ({reason}); running on {serving} instead"


def session_fallback_warning(choice: ProviderChoice, active: Sequence[str]) -> str | None:
    """A warning when the built session does not run on the provider that was chosen."""
    if not active or active[0] == choice.serving:
        return None
    missing = missing_libraries(choice.serving)
    why = f"missing libraries: {', '.join(missing)}" if missing else "see ONNX Runtime's log above"
    return (
        f"{choice.serving} could not start ({why}; a CUDA/cuDNN version mismatch is the usual cause); "
        f"running on {active[0]} instead"
    )
