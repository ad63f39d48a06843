"""A worker process's heartbeat record (`keys.WORKER`): one writer, one reader.

Each worker process's `ReloadCoordinator` writes its `WorkerRecord` every few seconds with an
expiry (`write_worker_record`), so a dead process's record is gone soon after it. Everyone else
reads them here (`read_worker_records`): `voxmill status`, a producer deciding whether a job can
be served or was lost, a corpus run counting ready workers, a local cluster waiting for its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from workers import keys

if TYPE_CHECKING:  # a local cluster reads these before it may import redis-py (workers.embedded)
    import redis

# Keys read per MGET (a SCAN finds them first).
READ_BATCH = 500


@dataclass(frozen=True)
class WorkerRecord:
    """One live worker process as its heartbeat describes it.

    `models`: role -> the loaded session (`file`, `sha256`, `provider`, ..., `generation`);
    `load_errors`: role -> why its model is not loaded; `running`: the ids of the tasks it runs;
    `reload_failures`: role -> the last failed reload. Times are epoch seconds.
    """

    worker_id: str
    hostname: str
    pid: int
    ppid: int
    queues: tuple[str, ...] = ()
    pool: str = "prefork"
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    load_errors: Mapping[str, str] = field(default_factory=dict)
    tasks_done: int = 0
    tasks_last_minute: int = 0
    aside: bool = False
    running: tuple[str, ...] = ()
    reload_failures: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    started_at: float = 0.0
    last_seen: float = 0.0

    @property
    def ready(self) -> bool:
        """Its models are loaded (a process whose queues need none is ready at once)."""
        return bool(self.models) or not self.queues

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape `voxmill status --json` prints under `workers`."""
        data = asdict(self)
        data["queues"], data["running"] = list(self.queues), list(self.running)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerRecord:
        """Inverse of `to_dict`; `ValueError` for a record of another shape."""
        try:
            return cls(
                worker_id=str(data.get("worker_id") or f"{data.get('hostname', '?')}:{data.get('pid', '?')}"),
                hostname=str(data.get("hostname", "")),
                pid=int(data.get("pid", 0)),
                ppid=int(data.get("ppid", 0)),
                queues=tuple(str(q) for q in data.get("queues") or ()),
                pool=str(data.get("pool", "prefork")),
                models=dict(data.get("models") or {}),
                load_errors={str(k): str(v) for k, v in (data.get("load_errors") or {}).items()},
                tasks_done=int(data.get("tasks_done", 0)),
                tasks_last_minute=int(data.get("tasks_last_minute", 0)),
                aside=bool(data.get("aside", False)),
                running=tuple(str(t) for t in data.get("running") or ()),
                reload_failures=dict(data.get("reload_failures") or {}),
                started_at=float(data.get("started_at", 0.0)),
                last_seen=float(data.get("last_seen", 0.0)),
            )
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"not a worker record: {exc}") from None


def write_worker_record(client: redis.Redis, record: WorkerRecord, ttl_s: int) -> None:
    """Write `record` under its key, expiring after `ttl_s` (the next beat writes it again)."""
    client.set(keys.WORKER.format(worker_id=record.worker_id), json.dumps(record.to_dict()), ex=ttl_s)


def delete_worker_record(client: redis.Redis, worker_id: str) -> None:
    """Remove a stopping process's record at once (not after its expiry)."""
    client.delete(keys.WORKER.format(worker_id=worker_id))


def read_worker_records(client: redis.Redis, host: str | None = None) -> list[WorkerRecord]:
    """Every live worker process's record (of `host` only, if given), sorted by host and pid; one
    SCAN, then MGETs. A record that is not one (written by something else) is skipped."""
    pattern = keys.WORKER.format(worker_id=f"{host}:*") if host is not None else keys.WORKER_PATTERN
    found = list(client.scan_iter(match=pattern, count=READ_BATCH))
    records = []
    for start in range(0, len(found), READ_BATCH):
        for raw in client.mget(found[start : start + READ_BATCH]):
            if not raw:
                continue
            try:
                data = json.loads(raw)
                if isinstance(data, dict):
                    records.append(WorkerRecord.from_dict(data))
            except ValueError:
                continue
    return sorted(records, key=lambda r: (r.hostname, r.pid))


def count_ready_workers(client: redis.Redis, parent_pid: int | None = None) -> int:
    """Worker processes with their models loaded (optionally only `parent_pid` and its children)."""
    return sum(
        1
        for record in read_worker_records(client)
        if record.ready and (parent_pid is None or parent_pid in (record.ppid, record.pid))
    )
