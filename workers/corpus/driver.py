"""The corpus driver behind `voxmill extract`: submit a plan's shards and follow them to the end.

The ledger is on disk in the output folder: `plan.json` (the shards, fixed for the run; see
`workers.corpus.plan`) and `shards/{op}-{shard:06d}.parquet` (one file per finished shard,
complete or absent). A shard is done when its file exists, whatever happened to Redis or to its
task. Its task announces it once, on the run's channel, with its counts; the driver listens, and
every round it also looks for the files of the shards in flight, so a lost announcement costs at
most `tuning.SHARD_LOOK_S`. A shard whose file has not appeared within its deadline (a few times the
median shard time, at least a minute) is submitted again; a duplicate run of a shard rewrites
identical data under the same name, and the merge reads each shard file once, so no utterance is
ever counted twice.

The driver owns its loop: every round it asks its cluster whether the work can go on
(`Cluster.check`) and how many workers are ready (the window of shards in flight).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from pipeline.records import ShardResult, ShardSpec
from pipeline.settings import Settings
from pipeline.writers import shard_counts, shard_path
from workers import keys, tuning
from workers.corpus.cluster import Cluster
from workers.corpus.plan import Plan, RunError
from workers.corpus.progress import ProgressView
from workers.queue import connections
from workers.queue.app import SHARD_TASK
from workers.queue.wakeups import ResultWakeups


@dataclass
class InFlight:
    """A submitted shard: when it was sent and how many times."""

    spec: ShardSpec
    submitted: float
    attempts: int = 1


@dataclass
class Ledger:
    """The driver's view of every shard: done, in flight, or waiting."""

    out_dir: Path
    specs: list[ShardSpec]
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=tuning.RECENT_SHARDS))
    resubmitted: int = 0

    def waiting(self) -> list[ShardSpec]:
        return [s for s in self.specs if s.name not in self.done and s.name not in self.inflight]

    def file_of(self, spec: ShardSpec) -> Path:
        return shard_path(self.out_dir, spec.op, spec.shard)

    def scan_finished(self) -> None:
        """Mark as done every shard whose file exists (a resumed run, or one finished meanwhile)."""
        for spec in self.specs:
            if spec.name not in self.done and self.file_of(spec).exists():
                ok, failed = shard_counts(self.file_of(spec))
                self.done[spec.name] = {"ok": ok, "failed": failed}

    def deadline_s(self, minimum_s: float, factor: float) -> float:
        if not self.durations_s:
            return minimum_s
        return max(minimum_s, factor * statistics.median(self.durations_s))


def longest_first(specs: Sequence[ShardSpec]) -> list[ShardSpec]:
    """Shards by decreasing audio seconds (ties keep plan order): the plan groups clips by length,
    so in plan order the run would end on its longest shard with the other workers idle. The
    merge still follows the plan, so outputs do not depend on this order."""
    return sorted(specs, key=lambda s: -s.audio_s)


class CorpusDriver:
    """Submits the shards of a plan to a cluster and follows them until every shard file exists."""

    def __init__(self, app: Celery, cluster: Cluster, plan: Plan, out_dir: Path, view: ProgressView) -> None:
        self.app = app
        self.cluster = cluster
        self.settings: Settings = cluster.settings
        self.plan = plan
        self.view = view
        self.ledger = Ledger(out_dir, longest_first(plan.specs))
        self.redis = connections.broker_client(self.settings, socket_timeout=5, socket_connect_timeout=5)
        self.channel = keys.SHARDS_DONE_CHANNEL.format(run=plan.run)
        self.announcements = ResultWakeups(self.redis)
        self._redis_down_since: float | None = None
        self._window_size = 4
        self._window_read_at = -tuning.WINDOW_REFRESH_S

    def run(self) -> None:
        """Until every shard file exists: keep a window of shards in flight, resubmit late ones."""
        self.ledger.scan_finished()
        by_name = {spec.name: spec for spec in self.ledger.specs}
        for name, value in self.ledger.done.items():
            self._count(by_name[name], value)
        self.view.counts.resumed()
        announced: list[ShardResult] = []
        try:
            while not self._all_done():
                if not self.announcements.listening:  # before looking: no announcement falls in between
                    self.announcements.follow([self.channel])
                try:
                    self._step(announced)
                    self._redis_down_since = None
                except (redis.RedisError, OperationalError, OSError) as exc:
                    self._broker_trouble(exc)
                self.view.update()
                if not self._all_done():  # the last shard seen: on to the merge at once
                    announced = [
                        _shard_result(data) for _, data in self.announcements.wait(tuning.SHARD_LOOK_S)
                    ]
        finally:
            self.announcements.close()
            self.redis.close()

    def _all_done(self) -> bool:
        return len(self.ledger.done) >= len(self.ledger.specs)

    def _broker_trouble(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._redis_down_since is None:
            self._redis_down_since = now
            self.view.message(f"broker unreachable ({type(exc).__name__}); waiting for it to come back…")
        time.sleep(min(5.0, 0.5 + (now - self._redis_down_since) / 4))

    def _step(self, announced: list[ShardResult]) -> None:
        self.cluster.check(self.redis)
        self._collect(announced)
        window = self._window()
        for spec in self.ledger.waiting()[: max(0, window - len(self.ledger.inflight))]:
            self._submit(spec)
        self._resubmit_late()

    def _window(self) -> int:
        """How many shards to keep in flight: twice the ready worker processes, at least 4."""
        now = time.monotonic()
        if now - self._window_read_at >= tuning.WINDOW_REFRESH_S:
            self._window_read_at = now
            try:
                self._window_size = max(4, 2 * self.cluster.ready_workers(self.redis))
            except redis.RedisError:
                self._window_size = 4
        return self._window_size

    def _submit(self, spec: ShardSpec, attempts: int = 1) -> None:
        self.app.send_task(
            SHARD_TASK, args=[spec.to_dict()], queue=spec.op, serializer="json", ignore_result=True
        )
        self.ledger.inflight[spec.name] = InFlight(spec, time.monotonic(), attempts)

    def _collect(self, announced: list[ShardResult]) -> None:
        """Finish the shards whose files exist, announced or not; a failed shard ends the run."""
        reported: dict[str, ShardResult] = {}
        for result in announced:
            if result.error:
                raise RunError(f"shard {result.name} failed: {result.error['message']}")
            reported[result.name] = result
        for name, item in list(self.ledger.inflight.items()):
            if self.ledger.file_of(item.spec).exists():
                self._finish(name, item, reported.get(name))
            elif name in reported:  # announced, yet no file: do it again
                self._resubmit(item)

    def _finish(self, name: str, item: InFlight, result: ShardResult | None) -> None:
        del self.ledger.inflight[name]
        if result is None:
            ok, failed = shard_counts(self.ledger.file_of(item.spec))
            value = {"ok": ok, "failed": failed}
        else:
            value = {"ok": result.ok, "failed": result.failed}
        self.ledger.done[name] = value
        self.ledger.durations_s.append(time.monotonic() - item.submitted)
        self._count(item.spec, value)

    def _resubmit_late(self) -> None:
        """Submit again every shard past its deadline; each new attempt waits twice as long."""
        base = self.ledger.deadline_s(self.settings.shard_deadline_min_s, self.settings.shard_deadline_factor)
        now = time.monotonic()
        for item in list(self.ledger.inflight.values()):
            deadline = base * min(2 ** (item.attempts - 1), tuning.MAX_DEADLINE_DOUBLINGS)
            if now - item.submitted > deadline:
                self.view.message(
                    f"shard {item.spec.name} not done after {now - item.submitted:.0f} s "
                    f"(deadline {deadline:.0f} s); submitting it again"
                )
                self._resubmit(item)

    def _resubmit(self, item: InFlight) -> None:
        self.ledger.resubmitted += 1
        self._submit(item.spec, item.attempts + 1)

    def _count(self, spec: ShardSpec, value: dict[str, Any]) -> None:
        """Add one finished shard to the progress counts."""
        counts = self.view.counts
        counts.units_done += len(spec.utts)
        counts.audio_done_s += spec.audio_s
        counts.failed[spec.op] = counts.failed.get(spec.op, 0) + int(value.get("failed", 0))


def _shard_result(data: Any) -> ShardResult:
    return ShardResult.from_dict(json.loads(data))
