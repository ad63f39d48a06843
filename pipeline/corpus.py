"""Corpus readers and shard planning (pure: no queue, no decoding).

`read_corpus` accepts the three input kinds of `voxmill extract` (DESIGN.md, Contract):

- a Kaldi data dir (CosyVoice's layout): `wav.scp` ("utt path", split on the first whitespace so
  paths may hold spaces), optional `utt2spk` ("utt spk") and `text` ("utt words...");
- a JSONL manifest: one `{"utt", "path", "spk"?, "text"?}` object per line;
- any other folder: audio files found recursively; utt = path relative to the folder without its
  extension (posix separators), spk = name of the parent folder.

Relative audio paths are taken relative to the folder of the file that names them and made absolute
without resolving symlinks (workers check paths against the allowed roots themselves). A missing
audio file is not an error here: the worker reports `not_found` for that utterance. Every problem
found in the listing files is collected and raised together as one `CorpusError`, each as
"FILE line N: what is wrong". An utterance without speaker information is its own speaker (Kaldi's
convention), so speaker embeddings never pool unrelated clips.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import OPS, ShardSpec, Utterance
from pipeline.settings import AudioLimits

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".wma"})
KALDI_WAV_SCP = "wav.scp"
KALDI_UTT2SPK = "utt2spk"
KALDI_TEXT = "text"
MANIFEST_SUFFIX = ".jsonl"
MAX_LISTED_PROBLEMS = 20


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
    """Collects problems while reading; `raise_if_any` raises them as one `CorpusError`."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, file: Path, line: int | None, what: str) -> None:
        """Record one problem; `line` None for a problem of the whole file."""
        self.items.append(f"{file}: {what}" if line is None else f"{file} line {line}: {what}")

    def raise_if_any(self) -> None:
        """Raise every recorded problem at once."""
        if self.items:
            raise CorpusError(self.items)


# --------------------------------------------------------------------------- entry points


def read_corpus(source: Path) -> list[Utterance]:
    """Read a Kaldi data dir, a `.jsonl` manifest or a folder of audio into utterances, in file order."""
    source = Path(source)
    if source.is_dir():
        if (source / KALDI_WAV_SCP).is_file():
            return read_kaldi_dir(source)
        return read_audio_folder(source)
    if source.is_file() and source.name == KALDI_WAV_SCP:
        return read_kaldi_dir(source.parent)
    if source.is_file() and source.suffix.lower() == MANIFEST_SUFFIX:
        return read_manifest(source)
    if not source.exists():
        raise CorpusError([f"{source}: no such file or folder"])
    raise CorpusError(
        [f"{source}: not a Kaldi data dir (with wav.scp), a .jsonl manifest or a folder of audio files"]
    )


def probe_durations(utts: list[Utterance], limits: AudioLimits) -> list[Utterance]:
    """Fill `duration_s` from each file's header (nothing is decoded); None where probing fails.

    The audio code (numpy, libsndfile) is imported here, not with the module: reading a corpus
    needs none of it, and `voxmill extract` starts its workers between the two.
    """
    from pipeline.audio import probe_audio

    def duration(path: str) -> float | None:
        try:
            return probe_audio(path, limits).duration_s
        except VoxmillError:
            return None

    return [u.copy_with(duration_s=duration(u.path)) for u in utts]


def plan_shards(utts: list[Utterance], ops: Sequence[str], out_dir: str, shard_size: int) -> list[ShardSpec]:
    """Cut the corpus into shards of similar-length utterances, one `ShardSpec` per (shard, op).

    Utterances are sorted by `duration_s` (unknown last, ties in corpus order) and chunked by
    `shard_size`; shard k holds the same utterances for every op. Specs come shard by shard, in the
    order of `ops` within a shard.
    """
    _check_plan_args(ops, shard_size)
    order = sorted(range(len(utts)), key=lambda i: _duration_key(utts[i], i))
    ordered = [utts[i] for i in order]
    chunks = [ordered[start : start + shard_size] for start in range(0, len(ordered), shard_size)]
    return [
        ShardSpec(shard=shard, op=op, out_dir=out_dir, utts=list(chunk))
        for shard, chunk in enumerate(chunks)
        for op in ops
    ]


def auto_shard_size(n_utts: int, workers: int, largest: int, shards_per_worker: int = 6) -> int:
    """Utterances per shard: `largest`, or fewer so each worker process gets `shards_per_worker` shards.

    A run ends when its last shard does: with few large shards one process finishes while the
    others still work on theirs. A small corpus is therefore cut finer (60 clips over 2 processes:
    shards of 5 instead of 2 shards of 32); a large one keeps shards of `largest`.
    """
    wanted = -(-n_utts // max(1, workers * shards_per_worker))  # ceiling division
    return max(1, min(largest, wanted))


def plan_fingerprint(utts: list[Utterance], ops: Sequence[str], shard_size: int) -> str:
    """sha256 (hex) over the utterances (utt, path, spk, text), the ops and the shard size."""
    digest = hashlib.sha256()
    header = {"ops": list(ops), "shard_size": shard_size, "utterances": len(utts)}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for u in utts:
        digest.update(b"\n")
        digest.update(json.dumps([u.utt, u.path, u.spk, u.text], ensure_ascii=False).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- Kaldi data dir


def read_kaldi_dir(folder: Path) -> list[Utterance]:
    """Read `wav.scp` and, when present, `utt2spk` and `text` of a Kaldi data dir."""
    problems = _Problems()
    wav_scp = folder / KALDI_WAV_SCP
    paths = _read_wav_scp(wav_scp, problems)
    speakers = _read_utt_map(folder / KALDI_UTT2SPK, set(paths), problems, single_word=True)
    texts = _read_utt_map(folder / KALDI_TEXT, set(paths), problems, single_word=False)
    if not paths and not problems.items:
        problems.add(wav_scp, None, "lists no utterances")
    problems.raise_if_any()
    return [
        Utterance(utt=utt, path=path, spk=speakers.get(utt) or utt, text=texts.get(utt, ""))
        for utt, path in paths.items()
    ]


def _read_wav_scp(file: Path, problems: _Problems) -> dict[str, str]:
    """{utt: absolute path} in file order; reports short lines, pipes and duplicates."""
    paths: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line in _lines(file, problems):
        utt, rest = _split_first(line.text)
        if not rest:
            problems.add(file, line.number, f"expected 'utt path', got {line.text.strip()!r}")
        elif rest.endswith("|"):
            problems.add(file, line.number, f"piped commands are not supported ({rest!r}); list audio files")
        elif utt in paths:
            problems.add(file, line.number, f"duplicate utt {utt!r} (first on line {first_line[utt]})")
        else:
            paths[utt] = _absolute(file.parent, rest)
            first_line[utt] = line.number
    return paths


def _read_utt_map(file: Path, known: set[str], problems: _Problems, *, single_word: bool) -> dict[str, str]:
    """{utt: value} of `utt2spk` (one word) or `text` (the rest of the line); {} if the file is absent."""
    values: dict[str, str] = {}
    if not file.exists():
        return values
    first_line: dict[str, int] = {}
    for line in _lines(file, problems):
        utt, rest = _split_first(line.text)
        if single_word and (not rest or len(rest.split()) != 1):
            problems.add(file, line.number, f"expected 'utt spk', got {line.text.strip()!r}")
        elif utt not in known:
            problems.add(file, line.number, f"utt {utt!r} is not in {KALDI_WAV_SCP}")
        elif utt in values:
            problems.add(file, line.number, f"duplicate utt {utt!r} (first on line {first_line[utt]})")
        else:
            values[utt] = rest
            first_line[utt] = line.number
    return values


def _split_first(text: str) -> tuple[str, str]:
    """Split a line at its first run of whitespace: ('utt', 'rest stripped')."""
    parts = text.strip().split(maxsplit=1)
    if len(parts) < 2:
        return (parts[0] if parts else ""), ""
    return parts[0], parts[1].strip()


# --------------------------------------------------------------------------- JSONL manifest


def read_manifest(file: Path) -> list[Utterance]:
    """Read a JSONL manifest of `{"utt", "path", "spk"?, "text"?}` objects, one per line."""
    problems = _Problems()
    utts: list[Utterance] = []
    first_line: dict[str, int] = {}
    for line in _lines(file, problems):
        utt = _manifest_entry(file, line, problems)
        if utt is None:
            continue
        if utt.utt in first_line:
            first = first_line[utt.utt]
            problems.add(file, line.number, f"duplicate utt {utt.utt!r} (first on line {first})")
            continue
        first_line[utt.utt] = line.number
        utts.append(utt)
    if not utts and not problems.items:
        problems.add(file, None, "lists no utterances")
    problems.raise_if_any()
    return utts


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
    return Utterance(
        utt=utt,
        path=_absolute(file.parent, data["path"]),
        spk=data.get("spk") or utt,
        text=data.get("text") or "",
    )


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


def read_audio_folder(folder: Path) -> list[Utterance]:
    """Every audio file below `folder` (hidden files and folders skipped), sorted by relative path."""
    problems = _Problems()
    base = folder.absolute()
    utts: list[Utterance] = []
    seen: dict[str, str] = {}
    for rel in sorted(_audio_files(base)):
        utt = rel.rsplit(".", 1)[0]
        if utt in seen:
            problems.add(folder, None, f"duplicate utt {utt!r} from {seen[utt]!r} and {rel!r}")
            continue
        seen[utt] = rel
        parent = rel.rsplit("/", 2)[-2] if "/" in rel else base.name
        utts.append(Utterance(utt=utt, path=str(base / rel), spk=parent))
    if not utts and not problems.items:
        problems.add(folder, None, f"holds no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})")
    problems.raise_if_any()
    return utts


def _audio_files(base: Path) -> Iterator[str]:
    """Posix paths, relative to `base`, of the audio files below it."""
    for root, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel_root = Path(root).relative_to(base)
        for name in files:
            if not name.startswith(".") and Path(name).suffix.lower() in AUDIO_EXTENSIONS:
                yield (rel_root / name).as_posix()


# --------------------------------------------------------------------------- helpers


def _lines(file: Path, problems: _Problems) -> Iterator[_Line]:
    """Non-blank lines of a UTF-8 text file; an unreadable file or line is reported, not raised."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        problems.add(file, None, f"cannot be read ({exc.strerror or exc})")
        return
    for number, chunk in enumerate(raw.splitlines(), start=1):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError:
            problems.add(file, number, "is not valid UTF-8")
            continue
        if number == 1:
            text = text.removeprefix("\ufeff")
        if text.strip():
            yield _Line(number, text)


def _absolute(base: Path, path: str) -> str:
    """`path` made absolute relative to `base` (symlinks and '..' are kept as written)."""
    candidate = Path(path)
    if candidate.is_absolute():
        return str(candidate)
    return str(base.absolute() / candidate)


def _duration_key(utt: Utterance, index: int) -> tuple[int, float, int]:
    """Sort key: known durations ascending, unknown last, corpus order within ties."""
    if utt.duration_s is None:
        return (1, 0.0, index)
    return (0, utt.duration_s, index)


def _check_plan_args(ops: Sequence[str], shard_size: int) -> None:
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
