"""The holder's reload bookkeeping, without Redis or worker processes: when to retry a failed load."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from pipeline.settings import Settings
from workers.holder import FileStamp, ModelHolder, _local_mismatch

STAMP = FileStamp(device=1, inode=2, size=1000, mtime_ns=3)
CHANGED = FileStamp(device=1, inode=9, size=1000, mtime_ns=4)


def holder() -> ModelHolder:
    return ModelHolder(Settings(reload_retry_max_s=60.0))


def delay_s(h: ModelHolder) -> float:
    return h.reload_failures["embedder"].retry_at - time.monotonic()


def test_a_failed_load_is_retried_with_growing_backoff() -> None:
    h = holder()
    h._fail("embedder", "aa", 2, STAMP, "out of memory")
    assert not h._retry_due("embedder", "aa", STAMP)
    assert 1.5 < delay_s(h) <= 2.0
    h._fail("embedder", "aa", 2, STAMP, "out of memory")
    assert h.reload_failures["embedder"].attempts == 2
    assert 3.5 < delay_s(h) <= 4.0
    h.reload_failures["embedder"] = replace(h.reload_failures["embedder"], retry_at=time.monotonic() - 1)
    assert h._retry_due("embedder", "aa", STAMP)


def test_the_backoff_is_capped() -> None:
    h = holder()
    for _ in range(12):
        h._fail("embedder", "aa", 2, STAMP, "out of memory")
    assert 59.0 < delay_s(h) <= 60.0


def test_a_changed_file_or_a_new_generation_is_tried_at_once() -> None:
    h = holder()
    h._fail("embedder", "aa", 2, STAMP, "differs", wait_for_change=True)
    assert not h._retry_due("embedder", "aa", STAMP)
    assert h._retry_due("embedder", "aa", CHANGED)
    assert h._retry_due("embedder", "bb", STAMP)


def test_failures_are_reported_in_the_heartbeat() -> None:
    h = holder()
    h._fail("embedder", "aa", 2, STAMP, "out of memory")
    reported = h.describe()["reload_failures"]["embedder"]
    assert reported["sha256"] == "aa" and reported["generation"] == 2
    assert reported["reason"] == "out of memory" and reported["attempts"] == 1


def test_a_local_copy_of_another_size_is_not_the_published_file(tmp_path: Path) -> None:
    path = tmp_path / "campplus.onnx"
    assert "1000 bytes, the published file 999" in _local_mismatch(path, STAMP, {"size": "999"})
    assert _local_mismatch(path, STAMP, {"size": "1000"}) == ""
    assert _local_mismatch(path, STAMP, {"size": "999"}, check_size=False) == ""
    assert "no such model file" in _local_mismatch(None, None, {"size": "1000"})
