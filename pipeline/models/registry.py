"""The registry of known models (`config/models.yaml`), returned as records.

A model file is recognised first by its sha256, then by its name. A CosyVoice model folder
(`pretrained_models/CosyVoice2-0.5B`) is recognised as it is: the tokenizer is its
`speech_tokenizer_v*.onnx` (the highest version when several), the embedder `campplus.onnx`.
A role may also have batch files (`batch_file_glob`: CosyVoice's `speech_tokenizer_v2.batch.onnx`
beside `speech_tokenizer_v2.onnx`): a file of the role, of its single file's variant, that never
serves in its place.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.settings import PROJECT_ROOT

DEFAULT_REGISTRY = PROJECT_ROOT / "config" / "models.yaml"
BATCH_SUFFIX = ".batch.onnx"  # CosyVoice names the batch twin of `X.onnx` `X.batch.onnx`


def batch_name(file_name: str) -> str:
    """The batch twin's name of a single-clip model file: `a.onnx` -> `a.batch.onnx`."""
    return file_name.removesuffix(".onnx") + BATCH_SUFFIX


def single_name(file_name: str) -> str:
    """The single-clip file a batch file is the twin of: `a.batch.onnx` -> `a.onnx` (others unchanged)."""
    if file_name.endswith(BATCH_SUFFIX):
        return file_name.removesuffix(BATCH_SUFFIX) + ".onnx"
    return file_name


@dataclass(frozen=True)
class TensorSpec:
    """What one input or output must declare: rank, dtype (or dtype kind) and fixed dims."""

    rank: int | None = None
    dtype: str | None = None
    dtype_kind: str | None = None
    dims: tuple[int | None, ...] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        dims = data.get("dims")
        return cls(
            rank=data.get("rank"),
            dtype=data.get("dtype"),
            dtype_kind=data.get("dtype_kind"),
            dims=None if dims is None else tuple(dims),
        )


@dataclass(frozen=True)
class Variant:
    """One known model file, e.g. the CosyVoice2 tokenizer (`v2`)."""

    name: str
    file: str
    description: str = ""
    sha256: str | None = None
    token_rate_hz: int | None = None
    embedding_dim: int | None = None


@dataclass(frozen=True)
class RoleSpec:
    """Everything voxmill knows about one model role (`tokenizer`, `embedder`)."""

    role: str
    op: str
    file_glob: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    profiles: dict[str, tuple[int, ...]] = field(default_factory=dict)
    variants: tuple[Variant, ...] = ()
    batch_glob: str | None = None
    batch_profiles: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def matches_name(self, file_name: str) -> bool:
        """A file of this role: the one that serves, or a batch file."""
        return fnmatch.fnmatch(file_name, self.file_glob) or self.is_batch_name(file_name)

    def is_batch_name(self, file_name: str) -> bool:
        return self.batch_glob is not None and fnmatch.fnmatch(file_name, self.batch_glob)

    def for_file(self, file_name: str) -> RoleSpec:
        """The spec a file loads with: a batch file's TensorRT shapes are `batch_profiles`."""
        if self.is_batch_name(file_name) and self.batch_profiles:
            return replace(self, profiles=self.batch_profiles)
        return self

    def serves_name(self, file_name: str) -> bool:
        """A file that may serve the role (the batch glob is inside the file glob: excluded)."""
        return fnmatch.fnmatch(file_name, self.file_glob) and not self.is_batch_name(file_name)


@dataclass(frozen=True)
class Identified:
    """How a file was recognised: its variant and whether by `sha256` or by `name`."""

    role: str
    variant: Variant
    by: str


@dataclass(frozen=True)
class Registry:
    """All roles, loaded from YAML."""

    roles: dict[str, RoleSpec]

    @classmethod
    def load(cls, path: Path | None = None) -> Registry:
        data = yaml.safe_load((path or DEFAULT_REGISTRY).read_text())
        roles = {name: _role_from_dict(name, spec) for name, spec in data["roles"].items()}
        return cls(roles=roles)

    def role(self, role: str) -> RoleSpec:
        if role not in self.roles:
            raise VoxmillError(
                errors.BAD_REQUEST, f"unknown model role {role!r}; known: {sorted(self.roles)}"
            )
        return self.roles[role]

    def identify(self, role: str, file_name: str, sha256: str) -> Identified:
        """Recognise a file: by sha256 among all variants of the role, else by its file name.

        A batch file is of its single file's variant (`speech_tokenizer_v2.batch.onnx`: v2).
        """
        spec = self.role(role)
        for variant in spec.variants:
            if variant.sha256 and variant.sha256 == sha256:
                return Identified(role, variant, "sha256")
        name = single_name(file_name) if spec.is_batch_name(file_name) else file_name
        for variant in spec.variants:
            if variant.file == name:
                return Identified(role, variant, "name")
        if spec.matches_name(file_name) and spec.variants:
            return Identified(role, spec.variants[-1], "name")
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{file_name} is not a known {role} model (expected a file named like {spec.file_glob})",
        )

    def find_model(self, role: str, model_dir: Path) -> Path:
        """The file in `model_dir` that serves `role` (newest tokenizer version when several)."""
        spec = self.role(role)
        if not model_dir.is_dir():
            raise VoxmillError(errors.NOT_FOUND, f"model folder {model_dir} does not exist")
        candidates = sorted(p for p in model_dir.iterdir() if spec.serves_name(p.name) and p.is_file())
        if not candidates:
            raise VoxmillError(
                errors.NOT_FOUND,
                f"no {role} model ({spec.file_glob}) in {model_dir}; "
                f"create stand-ins with `voxmill models make-standin --out {model_dir}`",
            )
        return candidates[-1]

    def find_batch_model(self, role: str, model_dir: Path) -> Path | None:
        """The batch twin of the file that serves `role` in `model_dir`, if the folder has one.

        Only the twin (`batch_name`) counts: another version's batch file is another model.
        Raises as `find_model` when the role has no file to serve.
        """
        served = self.find_model(role, model_dir)
        twin = served.with_name(batch_name(served.name))
        return twin if self.role(role).is_batch_name(twin.name) and twin.is_file() else None

    def role_of_file(self, file_name: str) -> str | None:
        """The role a file name serves, if any (the watcher's question: a batch file serves none yet)."""
        for spec in self.roles.values():
            if spec.serves_name(file_name):
                return spec.role
        return None


def _role_from_dict(role: str, data: dict[str, Any]) -> RoleSpec:
    signature = data.get("signature", {})
    variants = tuple(
        Variant(
            name=name,
            file=v["file"],
            description=v.get("description", ""),
            sha256=v.get("sha256"),
            token_rate_hz=v.get("token_rate_hz"),
            embedding_dim=v.get("embedding_dim"),
        )
        for name, v in data.get("variants", {}).items()
    )
    return RoleSpec(
        role=role,
        op=data["op"],
        file_glob=data["file_glob"],
        inputs=tuple(TensorSpec.from_dict(t) for t in signature.get("inputs", [])),
        outputs=tuple(TensorSpec.from_dict(t) for t in signature.get("outputs", [])),
        profiles={k: tuple(v) for k, v in data.get("profiles", {}).items()},
        variants=variants,
        batch_glob=data.get("batch_file_glob"),
        batch_profiles={k: tuple(v) for k, v in data.get("batch_profiles", {}).items()},
    )
