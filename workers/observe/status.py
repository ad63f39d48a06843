"""What `voxmill status` reports, read straight from Redis: queues, workers, models, corpus runs in
progress, throughput."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from pipeline.records import ROLES
from workers import keys
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


def worker_records(client: redis.Redis) -> list[dict[str, Any]]:
    """Every live worker process's heartbeat record (expired ones are gone)."""
    records = []
    for key in client.scan_iter(match=keys.WORKER_PATTERN, count=500):
        raw = client.get(key)
        if raw:
            records.append(json.loads(raw))
    return sorted(records, key=lambda r: (r.get("hostname", ""), r.get("pid", 0)))


def count_ready_workers(client: redis.Redis, parent_pid: int | None = None) -> int:
    """Worker processes with their models loaded (optionally only children of `parent_pid`)."""
    count = 0
    for record in worker_records(client):
        if parent_pid is not None and parent_pid not in (record.get("ppid"), record.get("pid")):
            continue
        if record.get("models") or not record.get("queues"):
            count += 1
    return count


def model_status(client: redis.Redis, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Per role: the published generation, the last rejection, the candidates being validated
    (one per machine at most), which workers serve which sha256, and the workers that failed to
    load the published generation (with their reason)."""
    models: dict[str, Any] = {}
    for role in ROLES:
        serving: dict[str, list[str]] = {}
        failures: dict[str, Any] = {}
        for worker in workers:
            model = worker.get("models", {}).get(role)
            if model:
                serving.setdefault(model["sha256"], []).append(worker["worker_id"])
            failure = worker.get("reload_failures", {}).get(role)
            if failure:
                failures[worker["worker_id"]] = failure
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
    workers = worker_records(client)
    queues = {queue: int(client.llen(queue)) for queue in QUEUES}
    return {
        "version": STATUS_VERSION,
        "time": time.time(),
        "queues": queues,
        "queues_without_consumer": queues_without_consumer(queues, workers),
        "workers": workers,
        "models": model_status(client, workers),
        "runs": runs_in_progress(client),
        "throughput": {
            "tasks_last_minute": sum(int(w.get("tasks_last_minute", 0)) for w in workers),
            "per_second": round(sum(int(w.get("tasks_last_minute", 0)) for w in workers) / 60.0, 3),
        },
    }
