"""Each model file: a git-lfs pointer, IR version and opsets, signature, variant, engine."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.batching import BatchRule
from pipeline.errors import VoxmillError
from pipeline.models.options import SessionOptions
from pipeline.settings import Settings
from workers.observe.doctor.check import (
    Check,
    error,
    ok,
    warning,
)
from workers.observe.doctor.software import (
    ort_refusal,
    probe_model_bytes,
)


@dataclass(frozen=True)
class ModelFile:
    """A model file that passed its checks far enough to be sized."""

    role: str
    path: Path
    sha256: str
    load_bytes: int


@dataclass(frozen=True)
class GraphArg:
    """An input or output as `check_signature` reads one from ONNX Runtime: name, shape, type."""

    name: str
    shape: list[int | str | None]
    type: str


def graph_args(values: Sequence[Any], skip: Collection[str] = ()) -> list[GraphArg]:
    """The graph's value infos as ONNX Runtime would show them (initializers are no inputs)."""
    from onnx import TensorProto

    args = []
    for value in values:
        if value.name in skip:
            continue
        tensor = value.type.tensor_type
        shape: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        ]
        type_name = TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "undefined"
        args.append(GraphArg(value.name, shape, f"tensor({type_name})"))
    return args


def model_checks(
    settings: Settings, registry: Any, available: Sequence[str]
) -> tuple[list[ModelFile], list[Check]]:
    """Each role's file in the model folder, checked without building a session from it."""
    folder = settings.model_dir
    if not folder.is_dir():
        return [], [
            error(
                "models",
                f"model folder {folder} does not exist",
                "set VOXMILL_MODEL_DIR, or make stand-ins: voxmill models make-standin --out DIR",
            )
        ]
    models, checks = [], []
    for role in registry.roles:
        spec = registry.role(role)
        try:
            path = registry.find_model(role, folder)
        except VoxmillError:
            checks.append(
                warning(
                    f"{role} file",
                    f"no {spec.file_glob} in {folder}",
                    f"put the model there; workers serving {spec.op} cannot start without it",
                )
            )
            continue
        model, lines = check_model_file(role, path, registry, settings, available)
        checks += lines
        if model is not None:
            models.append(model)
        twin = registry.find_batch_model(role, folder)
        if twin is not None:  # workers load it beside the tokenizer where their rule batches
            batch_model, batch_lines = check_model_file(role, twin, registry, settings, available, batch=True)
            checks += batch_lines
            serving = SessionOptions.from_settings(settings).serving_provider(available)
            if batch_model is not None and BatchRule.loads_twin(settings, serving):
                models.append(batch_model)
    if not models and not any(c.status == "error" for c in checks):
        checks.append(
            error("models", f"no model in {folder}", "voxmill models make-standin --out DIR to try")
        )
    return models, checks


def check_model_file(
    role: str,
    path: Path,
    registry: Any,
    settings: Settings,
    available: Sequence[str],
    batch: bool = False,
) -> tuple[ModelFile | None, list[Check]]:
    """One file: readable and no git-lfs pointer, IR/opsets, signature, variant, TensorRT engine.

    A `batch` file (checks named `<role> batch ...`) has its batch axes checked too, and no engine.
    """
    from pipeline.models.files import hash_model_file
    from pipeline.models.signature import check_batch_signature, check_signature

    label = f"{role} batch" if batch else role
    try:
        sha256 = hash_model_file(path)  # refuses an empty file or a git-lfs pointer by name
    except VoxmillError as exc:
        fix = "git lfs install && git lfs pull in the model folder" if "git-lfs" in exc.message else ""
        return None, [error(f"{label} file", exc.message, fix or "copy the real model file there")]
    lines = [ok(f"{label} file", f"{path} ({path.stat().st_size / 1e6:.1f} MB, sha256 {sha256[:12]})")]
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        what = f"{path.name} is not an ONNX model ({type(exc).__name__}: {str(exc)[:120]})"
        return None, [
            *lines,
            error(f"{label} onnx", what, "copy the file again: it is truncated or of another kind"),
        ]
    onnx_line, external_bytes = onnx_check(label, path, model)
    lines.append(onnx_line)
    inputs = graph_args(model.graph.input, {init.name for init in model.graph.initializer})
    outputs = graph_args(model.graph.output)
    spec = registry.role(role)
    try:
        check_signature(spec, path.name, inputs, outputs)
        if batch:
            check_batch_signature(path.name, inputs, outputs)
        what = f"matches the {role} role of the registry" + (", with a dynamic batch axis" if batch else "")
        lines.append(ok(f"{label} signature", what))
    except VoxmillError as exc:
        glob = spec.batch_glob if batch else spec.file_glob
        lines.append(
            error(f"{label} signature", exc.message, f"put a real {glob} there; this file is another model")
        )
    lines.append(variant_check(registry, role, path, sha256, label))
    if not batch:
        lines += engine_checks(role, sha256, settings, available)
    return ModelFile(role, path, sha256, path.stat().st_size + external_bytes), lines


def onnx_check(role: str, path: Path, model: Any) -> tuple[Check, int]:
    """IR version and opsets against this ONNX Runtime (a probe model of the same stamps), external data."""
    import onnxruntime as ort
    from onnx import TensorProto

    opsets = [(o.domain, int(o.version)) for o in model.opset_import]
    stamps = f"IR {model.ir_version}, opset " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in opsets)
    refusal, _ = ort_refusal(probe_model_bytes(int(model.ir_version), opsets))
    if refusal is not None:
        return error(
            f"{role} onnx",
            f"{path.name} ({stamps}) needs a newer onnxruntime than {ort.__version__}: {refusal}",
            "pip install -U onnxruntime (or onnxruntime-gpu), or re-export the model with an older opset",
        ), 0
    external, missing = 0, []
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        location = {entry.key: entry.value for entry in tensor.external_data}.get("location", "")
        target = path.parent / location
        if target.is_file():
            external += target.stat().st_size
        elif location not in missing:
            missing.append(location)
    if missing:
        return error(
            f"{role} onnx",
            f"{path.name} keeps weights in {', '.join(missing)}, not found beside it",
            "copy the external data files next to the model (or git lfs pull)",
        ), 0
    return ok(f"{role} onnx", f"{stamps}: loadable by onnxruntime {ort.__version__}"), external


def variant_check(registry: Any, role: str, path: Path, sha256: str, label: str = "") -> Check:
    """A known release by sha256, or only by name (its token rate is then the name's guess)."""
    label = label or role
    try:
        identified = registry.identify(role, path.name, sha256)
    except VoxmillError as exc:
        return error(f"{label} variant", exc.message, f"name the file like {registry.role(role).file_glob}")
    variant = identified.variant
    facts = [variant.description, f"{variant.token_rate_hz} tokens/s" if variant.token_rate_hz else ""]
    what = f"{variant.name}: {', '.join(f for f in facts if f)}"
    if identified.by == "sha256":
        return ok(f"{label} variant", f"{what}: sha256 of the known release")
    if registry.role(role).is_batch_name(path.name):
        return ok(
            f"{label} variant", f"{what}; known by its name (the registry lists no sha256 for batch files)"
        )
    if not any(v.sha256 for v in registry.role(role).variants):
        return ok(
            f"{label} variant", f"{what}; known by its name (the registry lists no sha256 for this role)"
        )
    v1 = (
        " (speech_tokenizer_v1.onnx: the 25 Hz release is told only by sha256)"
        if path.name.endswith("v1.onnx")
        else ""
    )
    return warning(
        f"{label} variant",
        f"sha256 {sha256[:12]} is no known release; taken by its name as {what}",
        "expected for a stand-in or your own export; for a released model download it again" + v1,
    )


def engine_checks(role: str, sha256: str, settings: Settings, available: Sequence[str]) -> list[Check]:
    """With TensorRT installed and asked for: an engine for this model, GPU, versions and precision."""
    from pipeline.models.engines import engine_status
    from pipeline.models.providers import ProviderOptions, uses_tensorrt

    if not uses_tensorrt(settings.provider, available):
        return []
    options = ProviderOptions(
        device_id=settings.cuda_device_id,
        trt_fp16=settings.trt_fp16,
        engine_cache_dir=settings.engine_cache_dir,
    )
    status = engine_status(sha256, options, available)
    if status.state == "ready":
        return [ok(f"{role} engine", status.detail)]
    return [
        warning(
            f"{role} engine",
            f"no TensorRT engine for this model on this GPU and TensorRT version ({status.engine_dir})",
            f"voxmill models build-engine {settings.model_dir} (else a worker's first start builds it)",
        )
    ]
