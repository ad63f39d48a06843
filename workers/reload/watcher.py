"""`voxmill watch`: the model watcher. New model files in, validated, published; workers swap.

One watcher runs per model folder (per machine). What it does with a file:

1. **Sees it change.** A `watchdog` observer on the folder reports files created, written,
   closed after writing, moved in (an atomic rename), moved away and deleted; opens and reads
   (`opened`, `closed_no_write`: every worker loading a model makes them) are dropped. A symlinked
   folder (`models/current -> v2/`) is followed by polling what it resolves to on every tick
   (0.1 s): when the target changes, the watch moves to the new folder and every role is
   re-checked. A rescan every 2 s compares each role's file identity with the last one seen, which
   catches what events miss (network file systems, a symlinked model file whose blob changes).
2. **Waits until it settles.** A role's file is a candidate once its identity (path, inode, size,
   mtime, ctime: `pipeline.models.identity.FileIdentity`) held still for `watch_quiet_s` and, where the
   platform reports it (inotify), its writer closed it; a file held open without writes for
   `watch_writing_max_s` settles anyway. It is hashed once, and with the optimized-model cache on
   the sha256 is recorded for this machine (`pipeline.models.cache`, known hashes): the validator
   and every worker loading the unchanged file take it from there instead of reading half a
   gigabyte again.
   A changed file is announced to the machine's workers as a candidate (`keys.CANDIDATE`) as
   soon as it settles and until its verdict is out: for a large model one of them stands aside
   meanwhile, so the hash and the validation get a core (`workers.reload.coordinator`).
3. **Validates it in a separate process** (`workers.reload.validation`) with the workers' provider
   settings: load, signature check against the registry, one run of the reference clip, outputs
   finite (`pipeline.inference.open_session`). A crash or a hang of the validator
   (`watch_validate_timeout_s`) is a rejection, never a dead watcher.
4. **Publishes or rejects.** Accepted: a new generation record in Redis (`workers.reload.generations`),
   announced on `keys.GENERATION_CHANNEL`. Rejected: the reason goes to the log, to
   `keys.REJECTION` (`voxmill status` shows it) and to `WatcherHooks.after_rejection` (the metrics
   hook); the published generation is untouched. A deleted file is a warning: workers keep
   serving the session they hold.

Several machines, one model per role. A generation is keyed by content. Each machine runs its
own watcher on its own copy, and each worker loads its *own machine's* file, swapping only when
the sha256 of the bytes it read equals the published one. Publishing a sha256 that is already
published is a no-op, so when the copies are updated one machine after another (rsync, a
deploy), the first watcher to see the new file publishes it and the others find it published;
workers on a machine whose copy is not there yet keep their session (status lists them, with
the reason, under their old sha256) and swap as soon as their copy lands. To roll back, put the
old file back on the machines: it is a new generation with the old sha256. At start-up a watcher
publishes its file only when nothing is published or the file changed (ctime/mtime) after the
published generation; a restarted watcher on a machine that lags behind never rolls the
cluster back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from watchdog.events import (
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CLOSED_NO_WRITE,
    EVENT_TYPE_DELETED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    EVENT_TYPE_OPENED,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from pipeline import tuning
from pipeline.errors import VoxmillError
from pipeline.models.files import hash_model_file
from pipeline.models.identity import FileIdentity
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.settings import Settings
from workers.reload import generations
from workers.reload.validation import Validation, Validator

log = logging.getLogger("voxmill.watcher")

# What an event says about the file it names.
LANDED = "landed"  # created, moved in, attributes changed: check it once it is quiet
WRITTEN = "written"  # bytes written: its writer holds it open until `closed`
CLOSED = "closed"  # its writer closed it after writing
GONE = "gone"  # deleted or moved away
IGNORED_EVENTS = frozenset({EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE})
EVENT_FILTER: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    FileModifiedEvent,
    FileClosedEvent,
    FileMovedEvent,
    FileDeletedEvent,
]
Stamp = FileIdentity | None  # a role's file now (None: it has none)


# -- pure parts: event filtering, debounce, start-up rule -----------------------------------
@dataclass(frozen=True)
class Change:
    """One file event reduced to what the watcher needs: the file's name and what happened."""

    name: str
    kind: str


def model_changes(event: FileSystemEvent) -> list[Change]:
    """The file changes a watchdog event reports; none for opens, reads and directories."""
    if event.is_directory or event.event_type in IGNORED_EVENTS:
        return []
    name = Path(os.fsdecode(event.src_path)).name
    if event.event_type == EVENT_TYPE_MOVED:
        return [Change(name, GONE), Change(Path(os.fsdecode(event.dest_path)).name, LANDED)]
    kinds = {EVENT_TYPE_MODIFIED: WRITTEN, EVENT_TYPE_CLOSED: CLOSED, EVENT_TYPE_DELETED: GONE}
    return [Change(name, kinds.get(event.event_type, LANDED))]


@dataclass
class _Pending:
    changed_at: float
    stamp: Stamp = None
    observed: bool = False
    writing: bool = False


class Debouncer:
    """Which keys stopped changing: a key settles once its stamp held still for `quiet_s`.

    `touch` (an event) restarts a key's quiet period; `observe` feeds its current stamp (a
    different stamp restarts it too); `pop_settled` hands out the settled keys. A key whose
    writer still holds it open (`touch(writing=True)` without `closed`) waits `writing_max_s`.
    Times are monotonic seconds passed in, so the class is pure.
    """

    def __init__(self, quiet_s: float, writing_max_s: float) -> None:
        self.quiet_s = quiet_s
        self.writing_max_s = max(writing_max_s, quiet_s)
        self._pending: dict[str, _Pending] = {}

    @property
    def pending(self) -> list[str]:
        return list(self._pending)

    def touch(self, key: str, now: float, writing: bool | None = None) -> None:
        """An event on `key`: (re)start its quiet period; `writing` says if a writer holds it open."""
        entry = self._pending.setdefault(key, _Pending(changed_at=now))
        entry.changed_at = now
        if writing is not None:
            entry.writing = writing

    def closed(self, key: str, now: float) -> None:
        """The writer of `key` closed it; its quiet period goes on (closing changes no bytes)."""
        self._pending.setdefault(key, _Pending(changed_at=now)).writing = False

    def observe(self, key: str, stamp: Stamp, now: float) -> None:
        """The current stamp of a pending key; a different one restarts its quiet period."""
        entry = self._pending.get(key)
        if entry is None:
            return
        if entry.observed and stamp != entry.stamp:
            entry.changed_at = now
        entry.stamp, entry.observed = stamp, True

    def pop_settled(self, now: float) -> list[tuple[str, Stamp]]:
        """The keys (with their last stamp) that settled; they are no longer pending."""
        settled = [(key, e.stamp) for key, e in self._pending.items() if self._settled(e, now)]
        for key, _ in settled:
            del self._pending[key]
        return settled

    def _settled(self, entry: _Pending, now: float) -> bool:
        quiet_s = now - entry.changed_at
        if not entry.observed or quiet_s < self.quiet_s:
            return False
        return not entry.writing or quiet_s >= self.writing_max_s


def startup_should_publish(published: dict[str, str], sha256: str, changed_at: float) -> bool:
    """At start-up: publish when nothing is, or when this file changed after the published one.

    `changed_at` is the file's last change (max of ctime and mtime, epoch seconds). A copy that
    differs but is older than the published generation means this machine lags behind.
    """
    if not published.get("sha256"):
        return True
    if published["sha256"] == sha256:
        return False
    return changed_at > float(published.get("time") or 0.0)


# -- the watcher process ----------------------------------------------------------------------
def last_change_time(path: Path) -> float:
    """When the file last changed (content, or moved/linked into place): max(ctime, mtime)."""
    st = path.stat()
    return max(st.st_ctime, st.st_mtime)


class WatcherHooks:
    """What happens to candidates, as no-op hooks (dramatiq's middleware shape).

    A metrics module subclasses this (e.g. `voxmill_model_rejections_total{role}`) and passes
    it to `Watcher`; nothing else needs to change.
    """

    def after_publish(self, role: str, generation: int, record: dict[str, Any]) -> None:
        """A candidate was accepted and published as `generation`."""

    def after_rejection(self, role: str, rejection: dict[str, Any]) -> None:
        """A candidate was rejected; `rejection` holds path, sha256 and reason."""

    def after_missing(self, role: str) -> None:
        """The role's model file is gone; workers keep serving what they hold."""


class MetricsHooks(WatcherHooks):
    """Counts publications and rejections per role as Prometheus series."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def after_publish(self, role: str, generation: int, record: dict[str, Any]) -> None:
        self.metrics.publication(role)

    def after_rejection(self, role: str, rejection: dict[str, Any]) -> None:
        self.metrics.rejection(role)


class EventQueue(FileSystemEventHandler):
    """watchdog handler: queues each model-relevant change for the watcher's loop."""

    def __init__(self, changes: queue.Queue[Change]) -> None:
        self.changes = changes

    def on_any_event(self, event: FileSystemEvent) -> None:
        for change in model_changes(event):
            self.changes.put(change)


class Watcher:
    """Watches one model folder and publishes each role's validated file as a generation."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        registry: Registry | None = None,
        hooks: WatcherHooks | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.registry = registry or Registry.load()
        self.hooks = hooks or WatcherHooks()
        self.model_dir = Path(settings.model_dir)
        self.roles = tuple(self.registry.roles)
        self.host = socket.gethostname()
        self.debouncer = Debouncer(settings.watch_quiet_s, settings.watch_writing_max_s)
        self.validator = Validator(settings)
        self.known_hashes = SessionOptions.from_settings(settings).model_cache()
        self.changes: queue.Queue[Change] = queue.Queue()
        self.reports_close = False
        self._target: Path | None = None
        self._watch: ObservedWatch | None = None
        self._known: dict[str, Stamp] = {}
        self._accepted: dict[str, str] = {}
        self._startup: set[str] = set()
        self._next_rescan = 0.0

    def run(self, stop: threading.Event) -> None:
        """Watch until `stop` is set. Every role is checked once at start-up."""
        observer = Observer()
        self.reports_close = type(observer).__name__.startswith("Inotify")
        observer.start()
        try:
            now = time.monotonic()
            self._retarget(observer, now)
            self._startup = set(self.roles)
            self._next_rescan = now + tuning.WATCH_RESCAN_S
            log.info(
                "watching %s (%s) for %s; a file settles after %.2f s without change",
                self.model_dir,
                self._target,
                ", ".join(self.roles),
                self.settings.watch_quiet_s,
            )
            while not stop.is_set():
                self._drain(tuning.WATCH_TICK_S)
                self.tick(observer, time.monotonic())
        finally:
            observer.stop()
            observer.join(timeout=5)

    def tick(self, observer: BaseObserver, now: float) -> None:
        """Follow the folder's symlink, rescan, debounce, and handle every settled role."""
        target = self.model_dir.resolve()
        if target != self._target or (self._watch is None and target.is_dir()):
            self._retarget(observer, now)
        if now >= self._next_rescan:
            self._rescan(now)
        for role in self.debouncer.pending:
            self.debouncer.observe(role, self._stamp(role), now)
        for role, stamp in self.debouncer.pop_settled(now):
            try:
                self.settle(role, stamp)
            except (redis.RedisError, OSError) as exc:
                log.warning("%s: could not finish checking its model (%s); trying again", role, exc)
                self.debouncer.touch(role, time.monotonic())

    def _drain(self, timeout_s: float) -> None:
        try:
            change = self.changes.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            self._apply(change, time.monotonic())
            try:
                change = self.changes.get_nowait()
            except queue.Empty:
                return

    def _apply(self, change: Change, now: float) -> None:
        role = self.registry.role_of_file(change.name)
        if role is None:
            return
        self._startup.discard(role)  # seen changing now: no start-up rule for it
        if change.kind == CLOSED:
            self.debouncer.closed(role, now)
        else:
            writing = self.reports_close if change.kind == WRITTEN else None
            self.debouncer.touch(role, now, writing=writing)

    def _retarget(self, observer: BaseObserver, now: float) -> None:
        target = self.model_dir.resolve()
        if self._watch is not None:
            observer.unschedule(self._watch)
            self._watch = None
        if self._target is not None and target != self._target:
            log.info("model folder %s now resolves to %s; checking every role", self.model_dir, target)
        self._target = target
        if target.is_dir():
            self._watch = observer.schedule(
                EventQueue(self.changes), str(target), recursive=False, event_filter=EVENT_FILTER
            )
        else:
            log.warning("model folder %s does not exist; waiting for it", self.model_dir)
        for role in self.roles:
            self.debouncer.touch(role, now)

    def _rescan(self, now: float) -> None:
        self._next_rescan = now + tuning.WATCH_RESCAN_S
        pending = set(self.debouncer.pending)
        for role in self.roles:
            if role not in pending and self._stamp(role) != self._known.get(role):
                self.debouncer.touch(role, now)

    def _model_path(self, role: str) -> Path | None:
        try:
            return self.registry.find_model(role, self.model_dir)
        except VoxmillError:
            return None

    def _stamp(self, role: str) -> Stamp:
        path = self._model_path(role)
        if path is None:
            return None
        try:
            return FileIdentity.of(path)
        except OSError:
            return None

    # -- what to do with a settled file -------------------------------------------------------
    def settle(self, role: str, stamp: Stamp) -> None:
        """A role's file stopped changing: publish it if it is new and valid, else say why not."""
        at_startup = role in self._startup
        self._startup.discard(role)
        self._known[role] = stamp
        path = self._model_path(role)
        if path is None or stamp is None:
            self._missing(role)
            return
        if not at_startup:  # a changed file: one worker stands aside already while it is hashed
            self._announce_candidate(role, path, "")
        try:
            self._check(role, path, stamp, at_startup)
        finally:  # after the verdict is out: the worker standing aside goes on to load it
            with contextlib.suppress(redis.RedisError):
                generations.withdraw_candidate(self.client, self.host, role)

    def _check(self, role: str, path: Path, stamp: Stamp, at_startup: bool) -> None:
        """Hash, compare with the published generation, validate, publish or reject."""
        try:  # recorded for the validator and the workers on this machine: they need not hash it again
            sha256 = hash_model_file(path, self.known_hashes, check_head=False)
        except VoxmillError as exc:
            if path.exists():  # there, but unreadable (permissions): a rejection that says why
                self._reject(role, path, "", Validation(ok=False, reason=exc.message))
            else:  # gone meanwhile
                self._missing(role)
            return
        current = generations.published(self.client, role)
        if current.get("sha256") == sha256:
            log.info("%s: %s unchanged (generation %s)", role, path.name, current.get("generation"))
            return
        if at_startup and not startup_should_publish(current, sha256, last_change_time(path)):
            log.warning(
                "%s: %s (sha256 %s) differs from the published generation %s (sha256 %s) and is older; "
                "this machine's copy lags behind, so it is not published (touch it to publish it)",
                role,
                path,
                sha256[:12],
                current.get("generation"),
                current.get("sha256", "")[:12],
            )
            return
        verdict = self._validate(path, role, sha256)
        if self._stamp(role) != stamp or (verdict.sha256 and verdict.sha256 != sha256):
            log.info("%s: %s changed while it was validated; waiting for it to settle", role, path.name)
            self.debouncer.touch(role, time.monotonic())
        elif verdict.ok:
            self._publish(role, path, sha256, verdict)
        else:
            self._reject(role, path, sha256, verdict)

    def _validate(self, path: Path, role: str, sha256: str) -> Validation:
        if self._accepted.get(role) == sha256:  # validated before, publishing failed
            return Validation(ok=True, sha256=sha256)
        log.info("%s: validating %s (sha256 %s)", role, path, sha256[:12])
        self._announce_candidate(role, path, sha256)
        verdict = self.validator.validate(path, role)
        if verdict.ok:
            self._accepted[role] = sha256
        return verdict

    def _announce_candidate(self, role: str, path: Path, sha256: str) -> None:
        """Tell this machine's workers (one of them stands aside) that a candidate is checked now.

        Announced when a changed file settles (sha256 not known yet), again with its sha256 when
        its validation starts, and withdrawn once it is published, rejected or found unchanged.
        """
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        fields = {"sha256": sha256, "file": path.name, "size": size}
        ttl_s = self.settings.watch_validate_timeout_s + tuning.VALIDATOR_EXIT_GRACE_S
        try:
            generations.announce_candidate(self.client, self.host, role, fields, ttl_s)
        except redis.RedisError as exc:  # the validation goes on; only the workers' head start is lost
            log.warning("%s: could not announce the candidate (%s)", role, exc)

    def _publish(self, role: str, path: Path, sha256: str, verdict: Validation) -> None:
        record = {
            "path": str(path),
            "file": path.name,
            "size": path.stat().st_size,
            "host": self.host,
            "variant": verdict.details.get("variant", ""),
            "validate_s": f"{verdict.seconds:.3f}",
        }
        generation = generations.publish(self.client, role, sha256, record)
        if generation == 0:
            log.info("%s: sha256 %s is already the published generation", role, sha256[:12])
            return
        log.info(
            "%s: published generation %d: %s (sha256 %s), validated in %.2f s "
            "(load %.2f s, reference clip %.0f ms)",
            role,
            generation,
            path,
            sha256[:12],
            verdict.seconds,
            float(verdict.details.get("load_s") or 0.0),
            float(verdict.details.get("warm_latency_ms") or 0.0),
        )
        self.hooks.after_publish(role, generation, {"sha256": sha256, "generation": generation, **record})

    def _reject(self, role: str, path: Path, sha256: str, verdict: Validation) -> None:
        rejection = {
            "path": str(path),
            "file": path.name,
            "sha256": sha256,
            "size": path.stat().st_size,
            "host": self.host,
            "reason": verdict.reason,
        }
        current = generations.published(self.client, role)
        log.error(
            "%s: rejected %s (sha256 %s): %s; generation %s (sha256 %s) keeps serving",
            role,
            path,
            sha256[:12],
            verdict.reason,
            current.get("generation"),
            current.get("sha256", "")[:12],
        )
        generations.record_rejection(self.client, role, rejection)
        self.hooks.after_rejection(role, rejection)

    def _missing(self, role: str) -> None:
        current = generations.published(self.client, role)
        spec = self.registry.role(role)
        served = f"generation {current['generation']}" if current.get("generation") else "what they loaded"
        log.warning(
            "%s: no model file (%s) in %s; workers keep serving %s",
            role,
            spec.file_glob,
            self.model_dir,
            served,
        )
        self.hooks.after_missing(role)


def serve(settings: Settings) -> None:
    """Run the watcher in the foreground until SIGINT or SIGTERM (what `voxmill watch` does)."""
    assert settings.broker_url, "the watcher needs a broker"
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    from workers.queue import connections

    client = connections.broker_client(settings, socket_timeout=10, socket_connect_timeout=5)
    hooks = WatcherHooks()
    if settings.watcher_metrics_port:
        from workers import metrics

        hooks = MetricsHooks(metrics.WatcherMetrics())
        metrics.serve(settings.watcher_metrics_port, settings.metrics_bind)
    try:
        Watcher(settings, client, hooks=hooks).run(stop)
    finally:
        client.close()
    log.info("watcher stopped")
