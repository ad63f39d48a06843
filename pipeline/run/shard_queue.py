"""What a corpus run asks of the workers that do its shards: the port the workers' side implements
over its broker (`workers.corpus.shard_queue.CeleryShardQueue`).

The run starts them (its own local workers, or workers anywhere on a broker), sends each shard as
a task, hears the shards announced done, asks whether the work can go on, and stops them once
every shard file exists. What it hears is a hint: a shard is done when its file exists.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.records import ShardResult, ShardSpec


@dataclass(frozen=True)
class ReadyWorkers:
    """The worker processes a run's shards are cut for (None: not known), and whether every one
    serves `extract` (then both ops of a shard run as one task)."""

    processes: int | None
    serve_extract: bool


class ShardQueue(Protocol):
    """The workers of one corpus run, reached through a queue."""

    # Workers anywhere on a broker, not the run's own (a failure's message says how to reach them).
    remote: bool
    # What an outage of the broker raises: the run waits for it to come back.
    outage: tuple[type[Exception], ...]

    def start(self) -> ReadyWorkers:
        """Start the run's workers, or reach those on the broker; `RunError` when it cannot."""
        ...

    @property
    def following(self) -> bool:
        """Whether the announcements of a run's shards are heard (an outage drops them)."""
        ...

    def follow(self, run: str) -> None:
        """Hear the announcements of `run`'s shards from now on."""
        ...

    def wait(self, timeout_s: float) -> list[ShardResult]:
        """The shards announced from now until the first announcement, or after `timeout_s` (none)."""
        ...

    def submit(self, spec: ShardSpec, attempt: int) -> str:
        """Send the shard's task (its `attempt`-th); the task's id."""
        ...

    def check(self, queues: Collection[str]) -> None:
        """`RunError` when the work cannot go on (the run's workers exited; no live worker has
        consumed one of `queues`, where shards wait, for long)."""
        ...

    def require_consumer(self, queue: str, run_queues: Sequence[str]) -> None:
        """Before the first shard goes to `queue`: `RunError` (`no_consumer`) unless a worker
        consumes it, naming every one of `run_queues` without one."""
        ...

    def ready_workers(self) -> int:
        """How many worker processes are ready now."""
        ...

    def running_task_ids(self) -> frozenset[str]:
        """The ids of the tasks live workers run now."""
        ...

    def stop(self, completed: bool = False) -> None:
        """Stop the run's own workers (`completed`: nothing is in flight) and let go of the broker;
        again: nothing."""
        ...
