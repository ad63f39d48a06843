"""The look at a whole listing before a run plans it: the quick pass vouches only for what the
reader would accept, and a refusal carries the reader's own problems."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pipeline.corpus.check import check_listing, looks_clean
from pipeline.corpus.listing import CorpusError, read_corpus

LIMIT = 4096


def _kaldi(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def _scp(n: int) -> str:
    return "".join(f"u{i:03d} /a/spk{i % 3}/u{i}.wav\n" for i in range(n))


def _problems(source: Path) -> list[str]:
    with pytest.raises(CorpusError) as caught:
        read_corpus(source)
    return caught.value.problems


def test_well_formed_listings_of_every_kind_with_a_quick_pass_are_vouched_for(tmp_path: Path) -> None:
    unsorted_spk = "".join(f"u{i:03d} spk{i % 3}\n" for i in reversed(range(20)))
    kaldi = _kaldi(
        tmp_path / "kaldi",
        {
            "wav.scp": "\ufeff" + _scp(20).replace("\n", "\r\n", 3) + "\n   \n",
            "utt2spk": unsorted_spk,
            "text": "u001 hello  there\nu002\n",
            "utt2dur": "u000 1.5\nu003 -1\n",
        },
    )
    segments = _kaldi(
        tmp_path / "segments",
        {
            "wav.scp": "r1 /a/r 1.wav\nr2 /a/r2.flac\n",
            "segments": "s1 r1 0 1.5\ns2 r1 1.5 -1\ns3 r2 0.25 3\n",
            "reco2dur": "r1 12.5\n",
            "utt2spk": "s1 a\ns3 b\n",
        },
    )
    manifest = tmp_path / "m.jsonl.gz"
    with gzip.open(manifest, "wt", encoding="utf-8") as stream:
        for i in range(30):
            stream.write(json.dumps({"utt": f"u{i}", "path": f"a/{i}.wav", "spk": "s", "duration": 1}) + "\n")
        stream.write("\n")
    for source in (kaldi, kaldi / "wav.scp", segments, manifest):
        assert looks_clean(source, LIMIT), source
        check_listing(source, LIMIT)  # nothing raised
        assert read_corpus(source)  # and the reader agrees


@pytest.mark.parametrize(
    ("files", "what"),
    [
        ({"wav.scp": _scp(5) + "u002 /a/again.wav\n"}, "duplicate utt 'u002' (first on line 3)"),
        ({"wav.scp": _scp(5) + "lonely\n"}, "expected 'utt path'"),
        ({"wav.scp": _scp(5) + "p sox x.wav -t wav - |\n"}, "piped commands are not supported"),
        ({"wav.scp": _scp(5) + f"{'u' * 5000} /a/x.wav\n"}, "utt is 5000 characters long"),
        ({"wav.scp": _scp(5) + "nul /a/x\x00.wav\n"}, "path holds a NUL byte"),
        ({"wav.scp": _scp(5), "utt2spk": "u001 a\nu009 b\n"}, "utt 'u009' is not in wav.scp"),
        ({"wav.scp": _scp(5), "utt2spk": "u001 a\nu002 b\nu001 c\n"}, "duplicate utt 'u001'"),
        ({"wav.scp": _scp(5), "utt2spk": f"u001 {'s' * 5000}\n"}, "speaker is 5000 characters long"),
        ({"wav.scp": _scp(5), "utt2dur": "u001 soon\n"}, "duration 'soon' is not a number of seconds"),
        ({"wav.scp": _scp(5), "utt2dur": "u001 inf\n"}, "duration 'inf' is not a number of seconds"),
        ({"wav.scp": _scp(5), "text": "u001 hi\nzzz hi\n"}, "utt 'zzz' is not in wav.scp"),
        ({"wav.scp": "\n \n"}, "lists no utterances"),
    ],
)
def test_any_problem_of_a_kaldi_dir_is_the_readers_refusal(
    tmp_path: Path, files: dict[str, str], what: str
) -> None:
    data = _kaldi(tmp_path / "data", files)
    assert not looks_clean(data, LIMIT)
    with pytest.raises(CorpusError) as caught:
        check_listing(data, LIMIT)
    assert caught.value.problems == _problems(data)
    assert any(what in problem for problem in caught.value.problems), caught.value.problems


def test_invalid_utf8_anywhere_is_the_readers_refusal(tmp_path: Path) -> None:
    data = _kaldi(tmp_path / "data", {"wav.scp": _scp(5)})
    (data / "utt2spk").write_bytes(b"u001 a\nu002 \xff\n")
    assert not looks_clean(data, LIMIT)
    with pytest.raises(CorpusError, match="utt2spk line 2: is not valid UTF-8"):
        check_listing(data, LIMIT)


@pytest.mark.parametrize(
    ("files", "what"),
    [
        ({"segments": "s1 r1 0 1\ns1 r1 1 2\n"}, "duplicate utt 's1' (first on line 1)"),
        ({"segments": "s1 r9 0 1\n"}, "recording 'r9' is not in wav.scp"),
        ({"segments": "s1 r1 2 1\n"}, "ends (1 s) before it starts (2 s)"),
        ({"segments": "s1 r1 0 nan\n"}, "start and end must be seconds"),
        ({"segments": "s1 r1 0 1\n", "reco2dur": "r1 long\n"}, "expected 'recording seconds'"),
        ({"segments": "s1 r1 0 1\n", "utt2spk": "s2 x\n"}, "utt 's2' is not in wav.scp"),
    ],
)
def test_any_problem_of_a_segments_dir_is_the_readers_refusal(
    tmp_path: Path, files: dict[str, str], what: str
) -> None:
    data = _kaldi(tmp_path / "data", {"wav.scp": "r1 /a/r1.wav\n", **files})
    assert not looks_clean(data, LIMIT)
    with pytest.raises(CorpusError) as caught:
        check_listing(data, LIMIT)
    assert caught.value.problems == _problems(data)
    assert any(what in problem for problem in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('{"utt": "u1", "path": "b.wav"}', "duplicate utt 'u1' (first on line 1)"),
        ('{"utt": "u2", "path": 3}', "field 'path' must be a non-empty string, got 3"),
        ('{"utt": "u2", "path": "x", "spk": ["a"]}', "field 'spk' must be a string"),
        ('{"utt": "\\ud800", "path": "x"}', "field 'utt' is not valid Unicode"),
        ('{"utt": "u2", "path": "x", "text": "\\udfff"}', "field 'text' is not valid Unicode"),
        ('{"utt": "u2", "path": "x\\u0000y"}', "field 'path' holds a NUL byte"),
        ('{"utt": "u2", "path": "x", "duration": ' + "9" * 5000 + "}", "not valid JSON (ValueError"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (RecursionError"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_any_problem_of_a_manifest_is_the_readers_refusal(tmp_path: Path, line: str, what: str) -> None:
    source = tmp_path / "m.jsonl"
    source.write_text('{"utt": "u1", "path": "a.wav"}\n' + line + "\n", encoding="utf-8")
    assert not looks_clean(source, LIMIT)
    with pytest.raises(CorpusError) as caught:
        check_listing(source, LIMIT)
    assert caught.value.problems == _problems(source)
    assert any(what in problem for problem in caught.value.problems), caught.value.problems


def test_lhotse_cuts_are_read_in_full_and_refused_the_same_way(tmp_path: Path) -> None:
    cut = {
        "id": "c1",
        "start": 0,
        "duration": 1,
        "recording": {"id": "r", "sources": [{"type": "file", "source": "r.wav"}]},
    }
    source = tmp_path / "cuts.jsonl"
    source.write_text(json.dumps(cut) + "\n" + json.dumps(cut) + "\n")
    assert not looks_clean(source, LIMIT)  # no quick pass: the reader decides
    with pytest.raises(CorpusError, match="duplicate utterance id"):
        check_listing(source, LIMIT)
    source.write_text(json.dumps(cut) + "\n")
    check_listing(source, LIMIT)


def test_a_run_looks_at_the_first_lines_before_it_starts_anything(tmp_path: Path) -> None:
    """`first_problems`: what `extract` reads before any worker is spawned. A problem in the first
    lines (or an input that is no listing) is told as the reader tells it; one further on is the
    whole-listing check's, and so is an id listed twice."""
    from pipeline.corpus.listing import first_problems
    from workers.extract import check_first_lines

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"utt": "a", "path": "a.wav"}\nnot json\n' + '{"utt": 3, "path": "b.wav"}\n' * 3000)
    problems = first_problems(bad, LIMIT, utterances=10)
    assert problems and problems[0].startswith(f"{bad} line 2: not valid JSON")
    with pytest.raises(CorpusError) as caught:  # told whole: every bad line, not the first few
        check_first_lines(bad, LIMIT)
    assert len(caught.value.problems) == 3001
    late = tmp_path / "late.jsonl"
    lines = [json.dumps({"utt": f"u{i}", "path": f"{i}.wav"}) + "\n" for i in range(50)]
    late.write_text("".join(lines) + "{\n")
    assert first_problems(late, LIMIT, utterances=10) == []
    assert "line 51" in first_problems(late, LIMIT)[0]  # a short listing is read to its end
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"utt": "a", "path": "a.wav"}\n{"utt": "a", "path": "b.wav"}\n')
    assert first_problems(twice, LIMIT) == []
    assert "no such file or folder" in first_problems(tmp_path / "missing", LIMIT)[0]
