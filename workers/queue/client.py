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
what has not come back by then is a `timeout` error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from pipeline.records import OPS, TaskResult
from pipeline.settings import Settings
from workers import tuning
from workers.queue.app import TASK_NAMES, create_app
from workers.queue.wakeups import ResultWakeups

log = logging.getLogger("voxmill.client")
TIMEOUT_CODE = "timeout"


def read_payload(path: Path, op: str, max_payload_bytes: int) -> tuple[bytes, TaskResult | None]:
    """The bytes of `path` to send, or an error result when it cannot or must not be sent.

    Refuses before reading: anything but a regular file (a FIFO would block) and files over
    the payload limit (the worker would refuse them after they crossed Redis).
    """
    import os
    import stat

    def refused(code: str, message: str) -> tuple[bytes, TaskResult]:
        return b"", TaskResult(input=str(path), op=op, error={"code": code, "message": message})

    try:
        info = os.stat(path)
    except FileNotFoundError:
        return refused("not_found", f"no such file: {path}")
    except OSError as exc:
        return refused("unreadable", f"cannot read {path}: {exc.strerror}")
    if not stat.S_ISREG(info.st_mode):
        return refused("unreadable", f"{path} is not a regular file")
    if info.st_size > max_payload_bytes:
        limit_mb = max_payload_bytes / 2**20
        return refused(
            "too_large",
            f"file is {info.st_size / 2**20:.1f} MB; jobs by bytes take at most {limit_mb:.0f} MB",
        )
    try:
        return path.read_bytes(), None
    except OSError as exc:
        return refused("unreadable", f"cannot read {path}: {exc.strerror}")


class BrokerNotConfigured(RuntimeError):
    """No broker URL: says exactly what to set or run."""

    def __init__(self) -> None:
        super().__init__(
            "no broker configured: set VOXMILL_BROKER_URL (for example redis://127.0.0.1:6379/0), "
            "or start a local cluster with `voxmill up` and export the URL it prints"
        )


@dataclass(frozen=True)
class Job:
    """One submitted input: its label, op and task id."""

    label: str
    op: str
    id: str


def timed_out(job: Job, timeout_s: float) -> TaskResult:
    """The `timeout` error result of a job with no result by the deadline."""
    message = f"no result within {timeout_s:g} s"
    return TaskResult(input=job.label, op=job.op, error={"code": TIMEOUT_CODE, "message": message})


class Client:
    """Submits jobs to voxmill workers and collects their results."""

    def __init__(self, settings: Settings, app: Celery | None = None, wakeups: bool = True) -> None:
        """`wakeups` False: read results every `poll_s` only (no pub/sub connection)."""
        if not settings.broker_url:
            raise BrokerNotConfigured()
        self.app = app or create_app(settings, polled_results=True)
        self.settings = settings
        self.wakeups = wakeups

    def submit(self, op: str, audio: str | Path | bytes, name: str | None = None) -> Job:
        """Queue one input: a path (sent as its absolute path; workers read it) or raw bytes."""
        if op not in TASK_NAMES:
            raise ValueError(f"op must be one of {', '.join(OPS)}, not {op!r}")
        if isinstance(audio, (bytes, bytearray)):
            label = name or "<bytes>"
            payload: dict[str, Any] = {"audio": bytes(audio), "name": label}
            serializer = "msgpack"
        else:
            label = name or str(audio)
            payload = {"path": str(Path(audio).absolute())}
            serializer = "json"
        sent = self.app.send_task(TASK_NAMES[op], args=[payload], serializer=serializer, queue=op)
        return Job(label=label, op=op, id=str(sent.id))

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
        backend = self.app.backend
        pending = {backend.get_key_for_task(job.id): job for job in jobs}
        deadline = time.monotonic() + timeout_s
        wakeups = ResultWakeups(backend.client) if self.wakeups else None
        announced: set[Any] = set()  # keys announced since the last read
        full_read_at = 0.0  # read every pending job then (and whenever nothing was announced)
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
                for job, result in ready or []:
                    del pending[backend.get_key_for_task(job.id)]
                    yield job, result
                if pending and time.monotonic() > deadline:
                    for job in pending.values():
                        yield job, timed_out(job, timeout_s)
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
            return TaskResult.from_dict(value)
        message = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else str(value)
        return TaskResult(input=job.label, op=job.op, error={"code": "internal", "message": message})
