"""`ReloadCoordinator`: one worker process's side of the reload protocol, the only code that
touches its Redis keys (`workers.keys`: WORKER, RELOAD_SLOT, ASIDE).

1. **Start.** Load and warm up the model of every role the worker's queues need (this
   machine's file, published or not), before the first task; then two threads start.
2. **Heartbeat.** Every `heartbeat_interval_s`, within a quarter second of a finished task, and
   after every swap or failure, the process's record (`keys.WORKER`, expiring after
   `heartbeat_ttl_s`) says what it serves; `voxmill status` and the other processes read it.
3. **Reload rounds.** On every announcement on `keys.GENERATION_CHANNEL` (and every
   `worker_reload_check_s`), read the published generations, this machine's candidates, its
   model files and its live processes, ask `workers.reload.policy.decide`, and carry out the
   steps with the holder. A load takes one of the machine's `reload_slots` for the role (Redis
   locks); one that should have a core to itself first stands aside (the machine's one
   `keys.ASIDE` lock): the holder takes no task, its running task ends, then it loads.
4. **Failures** keep the old session; the policy says when to try again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from redis.client import PubSub

from pipeline import tuning
from pipeline.batching import file_now, twin_path
from pipeline.errors import VoxmillError
from pipeline.models.identity import FileIdentity
from pipeline.models.registry import Registry
from pipeline.settings import Settings
from workers import keys
from workers.heartbeat import WorkerRecord, delete_worker_record, read_worker_records, write_worker_record
from workers.metrics import NoMetrics
from workers.reload import generations
from workers.reload.holder import ModelHolder
from workers.reload.policy import (
    Adopt,
    AwaitVerdict,
    Candidate,
    Load,
    Published,
    Refuse,
    ReloadFailure,
    ReloadView,
    RoleState,
    after_failure,
    decide,
    slot_count,
    twin_step,
)

log = logging.getLogger("voxmill.reload")


class ReloadCoordinator:
    """Heartbeat, reload rounds, reload slots and standing aside of one worker process."""

    def __init__(
        self,
        settings: Settings,
        holder: ModelHolder,
        registry: Registry,
        queues: Sequence[str],
        pool: str,
        client: redis.Redis | None,
        metrics: NoMetrics | None = None,
        running: Callable[[], list[str]] | None = None,
    ) -> None:
        """`client`: this process's Redis connection (None: no broker, nothing to coordinate).
        `running`: the ids of the tasks the process runs now, for its record (producers look)."""
        self.running = running or list
        self.settings = settings
        self.holder = holder
        self.registry = registry
        self.queues = tuple(queues)
        self.pool = pool
        self.metrics = metrics or NoMetrics()
        self.host = socket.gethostname()
        self.worker_id = holder.name or f"{self.host}:{os.getpid()}"
        self.started_at = time.time()
        self.failures: dict[str, ReloadFailure] = {}
        self._twin_seen: dict[str, FileIdentity | None] = {}  # each batch file at the last look
        self.redis = client
        self._slots: dict[str, str] = {}  # role -> the reload slot this process holds for it
        self._aside_key: str | None = None
        self._peers: tuple[float, dict[str, int]] = (-math.inf, {})
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Load every role's model (before the first task), then heartbeat and reload threads."""
        self.load_models()
        self.heartbeat()
        for name, target in (("heartbeat", self._heartbeat_loop), ("reload", self._reload_loop)):
            thread = threading.Thread(target=target, name=f"voxmill-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads, give back every lock and drop the heartbeat record."""
        self._stop.set()
        self.holder.task_ended.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._rejoin()
        for role in list(self._slots):
            self._release_slot(role)
        if self.redis is not None:
            with contextlib.suppress(redis.RedisError):
                delete_worker_record(self.redis, self.worker_id)

    def load_models(self) -> None:
        """Load and warm up this machine's file of every role, published or not."""
        self.started_at = time.time()
        for role in self.holder.roles:
            self._load_at_start(role)

    def _load_at_start(self, role: str) -> None:
        published = Published.from_record(self._published(role))
        try:
            path = self.registry.find_model(role, self.settings.model_dir)
            session = self.holder.load(role, path)
        except VoxmillError as exc:
            self.holder.unavailable(role, exc.message)
            log.error("worker %s could not load the %s model: %s", self.worker_id, role, exc.message)
            return
        if published is not None and published.sha256 != session.sha256:
            log.warning(
                "%s: local %s has sha256 %s, the published generation is %s; serving the local file "
                "until this machine's copy matches",
                self.worker_id,
                path.name,
                session.sha256[:12],
                published.sha256[:12],
            )
        self.holder.swap(role, session, published.generation if published else None)
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

    # -- heartbeat ----------------------------------------------------------------------------
    def record(self) -> WorkerRecord:
        """This process as `voxmill status` shows it."""
        return WorkerRecord(
            worker_id=self.worker_id,
            hostname=self.host,
            pid=os.getpid(),
            ppid=os.getppid(),
            queues=tuple(self.queues),
            pool=self.pool,
            **self.holder.describe(),
            running=tuple(self.running()),
            reload_failures={role: f.to_dict() for role, f in self.failures.items()},
            started_at=self.started_at,
            last_seen=time.time(),
        )

    def heartbeat(self) -> None:
        """Write the record now (a Redis outage is ridden out: the next beat writes it)."""
        if self.redis is None:
            return
        try:
            write_worker_record(self.redis, self.record(), self.settings.heartbeat_ttl_s)
            self.metrics.sample_process()
        except redis.RedisError as exc:
            log.debug("worker %s: heartbeat failed: %s", self.worker_id, exc)

    def _heartbeat_loop(self) -> None:
        interval_s = min(self.settings.worker_reload_check_s, self.settings.heartbeat_interval_s)
        while not self._stop.is_set():
            self.holder.task_ended.wait(interval_s)
            if self._stop.is_set():
                break
            self.holder.task_ended.clear()
            self.heartbeat()
            self._stop.wait(tuning.HEARTBEAT_MIN_GAP_S)

    # -- reload rounds ------------------------------------------------------------------------
    def _reload_loop(self) -> None:
        """A round on every announcement, or every `worker_reload_check_s`; Redis outages back off."""
        listener: PubSub | None = None
        backoff_s = 1.0
        while not self._stop.is_set():
            try:
                if listener is None and self.redis is not None:
                    listener = self.redis.pubsub(ignore_subscribe_messages=True)
                    listener.subscribe(keys.GENERATION_CHANNEL)
                waiting = self.round()
                self._wait_for_news(
                    listener, tuning.SLOT_RETRY_S if waiting else self.settings.worker_reload_check_s
                )
                backoff_s = 1.0
            except redis.RedisError as exc:
                log.warning(
                    "worker %s: Redis unavailable (%s); retrying in %.0f s", self.worker_id, exc, backoff_s
                )
                self._rejoin()
                _close(listener)
                listener = None
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
        _close(listener)

    def _wait_for_news(self, listener: PubSub | None, timeout_s: float) -> None:
        if listener is None:
            self._stop.wait(timeout_s)
            return
        message = listener.get_message(timeout=timeout_s)
        while message is not None:  # several announcements: one round covers them all
            message = listener.get_message(timeout=0)

    def round(self) -> bool:
        """One reload round; True when it waits for a slot or a verdict (the next comes soon)."""
        steps = decide(self.view())
        awaiting = {step.role: step for step in steps if isinstance(step, AwaitVerdict)}
        waiting = False
        for step in steps:
            if isinstance(step, Adopt):
                self.holder.note_generation(step.role, step.generation)
                self.failures.pop(step.role, None)
            elif isinstance(step, AwaitVerdict):
                waiting = True
                if self._take_slot(step.role) and step.stand_aside:
                    self._stand_aside()
            elif isinstance(step, Refuse):
                self._fail(step, step.reason)
            elif isinstance(step, Load):
                waiting = not self._load(step) or waiting
        for role in set(self._slots) - set(awaiting):
            self._release_slot(role)
        if not awaiting:
            self._rejoin()
        self._follow_twins()
        return waiting

    def _follow_twins(self) -> None:
        """Reload a tokenizer's batch file that changed and held still a round (`twin_step`)."""
        if not self.holder.batch_twins:
            return
        for role, session in list(self.holder.sessions.items()):
            now = file_now(twin_path(session))
            step = twin_step(session.twin_file, self._twin_seen.get(role), now)
            self._twin_seen[role] = now
            if step == "reload" and self.holder.reload_twin(role, session):
                twin = session.twin
                log.info(
                    "worker %s now batches %s with %s",
                    self.worker_id,
                    role,
                    f"{twin.ref.file} (sha256 {twin.sha256[:12]})" if twin else "no batch file",
                )
                self.heartbeat()

    def view(self) -> ReloadView:
        """What the policy looks at. Candidates are read before generations: a verdict published
        between the two reads is loaded in this round by the process already standing aside."""
        candidates = {role: self._candidate(role) for role in self.holder.roles}
        states = []
        for role in self.holder.roles:
            serving = self.holder.sessions.get(role)
            states.append(
                RoleState(
                    role=role,
                    serving=serving.sha256 if serving else None,
                    published=Published.from_record(self._published(role)),
                    candidate=candidates[role],
                    local=self._local_file(role),
                    failure=self.failures.get(role),
                )
            )
        return ReloadView(
            roles=tuple(states),
            peers=self._peer_counts(),
            aside_min_bytes=self.settings.reload_aside_min_mb * 1e6,
            now=time.monotonic(),
        )

    def _load(self, step: Load) -> bool:
        """Load and swap (False: no slot free yet). A failure keeps the old session."""
        if not self._take_slot(step.role):
            return False
        if step.stand_aside and self._stand_aside():
            self.holder.drain(self.settings.reload_drain_max_s)
        try:
            session = self.holder.load(step.role, Path(step.file.path), step.expected_sha256)
        except Exception as exc:  # out of memory, a bad file, a provider error: keep the old session
            self._fail(step, exc.message if isinstance(exc, VoxmillError) else f"{type(exc).__name__}: {exc}")
        else:
            published = step.sha256 and session.sha256 == step.sha256
            old = self.holder.swap(step.role, session, step.generation if published else None)
            if published:
                self.failures.pop(step.role, None)
            self.metrics.reload(step.role, "ok")
            log.info(
                "worker %s now serves %s generation %s (sha256 %s, was %s), loaded in %.2f s",
                self.worker_id,
                step.role,
                step.generation if published else "(its own file, not the published one)",
                session.sha256[:12],
                old.sha256[:12] if old else "none",
                session.load_s,
            )
            self.heartbeat()
        finally:
            self._rejoin()
            self._release_slot(step.role)
        return True

    def _fail(self, step: Refuse | Load, reason: str) -> None:
        failure = after_failure(
            self.failures.get(step.role),
            step,
            reason,
            time.monotonic(),
            time.time(),
            self.settings.reload_retry_max_s,
        )
        self.failures[step.role] = failure
        self.metrics.reload(step.role, "failed")
        current = self.holder.sessions.get(step.role)
        wanted = (
            f"generation {step.generation} (sha256 {step.sha256[:12]})" if step.sha256 else "its model file"
        )
        then = (
            "waiting for the file to change"
            if math.isinf(failure.retry_at)
            else f"retrying in {failure.retry_at - time.monotonic():.0f} s"
        )
        log.warning(
            "worker %s keeps its %s model (sha256 %s): %s not loaded: %s; %s",
            self.worker_id,
            step.role,
            current.sha256[:12] if current else "none",
            wanted,
            reason,
            then,
        )
        self.heartbeat()

    # -- what the view is made of ---------------------------------------------------------------
    def _published(self, role: str) -> dict[str, str]:
        if self.redis is None:
            return {}
        try:
            return generations.published(self.redis, role)
        except redis.RedisError:
            return {}

    def _candidate(self, role: str) -> Candidate | None:
        record = generations.candidate(self.redis, self.host, role) if self.redis is not None else {}
        if not record:
            return None
        return Candidate(str(record.get("sha256") or ""), int(record.get("size") or 0))

    def _local_file(self, role: str) -> FileIdentity | None:
        try:
            return FileIdentity.of(self.registry.find_model(role, self.settings.model_dir))
        except (VoxmillError, OSError):
            return None

    def _peer_counts(self) -> dict[str, int]:
        """This machine's live processes (this one included) serving each role, counted every 10 s."""
        counted_at, counts = self._peers
        if self.redis is None or time.monotonic() - counted_at <= tuning.PEERS_TTL_S:
            return counts
        counts = {role: 0 for role in self.holder.roles}
        for record in read_worker_records(self.redis, host=self.host):
            for role in counts:
                counts[role] += role in record.models
        self._peers = (time.monotonic(), counts)
        return counts

    # -- locks --------------------------------------------------------------------------------
    def _take_slot(self, role: str) -> bool:
        """Hold one of the machine's reload slots for `role` (kept, and refreshed, if held already)."""
        if self.redis is None:
            return True
        held = self._slots.get(role)
        if held is not None:
            self.redis.expire(held, self.settings.reload_slot_ttl_s)
            return True
        peers = self._peer_counts().get(role, 1)
        for slot in range(slot_count(self.settings.reload_slots, peers)):
            key = keys.RELOAD_SLOT.format(host=self.host, role=role, slot=slot)
            if self.redis.set(key, self.worker_id, nx=True, ex=self.settings.reload_slot_ttl_s):
                self._slots[role] = key
                return True
        return False

    def _release_slot(self, role: str) -> None:
        key = self._slots.pop(role, None)
        if key is not None:
            self._unlock(key)

    def _stand_aside(self) -> bool:
        """Take the machine's aside lock (refreshed if held) and stop taking tasks; True if aside."""
        if self.redis is None:
            return False
        ttl_s = self.settings.reload_slot_ttl_s
        if self._aside_key is not None:
            self.redis.expire(self._aside_key, ttl_s)
            return True
        key = keys.ASIDE.format(host=self.host)
        if not self.redis.set(key, self.worker_id, nx=True, ex=ttl_s):
            return False
        self._aside_key = key
        self.holder.stand_aside()
        log.info("worker %s stands aside (takes no task) while it reloads", self.worker_id)
        self.heartbeat()
        return True

    def _rejoin(self) -> None:
        key, self._aside_key = self._aside_key, None
        self.holder.rejoin()
        if key is not None:
            self._unlock(key)
            self.heartbeat()

    def _unlock(self, key: str) -> None:
        """Delete a lock this process holds (left to expire when Redis does not answer)."""
        if self.redis is not None:
            with contextlib.suppress(redis.RedisError):
                if self.redis.get(key) == self.worker_id.encode():
                    self.redis.delete(key)


def _close(listener: PubSub | None) -> None:
    """Close a pub/sub connection, whatever state it is in."""
    if listener is not None:
        with contextlib.suppress(Exception):
            listener.close()
