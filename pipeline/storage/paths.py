"""Confine path jobs to the allowed roots (and URL jobs to the allowed URL prefixes).

A path is judged by where it really points: relative parts are taken against `base`, then `..`
and every symlink are resolved (`os.path.realpath`) before the containment check. Whether the
file exists is left to the caller, after confinement, so a missing file outside the roots is
`forbidden_path`, not `not_found`, and the answer does not reveal what exists outside them.

What is read is what was checked, with no window between the two: `resolve_allowed` returns a
`ConfinedPath` (the real path and the root it lies below), and `open_confined` opens it from that
root one folder at a time (`openat` with `O_NOFOLLOW`). The real path has no symlink in it, so a
folder or file that became a symlink since the check is `forbidden_path`, never followed, and
nothing outside the root is ever opened (not even a device or a FIFO).

Roots are resolved once (`Roots`): containment walks the candidate's folders against a set, so it
costs the candidate's depth, not the number of roots (an embedded `extract` may allow thousands).
A path longer than `max_chars` is `bad_request` before any path call (`os.path.realpath` copies
the rest of the path at every '/', quadratic in a slash-heavy string).

A URL (`s3://`, `gs://`, `http(s)://`) is judged by `pipeline.storage.urls.check_url` against the URL
prefixes among the roots: `.` and `..` removed, scheme and bucket equal, key prefix on a `/`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, NOT_FOUND, UNREADABLE, VoxmillError
from pipeline.storage.urls import MAX_TEXT_CHARS, check_length, check_url, is_url

# How many roots a `forbidden_path` message lists before "and N more".
ROOTS_IN_MESSAGES = 5
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A folder on the way is opened only to be walked through: O_PATH needs no read permission.
_FOLDER_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the lstat opens at once (the caller's fstat refuses it).
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_NOCTTY", 0) | _CLOEXEC
# What open(O_NOFOLLOW) answers for a symlink: ELOOP (Linux), EMLINK (FreeBSD), ENOTDIR with O_DIRECTORY.
_SYMLINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, errno.ENOTDIR})


def is_within(path: Path | str, root: Path | str) -> bool:
    """True when `path` is `root` or lies below it, comparing the normalised absolute paths as
    given (no resolving); strings, not `Path.parents`, which builds a Path per level."""
    inside, top = os.fspath(path), os.fspath(root)
    return inside == top or inside.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True)
class Roots:
    """The allowed roots, resolved once: real paths in the order given (for messages), looked up
    through a set. `Roots.of(settings.roots())` once per process, then passed to every check."""

    paths: tuple[str, ...]
    _lookup: frozenset[str] = field(init=False, repr=False, compare=False)
    _lengths: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", frozenset(self.paths))
        object.__setattr__(self, "_lengths", frozenset(len(p) for p in self.paths))

    @classmethod
    def of(cls, roots: Iterable[Path | str]) -> Roots:
        """Each root's real path (`os.path.realpath`), duplicates dropped."""
        return cls(tuple(dict.fromkeys(_real_root(root) for root in roots)))

    def root_of(self, real: str) -> str | None:
        """The deepest root that `real` (absolute, normalised) is or lies below, else None: the
        same answer as `is_within` against each root, found by walking `real`'s folders."""
        if real in self._lookup:
            return real
        found = None
        slash = real.find("/", 1)
        while slash != -1:
            if slash in self._lengths and real[:slash] in self._lookup:
                found = real[:slash]
            slash = real.find("/", slash + 1)
        if found is None and "/" in self._lookup and real.startswith("/"):
            return "/"
        return found

    def describe(self) -> str:
        """The roots for a message: the first few, then how many more."""
        if not self.paths:
            return "none configured"
        shown = ", ".join(self.paths[:ROOTS_IN_MESSAGES])
        more = len(self.paths) - ROOTS_IN_MESSAGES
        return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True)
class ConfinedPath:
    """A local file a job may read: its real absolute `path` when it was checked and the `root`
    (a real folder, one of the allowed roots) it lies below. Read it with `open_confined`;
    `os.fspath` and `str` give the path.

    >>> ConfinedPath(Path("/data/corpus/a.wav"), "/data")
    ConfinedPath(path=PosixPath('/data/corpus/a.wav'), root='/data')
    """

    path: Path
    root: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def confine_path(
    path: str | Path,
    roots: Roots | Sequence[Path],
    base: Path | None = None,
    max_chars: int = MAX_TEXT_CHARS,
    folders: dict[str, str] | None = None,
) -> ConfinedPath:
    """`path` (relative to `base`, default cwd) resolved, with the root it lies below;
    `folders`: the real paths of folders resolved before, kept for the next call (`real_path`).

    Raises `bad_request` for a NUL byte, an empty path or one over `max_chars` characters, and
    `forbidden_path` when the real path lies outside every root (also when no roots are given)
    or a part of it changed while it was being resolved.
    """
    text = os.fspath(path)
    check_length(text, "path", max_chars)
    if "\x00" in text:
        raise VoxmillError(BAD_REQUEST, f"path {text!r} contains a NUL byte")
    if not text:
        raise VoxmillError(BAD_REQUEST, "path is empty")
    allowed = roots if isinstance(roots, Roots) else Roots.of(roots)
    try:
        anchor = "/" if text.startswith("/") else os.getcwd() if base is None else os.fspath(base)
        real = real_path(os.path.join(anchor, text), folders)
    except OSError as exc:  # readlink of a part that stopped being a symlink mid-resolve (EINVAL)
        reason = exc.strerror or exc
        raise VoxmillError(
            FORBIDDEN_PATH, f"path {text} changed while it was being resolved ({reason}); it is not read"
        ) from exc
    root = allowed.root_of(real)
    if root is None:
        raise VoxmillError(
            FORBIDDEN_PATH,
            f"path {text} is outside the allowed roots ({allowed.describe()}); add its folder to the "
            "workers' VOXMILL_ALLOWED_ROOTS, or send the file's bytes instead (`voxmill submit --bytes`)",
        )
    return ConfinedPath(Path(real), root)


def real_path(path: str, folders: dict[str, str] | None = None) -> str:
    """`os.path.realpath(path)`; with `folders`, the real path of `path`'s folder is looked up
    there (and kept there), so that the files of one folder cost one `lstat` each. What is then
    opened is walked again without following a symlink (`open_confined`): a folder changed since
    it was kept can make a read fail, never let one out of its root."""
    folder, name = os.path.split(path)
    if folders is None or name in ("", ".", ".."):
        return os.path.realpath(path)
    real_folder = folders.get(folder)
    if real_folder is None:
        real_folder = folders[folder] = os.path.realpath(folder)
    real = os.path.join(real_folder, name)
    return os.path.realpath(path) if os.path.islink(real) else real


def resolve_allowed_path(
    path: str | Path, roots: Roots | Sequence[Path], base: Path | None = None, max_chars: int = MAX_TEXT_CHARS
) -> Path:
    """The real absolute path of `path` (relative to `base`, default cwd) if inside one of
    `roots` (`confine_path`, whose errors it raises)."""
    return confine_path(path, roots, base, max_chars).path


def resolve_allowed(
    path: str | Path,
    roots: Roots | Sequence[Path],
    url_roots: Sequence[str] = (),
    max_chars: int = MAX_TEXT_CHARS,
    folders: dict[str, str] | None = None,
) -> ConfinedPath | str:
    """A path confined to `roots` (`confine_path`, `folders` as there), or a URL to `url_roots`
    (its normalised spelling): what a worker reads for a job, an utterance or a tar shard."""
    if isinstance(path, str) and is_url(path):
        return check_url(path, url_roots, max_chars)
    return confine_path(path, roots, max_chars=max_chars, folders=folders)


def open_confined(confined: ConfinedPath, check: Callable[[os.stat_result], None] | None = None) -> int:
    """A read-only descriptor (`O_NONBLOCK`, close-on-exec) of `confined`, opened by walking from
    its root one folder at a time without following a symlink; the caller closes it.

    `check` sees the file's `lstat` before it is opened: refuse FIFOs, devices and sizes there,
    so they are never opened. A part that is now a symlink is `forbidden_path`; a missing part
    `not_found`; any other failure `unreadable`.
    """
    text = str(confined.path)
    parts = [part for part in text[len(confined.root) :].split("/") if part]
    folder = _open_root(confined.root, text)
    try:
        if not parts:  # the root itself: a folder
            if check is not None:
                check(os.fstat(folder))
            raise VoxmillError(UNREADABLE, f"{text} is a directory, not a file")
        for name in parts[:-1]:
            inner = _open_at(folder, name, _FOLDER_FLAGS, text)
            os.close(folder)
            folder = inner
        name = parts[-1]
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except OSError as exc:
            raise _open_failure(exc, folder, name, text) from exc
        if stat.S_ISLNK(st.st_mode):
            raise _changed(text, name)
        if check is not None:
            check(st)
        return _open_at(folder, name, _FILE_FLAGS, text)
    finally:
        os.close(folder)


def _open_root(root: str, text: str) -> int:
    try:
        return os.open(root, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise VoxmillError(NOT_FOUND, f"no such file: {text} (its root {root} is gone)") from exc
        raise VoxmillError(UNREADABLE, f"cannot open {text}: {exc.strerror or exc}") from exc


def _open_at(folder: int, name: str, flags: int, text: str) -> int:
    try:
        return os.open(name, flags, dir_fd=folder)
    except OSError as exc:
        raise _open_failure(exc, folder, name, text) from exc


def _open_failure(exc: OSError, folder: int, name: str, text: str) -> VoxmillError:
    """The voxmill error for a failed step of the walk: a symlink where the checked path had none
    is `forbidden_path`, a missing part `not_found`, anything else `unreadable`."""
    if exc.errno in _SYMLINK_ERRNOS:
        try:
            mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
        # A folder now, refused as not one a moment ago: swapped back from a symlink since.
        if stat.S_ISLNK(mode) or (exc.errno == errno.ENOTDIR and stat.S_ISDIR(mode)):
            return _changed(text, name)
        if exc.errno == errno.ENOTDIR:
            return VoxmillError(NOT_FOUND, f"no such file: {text} ({name} is not a folder)")
    if exc.errno == errno.ENOENT:
        return VoxmillError(NOT_FOUND, f"no such file: {text}")
    return VoxmillError(UNREADABLE, f"cannot open {text}: {exc.strerror or exc}")


def _changed(text: str, name: str) -> VoxmillError:
    return VoxmillError(
        FORBIDDEN_PATH,
        f"path {text} changed after it was checked: {name} is (or was a moment ago) a symlink, which "
        "is not followed; it is not read",
    )


def _real_root(root: Path | str) -> str:
    try:
        return os.path.realpath(root)
    except OSError:  # changed while resolving: as given, absolute
        return os.path.abspath(root)
