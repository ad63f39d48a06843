"""What `voxmill status` reports, read straight from Redis: queues, workers, models, corpus runs in
progress, throughput."""

from __future__ import annotations

import time
from typing import Any

import redis

from pipeline.records import ROLES
from workers.heartbeat import WorkerRecord, read_worker_records
from workers.keys import QUEUES
from workers.observe.run_metrics import runs_in_progress
from workers.queue.delivery import queues_without_consumer
from workers.reload import generations

STATUS_VERSION = 1
# Fields of the generation, rejection and candidate records that are numbers (Redis stores text).
INTEGER_FIELDS = ("generation", "size", "count")
TIME_FIELDS = ("time", "since", "validate_s")


def typed(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A record as JSON with numbers as numbers: counts and sizes int, times epoch seconds (float)."""
    if not record:
        return None
    out: dict[str, Any] = dict(record)
    for name in INTEGER_FIELDS:
        if out.get(name) not in (None, ""):
            out[name] = int(out[name])
    for name in TIME_FIELDS:
        if out.get(name) not in (None, ""):
            out[name] = float(out[name])
    return out


def model_status(client: redis.Redis, workers: list[WorkerRecord]) -> dict[str, Any]:
    """Per role: the published generation, the last rejection, the candidates being validated
    (one per machine at most), which workers serve which sha256, and the workers that failed to
    load the published generation (with their reason)."""
    models: dict[str, Any] = {}
    for role in ROLES:
        serving: dict[str, list[str]] = {}
        failures: dict[str, Any] = {}
        for worker in workers:
            model = worker.models.get(role)
            if model:
                serving.setdefault(model["sha256"], []).append(worker.worker_id)
            failure = worker.reload_failures.get(role)
            if failure:
                failures[worker.worker_id] = failure
        models[role] = {
            "published": typed(generations.published(client, role)),
            "last_rejection": typed(generations.last_rejection(client, role)),
            "validating": [typed(c) for c in generations.candidates(client, role)],
            "serving": serving,
            "reload_failures": failures,
        }
    return models


def collect_status(client: redis.Redis) -> dict[str, Any]:
    """The whole picture as one JSON-ready dict (the shape `voxmill status --json` prints)."""
    workers = read_worker_records(client)
    queues = {queue: int(client.llen(queue)) for queue in QUEUES}
    return {
        "version": STATUS_VERSION,
        "time": time.time(),
        "queues": queues,
        "queues_without_consumer": queues_without_consumer(queues, workers),
        "workers": [worker.to_dict() for worker in workers],
        "models": model_status(client, workers),
        "runs": runs_in_progress(client),
        "throughput": {
            "tasks_last_minute": sum(w.tasks_last_minute for w in workers),
            "per_second": round(sum(w.tasks_last_minute for w in workers) / 60.0, 3),
        },
    }
