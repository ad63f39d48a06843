"""The optimized-model cache: ONNX Runtime's graph optimisation done once per model and machine.

Building a session from an `.onnx` file spends most of its time optimising the graph (the full
tokenizer: about 2.5 of 3 s on our 2-core machines). ONNX Runtime can save the optimised graph
(`optimized_model_filepath`, weights in an external file); a later session built from that file
with optimisation off starts in about a third of the time and never holds the model's bytes in
memory, and it gives bit-identical outputs (`tests/unit/test_model_cache.py`).

An entry is a folder `model_cache_dir/<key>/` holding `model.onnx`, `model.bin` and
`entry.json`. The key covers everything the saved graph depends on: the source model's sha256,
the ONNX Runtime version, the provider (CPU only: GPU providers have their own engine caches)
and this machine's CPU (ORT_ENABLE_ALL picks kernels and layouts for the CPU's instruction
sets), so a new model, an ONNX Runtime upgrade or another machine never reads a stale entry.

Trust: an entry is a model the worker runs in place of the source, under the source's sha256.
So the cache folder must be this user's and writable by nobody else (checked at every use, as
ssh checks `~/.ssh`); otherwise voxmill warns once and loads from the source. Entries are written
into a temporary folder and renamed into place, so a crash or a concurrent writer never leaves a
half-written entry; an entry that fails to load is rebuilt. At most `keep` entries are kept
(least recently used first out), so a watcher swapping models does not fill the disk.

Life of an entry: `lookup` (hit: build the session from it) or `prepare` + ONNX Runtime writes
it while building the session from the source + `commit`; `prune` after a commit.

Known hashes: hashing the full tokenizer (half a gigabyte) is most of a cache hit's load. Once a
process on this machine has hashed a model file, `remember_sha256` records its sha256 under the
file's identity (`pipeline.models.identity.FileIdentity`: device, inode, size, modification and change
times). A later load of the same unchanged file (`known_sha256`: the watcher
hashed it when it settled, so its validator, every worker's reload and every restart skip it)
takes the sha256 from there; a file changed less than a second before it was opened is never
recorded (`pipeline.models.files.RACY_MARGIN_NS`: file times tick coarsely). Writing the file in
place, renaming another over it or touching it changes the identity (the change time cannot be
set back), so a changed file is always hashed again. The records live in `hashes/` under the
same trust rules as the entries; the newest `KNOWN_HASHES_KEEP` are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.models.identity import FileIdentity

log = logging.getLogger("voxmill.model_cache")

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.bin"
ENTRY_FILE = "entry.json"
FORMAT = 1
EXTERNAL_MIN_BYTES = 1024
DEFAULT_KEEP = 6
HASHES_DIR = "hashes"
KNOWN_HASHES_KEEP = 64
_warned: set[str] = set()


@lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """A short digest of this machine's CPU model and instruction-set flags."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    except OSError:
        pass
    text = f"{platform.machine()}|{model or platform.processor()}|{flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_key(model_sha256: str, ort_version: str, provider: str = "cpu", cpu: str | None = None) -> str:
    """The entry name: the model's sha256 prefix and a digest of everything the saved graph depends on."""
    cpu = cpu or cpu_fingerprint()
    parts = f"format={FORMAT}|sha256={model_sha256}|ort={ort_version}|provider={provider}|cpu={cpu}"
    return f"{model_sha256[:16]}-{hashlib.sha256(parts.encode()).hexdigest()[:16]}"


def untrusted_reason(folder: Path) -> str | None:
    """Why `folder` cannot hold cache entries (another owner, writable by others), or None."""
    try:
        st = folder.stat()
    except OSError as exc:
        return f"cannot read {folder}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{folder} belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        return f"{folder} is writable by its group or others (mode {mode:o}); chmod 700 it"
    return None


def _warn_once(folder: Path, message: str) -> None:
    if str(folder) not in _warned:
        _warned.add(str(folder))
        log.warning("optimized-model cache not used: %s; loading models from their files", message)


@dataclass(frozen=True)
class CacheEntry:
    """One saved optimised model: its folder and the files ONNX Runtime reads."""

    folder: Path

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE

    def facts(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.folder / ENTRY_FILE).read_text())
        return data

    def is_complete(self) -> bool:
        """The entry file names the sizes the model and weight files still have."""
        try:
            sizes = self.facts()["sizes"]
            return all((self.folder / name).stat().st_size == size for name, size in sizes.items())
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def touch(self) -> None:
        """Mark as recently used (for `prune`)."""
        with contextlib.suppress(OSError):
            os.utime(self.folder / ENTRY_FILE)


class ModelCache:
    """The cache folder (`model_cache_dir`); every method tolerates an unusable folder by doing nothing."""

    def __init__(self, root: Path, keep: int = DEFAULT_KEEP) -> None:
        self.root = root
        self.keep = max(1, keep)

    def usable(self) -> bool:
        """Create the folder (mode 700) when missing; False (warned once) when it cannot be trusted."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            _warn_once(self.root, f"cannot create {self.root}: {exc.strerror}")
            return False
        reason = untrusted_reason(self.root)
        if reason:
            _warn_once(self.root, reason)
            return False
        return True

    def lookup(self, key: str) -> CacheEntry | None:
        """The complete entry for `key`, or None."""
        entry = CacheEntry(self.root / key)
        if not entry.folder.is_dir():
            return None
        if not entry.is_complete() or untrusted_reason(entry.folder):
            log.warning("optimized-model cache entry %s is incomplete or untrusted; rebuilding it", key)
            self.discard(entry)
            return None
        entry.touch()
        return entry

    def prepare(self, key: str) -> Path:
        """A fresh private folder where ONNX Runtime writes the entry for `key`."""
        return Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))

    def commit(self, key: str, staging: Path, facts: dict[str, Any]) -> CacheEntry | None:
        """Record sizes and facts and rename `staging` into place; None when it was not written."""
        sizes = {}
        for name in (MODEL_FILE, WEIGHTS_FILE):
            path = staging / name
            if path.exists():
                sizes[name] = path.stat().st_size
        if MODEL_FILE not in sizes:
            shutil.rmtree(staging, ignore_errors=True)
            return None
        record = {"format": FORMAT, "key": key, "sizes": sizes, "created": time.time(), **facts}
        (staging / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        final = self.root / key
        try:
            staging.rename(final)
        except OSError:  # another process committed the same key first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
        self.prune()
        return CacheEntry(final) if final.is_dir() else None

    def known_sha256(self, opened: FileIdentity) -> str | None:
        """The sha256 recorded for a file with exactly this identity, or None."""
        record = self.root / HASHES_DIR / opened.key
        try:
            if untrusted_reason(record.parent):
                return None
            sha256 = record.read_text().strip()
        except OSError:
            return None
        return sha256 if len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256) else None

    def remember_sha256(self, opened: FileIdentity, sha256: str) -> None:
        """Record the sha256 of a file just hashed whole, under its identity when opened."""
        folder = self.root / HASHES_DIR
        with contextlib.suppress(OSError):
            folder.mkdir(mode=0o700, exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=".", dir=folder)
            with os.fdopen(fd, "w") as stream:
                stream.write(sha256)
            os.replace(staging, folder / opened.key)
            records = sorted(
                (p for p in folder.iterdir() if not p.name.startswith(".")),
                key=lambda p: p.stat().st_mtime,
                reverse=True,
            )
            for old in records[KNOWN_HASHES_KEEP:]:
                old.unlink()

    def discard(self, entry: CacheEntry) -> None:
        shutil.rmtree(entry.folder, ignore_errors=True)

    def entries(self) -> list[CacheEntry]:
        """Committed entries, most recently used first."""
        found = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if folder.name.startswith(".") or not (folder / ENTRY_FILE).exists():
                continue
            found.append((folder.joinpath(ENTRY_FILE).stat().st_mtime, CacheEntry(folder)))
        return [entry for _, entry in sorted(found, key=lambda item: item[0], reverse=True)]

    def prune(self) -> list[Path]:
        """Delete all but the `keep` most recently used entries; the folders deleted."""
        removed = []
        for entry in self.entries()[self.keep :]:
            self.discard(entry)
            removed.append(entry.folder)
        return removed


def save_options(so: Any, staging: Path) -> None:
    """Have the session being built write its optimised graph (and external weights) into `staging`."""
    so.optimized_model_filepath = str(staging / MODEL_FILE)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", WEIGHTS_FILE)
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", str(EXTERNAL_MIN_BYTES)
    )
