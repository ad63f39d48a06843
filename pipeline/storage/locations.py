"""A run's output location, local or in an object store, whose files appear complete or not at all.

`OutputLocation` is the folder of a run: `LocalFolder` (a file is written to a temporary name,
fsynced and renamed: `atomic_file`) or `ObjectFolder` (an object is one PUT of the whole object,
which a store makes visible complete or not at all). Both list a sub-folder in one call. The run
whose folder it is, and the names of its files, are `pipeline.outputs.folder.RunFolder`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.errors import BAD_REQUEST, OUTPUT_ERROR, VoxmillError
from pipeline.storage.objects import filesystem, list_url, read_url, url_exists, with_retries
from pipeline.storage.urls import StoreUrl, is_url, parse_url

WRITABLE_SCHEMES = ("s3", "gs", "gcs")


@dataclass(frozen=True)
class LocalFolder:
    """A local output folder: today's files, written to a temporary name and renamed."""

    root: Path
    is_local: bool = True

    def ref(self, name: str) -> Path:
        return self.root / name if name else self.root

    def display(self, name: str = "") -> str:
        return str(self.ref(name))

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def names(self, folder: str) -> set[str]:
        try:
            with os.scandir(self.root / folder) as entries:
                return {e.name for e in entries if e.is_file() and not e.name.startswith(".")}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def entries(self, folder: str) -> set[str]:
        try:
            with os.scandir(self.root / folder) as entries:
                return {f"{e.name}/" if e.is_dir() else e.name for e in entries}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def writer(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return atomic_file(self.root / name)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / name).unlink()


@dataclass(frozen=True)
class ObjectFolder:
    """A prefix in an object store: each file one object, written by one PUT of the whole object
    (a store shows an object complete or not at all), listed with one listing call."""

    url: StoreUrl
    is_local: bool = False

    def ref(self, name: str) -> str:
        return str(self.url.join(name)) if name else str(self.url)

    def display(self, name: str = "") -> str:
        return self.ref(name)

    def exists(self, name: str) -> bool:
        return url_exists(self.ref(name))

    def read_bytes(self, name: str) -> bytes:
        return read_url(self.ref(name))

    def names(self, folder: str) -> set[str]:
        return set(list_url(self.ref(folder)))

    def entries(self, folder: str) -> set[str]:
        return set(list_url(self.ref(folder), folders=True))

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[IO[bytes]]:
        """Spooled to a local temporary file, then PUT whole (a large one as a multipart upload,
        which the store also completes atomically); nothing is uploaded if the block fails."""
        target = self.ref(name)
        spool = tempfile.NamedTemporaryFile(prefix="voxmill-put-", delete=False)  # noqa: SIM115
        try:
            with spool:
                try:
                    yield spool
                except OSError as exc:
                    raise VoxmillError(OUTPUT_ERROR, f"cannot write {target}: {exc.strerror or exc}") from exc
            self._put(name, Path(spool.name))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spool.name)

    def create(self, name: str, data: bytes) -> bool:
        """PUT `data` as `name` unless the object exists (S3's `If-None-Match: *`, GCS's
        `ifGenerationMatch=0`): False when the store refused because it does. A store that
        ignores the condition writes over the object and says True."""
        target = self.ref(name)
        fs = filesystem(self.url.scheme)

        def put() -> bool:
            try:
                fs.pipe_file(parse_url(target).fs_path, data, mode="create")
            except FileExistsError:
                return False
            return True

        try:
            return with_retries(put, target, "cannot write")
        except VoxmillError as exc:
            raise VoxmillError(OUTPUT_ERROR, exc.message) from None

    def put_files(self, files: Mapping[str, Path], in_flight: int) -> None:
        """Upload local files as the objects `name` -> `path`, `in_flight` at once: each one a
        whole PUT (retried as `writer`'s), so with all at once the last finishes a round trip
        after the first, not one per file later. Every upload is waited for; the first failure
        is then raised."""
        if not files:
            return
        threads = max(1, min(in_flight, len(files)))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="voxmill-put") as pool:
            uploads = [pool.submit(self._put, name, local) for name, local in files.items()]
        for upload in uploads:
            upload.result()

    def _put(self, name: str, local: Path) -> None:
        target = self.ref(name)
        fs = filesystem(self.url.scheme)
        try:
            with_retries(lambda: fs.put_file(str(local), parse_url(target).fs_path), target, "cannot write")
        except VoxmillError as exc:
            raise VoxmillError(OUTPUT_ERROR, exc.message) from None

    def delete(self, name: str) -> None:
        fs = filesystem(self.url.scheme)
        path = parse_url(self.ref(name)).fs_path

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)

        with_retries(remove, self.ref(name), "cannot delete")


# A run's output folder: names inside it are '/'-separated and relative. Both kinds answer
# ref (a Path, or a URL string), display, exists, read_bytes, names (a sub-folder's file names,
# one listing call), entries (its files and, ending in '/', its folders: one listing call), writer
# (complete or absent) and delete.
OutputLocation = LocalFolder | ObjectFolder


def output_location(out: str | os.PathLike[str]) -> OutputLocation:
    """The output location of a `--out` value (mended: `pipeline.outputs.folder.RunFolder.of`): a
    URL (`s3://`, `gs://`) or a local folder."""
    if isinstance(out, str) and is_url(out):
        url = parse_url(out)
        if url.scheme not in WRITABLE_SCHEMES:
            raise VoxmillError(BAD_REQUEST, f"cannot write outputs to {url.scheme}:// (use s3:// or gs://)")
        return ObjectFolder(url)
    return LocalFolder(Path(out))


# --------------------------------------------------------------------------- atomic files


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A stream whose bytes become `path` complete or not at all: a temporary file in the same
    folder, fsynced and renamed over `path` when the block ends without an exception.

    Any OS or Arrow failure (disk full, unwritable folder) becomes `VoxmillError("output_error")`;
    the temporary file is removed whatever ended the block.
    """
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except _write_errors() as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VoxmillError(OUTPUT_ERROR, f"cannot write {path}: {reason}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _write_errors() -> tuple[type[Exception], ...]:
    """What a failed write raises: an OS error, or Arrow's own when a table is written. Arrow's
    class is taken only where pyarrow is loaded (no Arrow write can have run otherwise), so that
    naming an output location imports no pyarrow."""
    arrow = sys.modules.get("pyarrow")
    return (OSError,) if arrow is None else (OSError, arrow.ArrowException)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` complete or not at all (`atomic_file`) with `write(stream)`."""
    with atomic_file(path) as stream:
        write(stream)


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (best effort: not every file system lets a folder be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
