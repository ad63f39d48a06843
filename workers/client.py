"""The producer client: submit audio by path or by bytes, get contract results back as data.

client = Client(settings)
for result in client.as_completed(client.submit_many("tokenize", ["a.wav", "b.wav"]), timeout_s=60):
    print(result.input, result.speech_token or result.error)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from pipeline.records import OPS, TaskResult
from pipeline.settings import Settings

TIMEOUT_CODE = "timeout"
TASK_NAMES = {op: f"voxmill.{op}" for op in OPS}


class BrokerNotConfigured(RuntimeError):
    """No broker URL: says exactly what to set or run."""

    def __init__(self) -> None:
        super().__init__(
            "no broker configured: set VOXMILL_BROKER_URL (for example redis://127.0.0.1:6379/0), "
            "or start a local cluster with `voxmill up` and export the URL it prints"
        )


@dataclass
class Job:
    """One submitted input: its label, op and Celery result handle."""

    label: str
    op: str
    result: AsyncResult

    @property
    def id(self) -> str:
        return str(self.result.id)


class Client:
    """Submits jobs to voxmill workers and collects their results."""

    def __init__(self, settings: Settings, app: Celery | None = None) -> None:
        if not settings.broker_url:
            raise BrokerNotConfigured()
        if app is None:
            from workers.app import create_app

            app = create_app(settings)
        self.app = app
        self.settings = settings

    def submit(self, op: str, audio: str | Path | bytes, name: str | None = None) -> Job:
        """Queue one input: a path (sent as its absolute path; workers read it) or raw bytes."""
        if op not in TASK_NAMES:
            raise ValueError(f"op must be one of {', '.join(OPS)}, not {op!r}")
        if isinstance(audio, (bytes, bytearray)):
            label = name or "<bytes>"
            payload: dict[str, Any] = {"audio": bytes(audio), "name": label}
            serializer = "msgpack"
        else:
            label = str(audio)
            payload = {"path": str(Path(audio).absolute())}
            serializer = "json"
        result = self.app.send_task(TASK_NAMES[op], args=[payload], serializer=serializer, queue=op)
        return Job(label=label, op=op, result=result)

    def submit_many(self, op: str, inputs: Iterable[str | Path | bytes]) -> list[Job]:
        """Queue many inputs; jobs come back in input order."""
        return [self.submit(op, audio) for audio in inputs]

    def as_completed(
        self, jobs: list[Job], timeout_s: float = 300.0, poll_s: float = 0.02
    ) -> Iterator[TaskResult]:
        """Yield each result as it completes; jobs still pending at the deadline give a `timeout` error."""
        pending = list(jobs)
        deadline = time.monotonic() + timeout_s
        while pending:
            still = []
            for job in pending:
                if job.result.ready():
                    yield self._result_of(job)
                else:
                    still.append(job)
            pending = still
            if pending and time.monotonic() > deadline:
                for job in pending:
                    yield TaskResult(
                        input=job.label,
                        op=job.op,
                        error={"code": TIMEOUT_CODE, "message": f"no result within {timeout_s:g} s"},
                    )
                return
            if pending:
                time.sleep(poll_s)

    def run(
        self, op: str, inputs: Iterable[str | Path | bytes], timeout_s: float = 300.0
    ) -> list[TaskResult]:
        """Submit and wait; results in input order."""
        jobs = self.submit_many(op, inputs)
        by_id = {}
        for job, result in zip(jobs, self._collect(jobs, timeout_s), strict=True):
            by_id[job.id] = result
        return [by_id[job.id] for job in jobs]

    def _collect(self, jobs: list[Job], timeout_s: float) -> list[TaskResult]:
        order = {job.id: i for i, job in enumerate(jobs)}
        results: list[TaskResult | None] = [None] * len(jobs)
        labels = {job.label: job for job in jobs}
        for result in self.as_completed(jobs, timeout_s):
            job = labels.get(result.input)
            index = order[job.id] if job is not None else results.index(None)
            results[index] = result
        return [r for r in results if r is not None]

    def _result_of(self, job: Job) -> TaskResult:
        try:
            value = job.result.get(timeout=1.0, propagate=True)
        except Exception as exc:  # the task raised: report it as data
            return TaskResult(
                input=job.label,
                op=job.op,
                error={"code": "internal", "message": f"{type(exc).__name__}: {exc}"},
            )
        finally:
            job.result.forget()
        return TaskResult.from_dict(value)
