"""WebDataset tar shards: the tars a listing names, and each tar read as a stream of samples.

A tar input is one `.tar` (path or URL), a folder of them (a URL ending in `/`), a list
(`.txt`/`.list`, a tar path or URL per line) or a brace pattern (`shards/{000..127}.tar`). Its
utterances are known only once a worker reads a tar, so the listing yields one entry per tar
(utt = the tar as listed, path = where it is).

A worker reads a tar one sample (`key.json` + one audio member) at a time.

A tar is read front to back with `tarfile` in stream mode (`r|*`: plain or compressed), over a
local file or a `pipeline.storage.objects` stream, and never extracted to disk. Members group into
samples by WebDataset's rule: the key is the member's path up to the first `.` of its file name
(`a/b/0001.seg.flac` -> key `a/b/0001`, extension `seg.flac`), and a sample's members are
adjacent. A sample's `key.json` gives `spk` (`speaker`, as Emilia writes it, or `spk`) and
`text`; a `key.txt` gives the text when the JSON does not. The first audio member (by listing
order) is the clip; later ones are ignored.

What goes wrong is the business of one sample only: an audio member over `max_member_bytes` is
`too_large` (skipped unread), a sample without audio is `not_found`, an unparseable JSON is
`unreadable`, a key met again later in the tar is `bad_request`. A tar that cannot be read past
some point ends with one more sample, keyed by the tar itself, whose error says where it stopped.
"""

from __future__ import annotations

import json
import os
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pipeline.corpus.kaldi import KALDI_WAV_SCP
from pipeline.corpus.lhotse import lhotse_pair
from pipeline.corpus.problems import Problems, name_problem
from pipeline.corpus.reading import Reading, Source, absolute, folder_of, is_pattern, read_lines
from pipeline.errors import BAD_REQUEST, NOT_FOUND, TOO_LARGE, UNREADABLE, VoxmillError
from pipeline.records import Utterance
from pipeline.storage.objects import list_url
from pipeline.storage.urls import expand_braces, is_url

AUDIO_EXTENSIONS = frozenset({"wav", "flac", "ogg", "oga", "opus", "mp3", "m4a", "aac", "wma"})
MAX_META_BYTES = 1024 * 1024  # a sample's JSON or text is small; a bigger one is not metadata
TAR_SUFFIX = ".tar"
TAR_LIST_SUFFIXES = (".txt", ".list", ".lst")


@dataclass
class TarSample:
    """One sample of a tar: its key, metadata, the audio member's bytes (or why there are none)."""

    key: str
    meta: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    audio: bytes | None = None
    audio_name: str = ""
    error: VoxmillError | None = None

    @property
    def spk(self) -> str:
        value = self.meta.get("speaker") or self.meta.get("spk")
        return str(value) if value else self.key

    @property
    def transcript(self) -> str:
        value = self.meta.get("text")
        return str(value) if isinstance(value, str) and value else self.text

    def fail(self, error: VoxmillError) -> None:
        if self.error is None:  # the first problem of a sample is the one reported
            self.error = error


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member name by WebDataset's rule (the first dot of the file name)."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return (posixpath.join(folder, stem) if folder else stem), ext.lower()


def is_audio(ext: str) -> bool:
    return ext.rsplit(".", 1)[-1] in AUDIO_EXTENSIONS


def iter_samples(stream: IO[bytes], name: str, max_member_bytes: int) -> Iterator[TarSample]:
    """The samples of the tar read from `stream` (named `name` in messages), in tar order."""
    seen: set[str] = set()
    current: TarSample | None = None
    members = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                members += 1
                key, ext = split_key(member.name)
                if current is None or key != current.key:
                    if current is not None:
                        yield _finished(current)
                    current = TarSample(key)
                    if key in seen:
                        current.fail(VoxmillError(BAD_REQUEST, f"key {key!r} appears twice in {name}"))
                    seen.add(key)
                _take(tar, member, ext, current, max_member_bytes)
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        if current is not None:
            current.fail(VoxmillError(UNREADABLE, f"{name} ends inside this sample ({_reason(exc)})"))
            yield _finished(current)
            current = None
        where = f"after {members} member(s)" if members else "from its start"
        yield TarSample(
            name, error=VoxmillError(UNREADABLE, f"{name} cannot be read {where}: {_reason(exc)}")
        )
        return
    if current is not None:
        yield _finished(current)


def _take(tar: tarfile.TarFile, member: tarfile.TarInfo, ext: str, sample: TarSample, limit: int) -> None:
    """Fold one member into its sample (reading it only when it is wanted and small enough)."""
    if ext == "json" or ext == "txt":
        if member.size > MAX_META_BYTES:
            sample.fail(
                VoxmillError(TOO_LARGE, f"{member.name} is {member.size} bytes, too big for metadata")
            )
            return
        raw = _read(tar, member)
        if ext == "txt":
            sample.text = raw.decode("utf-8", "replace").strip()
            return
        try:
            meta = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            sample.fail(VoxmillError(UNREADABLE, f"{member.name} is not valid JSON ({exc})"))
            return
        if isinstance(meta, dict):
            sample.meta = meta
        else:
            sample.fail(VoxmillError(UNREADABLE, f"{member.name} is not a JSON object"))
    elif is_audio(ext) and not sample.audio_name:
        sample.audio_name = member.name
        if member.size > limit:
            sample.fail(
                VoxmillError(TOO_LARGE, f"{member.name} is {member.size} bytes; the limit is {limit}")
            )
            return  # left unread: the stream skips it
        sample.audio = _read(tar, member)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    return handle.read() if handle is not None else b""


def _finished(sample: TarSample) -> TarSample:
    if sample.audio is None and sample.error is None:
        sample.fail(VoxmillError(NOT_FOUND, f"sample {sample.key!r} has no audio member"))
    return sample


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- the tars of a listing


def read_tars(source: Source, reading: Reading) -> Iterator[Utterance]:
    """One entry per tar, in the order listed (a folder's or prefix's: sorted by name)."""
    tars = _tar_paths(source, reading.problems, reading.limit)
    for number, tar in enumerate(tars, start=1):
        reading.ids.add(tar, number)
        yield Utterance(utt=tar, path=tar)
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(source, None, "lists no .tar shards")
    repeats = reading.ids.repeats()
    for line, first in sorted(repeats.items()):
        reading.problems.add(source, line, f"tar {tars[line - 1]!r} listed twice (first as number {first})")


def input_is_tars(source: Source) -> bool:
    """Whether `source` names WebDataset tar shards (a .tar, a pattern, a list, a folder of them)."""
    if isinstance(source, str):
        lower = source.lower()
        return (
            lower.endswith(TAR_SUFFIX)
            or lower.endswith(TAR_LIST_SUFFIXES)
            or (is_url(source) and source.endswith("/"))
        )
    if source.is_file():
        if source.suffix.lower() in TAR_LIST_SUFFIXES:  # a list of tars: its first line names one
            first = next(read_lines(source, Problems()), None)
            return first is not None and first.text.strip().lower().endswith(TAR_SUFFIX)
        return source.suffix.lower() == TAR_SUFFIX
    if source.is_dir() and not (source / KALDI_WAV_SCP).is_file() and lhotse_pair(source) is None:
        try:
            with os.scandir(source) as entries:
                return any(e.name.lower().endswith(TAR_SUFFIX) and e.is_file() for e in entries)
        except OSError:
            return False
    return False


def _tar_paths(source: Source, problems: Problems, limit: int | None = None) -> list[str]:
    """The tars a tar input names, in order; problems for what cannot be listed (a line of a
    list naming one beyond `limit` characters, too)."""
    text = str(source)
    if isinstance(source, str) and is_pattern(source):
        try:
            return (
                expand_braces(source)
                if is_url(source)
                else [absolute(Path.cwd(), p) for p in expand_braces(source)]
            )
        except VoxmillError as exc:
            problems.add(source, None, exc.message)
            return []
    if isinstance(source, str) and source.endswith("/"):
        try:
            names = list_url(source)
        except VoxmillError as exc:
            problems.add(source, None, f"cannot be listed ({exc.message})")
            return []
        return [absolute(source, n) for n in names if n.lower().endswith(TAR_SUFFIX)]
    if text.lower().endswith(TAR_SUFFIX):
        return [text if isinstance(source, str) else str(source.absolute())]
    if isinstance(source, Path) and source.is_dir():
        names = sorted(e.name for e in os.scandir(source) if e.name.lower().endswith(TAR_SUFFIX))
        return [str(source.absolute() / n) for n in names]
    base = folder_of(source)
    tars = []
    for line in read_lines(source, problems):
        if wrong := name_problem("tar", line.text.strip(), limit):
            problems.add(source, line.number, wrong)
        else:
            tars.append(absolute(base, line.text.strip()))
    return tars
