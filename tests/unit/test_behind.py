"""Writes behind the caller (`pipeline.storage.behind`) and what a shard task decides around them:
whether to look for its file first, and how long its id stays in the heartbeat record."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.settings import Settings
from pipeline.storage.behind import BackgroundWrites
from workers.queue.tasks import may_be_written
from workers.worker import WorkerProcess


def test_writes_run_in_order_behind_the_caller_and_close_waits_for_them() -> None:
    done: list[int] = []
    release = threading.Event()
    writes = BackgroundWrites(limit=3)

    def write(n: int) -> Any:
        def run() -> None:
            release.wait(5)
            done.append(n)

        return run

    for n in range(3):
        writes.submit(write(n))  # returns at once: the writes wait behind
    assert done == [] and writes.pending == 3
    release.set()
    assert writes.close(5)
    assert done == [0, 1, 2] and writes.pending == 0


def test_a_submit_beyond_the_limit_waits_for_the_oldest_write() -> None:
    release = threading.Event()
    writes = BackgroundWrites(limit=1)
    writes.submit(lambda: release.wait(5))
    submitted = threading.Event()
    third = threading.Thread(target=lambda: (writes.submit(lambda: None), submitted.set()))
    third.start()
    assert not submitted.wait(0.3)  # one write pending: the next submit waits
    release.set()
    assert submitted.wait(5)
    third.join()
    assert writes.close(5)


def test_a_failing_write_does_not_stop_the_writes_after_it(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []
    writes = BackgroundWrites(limit=2)

    def fail() -> None:
        raise OSError("store gone")

    writes.submit(fail)
    writes.submit(lambda: done.append("after"))
    assert writes.close(5)
    assert done == ["after"]
    assert "a background write failed" in caplog.text


def test_close_says_when_writes_are_left() -> None:
    release = threading.Event()
    writes = BackgroundWrites(limit=1)
    writes.submit(lambda: release.wait(5))
    started = time.monotonic()
    assert not writes.close(0.2)
    assert time.monotonic() - started < 2
    release.set()


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BackgroundWrites(0)


def _task(redelivered: bool | None = None) -> Any:
    info = {} if redelivered is None else {"redelivered": redelivered}
    return SimpleNamespace(request=SimpleNamespace(delivery_info=info))


@pytest.mark.parametrize(
    ("payload", "redelivered", "look"),
    [
        ({"attempt": 1}, None, False),  # the driver's first send: nothing can be there yet
        ({"attempt": 1}, True, True),  # the broker delivers it again: an earlier run may have written it
        ({"attempt": 2}, None, True),  # sent again by the driver
        ({}, None, True),  # a payload that does not say (an older driver)
        ({"attempt": "1"}, None, True),
        ("not a dict", None, True),
    ],
)
def test_a_shard_looks_for_its_file_first_unless_it_is_a_first_delivery(
    payload: Any, redelivered: bool | None, look: bool
) -> None:
    assert may_be_written(payload, _task(redelivered)) is look


def test_an_id_stays_running_while_its_task_or_its_upload_runs() -> None:
    process = WorkerProcess(Settings())
    process.task_started("a")  # the task
    process.task_started("a")  # its upload, behind it
    process.task_finished("a")  # the task ends
    assert process.running_ids() == ["a"]
    process.task_finished("a")  # the file is written
    assert process.running_ids() == []
    process.task_finished("a")  # a stray end counts nothing below zero
    process.task_started("a")
    assert process.running_ids() == ["a"]
