"""`ModelHolder`: the warm sessions of one worker process, and how they are replaced.

Life of a model in a worker (Triton's load -> warm up -> serve -> unload):
1. `start()` runs after fork (or in the main process of a solo/threads worker): it loads and
   warms up the model of every role the worker's queues need, before the first task.
2. Tasks use `serving(roles)`, which holds the swap lock for the duration of one task.
3. A background thread heartbeats to Redis and watches the published generation of each role.
   On a new sha256 it loads the file from this machine's model folder *beside* the current
   session, checks the sha256 of the bytes it read against the published one, warms it up,
   then swaps between two tasks and releases the old session. Any failure keeps the old one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from pipeline.errors import VoxmillError
from pipeline.extraction import open_session
from pipeline.records import ROLES_BY_OP
from pipeline.registry import Registry
from pipeline.sessions import ModelSession, SessionOptions
from pipeline.settings import Settings
from workers import keys

log = logging.getLogger("voxmill.holder")
HEARTBEAT_TTL_S = 15
RELOAD_SLOT_TTL_S = 120


class ModelUnavailable(Exception):
    """A role this task needs has no loaded session in this process (yet)."""


@dataclass(frozen=True)
class FileStamp:
    """Identity of a file on disk without reading it: (device, inode, size, mtime)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def roles_for_queues(queues: Sequence[str]) -> tuple[str, ...]:
    """The model roles a worker consuming `queues` must hold (embed-only: just the embedder)."""
    roles: list[str] = []
    for queue in queues:
        for role in ROLES_BY_OP.get(queue, ()):
            if role not in roles:
                roles.append(role)
    return tuple(roles)


class ModelHolder:
    """Per-process model state: the current session of each role, and its replacement."""

    def __init__(self, settings: Settings, registry: Registry | None = None) -> None:
        self.settings = settings
        self.registry = registry or Registry.load()
        self.options = SessionOptions.from_settings(settings)
        self.queues: tuple[str, ...] = ()
        self.roles: tuple[str, ...] = ()
        self.pool = "prefork"
        self.sessions: dict[str, ModelSession] = {}
        self.generations: dict[str, int] = {}
        self.load_errors: dict[str, str] = {}
        self.worker_id = ""
        self.started_at = 0.0
        self.tasks_done = 0
        self._recent: deque[float] = deque()
        self._swap_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._redis: redis.Redis | None = None
        self._rejected: dict[str, tuple[str, FileStamp | None]] = {}
        self._slot: str | None = None

    # -- set-up -----------------------------------------------------------------------------
    def configure(self, queues: Sequence[str], pool: str) -> None:
        """Record which queues this worker consumes (in the parent, before any fork)."""
        self.queues = tuple(queues)
        self.roles = roles_for_queues(queues)
        self.pool = pool

    def start(self) -> None:
        """Load and warm up every needed model, then start the heartbeat/reload thread."""
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.started_at = time.time()
        self._redis = self._connect()
        for role in self.roles:
            published = self._published(role)
            try:
                self._load_initial(role, published)
            except VoxmillError as exc:
                self.load_errors[role] = exc.message
                log.error("worker %s could not load the %s model: %s", self.worker_id, role, exc.message)
        self._thread = threading.Thread(target=self._watch_loop, name="voxmill-holder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread, drop the heartbeat and release every session."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            if self._redis is not None:
                self._redis.delete(keys.WORKER.format(worker_id=self.worker_id))
        with self._swap_lock:
            self.sessions.clear()

    def _connect(self) -> redis.Redis | None:
        if not self.settings.broker_url:
            return None
        return redis.Redis.from_url(
            self.settings.broker_url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
        )

    def _load_initial(self, role: str, published: dict[str, str]) -> None:
        path = self.registry.find_model(role, self.settings.model_dir)
        session = open_session(path, role, self.options, self.registry)
        if published and published.get("sha256") != session.sha256:
            log.warning(
                "%s: local %s has sha256 %s, the published generation is %s; serving the local file "
                "until this machine's copy matches",
                self.worker_id,
                path.name,
                session.sha256[:12],
                published.get("sha256", "")[:12],
            )
        elif published:
            self.generations[role] = int(published.get("generation", 0))
        self.sessions[role] = session
        log.info(
            "worker %s loaded %s %s (sha256 %s) in %.2f s, warm latency %.1f ms on %s",
            self.worker_id,
            role,
            path.name,
            session.sha256[:12],
            session.load_s,
            session.warm_latency_ms or 0.0,
            session.active_providers[0],
        )

    # -- serving ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self, roles: Sequence[str]) -> Iterator[dict[str, ModelSession]]:
        """The sessions for `roles`, fixed for the whole task even if a swap happens meanwhile.

        A swap only replaces the holder's reference; the task keeps the session it started
        with, which is released when its last user is done.
        """
        with self._swap_lock:
            missing = [role for role in roles if role not in self.sessions]
            if missing:
                reasons = "; ".join(f"{r}: {self.load_errors.get(r, 'not loaded')}" for r in missing)
                raise ModelUnavailable(
                    f"worker {self.worker_id} has no {', '.join(missing)} model ({reasons})"
                )
            snapshot = {role: self.sessions[role] for role in roles}
        yield snapshot
        with self._swap_lock:
            self.tasks_done += 1
            self._recent.append(time.time())

    def describe(self) -> dict[str, Any]:
        """This process as `voxmill status` shows it."""
        now = time.time()
        while self._recent and self._recent[0] < now - 60:
            self._recent.popleft()
        return {
            "worker_id": self.worker_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "queues": list(self.queues),
            "pool": self.pool,
            "models": {
                role: {**s.describe(), "generation": self.generations.get(role)}
                for role, s in self.sessions.items()
            },
            "load_errors": dict(self.load_errors),
            "started_at": self.started_at,
            "last_seen": now,
            "tasks_done": self.tasks_done,
            "tasks_last_minute": len(self._recent),
        }

    # -- background: heartbeat and reload ----------------------------------------------------
    def _watch_loop(self) -> None:
        backoff = 1.0
        while not self._stop.wait(self.settings.worker_reload_check_s):
            try:
                self._heartbeat()
                for role in self.roles:
                    self._maybe_reload(role)
                backoff = 1.0
            except redis.RedisError as exc:
                log.warning(
                    "worker %s: Redis unavailable (%s); retrying in %.0f s", self.worker_id, exc, backoff
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _heartbeat(self) -> None:
        if self._redis is None:
            return
        key = keys.WORKER.format(worker_id=self.worker_id)
        self._redis.set(key, json.dumps(self.describe()), ex=HEARTBEAT_TTL_S)

    def _published(self, role: str) -> dict[str, str]:
        if self._redis is None:
            return {}
        try:
            raw = self._redis.hgetall(keys.GENERATION.format(role=role))
        except redis.RedisError:
            return {}
        return {_text(k): _text(v) for k, v in raw.items()}

    def _maybe_reload(self, role: str) -> None:
        published = self._published(role)
        sha256 = published.get("sha256")
        current = self.sessions.get(role)
        if not sha256 or (current is not None and current.sha256 == sha256):
            return
        path = self.registry.find_model(role, self.settings.model_dir)
        stamp = FileStamp.of(path)
        if self._rejected.get(role) == (sha256, stamp):
            return  # same file that failed for this generation; wait for a change
        if not self._take_reload_slot(role):
            return
        try:
            candidate = open_session(path, role, self.options, self.registry, expected_sha256=sha256)
        except VoxmillError as exc:
            self._rejected[role] = (sha256, stamp)
            log.warning(
                "worker %s keeps its %s model: new generation not loaded: %s",
                self.worker_id,
                role,
                exc.message,
            )
            return
        finally:
            self._release_reload_slot(role)
        self._swap(role, candidate, int(published.get("generation", 0)))

    def _swap(self, role: str, candidate: ModelSession, generation: int) -> None:
        with self._swap_lock:
            old = self.sessions.get(role)
            self.sessions[role] = candidate
            self.generations[role] = generation
            self.load_errors.pop(role, None)
        log.info(
            "worker %s now serves %s generation %d (sha256 %s, was %s)",
            self.worker_id,
            role,
            generation,
            candidate.sha256[:12],
            old.sha256[:12] if old else "none",
        )

    def _take_reload_slot(self, role: str) -> bool:
        if self._redis is None:
            return True
        self._slot = None
        for slot in range(max(1, self.settings.reload_slots)):
            key = keys.RELOAD_SLOT.format(role=role, slot=slot)
            if self._redis.set(key, self.worker_id, nx=True, ex=RELOAD_SLOT_TTL_S):
                self._slot = key
                return True
        return False

    def _release_reload_slot(self, role: str) -> None:
        if self._redis is not None and self._slot is not None:
            with contextlib.suppress(redis.RedisError):
                if self._redis.get(self._slot) == self.worker_id.encode():
                    self._redis.delete(self._slot)
        self._slot = None
