"""The plan of a run: shards cut for the workers as the listing streams by, resumed as they were."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pipeline.corpus.sharding import auto_shard_size, shard_size_for_durations
from pipeline.errors import RunError
from pipeline.outputs.folder import RunFolder
from pipeline.records import ShardSpec
from pipeline.run.plan import Planner, PlanReader
from pipeline.settings import Settings


def plan_for(
    source: Path, out: Path, ops: list[str], size: int, settings: Settings, workers: int | None
) -> Planner:
    planner = Planner(source, RunFolder.of(out), ops, size, settings, workers).start()
    planner.join()
    if planner.error is not None:
        raise planner.error
    return planner


def shard_sizes(out: Path) -> list[int]:
    return [len(utts) for _, utts in PlanReader(RunFolder.of(out)).shards()]


def manifest(tmp_path: Path, count: int, name: str = "corpus.jsonl", duration: float | None = None) -> Path:
    path = tmp_path / name
    lines = []
    for i in range(count):
        line: dict[str, object] = {"utt": f"u{i:05d}", "path": f"/a/u{i}.wav"}
        if duration is not None:
            line["duration"] = duration
        lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines))
    return path


def test_auto_shard_size_gives_every_worker_several_shards_up_to_the_largest() -> None:
    assert auto_shard_size(60, workers=2, largest=32) == 5  # 12 shards: 6 per worker
    assert auto_shard_size(240, workers=2, largest=32) == 20
    assert auto_shard_size(100_000, workers=2, largest=32) == 32
    assert auto_shard_size(3, workers=8, largest=32) == 1
    assert auto_shard_size(0, workers=2, largest=32) == 1


def test_an_automatic_plan_is_cut_for_the_workers_and_resumed_whatever_their_number(tmp_path: Path) -> None:
    source, settings = manifest(tmp_path, 60), Settings(shard_size=32)
    out = tmp_path / "out"
    plan_for(source, out, ["embed"], 0, settings, workers=2)
    assert shard_sizes(out) == [5] * 12
    plan_for(source, out, ["embed"], 0, settings, workers=8)
    assert shard_sizes(out) == [5] * 12  # the plan on disk is reused: a resume never re-cuts the shards
    plan_for(source, tmp_path / "fixed", ["embed"], 16, settings, workers=2)
    assert shard_sizes(tmp_path / "fixed") == [16, 16, 16, 12]
    plan_for(source, tmp_path / "remote", ["embed"], 0, settings, workers=None)
    assert shard_sizes(tmp_path / "remote") == [32, 28]


def test_shards_of_short_listed_clips_hold_about_shard_seconds_of_audio() -> None:
    assert shard_size_for_durations(1.2, smallest=32, seconds=300, largest=4096) == 250
    assert shard_size_for_durations(10.0, smallest=32, seconds=300, largest=4096) == 32  # never fewer
    assert shard_size_for_durations(0.01, smallest=32, seconds=300, largest=4096) == 4096
    assert shard_size_for_durations(1.2, smallest=32, seconds=0, largest=4096) == 32  # off
    assert shard_size_for_durations(0.0, smallest=32, seconds=300, largest=4096) == 32


def test_a_listing_with_durations_is_cut_by_audio_seconds_and_resumed_as_it_was(tmp_path: Path) -> None:
    settings = Settings(shard_size=32, shard_seconds=100.0)
    short = manifest(tmp_path, 5000, "short.jsonl", duration=0.5)
    plan_for(short, tmp_path / "short", ["embed"], 0, settings, workers=2)
    assert shard_sizes(tmp_path / "short") == [200] * 25
    # Each chunk of the plan stays about 8192 utterances, however large the shards.
    big = Settings(shard_size=32, shard_seconds=2048.0)
    plan_for(manifest(tmp_path, 20_000, "big.jsonl", 0.5), tmp_path / "big", ["embed"], 0, big, None)
    assert shard_sizes(tmp_path / "big") == [4096] * 4 + [3616]
    assert json.loads((tmp_path / "big" / "plan" / "header.json").read_text())["shards_per_chunk"] == 2
    assert len(list((tmp_path / "big" / "plan").glob("chunk-*.parquet"))) == 3
    # A resume keeps the plan on disk, whatever shard_seconds says now.
    plan_for(short, tmp_path / "short", ["embed"], 0, Settings(shard_size=32, shard_seconds=10.0), 2)
    assert shard_sizes(tmp_path / "short") == [200] * 25
    # Long clips, a fixed size, the setting off, or no durations: by count, as always.
    plan_for(manifest(tmp_path, 500, "long.jsonl", 8.0), tmp_path / "long", ["embed"], 0, settings, 2)
    assert set(shard_sizes(tmp_path / "long")[:-1]) == {32}
    plan_for(short, tmp_path / "fixed", ["embed"], 16, settings, workers=2)
    assert set(shard_sizes(tmp_path / "fixed")[:-1]) == {16}
    plan_for(short, tmp_path / "off", ["embed"], 0, Settings(shard_size=32, shard_seconds=0), 2)
    assert set(shard_sizes(tmp_path / "off")[:-1]) == {32}
    plan_for(manifest(tmp_path, 5000), tmp_path / "unlisted", ["embed"], 0, settings, workers=2)
    assert set(shard_sizes(tmp_path / "unlisted")[:-1]) == {32}
    # A small listed corpus is still cut so that each of the 2 workers gets 6 shards.
    plan_for(manifest(tmp_path, 600, "small.jsonl", 0.5), tmp_path / "small", ["embed"], 0, settings, 2)
    assert shard_sizes(tmp_path / "small") == [50] * 12


def test_a_large_listing_is_cut_in_listing_order_across_chunks(tmp_path: Path) -> None:
    source = manifest(tmp_path, 20_000)
    out = tmp_path / "out"
    planner = plan_for(source, out, ["tokenize", "embed"], 0, Settings(shard_size=32), workers=2)
    assert planner.utterances == 20_000 and planner.planned == 625
    specs = list(PlanReader(RunFolder.of(out)).specs())
    assert [(s.shard, s.op) for s in specs[:3]] == [(0, "tokenize"), (0, "embed"), (1, "tokenize")]
    utts = [u.utt for s in specs if s.op == "embed" for u in s.utts]
    assert utts == [f"u{i:05d}" for i in range(20_000)]  # every utterance once, in listing order
    assert len(list((out / "plan").glob("chunk-*.parquet"))) == 3


def test_a_reader_takes_the_last_chunk_its_planner_wrote_from_it_and_the_others_from_the_plan(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    planner = plan_for(manifest(tmp_path, 20_000), out, ["embed"], 0, Settings(shard_size=32), workers=2)
    from_plan = list(PlanReader(RunFolder.of(out)).specs())
    (out / "plan" / "chunk-000002.parquet").unlink()  # the last of 3: its planner still holds it
    assert list(PlanReader(RunFolder.of(out), planner).specs()) == from_plan
    (out / "plan" / "chunk-000001.parquet").unlink()
    with pytest.raises(OSError):
        list(PlanReader(RunFolder.of(out), planner).specs())  # any other chunk is read from the plan


def test_a_reader_takes_a_short_last_chunk_once_written_not_when_the_plan_is_complete(tmp_path: Path) -> None:
    # complete.json is one more write (a PUT in a store) after the last chunk: shards wait for the chunk only
    writes: list[int] = []
    release = threading.Event()

    def before_writing() -> None:  # the chunk (the header beside it), then complete.json: held
        writes.append(1)
        if len(writes) == 2:
            release.wait(10)

    out = RunFolder.of(tmp_path / "out")
    source = manifest(tmp_path, 40)
    planner = Planner(source, out, ["embed"], 10, Settings(), 2, before_writing=before_writing)
    firsts: list[ShardSpec] = []
    reader = threading.Thread(target=lambda: firsts.append(next(PlanReader(out, planner).specs())))
    planner.start()
    planner.wait_for(1, 5)  # its chunk written
    reader.start()
    reader.join(5)
    done_then = planner.done
    release.set()
    planner.join()
    assert firsts and firsts[0].shard == 0 and not done_then  # read while complete.json was held back
    assert planner.error is None and planner.planned == 4 and len(writes) == 2


def test_a_plan_of_an_earlier_voxmill_is_refused_and_a_plan_folder_without_header_is_no_plan(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    (out / "plan").mkdir(parents=True)
    planner = plan_for(manifest(tmp_path, 10), out, ["embed"], 4, Settings(), workers=None)
    assert not planner.resumed and shard_sizes(out) == [4, 4, 2]
    assert plan_for(manifest(tmp_path, 10), out, ["embed"], 4, Settings(), workers=None).resumed
    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text("{}")
    with pytest.raises(RunError, match=r"holds a run of an earlier voxmill \(plan.json\)"):
        Planner(manifest(tmp_path, 10), RunFolder.of(old), ["embed"], 4, Settings(), None)


def test_a_different_corpus_in_the_same_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    settings = Settings(shard_size=4)
    plan_for(manifest(tmp_path, 10), out, ["embed"], 0, settings, workers=None)
    with pytest.raises(RunError, match="holds a run of a different corpus"):
        plan_for(manifest(tmp_path, 11, "other.jsonl"), out, ["embed"], 0, settings, workers=None)
    with pytest.raises(RunError, match="different corpus, ops or shard size"):
        plan_for(manifest(tmp_path, 10), out, ["tokenize"], 0, settings, workers=None)


def test_a_listing_problem_at_its_very_end_is_refused_before_any_shard_is_planned(tmp_path: Path) -> None:
    source = manifest(tmp_path, 12_000)
    with source.open("a") as stream:
        stream.write('{"utt": "u00003", "path": "/a/again.wav"}\n')  # a duplicate at the very end
    out = tmp_path / "out"
    planner = Planner(source, RunFolder.of(out), ["embed"], 0, Settings(shard_size=32), None).start()
    planner.join()
    assert isinstance(planner.error, RunError) and "duplicate utt 'u00003' (first on line 4)" in str(
        planner.error
    )
    assert planner.planned == 0  # nothing planned, so nothing could have run
    assert not (out / "plan" / "header.json").exists() and not list((out / "plan").glob("chunk-*"))


def test_a_kaldi_dir_with_a_late_duplicate_or_side_file_problem_plans_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    n = 30_000
    lines = [f"u{i:06d} /a/u{i}.wav\n" for i in range(n)] + ["u020000 /a/again.wav\n"]
    (data / "wav.scp").write_text("".join(lines))
    (data / "utt2spk").write_text("".join(f"u{i:06d} s{i % 7}\n" for i in range(n)))
    out = RunFolder.of(tmp_path / "out")
    planner = Planner(data, out, ["embed"], 0, Settings(shard_size=32), None).start()
    planner.join()
    assert planner.planned == 0 and isinstance(planner.error, RunError)
    assert f"wav.scp line {n + 1}: duplicate utt 'u020000' (first on line 20001)" in str(planner.error)
    (data / "wav.scp").write_text("".join(lines[:-1]))
    with (data / "utt2spk").open("a") as stream:
        stream.write("u000005 two words\n")
    out = RunFolder.of(tmp_path / "out2")
    planner = Planner(data, out, ["embed"], 0, Settings(shard_size=32), None).start()
    planner.join()
    assert planner.planned == 0 and isinstance(planner.error, RunError)
    assert f"utt2spk line {n + 1}: expected 'utt spk', got 'u000005 two words'" in str(planner.error)


def test_a_name_longer_than_max_text_chars_is_refused_with_its_line(tmp_path: Path) -> None:
    source = manifest(tmp_path, 10)
    with source.open("a") as stream:
        stream.write(json.dumps({"utt": "x" * 5000, "path": "/a/x.wav"}) + "\n")
    out = RunFolder.of(tmp_path / "out")
    planner = Planner(source, out, ["embed"], 0, Settings(shard_size=4), None).start()
    planner.join()
    assert isinstance(planner.error, RunError) and planner.planned == 0
    assert "line 11: field 'utt' is 5000 characters long; the limit is 4096 (max_text_chars)" in str(
        planner.error
    )


def test_both_ops_run_as_one_extract_task_only_where_every_worker_serves_it() -> None:
    from pipeline.run.plan import task_ops
    from workers.corpus.shard_queue import all_serve_extract

    assert task_ops(["tokenize", "embed"], True) == ["extract"]
    assert task_ops(["tokenize", "embed"], False) == ["tokenize", "embed"]
    assert task_ops(["embed"], True) == ["embed"]
    from workers.heartbeat import WorkerRecord

    both = WorkerRecord.from_dict({"queues": ["tokenize", "embed", "extract"]})
    assert all_serve_extract([both, both])
    tokenize_only = WorkerRecord.from_dict({"queues": ["tokenize"]})
    assert not all_serve_extract([both, tokenize_only])  # a GPU tokenize-only worker
    assert not all_serve_extract([])


def test_a_plan_made_with_separate_tasks_resumes_with_them(tmp_path: Path) -> None:
    source = manifest(tmp_path, 10)
    out = tmp_path / "out"
    settings = Settings()
    old = plan_for(source, out, ["tokenize", "embed"], 4, settings, None)
    assert "tasks" not in json.loads((out / "plan" / "header.json").read_text())  # as before
    resumed = Planner(source, RunFolder.of(out), ["tokenize", "embed"], 4, settings, None, ["extract"])
    assert resumed.ops == ["tokenize", "embed"] and resumed.requested_ops == old.requested_ops
    fresh = plan_for(source, tmp_path / "fresh", ["tokenize", "embed"], 4, settings, None)
    one_out = RunFolder.of(tmp_path / "one")
    one = Planner(source, one_out, ["tokenize", "embed"], 4, settings, None, ["extract"]).start()
    one.join()
    assert [s.op for s in PlanReader(one_out).specs()] == ["extract"] * 3
    fresh_specs = list(PlanReader(RunFolder.of(tmp_path / "fresh")).specs())
    assert len(fresh_specs) == 6 and fresh.ops == ["tokenize", "embed"]
    with pytest.raises(RunError, match="different"):
        Planner(source, one_out, ["embed"], 4, settings, None)


def test_a_finished_plan_resumes_without_reading_an_unchanged_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.corpus import digest, listing

    source = manifest(tmp_path, 10)
    out = tmp_path / "out"
    settings = Settings()
    first = plan_for(source, out, ["embed"], 4, settings, None)
    complete = out / "plan" / "complete.json"
    assert json.loads(complete.read_text())["listing_digest"] == digest.listing_digest(source)

    def unread(self: object) -> object:
        raise AssertionError("the listing was read")

    with monkeypatch.context() as patched:
        patched.setattr(listing.CorpusListing, "__iter__", unread)
        again = plan_for(source, out, ["embed"], 4, settings, None)
    assert (again.planned, again.utterances, again.fingerprint) == (first.planned, 10, first.fingerprint)
    assert [len(utts) for _, utts in PlanReader(RunFolder.of(out)).shards()] == [4, 4, 2]

    # A plan recorded before the digest existed is read in full once, then records it.
    record = json.loads(complete.read_text())
    del record["listing_digest"]
    complete.write_text(json.dumps(record))
    assert plan_for(source, out, ["embed"], 4, settings, None).fingerprint == first.fingerprint
    assert json.loads(complete.read_text())["listing_digest"] == digest.listing_digest(source)

    # A changed listing is read again, and refused as another corpus.
    planned_from = digest.listing_digest(source)
    with source.open("a") as stream:
        stream.write('{"utt": "u99999", "path": "/a/late.wav"}\n')
    assert digest.listing_digest(source) != planned_from
    with pytest.raises(RunError, match="different corpus"):
        plan_for(source, out, ["embed"], 4, settings, None)


def test_only_local_file_listings_have_a_digest(tmp_path: Path) -> None:
    from pipeline.corpus.digest import listing_digest

    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    (kaldi / "wav.scp").write_text("a /x/a.wav\n")
    (kaldi / "utt2spk").write_text("a s1\n")
    before = listing_digest(kaldi)
    assert before is not None and listing_digest(kaldi / "wav.scp") == before
    (kaldi / "utt2spk").write_text("a s2\n")  # every file the listing reads counts
    changed = listing_digest(kaldi)
    assert changed != before
    (kaldi / "feats.ark").write_bytes(b"\0" * 1024)  # others are not read, nor hashed
    assert listing_digest(kaldi) == changed
    (kaldi / "segments").write_text("a-1 a 0.0 1.0\n")  # a new one the listing reads
    assert listing_digest(kaldi) != changed
    folder = tmp_path / "audio"
    folder.mkdir()
    assert listing_digest(folder) is None  # a folder scan is read again
    assert listing_digest("s3://bucket/corpus.jsonl") is None
