"""What a corpus run tells whoever watches it: one hook per moment, each a no-op here.

The driver (`pipeline.run.driver.CorpusDriver`) calls these and keeps nothing of its watchers';
the progress view (`workers.corpus.progress.ProgressView`) and the metrics observer
(`workers.observe.run_metrics.RunObserver`) implement the hooks they need, as dramatiq's
middleware does. What a hook receives is a snapshot (frozen): a watcher cannot change the run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.records import ShardResult, ShardSpec
from pipeline.run.plan import PlanProgress
from pipeline.units import audio_amount


@dataclass
class Counts:
    """What a run has done so far: work units (utterance x op), audio seconds, failures per op.

    The totals are known once the listing has been read (the audio total only when the listing
    gives durations). The audio and failures done count what the merge will count: each shard's
    rows that succeeded, from its task's announcement or, when that was not heard, its file.
    Shards an earlier run did count as done, with their audio and failures when their files were
    read (`resumed_uncounted`: how many were not, in an object store), never towards this run's
    speed. In a run of tar shards the units are tars (their utterances are known once read:
    `tar_utterances` counts those done).
    """

    n_ops: int
    unit: str = "utterances"
    tar_utterances: int = 0
    units_total: int | None = None
    audio_total_s: float | None = None
    units_done: int = 0
    units_resumed: int = 0
    audio_done_s: float = 0.0
    audio_resumed_s: float = 0.0
    resumed_uncounted: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def rtf(self) -> float:
        """Audio seconds processed in this run per wall second (real-time factor)."""
        elapsed = time.monotonic() - self.started
        return (self.audio_done_s / max(self.n_ops, 1)) / elapsed if elapsed > 0 else 0.0

    def add_resumed(self, op: str, failed: int, audio_s: float) -> None:
        """A shard an earlier run did, as its file says (`failed` rows, `audio_s` of the rest)."""
        self.audio_resumed_s += audio_s
        self.failed[op] = self.failed.get(op, 0) + failed

    def failed_by_op(self, asked: Sequence[str] = ()) -> dict[str, int]:
        """Failures per op as the summary table counts them: an `extract` task's failed row is a
        failure of each op asked (`asked`: the run's ops, when known)."""
        stands_for = [op for op in asked if op != "extract"]
        by_op: dict[str, int] = {}
        for op, n in self.failed.items():
            for each in stands_for if op == "extract" and stands_for else [op]:
                by_op[each] = by_op.get(each, 0) + n
        return by_op

    def line(self, asked: Sequence[str] = ()) -> str:
        n_ops = max(self.n_ops, 1)
        total = "…" if self.units_total is None else str(self.units_total // n_ops)
        parts = [f"{self.units_done // n_ops}/{total} {self.unit}"]
        if self.unit == "tars":
            parts[0] += f" ({self.tar_utterances // n_ops} utterances)"
        if self.resumed_uncounted:  # an earlier run's audio is not known: this run's, said so
            audio_s, label = self.audio_done_s / n_ops, "audio in this run"
        else:
            audio_s = (self.audio_done_s + self.audio_resumed_s) / n_ops
            label = f"of {audio_amount(self.audio_total_s)} audio" if self.audio_total_s else "audio"
        if audio_s > 0:
            parts.append(f"{audio_amount(audio_s)} {label}")
            if self.audio_done_s > 0:
                parts.append(f"{self.rtf():.1f}x real time")
        elif self.audio_total_s:
            parts.append(f"{audio_amount(self.audio_total_s)} audio")
        failed = ", ".join(f"{n} {op}" for op, n in self.failed_by_op(asked).items() if n)
        if self.units_resumed and self.units_resumed == self.units_done:
            parts.append("all done by an earlier run")
            if failed:
                parts.append(f"failed: {failed}")
        else:
            parts.append(f"failed: {failed}" if failed else "none failed")
        return ", ".join(parts)

    def snapshot(self) -> Counts:
        """A copy that later counting does not change."""
        return replace(self, failed=dict(self.failed))


@dataclass(frozen=True)
class RunRound:
    """What a round of the driver ends with: the counts so far, the shards in flight, the plan."""

    counts: Counts
    in_flight: int
    plan: PlanProgress


class RunHooks:
    """Every moment of a corpus run a watcher may act on (the driver calls them in this order of
    life: `run_started`, then per shard and per round, then `run_ended`)."""

    def run_started(self) -> None:
        """Before the first round; a watcher that cannot start raises a `RunError` here."""

    def shard_done(self, spec: ShardSpec, result: ShardResult, shard_file: Path | str) -> None:
        """A shard of this run has its file (a given-up shard: the file that says so)."""

    def shard_resumed(self, spec: ShardSpec) -> None:
        """A shard an earlier run of the same folder did."""

    def shard_resubmitted(self, spec: ShardSpec) -> None:
        """A shard was sent again (late, or announced without its file)."""

    def message(self, text: str) -> None:
        """Something the person running the extraction should read."""

    def round_ended(self, now: RunRound) -> None:
        """After every round of the driver."""

    def run_ended(self) -> None:
        """The run is over (done or stopped)."""


class HookList(RunHooks):
    """Several watchers as one: each hook called on each, in order."""

    def __init__(self, hooks: Sequence[RunHooks]) -> None:
        self.hooks = tuple(hooks)

    def run_started(self) -> None:
        for hook in self.hooks:
            hook.run_started()

    def shard_done(self, spec: ShardSpec, result: ShardResult, shard_file: Path | str) -> None:
        for hook in self.hooks:
            hook.shard_done(spec, result, shard_file)

    def shard_resumed(self, spec: ShardSpec) -> None:
        for hook in self.hooks:
            hook.shard_resumed(spec)

    def shard_resubmitted(self, spec: ShardSpec) -> None:
        for hook in self.hooks:
            hook.shard_resubmitted(spec)

    def message(self, text: str) -> None:
        for hook in self.hooks:
            hook.message(text)

    def round_ended(self, now: RunRound) -> None:
        for hook in self.hooks:
            hook.round_ended(now)

    def run_ended(self) -> None:
        for hook in self.hooks:
            hook.run_ended()
