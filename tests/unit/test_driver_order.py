"""The corpus driver submits the longest shards first (`workers.driver.longest_first`)."""

from __future__ import annotations

from pipeline.records import ShardSpec, Utterance
from workers.driver import longest_first


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
