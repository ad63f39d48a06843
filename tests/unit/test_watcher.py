"""The watcher's pure parts, without Redis: event filtering, debounce and the start-up rule."""

from __future__ import annotations

from watchdog.events import (
    DirModifiedEvent,
    FileClosedEvent,
    FileClosedNoWriteEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileOpenedEvent,
)

from workers.reload.watcher import (
    CLOSED,
    GONE,
    LANDED,
    WRITTEN,
    Change,
    Debouncer,
    model_changes,
    startup_should_publish,
)

# -- event filtering ---------------------------------------------------------------------------


def test_reads_and_opens_are_ignored() -> None:
    assert model_changes(FileOpenedEvent("/m/campplus.onnx")) == []
    assert model_changes(FileClosedNoWriteEvent("/m/campplus.onnx")) == []


def test_directory_events_are_ignored() -> None:
    assert model_changes(DirModifiedEvent("/m")) == []


def test_writes_closes_creations_and_deletions() -> None:
    assert model_changes(FileModifiedEvent("/m/campplus.onnx")) == [Change("campplus.onnx", WRITTEN)]
    assert model_changes(FileClosedEvent("/m/campplus.onnx")) == [Change("campplus.onnx", CLOSED)]
    assert model_changes(FileCreatedEvent("/m/campplus.onnx")) == [Change("campplus.onnx", LANDED)]
    assert model_changes(FileDeletedEvent("/m/campplus.onnx")) == [Change("campplus.onnx", GONE)]


def test_an_atomic_rename_lands_the_destination() -> None:
    event = FileMovedEvent("/m/.campplus.onnx.x1.tmp", "/m/campplus.onnx")
    assert model_changes(event) == [Change(".campplus.onnx.x1.tmp", GONE), Change("campplus.onnx", LANDED)]


def test_bytes_paths_are_decoded() -> None:
    assert model_changes(FileCreatedEvent(b"/m/campplus.onnx")) == [Change("campplus.onnx", LANDED)]


# -- debounce ----------------------------------------------------------------------------------


def test_a_file_settles_after_the_quiet_period() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    d.observe("embedder", "s1", now=0.1)
    assert d.pop_settled(now=0.9) == []
    assert d.pop_settled(now=1.0) == [("embedder", "s1")]
    assert d.pending == []


def test_nothing_settles_before_its_stamp_was_seen() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    assert d.pop_settled(now=5.0) == []


def test_each_event_restarts_the_quiet_period() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    d.observe("embedder", "s1", now=0.0)
    d.touch("embedder", now=0.8)
    assert d.pop_settled(now=1.5) == []
    assert d.pop_settled(now=1.8) == [("embedder", "s1")]


def test_a_growing_file_does_not_settle_until_its_stamp_holds_still() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    for step in range(20):  # a slow copy: the size changes every 0.5 s, without events
        d.observe("embedder", f"size-{step}", now=step * 0.5)
        assert d.pop_settled(now=step * 0.5) == []
    d.observe("embedder", "size-19", now=10.0)  # last changed at 9.5
    assert d.pop_settled(now=10.4) == []
    assert d.pop_settled(now=10.5) == [("embedder", "size-19")]


def test_a_file_held_open_for_writing_waits_for_its_close() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0, writing=True)
    d.observe("embedder", "s1", now=0.1)
    assert d.pop_settled(now=5.0) == []  # quiet, but the writer still has it open
    d.closed("embedder", now=5.0)
    assert d.pop_settled(now=5.0) == [("embedder", "s1")]


def test_closing_does_not_shorten_the_quiet_period() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0, writing=True)
    d.observe("embedder", "s1", now=0.0)
    d.closed("embedder", now=0.2)
    assert d.pop_settled(now=0.5) == []
    assert d.pop_settled(now=1.0) == [("embedder", "s1")]


def test_a_writer_that_never_closes_settles_after_writing_max_s() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=10.0)
    d.touch("embedder", now=0.0, writing=True)
    d.observe("embedder", "s1", now=0.0)
    assert d.pop_settled(now=9.9) == []
    assert d.pop_settled(now=10.0) == [("embedder", "s1")]


def test_roles_settle_independently() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    d.touch("tokenizer", now=0.5)
    for role in ("embedder", "tokenizer"):
        d.observe(role, "s", now=0.5)
    assert d.pop_settled(now=1.2) == [("embedder", "s")]
    assert d.pending == ["tokenizer"]
    assert d.pop_settled(now=1.5) == [("tokenizer", "s")]


def test_a_deleted_file_settles_with_no_stamp() -> None:
    d = Debouncer(quiet_s=1.0, writing_max_s=30.0)
    d.touch("embedder", now=0.0)
    d.observe("embedder", None, now=0.1)
    assert d.pop_settled(now=1.0) == [("embedder", None)]


# -- the start-up rule --------------------------------------------------------------------------


def test_startup_publishes_when_nothing_is_published() -> None:
    assert startup_should_publish({}, "aa", changed_at=100.0)


def test_startup_does_not_republish_the_published_file() -> None:
    assert not startup_should_publish({"sha256": "aa", "time": "50"}, "aa", changed_at=100.0)


def test_startup_publishes_a_file_changed_while_the_watcher_was_down() -> None:
    assert startup_should_publish({"sha256": "aa", "time": "50"}, "bb", changed_at=100.0)


def test_startup_never_rolls_back_with_a_copy_older_than_the_published_one() -> None:
    assert not startup_should_publish({"sha256": "aa", "time": "150"}, "bb", changed_at=100.0)
