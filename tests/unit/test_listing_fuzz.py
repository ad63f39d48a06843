"""Random and mutated listing lines, seeded: reading and planning a listing either gives
well-formed utterances or the listing's clear error (`CorpusError`, a `RunError` from the
planner), never another exception, never a hang; and the quick pass before a run
(`pipeline.corpus.check`) never vouches for a listing the reader refuses.

Every format the corpus readers take a line at a time is fuzzed: Kaldi `wav.scp`, `utt2spk`,
`text`, `utt2dur`, `segments` (with `reco2dur`), JSONL manifests and lhotse `cuts.jsonl`. Each
case starts from a well-formed listing and mutates one to three of its lines: random bytes,
invalid UTF-8, NUL bytes, a field far over `max_text_chars`, a field dropped, a JSON value of the
wrong type (or nested too deep, or a number of too many digits), an id listed twice, a line cut
short. A failure names its case number and shows the files, so it can be replayed alone.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.corpus import kaldi, lhotse, manifest, reading, roots, tars
from pipeline.corpus.check import check_listing, looks_clean
from pipeline.corpus.listing import CorpusError, CorpusListing
from pipeline.errors import RunError
from pipeline.outputs.folder import RunFolder
from pipeline.records import Utterance
from pipeline.run.plan import Planner, PlanReader
from pipeline.settings import Settings

SEED = 20261204
CASES_PER_FORMAT = 50
LIMIT = 48  # max_text_chars for the cases: a "very long" field stays cheap to write
PLANNED_EVERY = 3  # every third case is also planned (a plan writes parquet: the slow part)
WEIRD_BYTES = b'\x00\xff\xfe\xc3\xa9\xed\xa0\x80\r\t \x0b\x0c\x1c\x85|{}[]":,\\/.-_aZ09\xe2\x80\xa8'
JSON_VALUES: list[Any] = [None, True, 0, -1, 1.5, 1e308, [], {}, [1], {"a": 1}, "", " ", "x"]
JSON_LITERALS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "9" * 5000,
    "[" * 3000 + "]" * 3000,
    '"\\ud800"',
    '"a\\u0000b"',
]


# --------------------------------------------------------------------------- mutations


def _random_bytes(rng: random.Random) -> bytes:
    return bytes(rng.choice(WEIRD_BYTES) for _ in range(rng.randint(0, 40)))


def _long(rng: random.Random) -> str:
    return "L" * rng.randint(LIMIT + 1, LIMIT * 4)


def _mutate_words(line: bytes, rng: random.Random, ids: list[bytes]) -> bytes:
    """One mutation of a whitespace-separated line (Kaldi files)."""
    words = line.split(b" ")
    kind = rng.randrange(9)
    if kind == 0:
        return _random_bytes(rng)
    if kind == 1:  # invalid UTF-8 or a NUL inside a word
        at = rng.randrange(len(words))
        words[at] = words[at][:1] + rng.choice([b"\xff", b"\x00", b"\xed\xa0\x80", b"\xc3"]) + words[at][1:]
    elif kind == 2:  # a field far too long
        words[rng.randrange(len(words))] = _long(rng).encode()
    elif kind == 3 and len(words) > 1:  # a field dropped
        del words[rng.randrange(len(words))]
    elif kind == 4:  # an id listed twice
        words[0] = rng.choice(ids)
    elif kind == 5:  # cut short
        return line[: rng.randrange(len(line) + 1)]
    elif kind == 6:  # a word too many, or a pipe
        words.append(rng.choice([b"extra", b"|", b"sox - |"]))
    elif kind == 7:  # odd numbers
        words[-1] = rng.choice([b"nan", b"inf", b"-1", b"1e999", b"0x10", b"1_0", b"", b"-0"])
    else:  # odd whitespace
        return rng.choice([b"\t", b"  ", b"\r", b"\x0b", b"\xc2\x85"]).join(words)
    return b" ".join(words)


def _mutate_json(data: Any, rng: random.Random, ids: list[str]) -> str:
    """One mutation of a JSON line (manifests, cuts): its text."""
    kind = rng.randrange(8)
    if kind == 0:
        return _random_bytes(rng).decode("utf-8", "replace")
    if kind == 1:  # a literal of its own
        return rng.choice(JSON_LITERALS + ["[1, 2]", '"utt"', "null", "{"])
    target = _some_object(data, rng)
    keys = list(target) or ["utt"]
    key = rng.choice(keys)
    if kind == 2:  # a field of the wrong type
        target[key] = rng.choice(JSON_VALUES)
    elif kind == 3:  # a field dropped
        target.pop(key, None)
    elif kind == 4:  # a field far too long, or with a NUL
        target[key] = rng.choice([_long(rng), "a\x00b", "\ud800x"])
    elif kind == 5:  # an id listed twice
        target["id" if "id" in target else "utt"] = rng.choice(ids)
    elif kind == 6:  # a literal inside
        text = json.dumps(data)
        return (
            text.replace(json.dumps(target.get(key)), rng.choice(JSON_LITERALS), 1) if key in target else text
        )
    else:  # cut short
        text = json.dumps(data)
        return text[: rng.randrange(len(text) + 1)]
    return json.dumps(data, ensure_ascii=rng.random() < 0.5, allow_nan=True)


def _some_object(data: Any, rng: random.Random) -> dict[str, Any]:
    """A dict somewhere inside `data` (the line itself, a recording, a source, a supervision)."""
    found = [data]
    stack = [data]
    while stack:
        value = stack.pop()
        children = (
            list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
        )
        for child in children:
            if isinstance(child, dict):
                found.append(child)
            if isinstance(child, (dict, list)):
                stack.append(child)
    chosen = rng.choice(found)
    return chosen if isinstance(chosen, dict) else {}


def _mutated(lines: list[bytes], rng: random.Random, mutate: Callable[[bytes], bytes]) -> bytes:
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(lines) + 1)
        if at == len(lines) or rng.random() < 0.2:
            lines.insert(at, mutate(rng.choice(lines)))
        else:
            lines[at] = mutate(lines[at])
    ending = rng.choice([b"\n", b"\r\n"])
    head = b"\xef\xbb\xbf" if rng.random() < 0.1 else b""
    return head + ending.join(lines) + (ending if rng.random() < 0.8 else b"")


# --------------------------------------------------------------------------- the formats


def _utts(n: int) -> list[str]:
    return [f"u{i:02d}" for i in range(n)]


def _kaldi_case(folder: Path, rng: random.Random, target: str) -> Path:
    """A Kaldi dir whose `target` file (wav.scp, utt2spk, text or utt2dur) is mutated."""
    utts = _utts(rng.randint(1, 6))
    files = {
        "wav.scp": [f"{u} /data/spk{i % 2}/{u}.wav".encode() for i, u in enumerate(utts)],
        "utt2spk": [f"{u} spk{i % 2}".encode() for i, u in enumerate(utts)],
        "text": [f"{u} some words {i}".encode() for i, u in enumerate(utts)],
        "utt2dur": [f"{u} {1 + i / 4}".encode() for i, u in enumerate(utts)],
    }
    if rng.random() < 0.3:
        rng.shuffle(files["utt2spk"])
    ids = [u.encode() for u in utts]
    folder.mkdir(parents=True)
    for name, lines in files.items():
        if name == target:
            data = _mutated(lines, rng, lambda line: _mutate_words(line, rng, ids))
        elif name != "wav.scp" and rng.random() < 0.5:
            continue
        else:
            data = b"\n".join(lines) + b"\n"
        (folder / name).write_bytes(data)
    return folder


def _segments_case(folder: Path, rng: random.Random) -> Path:
    """A Kaldi dir with segments (and reco2dur), one of those or wav.scp mutated."""
    recs = ["r1", "r2"]
    utts = _utts(rng.randint(1, 6))
    files = {
        "wav.scp": [f"{r} /data/{r}.wav".encode() for r in recs],
        "segments": [
            f"{u} {recs[i % 2]} {i} {-1 if i == 2 else i + 0.5}".encode() for i, u in enumerate(utts)
        ],
        "reco2dur": [f"{r} 30.0".encode() for r in recs],
    }
    target = rng.choice(list(files))
    ids = [u.encode() for u in utts] + [r.encode() for r in recs]
    folder.mkdir(parents=True)
    for name, lines in files.items():
        mutated = name == target
        data = _mutated(lines, rng, lambda line: _mutate_words(line, rng, ids)) if mutated else None
        (folder / name).write_bytes(data if data is not None else b"\n".join(lines) + b"\n")
    return folder


def _manifest_case(folder: Path, rng: random.Random) -> Path:
    utts = _utts(rng.randint(1, 6))
    objects = [
        {"utt": u, "path": f"spk{i % 2}/{u}.wav", "spk": f"spk{i % 2}", "text": "hi", "duration": 1.5}
        for i, u in enumerate(utts)
    ]
    return _jsonl_case(folder / "manifest.jsonl", objects, utts, rng)


def _cuts_case(folder: Path, rng: random.Random) -> Path:
    utts = _utts(rng.randint(1, 4))
    objects = []
    for i, u in enumerate(utts):
        recording = {
            "id": f"rec{i}",
            "sources": [{"type": "file", "channels": [0, 1], "source": f"/data/rec{i}.flac"}],
            "sampling_rate": 16000,
            "duration": 10.0,
        }
        sups = [
            {
                "id": f"{u}-s{j}",
                "recording_id": f"rec{i}",
                "start": j,
                "duration": 1.0,
                "channel": j % 2,
                "speaker": "s",
                "text": "t",
            }
            for j in range(rng.randint(0, 2))
        ]
        objects.append(
            {
                "id": u,
                "start": 0.5,
                "duration": 5.0,
                "channel": 0,
                "recording": recording,
                "supervisions": sups,
                "type": "MonoCut",
            }
        )
    return _jsonl_case(folder / "cuts.jsonl", objects, utts, rng)


def _jsonl_case(path: Path, objects: list[dict[str, Any]], ids: list[str], rng: random.Random) -> Path:
    lines = [json.dumps(o).encode() for o in objects]

    def mutate(line: bytes) -> bytes:
        try:
            data = json.loads(line)
        except ValueError:
            return _mutate_words(line, rng, [i.encode() for i in ids])
        return _mutate_json(data, rng, ids).encode("utf-8", "surrogatepass")

    path.parent.mkdir(parents=True)
    path.write_bytes(_mutated(lines, rng, mutate))
    return path


FORMATS: dict[str, Callable[[Path, random.Random], Path]] = {
    "wav.scp": lambda folder, rng: _kaldi_case(folder, rng, "wav.scp"),
    "utt2spk": lambda folder, rng: _kaldi_case(folder, rng, "utt2spk"),
    "text": lambda folder, rng: _kaldi_case(folder, rng, "text"),
    "utt2dur": lambda folder, rng: _kaldi_case(folder, rng, "utt2dur"),
    "segments": _segments_case,
    "manifest": _manifest_case,
    "cuts": _cuts_case,
}


# --------------------------------------------------------------------------- the checks


def _well_formed(utt: Utterance) -> str | None:
    """What is wrong with an utterance a listing gave, or None."""
    for name in ("utt", "path", "spk", "text"):
        value = getattr(utt, name)
        if not isinstance(value, str):
            return f"{name} is {type(value).__name__}"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name} is not valid Unicode"
    if not utt.utt.strip() or not utt.path.strip():
        return "an empty utt or path"
    if len(utt.utt) > LIMIT or len(utt.spk) > LIMIT or "\x00" in utt.utt + utt.path + utt.spk:
        return "a name over the limit or with a NUL byte"
    for name in ("duration_s", "start_s", "end_s"):
        value = getattr(utt, name)
        if value is not None and not (isinstance(value, float) and math.isfinite(value) and value >= 0):
            return f"{name} is {value!r}"
    if utt.end_s is not None and utt.end_s <= (utt.start_s or 0.0):
        return "a segment that ends before it starts"
    if utt.channel is not None and not (isinstance(utt.channel, int) and utt.channel >= 0):
        return f"channel is {utt.channel!r}"
    return None


def _show(source: Path) -> str:
    files = sorted(source.iterdir()) if source.is_dir() else [source]
    return "\n".join(f"--- {f.name}\n{f.read_bytes()!r}" for f in files)


@pytest.mark.timeout(120)
def test_random_listing_lines_give_utterances_or_the_listings_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    too_long: list[str] = []
    absolute = reading.absolute

    def checked_absolute(base: Path | str, path: str) -> str:
        if len(path) > LIMIT or "\x00" in path:  # a path call must never see what the limit refuses
            too_long.append(path)
        return absolute(base, path)

    for reader in (kaldi, lhotse, manifest, roots, tars):  # every module that makes a listed path absolute
        monkeypatch.setattr(reader, "absolute", checked_absolute)
    settings = Settings(max_text_chars=LIMIT, shard_size=2)
    rng = random.Random(SEED)
    seen = {"refused": 0, "read": 0, "vouched": 0}
    for name, make in FORMATS.items():
        for case in range(CASES_PER_FORMAT):
            where = f"{name} case {case} (seed {SEED})"
            source = make(tmp_path / name / str(case), rng)
            listing = CorpusListing(source, max_text_chars=LIMIT)
            try:
                utts = list(listing)
            except Exception as exc:  # noqa: BLE001 - the point: nothing but problems
                pytest.fail(f"{where}: reading raised {type(exc).__name__}: {exc}\n{_show(source)}")
            problems = listing.problems.items
            assert not too_long, f"{where}: a path call saw {too_long[0][:80]!r}\n{_show(source)}"
            if problems:
                seen["refused"] += 1
            else:
                seen["read"] += 1
                for utt in utts:
                    assert _well_formed(utt) is None, (
                        f"{where}: {_well_formed(utt)} in {utt}\n{_show(source)}"
                    )
                assert len({u.utt for u in utts}) == len(utts), f"{where}: an id twice\n{_show(source)}"
            vouched = looks_clean(source, LIMIT)
            seen["vouched"] += vouched
            assert not (vouched and problems), f"{where}: vouched for, yet {problems}\n{_show(source)}"
            try:
                check_listing(source, LIMIT)
                refused: list[str] = []
            except CorpusError as exc:
                refused = exc.problems
            assert refused == problems, f"{where}: the look before a run differs\n{_show(source)}"
            if case % PLANNED_EVERY == 0:
                _plan(source, tmp_path / "out" / name / str(case), settings, utts, problems, where)
    # The cases reach both ends, and the quick pass vouches for clean listings it can read.
    assert seen["refused"] >= 100 and seen["read"] >= 40 and seen["vouched"] >= 20, seen


def _plan(
    source: Path, out: Path, settings: Settings, utts: list[Utterance], problems: list[str], where: str
) -> None:
    planner = Planner(source, RunFolder.of(out), ["embed"], 0, settings, workers=2).start()
    planner.join()
    if problems:
        assert isinstance(planner.error, RunError), f"{where}: planned despite {problems}"
        assert planner.planned == 0, f"{where}: shards planned before the refusal"
        return
    assert planner.error is None, f"{where}: {planner.error}\n{_show(source)}"
    planned = [u for _, shard in PlanReader(RunFolder.of(out)).shards() for u in shard]
    assert planned == utts, where
