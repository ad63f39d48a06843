"""Corpus runs on the broker: the record a driver publishes (with its TTL), and `voxmill status`
listing the runs in progress, read from a real Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import redis

from pipeline.records import ShardResult, ShardSpec, Utterance
from pipeline.run.hooks import Counts, RunRound
from pipeline.settings import Settings
from tests.conftest import voxmill, wait_for
from workers.observe.run_metrics import RUN_PROGRESS, RunObserver, publish_run_progress, runs_in_progress
from workers.observe.status import collect_status


def test_a_record_expires_with_its_ttl(redis_client: redis.Redis) -> None:
    publish_run_progress(redis_client, "gone-soon", {"run": "gone-soon", "started": 2.0}, ttl_s=1)
    publish_run_progress(redis_client, "stays", {"run": "stays", "started": 1.0}, ttl_s=60)
    assert [r["run"] for r in runs_in_progress(redis_client)] == ["stays", "gone-soon"]  # oldest first
    assert 0 < redis_client.ttl(RUN_PROGRESS.format(run="gone-soon")) <= 1
    wait_for(lambda: [r["run"] for r in runs_in_progress(redis_client)] == ["stays"], timeout_s=5)


def test_status_shows_a_run_in_progress_until_it_finishes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    def spec(shard: int, op: str) -> ShardSpec:
        return ShardSpec(
            shard, op, str(tmp_path), [Utterance(f"u{shard}", f"/c/u{shard}.wav", duration_s=60.0)]
        )

    header = SimpleNamespace(run="run-abc", source=Path("/corpora/librispeech"))
    planner = SimpleNamespace(header=header, ops=["tokenize", "embed"], planned=4, done=True)
    counts = Counts(n_ops=2, units_total=8, audio_total_s=240.0)
    observer = RunObserver(str(tmp_path / "out"), lambda: redis_client)
    observer.run_started()
    for op in planner.ops:  # shard 0 an earlier run did, shard 1 this one: 60 s of audio each op
        observer.shard_resumed(spec(0, op))
        observer.shard_done(spec(1, op), ShardResult(1, op, "", 1, 0, 60.0, 0.0), tmp_path / "unused")
    counts.units_done, counts.units_resumed, counts.audio_done_s = 4, 2, 120.0
    counts.started = time.monotonic() - 6.0  # 2 units in 6 s: 4 more take 12 s
    observer.shard_resubmitted(spec(1, "embed"))
    observer.round_ended(RunRound(counts, 3, planner))
    [run] = collect_status(redis_client)["runs"]
    assert run["run"] == "run-abc" and run["input"] == "/corpora/librispeech"
    assert run["utterances_done"] == 2 and run["utterances_total"] == 4 and run["audio_done_s"] == 60.0
    assert run["shards"] == {
        "planned": 8,
        "plan_complete": True,
        "done": 4,
        "done_before": 2,
        "in_flight": 3,
        "resubmitted": 1,
    }
    assert 11.0 < run["eta_s"] < 13.0
    assert 0 < redis_client.ttl(RUN_PROGRESS.format(run="run-abc")) <= 15

    env = Settings(broker_url=redis_url).to_env()
    shown = voxmill("status", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["runs"][0]["shards"]["in_flight"] == 3
    text = voxmill("status", env={**env, "COLUMNS": "80"}).stdout
    assert "corpus runs: 1 in progress" in text and "/corpora/librispeech" in text
    assert "2/4 utterances; audio 1.0 min of 4.0 min (this run); ETA 12 s" in text
    assert "shards 4/8 done (2 before), 3 in flight, 1 resubmitted" in text

    observer.run_ended()
    assert collect_status(redis_client)["runs"] == []
    assert "corpus runs" not in voxmill("status", env=env).stdout


def test_a_run_still_listing_has_no_totals_yet(redis_client: redis.Redis, tmp_path: Path) -> None:
    observer = RunObserver(str(tmp_path / "out"), lambda: redis_client)
    observer.run_started()
    listing = SimpleNamespace(header=None, ops=["embed"], planned=0, done=False)
    observer.round_ended(RunRound(Counts(n_ops=1), 0, listing))
    assert runs_in_progress(redis_client) == []  # no header yet: the run has no name to publish under
    listing.header, listing.planned = SimpleNamespace(run="run-new", source="/c"), 2
    observer.round_ended(RunRound(Counts(n_ops=1), 2, listing))
    [run] = runs_in_progress(redis_client)
    assert run["utterances_total"] is None and run["eta_s"] is None
    assert run["shards"]["planned"] == 2 and run["shards"]["plan_complete"] is False
