"""The output lock of a `voxmill extract` run: one run writes a folder at a time.

A local folder is locked with `flock` on `DIR/.lock`. An object store has no
flock: the run holds `flock` on a local state folder (`RunFolder.local_state` in `run_state_dir`,
one per output URL: two runs on one machine) and a marker object `DIR/.lock.json` (host, pid, a
token, refreshed every `LOCK_REFRESH_S`): a run finding another's marker fresher than
`LOCK_STALE_S` (or of a live pid on this host) refuses to start. Where no marker is, the run
creates it exclusively (`ObjectFolder.create`); a store that honours that (S3 and GCS do) refuses
a second create of it, and the lock is sure at once. Elsewhere, and over a stale marker, a run
looks once more `SETTLE_S` after writing its marker, and a racing run that wrote after it wins
(`settle`); the run reads meanwhile but writes nothing and sends no shard until it is settled.
Two runs may both go on only when one paused longer than that between its first look and its
write, or wrote its marker plainly (a voxmill before exclusive creates); their shards are
idempotent, so the cost is duplicate work, not wrong outputs. A run frees the folder by deleting
its marker: at once where the store honoured its exclusive create and the marker is fresh, else
once a look shows the marker is still its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any

from pipeline.errors import NOT_FOUND, RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.storage.locations import ObjectFolder

LOCK_REFRESH_S = 20.0
LOCK_STALE_S = 90.0  # a marker not refreshed for this long belongs to a run that is gone
SETTLE_S = 0.2  # from writing the marker to looking at it again: a racing run's write lands first


def lock_output(out_dir: RunFolder, state_dir: Path) -> LocalLock | StoreLock:
    """Hold an exclusive lock on the output folder for the life of the run (`close()` frees it;
    `settle()` before the run writes; `entries`: what the folder held when it was locked, one
    listing). An object-store output is locked in its local state folder under `state_dir` and by
    a marker object (module docstring). `RunError` when another run holds it, or the folder cannot
    be one."""
    try:
        lock = out_dir.lock_file(state_dir)
        if not out_dir.is_local:
            return StoreLock(out_dir, lock).acquire()
        lock.parent.mkdir(parents=True, exist_ok=True)
        held = _flock(lock, f"another `voxmill extract` is running on {out_dir.display()}")
        return LocalLock(held, out_dir.location.entries(""))
    except OSError as exc:
        raise RunError(unusable_output(out_dir, exc)) from None


class LocalLock:
    """The `flock` of a local output folder: sure once taken."""

    def __init__(self, handle: IO[str], entries: set[str]) -> None:
        self.handle = handle
        self.entries = entries

    def settle(self) -> None:
        pass

    def close(self) -> None:
        self.handle.close()


def unusable_output(out_dir: RunFolder, exc: OSError) -> str:
    """Why `--out` cannot hold a run, in words: a local path that is (or lies below) a file says so."""
    where = out_dir.display()
    if out_dir.is_local:
        path = Path(out_dir.name)
        file = next((p for p in (path, *path.parents) if p.is_file()), None)
        if file == path:
            return f"cannot use the output folder {where}: it is a file, not a folder (--out names a folder)"
        if file is not None:
            return f"cannot use the output folder {where}: {file} is a file, not a folder"
    return f"cannot use the output folder {where}: {exc.strerror or exc}"


def _flock(path: Path, busy: str) -> IO[str]:
    handle = open(path, "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(busy) from None
    return handle


class StoreLock:
    """The lock of an object-store output: a local flock plus a marker object (module docstring)."""

    def __init__(self, out_dir: RunFolder, lock_file: Path) -> None:
        self.out_dir = out_dir
        location = out_dir.location
        assert isinstance(location, ObjectFolder)  # a local folder is locked by flock alone
        self.out = location
        self.lock_file = lock_file  # in the run's local state folder
        self.token = secrets.token_hex(8)
        self._local: IO[str] | None = None
        self._written_at = 0.0  # when this run's marker was last written (monotonic); 0: never
        self._created = False  # where none was, as an exclusive create
        self._exclusive = False  # created so, and the store refused to create it again
        self.entries: set[str] = set()  # the folder's, listed before the marker was written
        self._settling = threading.Lock()
        self._settled: RunError | bool = False  # True, or why the lock was lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="voxmill-store-lock", daemon=True)

    def _record(self) -> str:
        return json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "refreshed": time.time()}
        )

    def acquire(self) -> StoreLock:
        state = self.lock_file.parent
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or exc
            raise RunError(f"cannot use the run's local state folder {state}: {reason}") from None
        target = self.out_dir.display()
        busy = f"another `voxmill extract` on this machine writes {target}"
        self._local = _flock(self.lock_file, busy)
        try:
            self.entries = self.out.entries("")  # the first look: a marker listed is read
            self._created = self._write_marker()
            self._written_at = time.monotonic()
        except RunError:  # another run's
            self.close()
            raise
        except VoxmillError as exc:
            self.close()
            raise RunError(f"cannot lock the output {target}: {exc.message}") from None
        self._thread.start()
        return self

    def _write_marker(self) -> bool:
        """Write this run's marker (`entries` listed); True when it was created where none was, as
        an exclusive create (whether the store honours that, `settle` asks)."""
        from pipeline.outputs.writers import write_text_at

        record = self._record()
        if RunFolder.STORE_LOCK not in self.entries or not self._check_marker():  # none there
            try:
                if self.out.create(RunFolder.STORE_LOCK, record.encode()):
                    return True
            except VoxmillError:
                pass  # a store that refuses the condition itself: written plainly
            else:
                self._check_marker()  # another run created it first: RunError when that run is live
        write_text_at(self.out, RunFolder.STORE_LOCK, record)
        return False

    def settle(self) -> None:
        """Make sure the marker is this run's alone: where this run created it, a store that
        refuses to create it again honours exclusive creates, and it is; else, `SETTLE_S` after the
        marker was last written, look at it again: `RunError` when a racing run wrote after it
        (that run wins). Any thread may ask; the first looks, the others wait for its answer."""
        with self._settling:
            if self._settled is False:
                try:
                    self._exclusive = self._created and self._created_again_refused()
                    if not self._exclusive:
                        time.sleep(max(0.0, self._written_at + SETTLE_S - time.monotonic()))
                        self._check_marker()
                    self._settled = True
                except RunError as exc:  # another run's
                    self._settled = exc
                except VoxmillError as exc:
                    where = self.out_dir.display()
                    self._settled = RunError(f"cannot lock the output {where}: {exc.message}")
            if isinstance(self._settled, RunError):
                self._stop.set()  # the marker is another run's now: never refreshed over it
                raise self._settled

    def _created_again_refused(self) -> bool:
        """Whether the store refuses a second create of the marker; where it writes it again, the
        settle counts from now."""
        try:
            if not self.out.create(RunFolder.STORE_LOCK, self._record().encode()):
                return True
        except VoxmillError:
            pass  # not asked: settled as any plain write is
        self._written_at = time.monotonic()
        return False

    def _marker(self) -> dict[str, Any] | None:
        """The marker object, if there is one that reads as a marker (one GET)."""
        try:
            marker = json.loads(self.out.read_bytes(RunFolder.STORE_LOCK))
        except VoxmillError as exc:
            if exc.code == NOT_FOUND:
                return None
            raise
        except ValueError:
            return None  # not ours to read: written half by hand, or by an older voxmill
        return marker if isinstance(marker, dict) else None

    def _check_marker(self) -> bool:
        """Whether there is a marker of another run (`RunError` when that run is live)."""
        marker = self._marker()
        if marker is None or marker.get("token") == self.token:
            return False
        if marker_is_live(marker, socket.gethostname(), time.time()):
            age = time.time() - float(marker.get("refreshed", 0))
            raise RunError(
                f"another `voxmill extract` (host {marker.get('host')}, pid {marker.get('pid')}) holds "
                f"{self.out_dir.display(RunFolder.STORE_LOCK)}, refreshed {age:.0f} s ago; if that run is "
                f"gone, delete the object or wait {LOCK_STALE_S:.0f} s"
            )
        return True

    def _surely_ours(self) -> bool:
        """Whether the marker is this run's without a look: no other run can create it where the
        store honours exclusive creates, and none takes it over while it is fresh (written within
        half of `LOCK_STALE_S`: the other half covers another host's clock running ahead)."""
        return self._exclusive and time.monotonic() - self._written_at < LOCK_STALE_S / 2

    def _still_ours(self) -> bool:
        marker = self._marker()
        return marker is not None and marker.get("token") == self.token

    def _refresh(self) -> None:
        from pipeline.outputs.writers import write_text_at

        while not self._stop.wait(LOCK_REFRESH_S):
            try:
                write_text_at(self.out, RunFolder.STORE_LOCK, self._record())
            except VoxmillError:
                continue  # the next refresh may succeed; a stale marker only lets another run in
            self._written_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            written = self._local is not None and self._written_at > 0  # a marker of this run's
            if written and (self._surely_ours() or self._still_ours()):
                self.out.delete(RunFolder.STORE_LOCK)
        except VoxmillError:
            pass  # left behind: stale after LOCK_STALE_S
        if self._local is not None:
            self._local.close()
            self._local = None


def marker_is_live(marker: dict[str, Any], host: str, now: float) -> bool:
    """Whether a lock marker belongs to a run still going: refreshed within `LOCK_STALE_S`, and,
    when written on this host, by a process that still exists."""
    try:
        refreshed = float(marker.get("refreshed", 0))
        pid = int(marker.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if now - refreshed > LOCK_STALE_S:
        return False
    if marker.get("host") == host and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True
