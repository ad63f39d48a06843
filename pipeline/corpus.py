"""Corpus listings, read as a stream (pure: no queue, no audio opened).

`CorpusListing(source)` accepts the three input kinds of `voxmill extract` (DESIGN.md, Contract):

- a Kaldi data dir (CosyVoice's layout): `wav.scp` ("utt path", split on the first whitespace so
  paths may hold spaces), optional `utt2spk` ("utt spk"), `text` ("utt words...") and `utt2dur`
  ("utt seconds");
- a JSONL manifest: one `{"utt", "path", "spk"?, "text"?, "duration"?}` object per line;
- any other folder: audio files found recursively; utt = path relative to the folder without its
  extension (posix separators), spk = name of the parent folder.

Iterating it yields `Utterance`s in listing order without holding the listing in memory: a Kaldi
dir's side files are joined as they stream by (kept aside only where their order differs from
`wav.scp`'s), and duplicate utterance ids are found from 16-byte digests of the ids. Every problem
found is collected; `raise_problems()` after the iteration raises them together as one
`CorpusError`, each as "FILE line N: what is wrong". A caller that plans as the listing streams by
calls it once the iteration ends. `read_corpus(source)` is the whole listing as a list, problems
raised.

Relative audio paths are taken relative to the folder of the file that names them and made
absolute without resolving symlinks (workers check paths against the allowed roots themselves). A
missing audio file is not an error here: the worker reports `not_found` for that utterance. An
utterance without speaker information is its own speaker (Kaldi's convention), so speaker
embeddings never pool unrelated clips.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import OPS, Utterance

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".wma"})
KALDI_WAV_SCP = "wav.scp"
KALDI_UTT2SPK = "utt2spk"
KALDI_TEXT = "text"
KALDI_UTT2DUR = "utt2dur"
MANIFEST_SUFFIX = ".jsonl"
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

    def register(self, *files: Path) -> None:
        """The files of a listing, in the order their problems are reported."""
        for file in files:
            self.by_file.setdefault(str(file), [])

    def add(self, file: Path, line: int | None, what: str) -> None:
        """Record one problem; `line` None for a problem of the whole file."""
        text = f"{file}: {what}" if line is None else f"{file} line {line}: {what}"
        self.by_file.setdefault(str(file), []).append((line or 0, text))

    @property
    def items(self) -> list[str]:
        return [text for found in self.by_file.values() for _, text in sorted(found, key=lambda p: p[0])]


class _Ids:
    """The utterance ids of a listing as 16-byte digests, to find the ones listed twice at the end
    (about 24 bytes per utterance instead of a set of strings)."""

    BLOCK = 65536

    def __init__(self) -> None:
        self._blocks: list[np.ndarray[Any, Any]] = []
        self._digests = np.empty(self.BLOCK, dtype="V16")
        self._lines = np.empty(self.BLOCK, dtype=np.int64)
        self._filled = 0

    @staticmethod
    def digest(utt: str) -> bytes:
        return hashlib.blake2b(utt.encode(), digest_size=16).digest()

    def add(self, utt: str, line: int) -> None:
        self._digests[self._filled] = self.digest(utt)
        self._lines[self._filled] = line
        self._filled += 1
        if self._filled == self.BLOCK:
            self._flush()

    def _flush(self) -> None:
        block = np.empty(self._filled, dtype=[("id", "V16"), ("line", np.int64)])
        block["id"], block["line"] = self._digests[: self._filled], self._lines[: self._filled]
        self._blocks.append(block)
        self._filled = 0

    def sorted(self) -> np.ndarray[Any, Any]:
        if self._filled:
            self._flush()
        if not self._blocks:
            return np.empty(0, dtype=[("id", "V16"), ("line", np.int64)])
        everything = np.concatenate(self._blocks)
        self._blocks = [everything]
        return everything[np.argsort(everything, order=("id", "line"), kind="stable")]

    def repeats(self) -> dict[int, int]:
        """{line of a repeat: line of the first listing of that id}."""
        ordered = self.sorted()
        if len(ordered) < 2:
            return {}
        same = ordered["id"][1:] == ordered["id"][:-1]
        repeats: dict[int, int] = {}
        first = 0
        for index in range(1, len(ordered)):
            if same[index - 1]:
                repeats[int(ordered["line"][index])] = int(ordered["line"][first])
            else:
                first = index
        return repeats

    def contains(self, utt: str) -> bool:
        ordered = self.sorted()
        key = np.array([self.digest(utt)], dtype="V16")
        index = int(np.searchsorted(ordered["id"], key)[0])
        return index < len(ordered) and ordered["id"][index] == key[0]


# --------------------------------------------------------------------------- the listing


class CorpusListing:
    """A corpus listing of `source`, read as it is iterated (once)."""

    def __init__(self, source: Path) -> None:
        self.source = Path(source)
        self.problems = _Problems()
        self.durations_listed = False
        self.count = 0
        self._ids = _Ids()

    def __iter__(self) -> Iterator[Utterance]:
        source = self.source
        if source.is_dir() and (source / KALDI_WAV_SCP).is_file():
            utts = self._kaldi(source)
        elif source.is_dir():
            utts = self._folder(source)
        elif source.is_file() and source.name == KALDI_WAV_SCP:
            utts = self._kaldi(source.parent)
        elif source.is_file() and source.suffix.lower() == MANIFEST_SUFFIX:
            utts = self._manifest(source)
        elif not source.exists():
            self.problems.add(source, None, "no such file or folder")
            return
        else:
            what = "not a Kaldi data dir (with wav.scp), a .jsonl manifest or a folder of audio files"
            self.problems.add(source, None, what)
            return
        for utt in utts:
            self.count += 1
            yield utt

    def raise_problems(self) -> None:
        """Raise every problem found so far (call it once the iteration ended)."""
        if self.problems.items:
            raise CorpusError(self.problems.items)

    def _check_ids(self, file: Path, id_of: Callable[[str], str]) -> None:
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
        wav_scp = folder / KALDI_WAV_SCP
        self.problems.register(
            wav_scp, *(folder / name for name in (KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR))
        )
        speakers = _SideFile(folder / KALDI_UTT2SPK, self.problems, "utt spk", single_word=True)
        texts = _SideFile(folder / KALDI_TEXT, self.problems, "utt words", single_word=False)
        durations = _SideFile(folder / KALDI_UTT2DUR, self.problems, "utt seconds", single_word=True)
        self.durations_listed = durations.exists
        base = str(folder.absolute())
        for line in _lines(wav_scp, self.problems):
            utt, rest = _split_first(line.text)
            if not rest:
                self.problems.add(wav_scp, line.number, f"expected 'utt path', got {line.text.strip()!r}")
                continue
            if rest.endswith("|"):
                what = f"piped commands are not supported ({rest!r}); list audio files"
                self.problems.add(wav_scp, line.number, what)
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

    # -- JSONL manifest ----------------------------------------------------------------------
    def _manifest(self, file: Path) -> Iterator[Utterance]:
        for line in _lines(file, self.problems):
            utt = _manifest_entry(file, line, self.problems)
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


def read_corpus(source: Path) -> list[Utterance]:
    """The whole corpus at `source`, in listing order (`CorpusError` for any problem in it)."""
    listing = CorpusListing(source)
    utts = list(listing)
    listing.raise_problems()
    return utts


# --------------------------------------------------------------------------- Kaldi side files


class _SideFile:
    """A Kaldi side file (`utt2spk`, `text`, `utt2dur`) joined to `wav.scp` as both stream by.

    Values are read ahead only until the wanted utt: when the file lists utts in `wav.scp`'s order
    nothing is held; lines met out of that order wait in `aside` until their utt comes (at worst
    the whole file, as a plain dict would hold it). When both files are sorted, the read stops at
    the first utt that sorts after the wanted one, so an utt the file lacks costs nothing.
    """

    def __init__(self, file: Path, problems: _Problems, shape: str, *, single_word: bool) -> None:
        self.file = file
        self.problems = problems
        self.shape = shape
        self.single_word = single_word
        self.exists = file.exists()
        self.aside: dict[str, tuple[str, int]] = {}
        self.sorted = self.exists and _keys_sorted(file)
        self._lines = _lines(file, problems) if self.exists else iter(())
        self._peeked: tuple[str, str, int] | None = None
        self._last_key = ""
        self._last_line = 0

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
            if self.sorted and key > utt:
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
                    self.file, line.number, f"expected '{self.shape}', got {line.text.strip()!r}"
                )
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

    def finish(self, ids: _Ids) -> None:
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
        problems.add(file, None, f"duration {value!r} is not a number")
        return None
    return seconds if seconds >= 0 else None


def _split_first(text: str) -> tuple[str, str]:
    """Split a line at its first run of whitespace: ('utt', 'rest stripped')."""
    parts = text.strip().split(maxsplit=1)
    if len(parts) < 2:
        return (parts[0] if parts else ""), ""
    return parts[0], parts[1].strip()


# --------------------------------------------------------------------------- JSONL manifest


def _manifest_entry(file: Path, line: _Line, problems: _Problems) -> Utterance | None:
    """One manifest line as an `Utterance`, or None after reporting what is wrong with it."""
    try:
        data = json.loads(line.text)
    except json.JSONDecodeError as exc:
        problems.add(file, line.number, f"not valid JSON ({exc.msg} at column {exc.colno})")
        return None
    if not isinstance(data, dict):
        problems.add(file, line.number, f"expected a JSON object, got {type(data).__name__}")
        return None
    wrong = _manifest_field_problems(data)
    if wrong:
        problems.add(file, line.number, "; ".join(wrong))
        return None
    utt = str(data["utt"])
    duration = next((data[key] for key in DURATION_FIELDS if isinstance(data.get(key), (int, float))), None)
    return Utterance(
        utt=utt,
        path=_absolute(file.parent, data["path"]),
        spk=data.get("spk") or utt,
        text=data.get("text") or "",
        duration_s=float(duration) if duration is not None and duration >= 0 else None,
    )


def _manifest_utt(text: str) -> str:
    try:
        return str(json.loads(text).get("utt"))
    except (json.JSONDecodeError, AttributeError):
        return "?"


def _manifest_field_problems(data: dict[str, Any]) -> list[str]:
    """What is wrong with the fields of one manifest object (empty when nothing is)."""
    wrong: list[str] = []
    for key in ("utt", "path"):
        value = data.get(key)
        if key not in data:
            wrong.append(f"missing field {key!r}")
        elif not isinstance(value, str) or not value.strip():
            wrong.append(f"field {key!r} must be a non-empty string, got {json.dumps(value)}")
    for key in ("spk", "text"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            wrong.append(f"field {key!r} must be a string, got {json.dumps(value)}")
    return wrong


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


def _lines(file: Path, problems: _Problems) -> Iterator[_Line]:
    """Non-blank lines of a UTF-8 text file, streamed; an unreadable file or line is reported."""
    try:
        stream = open(file, "rb")  # noqa: SIM115 - closed below, whatever the caller does
    except OSError as exc:
        problems.add(file, None, f"cannot be read ({exc.strerror or exc})")
        return
    with stream:
        for number, chunk in enumerate(stream, start=1):
            try:
                text = chunk.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                problems.add(file, number, "is not valid UTF-8")
                continue
            if number == 1:
                text = text.removeprefix("\ufeff")
            if text.strip():
                yield _Line(number, text)


def _absolute(base: Path | str, path: str) -> str:
    """`path` made absolute relative to `base` (symlinks and '..' are kept as written). Plain string
    joins: this runs once per utterance of a listing."""
    base_text = base if isinstance(base, str) else str(base.absolute())
    if "//" in path or "./" in path or path.endswith("/"):  # what pathlib would tidy: let it
        return str(Path(base_text, path))
    return path if path.startswith("/") else f"{base_text}/{path}"


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
    """sha256 (hex) of a shard's utterances (utt, path, spk, text): what a resume compares."""
    digest = hashlib.sha256()
    for u in utts:
        digest.update(json.dumps([u.utt, u.path, u.spk, u.text], ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def corpus_folders(source: Path, limit: int = 64) -> list[Path]:
    """The folders holding a corpus's audio, read from its listing (paths only, nothing opened):
    what an embedded run lets its own workers read. More than `limit` folders become their common
    ancestor, unless that is `/` or a top-level folder such as /home."""
    source = Path(source)
    folders: set[str] = set()
    if source.is_dir() and not (source / KALDI_WAV_SCP).is_file():
        return [source.absolute()]
    for path in _listed_paths(source):
        folders.add(os.path.dirname(path))
        if len(folders) > limit:
            common = os.path.commonpath(sorted(folders))
            if len(Path(common).parts) > 2:
                folders = {common}
    minimal: list[Path] = []
    for folder in sorted(Path(f) for f in folders):
        if not any(folder == m or m in folder.parents for m in minimal):
            minimal.append(folder)
    return minimal


def _listed_paths(source: Path) -> Iterator[str]:
    """The audio paths a listing names, parsed no further than that (a wav.scp line is split once)."""
    wav_scp = source / KALDI_WAV_SCP if source.is_dir() else source
    if wav_scp.name != KALDI_WAV_SCP:
        yield from (utt.path for utt in CorpusListing(source))
        return
    base = str(wav_scp.parent.absolute())
    with open(wav_scp, "rb") as stream:
        for raw in stream:
            parts = raw.split(None, 1)
            if len(parts) == 2:
                yield _absolute(base, parts[1].strip().decode("utf-8", "replace"))
