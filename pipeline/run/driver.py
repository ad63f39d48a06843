"""The corpus driver: submit a plan's shards and follow them until every shard file exists.

The ledger is on disk in the output folder: the plan (`DIR/plan/`, `pipeline.run.plan`) and one
file per finished shard (`RunFolder.shard_file`), complete or absent. A shard is done when its
file exists, whatever happened to the broker or to its task. Its task announces it once; the
driver listens (`ShardQueue.wait`), and every round it also looks for the files of the shards in
flight, so a lost announcement costs at most `tuning.SHARD_LOOK_S` (in an object store, where a
look is a request, a few sweeps: `pipeline.run.ledger.shards_to_look_at`). Late shards are sent
again, or given up, as `pipeline.run.ledger` decides; a duplicate run of a shard rewrites
identical data under the same name, and the merge reads each shard file once.

Every round it asks the workers whether the work can go on (`ShardQueue.check`) and how many
are ready (the window of shards in flight), and takes the next shards of the plan as the planner
writes them. It keeps state for the shards in flight only; the shards done before it started are
the names in `DIR/shards/`, read once. An outage of the broker or of the output's store is
waited out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from pipeline import tuning
from pipeline.errors import OUTPUT_ERROR, STORE_ERROR, RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import shard_tally, write_given_up_shard
from pipeline.records import ShardResult, ShardSpec
from pipeline.run.hooks import Counts, RunHooks, RunRound
from pipeline.run.ledger import (
    SHARD_FAILURES,
    STORE_LOOKS_PER_ROUND,
    STORE_SWEEP_S,
    InFlight,
    Ledger,
    attempt_deadline_s,
    given_up_reason,
    judge_late,
    late_shards,
    run_ending_failure,
    shards_to_look_at,
    sweep_due,
)
from pipeline.run.plan import Planner, PlanProgress, PlanReader
from pipeline.run.shard_queue import ShardQueue
from pipeline.settings import Settings


class CorpusDriver:
    """Sends the shards of a plan to the workers (its `ShardQueue`) and follows them until every
    shard file exists."""

    def __init__(
        self, queue: ShardQueue, planner: Planner, out_dir: RunFolder, hooks: RunHooks, settings: Settings
    ) -> None:
        self.queue = queue
        self.settings = settings
        self.planner = planner
        self.hooks = hooks
        self.counts = Counts(n_ops=len(planner.ops))
        self.ledger = Ledger(out_dir, keep_bytes=settings.read_ahead_bytes)
        self._specs: Iterator[ShardSpec] = PlanReader(out_dir, planner).specs()
        self._taken = 0  # shards (all ops of each) taken from the plan so far
        self._next: ShardSpec | None = None
        self._plan_read = False
        self._broker_down_since: float | None = None
        self._window_size = 4
        self._processes = 2  # ready worker processes, as last read
        self._window_read_at = -tuning.WINDOW_REFRESH_S

    def run(self) -> None:
        """Until every shard file exists: keep a window of shards in flight, resubmit late ones."""
        # Only a resumed plan has shards done (files a plan that is gone left are not its shards).
        if self.planner.resumed:
            self.ledger.scan_finished()
        announced: list[ShardResult] = []
        outage: tuple[type[Exception], ...] = (*self.queue.outage, OSError)
        self.hooks.run_started()
        try:
            while not self._all_done():
                # One snapshot of the plan per round decides both: the run is followed before any
                # of its shards goes out, so no announcement falls in between.
                plan = self.planner.progress()
                if not self.queue.following and plan.header is not None:
                    self.queue.follow(plan.header.run)
                try:
                    self._step(announced, plan)
                    self._broker_down_since = None
                except outage as exc:
                    self._broker_trouble(exc)
                except VoxmillError as exc:  # the output's store, after its own retries
                    if exc.code != STORE_ERROR:
                        raise
                    self._broker_trouble(exc, what="the output store")
                self._show_progress()
                if not self._all_done():  # the last shard seen: on to the merge at once
                    announced = self._wait()
        finally:
            self.hooks.run_ended()

    def _wait(self) -> list[ShardResult]:
        """The shards announced meanwhile. With none in flight none can be: until the planner adds
        a shard (the run's first waits for the plan's first chunk, not for a poll's next turn)."""
        if not self._plan_read and self._next is None and not self.ledger.inflight:
            self.planner.wait_for(self._taken + 1, 0.05)
            return []
        return self.queue.wait(tuning.SHARD_LOOK_S if self._plan_read else 0.05)

    def _all_done(self) -> bool:
        return self._plan_read and not self.ledger.inflight

    def _broker_trouble(self, exc: Exception, what: str = "broker") -> None:
        now = time.monotonic()
        if self._broker_down_since is None:
            self._broker_down_since = now
            self.hooks.message(f"{what} unreachable ({type(exc).__name__}); waiting for it to come back…")
        time.sleep(min(5.0, 0.5 + (now - self._broker_down_since) / 4))

    def _step(self, announced: list[ShardResult], plan: PlanProgress) -> None:
        if plan.error is not None:
            raise plan.error
        # The queues shards wait in: a run stops when every consumer of one is gone for good.
        self.queue.check({item.spec.op for item in self.ledger.inflight.values()})
        self._collect(announced)
        window = self._window()
        while len(self.ledger.inflight) < window and (spec := self._peek(plan)) is not None:
            if self.ledger.done_earlier(spec):
                self._count_done(spec, None, resumed=True)
            else:
                self.queue.require_consumer(spec.op, self.planner.progress().ops)
                self._submit(spec)  # a broker outage raises here: the spec stays next
            self._consume()
        self._resubmit_late()

    def _peek(self, plan: PlanProgress) -> ShardSpec | None:
        """The plan's next (shard, op), if `plan` (this round's snapshot) holds it; None when none
        is ready."""
        if self._next is None and not self._plan_read:
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
                self._processes = self.queue.ready_workers()
            except self.queue.outage:
                self._processes = 2
            self._window_size = max(4, 2 * self._processes)
        return self._window_size

    def _submit(self, spec: ShardSpec, earlier: InFlight | None = None) -> None:
        attempt = 1 if earlier is None else earlier.attempts + 1  # a first one need not look for its file
        task_id = self.queue.submit(spec, attempt)
        item = InFlight(spec, time.monotonic(), attempt, task_ids=[task_id])
        if earlier is not None:  # its earlier tasks may still run: any of them writes the file
            item.failure = earlier.failure
            item.task_ids = [*earlier.task_ids, task_id]
        self.ledger.inflight[spec.name] = item

    def _collect(self, announced: list[ShardResult]) -> None:
        """Finish the shards whose files exist, announced or not. A shard announced failed for
        want of its file is sent again (or given up); any other failure ends the run."""
        reported: dict[str, ShardResult] = {}
        for result in announced:
            if result.error and result.error.code not in SHARD_FAILURES:
                raise RunError(run_ending_failure(result, self.queue.remote))
            if result.name not in reported or reported[result.name].error:  # a success tells more
                reported[result.name] = result
        ledger = self.ledger
        local, budget, now = ledger.out.is_local, STORE_LOOKS_PER_ROUND, time.monotonic()
        sweep = sweep_due(now, ledger.swept_at, STORE_SWEEP_S)
        names, ledger.look_cursor = shards_to_look_at(
            list(ledger.inflight), set(reported), local, budget, ledger.look_cursor, sweep
        )
        ledger.swept_at = now if sweep else ledger.swept_at
        done = {name for name, result in reported.items() if not result.error}
        found = ledger.existing([ledger.inflight[name].spec for name in names], done)
        for name in names:
            item = ledger.inflight[name]
            if name in found:
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
        verdict = judge_late(late, self.queue.running_task_ids(), self.settings.shard_max_attempts)
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
        self.ledger.given_up_now.add(RunFolder.given_up_file(spec.op, spec.shard))
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

