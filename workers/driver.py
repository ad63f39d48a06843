"""The corpus driver behind `voxmill extract`: plan, submit shards, watch the ledger, merge.

The ledger is on disk in the output folder: `plan.json` (the shards, fixed for the run) and
`shards/{op}-{shard:06d}.parquet` (one file per finished shard, complete or absent). A shard
is done when its file exists, whatever happened to Redis or to the task's result. A shard
whose task has not finished within its deadline (a few times the median shard time, at least
a minute) is submitted again; a duplicate run of a shard rewrites identical data under the
same name, and the merge reads each shard file once, so no utterance is ever counted twice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from pipeline.corpus import auto_shard_size, plan_fingerprint, plan_shards, probe_durations, read_corpus
from pipeline.errors import VoxmillError
from pipeline.records import ShardSpec, Utterance
from pipeline.settings import Settings
from pipeline.writers import merge_outputs, shard_counts, shard_path, write_text
from workers import keys, status
from workers.progress import Counts, ProgressView

log = logging.getLogger("voxmill.driver")
PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
PLAN_VERSION = 1
POLL_S = 0.1
MAX_DEADLINE_DOUBLINGS = 8  # a shard submitted again and again waits at most 8x the deadline
RECENT_SHARDS = 200  # the deadline follows the median time of the most recent shards
WINDOW_REFRESH_S = 2.0  # how often the number of live workers is read again


class RunError(Exception):
    """The run cannot go on (bad input, output not writable, a different run in the folder)."""


@dataclass
class InFlight:
    """A submitted shard: its task id, when it was sent and how many times."""

    spec: ShardSpec
    task_id: str
    submitted: float
    attempts: int = 1


@dataclass
class Plan:
    """What `plan.json` holds."""

    fingerprint: str
    source: str
    ops: list[str]
    shard_size: int
    specs: list[ShardSpec]
    order: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "input": self.source,
            "ops": self.ops,
            "shard_size": self.shard_size,
            "order": self.order,
            "shards": [spec.to_dict() for spec in self.specs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            fingerprint=data["fingerprint"],
            source=data["input"],
            ops=list(data["ops"]),
            shard_size=int(data["shard_size"]),
            specs=[ShardSpec.from_dict(s) for s in data["shards"]],
            order=list(data.get("order", [])),
        )

    def utterances(self) -> list[Utterance]:
        seen: dict[str, Utterance] = {}
        for spec in self.specs:
            for utt in spec.utts:
                seen.setdefault(utt.utt, utt)
        return list(seen.values())


def lock_output(out_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the output folder for the life of the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    handle = open(out_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(f"another `voxmill extract` is running on {out_dir}") from None
    return handle


def load_or_make_plan(
    source: Path,
    out_dir: Path,
    ops: Sequence[str],
    shard_size: int,
    settings: Settings,
    workers: int | None = None,
) -> Plan:
    """Read the corpus and reuse `plan.json` when it describes the same run (resume), else plan anew.

    `shard_size` 0 is automatic: `settings.shard_size`, or smaller so that `workers` processes
    (when known) get several shards each (`auto_shard_size`). The plan's fingerprint uses the
    requested size (the settings' for automatic), so a resume reuses the plan whatever the
    number of workers.
    """
    try:
        utts = read_corpus(source)
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    if not utts:
        raise RunError(f"{source} holds no utterances")
    fingerprint = plan_fingerprint(utts, ops, shard_size or settings.shard_size)
    plan_file = out_dir / PLAN_FILE
    if plan_file.exists():
        existing = Plan.from_dict(json.loads(plan_file.read_text()))
        if existing.fingerprint != fingerprint:
            raise RunError(
                f"{out_dir} holds a run of a different corpus, ops or shard size; "
                "use another --out folder, or delete this one to start over"
            )
        return existing
    size = shard_size
    if not size:
        size = auto_shard_size(len(utts), workers, settings.shard_size) if workers else settings.shard_size
    timed = probe_durations(utts, settings.audio_limits)
    specs = plan_shards(timed, ops, str(out_dir.resolve()), size)
    plan = Plan(fingerprint, str(source), list(ops), size, specs, [u.utt for u in utts])
    write_text(plan_file, json.dumps(plan.to_dict()))
    return plan


@dataclass
class Ledger:
    """The driver's view of every shard: done, in flight, or waiting."""

    out_dir: Path
    specs: list[ShardSpec]
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SHARDS))
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
    """Submits the shards of a plan and follows them to the end."""

    def __init__(
        self, app: Celery, settings: Settings, plan: Plan, out_dir: Path, view: ProgressView
    ) -> None:
        self.app = app
        self.settings = settings
        self.plan = plan
        self.view = view
        self.ledger = Ledger(out_dir, longest_first(plan.specs))
        self.redis = redis.Redis.from_url(
            settings.broker_url or "", socket_timeout=5, socket_connect_timeout=5
        )
        self._redis_down_since: float | None = None
        self._window_size = 4
        self._window_read_at = -WINDOW_REFRESH_S

    def run(self) -> None:
        """Until every shard file exists: keep a window of shards in flight, resubmit late ones."""
        self.ledger.scan_finished()
        by_name = {spec.name: spec for spec in self.ledger.specs}
        for name, value in self.ledger.done.items():
            self._count(by_name[name], value)
        while len(self.ledger.done) < len(self.ledger.specs):
            try:
                self._step()
                self._redis_down_since = None
            except (redis.RedisError, OperationalError, OSError) as exc:
                self._broker_trouble(exc)
            self.view.update()
            time.sleep(POLL_S)

    def _broker_trouble(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._redis_down_since is None:
            self._redis_down_since = now
            self.view.message(f"broker unreachable ({type(exc).__name__}); waiting for it to come back…")
        time.sleep(min(5.0, 0.5 + (now - self._redis_down_since) / 4))

    def _step(self) -> None:
        self._collect()
        window = self._window()
        for spec in self.ledger.waiting()[: max(0, window - len(self.ledger.inflight))]:
            self._submit(spec)
        self._resubmit_late()

    def _window(self) -> int:
        """How many shards to keep in flight: twice the live worker processes, at least 4."""
        now = time.monotonic()
        if now - self._window_read_at >= WINDOW_REFRESH_S:
            self._window_read_at = now
            try:
                self._window_size = max(4, 2 * status.count_ready_workers(self.redis))
            except redis.RedisError:
                self._window_size = 4
        return self._window_size

    def _submit(self, spec: ShardSpec, attempts: int = 1) -> None:
        sent = self.app.send_task(
            "voxmill.shard", args=[spec.to_dict()], queue=spec.op, serializer="json", ignore_result=True
        )
        self.ledger.inflight[spec.name] = InFlight(spec, str(sent.id), time.monotonic(), attempts)

    def _collect(self) -> None:
        items = list(self.ledger.inflight.items())
        if not items:
            return
        raw = self.redis.mget([keys.SHARD_RESULT.format(task_id=item.task_id) for _, item in items])
        for (name, item), value in zip(items, raw, strict=True):
            result = json.loads(value) if value else None
            if result is not None and result.get("error"):
                raise RunError(f"shard {name} failed: {result['error']['message']}")
            if self.ledger.file_of(item.spec).exists():
                self._finish(name, item, result)
            elif result is not None:  # reported done, yet no file: do it again
                self._resubmit(item)

    def _finish(self, name: str, item: InFlight, value: dict[str, Any] | None) -> None:
        del self.ledger.inflight[name]
        if value is None:
            ok, failed = shard_counts(self.ledger.file_of(item.spec))
            value = {"ok": ok, "failed": failed}
        self.ledger.done[name] = value
        self.ledger.durations_s.append(time.monotonic() - item.submitted)
        self._count(item.spec, value)

    def _resubmit_late(self) -> None:
        """Submit again every shard past its deadline; each new attempt waits twice as long."""
        base = self.ledger.deadline_s(self.settings.shard_deadline_min_s, self.settings.shard_deadline_factor)
        now = time.monotonic()
        for item in list(self.ledger.inflight.values()):
            deadline = base * min(2 ** (item.attempts - 1), MAX_DEADLINE_DOUBLINGS)
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
        counts.failed += int(value.get("failed", 0))


def run_corpus(
    app: Celery,
    settings: Settings,
    plan: Plan,
    out_dir: Path,
    quiet: bool = False,
    extra_report: dict[str, Any] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Drive `plan` to the end and merge the outputs; returns `report.json`'s content.

    `wall_seconds` counts from `started` (a `time.monotonic()` value; default: now).
    """
    started = time.monotonic() if started is None else started
    audio_total = sum(u.duration_s or 0.0 for u in plan.utterances())
    counts = Counts(
        units_total=sum(len(s.utts) for s in plan.specs), audio_total_s=audio_total, n_ops=len(plan.ops)
    )
    with ProgressView(counts, quiet=quiet) as view:
        driver = CorpusDriver(app, settings, plan, out_dir, view)
        driver.run()
    extra = {"wall_seconds": round(time.monotonic() - started, 3), **(extra_report or {})}
    extra["resubmitted_shards"] = driver.ledger.resubmitted
    try:
        return merge_outputs(out_dir, plan.specs, extra, plan.order or None)
    except VoxmillError as exc:
        raise RunError(exc.message) from None


def corpus_roots(plan: Plan, out_dir: Path, limit: int = 64) -> list[Path]:
    """The folders an embedded run's workers must be allowed to read (and the output folder)."""
    folders = sorted({Path(u.path).parent for u in plan.utterances()})
    if len(folders) > limit:
        common = Path(os.path.commonpath([str(f) for f in folders]))
        if len(common.parts) > 2:  # never collapse to "/" or a top-level folder such as /home
            folders = [common]
    minimal: list[Path] = []
    for folder in folders:
        if not any(folder == m or m in folder.parents for m in minimal):
            minimal.append(folder)
    return [*minimal, out_dir.resolve()]


def remote_workers(settings: Settings) -> int | None:
    """Worker processes with their models loaded on the broker (None when there are none or it fails)."""
    try:
        client = redis.Redis.from_url(settings.broker_url or "", socket_timeout=5, socket_connect_timeout=5)
        try:
            return status.count_ready_workers(client) or None
        finally:
            client.close()
    except redis.RedisError:
        return None


def check_models(settings: Settings, ops: Sequence[str]) -> None:
    """Fail early, with the fix, when the model folder lacks a model the ops need."""
    from pipeline.records import ROLES_BY_OP
    from pipeline.registry import Registry

    registry = Registry.load()
    for role in dict.fromkeys(r for op in ops for r in ROLES_BY_OP[op]):
        try:
            registry.find_model(role, settings.model_dir)
        except VoxmillError as exc:
            raise RunError(exc.message) from None


def extract_corpus(
    settings: Settings,
    source: Path,
    out_dir: Path,
    ops: Sequence[str],
    workers: int,
    shard_size: int,
    quiet: bool = False,
) -> dict[str, Any]:
    """`voxmill extract`: with a broker, submit and wait; without one, run an embedded cluster too.

    `shard_size` 0: automatic (see `load_or_make_plan`), for `workers` local processes, or with a
    broker for the worker processes ready now.
    """
    from workers.app import create_app
    from workers.embedded import EmbeddedRedis, LocalWorkers

    started = time.monotonic()
    try:
        lock = lock_output(out_dir)
    except OSError as exc:
        raise RunError(f"cannot use the output folder {out_dir}: {exc.strerror or exc}") from None
    try:
        planned_for = remote_workers(settings) if settings.broker_url else workers
        plan = load_or_make_plan(source, out_dir, ops, shard_size, settings, planned_for)
        extra: dict[str, Any] = {"input": str(source)}
        if settings.broker_url:
            return run_corpus(
                create_app(settings, polled_results=True), settings, plan, out_dir, quiet, extra, started
            )
        check_models(settings, ops)
        roots = (*settings.allowed_roots, *corpus_roots(plan, out_dir))
        embedded = EmbeddedRedis().start()
        local = settings.model_copy(update={"broker_url": embedded.url, "allowed_roots": roots})
        cluster = LocalWorkers(local, workers, queues=list(ops), log_path=out_dir / "workers.log")
        completed = False
        try:
            cluster.start()
            if not quiet:
                print(f"extract: started {workers} local worker(s) on an embedded Redis", flush=True)
            cluster.wait_ready()
            report = run_corpus(
                create_app(local, polled_results=True), local, plan, out_dir, quiet, extra, started
            )
            completed = True
            return report
        finally:
            # Once everything is merged nothing is in flight: no warm shutdown to wait for (about
            # 3 s of Celery's). Otherwise shards are idempotent: no need to wait long either.
            cluster.stop(timeout_s=0.0 if completed else 5.0)
            embedded.stop()
    except VoxmillError as exc:  # e.g. output_error while writing the plan
        raise RunError(exc.message) from None
    finally:
        lock.close()
