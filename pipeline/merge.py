"""Merging a run's shard files into the outputs of `voxmill extract` (DESIGN.md, "Output of
extract"): `speech_tokens.parquet`, `utt_embeddings.parquet`, `spk_embeddings.parquet`,
`errors.jsonl` and `report.json`, each written atomically (`pipeline.writers`).

Apart from the shard files, because workers only write shards: they import `pipeline.writers`
at start, and never Arrow's compute functions, which only the merge needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import OUTPUT_ERROR, VoxmillError
from pipeline.records import OPS, ShardSpec
from pipeline.writers import (
    EMBEDDING_OPS,
    ERRORS_FILE,
    REPORT_FILE,
    SHARD_SCHEMA,
    SPEECH_TOKENS_FILE,
    SPEECH_TOKENS_SCHEMA,
    SPK_EMBEDDINGS_FILE,
    SPK_EMBEDDINGS_SCHEMA,
    TOKEN_OPS,
    UTT_EMBEDDINGS_FILE,
    UTT_EMBEDDINGS_SCHEMA,
    read_shard,
    shard_models,
    shard_path,
    write_parquet,
    write_text,
)


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
