"""A listing cut into shards as it streams by: how many utterances a shard holds, and its digest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import OPS, Utterance


@dataclass
class ShardCutter:
    """Cuts a listing into shards of `shard_size` utterances, in listing order, as it streams by.

    Shard k holds listing positions [k * size, (k + 1) * size): the plan of a listing depends on
    nothing else, so the same listing gives the same shards whatever happened before.
    """

    shard_size: int
    next_shard: int = 0
    pending: list[Utterance] = field(default_factory=list)

    def add(self, utt: Utterance) -> list[Utterance] | None:
        """Take one utterance; the utterances of a full shard when this one completes it."""
        self.pending.append(utt)
        if len(self.pending) < self.shard_size:
            return None
        return self._cut()

    def rest(self) -> list[Utterance] | None:
        """The last, shorter shard, if any."""
        return self._cut() if self.pending else None

    def _cut(self) -> list[Utterance]:
        utts, self.pending = self.pending, []
        self.next_shard += 1
        return utts


def auto_shard_size(n_utts: int, workers: int, largest: int, shards_per_worker: int = 6) -> int:
    """Utterances per shard: `largest`, or fewer so each worker process gets `shards_per_worker` shards.

    A run ends when its last shard does: with few large shards one process finishes while the
    others still work on theirs. A small corpus is therefore cut finer (60 clips over 2 processes:
    shards of 5 instead of 2 shards of 32); a large one keeps shards of `largest`.
    """
    wanted = -(-n_utts // max(1, workers * shards_per_worker))  # ceiling division
    return max(1, min(largest, wanted))


def shard_size_for_durations(mean_s: float, smallest: int, seconds: float, largest: int) -> int:
    """Utterances per shard when the listing gives durations: `smallest`, or more for short clips,
    so that a shard holds about `seconds` of audio (at most `largest` utterances).

    A shard pays a fixed cost (its task, its file, the driver's bookkeeping) that matters only
    when its clips are short and the models fast (CHANGELOG 24).
    """
    if seconds <= 0 or mean_s <= 0:
        return smallest
    return max(smallest, min(largest, round(seconds / mean_s)))


def check_ops(ops: Sequence[str], shard_size: int) -> None:
    """Refuse unknown or repeated ops and a shard size below 1."""
    if shard_size < 1:
        raise VoxmillError(BAD_REQUEST, f"shard size must be at least 1, got {shard_size}")
    if not ops:
        raise VoxmillError(BAD_REQUEST, "no ops to plan")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise VoxmillError(BAD_REQUEST, f"unknown op(s) {unknown}; known: {list(OPS)}")
    if len(set(ops)) != len(ops):
        raise VoxmillError(BAD_REQUEST, f"ops repeat: {list(ops)}")


def shard_digest(utts: Sequence[Utterance]) -> str:
    """sha256 (hex) of a shard's utterances (utt, path, spk, text, and a segment's bounds and
    channel): what a resume compares. A whole-file utterance digests as before segments existed."""
    digest = hashlib.sha256()
    for u in utts:
        fields: list[Any] = [u.utt, u.path, u.spk, u.text]
        if u.is_segment:
            fields += [u.start_s, u.end_s, u.channel]
        digest.update(json.dumps(fields, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()
