"""Wave 2 listings: Kaldi segments, lhotse cuts and recordings + supervisions, WebDataset tar
shards (listing, plan, reading as a stream), segment decoding, and the driver's look budget."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio.decode import Segment, load_audio
from pipeline.corpus.listing import CorpusError, CorpusListing, read_corpus
from pipeline.corpus.problems import NO_SHELL
from pipeline.corpus.roots import corpus_roots
from pipeline.corpus.sharding import shard_digest
from pipeline.corpus.tars import iter_samples, split_key
from pipeline.errors import BAD_REQUEST, EMPTY, NOT_FOUND, TOO_LARGE, TOO_LONG, UNREADABLE, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.records import ShardSpec, Utterance
from pipeline.run.ledger import InFlight, late_shards, shards_to_look_at
from pipeline.run.plan import Planner, PlanReader
from pipeline.settings import AudioLimits, Settings


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _problems(source: Path | str) -> list[str]:
    with pytest.raises(CorpusError) as caught:
        read_corpus(source)
    return caught.value.problems


def _wav(path: Path, seconds: float, channels: int = 1, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(int(seconds * 1000) + channels)
    wave = (rng.uniform(-0.5, 0.5, (int(seconds * rate), channels))).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, wave, rate, subtype="FLOAT")
    return wave


# --------------------------------------------------------------------------- Kaldi segments


def test_kaldi_segments_make_each_segment_an_utterance_of_its_recording(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "rec1 audio/r1.wav\nrec2 /abs/r2.flac\n")
    _write(tmp_path / "segments", "u1 rec1 0.5 1.25\nu2 rec1 2 -1\nu3 rec2 0 3\n")
    _write(tmp_path / "utt2spk", "u1 alice\nu2 alice\nu3 bob\n")
    _write(tmp_path / "text", "u1 hello\nu3 bye\n")
    _write(tmp_path / "reco2dur", "rec1 4.0\nrec2 3.5\n")
    utts = read_corpus(tmp_path)
    r1 = str(tmp_path.absolute() / "audio/r1.wav")
    assert utts == [
        Utterance("u1", r1, "alice", "hello", 0.75, 0.5, 1.25),
        Utterance("u2", r1, "alice", "", 2.0, 2.0, 4.0),  # -1: to the end, from reco2dur
        Utterance("u3", "/abs/r2.flac", "bob", "bye", 3.0, 0.0, 3.0),
    ]


def test_kaldi_segment_problems_are_reported_with_their_lines(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "rec1 /a/r1.wav\n")
    _write(tmp_path / "segments", "u1 rec1 1 0.5\nu2 nope 0 1\nu3 rec1 x 1\nu4 rec1 0\nu1 rec1 0 1\n")
    problems = _problems(tmp_path)
    segments = tmp_path / "segments"
    assert any(p.startswith(f"{segments} line 1:") and "ends" in p for p in problems)
    assert any(p.startswith(f"{segments} line 2:") and "'nope' is not in wav.scp" in p for p in problems)
    assert any(p.startswith(f"{segments} line 3:") and "seconds" in p for p in problems)
    assert any(p.startswith(f"{segments} line 4:") for p in problems)


def test_a_kaldi_pipe_says_voxmill_never_runs_a_shell_command(tmp_path: Path) -> None:
    _write(tmp_path / "wav.scp", "a /x/a.wav\nb sox /x/b.wav -t wav - |\n")
    problems = _problems(tmp_path)
    assert problems == [
        f"{tmp_path / 'wav.scp'} line 2: piped commands are not supported ('sox /x/b.wav -t wav - |'): "
        f"{NO_SHELL}; list audio files"
    ]
    assert "never runs a shell command named by a corpus file" in problems[0]
    _write(tmp_path / "segments", "s1 b 0 1\n")  # the same with segments: wav.scp lists recordings
    assert any(NO_SHELL in p and "line 2" in p for p in _problems(tmp_path))


# --------------------------------------------------------------------------- lhotse


def _recording(rec_id: str, source: str, kind: str = "file", channels: list[int] | None = None) -> dict:
    return {
        "id": rec_id,
        "sources": [{"type": kind, "channels": channels or [0], "source": source}],
        "sampling_rate": 16000,
        "num_samples": 160000,
        "duration": 10.0,
        "channel_ids": channels or [0],
    }


def test_lhotse_cuts_gz_each_supervision_is_its_segment_inside_the_cut(tmp_path: Path) -> None:
    cuts = [
        {
            "id": "cut1",
            "start": 2.0,
            "duration": 5.0,
            "channel": 1,
            "type": "MonoCut",
            "supervisions": [
                {
                    "id": "s1",
                    "recording_id": "r1",
                    "start": 0.5,
                    "duration": 1.0,
                    "channel": 1,
                    "speaker": "spkA",
                    "text": "hi",
                },
                {"id": "s2", "recording_id": "r1", "start": 4.0, "duration": 3.0, "channel": 1},
                {"id": "s3", "recording_id": "r1", "start": -1.0, "duration": 0.5},
            ],
            "recording": _recording("r1", "audio/r1.wav", channels=[0, 1]),
        },
        {
            "id": "cut2",
            "start": 0,
            "duration": 1.5,
            "channel": 0,
            "supervisions": [],
            "recording": _recording("r2", "s3://bkt/r2.flac", kind="url"),
        },
    ]
    file = tmp_path / "cuts.jsonl.gz"
    with gzip.open(file, "wt") as stream:
        stream.write("".join(json.dumps(c) + "\n" for c in cuts))
    utts = read_corpus(file)
    r1 = str(tmp_path.absolute() / "audio/r1.wav")
    assert utts == [
        Utterance("s1", r1, "spkA", "hi", 1.0, 2.5, 3.5, 1),
        Utterance("s2", r1, "s2", "", 1.0, 6.0, 7.0, 1),  # clipped to the cut's end
        Utterance("cut2", "s3://bkt/r2.flac", "cut2", "", 1.5, 0.0, 1.5, None),
    ]  # s3 lies before the cut: nothing of it is inside
    listing = CorpusListing(file)
    assert sum(u.duration_s or 0 for u in listing) == pytest.approx(3.5) and listing.durations_listed


def test_lhotse_command_sources_and_mixed_cuts_are_refused(tmp_path: Path) -> None:
    cuts = [
        {
            "id": "c1",
            "start": 0,
            "duration": 1,
            "supervisions": [],
            "recording": _recording("r1", "ffmpeg -i x.mp3 -f wav -", kind="command"),
        },
        {"id": "c2", "type": "MixedCut", "tracks": []},
    ]
    file = _write(tmp_path / "cuts.jsonl", "".join(json.dumps(c) + "\n" for c in cuts))
    problems = _problems(file)
    assert NO_SHELL in problems[0] and "line 1" in problems[0]
    assert "MixedCut" in problems[1] and "line 2" in problems[1]


def test_lhotse_recordings_and_supervisions_pair_as_a_folder_or_the_supervisions_file(tmp_path: Path) -> None:
    recs = [_recording("r1", "/abs/r1.wav"), _recording("r2", "/abs/r2.wav", channels=[0, 1])]
    sups = [
        {
            "id": "a",
            "recording_id": "r1",
            "start": 1.0,
            "duration": 2.0,
            "channel": 0,
            "speaker": "x",
            "text": "one",
        },
        {"id": "b", "recording_id": "r2", "start": 0.0, "duration": 1.0, "channel": 1},
    ]
    with gzip.open(tmp_path / "libri_recordings_dev.jsonl.gz", "wt") as stream:
        stream.write("".join(json.dumps(r) + "\n" for r in recs))
    with gzip.open(tmp_path / "libri_supervisions_dev.jsonl.gz", "wt") as stream:
        stream.write("".join(json.dumps(s) + "\n" for s in sups))
    wanted = [
        Utterance("a", "/abs/r1.wav", "x", "one", 2.0, 1.0, 3.0, None),
        Utterance("b", "/abs/r2.wav", "b", "", 1.0, 0.0, 1.0, 1),
    ]
    assert read_corpus(tmp_path) == wanted
    assert read_corpus(tmp_path / "libri_supervisions_dev.jsonl.gz") == wanted
    with gzip.open(tmp_path / "libri_supervisions_dev.jsonl.gz", "at") as stream:
        stream.write(json.dumps({"id": "c", "recording_id": "r9", "start": 0, "duration": 1}) + "\n")
    assert any("'r9' is not in the recordings file" in p and "line 3" in p for p in _problems(tmp_path))


def test_segment_digests_differ_and_whole_file_digests_are_unchanged() -> None:
    whole = [Utterance("a", "/x/a.wav", "s", "t")]
    import hashlib

    legacy = hashlib.sha256((json.dumps(["a", "/x/a.wav", "s", "t"]) + "\n").encode()).hexdigest()
    assert shard_digest(whole) == legacy  # a resume of a plan written before segments existed
    seg = [Utterance("a", "/x/a.wav", "s", "t", None, 1.0, 2.0)]
    assert shard_digest(seg) != legacy


# --------------------------------------------------------------------------- segment decoding


def test_a_segment_decodes_only_its_frames_and_its_channel(tmp_path: Path) -> None:
    wave = _wav(tmp_path / "r.wav", 3.0, channels=2)
    limits = AudioLimits()
    part = load_audio(tmp_path / "r.wav", limits, segment=Segment(0.5, 1.25, 1))
    assert np.array_equal(part.samples, wave[8000:20000, 1])
    assert part.duration_s == pytest.approx(0.75)
    mixed = load_audio(tmp_path / "r.wav", limits, segment=Segment(2.5, None))
    assert np.allclose(mixed.samples, wave[40000:].mean(axis=1), atol=1e-7)
    clamped = load_audio(tmp_path / "r.wav", limits, segment=Segment(2.9, 9.0))
    assert len(clamped.samples) == 1600


def test_segment_limits_judge_the_segment_not_the_recording(tmp_path: Path) -> None:
    _wav(tmp_path / "r.wav", 3.0)
    limits = AudioLimits(max_duration_s=2.0)
    with pytest.raises(VoxmillError) as whole:
        load_audio(tmp_path / "r.wav", limits)
    assert whole.value.code == TOO_LONG
    assert load_audio(tmp_path / "r.wav", limits, segment=Segment(1.0, 2.5)).duration_s == pytest.approx(1.5)
    with pytest.raises(VoxmillError) as late:
        load_audio(tmp_path / "r.wav", limits, segment=Segment(3.5, 4.0))
    assert late.value.code == EMPTY
    with pytest.raises(VoxmillError) as channel:
        load_audio(tmp_path / "r.wav", limits, segment=Segment(0.0, 1.0, 3))
    assert channel.value.code == BAD_REQUEST


# --------------------------------------------------------------------------- tar shards


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _wav_bytes(seconds: float) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.full(int(seconds * 16000), 0.1, dtype=np.float32), 16000, format="WAV")
    return buffer.getvalue()


def test_tar_inputs_single_folder_list_and_pattern_are_one_entry_per_tar(tmp_path: Path) -> None:
    for n in range(3):
        _tar(tmp_path / "shards" / f"{n:06d}.tar", [])
    tars = [str(tmp_path / "shards" / f"{n:06d}.tar") for n in range(3)]
    listing = CorpusListing(tmp_path / "shards")
    assert listing.tars and [u.path for u in listing] == tars
    assert [u.path for u in read_corpus(tmp_path / "shards" / "000001.tar")] == tars[1:2]
    _write(tmp_path / "list.txt", "shards/000002.tar\n" + tars[0] + "\ns3://bkt/x/000009.tar\n")
    assert [u.path for u in read_corpus(tmp_path / "list.txt")] == [tars[2], tars[0], "s3://bkt/x/000009.tar"]
    pattern = str(tmp_path / "shards" / "{000000..000002}.tar")
    assert [u.path for u in read_corpus(pattern)] == tars
    assert [u.path for u in read_corpus("s3://bkt/s/{0..1}.tar")] == ["s3://bkt/s/0.tar", "s3://bkt/s/1.tar"]
    assert corpus_roots(tmp_path / "list.txt") == ([tmp_path / "shards"], ["s3://bkt/x"])
    _write(tmp_path / "notes.txt", "not a list of tars\n")
    assert "not a Kaldi data dir" in _problems(tmp_path / "notes.txt")[0]


def test_a_tar_plan_has_one_shard_per_tar_naming_the_tar(tmp_path: Path) -> None:
    for n in range(3):
        _tar(tmp_path / "shards" / f"{n}.tar", [])
    out = RunFolder.of(tmp_path / "out")
    planner = Planner(tmp_path / "shards", out, ["embed", "tokenize"], 0, Settings(), workers=2).start()
    planner.join()
    assert planner.error is None and planner.utterances == 3 and planner.header and planner.header.tars
    specs = list(PlanReader(out).specs())
    assert [(s.shard, s.op, Path(s.tar).name, s.utts) for s in specs] == [
        (n, op, f"{n}.tar", []) for n in range(3) for op in ("embed", "tokenize")
    ]
    assert ShardSpec.from_dict(specs[0].to_dict()) == specs[0]
    again = Planner(tmp_path / "shards", out, ["embed", "tokenize"], 0, Settings(), workers=2).start()
    again.join()
    assert again.error is None and again.fingerprint == planner.fingerprint  # a resume re-plans the same


def test_tar_samples_stream_with_their_metadata_and_errors_of_their_own(tmp_path: Path) -> None:
    good = _wav_bytes(0.5)
    tar = _tar(
        tmp_path / "a.tar",
        [
            ("spk1/u1.json", json.dumps({"speaker": "S1", "text": "hello"}).encode()),
            ("spk1/u1.flac.wav", good),
            ("u2.json", json.dumps({"spk": "S2"}).encode()),
            ("u2.txt", b"from txt"),
            ("u2.mp3", good),
            ("u3.json", b"{not json"),
            ("u3.wav", good),
            ("u4.json", b"{}"),
            ("u5.wav", good * 3),
            ("u1.wav", good),
            ("spk1/u1.wav", good),
        ],
    )
    with open(tar, "rb") as stream:
        samples = list(iter_samples(stream, "a.tar", max_member_bytes=len(good) * 2))
    keys = [(s.key, s.spk, s.transcript, s.error.code if s.error else None) for s in samples]
    assert keys == [
        ("spk1/u1", "S1", "hello", None),
        ("u2", "S2", "from txt", None),
        ("u3", "u3", "", UNREADABLE),
        ("u4", "u4", "", NOT_FOUND),
        ("u5", "u5", "", TOO_LARGE),
        ("u1", "u1", "", None),
        ("spk1/u1", "spk1/u1", "", BAD_REQUEST),  # met again later in the tar
    ]
    assert samples[0].audio == good and samples[0].audio_name == "spk1/u1.flac.wav"
    assert split_key("a/b/0001.seg.flac") == ("a/b/0001", "seg.flac")


def test_a_truncated_tar_keeps_what_it_held_and_says_where_it_stopped(tmp_path: Path) -> None:
    good = _wav_bytes(0.5)
    tar = _tar(tmp_path / "a.tar", [("u1.wav", good), ("u2.wav", good), ("u3.wav", good)])
    data = tar.read_bytes()
    cut = data[: 512 + len(good) + 512 + 512 + 100]  # inside u2's data
    samples = list(iter_samples(io.BytesIO(cut), "a.tar", 10**9))
    assert samples[0].key == "u1" and samples[0].error is None
    assert samples[-1].key == "a.tar" and samples[-1].error is not None
    assert samples[-1].error.code == UNREADABLE and "a.tar cannot be read after" in samples[-1].error.message


# --------------------------------------------------------------------------- the driver's looks


def test_shards_to_look_at_local_all_store_announced_plus_a_budget_in_turn() -> None:
    names = [f"embed-{n:06d}" for n in range(10)]
    assert shards_to_look_at(names, set(), True, 3, 0) == (names, 0)
    first, cursor = shards_to_look_at(names, {"embed-000009"}, False, 3, 0)
    assert first == ["embed-000009", "embed-000000", "embed-000001", "embed-000002"] and cursor == 3
    second, cursor = shards_to_look_at(names, set(), False, 3, cursor)
    assert second == ["embed-000003", "embed-000004", "embed-000005"]
    seen: set[str] = set()
    cursor = 0
    for _ in range(4):  # every shard is looked at within len/budget rounds
        looked, cursor = shards_to_look_at(names, set(), False, 3, cursor)
        seen.update(looked)
    assert seen == set(names)


def test_late_shards_before_any_is_done_are_only_those_that_can_have_started() -> None:
    def spec(n: int) -> ShardSpec:
        return ShardSpec(shard=n, op="embed", out_dir="/out", utts=[Utterance(f"u{n}", "/a.wav")])

    # Four shards sent at t=0 to 2 worker processes; shard 2 was sent again at t=50.
    inflight = [
        InFlight(spec(0), 0.0),
        InFlight(spec(1), 0.0),
        InFlight(spec(2), 50.0, 2),
        InFlight(spec(3), 0.0),
    ]
    shards = [item.spec.shard for item in late_shards(inflight, 70.0, 60.0, running=None)]
    assert shards == [0, 1, 3]  # a second attempt waits twice the deadline
    # No shard done yet: shard 3 waits in the queue behind the 2 running; its wait is no loss.
    assert [item.spec.shard for item in late_shards(inflight, 70.0, 60.0, running=2)] == [0, 1]
    assert late_shards(inflight, 59.0, 60.0, running=2) == []


def test_an_utterance_on_the_wire_keeps_every_field_and_a_whole_file_no_segment_keys() -> None:
    from dataclasses import fields

    segment = Utterance("u1", "/d/r.wav", "s", "t", duration_s=1.5, start_s=0.5, end_s=2.0, channel=1)
    whole = Utterance("u2", "/d/b.wav", spk="s", duration_s=2.0)
    assert set(segment.to_dict()) == {f.name for f in fields(Utterance)}
    assert set(whole.to_dict()) == {f.name for f in fields(Utterance)} - {"start_s", "end_s", "channel"}
    assert [Utterance.from_dict(u.to_dict()) for u in (segment, whole)] == [segment, whole]
