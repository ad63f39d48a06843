"""What a merge counts as the shards stream by (report.json's counts, models and statistics) and
the per-speaker embedding sums: constant memory whatever the corpus size."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from pipeline.outputs.report import MixedModel, OpCounts, RunReport
from pipeline.outputs.writers import SPK_EMBEDDINGS_SCHEMA, shard_models
from pipeline.records import ModelRef


@dataclass
class SpeakerSums:
    """Per speaker, in order of first appearance: the float64 sum of its embeddings and their count."""

    sums: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, spks: Sequence[str], vectors: npt.NDArray[np.float32]) -> None:
        for spk, vector in zip(spks, vectors.astype(np.float64), strict=True):
            if spk in self.sums:
                self.sums[spk] += vector
                self.counts[spk] += 1
            else:
                self.sums[spk] = vector.copy()
                self.counts[spk] = 1

    def table(self) -> pa.Table:
        spks = list(self.sums)
        if not spks:  # every utterance failed or was filtered out
            return SPK_EMBEDDINGS_SCHEMA.empty_table()
        counts = np.array([self.counts[s] for s in spks], dtype=np.int64)
        dim = len(next(iter(self.sums.values())))
        sums = np.array([self.sums[s] for s in spks], dtype=np.float64).reshape(len(spks), dim)
        means = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(means.reshape(-1), type=pa.float32()), dim)
        columns = {"spk": spks, "embedding": vectors.cast(pa.list_(pa.float32())), "num_utts": counts}
        return pa.Table.from_pydict(columns, schema=SPK_EMBEDDINGS_SCHEMA)


class StatHistograms:
    """Fixed-bin histograms of the quality statistics: their percentiles in constant memory."""

    BINS: dict[str, tuple[float, float, float]] = {  # name: (low, high, bin width)
        "duration_s": (0.0, 3600.0, 0.01),
        "speech_s": (0.0, 3600.0, 0.01),
        "speech_ratio": (0.0, 1.0, 0.001),
        "rms_dbfs": (-150.0, 0.0, 0.1),
        "peak_dbfs": (-150.0, 0.0, 0.1),
        "clipped_fraction": (0.0, 1.0, 0.0001),
    }
    QUANTILES = (0.05, 0.5, 0.95)

    def __init__(self) -> None:
        self.counts = {
            name: np.zeros(round((hi - lo) / w) + 1, dtype=np.int64)
            for name, (lo, hi, w) in self.BINS.items()
        }

    def add(self, stats: pa.Table) -> None:
        for name, (low, _, width) in self.BINS.items():
            column = stats.column(name)
            values = np.asarray(column.drop_null() if column.null_count else column, dtype=np.float64)
            bins = np.clip(np.round((values - low) / width), 0, len(self.counts[name]) - 1).astype(np.int64)
            found = np.bincount(bins)  # up to the largest bin only: not a 360k-bin array per shard
            self.counts[name][: len(found)] += found

    def percentiles(self) -> dict[str, dict[str, float | int | None]]:
        out: dict[str, dict[str, float | int | None]] = {}
        for name, (low, _, width) in self.BINS.items():
            counts = self.counts[name]
            total = int(counts.sum())
            row: dict[str, float | int | None] = {"count": total}
            cumulative = np.cumsum(counts)
            for q in self.QUANTILES:
                index = int(np.searchsorted(cumulative, q * total, side="left")) if total else None
                row[f"p{round(q * 100)}"] = None if index is None else round(low + index * width, 6)
            out[name] = row
        return out


@dataclass
class Tally:
    """What report.json counts, as the shards stream by."""

    ops: list[str] = field(default_factory=list)
    utterances: int = 0
    audio_seconds: float = 0.0
    filtered: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    model_votes: dict[str, dict[str, int]] = field(default_factory=dict)
    histograms: StatHistograms = field(default_factory=StatHistograms)

    def add(self, op: str, rows: int, ok: int) -> None:
        """One op of a shard: `ok` of its `rows` go into the outputs (the rest failed or were filtered)."""
        counts = self.counts.setdefault(op, {"ok": 0, "failed": 0})
        counts["ok"] += ok
        counts["failed"] += rows - ok

    def vote(self, table: pa.Table) -> None:
        """The models a shard file names, once per file."""
        for role, ref in shard_models(table).items():
            key = json.dumps(ref, sort_keys=True)
            votes = self.model_votes.setdefault(role, {})
            votes[key] = votes.get(key, 0) + 1

    def fill(self, report: RunReport) -> None:
        """The merge's part of `report`: counts, models, stats."""
        report.utterances = self.utterances
        report.audio_seconds = round(self.audio_seconds, 6)
        report.ops = {op: OpCounts(**self.counts.get(op, {"ok": 0, "failed": 0})) for op in self.ops}
        report.models = {role: refs[0].ref for role, refs in self.ranked_models().items()}
        report.models_mixed = {role: refs for role, refs in self.ranked_models().items() if len(refs) > 1}
        report.stats = self.histograms.percentiles()

    def ranked_models(self) -> dict[str, list[MixedModel]]:
        """{role: each model its rows name, with its shard files, most first (first seen wins ties)}.

        A batch file and its single-clip twin are one model: named by the batch file's ref (whose
        `twin_sha256` names the other), its shard files counted once each.
        """
        ranked: dict[str, list[MixedModel]] = {}
        for role, votes in self.model_votes.items():
            by_model: dict[str, MixedModel] = {}
            for key, n in votes.items():
                ref = ModelRef.from_dict(role, json.loads(key))
                seen = by_model.get(ref.model_sha256)
                if seen is None:
                    by_model[ref.model_sha256] = MixedModel(ref, n)
                else:
                    named = ref if ref.twin_sha256 and not seen.ref.twin_sha256 else seen.ref
                    by_model[ref.model_sha256] = MixedModel(named, seen.shards + n)
            ranked[role] = sorted(by_model.values(), key=lambda mixed: -mixed.shards)
        return ranked

    def provenance(self) -> dict[str, Any]:
        """What produced the outputs: voxmill, each model (file, sha256, provider actually used,
        ONNX Runtime), the front-end (`pipeline.features.frontend_parameters`)."""
        from importlib.metadata import PackageNotFoundError, version

        from pipeline.features import frontend_parameters

        try:
            voxmill = version("voxmill")
        except PackageNotFoundError:  # run from a source tree that was never installed
            voxmill = "unknown"
        models = {role: refs[0].ref.to_dict() for role, refs in self.ranked_models().items()}
        return {
            "voxmill": voxmill,
            "models": models,
            "providers": {role: ref.get("provider", "") for role, ref in models.items()},
            "onnxruntime": sorted({ref["onnxruntime"] for ref in models.values() if ref.get("onnxruntime")}),
            "frontend": frontend_parameters(),
        }


def speaker_means(spks: Sequence[str], embeddings: npt.NDArray[np.floating[Any]]) -> pa.Table:
    """Mean embedding per speaker (as CosyVoice's spk2embedding), speakers in order of appearance.

    `spks[i]` is the speaker of row `embeddings[i]` ([rows, dim]); the mean is taken in float64
    and stored as float32.
    """
    sums = SpeakerSums()
    sums.add(spks, np.asarray(embeddings, dtype=np.float32))
    return sums.table()
