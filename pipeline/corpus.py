"""Corpus listings, read as a stream (pure: no queue, no audio opened).

`CorpusListing(source)` accepts the input kinds of `voxmill extract` (DESIGN.md, Contract):

- a Kaldi data dir (CosyVoice's layout): `wav.scp` ("utt path", split on the first whitespace so
  paths may hold spaces), optional `utt2spk` ("utt spk"), `text` ("utt words...") and `utt2dur`
  ("utt seconds"); with a `segments` file ("utt rec start end", end -1: to the recording's end)
  `wav.scp` maps recording ids to paths (held as a dict: recordings are few next to segments)
  and each segment is an utterance; `reco2dur` ("rec seconds") is optional;
- a JSONL manifest: one `{"utt", "path", "spk"?, "text"?, "duration"?}` object per line;
- a lhotse CutSet (`cuts.jsonl[.gz]`, its documented JSONL form; the lhotse package is not used):
  each supervision of a cut is an utterance (the segment of the recording it covers inside the
  cut), a cut without supervisions is one; or a recordings + supervisions pair
  (`*recordings*.jsonl[.gz]` and `*supervisions*.jsonl[.gz]`, a folder holding both or the
  supervisions file): each supervision is an utterance (the recordings are held as a dict);
- WebDataset tar shards: one `.tar` (path or URL), a folder of them (a URL ending in `/`), a
  list (`.txt`/`.list`, a tar path or URL per line) or a brace pattern (`shards/{000..127}.tar`).
  Their utterances are known only once a worker reads a tar, so the listing yields one entry per
  tar (utt = the tar as listed, path = where it is) and sets `tars`;
- any other folder: audio files found recursively; utt = path relative to the folder without its
  extension (posix separators), spk = name of the parent folder.

Audio paths may be `s3://`, `gs://` or `http(s)://` URLs; a manifest, cuts, a tar list or tar
shards may themselves be at a URL (read through `pipeline.storage`).

Iterating it yields `Utterance`s in listing order without holding the listing in memory: a Kaldi
dir's side files are joined as they stream by (kept aside only where their order differs from
`wav.scp`'s), and duplicate utterance ids are found from 16-byte digests of the ids. Every problem
found is collected; `raise_problems()` after the iteration raises them together as one
`CorpusError`, each as "FILE line N: what is wrong". A caller that plans as the listing streams by
calls it once the iteration ends. `read_corpus(source)` is the whole listing as a list, problems
raised.

Relative audio paths are taken relative to the folder of the file that names them and made
absolute without resolving symlinks (workers check paths against the allowed roots themselves). A
missing audio file is not an error here: the worker reports `not_found` for that utterance. A
Kaldi pipe (`wav.scp` line ending in `|`) and a lhotse `command` source are refused: voxmill never
runs a shell command named by a corpus file. An
utterance without speaker information is its own speaker (Kaldi's convention), so speaker
embeddings never pool unrelated clips.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, cast

from pipeline import storage
from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import OPS, Utterance, encodable
from pipeline.storage import MAX_TEXT_CHARS, is_url

if TYPE_CHECKING:
    from pipeline.listed_ids import ListedIds

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".wma"})
KALDI_WAV_SCP = "wav.scp"
KALDI_UTT2SPK = "utt2spk"
KALDI_TEXT = "text"
KALDI_UTT2DUR = "utt2dur"
KALDI_SEGMENTS = "segments"
KALDI_RECO2DUR = "reco2dur"
KALDI_FILES = (KALDI_WAV_SCP, KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR, KALDI_SEGMENTS, KALDI_RECO2DUR)
MANIFEST_SUFFIX = ".jsonl"
GZ_MANIFEST_SUFFIX = ".jsonl.gz"
TAR_SUFFIX = ".tar"
TAR_LIST_SUFFIXES = (".txt", ".list", ".lst")
NO_SHELL = "voxmill never runs a shell command named by a corpus file"
Source = Path | str
MAX_LISTED_PROBLEMS = 20
DURATION_FIELDS = ("duration", "duration_s")


class CorpusError(VoxmillError):
    """Problems in a corpus listing, each "FILE line N: what is wrong" (code `bad_request`)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        lines = [f"{len(self.problems)} problem(s) in the corpus:", *(f"  {p}" for p in shown)]
        if len(self.problems) > MAX_LISTED_PROBLEMS:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED_PROBLEMS} more")
        super().__init__(BAD_REQUEST, "\n".join(lines))


@dataclass(frozen=True)
class _Line:
    """One non-blank line of a listing file: 1-based number and text without the line break."""

    number: int
    text: str


class _Problems:
    """Problems found while reading, kept per file, files in the order they were registered."""

    def __init__(self) -> None:
        self.by_file: dict[str, list[tuple[int, str]]] = {}

    def register(self, *files: Path | str) -> None:
        """The files of a listing, in the order their problems are reported."""
        for file in files:
            self.by_file.setdefault(str(file), [])

    def add(self, file: Path | str, line: int | None, what: str) -> None:
        """Record one problem; `line` None for a problem of the whole file."""
        text = f"{file}: {what}" if line is None else f"{file} line {line}: {what}"
        self.by_file.setdefault(str(file), []).append((line or 0, text))

    @property
    def items(self) -> list[str]:
        return [text for found in self.by_file.values() for _, text in sorted(found, key=lambda p: p[0])]


# --------------------------------------------------------------------------- the listing


class _NoIds:
    """The ids of a listing read only for its paths: none kept, none repeated."""

    def add(self, utt: str, line: int) -> None:
        """Nothing kept."""

    def repeats(self) -> dict[int, int]:
        return {}

    def contains(self, utt: str) -> bool:
        return False


class CorpusListing:
    """A corpus listing of `source`, read as it is iterated (once).

    `tars` is set when the source is WebDataset tar shards: then each item is a tar, not an
    utterance (`Utterance(utt=tar as listed, path=tar)`). `find_repeats` False: the listing is
    read only for its paths, and ids listed twice are not looked for. `max_text_chars`: the
    longest utt, speaker, recording id, path or URL a line may carry (`Settings.max_text_chars`),
    told before any path call; None: no limit. A name or path holding a NUL byte, or text that
    is not valid Unicode (a lone surrogate from a JSON escape), is a problem whatever the limit.
    """

    def __init__(
        self, source: Source, find_repeats: bool = True, max_text_chars: int | None = MAX_TEXT_CHARS
    ) -> None:
        self.source: Source = as_source(source)
        self.limit = max_text_chars
        self.problems = _Problems()
        self.durations_listed = False
        self.count = 0
        self.tars = input_is_tars(self.source)
        self._ids: ListedIds | _NoIds = _NoIds()
        if find_repeats:
            from pipeline.listed_ids import ListedIds  # numpy: `corpus_roots` runs before it is needed

            self._ids = ListedIds()

    def __iter__(self) -> Iterator[Utterance]:
        source = self.source
        utts: Iterator[Utterance]
        if self.tars:
            utts = self._tars(source)
        elif isinstance(source, str):
            utts = self._remote(source)
        elif source.is_dir() and (source / KALDI_WAV_SCP).is_file():
            utts = self._kaldi(source)
        elif source.is_dir() and (pair := _lhotse_pair(source)) is not None:
            utts = self._lhotse_pair(*pair)
        elif source.is_dir():
            utts = self._folder(source)
        elif source.is_file() and source.name == KALDI_WAV_SCP:
            utts = self._kaldi(source.parent)
        elif source.is_file() and is_jsonl(source.name):
            utts = self._jsonl(source)
        elif not source.exists():
            self.problems.add(source, None, "no such file or folder")
            return
        else:
            what = (
                "not a Kaldi data dir (with wav.scp), a .jsonl manifest, lhotse cuts, WebDataset .tar "
                "shards or a folder of audio files"
            )
            self.problems.add(source, None, what)
            return
        for utt in utts:
            self.count += 1
            yield utt

    def _remote(self, url: str) -> Iterator[Utterance]:
        """A listing file at a URL: a JSONL manifest or lhotse cuts."""
        if is_jsonl(url):
            return self._jsonl(url)
        self.problems.add(
            url,
            None,
            "a URL input must be a .jsonl[.gz] manifest or lhotse cuts, a .tar, a brace pattern of "
            ".tar, a prefix of .tar shards (ending in '/') or a .txt list of tars",
        )
        return iter(())

    def raise_problems(self) -> None:
        """Raise every problem found so far (call it once the iteration ended)."""
        if self.problems.items:
            raise CorpusError(self.problems.items)

    def _check_ids(self, file: Source, id_of: Callable[[str], str]) -> None:
        """Report every utt listed twice; the ids were kept as digests, so the repeated lines are
        read again to name them."""
        repeats = self._ids.repeats()
        if not repeats:
            return
        names = {
            line.number: id_of(line.text) for line in _lines(file, _Problems()) if line.number in repeats
        }
        for line, first in sorted(repeats.items()):
            self.problems.add(file, line, f"duplicate utt {names.get(line, '?')!r} (first on line {first})")

    # -- Kaldi data dir ----------------------------------------------------------------------
    def _kaldi(self, folder: Path) -> Iterator[Utterance]:
        if (folder / KALDI_SEGMENTS).is_file():
            yield from self._kaldi_segments(folder)
            return
        wav_scp = folder / KALDI_WAV_SCP
        self.problems.register(
            wav_scp, *(folder / name for name in (KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR))
        )
        speakers, texts, durations = self._side_files(folder)
        self.durations_listed = durations.exists
        base = str(folder.absolute())
        for line in _lines(wav_scp, self.problems):
            utt, rest = _split_first(line.text)
            if not rest:
                what = f"expected 'utt path', got {_quote(line.text.strip())}"
                self.problems.add(wav_scp, line.number, what)
                continue
            wrong = name_problem("utt", utt, self.limit) or name_problem("path", rest, self.limit)
            if wrong:
                self.problems.add(wav_scp, line.number, wrong)
                continue
            if rest.endswith("|"):
                self.problems.add(wav_scp, line.number, _pipe_refused(rest))
                continue
            self._ids.add(utt, line.number)
            seconds = durations.value(utt)
            yield Utterance(
                utt=utt,
                path=_absolute(base, rest),
                spk=speakers.value(utt) or utt,
                text=texts.value(utt) or "",
                duration_s=_seconds(seconds, durations.file, self.problems),
            )
        if self.count == 0 and not self.problems.items:
            self.problems.add(wav_scp, None, "lists no utterances")
        self._check_ids(wav_scp, lambda text: _split_first(text)[0])
        for side in (speakers, texts, durations):
            side.finish(self._ids)

    def _side_files(self, folder: Path) -> tuple[_SideFile, _SideFile, _SideFile]:
        """utt2spk, text and utt2dur of a Kaldi dir, joined as they stream by."""
        limit = self.limit
        return (
            _SideFile(folder / KALDI_UTT2SPK, self.problems, "utt spk", "speaker", limit),
            _SideFile(folder / KALDI_TEXT, self.problems, "utt words", None, limit),
            _SideFile(folder / KALDI_UTT2DUR, self.problems, "utt seconds", "duration", limit),
        )

    def _kaldi_segments(self, folder: Path) -> Iterator[Utterance]:
        """`segments` ("utt rec start end"): each line an utterance of recording `rec` of wav.scp."""
        wav_scp, segments = folder / KALDI_WAV_SCP, folder / KALDI_SEGMENTS
        side = (KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR, KALDI_RECO2DUR)
        self.problems.register(segments, wav_scp, *(folder / name for name in side))
        recordings: dict[str, str] = {}
        base = str(folder.absolute())
        for line in _lines(wav_scp, self.problems):
            rec, rest = _split_first(line.text)
            wrong = name_problem("recording", rec, self.limit) or name_problem("path", rest, self.limit)
            if not rest:
                what = f"expected 'recording path', got {_quote(line.text.strip())}"
                self.problems.add(wav_scp, line.number, what)
            elif wrong:
                self.problems.add(wav_scp, line.number, wrong)
            elif rest.endswith("|"):
                self.problems.add(wav_scp, line.number, _pipe_refused(rest))
            elif rec in recordings:
                self.problems.add(wav_scp, line.number, f"duplicate recording {rec!r}")
            else:
                recordings[rec] = _absolute(base, rest)
        lengths = _durations_of(folder / KALDI_RECO2DUR, self.problems)
        speakers, texts, _ = self._side_files(folder)
        self.durations_listed = True
        for line in _lines(segments, self.problems):
            parsed = segment_line(line.text, recordings, lengths, self.limit)
            if isinstance(parsed, str):
                self.problems.add(segments, line.number, parsed)
                continue
            utt, path, start, end = parsed
            self._ids.add(utt, line.number)
            yield Utterance(
                utt=utt,
                path=path,
                spk=speakers.value(utt) or utt,
                text=texts.value(utt) or "",
                duration_s=None if end is None else max(0.0, end - start),
                start_s=start,
                end_s=end,
            )
            if end is None:
                self.durations_listed = False
        if self.count == 0 and not self.problems.items:
            self.problems.add(segments, None, "lists no utterances")
        self._check_ids(segments, lambda text: _split_first(text)[0])
        for side_file in (speakers, texts):
            side_file.finish(self._ids)

    # -- WebDataset tar shards -----------------------------------------------------------------
    def _tars(self, source: Source) -> Iterator[Utterance]:
        """One entry per tar, in the order listed (a folder's or prefix's: sorted by name)."""
        tars = _tar_paths(source, self.problems, self.limit)
        for number, tar in enumerate(tars, start=1):
            self._ids.add(tar, number)
            yield Utterance(utt=tar, path=tar)
        if self.count == 0 and not self.problems.items:
            self.problems.add(source, None, "lists no .tar shards")
        repeats = self._ids.repeats()
        for line, first in sorted(repeats.items()):
            self.problems.add(source, line, f"tar {tars[line - 1]!r} listed twice (first as number {first})")

    # -- lhotse ----------------------------------------------------------------------------------
    def _jsonl(self, file: Source) -> Iterator[Utterance]:
        """A JSONL file: a manifest, lhotse cuts, or lhotse supervisions (their recordings beside)."""
        kind = jsonl_kind(file)
        if kind == "cuts":
            return self._cuts(file)
        if kind == "supervisions":
            recordings = _recordings_beside(file)
            if recordings is None:
                self.problems.add(file, None, "lhotse supervisions without a recordings file beside them")
                return iter(())
            return self._lhotse_pair(recordings, file)
        return self._manifest(file)

    def _cuts(self, file: Source) -> Iterator[Utterance]:
        base = _parent(file)
        for line in _lines(file, self.problems):
            found = _cut_utterances(line.text, base, self.limit)
            if isinstance(found, str):
                self.problems.add(file, line.number, found)
                continue
            for utt in found:
                self._ids.add(utt.utt, line.number)
                yield utt
        self.durations_listed = True
        if self.count == 0 and not self.problems.items:
            self.problems.add(file, None, "lists no cuts")
        self._check_lhotse_ids(file)

    def _lhotse_pair(self, recordings_file: Source, supervisions_file: Source) -> Iterator[Utterance]:
        self.problems.register(supervisions_file, recordings_file)
        recordings: dict[str, _Recording] = {}
        base = _parent(recordings_file)
        for line in _lines(recordings_file, self.problems):
            recording = _recording_entry(line.text, base, self.limit)
            if isinstance(recording, str):
                self.problems.add(recordings_file, line.number, recording)
            elif recording.id in recordings:
                self.problems.add(recordings_file, line.number, f"duplicate recording {recording.id!r}")
            else:
                recordings[recording.id] = recording
        for line in _lines(supervisions_file, self.problems):
            utt = _supervision_entry(line.text, recordings, self.limit)
            if isinstance(utt, str):
                self.problems.add(supervisions_file, line.number, utt)
                continue
            self._ids.add(utt.utt, line.number)
            yield utt
        self.durations_listed = True
        if self.count == 0 and not self.problems.items:
            self.problems.add(supervisions_file, None, "lists no supervisions")
        self._check_lhotse_ids(supervisions_file)

    def _check_lhotse_ids(self, file: Source) -> None:
        for line, first in sorted(self._ids.repeats().items()):
            self.problems.add(file, line, f"duplicate utterance id (first on line {first})")

    # -- JSONL manifest ----------------------------------------------------------------------
    def _manifest(self, file: Source) -> Iterator[Utterance]:
        for line in _lines(file, self.problems):
            utt = _manifest_entry(file, line, self.problems, self.limit)
            if utt is None:
                continue
            self._ids.add(utt.utt, line.number)
            self.durations_listed = self.durations_listed or utt.duration_s is not None
            yield utt
        if self.count == 0 and not self.problems.items:
            self.problems.add(file, None, "lists no utterances")
        self._check_ids(file, _manifest_utt)

    # -- folder of audio ---------------------------------------------------------------------
    def _folder(self, folder: Path) -> Iterator[Utterance]:
        base = folder.absolute()
        # Two files of one stem (a.wav, a.flac) are in the same folder: the stems of the folder
        # being listed are enough to find them.
        folder_now, stems = "", dict[str, str]()
        for rel in _audio_files(base):
            utt = rel.rsplit(".", 1)[0]
            parent = rel.rsplit("/", 2)[-2] if "/" in rel else base.name
            here = rel.rsplit("/", 1)[0] if "/" in rel else ""
            if here != folder_now:
                folder_now, stems = here, {}
            if utt in stems:
                self.problems.add(folder, None, f"duplicate utt {utt!r} from {stems[utt]!r} and {rel!r}")
                continue
            stems[utt] = rel
            yield Utterance(utt=utt, path=str(base / rel), spk=parent)
        if self.count == 0 and not self.problems.items:
            self.problems.add(folder, None, f"holds no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})")


def read_corpus(source: Source, max_text_chars: int | None = MAX_TEXT_CHARS) -> list[Utterance]:
    """The whole corpus at `source`, in listing order (`CorpusError` for any problem in it)."""
    listing = CorpusListing(source, max_text_chars=max_text_chars)
    utts = list(listing)
    listing.raise_problems()
    return utts


# --------------------------------------------------------------------------- Kaldi side files


class _SideFile:
    """A Kaldi side file (`utt2spk`, `text`, `utt2dur`) joined to `wav.scp` as both stream by.

    Values are read ahead only until the wanted utt: when the file lists utts in `wav.scp`'s order
    nothing is held; lines met out of that order wait in `aside` until their utt comes (at worst
    the whole file, as a plain dict would hold it). When both files are sorted, the read stops at
    the first utt that sorts after the wanted one, so an utt the file lacks costs nothing. Whether
    the file is sorted is read (the whole file, once) only when that question first comes up: a
    file in `wav.scp`'s order never asks it, so the first utterances come without reading it.
    """

    def __init__(
        self, file: Path, problems: _Problems, shape: str, value_name: str | None, limit: int | None
    ) -> None:
        """`value_name`: what the one word after the utt is (a speaker, a duration); None: the rest
        of the line is free text (`text`). Such a word is held to `limit` characters."""
        self.file = file
        self.problems = problems
        self.shape = shape
        self.value_name = value_name
        self.single_word = value_name is not None
        self.limit = limit
        self.exists = file.exists()
        self.aside: dict[str, tuple[str, int]] = {}
        self._sorted: bool | None = None
        self._lines = _lines(file, problems) if self.exists else iter(())
        self._peeked: tuple[str, str, int] | None = None
        self._last_key = ""
        self._last_line = 0

    def sorted(self) -> bool:
        if self._sorted is None:
            self._sorted = _keys_sorted(self.file)
        return self._sorted

    def value(self, utt: str) -> str | None:
        """The value listed for `utt`, or None when the file does not list it."""
        if not self.exists:
            return None
        if utt in self.aside:
            return self.aside.pop(utt)[0]
        while (entry := self._next()) is not None:
            key, value, number = entry
            if key == utt:
                return value
            if key > utt and self.sorted():
                self._peeked = entry  # every later key sorts after `utt` too: it is not listed
                return None
            self._keep_aside(key, value, number)
        return None

    def _next(self) -> tuple[str, str, int] | None:
        if self._peeked is not None:
            entry, self._peeked = self._peeked, None
            return entry
        for line in self._lines:
            key, rest = _split_first(line.text)
            if self.single_word and (not rest or len(rest.split()) != 1):
                self.problems.add(
                    self.file, line.number, f"expected '{self.shape}', got {_quote(line.text.strip())}"
                )
                continue
            if self.value_name is not None and (wrong := name_problem(self.value_name, rest, self.limit)):
                self.problems.add(self.file, line.number, wrong)
                continue
            if key == self._last_key:
                self.problems.add(
                    self.file, line.number, f"duplicate utt {key!r} (first on line {self._last_line})"
                )
                continue
            self._last_key, self._last_line = key, line.number
            return key, rest, line.number
        return None

    def _keep_aside(self, key: str, value: str, number: int) -> None:
        if key in self.aside:
            self.problems.add(
                self.file, number, f"duplicate utt {key!r} (first on line {self.aside[key][1]})"
            )
            return
        self.aside[key] = (value, number)

    def finish(self, ids: ListedIds | _NoIds) -> None:
        """Report what the file lists that `wav.scp` does not (or lists twice)."""
        if not self.exists:
            return
        while (entry := self._next()) is not None:
            self._keep_aside(*entry)
        for key, (_, number) in sorted(self.aside.items(), key=lambda item: item[1][1]):
            if ids.contains(key):
                self.problems.add(self.file, number, f"duplicate utt {key!r}")
            else:
                self.problems.add(self.file, number, f"utt {key!r} is not in {KALDI_WAV_SCP}")
        self.aside.clear()


def _keys_sorted(file: Path) -> bool:
    """Whether the file's lines come in sorted order of their first word (Kaldi's convention)."""
    previous = ""
    for line in _lines(file, _Problems()):
        key = _split_first(line.text)[0]
        if key < previous:
            return False
        previous = key
    return True


def _seconds(value: str | None, file: Path, problems: _Problems) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        problems.add(file, None, f"duration {_quote(value)} is not a number of seconds")
        return None
    return seconds if seconds >= 0 else None


def _split_first(text: str) -> tuple[str, str]:
    """Split a line at its first run of whitespace: ('utt', 'rest stripped')."""
    parts = text.strip().split(maxsplit=1)
    if len(parts) < 2:
        return (parts[0] if parts else ""), ""
    return parts[0], parts[1].strip()


# --------------------------------------------------------------------------- JSONL manifest


def _manifest_entry(file: Source, line: _Line, problems: _Problems, limit: int | None) -> Utterance | None:
    """One manifest line as an `Utterance`, or None after reporting what is wrong with it."""
    data, error = parse_json(line.text)
    if error is None and not isinstance(data, dict):
        error = f"expected a JSON object, got {type(data).__name__}"
    wrong = [error] if error is not None else manifest_field_problems(data, limit)
    if wrong:
        problems.add(file, line.number, "; ".join(wrong))
        return None
    utt = str(data["utt"])
    duration = next((data[key] for key in DURATION_FIELDS if isinstance(data.get(key), (int, float))), None)
    seconds = _finite(duration)
    return Utterance(
        utt=utt,
        path=_absolute(_parent(file), data["path"]),
        spk=data.get("spk") or utt,
        text=data.get("text") or "",
        duration_s=seconds if seconds is not None and seconds >= 0 else None,
    )


def _manifest_utt(text: str) -> str:
    data, _ = parse_json(text)
    return str(data.get("utt")) if isinstance(data, dict) else "?"


def parse_json(text: str) -> tuple[Any, str | None]:
    """(the value of one JSON line, None), or (None, what is wrong with it): a syntax error, a
    number of more digits than Python converts, nesting deeper than it recurses."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    except (ValueError, RecursionError) as exc:  # int digits beyond sys.get_int_max_str_digits, nesting
        return None, f"not valid JSON ({type(exc).__name__}: {_quote(str(exc), 80)})"


def manifest_field_problems(data: dict[str, Any], limit: int | None) -> list[str]:
    """What is wrong with the fields of one manifest object (empty when nothing is)."""
    wrong: list[str] = []
    for key in ("utt", "path"):
        value = data.get(key)
        if key not in data:
            wrong.append(f"missing field {key!r}")
        elif not isinstance(value, str) or not value.strip():
            wrong.append(f"field {key!r} must be a non-empty string, got {_shown_json(value)}")
        elif problem := name_problem(f"field {key!r}", value, limit):
            wrong.append(problem)
    for key in ("spk", "text"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            wrong.append(f"field {key!r} must be a string, got {_shown_json(value)}")
        elif isinstance(value, str) and (problem := _text_problem(key, value, limit)):
            wrong.append(problem)
    return wrong


def _text_problem(key: str, value: str, limit: int | None) -> str | None:
    """A speaker is a name (`name_problem`); a text only has to be valid Unicode."""
    if key == "text":
        return None if encodable(value) else f"field {key!r} is not valid Unicode (a lone surrogate)"
    return name_problem(f"field {key!r}", value, limit)


# --------------------------------------------------------------------------- folder of audio


def _audio_files(base: Path, rel_dir: PurePosixPath = PurePosixPath()) -> Iterator[str]:
    """Posix paths, relative to `base`, of the audio files below it (hidden ones skipped), in the
    order a sort of those paths gives: a folder's entries sorted as `name/` and `name`."""
    try:
        entries = list(os.scandir(base / rel_dir))
    except OSError:
        return
    keyed = sorted(
        ((entry.name + "/" if entry.is_dir() else entry.name), entry.name)
        for entry in entries
        if not entry.name.startswith(".")
    )
    for key, name in keyed:
        if key.endswith("/"):
            yield from _audio_files(base, rel_dir / name)
        elif Path(name).suffix.lower() in AUDIO_EXTENSIONS:
            yield (rel_dir / name).as_posix()


# --------------------------------------------------------------------------- helpers


def name_problem(what: str, value: str, limit: int | None) -> str | None:
    """What is wrong with a name or path a listing gives (an utt, a speaker, a path or URL), or
    None: longer than `limit` characters, a NUL byte, not valid Unicode. Told by length and
    membership alone, before any path or pattern call sees it."""
    if limit is not None and len(value) > limit:
        return f"{what} is {len(value)} characters long; the limit is {limit} (max_text_chars)"
    if "\x00" in value:
        return f"{what} holds a NUL byte"
    if not encodable(value):
        return f"{what} is not valid Unicode (a lone surrogate)"
    return None


def _quote(text: str, width: int = 120) -> str:
    """`text` as repr, cut to about `width` characters: a message never carries a whole long line."""
    shown = repr(text)
    return shown if len(shown) <= width else f"{shown[: width - 20]}... ({len(text)} characters)"


def _shown(value: Any, width: int = 120) -> str:
    """A value of a JSON line for a message: a string as repr, anything else as JSON."""
    return _quote(value, width) if isinstance(value, str) else _shown_json(value, width)


def _shown_json(value: Any, width: int = 120) -> str:
    """A JSON value for a message, as JSON, cut to about `width` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= width else f"{text[: width - 20]}... ({len(text)} characters)"


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, NaN, Infinity, an int too
    large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _lines(file: Source, problems: _Problems) -> Iterator[_Line]:
    """Non-blank lines of a UTF-8 text file (local or at a URL; gzip when it ends in .gz), streamed;
    an unreadable file or line is reported."""
    try:
        raw: IO[bytes] = storage.open_input(file)
    except VoxmillError as exc:
        problems.add(file, None, f"cannot be read ({exc.message})")
        return
    except OSError as exc:
        problems.add(file, None, f"cannot be read ({exc.strerror or exc})")
        return
    stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if str(file).endswith(".gz") else raw
    with raw, stream:
        number = 0
        try:
            for number, chunk in enumerate(stream, start=1):  # noqa: B007 - the count outlives the loop
                try:
                    text = chunk.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    problems.add(file, number, "is not valid UTF-8")
                    continue
                if number == 1:
                    text = text.removeprefix("\ufeff")
                if text.strip():
                    yield _Line(number, text)
        except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
            problems.add(file, number + 1, f"cannot be read further ({exc})")


def _absolute(base: Path | str, path: str) -> str:
    """`path` made absolute relative to `base` (symlinks and '..' are kept as written); a URL stays
    as it is, and a relative path in a listing at a URL becomes a URL beside it. Plain string
    joins: this runs once per utterance of a listing."""
    if "://" in path and is_url(path):
        return path
    base_text = base if isinstance(base, str) else str(base.absolute())
    if "://" in base_text and is_url(base_text):
        return path if path.startswith("/") else str(storage.parse_url(base_text).join(path))
    if "//" in path or "./" in path or path.endswith("/"):  # what pathlib would tidy: let it
        return str(Path(base_text, path))
    return path if path.startswith("/") else f"{base_text}/{path}"


def _parent(file: Source) -> Path | str:
    """The folder of a listing file: a Path, or a URL for a listing at a URL."""
    if isinstance(file, str):
        return str(storage.parse_url(file).parent)
    return file.parent.absolute()


def as_source(source: Source) -> Source:
    """An `extract` input as this module reads it: a URL or a brace pattern stays a string,
    anything else is a Path. A URL that went through `Path()` (`s3:/bucket/x`) is mended."""
    text = str(source)
    for scheme in storage.URL_SCHEMES:
        if text.startswith(f"{scheme}:/") and not text.startswith(f"{scheme}://"):
            text = f"{scheme}://{text[len(scheme) + 2 :]}"
            break
    if is_url(text) or _is_pattern(text):
        return text
    return Path(source)


def listing_digest(source: Source) -> str | None:
    """A digest of the files a local Kaldi dir (those of `KALDI_FILES` it has) or JSONL manifest
    is read from: their paths, sizes and bytes, and the working folder. Equal digests mean the
    listing would read the same, so a resume of a finished plan need not parse it again (CHANGELOG
    21). None for the other listings (a folder scan, tars, URLs, lhotse pairs), which a resume
    reads again."""
    source = as_source(source)
    if isinstance(source, str) or input_is_tars(source):
        return None
    if source.is_dir() and (source / KALDI_WAV_SCP).is_file():
        files = [source / name for name in KALDI_FILES if (source / name).is_file()]
    elif source.is_file() and source.name == KALDI_WAV_SCP:
        files = [source.parent / name for name in KALDI_FILES if (source.parent / name).is_file()]
    elif source.is_file() and is_jsonl(source.name):
        files = [source]
    else:
        return None
    digest = hashlib.sha256(os.getcwd().encode())
    for path in files:
        digest.update(f"\0{path.absolute()}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as stream:
            while block := stream.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _is_pattern(text: str) -> bool:
    return "{" in text and "}" in text.split("{", 1)[1]


def is_jsonl(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(MANIFEST_SUFFIX) or lower.endswith(GZ_MANIFEST_SUFFIX)


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
            first = next(_lines(source, _Problems()), None)
            return first is not None and first.text.strip().lower().endswith(TAR_SUFFIX)
        return source.suffix.lower() == TAR_SUFFIX
    if source.is_dir() and not (source / KALDI_WAV_SCP).is_file() and _lhotse_pair(source) is None:
        try:
            with os.scandir(source) as entries:
                return any(e.name.lower().endswith(TAR_SUFFIX) and e.is_file() for e in entries)
        except OSError:
            return False
    return False


def _tar_paths(source: Source, problems: _Problems, limit: int | None = None) -> list[str]:
    """The tars a tar input names, in order; problems for what cannot be listed (a line of a
    list naming one beyond `limit` characters, too)."""
    text = str(source)
    if isinstance(source, str) and _is_pattern(source):
        try:
            return (
                storage.expand_braces(source)
                if is_url(source)
                else [_absolute(Path.cwd(), p) for p in storage.expand_braces(source)]
            )
        except VoxmillError as exc:
            problems.add(source, None, exc.message)
            return []
    if isinstance(source, str) and source.endswith("/"):
        try:
            names = storage.list_url(source)
        except VoxmillError as exc:
            problems.add(source, None, f"cannot be listed ({exc.message})")
            return []
        return [_absolute(source, n) for n in names if n.lower().endswith(TAR_SUFFIX)]
    if text.lower().endswith(TAR_SUFFIX):
        return [text if isinstance(source, str) else str(source.absolute())]
    if isinstance(source, Path) and source.is_dir():
        names = sorted(e.name for e in os.scandir(source) if e.name.lower().endswith(TAR_SUFFIX))
        return [str(source.absolute() / n) for n in names]
    base = _parent(source)
    tars = []
    for line in _lines(source, problems):
        if wrong := name_problem("tar", line.text.strip(), limit):
            problems.add(source, line.number, wrong)
        else:
            tars.append(_absolute(base, line.text.strip()))
    return tars


def _pipe_refused(command: str) -> str:
    return f"piped commands are not supported ({command!r}): {NO_SHELL}; list audio files"


def _durations_of(file: Path, problems: _Problems) -> dict[str, float]:
    """`reco2dur` ("rec seconds") as a dict; empty when there is no such file."""
    if not file.exists():
        return {}
    lengths: dict[str, float] = {}
    for line in _lines(file, problems):
        rec, rest = _split_first(line.text)
        seconds = recording_seconds(rest)
        if seconds is None:
            problems.add(file, line.number, f"expected 'recording seconds', got {_quote(line.text.strip())}")
        else:
            lengths[rec] = seconds
    return lengths


def recording_seconds(text: str) -> float | None:
    """The seconds of a `reco2dur` line's value, or None when it is not a finite number."""
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


def segment_line(
    text: str, recordings: dict[str, str], lengths: dict[str, float], limit: int | None
) -> tuple[str, str, float, float | None] | str:
    """(utt, path, start, end or None) of a `segments` line, or what is wrong with it."""
    parts = text.split()
    if len(parts) != 4:
        return f"expected 'utt recording start end', got {_quote(text.strip())}"
    utt, rec, start_text, end_text = parts
    if wrong := name_problem("utt", utt, limit):
        return wrong
    if rec not in recordings:
        return f"recording {_quote(rec)} is not in {KALDI_WAV_SCP}"
    try:
        start, end = float(start_text), float(end_text)
    except ValueError:
        start = end = math.nan
    if not (math.isfinite(start) and math.isfinite(end)):
        return f"start and end must be seconds, got {_quote(start_text, 40)} and {_quote(end_text, 40)}"
    if start < 0:
        return f"segment {utt!r} starts before 0 s"
    if end == -1:  # Kaldi: to the end of the recording
        return utt, recordings[rec], start, lengths.get(rec)
    if end <= start:
        return f"segment {utt!r} ends ({end:g} s) before it starts ({start:g} s)"
    return utt, recordings[rec], start, end


# --------------------------------------------------------------------------- lhotse


@dataclass(frozen=True)
class _Recording:
    """A lhotse recording: its id and its sources as (path or URL, the channels it holds)."""

    id: str
    sources: tuple[tuple[str, tuple[int, ...]], ...]


def _lhotse_pair(folder: Path) -> tuple[Path, Path] | None:
    """(recordings, supervisions) of a folder holding exactly one file of each, else None."""
    try:
        names = [e.name for e in os.scandir(folder) if is_jsonl(e.name)]
    except OSError:
        return None
    recordings = [n for n in names if "recordings" in n]
    supervisions = [n for n in names if "supervisions" in n]
    if len(recordings) == 1 and len(supervisions) == 1:
        return folder / recordings[0], folder / supervisions[0]
    return None


def _recordings_beside(file: Source) -> Source | None:
    """The recordings file named like `file` with 'supervisions' replaced, if it exists."""
    name = str(file).rsplit("/", 1)[-1]
    if "supervisions" not in name:
        return None
    other = name.replace("supervisions", "recordings")
    if isinstance(file, str):
        url = str(storage.parse_url(file).parent.join(other))
        return url if storage.url_exists(url) else None
    candidate = file.parent / other
    return candidate if candidate.exists() else None


def jsonl_kind(file: Source) -> str:
    """'cuts', 'supervisions' or 'manifest', told from the first object of the file."""
    for line in _lines(file, _Problems()):
        first, error = parse_json(line.text)
        if error is not None or not isinstance(first, dict):
            return "manifest"  # its problems are reported as a manifest's
        if "supervisions" in first or "recording" in first or str(first.get("type", "")).endswith("Cut"):
            return "cuts"
        if "recording_id" in first and "start" in first:
            return "supervisions"
        return "manifest"
    return "manifest"


def _lhotse_source(source: Any, base: Path | str, limit: int | None) -> tuple[str, tuple[int, ...]] | str:
    """(path or URL, channels) of one lhotse AudioSource, or why it cannot be read."""
    if not isinstance(source, dict):
        return "a recording source must be an object"
    kind, where = source.get("type"), source.get("source")
    channels = _channel_list(source.get("channels"))
    if kind == "command":
        return f"recording source of type 'command' refused: {NO_SHELL}"
    if kind not in ("file", "url") or not isinstance(where, str) or not where:
        return f"recording source of type {_shown(kind, 40)} is not supported (file and url are)"
    if wrong := name_problem("recording source", where, limit):
        return wrong
    if channels is None:
        return f"channels must be a list of channel numbers, got {_shown(source.get('channels'))}"
    if kind == "url" and not is_url(where):
        return f"recording URL scheme not supported (schemes: {', '.join(storage.URL_SCHEMES)})"
    return _absolute(base, where), channels


def _channel_list(value: Any) -> tuple[int, ...] | None:
    """A source's `channels` (absent: channel 0), or None when it is not a list of channel numbers."""
    if value is None or value == []:
        return (0,)
    if not isinstance(value, list) or not all(_is_channel(c) for c in value):
        return None
    return tuple(value)


def _is_channel(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536


def _recording_entry(text: str, base: Path | str, limit: int | None) -> _Recording | str:
    data, error = parse_json(text)
    if error is not None:
        return error
    return _recording_of(data, base, limit)


def _recording_of(data: Any, base: Path | str, limit: int | None) -> _Recording | str:
    """A lhotse recording object, or what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not data.get("sources"):
        return "expected a lhotse recording: an object with 'id' and 'sources'"
    if not isinstance(data["sources"], list):
        return "a recording's 'sources' must be a list"
    if wrong := name_problem("recording id", data["id"], limit):
        return wrong
    sources = []
    for source in data["sources"]:
        parsed = _lhotse_source(source, base, limit)
        if isinstance(parsed, str):
            return parsed
        sources.append(parsed)
    return _Recording(data["id"], tuple(sources))


def _channel_of(recording: _Recording, wanted: Any) -> tuple[str, int | None] | str:
    """(path, channel inside that file or None for the mean) for a supervision's `channel`."""
    if isinstance(wanted, list):
        wanted = wanted[0] if len(wanted) == 1 else None  # several: their mean, as all channels
    if wanted is not None and not _is_channel(wanted):
        return f"channel must be an integer or a list of them, got {_shown(wanted)}"
    for path, channels in recording.sources:
        if wanted is None or wanted in channels:
            if wanted is None or len(channels) <= 1:
                return path, None
            return path, channels.index(wanted)
    return f"channel {wanted} is in none of recording {_quote(recording.id)}'s sources"


def _number(data: dict[str, Any], key: str, default: float | None = None) -> float | None:
    """A field as a finite number of seconds; None when absent (without default) or not one."""
    return _finite(data.get(key, default))


def _supervision_entry(text: str, recordings: dict[str, _Recording], limit: int | None) -> Utterance | str:
    """One lhotse supervision (of a recordings + supervisions pair) as an utterance."""
    data, error = parse_json(text)
    if error is not None:
        return error
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return "expected a lhotse supervision: an object with 'id', 'recording_id', 'start', 'duration'"
    recording_id = data.get("recording_id")
    recording = recordings.get(recording_id) if isinstance(recording_id, str) else None
    if recording is None:
        return f"recording {_shown(data.get('recording_id'))} is not in the recordings file"
    start, duration = _number(data, "start"), _number(data, "duration")
    if start is None or duration is None or duration <= 0 or start < 0:
        return "supervision needs a 'start' >= 0 and a 'duration' > 0 (seconds)"
    where = _channel_of(recording, data.get("channel"))
    if isinstance(where, str):
        return where
    return _supervised(data, where, start, start + duration, limit)


def _supervised(
    sup: dict[str, Any], where: tuple[str, int | None], start: float, end: float, limit: int | None
) -> Utterance | str:
    """A lhotse supervision as the utterance [start, end) of the recording file `where` names."""
    utt, speaker, text = sup["id"], sup.get("speaker"), sup.get("text")
    if speaker is not None and not isinstance(speaker, str) or text is not None and not isinstance(text, str):
        return f"supervision {_quote(utt)}: 'speaker' and 'text' must be strings"
    wrong = (
        name_problem("supervision id", utt, limit)
        or _text_problem("speaker", speaker or "", limit)
        or _text_problem("text", text or "", limit)
    )
    if wrong:
        return wrong
    return Utterance(
        utt=utt,
        path=where[0],
        spk=speaker or utt,
        text=text or "",
        duration_s=end - start,
        start_s=start,
        end_s=end,
        channel=where[1],
    )


def _cut_utterances(text: str, base: Path | str, limit: int | None) -> list[Utterance] | str:
    """The utterances of one lhotse cut: each supervision's part of the cut (clipped to it), or
    the whole cut when it has none; or what is wrong with the line."""
    cut, error = parse_json(text)
    if error is not None:
        return error
    if not isinstance(cut, dict):
        return f"expected a JSON object, got {type(cut).__name__}"
    kind = cut.get("type") or "MonoCut"
    if kind != "MonoCut":
        return f"cut of type {_shown(kind, 40)} is not supported (MonoCut is)"
    recording = _recording_of(cut.get("recording") or {}, base, limit)
    if isinstance(recording, str):
        return recording
    start, duration = _number(cut, "start", 0.0), _number(cut, "duration")
    if start is None or duration is None or duration <= 0 or start < 0:
        return "cut needs a 'start' >= 0 and a 'duration' > 0 (seconds)"
    supervisions = cut.get("supervisions") or []
    if not isinstance(supervisions, list):
        return "a cut's 'supervisions' must be a list"
    if not supervisions:
        return _whole_cut(cut, recording, start, duration, limit)
    utts = []
    for sup in supervisions:
        part = _cut_supervision(sup, cut, recording, start, duration, limit)
        if isinstance(part, str):
            return part
        if part is not None:
            utts.append(part)
    return utts


def _whole_cut(
    cut: dict[str, Any], recording: _Recording, start: float, duration: float, limit: int | None
) -> list[Utterance] | str:
    """A cut without supervisions: one utterance, the whole cut."""
    where = _channel_of(recording, cut.get("channel"))
    if isinstance(where, str):
        return where
    utt = cut.get("id") or recording.id
    if not isinstance(utt, str):
        return f"a cut's 'id' must be a string, got {_shown(utt)}"
    if wrong := name_problem("cut id", utt, limit):
        return wrong
    return [Utterance(utt, where[0], utt, "", duration, start, start + duration, where[1])]


def _cut_supervision(
    sup: Any, cut: dict[str, Any], recording: _Recording, start: float, duration: float, limit: int | None
) -> Utterance | str | None:
    """One supervision of a cut as an utterance (the part of it inside the cut; None if none is)."""
    if not isinstance(sup, dict) or not isinstance(sup.get("id"), str):
        return "a supervision must be an object with an 'id'"
    sup_start, sup_duration = _number(sup, "start"), _number(sup, "duration")
    if sup_start is None or sup_duration is None or sup_duration <= 0:
        return f"supervision {_quote(sup['id'])} needs a 'start' and a 'duration' > 0"
    first, last = max(sup_start, 0.0), min(sup_start + sup_duration, duration)  # inside the cut
    if last <= first:
        return None
    where = _channel_of(recording, sup.get("channel", cut.get("channel")))
    if isinstance(where, str):
        return where
    return _supervised(sup, where, start + first, start + last, limit)


# --------------------------------------------------------------------------- planning


@dataclass
class ShardCutter:
    """Cuts a listing into shards of `shard_size` utterances, in listing order, as it streams by.

    Shard k holds listing positions [k * size, (k + 1) * size): the plan of a listing depends on
    nothing else, so the same listing gives the same shards whatever happened before.
    """

    shard_size: int
    next_shard: int = 0
    pending: list[Utterance] = field(default_factory=list)

    def add(self, utt: Utterance) -> list[Utterance] | None:
        """Take one utterance; the utterances of a full shard when this one completes it."""
        self.pending.append(utt)
        if len(self.pending) < self.shard_size:
            return None
        return self._cut()

    def rest(self) -> list[Utterance] | None:
        """The last, shorter shard, if any."""
        return self._cut() if self.pending else None

    def _cut(self) -> list[Utterance]:
        utts, self.pending = self.pending, []
        self.next_shard += 1
        return utts


def auto_shard_size(n_utts: int, workers: int, largest: int, shards_per_worker: int = 6) -> int:
    """Utterances per shard: `largest`, or fewer so each worker process gets `shards_per_worker` shards.

    A run ends when its last shard does: with few large shards one process finishes while the
    others still work on theirs. A small corpus is therefore cut finer (60 clips over 2 processes:
    shards of 5 instead of 2 shards of 32); a large one keeps shards of `largest`.
    """
    wanted = -(-n_utts // max(1, workers * shards_per_worker))  # ceiling division
    return max(1, min(largest, wanted))


def shard_size_for_durations(mean_s: float, smallest: int, seconds: float, largest: int) -> int:
    """Utterances per shard when the listing gives durations: `smallest`, or more for short clips,
    so that a shard holds about `seconds` of audio (at most `largest` utterances).

    A shard pays a fixed cost (its task, its file, the driver's bookkeeping) that matters only
    when its clips are short and the models fast (CHANGELOG 24).
    """
    if seconds <= 0 or mean_s <= 0:
        return smallest
    return max(smallest, min(largest, round(seconds / mean_s)))


def check_ops(ops: Sequence[str], shard_size: int) -> None:
    """Refuse unknown or repeated ops and a shard size below 1."""
    if shard_size < 1:
        raise VoxmillError(BAD_REQUEST, f"shard size must be at least 1, got {shard_size}")
    if not ops:
        raise VoxmillError(BAD_REQUEST, "no ops to plan")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise VoxmillError(BAD_REQUEST, f"unknown op(s) {unknown}; known: {list(OPS)}")
    if len(set(ops)) != len(ops):
        raise VoxmillError(BAD_REQUEST, f"ops repeat: {list(ops)}")


def shard_digest(utts: Sequence[Utterance]) -> str:
    """sha256 (hex) of a shard's utterances (utt, path, spk, text, and a segment's bounds and
    channel): what a resume compares. A whole-file utterance digests as before segments existed."""
    digest = hashlib.sha256()
    for u in utts:
        fields: list[Any] = [u.utt, u.path, u.spk, u.text]
        if u.is_segment:
            fields += [u.start_s, u.end_s, u.channel]
        digest.update(json.dumps(fields, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def corpus_folders(source: Source) -> list[Path]:
    """The local folders holding a corpus's audio (or tars), read from its listing (paths only,
    nothing opened): what an embedded run lets its own workers read (`corpus_roots`)."""
    return corpus_roots(source)[0]


def corpus_roots(source: Source, limit: int = 64) -> tuple[list[Path], list[str]]:
    """(local folders, URL prefixes) holding a corpus's audio or tars.

    The folders are exactly those of the listed files, less any below another of them (it adds
    nothing): never a common ancestor, which would let the workers read what the corpus does not
    name. There may be many (one per speaker or chapter): the embedded run hands them to its
    workers in a file (`workers.corpus.cluster.EmbeddedCluster`). The URL prefixes are the listed
    objects' parents, or their buckets beyond `limit` of them.
    """
    source = as_source(source)
    if isinstance(source, Path) and source.is_dir() and not _listing_names_paths(source):
        return [source.absolute()], []
    folders: set[str] = set()
    prefixes: set[str] = set()
    for path in _listed_paths(source):
        if "://" in path and is_url(path):
            try:
                prefixes.add(str(storage.parse_url(path).parent))
            except VoxmillError:
                continue  # the worker reports it for its utterance
            if len(prefixes) > limit:  # many prefixes: their buckets
                prefixes = {_bucket_of(p) for p in prefixes}
            continue
        if "\x00" not in path:  # the worker refuses such a path for its utterance
            folders.add(os.path.dirname(path))
    return [Path(folder) for folder in outermost_folders(folders)], sorted(prefixes)


def outermost_folders(folders: Iterable[str]) -> list[str]:
    """The absolute folders none of the others holds, sorted: '/a/b' drops '/a/b/c', never '/a/bc'.

    A folder is below another when that one is a prefix of it ending at a '/' and no '..' follows
    it ('/a/b/../c' is not below '/a/b'). A set of the kept ones and a look at each ancestor: a
    few steps per folder, whatever their number.
    """
    kept: set[str] = set()
    trimmed = {f.rstrip("/") or f[:1] for f in folders}  # '/a/' is '/a'; '/' stays '/', '' stays ''
    for folder in sorted(trimmed, key=lambda f: (f.count("/"), f)):
        if not folder.startswith("/"):
            continue  # not a local absolute path: the worker refuses it for its utterance
        if folder == "/" or "/" in kept:
            return ["/"]
        parts = folder.split("/")  # '/a/b/c': '', 'a', 'b', 'c'
        ancestors = []
        for end in range(len(parts) - 1, 1, -1):  # '/a/b', then '/a'
            if parts[end] == "..":
                break
            ancestors.append("/".join(parts[:end]))
        if not any(ancestor in kept for ancestor in ancestors):
            kept.add(folder)
    return sorted(kept)


def _bucket_of(url: str) -> str:
    parsed = storage.parse_url(url)
    return f"{parsed.scheme}://{parsed.bucket}"


def _listing_names_paths(folder: Path) -> bool:
    """Whether a folder input is a listing that names its audio (Kaldi, lhotse, tars), not a
    folder of audio files whose audio is the folder itself."""
    return (folder / KALDI_WAV_SCP).is_file() or _lhotse_pair(folder) is not None or input_is_tars(folder)


def _listed_paths(source: Source) -> Iterator[str]:
    """The audio paths a listing names, parsed no further than that (a wav.scp line is split once,
    a manifest line's JSON read for its 'path'); a path the reader refuses (too long, a NUL byte)
    is left out: the listing is refused before anything runs."""
    wav_scp = source / KALDI_WAV_SCP if isinstance(source, Path) and source.is_dir() else source
    if isinstance(wav_scp, Path) and wav_scp.name == KALDI_WAV_SCP:
        base = str(wav_scp.parent.absolute())
        with open(wav_scp, "rb") as stream:
            for raw in stream:
                parts = raw.split(None, 1)
                if len(parts) == 2 and len(parts[1]) <= MAX_TEXT_CHARS and b"\x00" not in parts[1]:
                    yield _absolute(base, parts[1].strip().decode("utf-8", "replace"))
    elif (
        isinstance(source, Path)
        and source.is_file()
        and is_jsonl(source.name)
        and jsonl_kind(source) == "manifest"
    ):
        base = str(source.parent.absolute())
        for line in _lines(source, _Problems()):
            data, _ = parse_json(line.text)
            path = data.get("path") if isinstance(data, dict) else None
            if isinstance(path, str) and path.strip() and name_problem("path", path, MAX_TEXT_CHARS) is None:
                yield _absolute(base, path)
    else:
        yield from (utt.path for utt in CorpusListing(source, find_repeats=False))
