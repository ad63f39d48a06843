"""A reduced `benchmarks.soak`: 1,000 jobs through 2 workers and 5,000 queued ones, on a private Redis,
over clips of every length (0.5-30 s, and one of 90 s: `soak.CLIP_SECONDS`).

Asserted: nothing lost, nothing duplicated, the same worker processes at the end, worker RSS
growth under 10 %, Redis memory back near its start once results expire and once the queue is
purged, and a bounded cost per queued job. Rates and durations are recorded, never asserted
(`python -m benchmarks.soak` measures them at full size).
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import soak

JOBS = 1000
QUEUED = 5000
RESULT_EXPIRES_S = 10
MAX_BYTES_PER_QUEUED_JOB = 4096  # a Celery JSON message for a path job is about 1 KB


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # Waits less than pytest's timeout, so that a job missing is reported by the tests below.
    return soak.run(
        JOBS, QUEUED, workers=2, warmup=200, result_expires_s=RESULT_EXPIRES_S, collect_timeout_s=180
    )


@pytest.mark.slow
def test_no_job_is_lost_or_run_twice(report: dict[str, Any]) -> None:
    run = report["soak"]
    assert run["lost"] == 0, (run["missing_ids"], run["missing_that_ran"])
    assert run["duplicated"] == 0, run["duplicated_ids"]
    assert run["never_logged"] == 0
    assert run["succeeded"] == JOBS and run["statuses"] == {"SUCCESS": JOBS}


@pytest.mark.slow
def test_workers_survive_and_their_memory_stays_flat(report: dict[str, Any]) -> None:
    lengths = report["clip_seconds"]
    assert len(set(lengths)) >= 20 and min(lengths) < 1.0 and max(lengths) > 30.0  # many input shapes
    run = report["soak"]
    assert run["same_worker_pids"] and len(run["worker_pids"]) == 2
    assert run["rss_growth_max"] is not None and run["rss_growth_max"] < soak.RSS_TARGET, run["rss_growth"]


@pytest.mark.slow
def test_redis_memory_returns_once_results_expire(report: dict[str, Any]) -> None:
    run = report["soak"]
    memory = run["redis_used_memory"]
    assert run["result_keys_left"] == 0
    assert memory["peak"] > memory["before"]  # the results did take room ...
    assert memory["after_expiry"] - memory["before"] <= 0.1 * (
        memory["peak"] - memory["before"]
    )  # ... no more


@pytest.mark.slow
def test_queued_jobs_cost_bounded_memory_and_it_comes_back(report: dict[str, Any]) -> None:
    queued = report["queued"]
    assert queued["jobs"] == QUEUED and queued["queued_at_end"] > QUEUED // 2
    assert 0 < queued["bytes_per_queued_job"] < MAX_BYTES_PER_QUEUED_JOB
    base = queued["redis_memory_base"]["used_memory"]
    grown = queued["redis_memory_queued"]["used_memory"] - base
    assert queued["redis_memory_after_purge"]["used_memory"] - base <= 0.1 * grown
