"""Shard files and the merged outputs of `voxmill extract`, every file written atomically.

A shard file (`shards/{op}-{shard:06d}.parquet`) holds one row per utterance of its `ShardSpec`, in
the spec's order: `utt`, `spk` (string), `audio_seconds` (float64, null on error), `speech_token`
(list<int32>), `embedding` (list<float32>; both null when failed or when the op has no such output),
`error_code`, `error_message` (string, null on success). The schema metadata key `voxmill.models`
holds the models used as JSON `{role: {"file", "sha256"}}`.

Every file is written to `.{name}.tmp-{pid}-{random}` in its own folder, fsynced and renamed over
the final name, so a file is complete or absent and a redelivered shard simply overwrites identical
data. `merge_outputs` reads the shard files of a plan and writes the contract's outputs (DESIGN.md,
"Output of extract"), each utterance exactly once per op.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import INTERNAL, OUTPUT_ERROR, VoxmillError
from pipeline.records import OPS, ShardSpec, TaskResult

MODELS_METADATA_KEY = b"voxmill.models"
SHARDS_DIR = "shards"
SPEECH_TOKENS_FILE = "speech_tokens.parquet"
UTT_EMBEDDINGS_FILE = "utt_embeddings.parquet"
SPK_EMBEDDINGS_FILE = "spk_embeddings.parquet"
ERRORS_FILE = "errors.jsonl"
REPORT_FILE = "report.json"
TOKEN_OPS = frozenset({"tokenize", "extract"})
EMBEDDING_OPS = frozenset({"embed", "extract"})

SHARD_SCHEMA = pa.schema(
    [
        ("utt", pa.string()),
        ("spk", pa.string()),
        ("audio_seconds", pa.float64()),
        ("speech_token", pa.list_(pa.int32())),
        ("embedding", pa.list_(pa.float32())),
        ("error_code", pa.string()),
        ("error_message", pa.string()),
    ]
)
SPEECH_TOKENS_SCHEMA = pa.schema([("utt", pa.string()), ("speech_token", pa.list_(pa.int32()))])
UTT_EMBEDDINGS_SCHEMA = pa.schema(
    [("utt", pa.string()), ("spk", pa.string()), ("embedding", pa.list_(pa.float32()))]
)
SPK_EMBEDDINGS_SCHEMA = pa.schema(
    [("spk", pa.string()), ("embedding", pa.list_(pa.float32())), ("num_utts", pa.int64())]
)

Models = dict[str, dict[str, str]]


# --------------------------------------------------------------------------- atomic files


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` complete or not at all: temp file in the same folder, fsync, `os.replace`.

    Any OS or Arrow failure (disk full, unwritable folder) becomes `VoxmillError("output_error")`
    and the temporary file is removed.
    """
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except (OSError, pa.ArrowException) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VoxmillError(OUTPUT_ERROR, f"cannot write {path}: {reason}") from exc
    _fsync_dir(path.parent)


def write_parquet(path: Path, table: pa.Table) -> None:
    """Write a table as one parquet file, atomically."""
    atomic_write(path, lambda stream: pq.write_table(table, stream))


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text, atomically."""
    atomic_write(path, lambda stream: stream.write(text.encode("utf-8")))


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (best effort: not every file system lets a folder be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- shard files


def shard_path(out_dir: Path, op: str, shard: int) -> Path:
    """Where the file of (op, shard) lives: `out_dir/shards/{op}-{shard:06d}.parquet`."""
    return Path(out_dir) / SHARDS_DIR / f"{op}-{shard:06d}.parquet"


def write_shard(out_dir: Path, spec: ShardSpec, results: list[TaskResult]) -> Path:
    """Write the shard file of `spec` (`results[i]` belongs to `spec.utts[i]`); returns its path."""
    if len(results) != len(spec.utts):
        raise VoxmillError(
            INTERNAL, f"shard {spec.name}: {len(results)} results for {len(spec.utts)} utterances"
        )
    table = shard_table(spec, results)
    path = shard_path(out_dir, spec.op, spec.shard)
    write_parquet(path, table)
    return path


def shard_table(spec: ShardSpec, results: Sequence[TaskResult]) -> pa.Table:
    """The shard's rows as a table of `SHARD_SCHEMA`, the models in the schema metadata."""
    tokens = spec.op in TOKEN_OPS
    embeds = spec.op in EMBEDDING_OPS
    columns: dict[str, list[Any]] = {name: [] for name in SHARD_SCHEMA.names}
    for utt, result in zip(spec.utts, results, strict=True):
        error = result.error
        columns["utt"].append(utt.utt)
        columns["spk"].append(utt.spk)
        columns["audio_seconds"].append(None if error else result.audio_seconds)
        columns["speech_token"].append(result.speech_token if tokens and not error else None)
        columns["embedding"].append(result.embedding if embeds and not error else None)
        columns["error_code"].append(error.get("code", INTERNAL) if error else None)
        columns["error_message"].append(error.get("message", "") if error else None)
    metadata = {MODELS_METADATA_KEY: json.dumps(_models_of(results), sort_keys=True).encode()}
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA.with_metadata(metadata))


def _models_of(results: Iterable[TaskResult]) -> Models:
    """{role: {"file", "sha256"}} of the successful results (the first model seen per role)."""
    models: Models = {}
    for result in results:
        if result.error is None:
            for role, ref in result.models.items():
                models.setdefault(role, {"file": str(ref["file"]), "sha256": str(ref["sha256"])})
    return models


def read_shard(path: Path) -> pa.Table:
    """Read a shard file; a missing or unreadable one is `VoxmillError("output_error")`."""
    try:
        return pq.read_table(path)
    except FileNotFoundError as exc:
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} is missing") from exc
    except (OSError, pa.ArrowException) as exc:
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} cannot be read: {exc}") from exc


def shard_models(table: pa.Table) -> Models:
    """The models recorded in a shard table's schema metadata ({} when none)."""
    raw = (table.schema.metadata or {}).get(MODELS_METADATA_KEY)
    if not raw:
        return {}
    models: Models = json.loads(raw)
    return models


def shard_counts(path: Path) -> tuple[int, int]:
    """(ok, failed) row counts of a shard file."""
    codes = read_shard(path).column("error_code")
    failed = len(codes) - codes.null_count
    return codes.null_count, failed


# --------------------------------------------------------------------------- merging


@dataclass
class _Merged:
    """What `merge_outputs` gathers from the shard files: kept rows as Arrow tables, per op."""

    tables: dict[str, list[pa.Table]] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    seen: dict[str, set[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    utts: dict[str, None] = field(default_factory=dict)
    model_votes: dict[str, dict[str, int]] = field(default_factory=dict)

    def rows(self, op: str) -> pa.Table:
        """The kept rows of `op`, in merge order (no schema metadata)."""
        tables = self.tables.get(op) or [SHARD_SCHEMA.empty_table()]
        return pa.concat_tables([t.replace_schema_metadata(None) for t in tables])


def merge_outputs(
    out_dir: Path,
    specs: list[ShardSpec],
    report_extra: dict[str, Any],
    utt_order: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Merge the shard files of `specs` into the contract's outputs in `out_dir`; returns the report.

    Writes `speech_tokens.parquet` (ops tokenize/extract), `utt_embeddings.parquet` and
    `spk_embeddings.parquet` (ops embed/extract), `errors.jsonl` and, last, `report.json`. Rows
    follow `utt_order` (the corpus order) when given, else the specs sorted by shard (ops within a
    shard in the order of `OPS`), then position; each (utt, op) counts once even if it appears in
    more than one shard. A missing shard file is `VoxmillError("output_error")`. Features stay in
    Arrow columns throughout, so a corpus of millions of utterances merges in bounded memory.
    """
    out_dir = Path(out_dir)
    ordered = sorted(specs, key=_spec_order)
    merged = _Merged()
    for spec in ordered:
        path = shard_path(out_dir, spec.op, spec.shard)
        _merge_shard(merged, spec, path, read_shard(path))
    ops = list(dict.fromkeys(spec.op for spec in ordered))
    rank = _ranker(utt_order)
    _write_feature_files(out_dir, merged, ops, rank)
    if utt_order is not None:
        order = {utt: index for index, utt in enumerate(utt_order)}
        merged.errors.sort(key=lambda e: order.get(e["utt"], len(order)))
    errors = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in merged.errors)
    write_text(out_dir / ERRORS_FILE, errors)
    report = _report(merged, ops)
    report.update(report_extra)
    write_text(out_dir / REPORT_FILE, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def _spec_order(spec: ShardSpec) -> tuple[int, int, str]:
    """Merge order: by shard, then ops in their canonical order (tokenize, embed, extract)."""
    rank = OPS.index(spec.op) if spec.op in OPS else len(OPS)
    return spec.shard, rank, spec.op


def _ranker(utt_order: Sequence[str] | None) -> Callable[[pa.Table], pa.Table]:
    """A function putting a table's rows in corpus order (rows of unknown utts last, stably)."""
    if utt_order is None:
        return lambda table: table
    order = pa.array(list(utt_order), type=pa.string())

    def rank(table: pa.Table) -> pa.Table:
        positions = pc.fill_null(pc.index_in(table.column("utt"), value_set=order), len(order))
        return table.take(pc.sort_indices(positions, sort_keys=[("", "ascending")]))

    return rank


def _merge_shard(merged: _Merged, spec: ShardSpec, path: Path, table: pa.Table) -> None:
    """Fold one shard file into `merged`, skipping (utt, op) pairs seen in an earlier shard."""
    utts = table.column("utt").to_pylist()
    present = set(utts)
    for utt in spec.utts:
        merged.utts.setdefault(utt.utt)
        if utt.utt not in present:
            raise VoxmillError(
                OUTPUT_ERROR, f"shard file {path} has no row for utt {utt.utt!r} (written by another plan?)"
            )
    seen = merged.seen.setdefault(spec.op, set())
    keep = [utt not in seen for utt in utts]
    seen.update(utts)
    kept = table.filter(pa.array(keep, type=pa.bool_())) if not all(keep) else table
    merged.tables.setdefault(spec.op, []).append(kept)
    _count_rows(merged, spec.op, kept)
    for role, ref in shard_models(table).items():
        key = json.dumps(ref, sort_keys=True)
        votes = merged.model_votes.setdefault(role, {})
        votes[key] = votes.get(key, 0) + 1


def _count_rows(merged: _Merged, op: str, kept: pa.Table) -> None:
    """Counts, audio seconds and error records of a shard's kept rows."""
    codes = kept.column("error_code")
    counts = merged.counts.setdefault(op, {"ok": 0, "failed": 0})
    counts["ok"] += codes.null_count
    counts["failed"] += len(codes) - codes.null_count
    for utt, seconds in zip(
        kept.column("utt").to_pylist(), kept.column("audio_seconds").to_pylist(), strict=True
    ):
        if seconds is not None:
            merged.seconds.setdefault(utt, float(seconds))
    if len(codes) > codes.null_count:
        failed = kept.filter(pc.is_valid(codes)).select(["utt", "error_code", "error_message"])
        for row in failed.to_pylist():
            message = row["error_message"] or ""
            merged.errors.append({"utt": row["utt"], "op": op, "code": row["error_code"], "message": message})


def _write_feature_files(
    out_dir: Path, merged: _Merged, ops: Sequence[str], rank: Callable[[pa.Table], pa.Table]
) -> None:
    """Write the parquet outputs of the ops that ran, from the rows that succeeded."""
    token_op = next((op for op in ops if op in TOKEN_OPS), None)
    if token_op is not None:
        ok = _succeeded(merged.rows(token_op))
        write_parquet(
            out_dir / SPEECH_TOKENS_FILE,
            rank(ok.select(SPEECH_TOKENS_SCHEMA.names)).cast(SPEECH_TOKENS_SCHEMA),
        )
    embed_op = next((op for op in ops if op in EMBEDDING_OPS), None)
    if embed_op is not None:
        ok = rank(_succeeded(merged.rows(embed_op)).select(UTT_EMBEDDINGS_SCHEMA.names))
        write_parquet(out_dir / UTT_EMBEDDINGS_FILE, ok.cast(UTT_EMBEDDINGS_SCHEMA))
        vectors = _matrix(ok.column("embedding"))
        write_parquet(out_dir / SPK_EMBEDDINGS_FILE, speaker_means(ok.column("spk").to_pylist(), vectors))


def _succeeded(table: pa.Table) -> pa.Table:
    return table.filter(pc.is_null(table.column("error_code")))


def _matrix(column: pa.ChunkedArray) -> npt.NDArray[np.float32]:
    """A list<float32> column of equal-length rows as a float32 matrix [rows, dim]."""
    if len(column) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    flat = np.asarray(pc.list_flatten(column), dtype=np.float32)
    return flat.reshape(len(column), -1)


def speaker_means(spks: Sequence[str], embeddings: npt.NDArray[np.floating[Any]]) -> pa.Table:
    """Mean embedding per speaker (as CosyVoice's spk2embedding), speakers in order of appearance.

    `spks[i]` is the speaker of row `embeddings[i]` ([rows, dim]); the mean is taken in float64
    and stored as float32.
    """
    codes: dict[str, int] = {}
    index = np.fromiter((codes.setdefault(spk, len(codes)) for spk in spks), dtype=np.int64, count=len(spks))
    counts = np.bincount(index, minlength=len(codes))
    dim = embeddings.shape[1] if embeddings.ndim == 2 else 0
    sums = np.zeros((len(codes), dim), dtype=np.float64)
    np.add.at(sums, index, embeddings.astype(np.float64))
    means = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(means.reshape(-1), type=pa.float32()), dim)
    columns = {"spk": list(codes), "embedding": vectors.cast(pa.list_(pa.float32())), "num_utts": counts}
    return pa.Table.from_pydict(columns, schema=SPK_EMBEDDINGS_SCHEMA)


def _report(merged: _Merged, ops: Sequence[str]) -> dict[str, Any]:
    """The contract's report.json fields (wall_seconds 0.0 until the caller's extra replaces it)."""
    report: dict[str, Any] = {
        "utterances": len(merged.utts),
        "audio_seconds": round(sum(merged.seconds.values()), 6),
        "wall_seconds": 0.0,
        "ops": {op: dict(merged.counts.get(op, {"ok": 0, "failed": 0})) for op in ops},
        "models": {},
    }
    mixed: dict[str, list[dict[str, Any]]] = {}
    for role, votes in merged.model_votes.items():
        ranked = sorted(votes.items(), key=lambda kv: -kv[1])  # stable: first seen wins ties
        report["models"][role] = json.loads(ranked[0][0])
        if len(ranked) > 1:
            mixed[role] = [{**json.loads(key), "shards": n} for key, n in ranked]
    if mixed:
        report["models_mixed"] = mixed
    return report
