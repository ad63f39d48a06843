"""The corpus driver's plan: shards sized for the workers, the longest submitted first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.corpus import auto_shard_size
from pipeline.records import ShardSpec, Utterance
from pipeline.settings import Settings
from workers.corpus.driver import longest_first
from workers.corpus.plan import Plan, load_or_make_plan, read_utterances


def plan_for(
    source: Path, out: Path, ops: list[str], size: int, settings: Settings, workers: int | None
) -> Plan:
    return load_or_make_plan(read_utterances(source), source, out, ops, size, settings, workers)


def shard(number: int, *durations: float | None) -> ShardSpec:
    utts = [Utterance(f"u{number}-{i}", f"/d/{i}.wav", duration_s=d) for i, d in enumerate(durations)]
    return ShardSpec(shard=number, op="embed", out_dir="/out", utts=utts)


def test_longest_shards_come_first_and_ties_keep_plan_order() -> None:
    plan = [shard(0, 1.0, 1.0), shard(1, 5.0, 5.0), shard(2, 1.5), shard(3, 1.0, 1.0), shard(4, 20.0)]
    assert [s.shard for s in longest_first(plan)] == [4, 1, 0, 3, 2]


def test_unknown_durations_count_as_zero_and_the_plan_is_left_alone() -> None:
    plan = [shard(0, None, None), shard(1, 3.0), shard(2, None, 4.0)]
    ordered = longest_first(plan)
    assert [s.shard for s in ordered] == [2, 1, 0]
    assert [s.shard for s in plan] == [0, 1, 2]


def test_auto_shard_size_gives_every_worker_several_shards_up_to_the_largest() -> None:
    assert auto_shard_size(60, workers=2, largest=32) == 5  # 12 shards: 6 per worker
    assert auto_shard_size(240, workers=2, largest=32) == 20
    assert auto_shard_size(100_000, workers=2, largest=32) == 32
    assert auto_shard_size(3, workers=8, largest=32) == 1
    assert auto_shard_size(0, workers=2, largest=32) == 1


def test_an_automatic_plan_is_cut_for_the_workers_and_resumed_whatever_their_number(tmp_path: Path) -> None:
    audio = tmp_path / "audio"
    audio.mkdir()
    manifest = tmp_path / "corpus.jsonl"
    lines = []
    for i in range(60):
        path = audio / f"u{i:02d}.wav"
        sf.write(path, np.zeros(1600 * (1 + i % 5), dtype=np.float32), 16000)
        lines.append(json.dumps({"utt": f"u{i:02d}", "path": str(path)}))
    manifest.write_text("\n".join(lines) + "\n")
    settings = Settings(shard_size=32)
    out = tmp_path / "out"
    out.mkdir()
    plan = plan_for(manifest, out, ["embed"], 0, settings, workers=2)
    assert plan.shard_size == 5 and len(plan.specs) == 12
    resumed = plan_for(manifest, out, ["embed"], 0, settings, workers=8)
    assert resumed.specs == plan.specs  # plan.json reused: a resume never re-cuts the shards
    fixed = plan_for(manifest, tmp_path / "fixed", ["embed"], 16, settings, workers=2)
    assert [len(s.utts) for s in fixed.specs] == [16, 16, 16, 12]
    unknown = plan_for(manifest, tmp_path / "remote", ["embed"], 0, settings, workers=None)
    assert unknown.shard_size == 32
