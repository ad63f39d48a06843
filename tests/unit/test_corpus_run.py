"""A corpus run (`pipeline.run.corpus.run_corpus`) drives any `ShardQueue`: here workers in this
process that write each shard file when it is sent, with no broker at all. The Celery one is
tested end to end in tests/integration/test_extract.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pipeline.errors import NO_CONSUMER, RunError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_shard
from pipeline.records import ModelRef, ShardResult, ShardSpec, TaskResult, Utterance
from pipeline.run.corpus import CorpusRun, run_corpus
from pipeline.run.driver import CorpusDriver
from pipeline.run.hooks import RunHooks
from pipeline.run.plan import Planner, PlanProgress
from pipeline.run.shard_queue import ReadyWorkers
from pipeline.settings import Settings

EMBEDDER = {"embedder": ModelRef("embedder", "campplus.onnx", "c" * 64)}


class InProcessQueue:
    """Workers in this process: a shard sent is done at once, its file written and announced;
    `lose`: shards whose first attempt is lost (no file, no announcement)."""

    remote = False
    outage: tuple[type[Exception], ...] = (ConnectionError,)

    def __init__(self, out_dir: RunFolder, lose: Collection[int] = ()) -> None:
        self.out_dir = out_dir
        self.lose = set(lose)
        self.sent: list[tuple[str, int]] = []
        self.heard: list[ShardResult] = []
        self.run: str | None = None
        self.stopped: list[bool] = []
        self.give_up_at = time.monotonic() + 30.0

    def start(self) -> ReadyWorkers:
        return ReadyWorkers(2, False)

    @property
    def following(self) -> bool:
        return self.run is not None

    def follow(self, run: str) -> None:
        self.run = run

    def wait(self, timeout_s: float) -> list[ShardResult]:
        assert time.monotonic() < self.give_up_at, f"the run never ended: sent {self.sent}"
        heard, self.heard = self.heard, []
        if not heard:
            time.sleep(min(timeout_s, 0.01))
        return heard

    def submit(self, spec: ShardSpec, attempt: int) -> str:
        self.sent.append((spec.name, attempt))
        if attempt == 1 and spec.shard in self.lose:
            return f"{spec.name}-{attempt}"
        results = [
            TaskResult(u.utt, spec.op, embedding=[float(len(u.utt)), 1.0], audio_seconds=1.0, models=EMBEDDER)
            for u in spec.utts
        ]
        path = write_shard(self.out_dir, spec, results)
        self.heard.append(ShardResult(spec.shard, spec.op, str(path), len(results), 0, len(results), 0.01))
        return f"{spec.name}-{attempt}"

    def check(self, queues: Collection[str]) -> None:
        pass

    def require_consumer(self, queue: str, run_queues: Sequence[str]) -> None:
        if queue == "tokenize":
            raise RunError("no worker consumes the tokenize queue", NO_CONSUMER)

    def ready_workers(self) -> int:
        return 2

    def running_task_ids(self) -> frozenset[str]:
        return frozenset()

    def stop(self, completed: bool = False) -> None:
        self.stopped.append(completed)


class Told(RunHooks):
    def __init__(self) -> None:
        self.moments: list[str] = []

    def run_started(self) -> None:
        self.moments.append("started")

    def shard_resubmitted(self, spec: ShardSpec) -> None:
        self.moments.append(f"again {spec.name}")

    def run_ended(self) -> None:
        self.moments.append("ended")


def listing(tmp_path: Path, count: int) -> Path:
    manifest = tmp_path / "m.jsonl"
    rows = [{"utt": f"u{i:02d}", "path": str(tmp_path / f"u{i}.wav"), "duration": 1.0} for i in range(count)]
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return manifest


def test_a_run_drives_its_shards_through_the_queue_and_merges_them_in_listing_order(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    queue, hooks = InProcessQueue(out), Told()
    settings = Settings(run_state_dir=tmp_path / "state")
    report = run_corpus(
        CorpusRun(listing(tmp_path, 10), out, ["embed"], shard_size=4), queue, hooks, settings
    )
    assert sorted(queue.sent) == [("embed-000000", 1), ("embed-000001", 1), ("embed-000002", 1)]
    assert report.ops["embed"].ok == 10 and report.ops["embed"].failed == 0
    table = pq.read_table(tmp_path / "out" / "utt_embeddings.parquet")
    assert table.column("utt").to_pylist() == [f"u{i:02d}" for i in range(10)]
    assert hooks.moments == ["started", "ended"]
    assert queue.stopped[0] is True  # stopped as completed once every shard file existed


def test_a_shard_whose_task_was_lost_is_sent_again_once_late(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    queue, hooks = InProcessQueue(out, lose={1}), Told()
    settings = Settings(run_state_dir=tmp_path / "state", shard_deadline_min_s=0.5)
    report = run_corpus(CorpusRun(listing(tmp_path, 8), out, ["embed"], shard_size=4), queue, hooks, settings)
    assert queue.sent == [("embed-000000", 1), ("embed-000001", 1), ("embed-000001", 2)]
    assert hooks.moments == ["started", "again embed-000001", "ended"]
    assert report.resubmitted_shards == 1 and report.ops["embed"].ok == 8


def test_a_new_plan_does_every_shard_and_a_resumed_one_only_those_not_done(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    settings = Settings(run_state_dir=tmp_path / "state")
    # A shard file left by a plan that is gone (deleted by hand) is not a shard of a new plan.
    stale = [TaskResult("x", "embed", embedding=[9.0, 9.0], audio_seconds=1.0, models=EMBEDDER)]
    write_shard(out, ShardSpec(1, "embed", str(tmp_path / "out"), [Utterance("x", "/x.wav")]), stale)
    queue = InProcessQueue(out)
    run = CorpusRun(listing(tmp_path, 8), out, ["embed"], shard_size=4)
    assert run_corpus(run, queue, Told(), settings).ops["embed"].ok == 8
    assert sorted(queue.sent) == [("embed-000000", 1), ("embed-000001", 1)]  # the stale one rewritten
    (tmp_path / "out" / "report.json").unlink()  # a run stopped before its merge: resumed
    (tmp_path / "out" / "shards" / "embed-000000.parquet").unlink()
    queue = InProcessQueue(out)
    assert run_corpus(run, queue, Told(), settings).ops["embed"].ok == 8
    assert queue.sent == [("embed-000000", 1)]  # the shard done before is not sent again


def test_a_queue_without_consumer_ends_the_run_with_its_code_and_stops_the_workers(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    queue = InProcessQueue(out)
    settings = Settings(run_state_dir=tmp_path / "state")
    with pytest.raises(RunError) as raised:
        run_corpus(CorpusRun(listing(tmp_path, 4), out, ["tokenize"]), queue, Told(), settings)
    assert raised.value.code == NO_CONSUMER
    assert queue.sent == [] and queue.stopped == [False]


class FollowCheckingQueue(InProcessQueue):
    """Notes every shard sent before the run's announcements were followed: its refusal would
    be published to no one, and the driver would hear of it only at the shard's deadline."""

    def __init__(self, out_dir: RunFolder) -> None:
        super().__init__(out_dir)
        self.sent_unfollowed: list[str] = []

    def submit(self, spec: ShardSpec, attempt: int) -> str:
        if not self.following:
            self.sent_unfollowed.append(spec.name)
        return super().submit(spec, attempt)


class PlannerJustBehind:
    """A finished planner whose first snapshot is from before it wrote its header: the driver's
    round starts, then the whole plan appears (a tiny corpus planned while the round runs)."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.snapshots = 0

    def progress(self) -> PlanProgress:
        self.snapshots += 1
        progress = self.planner.progress()
        return replace(progress, header=None, planned=0, done=False) if self.snapshots == 1 else progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)


def test_no_shard_is_sent_before_its_announcements_are_followed(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    settings = Settings(run_state_dir=tmp_path / "state")
    planner = Planner(listing(tmp_path, 4), out, ["embed"], 1, settings, 2).start()
    planner.join()
    queue = FollowCheckingQueue(out)
    driver = CorpusDriver(queue, PlannerJustBehind(planner), out, Told(), settings)  # type: ignore[arg-type]
    driver.run()
    assert len(queue.sent) == 4 and queue.sent_unfollowed == []


class WaitCountingQueue(InProcessQueue):
    """Counts the times the driver listened for announcements before it had sent any shard."""

    def __init__(self, out_dir: RunFolder) -> None:
        super().__init__(out_dir)
        self.waits_before_sending = 0

    def wait(self, timeout_s: float) -> list[ShardResult]:
        self.waits_before_sending += not self.sent
        return super().wait(timeout_s)


def test_with_nothing_in_flight_the_driver_waits_for_the_planner_not_announcements(tmp_path: Path) -> None:
    out = RunFolder.of(tmp_path / "out")
    settings = Settings(run_state_dir=tmp_path / "state")
    planned = threading.Event()

    def slow_store() -> None:  # the plan's writes wait: a store's lock settling, its round trips
        planned.wait(10)

    planner = Planner(listing(tmp_path, 4), out, ["embed"], 1, settings, 2, before_writing=slow_store).start()
    threading.Timer(0.3, planned.set).start()
    queue = WaitCountingQueue(out)
    CorpusDriver(queue, planner, out, Told(), settings).run()
    # Woken by the plan's first chunk, not by a poll of the queue: nothing could be announced.
    assert len(queue.sent) == 4 and queue.waits_before_sending == 0
