"""The corpus driver behind `voxmill extract`: submit a plan's shards and follow them to the end.

The ledger is on disk in the output folder: the plan (`DIR/plan/`, written as the listing streams
by; see `workers.corpus.plan`) and `shards/{op}-{shard:06d}.parquet` (one file per finished
shard, complete or absent). A shard is done when its file exists, whatever happened to Redis or
to its task. Its task announces it once, on the run's channel, with its counts; the driver
listens, and every round it also looks for the files of the shards in flight, so a lost
announcement costs at most `tuning.SHARD_LOOK_S`. A shard whose file has not appeared within its
deadline (a few times the median shard time, at least a minute, doubled with each attempt;
before any shard is done, only the first shards in flight, one per ready worker process, can be
late) is submitted again, unless a live worker runs its task (its id is in that worker's
heartbeat record): a shard that is merely slow is never sent twice. A shard announced failed
because its file could not be written (`output_error`, `internal`) is submitted again at once;
any other failure (a forbidden output folder, a model no worker can load) ends the run. A duplicate
run of a shard rewrites identical data under the same name, and the merge reads each shard file
once, so no utterance is ever counted twice.

A shard sent `shard_max_attempts` times without its file being written is given up for good
(`judge_late`): the driver writes `shards/{op}-{shard:06d}.given-up.parquet`, every utterance
failed (`output_error` when its tasks said they could not write it, else `internal`) with the
number of attempts and the last failure heard of; the merge lists them in errors.jsonl and the
run goes on. Unless no worker has written any shard of the run yet and this one's tasks could not
write it: then the workers cannot write the output at all, and the run ends saying so. A resume
finds that file and counts the shard done, so nothing is sent again and again (delete the file to
have the shard tried anew).

The output folder may be a prefix in an object store: a shard is done when its object exists.
There, a look costs a request (a HEAD), so a round looks only at the shards announced; once every
`STORE_SWEEP_S` it also looks at up to `STORE_LOOKS_PER_ROUND` others, in turn (a lost
announcement then costs a few sweeps, not one round), and the shards done before are one listing
of `shards/`. A tar shard's utterances are known only
once its file is written: progress counts tars until then.

The driver owns its loop: every round it asks its cluster whether the work can go on
(`Cluster.check`) and how many workers are ready (the window of shards in flight), and takes the
next shards of the plan as the planner writes them. It keeps state for the shards in flight
only; the shards done before it started are the names in `DIR/shards/`, read once (in a local
folder each one's file is read too, for the audio and failures the progress counts).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from pipeline.errors import FORBIDDEN_PATH, INTERNAL, OUTPUT_ERROR, STORE_ERROR, ErrorRecord, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import shard_tally, write_given_up_shard
from pipeline.records import ShardResult, ShardSpec
from pipeline.settings import Settings
from pipeline.storage.locations import OutputLocation
from workers import keys, tuning
from workers.corpus.cluster import Cluster, RemoteCluster
from workers.corpus.hooks import Counts, RunHooks, RunRound
from workers.corpus.plan import Planner, PlanReader, RunError
from workers.heartbeat import read_worker_records
from workers.queue import connections
from workers.queue.app import SHARD_TASK
from workers.queue.delivery import WorkerView
from workers.queue.wakeups import ResultWakeups


@dataclass
class InFlight:
    """A submitted shard: when it was last sent, how many times, its tasks' ids, when a live worker
    was last seen running one of them, and the last failure its tasks announced."""

    spec: ShardSpec
    submitted: float
    attempts: int = 1
    task_ids: list[str] = field(default_factory=list)
    seen_running: float | None = None
    failure: ErrorRecord | None = None


@dataclass(frozen=True)
class LateVerdict:
    """What to do with the shards past their deadline (`judge_late`)."""

    resend: list[InFlight]
    give_up: list[InFlight]
    running: list[InFlight]  # a live worker runs one of its tasks: it waits


STORE_LOOKS_PER_ROUND = 32  # object-store outputs: HEAD requests per sweep beyond the announced
# Object-store outputs: how often unannounced shards are looked for. Rounds come with every
# announcement (every 50 ms while the plan is read): looking at the unannounced each round cost a
# HEAD per shard in flight per round, and a GET for each found before its announcement.
STORE_SWEEP_S = 5.0
# A shard announced failed with one of these could not be written: sent again, then given up. Any
# other failure (a forbidden output folder, a model no worker loads, a payload the workers do not
# read) would fail every shard: the run ends.
SHARD_FAILURES = frozenset({OUTPUT_ERROR, INTERNAL})


@dataclass
class Ledger:
    """The driver's view of the run: the shards in flight, the ones found done, the recent times."""

    out_dir: RunFolder
    inflight: dict[str, InFlight] = field(default_factory=dict)
    done_before: set[str] = field(default_factory=set)  # shard files found at start
    durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=tuning.RECENT_SHARDS))
    done: int = 0
    done_now: int = 0
    resubmitted: int = 0
    given_up: int = 0
    look_cursor: int = 0  # where the next sweep's looks at unannounced shards start (object store)
    swept_at: float = field(default_factory=time.monotonic)  # the last sweep (object store)
    out: OutputLocation = field(init=False)

    def __post_init__(self) -> None:
        self.out = self.out_dir.location

    def file_of(self, spec: ShardSpec) -> Path | str:
        return self.out_dir.ref(self.out_dir.shard_file(spec.op, spec.shard))

    def exists(self, spec: ShardSpec) -> bool:
        """Whether the shard's file is written (a folder of that name, which no write can replace,
        is not a shard file)."""
        ref = self.file_of(spec)
        if isinstance(ref, Path):
            return ref.is_file()
        return self.out.exists(self.out_dir.shard_file(spec.op, spec.shard))

    def scan_finished(self) -> None:
        """The shard files already there (a resumed run): one listing of the folder."""
        self.done_before = self.out_dir.shard_files()

    def earlier_tally(self, spec: ShardSpec) -> tuple[int, int, float] | None:
        """(ok, failed, audio seconds) of a shard an earlier run did, from its file (or its given-up
        file); None in an object store, where a resume would pay a request per shard for it, or
        when the file cannot be read (the merge says so)."""
        if not self.out.is_local:
            return None
        given_up = self.out_dir.given_up_file(spec.op, spec.shard)
        name = given_up if given_up in self.done_before else self.out_dir.shard_file(spec.op, spec.shard)
        try:
            return shard_tally(self.out_dir.ref(name))
        except VoxmillError:
            return None

    def done_earlier(self, spec: ShardSpec) -> bool:
        """Whether an earlier run wrote the shard's file, or gave the shard up."""
        op, shard = spec.op, spec.shard
        names = (self.out_dir.shard_file(op, shard), self.out_dir.given_up_file(op, shard))
        return any(name in self.done_before for name in names)

    def deadline_s(self, minimum_s: float, factor: float) -> float:
        if not self.durations_s:
            return minimum_s
        return max(minimum_s, factor * statistics.median(self.durations_s))


def shards_to_look_at(
    inflight: Sequence[str], announced: set[str], local: bool, budget: int, cursor: int, sweep: bool = True
) -> tuple[list[str], int]:
    """Which in-flight shards to look for this round, and the next round's cursor.

    A local folder: all of them (a stat each). An object store: the announced ones, then, on a
    `sweep` round, up to `budget` others in turn from `cursor`, so each is looked at every
    len/budget sweeps.
    """
    if local:
        return list(inflight), cursor
    chosen = [name for name in inflight if name in announced]
    others = [name for name in inflight if name not in announced]
    if not sweep:
        return chosen, cursor
    if not others:
        return chosen, 0
    start = cursor % len(others)
    take = min(budget, len(others))
    picked = [others[(start + i) % len(others)] for i in range(take)]
    return chosen + picked, (start + take) % len(others)


def sweep_due(now: float, swept_at: float, every_s: float) -> bool:
    """Whether this round (object store) also looks at the shards that did not announce."""
    return now - swept_at >= every_s


def late_shards(
    inflight: Sequence[InFlight], now: float, deadline_s: float, running: int | None
) -> list[InFlight]:
    """The shards in flight past their deadline (`deadline_s`, doubled with each new attempt),
    counted from when they were sent or, later, last seen running on a live worker.

    `running`: before any shard of this run is done, only the first that many (one per ready
    worker process) can have started; the others wait in the queue behind them, so their wait is
    not yet a sign of loss (a first shard of minutes would otherwise be sent twice).
    """
    candidates = inflight if running is None else inflight[:running]
    return [
        item
        for item in candidates
        if now - max(item.submitted, item.seen_running or 0.0) > attempt_deadline_s(deadline_s, item.attempts)
    ]


def judge_late(late: Sequence[InFlight], running_ids: frozenset[str], max_attempts: int) -> LateVerdict:
    """What becomes of the shards past their deadline: one whose task a live worker runs waits,
    however long it takes (it is slow, not lost); any other is sent again, or given up once it
    was sent `max_attempts` times."""
    running = [item for item in late if running_ids.intersection(item.task_ids)]
    lost = [item for item in late if not running_ids.intersection(item.task_ids)]
    return LateVerdict(
        resend=[item for item in lost if item.attempts < max_attempts],
        give_up=[item for item in lost if item.attempts >= max_attempts],
        running=running,
    )


def given_up_reason(item: InFlight) -> tuple[str, str]:
    """(code, message) of the utterances of a shard given up: `output_error` when its tasks said
    its file could not be written, else `internal`; the attempts and the last failure heard of."""
    failure = item.failure
    code = OUTPUT_ERROR if failure is not None and failure.code == OUTPUT_ERROR else INTERNAL
    message = f"shard {item.spec.name} was given up after {item.attempts} attempt(s) without its file written"
    if failure is not None:
        message += f"; last failure: {failure.code}: {failure.message}"
    else:
        message += " (each task ended without a result, or its worker was lost)"
    return code, message


def run_ending_failure(result: ShardResult, remote: bool) -> str:
    """What ends a run whose shard failed as every shard would (`result.error` is set). Workers on
    a broker refusing the output folder is most often a shell where `voxmill up`'s export line was
    run, with an --out outside the folder `up` was started in: said so."""
    assert result.error is not None
    message = f"shard {result.name} failed: {result.error.message}"
    if remote and result.error.code == FORBIDDEN_PATH:
        message += (
            "; VOXMILL_BROKER_URL is set, so this run's shards go to the workers on that broker, and they "
            "write only below their VOXMILL_ALLOWED_ROOTS (workers `voxmill up` started: below the folder "
            "it was started in): give an --out there, or unset VOXMILL_BROKER_URL to run with workers of "
            "this run's own"
        )
    return message


def attempt_deadline_s(deadline_s: float, attempts: int) -> float:
    return deadline_s * float(min(2 ** (attempts - 1), tuning.MAX_DEADLINE_DOUBLINGS))


class CorpusDriver:
    """Submits the shards of a plan to a cluster and follows them until every shard file exists."""

    def __init__(
        self, app: Celery, cluster: Cluster, planner: Planner, out_dir: RunFolder, hooks: RunHooks
    ) -> None:
        self.app = app
        self.cluster = cluster
        self.settings: Settings = cluster.settings
        self.planner = planner
        self.hooks = hooks
        self.counts = Counts(n_ops=len(planner.ops))
        self.ledger = Ledger(out_dir)
        self.redis = connections.broker_client(self.settings, socket_timeout=5, socket_connect_timeout=5)
        self.announcements = ResultWakeups(self.redis)
        self._specs: Iterator[ShardSpec] = PlanReader(out_dir, planner).specs()
        self._taken = 0  # shards (all ops of each) taken from the plan so far
        self._next: ShardSpec | None = None
        self._plan_read = False
        self._redis_down_since: float | None = None
        self._window_size = 4
        self._processes = 2  # ready worker processes, as last read
        self._window_read_at = -tuning.WINDOW_REFRESH_S

    def run(self) -> None:
        """Until every shard file exists: keep a window of shards in flight, resubmit late ones."""
        self.ledger.scan_finished()
        announced: list[ShardResult] = []
        self.hooks.run_started()
        try:
            while not self._all_done():
                header = self.planner.progress().header
                if not self.announcements.listening and header is not None:
                    # Before looking: no announcement falls in between.
                    self.announcements.follow([keys.SHARDS_DONE_CHANNEL.format(run=header.run)])
                try:
                    self._step(announced)
                    self._redis_down_since = None
                except (redis.RedisError, OperationalError, OSError) as exc:
                    self._broker_trouble(exc)
                except VoxmillError as exc:  # the output's store, after its own retries
                    if exc.code != STORE_ERROR:
                        raise
                    self._broker_trouble(exc, what="the output store")
                self._show_progress()
                if not self._all_done():  # the last shard seen: on to the merge at once
                    heard = self.announcements.wait(tuning.SHARD_LOOK_S if self._plan_read else 0.05)
                    announced = [_shard_result(data) for _, data in heard]
        finally:
            self.announcements.close()
            self.hooks.run_ended()
            self.redis.close()

    def _all_done(self) -> bool:
        return self._plan_read and not self.ledger.inflight

    def _broker_trouble(self, exc: Exception, what: str = "broker") -> None:
        now = time.monotonic()
        if self._redis_down_since is None:
            self._redis_down_since = now
            self.hooks.message(f"{what} unreachable ({type(exc).__name__}); waiting for it to come back…")
        time.sleep(min(5.0, 0.5 + (now - self._redis_down_since) / 4))

    def _step(self, announced: list[ShardResult]) -> None:
        error = self.planner.progress().error
        if error is not None:
            raise error
        # The queues shards wait in: a run stops when every consumer of one is gone for good.
        self.cluster.check(self.redis, {item.spec.op for item in self.ledger.inflight.values()})
        self._collect(announced)
        window = self._window()
        while len(self.ledger.inflight) < window and (spec := self._peek()) is not None:
            if self.ledger.done_earlier(spec):
                self._count_done(spec, None, resumed=True)
            else:
                self.cluster.require_consumer(self.redis, spec.op, self.planner.progress().ops)
                self._submit(spec)  # a broker outage raises here: the spec stays next
            self._consume()
        self._resubmit_late()

    def _peek(self) -> ShardSpec | None:
        """The plan's next (shard, op), if the planner has written it; None when none is ready."""
        if self._next is None and not self._plan_read:
            plan = self.planner.progress()
            if not (plan.done or self._taken < plan.planned):
                return None
            self._next = next(self._specs, None)
            self._plan_read = self._next is None
        return self._next

    def _consume(self) -> None:
        if self._next is not None and self._next.op == self.planner.ops[-1]:
            self._taken += 1
        self._next = None

    def _window(self) -> int:
        """How many shards to keep in flight: twice the ready worker processes, at least 4."""
        now = time.monotonic()
        if now - self._window_read_at >= tuning.WINDOW_REFRESH_S:
            self._window_read_at = now
            try:
                self._processes = self.cluster.ready_workers(self.redis)
            except redis.RedisError:
                self._processes = 2
            self._window_size = max(4, 2 * self._processes)
        return self._window_size

    def _submit(self, spec: ShardSpec, earlier: InFlight | None = None) -> None:
        attempt = 1 if earlier is None else earlier.attempts + 1  # a first one need not look for its file
        sent = self.app.send_task(
            SHARD_TASK,
            args=[{**spec.to_dict(), "attempt": attempt}],
            queue=spec.op,
            serializer="json",
            ignore_result=True,
        )
        item = InFlight(spec, time.monotonic(), attempt, task_ids=[sent.id])
        if earlier is not None:  # its earlier tasks may still run: any of them writes the file
            item.failure = earlier.failure
            item.task_ids = [*earlier.task_ids, sent.id]
        self.ledger.inflight[spec.name] = item

    def _collect(self, announced: list[ShardResult]) -> None:
        """Finish the shards whose files exist, announced or not. A shard announced failed for
        want of its file is sent again (or given up); any other failure ends the run."""
        reported: dict[str, ShardResult] = {}
        for result in announced:
            if result.error and result.error.code not in SHARD_FAILURES:
                raise RunError(run_ending_failure(result, isinstance(self.cluster, RemoteCluster)))
            if result.name not in reported or reported[result.name].error:  # a success tells more
                reported[result.name] = result
        ledger = self.ledger
        local, budget, now = ledger.out.is_local, STORE_LOOKS_PER_ROUND, time.monotonic()
        sweep = sweep_due(now, ledger.swept_at, STORE_SWEEP_S)
        names, ledger.look_cursor = shards_to_look_at(
            list(ledger.inflight), set(reported), local, budget, ledger.look_cursor, sweep
        )
        ledger.swept_at = now if sweep else ledger.swept_at
        for name in names:
            item = ledger.inflight[name]
            if ledger.exists(item.spec):
                del self.ledger.inflight[name]
                self.ledger.durations_s.append(time.monotonic() - item.submitted)
                heard = reported.get(name)
                self._count_done(item.spec, None if heard is None or heard.error else heard)
            elif name in reported:  # announced failed, or announced yet no file: do it again
                item.failure = reported[name].error or item.failure
                self._resubmit(item)

    def _resubmit_late(self) -> None:
        """Submit again every shard past its deadline that no live worker runs (each new attempt
        waits twice as long); give up those sent `shard_max_attempts` times."""
        base = self.ledger.deadline_s(self.settings.shard_deadline_min_s, self.settings.shard_deadline_factor)
        now = time.monotonic()
        running = None if self.ledger.durations_s else max(1, self._processes)
        late = late_shards(list(self.ledger.inflight.values()), now, base, running)
        if not late:
            return
        verdict = judge_late(late, self._running_task_ids(), self.settings.shard_max_attempts)
        for item in verdict.running:
            item.seen_running = now
        for item in verdict.resend:
            self.hooks.message(
                f"shard {item.spec.name} not done after {now - item.submitted:.0f} s "
                f"(deadline {attempt_deadline_s(base, item.attempts):.0f} s); submitting it again"
            )
            self._resubmit(item)
        for item in verdict.give_up:
            self._give_up(item)

    def _running_task_ids(self) -> frozenset[str]:
        """The ids of the tasks live workers run now (their heartbeat records)."""
        return WorkerView.from_records(read_worker_records(self.redis)).running

    def _resubmit(self, item: InFlight) -> None:
        """Send a shard again, or give it up once it was sent `shard_max_attempts` times."""
        if item.attempts >= self.settings.shard_max_attempts:
            self._give_up(item)
            return
        self.ledger.resubmitted += 1
        self.hooks.shard_resubmitted(item.spec)
        self._submit(item.spec, item)

    def _give_up(self, item: InFlight) -> None:
        """Write the shard's given-up file (every utterance failed, with why) and count it done;
        `RunError` when even that file cannot be written."""
        spec = item.spec
        code, message = given_up_reason(item)
        if code == OUTPUT_ERROR and self.ledger.done_now == self.ledger.given_up:
            # Not one shard written by a worker yet: the workers cannot write the output, which
            # giving up every shard would only hide.
            raise RunError(
                f"{message}; no worker has written a shard of this run: check that the workers can "
                f"write {self.ledger.out_dir.display()}"
            )
        try:
            path = write_given_up_shard(self.ledger.out_dir, spec, code, message)
        except VoxmillError as exc:
            raise RunError(f"{message}, and its given-up file cannot be written: {exc.message}") from None
        del self.ledger.inflight[spec.name]
        self.ledger.given_up += 1
        self.hooks.message(f"{message}: its utterances are {code} failures in errors.jsonl")
        failed = len(spec.utts) or 1  # a tar shard: one row, the tar
        self._count_done(spec, ShardResult(spec.shard, spec.op, str(path), 0, failed, 0.0, 0.0), path)

    def _count_done(
        self,
        spec: ShardSpec,
        result: ShardResult | None,
        file: Path | str | None = None,
        resumed: bool = False,
    ) -> None:
        """Add one finished shard to the progress counts (a resumed one: its utterances only);
        `file`: its file, when not the shard file (a shard given up)."""
        self.ledger.done += 1
        counts = self.counts
        units = 1 if spec.tar else len(spec.utts)  # a tar counts as one until its rows are known
        counts.units_done += units
        if resumed:
            counts.units_resumed += units
            earlier = self.ledger.earlier_tally(spec)
            if earlier is None:
                counts.resumed_uncounted += 1
            else:  # its audio and failures, as the merge will count them
                ok, failed, audio_s = earlier
                counts.add_resumed(spec.op, failed, audio_s)
                counts.tar_utterances += (ok + failed) if spec.tar else 0
            self.hooks.shard_resumed(spec)
            return
        self.ledger.done_now += 1
        file = file or self.ledger.file_of(spec)
        if result is None:  # its announcement was not heard (yet): the file has the counts and audio
            ok, failed, audio_s = shard_tally(file)
            result = ShardResult(spec.shard, spec.op, "", ok, failed, audio_s, 0.0)
        if spec.tar:
            counts.tar_utterances += result.ok + result.failed
        counts.audio_done_s += result.audio_seconds
        counts.failed[spec.op] = counts.failed.get(spec.op, 0) + result.failed
        self.hooks.shard_done(spec, result, file)

    def _show_progress(self) -> None:
        counts, plan = self.counts, self.planner.progress()
        if plan.header is not None and plan.header.tars:
            counts.unit = "tars"
        if plan.done and plan.error is None:
            counts.units_total = plan.utterances * len(plan.ops)
            counts.audio_total_s = plan.listed_audio_s
        self.hooks.round_ended(RunRound(counts.snapshot(), len(self.ledger.inflight), plan))


def _shard_result(data: Any) -> ShardResult:
    return ShardResult.from_dict(json.loads(data))
