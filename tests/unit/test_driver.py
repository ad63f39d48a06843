"""The driver's decisions about shards whose file is late: send again, wait, or give up."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from pipeline.errors import INTERNAL, OUTPUT_ERROR, ErrorRecord
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.merge import merge_outputs
from pipeline.outputs.report import RunReport
from pipeline.outputs.writers import write_given_up_shard, write_shard
from pipeline.records import ModelRef, ShardSpec, TaskResult, Utterance
from pipeline.run.ledger import InFlight, given_up_reason, judge_late, late_shards


def spec(n: int, out: str = "/out") -> ShardSpec:
    return ShardSpec(
        shard=n, op="embed", out_dir=out, utts=[Utterance(f"u{n}", "/a.wav"), Utterance(f"v{n}", "/b.wav")]
    )


def test_a_shard_sent_max_attempts_times_is_given_up_unless_a_live_worker_runs_it() -> None:
    # Deadline 60 s, doubled per attempt: the 4th attempt, sent at t=0, is late after 480 s.
    fresh = InFlight(spec(0), 0.0, 1, ["t0"])
    again = InFlight(spec(1), 0.0, 3, ["t1a", "t1b", "t1c"])
    last = InFlight(spec(2), 0.0, 4, ["t2a", "t2b", "t2c", "t2d"])
    slow = InFlight(spec(3), 0.0, 4, ["t3a", "t3b", "t3c", "t3d"])
    late = late_shards([fresh, again, last, slow], 500.0, 60.0, running=None)
    assert late == [fresh, again, last, slow]
    # t3b (an earlier attempt of shard 3) still runs on a live worker: slow, not lost.
    verdict = judge_late(late, frozenset({"t3b", "other"}), max_attempts=4)
    assert verdict.resend == [fresh, again]
    assert verdict.give_up == [last]
    assert verdict.running == [slow]
    # Seen running at t=500: its deadline counts from then, not from when it was sent.
    slow.seen_running = 500.0
    assert late_shards([slow], 900.0, 60.0, running=None) == []
    assert late_shards([slow], 981.0, 60.0, running=None) == [slow]
    # Never given up while running, however many attempts it had.
    assert judge_late([slow], frozenset({"t3d"}), max_attempts=1).give_up == []


def test_a_given_up_shard_says_why_with_the_last_failure_heard_of() -> None:
    told = InFlight(spec(5), 0.0, 4, failure=ErrorRecord(OUTPUT_ERROR, "cannot write x: Is a directory"))
    code, message = given_up_reason(told)
    assert code == OUTPUT_ERROR
    assert message == (
        "shard embed-000005 was given up after 4 attempt(s) without its file written; "
        "last failure: output_error: cannot write x: Is a directory"
    )
    code, message = given_up_reason(InFlight(spec(6), 0.0, 4))
    assert code == INTERNAL and "each task ended without a result, or its worker was lost" in message


def test_the_merge_counts_a_given_up_shard_failed_even_beside_a_late_shard_file(tmp_path: Path) -> None:
    specs = [spec(0, str(tmp_path)), spec(1, str(tmp_path))]
    for s in specs:  # shard 1's file came late, after it was given up: the give-up stands
        results = [
            TaskResult(
                u.utt,
                "embed",
                embedding=[0.5, 0.25],
                audio_seconds=1.0,
                models={"embedder": ModelRef("embedder", "c.onnx", "b" * 64)},
            )
            for u in s.utts
        ]
        write_shard(RunFolder.of(tmp_path), s, results)
    path = write_given_up_shard(RunFolder.of(tmp_path), specs[1], OUTPUT_ERROR, "given up")
    assert str(path).endswith(RunFolder.given_up_file("embed", 1))
    assert pq.read_table(path).column("error_code").to_pylist() == [OUTPUT_ERROR, OUTPUT_ERROR]
    report = merge_outputs(RunFolder.of(tmp_path), specs, RunReport()).to_dict()
    assert report["ops"] == {"embed": {"ok": 2, "failed": 2}}
    errors = (tmp_path / "errors.jsonl").read_text().splitlines()
    assert [e.split('"code"')[0] for e in errors] == [
        '{"utt": "u1", "op": "embed", ',
        '{"utt": "v1", "op": "embed", ',
    ]


def test_a_given_up_tar_shard_fails_what_another_ops_file_of_the_tar_held(tmp_path: Path) -> None:
    tar = "/t/0.tar"
    tokenize = ShardSpec(shard=0, op="tokenize", out_dir=str(tmp_path), tar=tar)
    embed = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), tar=tar)
    held = [Utterance(f"k{i}", f"{tar}#k{i}.flac", "spk") for i in range(3)]
    model = {"tokenizer": ModelRef("tokenizer", "t.onnx", "a" * 64)}
    results = [
        TaskResult(u.utt, "tokenize", speech_token=[1, 2], audio_seconds=1.0, models=model) for u in held
    ]
    folder = RunFolder.of(tmp_path)
    write_shard(folder, tokenize, results, held)
    write_given_up_shard(folder, embed, INTERNAL, "given up after 4 attempt(s)")  # one row: the tar
    report = merge_outputs(folder, [tokenize, embed], RunReport()).to_dict()
    assert report["ops"] == {"tokenize": {"ok": 3, "failed": 0}, "embed": {"ok": 0, "failed": 3}}
    errors = (tmp_path / "errors.jsonl").read_text().splitlines()
    assert len(errors) == 3 and all('"embed", "code": "internal"' in e for e in errors)
