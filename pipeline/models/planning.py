"""Where one model will run: its providers and, when TensorRT may serve, its engine folder and shapes.

`plan_providers` asks `pipeline.models.providers` for the choice; only when TensorRT is installed
and wanted does it detect the GPU and versions (the engine cache key) and read the registry's
shape profile from the model's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.host import HostInfo, detect_host
from pipeline.models.options import SessionOptions
from pipeline.models.providers import (
    ProviderChoice,
    ShapeProfile,
    choose_providers,
    engine_cache_dir,
    uses_tensorrt,
)
from pipeline.models.registry import RoleSpec


def plan_providers(
    options: SessionOptions,
    spec: RoleSpec,
    data: bytes,
    sha256: str,
    available: Sequence[str],
    host: HostInfo | None = None,
) -> tuple[ProviderChoice, Path | None]:
    """The provider choice for one model, and its TensorRT engine cache folder when TensorRT may serve.

    Only when TensorRT is installed and wanted are the GPU and versions detected (`host`, when
    not given) and the registry's shape profile read from the model; a CPU load does neither.
    """
    provider_options = options.provider_options
    if not uses_tensorrt(options.provider, available):
        return choose_providers(options.provider, available, provider_options), None
    host = host or detect_host(provider_options.device_id)
    cache_dir = engine_cache_dir(provider_options, sha256, host)
    profile = _shape_profile(spec, data)
    return choose_providers(options.provider, available, provider_options, cache_dir, profile), cache_dir


def make_engine_dir(path: Path) -> None:
    """Create the engine cache folder; an unwritable one is a `model_error` that names the setting."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"cannot create the TensorRT engine cache folder {path}: {exc.strerror}; "
            "point engine_cache_dir (VOXMILL_ENGINE_CACHE_DIR) at a writable folder",
        ) from None


def _shape_profile(spec: RoleSpec, data: bytes) -> ShapeProfile:
    """TensorRT min/opt/max shapes for the model's inputs, named as the file names them."""
    if not spec.profiles:
        return ShapeProfile()
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception:
        return ShapeProfile()
    initializers = {init.name for init in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    first = names[0]
    profile: dict[str, dict[str, tuple[int, ...]]] = {"min": {}, "opt": {}, "max": {}}
    for level in profile:
        shape = spec.profiles[level]
        profile[level][first] = shape
        if len(names) > 1:  # the tokenizer's feats_length
            profile[level][names[1]] = (shape[0],)
    return ShapeProfile(min=profile["min"], opt=profile["opt"], max=profile["max"])
