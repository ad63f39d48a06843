"""Every job answered once through the faults a producer meets: a killed pool process, a killed
worker (and its replacement), Redis restarted with and without persistence, Redis unreachable.

Each test runs a worker (2 processes, the full-size embedder: 30 s clips take about 0.4 s each) on
a private Redis, a producer through `Client` submitting batches of jobs and waiting for them, and
one `voxmill submit` of 16 inputs started just before the fault. Then it checks: every job
submitted answered exactly once, without error, well before its producer would give up; the
counts are printed (`-s`) for docs/faults.md. The producer sends again, under the same task id,
what the fault lost (`workers.queue.client`); the workers keep the first result of each task id.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import make_settings
from tests.fault.conftest import PrivateRedis, kill_group, settle
from tests.fault.streams import ClientStream, SubmitRun, Tally, executions, make_clips, wait_submitted
from tests.helpers import worker_dicts
from workers.embedded import LocalWorkers

pytestmark = pytest.mark.slow
QUEUES = ("embed",)
MAX_WAIT_S = 90.0  # the producers give up after 120 s; every job must be answered well before


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clips(tmp_path_factory.mktemp("job-clips"))


@pytest.fixture
def settings(private_redis: PrivateRedis, fault_models: Path, clips: Path):
    # short deadlines; a dead process's record is gone after 8 s (instead of 15 s)
    return make_settings(private_redis.url, fault_models, [clips], job_deadline_min_s=3.0, heartbeat_ttl_s=8)


def streams(settings, clips: Path) -> tuple[ClientStream, list[Path]]:
    stream = ClientStream(settings, sorted(clips.glob("clip*.wav")), batch=6).start()
    return stream, sorted(clips.glob("input*.wav"))


def wait_until_busy(url: str, workers: LocalWorkers, run: SubmitRun, queued: int = 4) -> list[dict]:
    """Until `run` has sent its jobs, a worker process runs one and `queued` more wait; the
    records of the busy processes (the moment for the fault)."""
    client = redis.Redis.from_url(url)
    try:
        assert workers.log_path is not None
        wait_submitted(client, run.files[-1], [workers.log_path])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            records = worker_dicts(client)
            parent = workers.process.pid if workers.process else -1
            busy = [r for r in records if r.get("running") and r.get("ppid") == parent]
            if busy and client.llen("embed") >= queued:
                return busy
            time.sleep(0.02)
    finally:
        client.close()
    raise AssertionError("the worker never got busy")


def report(name: str, stream: Tally, submit: Tally, code: int) -> None:
    print(f"\n{name}: Client stream {stream.counts()}")
    print(f"{name}: voxmill submit (exit {code}) {submit.counts()}")


def finish(stream: ClientStream, run: SubmitRun, name: str, refusals_ok: bool = False) -> tuple[Tally, Tally]:
    code, submitted = run.finish()
    tally = stream.stop()
    report(name, tally, submitted, code)
    tally.check(MAX_WAIT_S)
    submitted.check(MAX_WAIT_S)
    assert code == 0
    if not refusals_ok:
        assert not tally.refused, tally.refused
    return tally, submitted


def test_sigkill_of_one_pool_process(settings, start_worker, clips) -> None:
    workers = start_worker(settings, concurrency=2, queues=QUEUES)
    stream, inputs = streams(settings, clips)
    run = SubmitRun(settings, inputs)
    busy = wait_until_busy(settings.broker_url, workers, run)
    os.kill(busy[0]["pid"], signal.SIGKILL)  # its job goes back to the queue (reject on worker lost)
    settle(6)  # the producer goes on submitting after the fault
    tally, _ = finish(stream, run, "pool process killed")
    assert workers.alive()
    ran = executions(workers.log_path.read_text(), tally.submitted)
    assert set(ran) == tally.submitted  # every job ran ...
    assert stream.client.resent == 0  # ... without the producer's help: Celery requeued the lost one


def test_sigkill_of_a_whole_worker_then_a_new_one(settings, start_worker, clips) -> None:
    first = start_worker(settings, concurrency=2, queues=QUEUES)
    stream, inputs = streams(settings, clips)
    run = SubmitRun(settings, inputs)
    wait_until_busy(settings.broker_url, first, run)
    kill_group(first.process.pid)  # the jobs it held wait an hour in Redis (visibility timeout)
    second = start_worker(settings, concurrency=2, queues=QUEUES)
    settle(6)  # the producer goes on submitting after the fault
    tally, _ = finish(stream, run, "whole worker killed")
    # what the dead worker held came back through its producer (this one's or voxmill submit's):
    # without, it would wait the visibility timeout (an hour) and time out
    print(f"jobs this producer sent again: {stream.client.resent}")
    ran = executions(first.log_path.read_text() + second.log_path.read_text(), tally.submitted)
    assert set(ran) == tally.submitted


@pytest.mark.parametrize(
    ("private_redis", "sig", "down_s", "name"),
    [
        (False, signal.SIGKILL, 0, "Redis restarted empty"),  # queue, results and records gone
        (True, signal.SIGTERM, 0, "Redis restarted with AOF"),
        (True, signal.SIGTERM, 20, "Redis unreachable for 20 s"),
    ],
    indirect=["private_redis"],
    ids=["restart-no-persistence", "restart-aof", "unreachable-20s"],
)
def test_redis_restarted_or_unreachable(
    settings, private_redis, start_worker, clips, sig: int, down_s: float, name: str
) -> None:
    workers = start_worker(settings, concurrency=2, queues=QUEUES)
    stream, inputs = streams(settings, clips)
    run = SubmitRun(settings, inputs)
    wait_until_busy(settings.broker_url, workers, run)
    private_redis.stop(sig)
    settle(down_s)
    private_redis.start()
    settle(6)  # the producer goes on submitting after the fault
    tally, submitted = finish(stream, run, name, refusals_ok=True)  # what was lost was sent again
    print(f"jobs this producer sent again: {stream.client.resent}")
    if down_s:  # the jobs in flight (some producer's) waited the outage out, and were answered
        assert max(tally.longest_wait_s, submitted.longest_wait_s) >= down_s
    assert workers.alive()
