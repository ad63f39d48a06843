"""The corpus driver's bookkeeping and its decisions, as pure functions of what it knows.

A shard whose file has not appeared within its deadline (a few times the median shard time, at
least a minute, doubled with each attempt; before any shard is done, only the first shards in
flight, one per ready worker process, can be late) is sent again, unless a live worker runs its
task: a shard that is merely slow is never sent twice. One announced failed because its file
could not be written (`output_error`, `internal`) is sent again at once; any other failure (a
forbidden output folder, a model no worker loads) ends the run.

A shard sent `shard_max_attempts` times without its file is given up: the driver writes its
given-up file, every utterance failed with why (`given_up_reason`), the merge lists them in
errors.jsonl, and a resume counts it done (delete the file to have it tried anew).

In an object store a look costs a request: a round looks only at the shards announced, and every
`STORE_SWEEP_S` at up to `STORE_LOOKS_PER_ROUND` others in turn (a HEAD each). An announced shard's
file is read (a GET, the round trip a HEAD costs) and kept for the merge, up to `keep_bytes` in
all: the merge then has no round trip to wait for at the end of the run.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import tuning
from pipeline.errors import FORBIDDEN_PATH, INTERNAL, NOT_FOUND, OUTPUT_ERROR, ErrorRecord, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import shard_tally
from pipeline.records import ShardResult, ShardSpec
from pipeline.storage.locations import OutputLocation


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
    given_up_now: set[str] = field(default_factory=set)  # the given-up files this run wrote
    look_cursor: int = 0  # where the next sweep's looks at unannounced shards start (object store)
    swept_at: float = field(default_factory=time.monotonic)  # the last sweep (object store)
    keep_bytes: int = 0  # most bytes of shard files kept for the merge (object store)
    kept: dict[str, bytes] = field(default_factory=dict)  # by URL: files read when looked for
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

    def existing(self, specs: Sequence[ShardSpec], announced: Collection[str] = ()) -> set[str]:
        """The names of the shards of `specs` whose files are written; in a store, each a request,
        up to `STORE_LOOKS_PER_ROUND` at once (a round's looks cost one round trip, not one each):
        the files of those `announced` done are read and kept while `keep_bytes` allows."""
        if self.out.is_local:
            return {spec.name for spec in specs if self.exists(spec)}
        room = self.keep_bytes - sum(len(data) for data in self.kept.values())
        reads = {spec.name for spec in specs if spec.name in announced} if room > 0 else set()

        def look(spec: ShardSpec) -> bytes | bool:
            return self._read(spec) if spec.name in reads else self.exists(spec)

        if len(specs) < 2:
            found = [look(spec) for spec in specs]
        else:
            threads = min(len(specs), STORE_LOOKS_PER_ROUND)
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="voxmill-look") as pool:
                found = list(pool.map(look, specs))
        for spec, there in zip(specs, found, strict=True):
            if isinstance(there, bytes) and len(there) <= room:
                self.kept[str(self.file_of(spec))] = there
                room -= len(there)
        return {spec.name for spec, there in zip(specs, found, strict=True) if there is not False}

    def _read(self, spec: ShardSpec) -> bytes | bool:
        """A shard file's bytes; False where there is none."""
        try:
            return self.out.read_bytes(self.out_dir.shard_file(spec.op, spec.shard))
        except VoxmillError as exc:
            if exc.code == NOT_FOUND:
                return False
            raise

    def scan_finished(self) -> None:
        """The shard files already there (a resumed run): one listing of the folder."""
        self.done_before = self.out_dir.shard_files()

    def given_up_files(self) -> set[str]:
        """The names of the plan's given-up files, for the merge without a listing of `shards/`:
        those a resumed run found at start and those written since."""
        return {name for name in self.done_before if RunFolder.is_given_up(name)} | self.given_up_now

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
