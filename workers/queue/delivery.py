"""What a producer decides about its jobs, as pure functions of what it saw (no Redis here).

`workers.queue.client.Client` reads the live workers' heartbeat records (`keys.WORKER`), the
queues and the results, and asks these functions:

- **Is there a consumer?** `WorkerView.serves(queue)`: some live worker process consumes the
  queue. A job for a queue nobody serves is refused (`NoConsumer`) once looks spanning a
  heartbeat interval found none (`absence`, `consumer_missing`): right after a Redis restart
  the records are back within one heartbeat interval, so a gap that short refuses nothing. A
  corpus run asks it of its queues (`consumers_gone`): so before its first shard of each, then,
  while shards wait there, with a longer grace (`consumer_grace_s`: workers restart within it).
- **Can a consumer serve it?** `WorkerView.unservable(op)`: every live consumer of the op's
  queue reports a model the op needs as unloadable (its `load_errors`); the job is answered at
  once with `model_error` and those reasons, not left to time out.
- **Is it lost?** `verdict`: a job with no result after its deadline (`deadline_s`: a few times
  the median latency seen, at least a minimum, doubling with each attempt) that is neither in
  its queue nor run by a live worker, on two looks at least `confirm_s` apart (a task that just
  started shows in its record within a heartbeat), is sent again under the same task id. A job
  in a queue, or running, waits however long it takes: sending it again would only run it twice.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeline import tuning
from pipeline.records import ROLES_BY_OP
from workers.heartbeat import WorkerRecord
from workers.keys import QUEUES

WAIT = "wait"  # queued, running, or not late yet
SUSPECT = "suspect"  # late and found nowhere once: look again before sending it again
RESEND = "resend"  # late and found nowhere on two looks: lost; send it again


def start_command(queue: str) -> str:
    """The command that starts a worker for `queue`."""
    if queue == "extract":
        return "voxmill worker -Q extract (or voxmill worker -Q tokenize,embed, which serves extract too)"
    return f"voxmill worker -Q {queue}"


@dataclass(frozen=True)
class WorkerView:
    """The live worker processes, as their heartbeat records describe them."""

    consumers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # queue -> worker ids
    running: frozenset[str] = frozenset()  # ids of the tasks they run
    serving: Mapping[str, frozenset[str]] = field(default_factory=dict)  # worker id -> roles loaded
    load_errors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # worker -> role -> why

    @classmethod
    def from_records(cls, records: Iterable[WorkerRecord]) -> WorkerView:
        consumers: dict[str, list[str]] = {}
        running: set[str] = set()
        serving: dict[str, frozenset[str]] = {}
        errors: dict[str, dict[str, str]] = {}
        for record in records:
            worker = record.worker_id
            for queue in record.queues:
                consumers.setdefault(queue, []).append(worker)
            running.update(record.running)
            serving[worker] = frozenset(record.models)
            errors[worker] = dict(record.load_errors)
        return cls(
            consumers={queue: tuple(workers) for queue, workers in consumers.items()},
            running=frozenset(running),
            serving=serving,
            load_errors=errors,
        )

    def serves(self, queue: str) -> bool:
        return bool(self.consumers.get(queue))

    def unservable(self, op: str) -> str | None:
        """Why no live consumer of `op`'s queue can run it (each lacks a model it could not load),
        or None: some consumer can, or none is known (then the job waits for one)."""
        workers = self.consumers.get(op, ())
        if not workers:
            return None
        reasons = []
        for worker in workers:
            missing = [r for r in ROLES_BY_OP.get(op, ()) if r not in self.serving.get(worker, frozenset())]
            failed = [r for r in missing if r in self.load_errors.get(worker, {})]
            if not failed:
                return None
            reasons.append(f"{worker}: " + "; ".join(f"{r}: {self.load_errors[worker][r]}" for r in failed))
        roles = " and ".join(dict.fromkeys(r for r in ROLES_BY_OP.get(op, ())))
        shown = reasons[: tuning.REASONS_SHOWN]
        more = f" (and {len(reasons) - len(shown)} more)" if len(reasons) > len(shown) else ""
        return f"no live worker of the {op} queue can load its {roles} model: " + " | ".join(shown) + more


def queues_without_consumer(queue_depths: Mapping[str, int], workers: Iterable[WorkerRecord]) -> list[str]:
    """The queues holding jobs that no live worker consumes (what `voxmill status` marks), in
    voxmill's queue order."""
    served = {queue for record in workers for queue in record.queues}
    return in_queue_order(q for q, depth in queue_depths.items() if depth > 0 and q not in served)


def in_queue_order(queues: Iterable[str]) -> list[str]:
    """`queues` sorted as voxmill lists its queues (any other name after them, by name)."""
    order = {queue: index for index, queue in enumerate(QUEUES)}
    return sorted(queues, key=lambda q: (order.get(q, len(order)), q))


def absence(previous: tuple[float, float] | None, now: float, confirm_s: float) -> tuple[float, float]:
    """(since, last) of a queue seen without a consumer now: since the first of the looks that
    found none, unless those looks are more than `confirm_s` apart (then the absence starts now)."""
    if previous is None or now - previous[1] > confirm_s:
        return (now, now)
    return (previous[0], now)


def consumer_missing(absent: tuple[float, float] | None, confirm_s: float) -> bool:
    """Whether a queue has no consumer for good: looks spanning at least `confirm_s` (a heartbeat
    interval and a margin: every live process rewrites its record that often) found none."""
    return absent is not None and absent[1] - absent[0] >= confirm_s


def consumers_gone(
    queues: Iterable[str],
    view: WorkerView,
    absent: Mapping[str, tuple[float, float]],
    now: float,
    grace_s: float,
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """One look at the consumers of `queues` (a corpus run's): the absences kept for the next look
    (`absence`, for each queue found without a live consumer; a served queue's is dropped) and the
    queues without one for `grace_s` (`consumer_missing`), in voxmill's queue order.

    A run asks with `grace_s` a heartbeat interval before its first shard of a queue (as `submit`
    does), and with `consumer_grace_s` later (workers restarting come back within it).
    """
    kept = {q: absence(absent.get(q), now, grace_s) for q in dict.fromkeys(queues) if not view.serves(q)}
    return kept, in_queue_order(q for q, seen in kept.items() if consumer_missing(seen, grace_s))


def no_consumer_message(queues: Sequence[str]) -> str:
    """What a producer says of `queues` that no live worker consumes: each, and the command that
    starts a worker for it."""
    said = [f"no live worker consumes the {q} queue: start one with {start_command(q)}" for q in queues]
    return "; ".join(said)


def deadline_s(latencies_s: Sequence[float], minimum_s: float, factor: float) -> float:
    """How long a job may go without a result before it is looked for: `factor` times the
    median latency seen, at least `minimum_s` (a burst of jobs served in order never reaches
    it: the job waiting longest has waited about twice the median of those answered)."""
    if not latencies_s:
        return minimum_s
    return max(minimum_s, factor * float(statistics.median(latencies_s)))


@dataclass(frozen=True)
class Delivery:
    """The producer's record of one pending job: its queue, when it was last sent, how often,
    when a look last found it queued or running, and since when looks find it nowhere."""

    queue: str
    sent_at: float
    attempts: int = 1
    missing_since: float | None = None
    seen_at: float | None = None

    def deadline_s(self, base_s: float) -> float:
        """This attempt's deadline: the base, doubled for each attempt after the first (bounded)."""
        return base_s * float(min(2 ** (self.attempts - 1), tuning.MAX_DEADLINE_DOUBLINGS))

    def overdue(self, now: float, base_s: float) -> bool:
        """Late, and not seen queued or running within a deadline: a job found waiting is looked
        for again only a deadline later (a long queue is not read at every look)."""
        since = self.sent_at if self.seen_at is None else max(self.sent_at, self.seen_at)
        return now - since > self.deadline_s(base_s)

    def resent(self, now: float) -> Delivery:
        return Delivery(self.queue, now, self.attempts + 1)


def verdict(
    delivery: Delivery, now: float, base_s: float, queued: bool, running: bool, confirm_s: float
) -> tuple[str, Delivery]:
    """WAIT, SUSPECT or RESEND for a job without a result, and its updated record.

    `queued`: the job's message is in its queue (or a look could not tell); `running`: a live
    worker's record names it.
    """
    if queued or running:
        return WAIT, replace(delivery, missing_since=None, seen_at=now)
    if not delivery.overdue(now, base_s):
        return WAIT, delivery
    if delivery.missing_since is None:
        return SUSPECT, replace(delivery, missing_since=now)
    if now - delivery.missing_since >= confirm_s:
        return RESEND, delivery.resent(now)
    return SUSPECT, delivery


def late_reason(op: str, view: WorkerView | None, delivery: Delivery | None) -> str:
    """What a producer that gives up on a job says besides the timeout itself."""
    parts = []
    if view is not None and not view.serves(op):
        parts.append(f"no live worker consumes the {op} queue: start one with {start_command(op)}")
    elif view is not None and (unservable := view.unservable(op)):
        parts.append(unservable)
    if delivery is not None and delivery.attempts > 1:
        parts.append(f"sent {delivery.attempts} times")
    return "; ".join(parts)
