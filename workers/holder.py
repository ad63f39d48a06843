"""`ModelHolder`: the warm sessions of one worker process, and how they are replaced.

Life of a model in a worker (Triton's load -> warm up -> serve -> unload):
1. `start()` runs after fork (or in the main process of a solo/threads worker): it loads and
   warms up the model of every role the worker's queues need, before the first task.
2. Tasks use `serving(roles)`, which snapshots the sessions for the duration of one task.
3. A reload thread wakes on every announcement on `keys.GENERATION_CHANNEL` (and, as a fallback,
   every `worker_reload_check_s`) and compares the published sha256 of each role with its own.
   On a difference it loads the file of this machine's model folder *beside* the current
   session, checks that the sha256 of the bytes it read is the published one, warms it up and
   swaps between two tasks; the old session is freed when the last task using it ends.
   At most `reload_slots` processes per machine (default: half of those serving the role) load
   a role at once (Redis locks). For a model file of `reload_aside_min_mb` or more, one process
   per machine *stands aside* (takes no task) while the watcher checks the candidate and while
   it loads, so the reload gets a core (`_stand_aside`); any other loading process still
   serves, its load competing for the CPU.
4. A failed reload keeps the old session and is reported in the heartbeat (`reload_failures`).
   A file that cannot be the published one (missing, another size) waits until it changes;
   any other failure (out of memory, say) is retried with backoff up to `reload_retry_max_s`.
5. A heartbeat thread writes `describe()` to Redis (`keys.WORKER`, expiring) every
   `HEARTBEAT_INTERVAL_S`, within `HEARTBEAT_MIN_GAP_S` of a finished task, and right away after
   every swap or failure; `voxmill status` reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
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
from redis.client import PubSub

from pipeline.errors import VoxmillError
from pipeline.extraction import open_session
from pipeline.records import ROLES_BY_OP
from pipeline.registry import Registry
from pipeline.sessions import ModelSession, SessionOptions
from pipeline.settings import Settings
from workers import generations, keys
from workers.metrics import NoMetrics

log = logging.getLogger("voxmill.holder")
HEARTBEAT_TTL_S = 15
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_MIN_GAP_S = 0.25  # a finished task is shown this soon; more tasks in between share one write
RELOAD_SLOT_TTL_S = 300
SLOT_RETRY_S = 0.1
SLOT_COUNT_TTL_S = 10.0
ASIDE_TTL_S = 120  # the aside lock outlives a dead process by at most this long
ASIDE_WAIT_MAX_S = 30.0  # a task waits at most this long for a process standing aside
DRAIN_MAX_S = 5.0  # a process standing aside waits this long at most for its running tasks


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


@dataclass(frozen=True)
class ReloadFailure:
    """Why this process did not load a published generation, and when it tries again."""

    sha256: str
    generation: int
    stamp: FileStamp | None
    reason: str
    attempts: int
    retry_at: float  # monotonic seconds; inf: when the file changes
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "generation": self.generation,
            "reason": self.reason,
            "attempts": self.attempts,
            "time": round(self.time, 3),
        }


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
        self.reload_failures: dict[str, ReloadFailure] = {}
        self.worker_id = ""
        self.started_at = 0.0
        self.tasks_done = 0
        self._recent: deque[float] = deque()
        self._swap_lock = threading.RLock()
        self._tasks_running = 0
        self._task_ended = threading.Condition(self._swap_lock)
        self._stop = threading.Event()
        self._activity = threading.Event()  # a task finished since the last heartbeat
        self._threads: list[threading.Thread] = []
        self._redis: redis.Redis | None = None
        self._slots: dict[str, str] = {}  # role -> the reload slot this process holds for it
        self._aside_key: str | None = None  # the machine's aside lock, while this process holds it
        self._in_rotation = threading.Event()  # cleared while this process stands aside
        self._in_rotation.set()
        self.metrics = NoMetrics()
        self._slot_counts: dict[str, tuple[float, int]] = {}

    # -- set-up -----------------------------------------------------------------------------
    def configure(self, queues: Sequence[str], pool: str) -> None:
        """Record which queues this worker consumes (in the parent, before any fork)."""
        self.queues = tuple(queues)
        self.roles = roles_for_queues(queues)
        self.pool = pool

    def start(self) -> None:
        """Load and warm up every needed model, then start the heartbeat and reload threads."""
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
        self._heartbeat_safely()
        for name, target in (("heartbeat", self._heartbeat_loop), ("reload", self._reload_loop)):
            thread = threading.Thread(target=target, name=f"voxmill-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the background threads, drop the heartbeat and release every session."""
        self._stop.set()
        self._activity.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._rejoin()
        for role in list(self._slots):
            self._release_reload_slot(role)
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
        self.metrics.model_loaded(role, session.sha256, session.load_s, session.warm_latency_ms or 0.0)
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
        if not self._in_rotation.is_set() and not self._in_rotation.wait(ASIDE_WAIT_MAX_S):
            log.warning("worker %s stood aside for %.0f s; serving again", self.worker_id, ASIDE_WAIT_MAX_S)
            self._in_rotation.set()
        with self._swap_lock:
            missing = [role for role in roles if role not in self.sessions]
            if missing:
                reasons = "; ".join(f"{r}: {self.load_errors.get(r, 'not loaded')}" for r in missing)
                raise ModelUnavailable(
                    f"worker {self.worker_id} has no {', '.join(missing)} model ({reasons})"
                )
            snapshot = {role: self.sessions[role] for role in roles}
            self._tasks_running += 1
        try:
            yield snapshot
        finally:
            with self._task_ended:
                self._tasks_running -= 1
                self._task_ended.notify_all()
        with self._swap_lock:
            self.tasks_done += 1
            self._recent.append(time.time())
        self._activity.set()

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
            "reload_failures": {role: f.to_dict() for role, f in self.reload_failures.items()},
            "started_at": self.started_at,
            "last_seen": now,
            "tasks_done": self.tasks_done,
            "tasks_last_minute": len(self._recent),
            "aside": not self._in_rotation.is_set(),
        }

    # -- background: heartbeat ---------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval_s = min(self.settings.worker_reload_check_s, HEARTBEAT_INTERVAL_S)
        while not self._stop.is_set():
            self._activity.wait(interval_s)
            if self._stop.is_set():
                break
            self._activity.clear()
            self._heartbeat_safely()
            self._stop.wait(HEARTBEAT_MIN_GAP_S)

    def _heartbeat_safely(self) -> None:
        try:
            self._heartbeat()
        except redis.RedisError as exc:
            log.debug("worker %s: heartbeat failed: %s", self.worker_id, exc)

    def _heartbeat(self) -> None:
        if self._redis is None:
            return
        key = keys.WORKER.format(worker_id=self.worker_id)
        self._redis.set(key, json.dumps(self.describe()), ex=HEARTBEAT_TTL_S)
        self.metrics.sample_process()

    # -- background: reload -------------------------------------------------------------------
    def _reload_loop(self) -> None:
        """Check the published generations on every announcement, or every `worker_reload_check_s`."""
        listener: PubSub | None = None
        check_s = self.settings.worker_reload_check_s
        backoff_s = 1.0
        while not self._stop.is_set():
            try:
                if listener is None and self._redis is not None:
                    listener = self._redis.pubsub(ignore_subscribe_messages=True)
                    listener.subscribe(keys.GENERATION_CHANNEL)
                waiting = self.check_generations()
                self._wait_for_news(listener, SLOT_RETRY_S if waiting else check_s)
                backoff_s = 1.0
            except redis.RedisError as exc:
                log.warning(
                    "worker %s: Redis unavailable (%s); retrying in %.0f s", self.worker_id, exc, backoff_s
                )
                self._rejoin()
                _closed(listener)
                listener = None
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
        _closed(listener)

    def _wait_for_news(self, listener: PubSub | None, timeout_s: float) -> None:
        """Sleep until a generation is announced or `timeout_s` passed (or the holder stops)."""
        if listener is None:
            self._stop.wait(timeout_s)
            return
        message = listener.get_message(timeout=timeout_s)
        while message is not None:  # several announcements: one check covers them all
            message = listener.get_message(timeout=0)

    def check_generations(self) -> bool:
        """Reload every role whose published sha256 differs; True when one waits (a slot, a verdict).

        While this machine's watcher validates a candidate for a role, the process that takes
        the role's reload slot first stands aside (`_stand_aside`) until the verdict, so the
        validation gets its core, and then loads the new generation first.
        """
        # Candidates first: a verdict published between the two reads is then loaded in this
        # round by the process already standing aside, which keeps its slot throughout.
        awaiting = {role: size for role in self.roles if (size := self._awaiting_verdict(role)) is not None}
        if awaiting and self._worth_standing_aside(max(awaiting.values())):
            self._stand_aside()
        waiting = False
        for role in self.roles:
            waiting = self._maybe_reload(role) or waiting
        if not awaiting:
            self._rejoin()
        return waiting or bool(awaiting)

    def _awaiting_verdict(self, role: str) -> int | None:
        """Hold the role's reload slot while this machine validates a new candidate for it.

        The candidate's size in bytes while this process holds the slot for it, else None.
        """
        current = self.sessions.get(role)
        pending = generations.candidate(self._redis, socket.gethostname(), role) if self._redis else {}
        if current is None or not pending or pending.get("sha256") == current.sha256:
            self._release_reload_slot(role)
            return None
        return int(pending.get("size") or 0) if self._take_reload_slot(role) else None

    def _worth_standing_aside(self, size: int) -> bool:
        """A model this large loads long enough to be worth a process's tasks meanwhile."""
        return size >= self.settings.reload_aside_min_mb * 1e6

    def _published(self, role: str) -> dict[str, str]:
        if self._redis is None:
            return {}
        try:
            return generations.published(self._redis, role)
        except redis.RedisError:
            return {}

    def _maybe_reload(self, role: str) -> bool:
        published = self._published(role)
        sha256 = published.get("sha256", "")
        generation = int(published.get("generation") or 0)
        current = self.sessions.get(role)
        if current is not None and not sha256:
            return False
        if current is not None and current.sha256 == sha256:
            self.generations[role] = generation
            self.reload_failures.pop(role, None)
            return False
        path, stamp = self._local_file(role)
        if not self._retry_due(role, sha256, stamp):
            return False
        # A process with no session at all (its file was missing or broken at start-up) takes its
        # own file as it is, published or not, as at start-up.
        problem = _local_mismatch(path, stamp, published, check_size=current is not None)
        if problem or path is None:
            self._fail(role, sha256, generation, stamp, problem, wait_for_change=True)
            return False
        if not self._take_reload_slot(role):
            return True
        if stamp is not None and self._worth_standing_aside(stamp.size) and self._stand_aside():
            self._drain(DRAIN_MAX_S)
        try:
            candidate = self._load_beside(role, path, sha256 if current is not None else None)
            self._swap(role, candidate, generation if candidate.sha256 == sha256 else None)
        except Exception as exc:  # out of memory, a bad file, a provider error: keep the old session
            reason = exc.message if isinstance(exc, VoxmillError) else f"{type(exc).__name__}: {exc}"
            self._fail(role, sha256, generation, stamp, reason)
        finally:
            self._rejoin()
            self._release_reload_slot(role)
        return False

    def _load_beside(self, role: str, path: Path, expected_sha256: str | None) -> ModelSession:
        """Load and warm up `path` while the current session keeps serving."""
        return open_session(path, role, self.options, self.registry, expected_sha256=expected_sha256)

    def _local_file(self, role: str) -> tuple[Path | None, FileStamp | None]:
        try:
            path = self.registry.find_model(role, self.settings.model_dir)
            return path, FileStamp.of(path)
        except (VoxmillError, OSError):
            return None, None

    def _retry_due(self, role: str, sha256: str, stamp: FileStamp | None) -> bool:
        """Load now unless the same file already failed for this generation and its retry is not due."""
        failure = self.reload_failures.get(role)
        if failure is None or failure.sha256 != sha256 or failure.stamp != stamp:
            return True
        return time.monotonic() >= failure.retry_at

    def _fail(
        self,
        role: str,
        sha256: str,
        generation: int,
        stamp: FileStamp | None,
        reason: str,
        wait_for_change: bool = False,
    ) -> None:
        previous = self.reload_failures.get(role)
        attempts = previous.attempts + 1 if previous is not None and previous.sha256 == sha256 else 1
        delay_s = math.inf if wait_for_change else min(self.settings.reload_retry_max_s, 2.0**attempts)
        self.reload_failures[role] = ReloadFailure(
            sha256, generation, stamp, reason, attempts, time.monotonic() + delay_s, time.time()
        )
        self.metrics.reload(role, "failed")
        then = "waiting for the file to change" if wait_for_change else f"retrying in {delay_s:.0f} s"
        current = self.sessions.get(role)
        wanted = f"generation {generation} (sha256 {sha256[:12]})" if sha256 else "its model file"
        log.warning(
            "worker %s keeps its %s model (sha256 %s): %s not loaded: %s; %s",
            self.worker_id,
            role,
            current.sha256[:12] if current else "none",
            wanted,
            reason,
            then,
        )
        self._heartbeat_safely()

    def _swap(self, role: str, candidate: ModelSession, generation: int | None) -> None:
        """Make `candidate` the role's session between two tasks; the old one goes with its last task."""
        with self._swap_lock:
            old = self.sessions.get(role)
            self.sessions[role] = candidate
            if generation is None:
                self.generations.pop(role, None)
            else:
                self.generations[role] = generation
                self.reload_failures.pop(role, None)
            self.load_errors.pop(role, None)
        self.metrics.model_loaded(role, candidate.sha256, candidate.load_s, candidate.warm_latency_ms or 0.0)
        self.metrics.reload(role, "ok")
        log.info(
            "worker %s now serves %s generation %s (sha256 %s, was %s), loaded in %.2f s",
            self.worker_id,
            role,
            "(its own file, not the published one)" if generation is None else generation,
            candidate.sha256[:12],
            old.sha256[:12] if old else "none",
            candidate.load_s,
        )
        # Tasks that started before the swap hold their own reference; ONNX Runtime frees the
        # old session when the last of them ends.
        del old
        self._heartbeat_safely()

    def _take_reload_slot(self, role: str) -> bool:
        """Hold one of the machine's reload slots for `role` (kept, and refreshed, if held already)."""
        if self._redis is None:
            return True
        held = self._slots.get(role)
        if held is not None:
            self._redis.expire(held, RELOAD_SLOT_TTL_S)
            return True
        for slot in range(self._slot_count(role)):
            key = keys.RELOAD_SLOT.format(host=socket.gethostname(), role=role, slot=slot)
            if self._redis.set(key, self.worker_id, nx=True, ex=RELOAD_SLOT_TTL_S):
                self._slots[role] = key
                return True
        return False

    def _slot_count(self, role: str) -> int:
        """`reload_slots`, or (0) half of this machine's live processes serving `role`, at least 1."""
        if self.settings.reload_slots > 0 or self._redis is None:
            return max(1, self.settings.reload_slots)
        return max(1, self._peer_count(role) // 2)

    def _peer_count(self, role: str) -> int:
        """This machine's live processes (this one included) serving `role`, counted every 10 s."""
        counted_at, count = self._slot_counts.get(role, (-math.inf, 1))
        if self._redis is not None and time.monotonic() - counted_at > SLOT_COUNT_TTL_S:
            pattern = keys.WORKER.format(worker_id=f"{socket.gethostname()}:*")
            count = 0
            for key in self._redis.scan_iter(match=pattern, count=500):
                raw = self._redis.get(key)
                count += 1 if raw and role in json.loads(raw).get("models", {}) else 0
            self._slot_counts[role] = (time.monotonic(), count)
        return count

    def _release_reload_slot(self, role: str) -> None:
        key = self._slots.pop(role, None)
        if key is not None:
            self._unlock(key)

    def _unlock(self, key: str) -> None:
        """Delete a Redis lock this process holds (left to expire when Redis does not answer)."""
        if self._redis is not None:
            with contextlib.suppress(redis.RedisError):
                if self._redis.get(key) == self.worker_id.encode():
                    self._redis.delete(key)

    # -- background: standing aside -----------------------------------------------------------
    def _stand_aside(self) -> bool:
        """Take no new task while this process reloads, when others keep serving; True if aside.

        On a machine whose cores are all serving, a load (or the watcher's validation) that
        competes with serving takes several times longer than on an idle core, and slows the
        serving beside it. So, for a model file of `reload_aside_min_mb` or more, the one
        process of a machine holding the aside lock (`keys.ASIDE`) stops taking tasks while it
        waits for the verdict on a candidate and while it loads: the others serve at full
        speed, the reload gets its core. A process stands aside only when every role it serves
        has another live process on the machine; alone (or when another process stands aside,
        or for a smaller model, which loads in a fraction of a second) it loads beside
        serving. A task that arrives meanwhile waits (at most `ASIDE_WAIT_MAX_S`), then runs
        on the new session.
        """
        if self._aside_key is not None:
            if self._redis is not None:
                self._redis.expire(self._aside_key, ASIDE_TTL_S)
            return True
        if self._redis is None or any(self._peer_count(role) < 2 for role in self.roles):
            return False
        key = keys.ASIDE.format(host=socket.gethostname())
        if not self._redis.set(key, self.worker_id, nx=True, ex=ASIDE_TTL_S):
            return False
        self._aside_key = key
        self._in_rotation.clear()
        log.info("worker %s stands aside (takes no task) while it reloads", self.worker_id)
        self._heartbeat_safely()
        return True

    def _drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the tasks this process runs to end; none starts meanwhile.

        A load beside a running task shares the core with it and with the machine's serving
        processes; after the task it has the core to itself, and ends sooner than both together.
        """
        deadline = time.monotonic() + timeout_s
        with self._task_ended:
            while self._tasks_running and (left_s := deadline - time.monotonic()) > 0:
                self._task_ended.wait(left_s)

    def _rejoin(self) -> None:
        """Take tasks again (a no-op unless standing aside)."""
        key, self._aside_key = self._aside_key, None
        self._in_rotation.set()
        if key is not None:
            self._unlock(key)
            self._heartbeat_safely()


def _local_mismatch(
    path: Path | None, stamp: FileStamp | None, published: dict[str, str], check_size: bool = True
) -> str:
    """Why this machine's file cannot be the published one without reading it ('' when it may be)."""
    if path is None or stamp is None:
        return "this machine has no such model file"
    size = published.get("size")
    if check_size and size and int(size) != stamp.size:
        return f"this machine's {path.name} has {stamp.size} bytes, the published file {size}"
    return ""


def _closed(listener: PubSub | None) -> None:
    """Close a pub/sub connection, whatever state it is in."""
    if listener is not None:
        with contextlib.suppress(Exception):
            listener.close()
