"""The model holder, without Redis: load, swap between tasks, serve, stand aside, close."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.errors import ModelUnavailable
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.standin import EMBEDDER_FILE, make_embedder_model, write_model
from workers.reload.holder import ModelHolder


def holder(**options: object) -> ModelHolder:
    return ModelHolder(("embedder",), SessionOptions(), Registry.load(), name="host:1", **options)  # type: ignore[arg-type]


def test_a_task_keeps_the_session_it_started_with_across_a_swap(tiny_models: Path, tmp_path: Path) -> None:
    h = holder()
    first = h.load("embedder", tiny_models / EMBEDDER_FILE)
    assert h.swap("embedder", first, generation=1) is None
    other = tmp_path / EMBEDDER_FILE
    write_model(make_embedder_model("tiny", seed=3), other)
    second = h.load("embedder", other)
    with h.serving(["embedder"]) as sessions:
        assert h.swap("embedder", second, generation=None) is first
        assert sessions["embedder"] is first  # the running task's snapshot
    with h.serving(["embedder"]) as sessions:
        assert sessions["embedder"] is second
    described = h.describe()
    assert described["models"]["embedder"]["sha256"] == second.sha256
    assert described["models"]["embedder"]["generation"] is None  # not the published file
    assert described["tasks_done"] == 2 and described["tasks_last_minute"] == 2


def test_a_role_without_a_session_says_why() -> None:
    h = holder()
    h.unavailable("embedder", "model folder models does not exist")
    with (
        pytest.raises(ModelUnavailable, match="worker host:1 has no embedder model .*does not exist"),
        h.serving(["embedder"]),
    ):
        pass
    assert h.describe()["load_errors"] == {"embedder": "model folder models does not exist"}


def test_standing_aside_holds_new_tasks_until_rejoining(tiny_models: Path) -> None:
    h = holder()
    h.swap("embedder", h.load("embedder", tiny_models / EMBEDDER_FILE), generation=1)
    h.stand_aside()
    assert h.describe()["aside"] is True
    served = threading.Event()

    def task() -> None:
        with h.serving(["embedder"]):
            served.set()

    thread = threading.Thread(target=task)
    thread.start()
    assert not served.wait(0.3)
    h.rejoin()
    assert served.wait(5)
    thread.join()


def test_a_task_waits_for_a_process_standing_aside_at_most_the_limit(tiny_models: Path) -> None:
    h = holder(aside_wait_max_s=0.2)
    h.swap("embedder", h.load("embedder", tiny_models / EMBEDDER_FILE), generation=1)
    h.stand_aside()
    with h.serving(["embedder"]) as sessions:  # waited 0.2 s, then served
        assert "embedder" in sessions
    assert h.describe()["aside"] is False


def test_drain_waits_for_the_running_task(tiny_models: Path) -> None:
    h = holder()
    h.swap("embedder", h.load("embedder", tiny_models / EMBEDDER_FILE), generation=1)
    may_end, started, drained = threading.Event(), threading.Event(), threading.Event()

    def task() -> None:
        with h.serving(["embedder"]):
            started.set()
            may_end.wait(10)

    threading.Thread(target=task).start()
    assert started.wait(5)
    drainer = threading.Thread(target=lambda: (h.drain(10), drained.set()))
    drainer.start()
    assert not drained.wait(0.3)
    may_end.set()
    assert drained.wait(5)
    h.close()
    assert h.describe()["models"] == {}
