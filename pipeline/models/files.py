"""A model file opened once, hashed through its descriptor and read by ONNX Runtime through it.

The sha256 of exactly the bytes a session is built from is what every result names: the file is
opened once (`PinnedModelFile`), hashed as a stream, and ONNX Runtime reads the very file that was
hashed (`/proc/self/fd/N`), so a model renamed over the path meanwhile cannot mix in, and one
written in place is caught by its size or time changing. A missing file, a folder, an empty file
or a git-lfs pointer is a `model_error` that says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.cache import ModelCache
from pipeline.models.identity import FileIdentity

RACY_MARGIN_NS = 1_000_000_000  # a file changed this recently is hashed, never remembered
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/"


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def read_model_bytes(path: Path) -> bytes:
    """The model file's bytes; a missing file, folder or git-lfs pointer is a `model_error`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    _check_model_head(path, data, len(data))
    return data


def hash_model_file(path: Path, known: ModelCache | None = None, check_head: bool = True) -> str:
    """The sha256 of the model file, read in chunks (never whole in memory), or known (`PinnedModelFile`).

    Errors as `read_model_bytes`; `check_head` False hashes an empty file or a git-lfs pointer too.
    """
    with PinnedModelFile(path, known, check_head) as pinned:
        return pinned.sha256


class PinnedModelFile:
    """A model file opened once: hashed through its descriptor, and read by ONNX Runtime through it.

    `source` is what ONNX Runtime opens: `/proc/self/fd/N` where the platform has it (the very
    file that was hashed, even if another is renamed over the path meanwhile), else the path.
    `check_unchanged()` after building catches a file written in place (or, without
    `/proc`, replaced) while it was read. Opening and hashing raise `model_error` as
    `read_model_bytes` does.

    With `known` (the optimized-model cache), a file this machine already hashed, unchanged
    since (same `FileIdentity`), takes its sha256 from there instead of
    being read (`hashed` False); a file hashed here is recorded for the next load.
    """

    CHUNK_BYTES = 8 * 1024 * 1024

    def __init__(self, path: Path, known: ModelCache | None = None, check_head: bool = True) -> None:
        self.path = path
        self.check_head = check_head
        opened_at_ns = time.time_ns()
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise _unreadable(path, exc) from None
        try:
            self.opened = FileIdentity.from_stat(path, os.fstat(self.fd))
            remembered = known.known_sha256(self.opened) if known is not None else None
            self.hashed = remembered is None
            if remembered and check_head:  # still refused as precisely as when it is read
                head = os.pread(self.fd, len(LFS_POINTER_PREFIX), 0)
                _check_model_head(path, head, self.opened.size)
            self.sha256 = remembered or self._hash()
            if known is not None and self.hashed and self._settled_before(opened_at_ns):
                known.remember_sha256(self.opened, self.sha256)
        except BaseException:
            os.close(self.fd)
            raise
        by_fd = Path(f"/proc/self/fd/{self.fd}")
        self.source = str(by_fd) if by_fd.exists() else str(path)

    def _hash(self) -> str:
        digest = hashlib.sha256()
        size = 0
        try:
            with open(self.fd, "rb", closefd=False) as stream:
                while chunk := stream.read(self.CHUNK_BYTES):
                    if size == 0 and self.check_head:
                        _check_model_head(self.path, chunk, len(chunk))
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise _unreadable(self.path, exc) from None
        if self.check_head:
            _check_model_head(self.path, b"", size)
        return digest.hexdigest()

    def _settled_before(self, opened_at_ns: int) -> bool:
        """Unchanged while hashed, and last changed well before it was opened.

        File times tick coarsely (a few ms): a write landing in the same tick as the previous
        one could leave the identity unchanged. A file last changed `RACY_MARGIN_NS` before it
        was opened cannot: any later write stamps a later time (git's "racy clean" rule).
        """
        unchanged = FileIdentity.from_stat(self.path, os.fstat(self.fd)) == self.opened
        return unchanged and self.opened.last_change_ns < opened_at_ns - RACY_MARGIN_NS

    def check_unchanged(self) -> None:
        """`model_error` when the file was written in place (or, read by path, replaced) since hashing."""
        changed = FileIdentity.from_stat(self.path, os.fstat(self.fd)).written_since(self.opened)
        if not changed and self.source == str(self.path):
            with contextlib.suppress(OSError):
                changed = os.stat(self.path).st_ino != self.opened.inode
        if changed:
            raise VoxmillError(
                errors.MODEL_ERROR,
                f"{self.path} changed while it was read (sha256 {self.sha256[:12]}… no longer holds)",
            )

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> PinnedModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unreadable(path: Path, exc: OSError) -> VoxmillError:
    if isinstance(exc, FileNotFoundError):
        return VoxmillError(errors.MODEL_ERROR, f"model file {path} does not exist")
    return VoxmillError(errors.MODEL_ERROR, f"cannot read model file {path}: {exc.strerror}")


def _check_model_head(path: Path, data: bytes, size: int) -> None:
    if data.startswith(LFS_POINTER_PREFIX):
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{path} is a git-lfs pointer file ({size} bytes), not the model: "
            "run `git lfs pull` in the model folder (or download the real file)",
        )
    if size == 0:
        raise VoxmillError(errors.MODEL_ERROR, f"model file {path} is empty")
