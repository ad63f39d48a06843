"""A model's inputs and outputs checked against its role in the registry, by position.

Rank, dtype (or dtype kind) and fixed dimensions as `config/models.yaml` declares them: a wrong
model is refused with `model_error` at load, before any request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.registry import RoleSpec, TensorSpec

ORT_DTYPES = {"float32": "tensor(float)", "int32": "tensor(int32)", "int64": "tensor(int64)"}
DTYPE_KINDS = {
    "int": ("tensor(int32)", "tensor(int64)", "tensor(int16)", "tensor(int8)", "tensor(uint8)"),
    "float": ("tensor(float)", "tensor(float16)", "tensor(double)"),
}


def check_signature(spec: RoleSpec, file_name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Refuse a session whose inputs/outputs do not match the role (by position)."""
    if len(inputs) < len(spec.inputs):
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{file_name} has {len(inputs)} input(s); a {spec.role} model needs {len(spec.inputs)}",
        )
    if len(outputs) < len(spec.outputs):
        raise VoxmillError(errors.MODEL_ERROR, f"{file_name} has no output; a {spec.role} model needs one")
    for kind, declared, wanted in (("input", inputs, spec.inputs), ("output", outputs, spec.outputs)):
        for index, (arg, want) in enumerate(zip(declared, wanted, strict=False)):
            problem = _tensor_mismatch(arg, want)
            if problem:
                raise VoxmillError(
                    errors.MODEL_ERROR,
                    f"{file_name} {kind} {index} ({arg.name!r}) {problem}; "
                    f"not {_article(spec.role)} {spec.role} model",
                )


def check_batch_signature(file_name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Refuse a batch file whose first input, lengths and output lack a dynamic batch axis.

    CosyVoice's batch signature: feats [B, 128, T], feats_length [B] -> tokens [B, T'] (the
    role's own signature is checked apart, by `check_signature`).
    """
    if len(inputs) < 2 or not outputs:
        raise VoxmillError(
            errors.MODEL_ERROR, f"{file_name} needs feats and feats_length inputs and an output to batch"
        )
    declared = [("input", 0, inputs[0], 3), ("input", 1, inputs[1], 1), ("output", 0, outputs[0], 2)]
    for kind, index, arg, rank in declared:
        shape = list(arg.shape)
        if len(shape) != rank or isinstance(shape[0], int):
            raise VoxmillError(
                errors.MODEL_ERROR,
                f"{file_name} {kind} {index} ({arg.name!r}) has shape {shape}; a batch tokenizer needs "
                f"rank {rank} with a dynamic batch axis first (feats [B,128,T], feats_length [B], "
                "tokens [B,T'])",
            )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _tensor_mismatch(arg: Any, want: TensorSpec) -> str | None:
    shape = list(arg.shape)
    if want.rank is not None and len(shape) != want.rank:
        return f"has rank {len(shape)} (shape {shape}), expected rank {want.rank}"
    if want.dtype is not None and arg.type != ORT_DTYPES[want.dtype]:
        return f"has type {arg.type}, expected {ORT_DTYPES[want.dtype]}"
    if want.dtype_kind is not None and arg.type not in DTYPE_KINDS[want.dtype_kind]:
        return f"has type {arg.type}, expected {_article(want.dtype_kind)} {want.dtype_kind} tensor"
    if want.dims is not None:
        for axis, (got, expected) in enumerate(zip(shape, want.dims, strict=False)):
            if expected is not None and isinstance(got, int) and got != expected:
                return f"has size {got} on axis {axis}, expected {expected}"
    return None
