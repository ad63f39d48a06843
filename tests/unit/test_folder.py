"""A run's output folder: built once from `--out`, the one owner of every name in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.outputs.folder import RunFolder


def test_shard_path_layout(tmp_path: Path) -> None:
    folder = RunFolder.of(tmp_path)
    assert folder.ref(folder.shard_file("embed", 12)) == tmp_path / "shards" / "embed-000012.parquet"
    assert folder.given_up_file("embed", 12) == "shards/embed-000012.given-up.parquet"
    assert RunFolder.is_given_up(folder.given_up_file("embed", 12))
    assert not RunFolder.is_given_up(folder.shard_file("embed", 12))
    assert folder.chunk_file(3) == "plan/chunk-000003.parquet"


def test_the_name_is_the_normalised_url_or_the_resolved_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert RunFolder.of("s3://bkt/runs/./1/").name == "s3://bkt/runs/1"
    assert RunFolder.of(Path("s3:/bkt/runs/1")).name == "s3://bkt/runs/1"  # a URL through Path()
    monkeypatch.chdir(tmp_path)
    local = RunFolder.of("out")
    assert local.is_local and local.name == str(tmp_path.resolve() / "out")
    assert local.display() == "out" and local.display("report.json") == str(Path("out") / "report.json")


def test_a_store_keeps_its_lock_and_log_in_a_local_state_folder(tmp_path: Path) -> None:
    local = RunFolder.of(tmp_path / "out")
    assert local.lock_file(tmp_path / "state") == tmp_path / "out" / ".lock"
    assert local.workers_log(tmp_path / "state") == tmp_path / "out" / "workers.log"
    remote = RunFolder.of("s3://bkt/run/")
    state = remote.local_state(tmp_path / "state")
    assert state.parent == tmp_path / "state"
    assert state == RunFolder.of("s3://bkt/run").local_state(tmp_path / "state")  # one per output URL
    assert remote.lock_file(tmp_path / "state") == state / ".lock"
    assert remote.display() == "s3://bkt/run/" and remote.display("report.json") == "s3://bkt/run/report.json"


def test_shard_files_are_the_parquet_files_of_shards(tmp_path: Path) -> None:
    folder = RunFolder.of(tmp_path)
    assert folder.shard_files() == set()
    (tmp_path / "shards").mkdir()
    for name in ("embed-000000.parquet", "embed-000001.given-up.parquet", ".embed-000002.parquet.tmp-1", "x"):
        (tmp_path / "shards" / name).write_bytes(b"")
    assert folder.shard_files() == {"shards/embed-000000.parquet", "shards/embed-000001.given-up.parquet"}


def test_a_folder_no_output_can_be_written_to_is_refused() -> None:
    with pytest.raises(VoxmillError) as caught:
        RunFolder.of("https://host/out")
    assert caught.value.code == BAD_REQUEST
