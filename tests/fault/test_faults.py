"""Faults a corpus run must survive: killed workers, restarted or unreachable Redis, killed drivers.

Every test runs `voxmill extract` over 300 utterances against a private Redis, with a producer
submitting `embed` jobs at the same time, injects its fault mid-run, and then checks that the
final outputs equal an undisturbed run's (every utterance exactly once, same features) and that
every submitted job got its answer (the producer sends again what a fault lost). A submit with
no broker or no live consumer is refused at once and counted apart. docs/faults.md summarises
what each test does and loses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis

from tests.fault.conftest import (
    Driver,
    PrivateRedis,
    SubmitStream,
    fault_settings,
    kill_group,
    pool_children,
    settle,
)
from tests.helpers import read_outputs

pytestmark = pytest.mark.slow
QUEUES = ("tokenize", "embed")


@pytest.fixture
def setup(private_redis: PrivateRedis, fault_models: Path, fault_corpus: Path, tmp_path: Path, start_worker):
    settings = fault_settings(private_redis.url, fault_models, fault_corpus, tmp_path)
    wav = next(fault_corpus.rglob("*.wav"))
    return settings, wav, tmp_path / "out"


def rerun(driver: Driver) -> Driver:
    """Kill the driver and start it again on the same folder."""
    driver.kill()
    return Driver(driver.settings, driver.corpus, driver.out, driver.shard_size).start()


def finish_and_check(driver: Driver, stream: SubmitStream, reference: dict) -> dict:
    code, output = driver.finish()
    assert code == 0, output[-3000:]
    assert read_outputs(driver.out) == reference
    # Every job answered, once: what a fault lost, the producer sent again (`Client`).
    counts = stream.finish(timeout_s=60)
    print(f"\nsubmit stream: {counts}, sent again: {stream.client.resent}")
    assert set(counts) <= {"submitted", "refused", "ok"}, counts
    assert counts["ok"] == counts["submitted"]
    return counts


def test_sigkill_of_one_worker_child(setup, start_worker, fault_reference, submit_stream) -> None:
    settings, wav, out = setup
    workers = start_worker(settings, concurrency=2, queues=QUEUES)
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    client = redis.Redis.from_url(settings.broker_url)
    os.kill(pool_children(client, workers.process.pid)[0], signal.SIGKILL)
    driver = rerun(driver)
    finish_and_check(driver, stream, fault_reference)
    assert workers.alive()


def test_sigkill_of_a_whole_worker_then_a_new_one(
    setup, start_worker, fault_reference, submit_stream
) -> None:
    settings, wav, out = setup
    first = start_worker(settings, concurrency=2, queues=QUEUES)
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    kill_group(first.process.pid)
    driver = rerun(driver)
    start_worker(settings, concurrency=2, queues=QUEUES)
    finish_and_check(driver, stream, fault_reference)


def test_all_workers_stopped_for_30_s(setup, start_worker, fault_reference, submit_stream) -> None:
    """The run waits the 30 s out (less than `consumer_grace_s`: workers restarting come back);
    a driver started again while no worker is up exits 2 at once naming the command (`no_consumer`,
    as `submit`), and the same command resumes once a worker is up."""
    settings, wav, out = setup
    workers = start_worker(settings, concurrency=2, queues=QUEUES)
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    workers.stop()
    stopped_at = driver.shards_done()
    settle(30)
    assert driver.shards_done() == stopped_at  # nothing ran while every worker was down
    assert driver.process is not None and driver.process.poll() is None  # and the run waited
    driver.kill()
    code, output = Driver(settings, fault_corpus_of(settings), out).start().finish(timeout_s=60)
    assert code == 2 and "voxmill worker -Q extract" in " ".join(output.split()), output[-3000:]
    start_worker(settings, concurrency=2, queues=QUEUES)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    finish_and_check(driver, stream, fault_reference)


@pytest.mark.parametrize("private_redis", [True], indirect=True, ids=["aof"])
def test_redis_restarted_with_persistence(
    setup, private_redis, start_worker, fault_reference, submit_stream
) -> None:
    settings, wav, out = setup
    start_worker(settings, concurrency=2, queues=QUEUES)
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    private_redis.stop(signal.SIGTERM)
    private_redis.start()
    driver = rerun(driver)
    finish_and_check(driver, stream, fault_reference)


@pytest.mark.parametrize("private_redis", [False], indirect=True, ids=["no-persistence"])
def test_redis_restarted_without_persistence(
    setup, private_redis, start_worker, fault_reference, submit_stream
) -> None:
    settings, wav, out = setup
    start_worker(settings, concurrency=2, queues=QUEUES)
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    private_redis.stop(signal.SIGKILL)  # the queue and every result are gone
    private_redis.start()
    driver = rerun(driver)
    finish_and_check(driver, stream, fault_reference)
    assert stream.client.resent >= 1  # the jobs lost with the queue came back through the producer


@pytest.mark.parametrize("private_redis", [True], indirect=True, ids=["aof"])
def test_redis_unreachable_for_20_s(
    setup, private_redis, start_worker, fault_reference, submit_stream
) -> None:
    settings, wav, out = setup
    workers = start_worker(settings, concurrency=2, queues=QUEUES)
    worker_pids = {p.pid for p in psutil.Process(workers.process.pid).children(recursive=True)}
    stream = submit_stream(settings, wav)
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    driver.wait_progress(6)
    private_redis.stop(signal.SIGTERM)
    cpu_before = driver.cpu_seconds()
    worker_cpu_before = psutil.Process(workers.process.pid).cpu_times().user
    settle(20)
    driver_cpu = driver.cpu_seconds() - cpu_before
    worker_cpu = psutil.Process(workers.process.pid).cpu_times().user - worker_cpu_before
    private_redis.start()
    print(f"\nCPU during the 20 s outage: driver {driver_cpu:.2f} s, worker main process {worker_cpu:.2f} s")
    assert driver_cpu < 4.0 and worker_cpu < 4.0  # backing off, not spinning
    finish_and_check(driver, stream, fault_reference)
    assert workers.alive()
    assert worker_pids <= {p.pid for p in psutil.Process(workers.process.pid).children(recursive=True)}


def test_worker_over_its_memory_limit_is_replaced(setup, start_worker, fault_reference) -> None:
    """Every pool process is over a 1 kB limit, so Celery replaces it after each task.

    The task it ran completes first (Celery checks the limit between tasks), so no shard is
    lost; a process killed mid-shard by the kernel's OOM killer is the SIGKILL case above.
    A stream of jobs is left out here: each job would cost a process restart.
    """
    settings, wav, out = setup
    tight = settings.model_copy(update={"worker_max_memory_per_child_kb": 1})
    workers = start_worker(tight, concurrency=2, queues=QUEUES)
    client = redis.Redis.from_url(settings.broker_url)
    seen = set(pool_children(client, workers.process.pid))
    first = set(seen)
    # 6 shards of 50: six tasks (both ops run as one task per shard), so several replacements.
    driver = Driver(settings, fault_corpus_of(settings), out, shard_size=50).start()
    while driver.process is not None and driver.process.poll() is None:
        seen |= set(pool_children(client, workers.process.pid))
        time.sleep(0.1)
    code, output = driver.finish()
    assert code == 0, output[-3000:]
    assert read_outputs(out) == fault_reference
    print(f"\npool processes seen: {len(seen)} (started with {len(first)})")
    assert len(seen - first) >= 2  # processes were replaced along the way


def test_unwritable_output_folder_is_a_clear_error(setup, start_worker) -> None:
    settings, wav, out = setup
    start_worker(settings, concurrency=2, queues=QUEUES)
    out.mkdir()
    (out / "shards").write_text("a file where the shard folder should be\n")
    driver = Driver(settings, fault_corpus_of(settings), out).start()
    code, output = driver.finish()
    assert code == 2
    assert "output_error" in output or "cannot write" in output.lower() or "not a directory" in output.lower()
    assert not list(out.glob("**/.*.tmp-*"))


def test_disk_full_leaves_no_shard_a_rerun_would_trust(setup, start_worker, tmp_path: Path) -> None:
    settings, wav, out = setup
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        small_out = mount / "out"
        roots = (*settings.allowed_roots, mount)
        full = settings.model_copy(update={"allowed_roots": roots})
        start_worker(full, concurrency=2, queues=QUEUES)
        driver = Driver(full, fault_corpus_of(settings), small_out).start()
        code, output = driver.finish()
        assert code == 2, output[-2000:]
        assert "No space left" in output or "output_error" in output or "space" in output.lower()
        import pyarrow.parquet as pq

        # The run ended at the first failed shard; a worker may still be writing another: its
        # temporary file must go (renamed when complete, removed when the disk refused it).
        deadline = time.monotonic() + 20
        while list(small_out.glob("**/.*.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(small_out.glob("**/.*.tmp-*"))
        for shard in (small_out / "shards").glob("*.parquet"):
            pq.read_table(shard)  # every shard file left is complete
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fault_corpus_of(settings) -> Path:
    return Path(settings.allowed_roots[0])
