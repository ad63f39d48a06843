"""A whole corpus listing looked at before anything runs: refused now if reading it would be.

`voxmill extract` plans a listing as it streams by, so that the first shards run while the rest
is still being read (`pipeline.run.plan`); a problem at line 100,001 would then be found after
shards were written. `check_listing` comes first: it raises the listing's `CorpusError`, with the
very problems `CorpusListing` reports, or returns when reading it will find none.

Reading a listing builds an `Utterance` per line and joins the Kaldi side files: about 9 s per
million lines. The quick pass (`looks_clean`) only looks: every line split as the reader splits
it (with the reader's own functions where a line is JSON or a segment), and the ids kept as
64-bit hashes in numpy arrays (8 bytes an utterance), sorted once. A line the reader would
refuse, a hash met twice, a side-file key whose hash is not among the ids: any doubt sends the
listing to the reader, which decides, so a hash collision costs one more read, never a wrong
refusal. A Kaldi dir (with or without `segments`) and a JSONL manifest have a quick pass; lhotse
manifests, tar shards and folders of audio are read in full by the reader instead.

The ids' hashes are Python's own string hash: salted per process, which is all a pass inside one
process needs.
"""

from __future__ import annotations

import gzip
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from pipeline.corpus.kaldi import (
    KALDI_RECO2DUR,
    KALDI_SEGMENTS,
    KALDI_TEXT,
    KALDI_UTT2DUR,
    KALDI_UTT2SPK,
    KALDI_WAV_SCP,
    recording_seconds,
    segment_line,
)
from pipeline.corpus.lhotse import jsonl_kind
from pipeline.corpus.listing import CorpusListing
from pipeline.corpus.manifest import manifest_field_problems
from pipeline.corpus.problems import name_problem
from pipeline.corpus.reading import Source, as_source, is_jsonl, parse_json
from pipeline.corpus.tars import input_is_tars
from pipeline.errors import VoxmillError
from pipeline.storage.objects import open_input

BLOCK_BYTES = 1 << 20  # lines read, decoded and split at a time


class _Doubt(Exception):
    """The quick pass cannot vouch for the listing: the reader decides."""


def check_listing(source: Source, max_text_chars: int | None) -> None:
    """Raise the `CorpusError` reading `source` would raise (every problem, as the reader words
    them), or return: the listing reads without a problem."""
    if looks_clean(source, max_text_chars):
        return
    listing = CorpusListing(source, max_text_chars=max_text_chars)
    for _ in listing:
        pass
    listing.raise_problems()


def looks_clean(source: Source, max_text_chars: int | None) -> bool:
    """True when reading `source` will find no problem; False when it may, or when its kind has no
    quick pass (the reader then decides)."""
    source = as_source(source)
    limit = sys.maxsize if max_text_chars is None else max_text_chars
    try:
        if input_is_tars(source):
            return False
        if isinstance(source, str):
            return is_jsonl(source) and _manifest(source, limit)
        if source.is_dir() and (source / KALDI_WAV_SCP).is_file():
            return _kaldi(source, limit)
        if source.is_file() and source.name == KALDI_WAV_SCP:
            return _kaldi(source.parent, limit)
        if source.is_file() and is_jsonl(source.name):
            return _manifest(source, limit)
        return False
    except _Doubt:
        return False


# --------------------------------------------------------------------------- the kinds


def _kaldi(folder: Path, limit: int) -> bool:
    """wav.scp ('utt path') and its side files utt2spk, text and utt2dur."""
    if (folder / KALDI_SEGMENTS).is_file():
        return _kaldi_segments(folder, limit)
    ids = _Hashes()
    for lines in _texts(folder / KALDI_WAV_SCP):
        ids.add([utt for utt, _ in _scp_entries(lines, limit)])
    known = ids.unique(empty_ok=False)
    _side_file(folder / KALDI_UTT2SPK, known, "speaker", limit)
    _side_file(folder / KALDI_TEXT, known, None, limit)
    _side_file(folder / KALDI_UTT2DUR, known, "duration", limit)
    return True


def _kaldi_segments(folder: Path, limit: int) -> bool:
    """segments ('utt rec start end') over wav.scp ('rec path'), reco2dur, utt2spk and text."""
    recordings = _recordings(folder / KALDI_WAV_SCP, limit)
    lengths = _lengths(folder / KALDI_RECO2DUR)
    ids = _Hashes()
    for lines in _texts(folder / KALDI_SEGMENTS):
        keys = []
        for line in lines:
            if not line.strip():
                continue
            parsed = segment_line(line, recordings, lengths, limit)
            if isinstance(parsed, str):
                raise _Doubt
            keys.append(parsed[0])
        ids.add(keys)
    known = ids.unique(empty_ok=False)
    _side_file(folder / KALDI_UTT2SPK, known, "speaker", limit)
    _side_file(folder / KALDI_TEXT, known, None, limit)
    return True


def _recordings(wav_scp: Path, limit: int) -> dict[str, str]:
    """{rec: path} of a segments dir's wav.scp; `_Doubt` for a line the reader would refuse."""
    recordings: dict[str, str] = {}
    for lines in _texts(wav_scp):
        for rec, path in _scp_entries(lines, limit):
            if name_problem("", rec, limit) or name_problem("", path, limit) or rec in recordings:
                raise _Doubt
            recordings[rec] = path
    return recordings


def _scp_entries(lines: list[str], limit: int) -> Iterator[tuple[str, str]]:
    """(key, path) of each wav.scp line; `_Doubt` for a line the reader would refuse."""
    for line in lines:
        parts = line.split(None, 1)
        if not parts:
            continue
        if len(parts) != 2:
            raise _Doubt
        key, path = parts[0], parts[1].rstrip()
        if len(key) > limit or len(path) > limit or "\x00" in line or path.endswith("|"):
            raise _Doubt
        yield key, path


def _lengths(reco2dur: Path) -> dict[str, float]:
    """{rec: seconds} of reco2dur (none without one); `_Doubt` for a line that is no number."""
    lengths: dict[str, float] = {}
    if not reco2dur.exists():
        return lengths
    for lines in _texts(reco2dur):
        for line in lines:
            parts = line.split(None, 1)
            if not parts:
                continue
            seconds = recording_seconds(parts[1].rstrip() if len(parts) == 2 else "")
            if seconds is None:
                raise _Doubt
            lengths[parts[0]] = seconds
    return lengths


def _side_file(file: Path, ids: np.ndarray[Any, Any], value: str | None, limit: int) -> None:
    """A Kaldi side file ('utt word', or 'utt free text' when `value` is None): every line well
    formed, no utt twice, every utt one of `ids`; `_Doubt` otherwise."""
    if not file.exists():
        return
    keys = _Hashes()
    for lines in _texts(file):
        block = []
        for line in lines:
            if value is None:
                parts = line.split(None, 1)
                if parts:
                    block.append(parts[0])
                continue
            words = line.split()
            if not words:
                continue
            if len(words) != 2 or len(words[1]) > limit or "\x00" in line:  # text from UTF-8: encodable
                raise _Doubt
            if value == "duration":
                try:
                    seconds = float(words[1])
                except ValueError:
                    raise _Doubt from None
                if not math.isfinite(seconds):
                    raise _Doubt
            block.append(words[0])
        keys.add(block)
    listed = keys.unique(empty_ok=True)
    at = np.minimum(np.searchsorted(ids, listed), len(ids) - 1)
    if not bool(np.all(ids[at] == listed)):
        raise _Doubt


def _manifest(file: Source, limit: int) -> bool:
    """A JSONL manifest ({"utt", "path", "spk"?, "text"?} per line); lhotse JSONL: the reader."""
    if jsonl_kind(file) != "manifest":
        return False
    ids = _Hashes()
    for lines in _texts(file):
        keys = []
        for line in lines:
            if not line.strip():
                continue
            data, error = parse_json(line)
            if error is not None or not isinstance(data, dict) or manifest_field_problems(data, limit):
                raise _Doubt
            keys.append(data["utt"])
        ids.add(keys)
    ids.unique(empty_ok=False)
    return True


# --------------------------------------------------------------------------- helpers


class _Hashes:
    """The hashes of the ids met so far, in blocks of int64."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray[Any, Any]] = []

    def add(self, keys: list[str]) -> None:
        if keys:
            self._blocks.append(np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)))

    def unique(self, empty_ok: bool) -> np.ndarray[Any, Any]:
        """Every hash, sorted; `_Doubt` when one was added twice (an id listed twice, or two ids
        of one hash) or, unless `empty_ok`, when none was (the reader says what lists nothing)."""
        if not self._blocks and not empty_ok:
            raise _Doubt
        hashes = np.concatenate(self._blocks) if self._blocks else np.empty(0, dtype=np.int64)
        self._blocks = []
        hashes.sort()
        if len(hashes) > 1 and bool(np.any(hashes[1:] == hashes[:-1])):
            raise _Doubt
        return hashes


def _texts(file: Source) -> Iterator[list[str]]:
    """The lines of a listing file, a block at a time, as `pipeline.corpus.reading` reads them (UTF-8, a
    .gz one inflated, the first line's byte-order mark dropped; blank lines kept); `_Doubt` for
    whatever it would report (a file that cannot be read, a line that is not UTF-8)."""
    try:
        raw: IO[bytes] = open_input(file)
    except (VoxmillError, OSError):
        raise _Doubt from None
    stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if str(file).endswith(".gz") else raw
    first = True
    with raw, stream:
        try:
            while chunk := stream.readlines(BLOCK_BYTES):
                try:
                    text = b"".join(chunk).decode("utf-8")
                except UnicodeDecodeError:
                    raise _Doubt from None
                lines = text.split("\n")
                if first:
                    lines[0], first = lines[0].removeprefix("\ufeff"), False
                yield [line.rstrip("\r") for line in lines]
        except (OSError, EOFError):  # a truncated or corrupt .gz
            raise _Doubt from None
