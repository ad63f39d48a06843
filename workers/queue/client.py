"""The producer client: submit audio by path or by bytes, get contract results back as data.

    client = Client(settings)
    for result in client.as_completed(client.submit_many("tokenize", ["a.wav", "b.wav"]), timeout_s=60):
        print(result.input, result.speech_token or result.error)

Results are read in batches (one MGET for all pending jobs) and deleted once read, so Redis
does not keep them until they expire. The client does not sleep between reads: Celery's Redis
backend publishes each stored result on a channel named as its key, and the client listens on
the pending jobs' channels (`ResultWakeups`) and reads the announced ones as soon as they are
announced; every `poll_s` without an announcement it reads them all, so a lost announcement
costs at most `poll_s`, never a result. A broker
outage while waiting is ridden out with backoff until the deadline (listening resumes after it);
what has not come back by then is a `timeout` error, which says why when it can.

Every job is answered once (`workers.queue.delivery` decides, this module looks and acts):
- A bytes job over `max_payload_bytes` is answered `too_large` by `submit` itself: nothing is
  sent, and its result comes back in its place among the others.
- `submit` raises `NoConsumer` when no live worker consumes the job's queue (the heartbeat
  records (`workers.heartbeat`) say which queues each process consumes).
- A job that every live consumer of its queue cannot run (a model it needs failed to load) is
  answered at once with `model_error` and the workers' reasons.
- Each pending job keeps what was sent (its path or its bytes) until its result is read. A job
  late past its deadline that is in no queue and that no live worker runs (lost with a killed
  worker or with a Redis restart) is sent again under the same task id. Workers store only the
  first final result of a task id (`workers.queue.app.FirstResultWins`) and the client reads a
  job's result once, so a job that ran twice is still answered once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from pipeline import tuning
from pipeline.errors import (
    INTERNAL,
    MODEL_ERROR,
    NO_BROKER,
    NO_CONSUMER,
    NOT_FOUND,
    TIMEOUT,
    TOO_LARGE,
    UNREADABLE,
    ErrorRecord,
    VoxmillError,
)
from pipeline.records import OPS, TaskResult
from pipeline.settings import Settings
from pipeline.storage.urls import is_url, mend_url
from workers import keys
from workers.heartbeat import read_worker_records
from workers.queue import connections
from workers.queue.app import TASK_NAMES, create_app
from workers.queue.delivery import (
    RESEND,
    Delivery,
    WorkerView,
    absence,
    consumer_missing,
    deadline_s,
    late_reason,
    queues_without_consumer,
    start_command,
    verdict,
)
from workers.queue.wakeups import ResultWakeups

log = logging.getLogger("voxmill.client")


def read_payload(path: Path, op: str, max_payload_bytes: int) -> tuple[bytes, TaskResult | None]:
    """The bytes of `path` to send, or an error result when it cannot or must not be sent.

    Refuses before reading: anything but a regular file (a FIFO would block) and files over
    the payload limit (the worker would refuse them after they crossed Redis).
    """
    import os
    import stat

    def refused(code: str, message: str) -> tuple[bytes, TaskResult]:
        return b"", TaskResult(input=str(path), op=op, error=ErrorRecord(code, message))

    try:
        info = os.stat(path)
    except FileNotFoundError:
        return refused(NOT_FOUND, f"no such file: {path}")
    except OSError as exc:
        return refused(UNREADABLE, f"cannot read {path}: {exc.strerror}")
    if not stat.S_ISREG(info.st_mode):
        return refused(UNREADABLE, f"{path} is not a regular file")
    if (too_large := payload_refusal(op, str(path), info.st_size, max_payload_bytes)) is not None:
        return b"", too_large
    try:
        return path.read_bytes(), None
    except OSError as exc:
        return refused(UNREADABLE, f"cannot read {path}: {exc.strerror}")


def payload_refusal(op: str, label: str, size: int, max_payload_bytes: int) -> TaskResult | None:
    """The `too_large` result of a bytes job of `size` bytes over the limit (in the worker's words),
    else None."""
    if size <= max_payload_bytes:
        return None
    from pipeline.units import format_bytes  # only a refused job needs the words

    message = f"payload is {format_bytes(size)}; the limit is {format_bytes(max_payload_bytes)}"
    return TaskResult(input=label, op=op, error=ErrorRecord(TOO_LARGE, message))



class BrokerNotConfigured(VoxmillError):
    """No broker URL: says exactly what to set or run."""

    def __init__(self) -> None:
        super().__init__(
            NO_BROKER,
            "no broker configured: set VOXMILL_BROKER_URL (for example redis://127.0.0.1:6379/0), "
            "or start a local cluster with `voxmill up` and export the URL it prints"
        )


class NoConsumer(VoxmillError):
    """No live worker consumes the queue a job needs: says which, and the command that starts one."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.command = start_command(queue)
        message = f"no live worker consumes the {queue} queue: start one with {self.command}"
        super().__init__(NO_CONSUMER, message)


@dataclass(frozen=True)
class Job:
    """One submitted input: its label, op and task id, and what was sent (to send it again).

    `answer`: the result the producer gave it without sending anything (a payload over the
    limit); `completed` yields it at once.
    """

    label: str
    op: str
    id: str
    payload: Any = field(default=None, repr=False, compare=False)
    serializer: str = field(default="json", repr=False, compare=False)
    sent_at: float = field(default_factory=time.monotonic, repr=False, compare=False)
    answer: TaskResult | None = field(default=None, repr=False, compare=False)


def timed_out(job: Job, timeout_s: float, reason: str = "") -> TaskResult:
    """The `timeout` error result of a job with no result by the deadline (and why, if known)."""
    message = f"no result within {timeout_s:g} s" + (f"; {reason}" if reason else "")
    return TaskResult(input=job.label, op=job.op, error=ErrorRecord(TIMEOUT, message))


def queued_ids(client: redis.Redis, queue: str, wanted: set[str]) -> set[str]:
    """Which of the task ids `wanted` are waiting in `queue` (a Redis list, oldest at its end).

    Read from the oldest end, in batches, until every one is found; a queue longer than
    `tuning.QUEUE_SCAN_MAX` is not read to its end, and the ids not found count as queued (a job
    is sent again only when it is surely missing).
    """
    found: set[str] = set()
    length = int(client.llen(queue))
    end = min(length, tuning.QUEUE_SCAN_MAX)
    for start in range(0, end, tuning.QUEUE_SCAN_BATCH):
        stop = min(start + tuning.QUEUE_SCAN_BATCH, end)
        for raw in client.lrange(queue, -stop, -start - 1):
            task_id = message_task_id(raw)
            if task_id in wanted:
                found.add(task_id)
        if found >= wanted:
            return found
    return found if length <= tuning.QUEUE_SCAN_MAX else set(wanted)


def message_task_id(raw: bytes | str) -> str | None:
    """The task id in the headers of a queued kombu message (its JSON envelope), or None."""
    try:
        headers = json.loads(raw).get("headers") or {}
    except (ValueError, AttributeError):
        return None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return str(task_id) if task_id else None


def queues_to_mark(client: redis.Redis) -> list[str]:
    """`queues_without_consumer` of what Redis holds now: the queues with jobs and no live consumer."""
    depths = {queue: int(client.llen(queue)) for queue in keys.QUEUES}
    return queues_without_consumer(depths, read_worker_records(client))


class Client:
    """Submits jobs to voxmill workers and collects their results, each exactly once."""

    def __init__(
        self,
        settings: Settings,
        app: Celery | None = None,
        wakeups: bool = True,
        check_consumers: bool = True,
    ) -> None:
        """`wakeups` False: read results every `poll_s` only (no pub/sub connection).
        `check_consumers` False: submit without looking for a live consumer first."""
        if not settings.broker_url:
            raise BrokerNotConfigured()
        self.app = app or create_app(settings, polled_results=True)
        self.settings = settings
        self.wakeups = wakeups
        self.check_consumers = check_consumers
        self.resent = 0  # jobs sent again because they were lost
        self._broker: redis.Redis | None = None
        self._view: WorkerView | None = None
        self._view_at = -math.inf
        self._absent: dict[str, tuple[float, float]] = {}  # queue -> (since, last look) without consumer
        self._latencies: deque[float] = deque(maxlen=tuning.RECENT_JOBS)

    @property
    def broker(self) -> redis.Redis:
        """This client's connection to the broker: the workers' records and the queues."""
        if self._broker is None:
            self._broker = connections.broker_client(
                self.settings, socket_timeout=5, socket_connect_timeout=5
            )
        return self._broker

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None

    def workers(self, max_age_s: float = 0.0) -> WorkerView:
        """The live workers as their records say, read again when older than `max_age_s`."""
        now = time.monotonic()
        if self._view is None or now - self._view_at > max_age_s:
            self._view = WorkerView.from_records(read_worker_records(self.broker))
            self._view_at = now
        return self._view

    def require_consumer(self, queue: str) -> None:
        """`NoConsumer` unless a live worker consumes `queue`. A queue found without one is looked
        at again for a heartbeat interval first (after a Redis restart the records come back)."""
        confirm_s = self.settings.heartbeat_interval_s + tuning.CONSUMER_CONFIRM_MARGIN_S
        max_age_s = tuning.CONSUMERS_TTL_S
        while True:
            if self.workers(max_age_s).serves(queue):
                self._absent.pop(queue, None)
                return
            self._absent[queue] = absence(self._absent.get(queue), self._view_at, confirm_s)
            if consumer_missing(self._absent[queue], confirm_s):
                raise NoConsumer(queue)
            time.sleep(tuning.RESULT_POLL_S)
            max_age_s = 0.0

    def submit(self, op: str, audio: str | Path | bytes, name: str | None = None) -> Job:
        """Queue one input: a path (sent as its absolute path; workers read it), a URL (s3://...) or
        raw bytes. Its result's `input` is `name`, else the path or URL as given.

        Bytes over `max_payload_bytes` are not sent: the job is answered `too_large` here.
        `NoConsumer` when no live worker consumes the op's queue (nothing is sent then)."""
        if op not in TASK_NAMES:
            raise ValueError(f"op must be one of {', '.join(OPS)}, not {op!r}")
        if isinstance(audio, (bytes, bytearray)):
            label = name or "<bytes>"
            refused = payload_refusal(op, label, len(audio), self.settings.max_payload_bytes)
            if refused is not None:
                return Job(label=label, op=op, id=f"refused-{uuid.uuid4()}", answer=refused)
            payload: dict[str, Any] = {"audio": bytes(audio), "name": label}
            serializer = "msgpack"
        else:
            label = name or str(audio)
            where = mend_url(audio)  # a URL given as a Path (`s3:/bucket/x.wav`) is a URL again
            payload = {"path": where if is_url(where) else str(Path(where).absolute())}
            serializer = "json"
        if self.check_consumers:
            self.require_consumer(op)
        sent = self.app.send_task(TASK_NAMES[op], args=[payload], serializer=serializer, queue=op)
        return Job(label=label, op=op, id=str(sent.id), payload=payload, serializer=serializer)

    def submit_many(self, op: str, inputs: Iterable[str | Path | bytes]) -> list[Job]:
        """Queue many inputs; jobs come back in input order."""
        return [self.submit(op, audio) for audio in inputs]

    def as_completed(
        self, jobs: list[Job], timeout_s: float = 300.0, poll_s: float = tuning.RESULT_POLL_S
    ) -> Iterator[TaskResult]:
        """Yield each result as it completes; jobs still pending at the deadline give a `timeout` error."""
        for _, result in self.completed(jobs, timeout_s, poll_s):
            yield result

    def completed(
        self, jobs: list[Job], timeout_s: float = 300.0, poll_s: float = tuning.RESULT_POLL_S
    ) -> Iterator[tuple[Job, TaskResult]]:
        """Like `as_completed`, with each result's job."""
        for job in jobs:
            if job.answer is not None:  # answered by `submit`: never sent
                yield job, job.answer
        sent = [job for job in jobs if job.answer is None]
        if sent:
            yield from self._collect(sent, timeout_s, poll_s)

    def _collect(self, jobs: list[Job], timeout_s: float, poll_s: float) -> Iterator[tuple[Job, TaskResult]]:
        """The results of sent `jobs` as they come back; `timeout` errors for those late at the deadline."""
        backend = self.app.backend
        pending = {backend.get_key_for_task(job.id): job for job in jobs}
        deliveries = {job.id: Delivery(job.op, job.sent_at) for job in jobs}
        deadline = time.monotonic() + timeout_s
        wakeups = ResultWakeups(backend.client) if self.wakeups else None
        announced: set[Any] = set()  # keys announced since the last read
        full_read_at = 0.0  # read every pending job then (and whenever nothing was announced)
        looked_at = -math.inf
        backoff = poll_s
        try:
            while pending:
                if wakeups is not None and not wakeups.listening:
                    wakeups.follow(list(pending))
                now = time.monotonic()
                if announced and now < full_read_at:
                    wanted = [pending[key] for key in announced if key in pending]
                else:
                    wanted, full_read_at = list(pending.values()), now + poll_s
                ready = self._read(wanted, wakeups)
                backoff = poll_s if ready is not None else min(max(backoff * 2, 0.5), 5.0)
                answered = ready or []
                if ready is not None and time.monotonic() - looked_at >= tuning.LOOK_S:
                    jobs_now = list(pending.values())
                    answered, looked_at = self._answered(answered, jobs_now, deliveries, looked_at)
                for job, result in answered:
                    del pending[backend.get_key_for_task(job.id)]
                    yield job, result
                if pending and time.monotonic() > deadline:
                    for job in pending.values():
                        reason = late_reason(job.op, self._view, deliveries.get(job.id))
                        yield job, timed_out(job, timeout_s, reason)
                    return
                if pending:
                    wait_s = min(backoff, max(0.0, deadline - time.monotonic()) + 0.001)
                    if wakeups is not None:
                        announced = {channel for channel, _ in wakeups.wait(wait_s)}
                    elif not ready:
                        time.sleep(wait_s)
        finally:
            if wakeups is not None:
                wakeups.close()

    def _answered(
        self,
        ready: list[tuple[Job, TaskResult]],
        pending: list[Job],
        deliveries: dict[str, Delivery],
        looked_at: float,
    ) -> tuple[list[tuple[Job, TaskResult]], float]:
        """The results read, their latencies noted, plus what a look at the jobs pending a while
        answers (`_look`); and when this look was (the last one's time when none was needed)."""
        now = time.monotonic()
        for job, _ in ready:
            self._latencies.append(now - deliveries[job.id].sent_at)
        done = {job.id for job, _ in ready}
        late = [j for j in pending if j.id not in done and now - deliveries[j.id].sent_at >= tuning.LOOK_S]
        if not late:
            return ready, looked_at
        return [*ready, *self._look(late, deliveries)], now

    def _look(self, late: list[Job], deliveries: dict[str, Delivery]) -> list[tuple[Job, TaskResult]]:
        """Look at jobs pending a while: answer those no live worker can run (`model_error`), send
        again those that are lost. Redis in trouble: nothing now, the next look tries again."""
        try:
            view = self.workers()
            reasons = {op: view.unservable(op) for op in dict.fromkeys(job.op for job in late)}
            answered = []
            for job in late:
                reason = reasons[job.op]
                if reason is not None:
                    error = ErrorRecord(MODEL_ERROR, reason)
                    answered.append((job, TaskResult(input=job.label, op=job.op, error=error)))
            self._redeliver([job for job in late if reasons[job.op] is None], deliveries, view)
            return answered
        except (redis.RedisError, OperationalError, OSError) as exc:
            log.warning("broker unreachable while looking at late jobs (%s); looking again later", exc)
            return []

    def _redeliver(self, jobs: Sequence[Job], deliveries: dict[str, Delivery], view: WorkerView) -> None:
        """Send again every job that is late, queued nowhere and running nowhere (on two looks)."""
        settings = self.settings
        base_s = deadline_s(list(self._latencies), settings.job_deadline_min_s, settings.job_deadline_factor)
        now = time.monotonic()
        overdue = [j for j in jobs if j.payload is not None and deliveries[j.id].overdue(now, base_s)]
        if not overdue:
            return
        queued: set[str] = set()
        for queue in dict.fromkeys(job.op for job in overdue):
            wanted = {job.id for job in overdue if job.op == queue and job.id not in view.running}
            if wanted:
                queued |= queued_ids(self.broker, queue, wanted)
        confirm_s = settings.heartbeat_interval_s + tuning.CONSUMER_CONFIRM_MARGIN_S
        for job in overdue:
            delivery = deliveries[job.id]
            running = job.id in view.running
            step, updated = verdict(delivery, now, base_s, job.id in queued, running, confirm_s)
            if step == RESEND:
                self._send_again(job, delivery, now)
            deliveries[job.id] = updated

    def _send_again(self, job: Job, delivery: Delivery, now: float) -> None:
        log.warning(
            "job %s (%s %s) has no result after %.0f s, is in no queue and no live worker runs it: "
            "sending it again (attempt %d)",
            job.id,
            job.op,
            job.label,
            now - delivery.sent_at,
            delivery.attempts + 1,
        )
        self.app.send_task(
            TASK_NAMES[job.op], args=[job.payload], serializer=job.serializer, queue=job.op, task_id=job.id
        )
        self.resent += 1

    def run(
        self, op: str, inputs: Iterable[str | Path | bytes], timeout_s: float = 300.0
    ) -> list[TaskResult]:
        """Submit and wait; results in input order."""
        return self.wait_all(self.submit_many(op, inputs), timeout_s)

    def wait_all(self, jobs: list[Job], timeout_s: float = 300.0) -> list[TaskResult]:
        """Results of `jobs`, in the order of `jobs`."""
        by_id = {job.id: result for job, result in self.completed(jobs, timeout_s)}
        return [by_id[job.id] for job in jobs]

    def _read(self, jobs: list[Job], wakeups: ResultWakeups | None) -> list[tuple[Job, TaskResult]] | None:
        """`_poll`; None when the broker is unreachable (logged; the wake-ups are dropped)."""
        try:
            return self._poll(jobs)
        except (redis.RedisError, OperationalError, OSError) as exc:
            log.warning("broker unreachable while waiting for results (%s); retrying", exc)
            if wakeups is not None:
                wakeups.close()
            return None

    def _poll(self, jobs: list[Job]) -> list[tuple[Job, TaskResult]]:
        """One MGET per batch of pending jobs; ready results are decoded and deleted."""
        backend = self.app.backend
        ready: list[tuple[Job, TaskResult]] = []
        for start in range(0, len(jobs), tuning.RESULT_READ_BATCH):
            batch = jobs[start : start + tuning.RESULT_READ_BATCH]
            keys = [backend.get_key_for_task(job.id) for job in batch]
            done_keys = []
            for job, key, raw in zip(batch, keys, backend.mget(keys), strict=True):
                if raw is None:
                    continue
                meta = backend.decode_result(raw)
                if meta.get("status") not in ("SUCCESS", "FAILURE", "REVOKED"):
                    continue
                ready.append((job, self._result_of(job, meta)))
                done_keys.append(key)
            if done_keys:
                backend.client.delete(*done_keys)
        return ready

    @staticmethod
    def _result_of(job: Job, meta: dict[str, Any]) -> TaskResult:
        value = meta.get("result")
        if meta.get("status") == "SUCCESS" and isinstance(value, dict):
            return dataclasses.replace(TaskResult.from_dict(value), input=job.label)  # as the user gave it
        message = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else str(value)
        return TaskResult(input=job.label, op=job.op, error=ErrorRecord(INTERNAL, message))
