"""What a corpus run tells its user, as pure functions: an --out that is a file, workers on a broker
that may not write --out, and rows that other models than the folder's made."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import FORBIDDEN_PATH, OUTPUT_ERROR, ErrorRecord
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.records import ShardResult
from pipeline.run.ledger import run_ending_failure
from pipeline.run.lock import unusable_output
from workers.extract import other_models_note

OLD, NEW = "a" * 64, "b" * 64


def test_an_out_that_is_a_file_is_said_to_be_one(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    exists = FileExistsError(17, "File exists")
    said = unusable_output(RunFolder.of(file), exists)
    assert said.endswith("it is a file, not a folder (--out names a folder)")
    below = unusable_output(RunFolder.of(file / "run"), NotADirectoryError(20, "Not a directory"))
    assert f"{file} is a file, not a folder" in below
    denied = unusable_output(RunFolder.of(tmp_path / "run"), PermissionError(13, "Permission denied"))
    assert denied == f"cannot use the output folder {tmp_path / 'run'}: Permission denied"


def test_workers_on_a_broker_that_may_not_write_the_output_say_why_the_run_is_theirs() -> None:
    refused = ErrorRecord(FORBIDDEN_PATH, "path /elsewhere/out is outside the allowed roots (/home/me)")
    result = ShardResult(0, "extract", "", 0, 0, 0.0, 0.0, error=refused)
    remote = run_ending_failure(result, remote=True)
    assert remote.startswith("shard extract-000000 failed: path /elsewhere/out is outside the allowed roots")
    assert "VOXMILL_BROKER_URL is set" in remote and "unset VOXMILL_BROKER_URL" in remote
    assert "VOXMILL_BROKER_URL" not in run_ending_failure(result, remote=False)
    other = ShardResult(0, "embed", "", 0, 0, 0.0, 0.0, error=ErrorRecord(OUTPUT_ERROR, "disk full"))
    assert run_ending_failure(other, remote=True) == "shard embed-000000 failed: disk full"


def test_rows_of_other_models_than_the_folders_are_named_with_the_fix() -> None:
    tokenizer, embedder = {"file": "t.onnx", "sha256": OLD}, {"file": "c.onnx", "sha256": NEW}
    report = RunReport.from_dict({"models": {"tokenizer": tokenizer, "embedder": embedder}})
    assert report.sha256s() == {"tokenizer": {OLD}, "embedder": {NEW}}
    note = other_models_note(report, {"tokenizer": NEW, "embedder": NEW}, "models2")
    assert note is not None and "other models than those in models2" in note
    assert f"tokenizer {OLD[:12]} in the rows, {NEW[:12]} in the folder" in note and "embedder" not in note
    assert "--redo-mixed" in note
    assert other_models_note(report, {"tokenizer": OLD, "embedder": NEW}, "models") is None
    # a run that spanned a change: the minority model is in models_mixed
    mixed = RunReport.from_dict(
        {
            "models": {"embedder": {"file": "c.onnx", "sha256": NEW}},
            "models_mixed": {
                "embedder": [
                    {"file": "c.onnx", "sha256": NEW, "shards": 3},
                    {"file": "c.onnx", "sha256": OLD, "shards": 1},
                ]
            },
        }
    )
    assert mixed.sha256s() == {"embedder": {NEW, OLD}}
    assert other_models_note(mixed, {"embedder": NEW}, "models") is not None
    assert other_models_note(RunReport.from_dict({"models": {}}), {"embedder": NEW}, "models") is None
