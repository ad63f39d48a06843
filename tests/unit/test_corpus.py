"""Corpus listings (Kaldi dir, JSONL manifest, folder) read as streams, and shard cutting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.corpus import kaldi
from pipeline.corpus.listing import CorpusError, CorpusListing, read_corpus
from pipeline.corpus.sharding import ShardCutter, check_ops, shard_digest
from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import Utterance


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _problems(source: Path) -> list[str]:
    with pytest.raises(CorpusError) as caught:
        read_corpus(source)
    assert caught.value.code == BAD_REQUEST
    assert isinstance(caught.value, VoxmillError)
    return caught.value.problems


# --------------------------------------------------------------------------- Kaldi data dir


def test_kaldi_dir_with_utt2spk_and_text(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _write(data / "wav.scp", "u2 /abs/b.wav\nu1 /abs/a.flac\n")
    _write(data / "utt2spk", "u1 alice\nu2 bob\n")
    _write(data / "text", "u2 hello   big world \nu1 hi\n")
    utts = read_corpus(data)
    assert utts == [
        Utterance(utt="u2", path="/abs/b.wav", spk="bob", text="hello   big world"),
        Utterance(utt="u1", path="/abs/a.flac", spk="alice", text="hi"),
    ]


def test_kaldi_dir_without_utt2spk_or_text_makes_each_utt_its_own_speaker(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\n\n   \nb /x/b.wav\n")
    utts = read_corpus(tmp_path)
    assert [(u.utt, u.spk, u.text) for u in utts] == [("a", "a", ""), ("b", "b", "")]


def test_kaldi_relative_paths_and_spaces_are_resolved_against_the_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _write(data / "wav.scp", "a ../audio/my clip.wav\nb\tsub dir/x y.wav  \nc /abs/with space.wav\n")
    utts = read_corpus(data)
    assert [u.path for u in utts] == [
        str(data.absolute() / "../audio/my clip.wav"),
        str(data.absolute() / "sub dir/x y.wav"),
        "/abs/with space.wav",
    ]
    assert all(Path(u.path).is_absolute() for u in utts)


def test_kaldi_dir_given_as_its_wav_scp(tmp_path: Path) -> None:
    scp = _write(tmp_path / "wav.scp", "a /x/a.wav\n")
    assert [u.utt for u in read_corpus(scp)] == ["a"]


def test_kaldi_missing_audio_is_not_an_error_here(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a does/not/exist.wav\n")
    assert read_corpus(tmp_path)[0].path == str(tmp_path / "does/not/exist.wav")


def test_kaldi_pipes_are_refused_with_their_line_number(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\nb sox /x/b.wav -t wav - |\n")
    problems = _problems(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith(f"{tmp_path / 'wav.scp'} line 2: piped commands are not supported")


def test_kaldi_malformed_lines_duplicates_and_unknown_utts_are_all_reported(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\nlonely\na /x/other.wav\nb /x/b.wav\n")
    _write(tmp_path / "utt2spk", "a s1\nzz s2\nb\nb s1 extra\n")
    _write(tmp_path / "text", "a hello\na again\nghost words\n")
    problems = _problems(tmp_path)
    scp, u2s, text = (str(tmp_path / n) for n in ("wav.scp", "utt2spk", "text"))
    assert problems == [
        f"{scp} line 2: expected 'utt path', got 'lonely'",
        f"{scp} line 3: duplicate utt 'a' (first on line 1)",
        f"{u2s} line 2: utt 'zz' is not in wav.scp",
        f"{u2s} line 3: expected 'utt spk', got 'b'",
        f"{u2s} line 4: expected 'utt spk', got 'b s1 extra'",
        f"{text} line 2: duplicate utt 'a' (first on line 1)",
        f"{text} line 3: utt 'ghost' is not in wav.scp",
    ]


def test_corpus_error_lists_twenty_problems_then_counts_the_rest(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "".join(f"u{i}\n" for i in range(25)))
    with pytest.raises(CorpusError) as caught:
        read_corpus(tmp_path)
    message = caught.value.message
    assert "line 20: expected 'utt path'" in message
    assert "line 21:" not in message
    assert message.rstrip().endswith("... and 5 more")
    assert len(caught.value.problems) == 25


def test_invalid_utf8_line_is_reported(tmp_path: Path) -> None:
    (tmp_path / "wav.scp").write_bytes(b"a /x/a.wav\nb /x/\xff.wav\n")
    assert _problems(tmp_path) == [f"{tmp_path / 'wav.scp'} line 2: is not valid UTF-8"]


def test_empty_wav_scp_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "\n\n")
    assert _problems(tmp_path) == [f"{tmp_path / 'wav.scp'}: lists no utterances"]


# --------------------------------------------------------------------------- JSONL manifest


def test_jsonl_manifest(tmp_path: Path) -> None:
    lines = [
        {"utt": "a", "path": "clips/a.wav", "spk": "s1", "text": "hi"},
        {"utt": "b", "path": "/abs/b.mp3", "extra": 1},
        {"utt": "c", "path": "c d.wav", "spk": None, "text": None},
    ]
    manifest = _write(tmp_path / "m" / "list.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    utts = read_corpus(manifest)
    assert utts == [
        Utterance("a", str(tmp_path.absolute() / "m/clips/a.wav"), "s1", "hi"),
        Utterance("b", "/abs/b.mp3", "b", ""),
        Utterance("c", str(tmp_path.absolute() / "m/c d.wav"), "c", ""),
    ]


def test_jsonl_errors_carry_line_numbers(tmp_path: Path) -> None:
    manifest = _write(
        tmp_path / "bad.JSONL",
        "\n".join(
            [
                '{"utt": "a", "path": "/a.wav"}',
                "{not json",
                "[1, 2]",
                '{"path": "/x.wav"}',
                '{"utt": 3, "path": ""}',
                '{"utt": "a", "path": "/again.wav"}',
                '{"utt": "d", "path": "/d.wav", "spk": 7}',
            ]
        ),
    )
    problems = _problems(manifest)
    assert [p.split(": ", 1)[0] for p in problems] == [f"{manifest} line {n}" for n in (2, 3, 4, 5, 6, 7)]
    assert "not valid JSON" in problems[0]
    assert "expected a JSON object, got list" in problems[1]
    assert "missing field 'utt'" in problems[2]
    assert "field 'utt' must be a non-empty string, got 3" in problems[3]
    assert "field 'path' must be a non-empty string" in problems[3]
    assert "duplicate utt 'a' (first on line 1)" in problems[4]
    assert "field 'spk' must be a string, got 7" in problems[5]


# --------------------------------------------------------------------------- folder of audio


def test_folder_recursive_with_speaker_from_parent(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    for rel in (
        "alice/one.wav",
        "alice/sub/two.FLAC",
        "bob/three.mp3",
        "top.ogg",
        "bob/notes.txt",
        ".hidden/x.wav",
        "bob/._resource.wav",
        "carol/four.opus",
    ):
        _write(root / rel, "x")
    utts = read_corpus(root)
    assert [(u.utt, u.spk) for u in utts] == [
        ("alice/one", "alice"),
        ("alice/sub/two", "sub"),
        ("bob/three", "bob"),
        ("carol/four", "carol"),
        ("top", "corpus"),
    ]
    assert utts[1].path == str(root.absolute() / "alice/sub/two.FLAC")


def test_folder_duplicate_utt_from_two_extensions(tmp_path: Path) -> None:
    _write(tmp_path / "s" / "a.wav", "x")
    _write(tmp_path / "s" / "a.flac", "x")
    problems = _problems(tmp_path)
    assert len(problems) == 1 and "duplicate utt 's/a'" in problems[0]


def test_folder_without_audio_and_missing_source(tmp_path: Path) -> None:
    _write(tmp_path / "notes.txt", "x")
    assert "holds no audio files" in _problems(tmp_path)[0]
    assert "no such file or folder" in _problems(tmp_path / "nope")[0]
    assert "not a Kaldi data dir" in _problems(tmp_path / "notes.txt")[0]


# --------------------------------------------------------------------------- durations


def test_kaldi_utt2dur_and_manifest_durations_are_taken_from_the_listing(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\nb /x/b.wav\n")
    _write(tmp_path / "utt2dur", "a 1.5\n")
    listing = CorpusListing(tmp_path)
    assert [u.duration_s for u in listing] == [1.5, None] and listing.durations_listed
    manifest = _write(tmp_path / "m.jsonl", '{"utt": "a", "path": "/a.wav", "duration": 2.25}\n')
    assert [u.duration_s for u in read_corpus(manifest)] == [2.25]


def test_listing_opens_no_audio(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /nonexistent/a.wav\n")
    assert read_corpus(tmp_path)[0].duration_s is None  # nothing probed: no header was read


# --------------------------------------------------------------------------- streaming


def test_sorted_side_files_are_joined_holding_nothing_aside(tmp_path: Path) -> None:
    count = 2000
    _write(tmp_path / "wav.scp", "".join(f"u{i:05d} /x/{i}.wav\n" for i in range(count)))
    _write(tmp_path / "utt2spk", "".join(f"u{i:05d} s{i % 7}\n" for i in range(0, count, 2)))
    listing = CorpusListing(tmp_path)
    held = 0
    for utt in listing:
        sides = [g for g in vars(listing).values()]  # the listing's state while it streams
        held = max(held, len(sides))
        assert utt.spk == (f"s{int(utt.utt[1:]) % 7}" if int(utt.utt[1:]) % 2 == 0 else utt.utt)
    listing.raise_problems()
    assert listing.count == count


def test_side_files_in_the_listings_order_are_not_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first utterance comes without reading any side file in whole (whether it is sorted is
    asked only when a side file lacks an utt or lists it out of order)."""
    count = 500
    _write(tmp_path / "wav.scp", "".join(f"u{i:05d} /x/{i}.wav\n" for i in range(count)))
    _write(tmp_path / "utt2spk", "".join(f"u{i:05d} s{i % 7}\n" for i in range(count)))
    _write(tmp_path / "utt2dur", "".join(f"u{i:05d} 1.5\n" for i in range(count)))
    asked: list[Path] = []
    keys_sorted = kaldi._keys_sorted
    monkeypatch.setattr(kaldi, "_keys_sorted", lambda file: asked.append(file) or keys_sorted(file))
    utts = list(CorpusListing(tmp_path))
    assert len(utts) == count and utts[3].spk == "s3" and utts[3].duration_s == 1.5
    assert asked == []
    _write(tmp_path / "utt2spk", "".join(f"u{i:05d} s{i % 7}\n" for i in range(0, count, 2)))
    assert [u.spk for u in CorpusListing(tmp_path)][:3] == ["s0", "u00001", "s2"]
    assert asked == [tmp_path / "utt2spk"]  # asked once, at the first utt the file lacks


def test_unsorted_side_files_still_join(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "c /x/c.wav\na /x/a.wav\nb /x/b.wav\n")
    _write(tmp_path / "utt2spk", "b sb\nc sc\na sa\n")
    assert [(u.utt, u.spk) for u in read_corpus(tmp_path)] == [("c", "sc"), ("a", "sa"), ("b", "sb")]


def test_a_listing_problem_is_raised_after_the_stream(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\nb /x/b.wav\na /x/c.wav\n")
    listing = CorpusListing(tmp_path)
    assert [u.utt for u in listing] == ["a", "b", "a"]  # streamed on...
    with pytest.raises(CorpusError, match="line 3: duplicate utt 'a' \\(first on line 1\\)"):
        listing.raise_problems()  # ...and refused once the whole listing was read


# --------------------------------------------------------------------------- planning


def _utts(count: int) -> list[Utterance]:
    return [Utterance(f"u{i}", f"/d/u{i}.wav") for i in range(count)]


def test_shards_are_cut_in_listing_order_by_count() -> None:
    cutter = ShardCutter(shard_size=3)
    shards = [cut for u in _utts(7) if (cut := cutter.add(u)) is not None]
    shards.append(cutter.rest() or [])
    assert [[u.utt for u in s] for s in shards] == [["u0", "u1", "u2"], ["u3", "u4", "u5"], ["u6"]]
    assert cutter.next_shard == 3 and cutter.rest() is None


@pytest.mark.parametrize(
    ("ops", "size"), [(["tokenize"], 0), ([], 4), (["nope"], 4), (["embed", "embed"], 4)]
)
def test_plan_refuses_bad_arguments(ops: list[str], size: int) -> None:
    with pytest.raises(VoxmillError) as caught:
        check_ops(ops, size)
    assert caught.value.code == BAD_REQUEST


def test_shard_digest_is_stable_and_changes_with_input() -> None:
    utts = _utts(2)
    base = shard_digest(utts)
    assert base == shard_digest(_utts(2)) and len(base) == 64
    assert base == shard_digest([u.copy_with(duration_s=7.0) for u in utts])  # durations do not count
    changed = [
        shard_digest(utts[:1]),
        shard_digest([utts[0].copy_with(path="/other.wav"), utts[1]]),
        shard_digest([utts[0].copy_with(spk="s"), utts[1]]),
        shard_digest([utts[0].copy_with(text="t"), utts[1]]),
        shard_digest(utts[::-1]),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
