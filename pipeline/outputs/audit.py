"""`voxmill audit`: re-extract a random sample of a finished run on the CPU reference path and
compare it with the stored rows, per model sha256.

`audit_run(rows_by_utt, paths_by_utt, model_dir, sample, seed, thresholds)` draws `sample`
utterances (`random.Random(seed)`, from those with a stored row and an audio path), decodes each
as a worker does (`load_audio`), runs the models of `model_dir` with ONNX Runtime on the CPU
(`Extractor`), and compares:

- tokens: the share of positions with the same token, over the longer of the two sequences (a
  length difference counts against it); 1.0 is identical;
- embeddings: the cosine similarity, in float64.

Results are grouped by (role, stored sha256). A group whose stored sha256 is the sha256 of the
model in `model_dir` (or unknown: a run written before rows carried it) is *judged*: every one of
its utterances must reach the threshold. A group produced by another model (a run spanning a hot
reload) is reported, not judged; a role none of whose sampled rows came from `model_dir`'s model
fails, as does an utterance that cannot be re-extracted (its file gone or changed). Why a
difference can be expected: docs/models.md, "Audit".
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER
from pipeline.settings import AudioLimits, Settings

UNKNOWN_SHA256 = "unknown"
# Per-row sha256 column names a merged output may carry (the merge's name first).
SHA256_COLUMNS = {
    ROLE_TOKENIZER: ("model_sha256", "tokenizer_sha256"),
    ROLE_EMBEDDER: ("model_sha256", "embedder_sha256"),
}
METRICS = {ROLE_TOKENIZER: "token_agreement", ROLE_EMBEDDER: "cosine"}


@dataclass(frozen=True)
class StoredRow:
    """What a finished run holds for one utterance, and the sha256 of the model behind each part."""

    utt: str
    speech_token: list[int] | None = None
    embedding: list[float] | None = None
    tokenizer_sha256: str | None = None
    embedder_sha256: str | None = None

    def sha256(self, role: str) -> str | None:
        return self.tokenizer_sha256 if role == ROLE_TOKENIZER else self.embedder_sha256

    def has(self, role: str) -> bool:
        return (self.speech_token if role == ROLE_TOKENIZER else self.embedding) is not None


@dataclass(frozen=True)
class AuditThresholds:
    """What every judged utterance must reach (settings `audit_min_token_agreement`, `audit_min_cosine`)."""

    min_token_agreement: float = 1.0
    min_cosine: float = 0.9999

    @classmethod
    def from_settings(cls, settings: Settings) -> AuditThresholds:
        return cls(settings.audit_min_token_agreement, settings.audit_min_cosine)

    def minimum(self, role: str) -> float:
        return self.min_token_agreement if role == ROLE_TOKENIZER else self.min_cosine


@dataclass
class ModelAudit:
    """The sampled utterances of one role whose stored rows name one model sha256."""

    role: str
    sha256: str
    judged: bool
    values: dict[str, float] = field(default_factory=dict)  # utt -> agreement or cosine
    file: str = ""  # the reference folder's file of this sha256 (its batch file, or the single one)

    def below(self, minimum: float) -> list[str]:
        return sorted(utt for utt, value in self.values.items() if value < minimum)

    def to_dict(self, minimum: float) -> dict[str, Any]:
        values = list(self.values.values())
        return {
            "role": self.role,
            "sha256": self.sha256,
            "file": self.file or None,
            "judged": self.judged,
            "metric": METRICS[self.role],
            "utterances": len(values),
            "min": round(min(values), 8) if values else None,
            "mean": round(float(np.mean(values)), 8) if values else None,
            "identical": sum(1 for v in values if v == 1.0) if self.role == ROLE_TOKENIZER else None,
            "below": self.below(minimum),
        }


@dataclass
class AuditReport:
    """What an audit found; `ok`/`verdict` say whether the run passes, `reasons` why not."""

    seed: int
    requested: int
    candidates: int
    sampled: list[str]
    thresholds: AuditThresholds
    reference: dict[str, dict[str, str]]
    models: list[ModelAudit]
    failures: list[dict[str, str]]
    reasons: list[str]

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def verdict(self) -> str:
        return "pass" if self.ok else "fail"

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "seed": self.seed,
            "sample_requested": self.requested,
            "candidates": self.candidates,
            "sampled": len(self.sampled),
            "utts": self.sampled,
            "thresholds": {
                "min_token_agreement": self.thresholds.min_token_agreement,
                "min_cosine": self.thresholds.min_cosine,
            },
            "reference": self.reference,
            "models": [m.to_dict(self.thresholds.minimum(m.role)) for m in self.models],
            "failures": self.failures,
            "reasons": self.reasons,
        }

    def lines(self) -> list[str]:
        """A short human summary: one line per model group, then the verdict and its reasons."""
        out = [f"audited {len(self.sampled)} of {self.candidates} utterances (seed {self.seed})"]
        for group in self.models:
            summary = group.to_dict(self.thresholds.minimum(group.role))
            tag = "" if group.judged else " (another model: not judged)"
            named = f" ({group.file})" if group.file else ""
            out.append(
                f"  {group.role} {group.sha256[:12]}{named}: {summary['utterances']} utts, "
                f"{summary['metric']} min {summary['min']} mean {summary['mean']}{tag}"
            )
        out.append(f"verdict: {self.verdict}")
        out += [f"  {reason}" for reason in self.reasons]
        return out


def token_agreement(stored: list[int], fresh: list[int]) -> float:
    """The share of equal tokens, position by position, over the longer sequence (1.0: identical)."""
    longest = max(len(stored), len(fresh))
    if longest == 0:
        return 1.0
    same = sum(1 for a, b in zip(stored, fresh, strict=False) if a == b)
    return same / longest


def cosine(stored: Iterable[float], fresh: Iterable[float]) -> float:
    """Cosine similarity in float64 (two zero vectors: 1.0; one: 0.0)."""
    a = np.asarray(list(stored), dtype=np.float64)
    b = np.asarray(list(fresh), dtype=np.float64)
    if a.shape != b.shape:
        return 0.0
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norms == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norms)


def draw_sample(candidates: Iterable[str], sample: int, seed: int) -> list[str]:
    """`sample` utterances drawn with `random.Random(seed)` from the sorted candidates (all if fewer)."""
    pool = sorted(set(candidates))
    chosen = random.Random(seed).sample(pool, min(max(sample, 0), len(pool)))
    return sorted(chosen)


def audit_run(
    rows_by_utt: Mapping[str, StoredRow],
    paths_by_utt: Mapping[str, str],
    model_dir: Path,
    sample: int,
    seed: int,
    thresholds: AuditThresholds,
    limits: AudioLimits | None = None,
) -> AuditReport:
    """Re-extract a sample of a run with `model_dir`'s models on the CPU and compare (module docstring)."""
    from pipeline.extractor import Extractor  # the inference stack, only when an audit runs
    from pipeline.models.files import hash_model_file

    candidates = [utt for utt in rows_by_utt if utt in paths_by_utt]
    sampled = draw_sample(candidates, sample, seed)
    roles = [
        role for role in (ROLE_TOKENIZER, ROLE_EMBEDDER) if any(rows_by_utt[u].has(role) for u in sampled)
    ]
    report = AuditReport(seed, sample, len(candidates), sampled, thresholds, {}, [], [], [])
    if not sampled:
        report.reasons.append("nothing to audit: no stored row has an audio path")
        return report
    with Extractor.from_model_dir(model_dir, provider="cpu", roles=roles, limits=limits) as extractor:
        report.reference = {role: extractor.sessions[role].ref.to_dict() for role in roles}
        for role, twin in batch_twins(model_dir, roles).items():  # the same model, batched
            report.reference[role].update(batch_file=twin.name, batch_sha256=hash_model_file(twin))
        groups: dict[tuple[str, str], ModelAudit] = {}
        for utt in sampled:
            _audit_one(extractor, utt, rows_by_utt[utt], paths_by_utt[utt], report, groups)
    report.models = sorted(groups.values(), key=lambda g: (g.role != ROLE_TOKENIZER, not g.judged, g.sha256))
    _judge(report)
    return report


def _audit_one(
    extractor: Any,
    utt: str,
    row: StoredRow,
    path: str,
    report: AuditReport,
    groups: dict[tuple[str, str], ModelAudit],
) -> None:
    """Re-extract one utterance and add its comparison to the group of each role it has."""
    try:
        wave = extractor.wave(path)
        fresh = {
            role: extractor.tokenize(wave) if role == ROLE_TOKENIZER else extractor.embed(wave)
            for role in report.reference
            if row.has(role)
        }
    except VoxmillError as exc:
        report.failures.append({"utt": utt, "code": exc.code, "message": exc.message})
        return
    for role, value in fresh.items():
        stored_sha = row.sha256(role) or UNKNOWN_SHA256
        reference = report.reference[role]
        files = {
            reference["sha256"]: reference["file"],
            reference.get("batch_sha256", ""): reference.get("batch_file", ""),
        }
        judged = stored_sha == UNKNOWN_SHA256 or stored_sha in files
        group = groups.setdefault(
            (role, stored_sha), ModelAudit(role, stored_sha, judged, file=files.get(stored_sha, ""))
        )
        if role == ROLE_TOKENIZER:
            group.values[utt] = token_agreement(row.speech_token or [], list(value))
        else:
            group.values[utt] = cosine(row.embedding or [], value.tolist())


def batch_twins(model_dir: Path, roles: Iterable[str]) -> dict[str, Path]:
    """{role: the batch twin of the file that serves it in `model_dir`}, for roles that have one."""
    from pipeline.models.registry import Registry

    registry = Registry.load()
    twins = {role: registry.find_batch_model(role, model_dir) for role in roles}
    return {role: path for role, path in twins.items() if path is not None}


def _judge(report: AuditReport) -> None:
    """The reasons the run fails, if any (an empty list passes)."""
    for failure in report.failures:
        report.reasons.append(
            f"{failure['utt']}: cannot re-extract ({failure['code']}: {failure['message']})"
        )
    for role in report.reference:
        judged = [g for g in report.models if g.role == role and g.judged and g.values]
        if not judged:
            sha = report.reference[role]["sha256"][:12]
            report.reasons.append(
                f"no sampled {role} row was produced by the model in the model folder ({sha}…)"
            )
        minimum = report.thresholds.minimum(role)
        for group in judged:
            below = group.below(minimum)
            if below:
                worst = min(group.values[u] for u in below)
                report.reasons.append(
                    f"{role} {group.sha256[:12]}: {len(below)} of {len(group.values)} utterances below "
                    f"{METRICS[role]} {minimum:g} (worst {worst:.6g}: {below[0]})"
                )


# --------------------------------------------------------------------------- reading a run


def paths_by_utt(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """{utt: path} of (utt, path) pairs; the same utt with two different paths is `bad_request`."""
    paths: dict[str, str] = {}
    for utt, path in pairs:
        known = paths.setdefault(str(utt), str(path))
        if known != str(path):
            raise VoxmillError(errors.BAD_REQUEST, f"utterance {utt!r} has two audio paths: {known}, {path}")
    return paths


def read_stored_rows(out_dir: RunFolder) -> dict[str, StoredRow]:
    """The rows of a finished run's outputs: `speech_tokens.parquet` and `utt_embeddings.parquet`.

    The sha256 of each row is its per-row column when the file has one (`model_sha256`, or the
    shard names `tokenizer_sha256` / `embedder_sha256`), else the run's model in `report.json`
    when the run used one model per role (unknown when it used several).
    """
    import pyarrow.parquet as pq

    fallback = _report_sha256(out_dir)
    tokens: dict[str, tuple[list[int], str | None]] = {}
    embeddings: dict[str, tuple[list[float], str | None]] = {}
    for file, role, column, into in (
        (RunFolder.SPEECH_TOKENS, ROLE_TOKENIZER, "speech_token", tokens),
        (RunFolder.UTT_EMBEDDINGS, ROLE_EMBEDDER, "embedding", embeddings),
    ):
        if not out_dir.location.exists(file):
            continue
        table = pq.read_table(out_dir.ref(file))
        sha_column = next((c for c in SHA256_COLUMNS[role] if c in table.column_names), None)
        utts = table.column("utt").to_pylist()
        values = table.column(column).to_pylist()
        shas = table.column(sha_column).to_pylist() if sha_column else [None] * len(utts)
        for utt, value, sha in zip(utts, values, shas, strict=True):
            into[utt] = (value, sha or fallback.get(role))
    rows: dict[str, StoredRow] = {}
    for utt in dict.fromkeys([*tokens, *embeddings]):
        token_row, embedding_row = tokens.get(utt), embeddings.get(utt)
        rows[utt] = StoredRow(
            utt=utt,
            speech_token=None if token_row is None else [int(t) for t in token_row[0]],
            embedding=None if embedding_row is None else [float(x) for x in embedding_row[0]],
            tokenizer_sha256=None if token_row is None else token_row[1],
            embedder_sha256=None if embedding_row is None else embedding_row[1],
        )
    return rows


def _report_sha256(out_dir: RunFolder) -> dict[str, str]:
    """{role: sha256} of the run's models from report.json, for roles that did not change mid-run."""
    try:
        report = RunReport.from_dict(json.loads(out_dir.location.read_bytes(RunFolder.REPORT)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, VoxmillError):
        return {}
    return {role: ref.sha256 for role, ref in report.models.items() if role not in report.models_mixed}
