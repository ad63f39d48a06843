"""The memory safety net on a real worker: a pool process whose peak memory passed
`worker_max_memory_per_child_kb` on a 10-minute clip is replaced after that task, every job is
answered, and the replacement has loaded its model before it takes the next one.

One worker process (`-Q embed`, the full-size embedder, whose 10-minute clip peaks far above its
flat memory) on the test Redis; the bound sits between the two.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
import soundfile as sf

from pipeline.demo import speechlike
from tests.conftest import make_settings, wait_for
from tests.helpers import worker_dicts
from workers.queue.client import Client

pytestmark = pytest.mark.slow
BOUND_KB = 800 * 1024  # a flat embed-only process is well under, one on a 10-minute clip well over
LOADED = re.compile(r"worker \S+:(\d+) loaded embedder")
CRASHED = "exited with"


def pool_pids(client: redis.Redis, parent: int) -> set[int]:
    return {r["pid"] for r in worker_dicts(client) if r.get("ppid") == parent}


def test_a_process_over_the_bound_is_replaced_warm_and_no_job_fails(
    redis_url: str, redis_client: redis.Redis, slow_models: Path, tmp_path: Path, start_worker
) -> None:
    audio = tmp_path / "audio"
    audio.mkdir()
    short = []
    for index, seconds in enumerate((4.0, 11.0, 27.0)):
        short.append(audio / f"short{index}.wav")
        sf.write(short[-1], speechlike(seconds, 16000, 120.0 + 20 * index, seed=index), 16000)
    long = audio / "long.wav"
    sf.write(long, speechlike(600.0, 16000, 140.0, seed=9), 16000)
    settings = make_settings(redis_url, slow_models, [audio], worker_max_memory_per_child_kb=BOUND_KB)
    workers = start_worker(settings, concurrency=1, queues=("embed",))
    assert workers.process is not None and workers.log_path is not None
    parent = workers.process.pid
    client = Client(settings)
    try:
        first = wait_for(lambda: pool_pids(redis_client, parent))
        results = client.wait_all(client.submit_many("embed", short), timeout_s=120)
        assert [r.error for r in results] == [None] * 3
        assert pool_pids(redis_client, parent) == first  # under the bound: the same process

        results = client.wait_all(client.submit_many("embed", [long, *short]), timeout_s=300)
        assert [r.error for r in results] == [None] * 4  # nothing failed, the long clip included
        assert all(len(r.embedding or []) == 192 for r in results)
        replaced = wait_for(lambda: pool_pids(redis_client, parent) - first, timeout_s=60)
    finally:
        client.close()
    log = workers.log_path.read_text(errors="replace")
    # Replaced by the bound after its task, not killed: Celery logs a process that died "exited with".
    assert CRASHED not in log, log[-3000:]
    # The replacement loaded (and warmed) its model before the task that followed the long clip.
    after = log[log.index("input=" + str(long)) :]
    new_pid = next(iter(replaced))
    loaded = next(m for m in LOADED.finditer(after) if int(m.group(1)) == new_pid)
    assert after.find("] task ") > loaded.end(), after[-3000:]
