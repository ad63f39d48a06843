"""TensorRT engines built ahead of time, so a GPU worker starts in seconds instead of minutes.

ONNX Runtime's TensorRT provider builds an engine the first time a model runs and writes it,
with a timing cache, into the folder `ModelSession.load` gives it: `engine_cache_dir/<key>`,
the key made of the model's sha256, the GPU name, the library versions and the precision
(`providers.engine_cache_dir`). Building ahead of time is loading each model once with the
TensorRT provider and the registry's min/opt/max shape profile, and running it at those three
shapes; a worker that later loads the same model on the same kind of GPU with the same
libraries finds the engine there and skips the build.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.host import HostInfo, detect_host
from pipeline.models.options import SessionOptions
from pipeline.models.providers import (
    TENSORRT,
    ProviderOptions,
    engine_cache_dir,
    session_fallback_warning,
    tensorrt_unavailable_reason,
)
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.records import ROLE_TOKENIZER

ENGINE_SUFFIX = ".engine"
PROFILE_LEVELS = ("min", "opt", "max")
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class EngineBuild:
    """One engine built: which model, where it went, how long it took (load + runs at every shape)."""

    role: str
    file: str
    sha256: str
    engine_dir: Path
    build_s: float
    fp16: bool
    engine_files: tuple[str, ...]
    run_ms: dict[str, float]


@dataclass(frozen=True)
class EngineStatus:
    """Whether a usable engine exists for a model on this GPU: `ready`, `missing` or `n/a`."""

    state: str
    engine_dir: Path | None
    detail: str

    def to_dict(self) -> dict[str, str | None]:
        return {
            "state": self.state,
            "engine_dir": None if self.engine_dir is None else str(self.engine_dir),
            "detail": self.detail,
        }


def tensorrt_unavailable() -> str | None:
    """Why this onnxruntime cannot run TensorRT (with what to install), or None when it can."""
    import onnxruntime as ort

    return tensorrt_unavailable_reason(ort.get_available_providers())


def engine_files(folder: Path | None) -> tuple[str, ...]:
    """Names of the TensorRT engines in `folder` (none when it does not exist)."""
    if folder is None or not folder.is_dir():
        return ()
    return tuple(sorted(p.name for p in folder.iterdir() if p.name.endswith(ENGINE_SUFFIX)))


def engine_status(
    sha256: str, options: ProviderOptions, available: Sequence[str], host: HostInfo | None = None
) -> EngineStatus:
    """Whether the engine cache folder of this model, GPU, versions and precision holds an engine."""
    if tensorrt_unavailable_reason(available) is not None:
        return EngineStatus("n/a", None, "n/a (no TensorRT)")
    folder = engine_cache_dir(options, sha256, host or detect_host(options.device_id))
    if engine_files(folder):
        return EngineStatus("ready", folder, f"ready ({folder})")
    return EngineStatus("missing", folder, "missing for this GPU: run `voxmill models build-engine`")


def profile_inputs(role: str, shape: tuple[int, ...], seed: int = 0) -> list[Array]:
    """Session inputs of one profile shape: tokenizer feats [1,128,T] + feats_length, embedder [B,T,F]."""
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal(shape).astype(np.float32)
    if role == ROLE_TOKENIZER:
        return [feats, np.full((shape[0],), shape[-1], dtype=np.int32)]
    return [feats]


def run_profile_shapes(session: ModelSession) -> dict[str, float]:
    """Run `session` at the registry's min, opt and max shapes; milliseconds per shape."""
    timings: dict[str, float] = {}
    for level in PROFILE_LEVELS:
        shape = session.spec.profiles.get(level)
        if shape is None:
            continue
        started = time.perf_counter()
        session.run(profile_inputs(session.role, shape))
        timings[level] = round((time.perf_counter() - started) * 1000.0, 3)
    return timings


def tensorrt_options(options: SessionOptions, fp16: bool | None) -> SessionOptions:
    """`options` forced onto TensorRT, with `fp16` when given (else the settings' precision)."""
    provider_options = options.provider_options
    if fp16 is not None:
        provider_options = dataclasses.replace(provider_options, trt_fp16=fp16)
    return dataclasses.replace(options, provider="tensorrt", warmup_runs=0, provider_options=provider_options)


def build_engine(
    path: Path,
    role: str,
    options: SessionOptions,
    registry: Registry,
    host: HostInfo | None = None,
) -> EngineBuild:
    """Build (or find already built) the TensorRT engine of one model; `options` must ask for TensorRT.

    Raises `VoxmillError(model_error)` when TensorRT does not start or writes no engine.
    """
    started = time.perf_counter()
    session = ModelSession.load(path, role, options, registry, host=host)
    try:
        if not session.active_providers or session.active_providers[0] != TENSORRT:
            why = session_fallback_warning(session.choice, session.active_providers) or session.choice.warning
            raise VoxmillError(errors.MODEL_ERROR, f"{path.name}: no TensorRT engine built: {why}")
        run_ms = run_profile_shapes(session)
    finally:
        session.close()
    built = engine_files(session.engine_dir)
    if session.engine_dir is None or not built:
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{path.name}: TensorRT ran but wrote no engine into {session.engine_dir}",
        )
    return EngineBuild(
        role=role,
        file=path.name,
        sha256=session.sha256,
        engine_dir=session.engine_dir,
        build_s=time.perf_counter() - started,
        fp16=options.provider_options.trt_fp16,
        engine_files=built,
        run_ms=run_ms,
    )


def build_engines(
    model_dir: Path,
    options: SessionOptions,
    fp16: bool | None = None,
    registry: Registry | None = None,
    host: HostInfo | None = None,
) -> list[EngineBuild]:
    """Build the TensorRT engine of every model the registry finds in `model_dir`.

    A folder with no model of any role is a `not_found` error.
    """
    registry = registry or Registry.load()
    trt = tensorrt_options(options, fp16)
    host = host or detect_host(trt.provider_options.device_id)
    paths = {}
    for role in registry.roles:
        try:
            paths[role] = registry.find_model(role, model_dir)
        except VoxmillError:
            continue
    if not paths:
        raise VoxmillError(errors.NOT_FOUND, f"no tokenizer or embedder model in {model_dir}")
    return [build_engine(path, role, trt, registry, host) for role, path in paths.items()]


def installed_engine_status(sha256: str, options: ProviderOptions) -> EngineStatus:
    """`engine_status` of a model (by sha256) with the providers this onnxruntime has."""
    import onnxruntime as ort

    return engine_status(sha256, options, ort.get_available_providers())
