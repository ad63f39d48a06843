"""`report.json`: what a corpus run made, as one typed record written by the merge and read by the
CLI, the HTML report, the audit and a resumed run (its JSON form is the contract's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.records import ModelRef, models_from_dict, models_to_dict


@dataclass(frozen=True)
class OpCounts:
    """An op's utterances in the outputs (`ok`) and left out of them (`failed`, filtered included)."""

    ok: int = 0
    failed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"ok": self.ok, "failed": self.failed}


@dataclass(frozen=True)
class MixedModel:
    """One of several models whose rows a role's outputs hold, and in how many shard files."""

    ref: ModelRef
    shards: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.ref.to_dict(), "shards": self.shards}


@dataclass
class RunReport:
    """`report.json`. `models`: the model each role's rows name most; `models_mixed`: every one,
    when a role's rows name more than one. The run's own numbers (`wall_seconds`, shards sent
    again or given up, `plan_fingerprint`) are set by the run after the merge; `extra` holds what
    the caller adds (`input`)."""

    utterances: int = 0
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    ops: dict[str, OpCounts] = field(default_factory=dict)
    models: dict[str, ModelRef] = field(default_factory=dict)
    models_mixed: dict[str, list[MixedModel]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    filters: dict[str, Any] | None = None
    resubmitted_shards: int | None = None
    given_up_shards: int | None = None
    remerge_wall_seconds: float | None = None
    plan_fingerprint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def filtered_utterances(self) -> int:
        return int((self.filters or {}).get("filtered_utterances") or 0)

    def sha256s(self) -> dict[str, set[str]]:
        """{role: every model the merged rows name} (`models` and `models_mixed`; a batch file counts
        as its single-clip twin)."""
        found: dict[str, set[str]] = {}
        for role, ref in self.models.items():
            found.setdefault(role, set()).add(ref.model_sha256)
        for role, refs in self.models_mixed.items():
            found.setdefault(role, set()).update(mixed.ref.model_sha256 for mixed in refs)
        return {role: shas - {""} for role, shas in found.items() if shas - {""}}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "utterances": self.utterances,
            "audio_seconds": self.audio_seconds,
            "wall_seconds": self.wall_seconds,
            "ops": {op: counts.to_dict() for op, counts in self.ops.items()},
            "models": models_to_dict(self.models),
        }
        if self.models_mixed:
            out["models_mixed"] = {
                role: [mixed.to_dict() for mixed in refs] for role, refs in self.models_mixed.items()
            }
        out["stats"] = self.stats
        out["provenance"] = self.provenance
        optional = {
            "filters": self.filters,
            "resubmitted_shards": self.resubmitted_shards,
            "given_up_shards": self.given_up_shards,
            "remerge_wall_seconds": self.remerge_wall_seconds,
            "plan_fingerprint": self.plan_fingerprint,
        }
        out.update({key: value for key, value in optional.items() if value is not None})
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        """A report as written (older files may lack the optional keys)."""
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        ops = data.get("ops") or {}
        mixed = {
            role: [MixedModel(ModelRef.from_dict(role, ref), int(ref.get("shards", 0))) for ref in refs]
            for role, refs in (data.get("models_mixed") or {}).items()
        }
        return cls(
            utterances=int(data.get("utterances", 0)),
            audio_seconds=float(data.get("audio_seconds", 0.0)),
            wall_seconds=float(data.get("wall_seconds", 0.0)),
            ops={op: OpCounts(int(c.get("ok", 0)), int(c.get("failed", 0))) for op, c in ops.items()},
            models=models_from_dict(data.get("models") or {}),
            models_mixed=mixed,
            stats=dict(data.get("stats") or {}),
            provenance=dict(data.get("provenance") or {}),
            filters=data.get("filters"),
            resubmitted_shards=data.get("resubmitted_shards"),
            given_up_shards=data.get("given_up_shards"),
            remerge_wall_seconds=data.get("remerge_wall_seconds"),
            plan_fingerprint=data.get("plan_fingerprint"),
            extra={key: value for key, value in data.items() if key not in known},
        )
