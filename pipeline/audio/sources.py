"""A clip's bytes opened for decoding: a path, a confined path, a URL or raw bytes, sized first.

A path must be a regular file (FIFOs and devices are refused from `os.stat`, never opened in
blocking mode), not empty, and at most `max_file_bytes`; raw bytes at most `max_payload_bytes`; a
URL (`s3://`, `gs://`, `http(s)://`, `pipeline.storage.objects`) is sized by one HEAD and refused
the same way before a byte of it is read. A `ConfinedPath` is opened from its root without a
window (`pipeline.storage.paths.open_confined`). A `Fetched` object (`prefetch_clips`: read ahead
of the model, checked the same way) reads as its URL would have.
"""

from __future__ import annotations

import functools
import io
import os
import stat
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import soundfile as sf

from pipeline.errors import BAD_REQUEST, EMPTY, NOT_FOUND, TOO_LARGE, UNREADABLE, VoxmillError
from pipeline.settings import AudioLimits
from pipeline.storage.objects import Reserve, fetch_checked
from pipeline.storage.paths import ConfinedPath, open_confined
from pipeline.storage.prefetch import ReadAhead, prefetch
from pipeline.storage.urls import is_url
from pipeline.units import format_bytes

_PAYLOAD_NAME = "payload"


@dataclass(frozen=True)
class Fetched:
    """An object read ahead of its decode (`prefetch_clips`): its bytes, a stream of ranged reads
    (an object too large to hold), or the error reading it gave, size-checked as a URL source is."""

    url: str
    content: bytes | BinaryIO | VoxmillError

    def open(self) -> BinaryIO:
        """A stream from the object's start (the same stream each time for a streamed object:
        segments of one recording read it in turn); its error, raised, when it could not be read."""
        if isinstance(self.content, VoxmillError):
            raise VoxmillError(self.content.code, self.content.message)
        if isinstance(self.content, bytes):
            return io.BytesIO(self.content)
        self.content.seek(0)
        return self.content


# A ConfinedPath (a worker's job or utterance) is opened without a window (`pipeline.storage.paths`).
Source = str | Path | bytes | ConfinedPath | Fetched


@dataclass
class Opened:
    """An open source: the stream to decode, a name for messages and, for paths, the path.

    `sound`: libsndfile's handle, opened once for the header and kept for the decode.
    """

    stream: BinaryIO
    name: str
    path: Path | None
    sound: sf.SoundFile | None = None

    def soundfile(self) -> sf.SoundFile:
        """libsndfile's handle on the stream (sf.SoundFileError or RuntimeError when it refuses it)."""
        if self.sound is None:
            self.stream.seek(0)
            if self.path is None:
                self.sound = sf.SoundFile(self.stream)
            else:  # a regular file: libsndfile reads its descriptor itself, not through Python calls
                fd = self.stream.fileno()
                os.lseek(fd, 0, os.SEEK_SET)
                self.sound = sf.SoundFile(fd, closefd=False)
        return self.sound

    def close(self) -> None:
        if self.sound is not None:
            self.sound.close()
            self.sound = None


@contextmanager
def open_source(source: Source, limits: AudioLimits) -> Iterator[Opened]:
    """Yield a seekable stream over a checked path or payload; closes what it opened."""
    with _open_stream(source, limits) as opened:
        try:
            yield opened
        finally:
            opened.close()


@contextmanager
def _open_stream(source: Source, limits: AudioLimits) -> Iterator[Opened]:
    if isinstance(source, bytes | bytearray):
        _check_payload(bytes(source), limits)
        yield Opened(io.BytesIO(source), _PAYLOAD_NAME, None)
        return
    if isinstance(source, str) and is_url(source):
        with fetch_url(source, limits) as stream:
            yield Opened(stream, source, None)
        return
    if isinstance(source, Fetched):  # the prefetch owns its stream
        yield Opened(source.open(), source.url, None)
        return
    if isinstance(source, ConfinedPath):
        stream = _open_regular_file(source, limits)
        with stream:
            # audioread (the fallback decoder) opens a path by itself: give it the descriptor's
            # name under /proc, which reaches the file opened here and nothing else.
            yield Opened(stream, str(source), _descriptor_path(stream.fileno()))
        return
    path = Path(source)
    stream = _open_regular_file(path, limits)
    with stream:
        yield Opened(stream, str(path), path)


def prefetch_clips(
    urls: Sequence[str | None], limits: AudioLimits, read_ahead: ReadAhead
) -> Generator[Fetched | None, None, None]:
    """Per entry of `urls`, in order, the object read ahead (`pipeline.storage.prefetch`) as a
    `Fetched` source, its error included; None for a None entry (a local file, read as before)."""

    def fetch(url: str, reserve: Reserve) -> Fetched:
        try:
            stream = fetch_url(url, limits, reserve)
        except VoxmillError as exc:
            return Fetched(url, exc)
        # An object held in memory gives its bytes (BytesIO shares them, no copy).
        return Fetched(url, stream.getvalue() if isinstance(stream, io.BytesIO) else stream)

    return prefetch(urls, fetch, read_ahead)


def fetch_url(url: str, limits: AudioLimits, reserve: Reserve | None = None) -> BinaryIO:
    """A stream over an object whose size is checked like a file's before its bytes are read."""
    size, stream = fetch_checked(url, limits.max_file_bytes, reserve)
    if size == 0:
        raise VoxmillError(EMPTY, f"{url} is empty (0 bytes)")
    if stream is None:
        raise VoxmillError(
            TOO_LARGE, f"object is {format_bytes(size)}; the limit is {format_bytes(limits.max_file_bytes)}"
        )
    return stream


def _check_payload(payload: bytes, limits: AudioLimits) -> None:
    """Refuse an empty payload or one over `max_payload_bytes`."""
    if not payload:
        raise VoxmillError(EMPTY, "payload is empty (0 bytes)")
    if len(payload) > limits.max_payload_bytes:
        size, limit = format_bytes(len(payload)), format_bytes(limits.max_payload_bytes)
        raise VoxmillError(TOO_LARGE, f"payload is {size}; the limit is {limit}")


def _open_regular_file(source: Path | ConfinedPath, limits: AudioLimits) -> BinaryIO:
    """Open `source` for reading after a stat shows a regular, non-empty file within the size
    limit: `os.stat` for a plain path, the walk's `lstat` for a `ConfinedPath`, which is opened
    from its root without following a symlink (`pipeline.storage.paths.open_confined`)."""
    path = source.path if isinstance(source, ConfinedPath) else source
    if isinstance(source, ConfinedPath):
        fd = open_confined(source, lambda st: _check_file_stat(st, path, limits))
    else:
        _check_file_stat(_stat(path), path, limits)
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, open still returns at
        # once, and the fstat below refuses it; for regular files the flag changes nothing.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:  # removed since the stat
            raise VoxmillError(NOT_FOUND, f"no such file: {path}") from exc
        except OSError as exc:
            raise VoxmillError(UNREADABLE, f"cannot open {path}: {exc.strerror or exc}") from exc
    try:
        _check_file_stat(os.fstat(fd), path, limits)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _descriptor_path(fd: int) -> Path | None:
    """A name that opens exactly the file behind `fd` (this process's /proc entry, which a
    decoder's subprocess may open too); None where there is no /proc."""
    folder = _descriptor_folder(os.getpid())  # by pid: a forked worker has its own
    return None if folder is None else folder / str(fd)


@functools.cache
def _descriptor_folder(pid: int) -> Path | None:
    """This process's /proc folder of descriptors, looked for once (not once per clip)."""
    folder = Path(f"/proc/{pid}/fd")
    return folder if folder.is_dir() else None


def _stat(path: Path) -> os.stat_result:
    """`os.stat` with its failures turned into voxmill errors."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise VoxmillError(NOT_FOUND, f"no such file: {path}") from exc
    except ValueError as exc:  # embedded NUL byte
        raise VoxmillError(BAD_REQUEST, f"invalid path {str(path)!r}: {exc}") from exc
    except OSError as exc:
        raise VoxmillError(UNREADABLE, f"cannot read {path}: {exc.strerror or exc}") from exc


def _check_file_stat(st: os.stat_result, path: Path, limits: AudioLimits) -> None:
    """Refuse directories, non-regular files, empty files and files over `max_file_bytes`."""
    if stat.S_ISDIR(st.st_mode):
        raise VoxmillError(UNREADABLE, f"{path} is a directory, not an audio file")
    if not stat.S_ISREG(st.st_mode):
        raise VoxmillError(UNREADABLE, f"{path} is not a regular file ({_file_kind(st.st_mode)})")
    if st.st_size == 0:
        raise VoxmillError(EMPTY, f"{path} is empty (0 bytes)")
    if st.st_size > limits.max_file_bytes:
        raise VoxmillError(
            TOO_LARGE,
            f"file is {format_bytes(st.st_size)}; the limit is {format_bytes(limits.max_file_bytes)}",
        )


def _file_kind(mode: int) -> str:
    """A word for a non-regular file type."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "not a plain file")
