"""Confine path jobs to the allowed roots (and URL jobs to the allowed URL prefixes).

A path is judged by where it really points: relative parts are taken against `base`, then `..`
and every symlink are resolved (`os.path.realpath`) before the containment check. Whether the
file exists is left to the caller, after confinement, so a missing file outside the roots is
`forbidden_path`, not `not_found`, and the answer does not reveal what exists outside them.

A URL (`s3://`, `gs://`, `http(s)://`) is judged by `pipeline.storage.check_url` against the URL
prefixes among the roots: `.` and `..` removed, scheme and bucket equal, key prefix on a `/`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, VoxmillError
from pipeline.storage import check_url, is_url


def is_within(path: Path | str, root: Path | str) -> bool:
    """True when `path` is `root` or lies below it, comparing the normalised absolute paths as
    given (no resolving); strings, not `Path.parents`, which builds a Path per level."""
    inside, top = os.fspath(path), os.fspath(root)
    return inside == top or inside.startswith(top.rstrip("/") + "/")


def resolve_allowed_path(path: str | Path, roots: Sequence[Path], base: Path | None = None) -> Path:
    """The real absolute path of `path` (relative to `base`, default cwd) if inside one of `roots`.

    Raises `bad_request` for a NUL byte or an empty path and `forbidden_path` when the real path
    lies outside every root (also when no roots are given).
    """
    text = os.fspath(path)
    if "\x00" in text:
        raise VoxmillError(BAD_REQUEST, f"path {text!r} contains a NUL byte")
    if not text:
        raise VoxmillError(BAD_REQUEST, "path is empty")
    anchor = os.getcwd() if base is None else os.fspath(base)
    real = os.path.realpath(os.path.join(anchor, text))
    real_roots = [os.path.realpath(root) for root in roots]
    if not any(is_within(real, root) for root in real_roots):
        allowed = ", ".join(str(root) for root in real_roots) or "none configured"
        raise VoxmillError(
            FORBIDDEN_PATH,
            f"path {text} is outside the allowed roots ({allowed}); add its folder to the workers' "
            "VOXMILL_ALLOWED_ROOTS, or send the file's bytes instead (`voxmill submit --bytes`)",
        )
    return Path(real)


def resolve_allowed(path: str | Path, roots: Sequence[Path], url_roots: Sequence[str] = ()) -> Path | str:
    """A path confined to `roots` (`resolve_allowed_path`), or a URL to `url_roots` (its
    normalised spelling): what a worker reads for a job, an utterance or a tar shard."""
    if isinstance(path, str) and is_url(path):
        return check_url(path, url_roots)
    return resolve_allowed_path(path, roots)
