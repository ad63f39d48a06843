"""Load and soak: many tiny-model jobs through real workers, nothing lost, nothing duplicated,
memory flat; then a producer queueing far more than the workers can take.

    python -m benchmarks.soak                       # 10,000 jobs, 100,000 queued (about 5 minutes)
    python -m benchmarks.soak --jobs 1000 --queued 10000 --result-expires-s 10   # a quick look

Everything runs against a private Redis (`workers.embedded.EmbeddedRedis`) on a free port, with
tiny stand-in models and 24 WAVs of every length (`CLIP_SECONDS`: 0.5-30 s, and one of 90 s)
sent by path, ops mixed (tokenize, embed, extract in turn). Phases:

1. warm-up: `--warmup` jobs through `--workers` worker processes (one Celery worker, prefork),
   then each op on the 90 s clip once per process; their results are read and deleted, then each
   process's RSS and Redis `used_memory` are the baseline.
2. soak: `--jobs` jobs submitted with `workers.queue.client.Client.submit`; results are polled by
   task id with MGET and *not* deleted, so they stay until `result_expires_s` (set short) runs
   out. Lost: a submitted id without a SUCCESS result, or a result carrying an error.
   Duplicated: an id that the workers' per-task log line ("task <id> op=...") shows more than
   once, or a result key that was never submitted. Redis memory is sampled while it runs (peak).
3. expiry: wait until no result key is left; Redis memory then, against the baseline. Worker RSS
   after the run against after warm-up (target: growth < 10 %), and the same PIDs.
4. queued: `--queued` jobs from one producer (the same `Client.submit` loop) in ten chunks that
   alternate between the workers consuming and not consuming (their consumers cancelled by
   Celery remote control: the processes stay up, idle), so both conditions share whatever else
   happens meanwhile (an AOF rewrite, other load). The producer's submit rate in each (target:
   slowed by at most 2x by the workers), Redis memory after each chunk, and, once the results of
   the jobs that ran have expired, bytes of Redis memory per queued job; then the queues are
   purged and memory must come back to its start.

It prints a table and writes `benchmarks/results/soak.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
import soundfile as sf

from pipeline.demo import speechlike
from pipeline.models.standin import make_standins
from pipeline.settings import Settings
from workers.embedded import EmbeddedRedis, LocalWorkers
from workers.heartbeat import read_worker_records
from workers.keys import QUEUES
from workers.queue.client import Client, Job

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OPS = ("tokenize", "embed", "extract")
# Lengths of every kind, so memory is watched over many input shapes: 23 log-uniform in 0.5-30 s,
# and one of 90 s (tokenized in windows; the embedder's arena shrinks after it).
_LENGTHS = random.Random(35)
CLIP_SECONDS = (
    *(round(math.exp(_LENGTHS.uniform(math.log(0.5), math.log(30.0))), 2) for _ in range(23)),
    90.0,
)
RESULT_PREFIX = "celery-task-meta-"
TASK_LINE = re.compile(r"\] task (\S+) op=")
MGET_BATCH = 500
SUBMIT_CHUNK = 50
POLL_S = 0.25
RSS_TARGET = 0.10
MB = 1024 * 1024


@dataclass
class Soak:
    """A private Redis, one worker with `workers` pool processes, a client, and where logs go."""

    folder: Path
    workers_count: int
    result_expires_s: int
    redis_server: EmbeddedRedis | None = None
    workers: LocalWorkers | None = None
    settings: Settings | None = None
    client: Client | None = None
    redis: redis.Redis | None = None
    clips: list[Path] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.folder / "workers.log"

    def start(self) -> Soak:
        audio = self.folder / "audio"
        audio.mkdir(parents=True, exist_ok=True)
        self.clips = make_clips(audio)
        models = self.folder / "models"
        make_standins(models, profile="tiny", seed=0)
        self.redis_server = EmbeddedRedis(data_dir=self.folder / "redis").start()
        self.settings = Settings(
            broker_url=self.redis_server.url,
            model_dir=models,
            speech_check=False,  # generated clips are not speech
            allowed_roots=(audio,),
            result_expires_s=self.result_expires_s,
            log_level="INFO",
        )
        self.redis = redis.Redis.from_url(self.redis_server.url)
        self.client = Client(self.settings)
        self.start_workers()
        return self

    def start_workers(self) -> None:
        assert self.settings is not None
        self.workers = LocalWorkers(self.settings, self.workers_count, QUEUES, log_path=self.log_path)
        self.workers.start()
        self.workers.wait_ready(180)

    def stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    def stop(self) -> None:
        self.stop_workers()
        if self.redis is not None:
            self.redis.close()
        if self.redis_server is not None:
            self.redis_server.stop()

    def pids(self) -> list[int]:
        """The worker's pool processes (from their heartbeats)."""
        assert self.redis is not None and self.workers is not None and self.workers.process is not None
        parent = self.workers.process.pid
        return sorted(r.pid for r in read_worker_records(self.redis) if r.ppid == parent)

    def used_memory(self) -> int:
        assert self.redis is not None
        return int(self.redis.info("memory")["used_memory"])

    def purge_queues(self) -> None:
        assert self.redis is not None
        self.redis.delete(*QUEUES)


@contextmanager
def soak_cluster(folder: Path | None, workers: int, result_expires_s: int) -> Iterator[Soak]:
    """A started `Soak` in `folder` (default: a temporary folder), stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="voxmill-soak-") as tmp:
        soak = Soak(folder or Path(tmp), workers, result_expires_s)
        try:
            yield soak.start()
        finally:
            soak.stop()


def make_clips(folder: Path) -> list[Path]:
    """Speech-like 16 kHz WAVs, one per length in `CLIP_SECONDS`."""
    clips = []
    for index, seconds in enumerate(CLIP_SECONDS):
        path = folder / f"clip{index}.wav"
        sf.write(path, speechlike(seconds, 16000, 110.0 + 30 * index, seed=index), 16000, subtype="PCM_16")
        clips.append(path)
    return clips


def rss_bytes(pids: list[int]) -> dict[int, int]:
    return {pid: psutil.Process(pid).memory_info().rss for pid in pids}


def submit(
    soak: Soak, count: int, offset: int = 0, watch: ResultWatch | None = None
) -> tuple[list[Job], float]:
    """Queue `count` jobs (ops and clips in turn) by path; the jobs and the seconds it took.

    With `watch`, its results are polled every `SUBMIT_CHUNK` jobs: a result lives only
    `result_expires_s`, and on a loaded machine submitting takes longer than that."""
    assert soak.client is not None
    started = time.perf_counter()
    jobs: list[Job] = []
    for i in range(offset, offset + count):
        jobs.append(soak.client.submit(OPS[i % len(OPS)], soak.clips[(i // len(OPS)) % len(soak.clips)]))
        if watch is not None and len(jobs) % SUBMIT_CHUNK == 0:
            watch.add(jobs[-SUBMIT_CHUNK:])
            watch.poll()
    if watch is not None:
        watch.add(jobs[len(jobs) - len(jobs) % SUBMIT_CHUNK :])
    return jobs, time.perf_counter() - started


@dataclass
class Collected:
    """Final results of a set of jobs, read without deleting them."""

    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    missing: list[str] = field(default_factory=list)
    peak_memory: int = 0
    seconds: float = 0.0


@dataclass
class ResultWatch:
    """The jobs whose final state has not been read yet, and what was read of the others."""

    soak: Soak
    delete: bool = False
    pending: dict[str, Job] = field(default_factory=dict)
    out: Collected = field(default_factory=Collected)
    added: int = 0

    def add(self, jobs: list[Job]) -> None:
        self.pending.update((job.id, job) for job in jobs)
        self.added += len(jobs)

    def poll(self) -> int:
        """Read every pending result key once; the number of jobs finished so far."""
        assert self.soak.client is not None and self.soak.redis is not None
        backend = self.soak.client.app.backend
        ids = list(self.pending)
        for start in range(0, len(ids), MGET_BATCH):
            batch = ids[start : start + MGET_BATCH]
            keys = [backend.get_key_for_task(task_id) for task_id in batch]
            done_keys = []
            for task_id, key, raw in zip(batch, keys, self.soak.redis.mget(keys), strict=True):
                if raw is None:
                    continue
                meta = json.loads(raw)
                if meta.get("status") not in ("SUCCESS", "FAILURE", "REVOKED"):
                    continue
                self.out.statuses[meta["status"]] += 1
                result = meta.get("result")
                if isinstance(result, dict) and result.get("error"):
                    self.out.errors[result["error"]["code"]] += 1
                del self.pending[task_id]
                done_keys.append(key)
            if self.delete and done_keys:
                self.soak.redis.delete(*done_keys)
        self.out.peak_memory = max(self.out.peak_memory, self.soak.used_memory())
        return self.added - len(self.pending)


def collect(
    soak: Soak,
    jobs: list[Job],
    timeout_s: float,
    delete: bool = False,
    on_poll: Callable[[int], None] | None = None,
    watch: ResultWatch | None = None,
) -> Collected:
    """Poll the result keys of `jobs` until each has a final state (or the deadline); sample memory.

    `on_poll(done)` runs after every poll with the number of jobs finished so far; `watch`: the
    one `submit` already polled while it queued `jobs`.
    """
    if watch is None:
        watch = ResultWatch(soak, delete)
        watch.add(jobs)
    watch.out.peak_memory = max(watch.out.peak_memory, soak.used_memory())
    started = time.monotonic()
    while watch.pending and time.monotonic() - started < timeout_s:
        done = watch.poll()
        if on_poll is not None:
            on_poll(done)
        if watch.pending:
            time.sleep(POLL_S)
    watch.out.missing = sorted(watch.pending)
    watch.out.seconds = time.monotonic() - started
    return watch.out


def result_keys(soak: Soak) -> list[str]:
    assert soak.redis is not None
    return [k.decode() for k in soak.redis.scan_iter(match=RESULT_PREFIX + "*", count=1000)]


def executions(log_path: Path) -> Counter[str]:
    """How many times the workers ran each task id, from their one log line per task."""
    counts: Counter[str] = Counter()
    with log_path.open(errors="replace") as log:
        for line in log:
            match = TASK_LINE.search(line)
            if match:
                counts[match.group(1)] += 1
    return counts


def wait_for_expiry(soak: Soak, timeout_s: float) -> float:
    """Seconds until no result key is left (Redis expires them itself; nothing is deleted here)."""
    started = time.monotonic()
    while result_keys(soak) and time.monotonic() - started < timeout_s:
        time.sleep(0.5)
    return time.monotonic() - started


# --------------------------------------------------------------------------- phases


def warm_up(soak: Soak, count: int) -> dict[str, Any]:
    """`count` jobs in turn, then each op on the longest clip once per worker process: jobs in turn
    reach a process by chance, and a process meeting the longest clip only after the baseline
    grows its arenas once then, which reads as a leak."""
    watch = ResultWatch(soak, delete=True)
    jobs, _ = submit(soak, count, watch=watch)
    done = collect(soak, jobs, timeout_s=300, watch=watch)
    longest = soak.clips[CLIP_SECONDS.index(max(CLIP_SECONDS))]
    for op in OPS:  # sent together, one reaches each idle process (prefetch 1, fair scheduling)
        assert soak.client is not None
        together = [soak.client.submit(op, longest) for _ in range(soak.workers_count)]
        longest_done = collect(soak, together, timeout_s=300, delete=True)
        done.missing += longest_done.missing
        done.errors.update(longest_done.errors)
    if done.missing or done.errors:
        raise RuntimeError(f"warm-up failed: {len(done.missing)} missing, errors {dict(done.errors)}")
    time.sleep(1.0)  # let the last tasks' memory settle before the baseline
    pids = soak.pids()
    return {"jobs": count, "pids": pids, "rss": rss_bytes(pids), "redis_used_memory": soak.used_memory()}


def soak_phase(
    soak: Soak, count: int, baseline: dict[str, Any], collect_timeout_s: float | None = None
) -> dict[str, Any]:
    """`count` jobs: lost, duplicated, throughput, RSS growth, Redis memory at peak and after expiry."""
    timeline: list[dict[str, Any]] = []
    every = max(1, count // 10)

    def sample_rss(done: int) -> None:
        if done >= every * (len(timeline) + 1) or done == count:
            rss = rss_bytes(baseline["pids"])
            timeline.append({"done": done, "rss_mb": {str(p): round(v / MB, 1) for p, v in rss.items()}})

    started = time.perf_counter()
    watch = ResultWatch(soak)
    jobs, submit_s = submit(soak, count, offset=baseline["jobs"], watch=watch)
    done = collect(
        soak, jobs, timeout_s=collect_timeout_s or max(600.0, count / 5), on_poll=sample_rss, watch=watch
    )
    wall_s = time.perf_counter() - started
    submitted = {job.id for job in jobs}
    stored = set(result_keys(soak))
    foreign = sorted(k for k in stored if k.removeprefix(RESULT_PREFIX) not in submitted)
    runs = executions(soak.log_path)
    duplicated = sorted(task_id for task_id in submitted if runs[task_id] > 1)
    never_ran = sorted(task_id for task_id in submitted if runs[task_id] == 0)
    time.sleep(1.0)
    pids = soak.pids()
    rss_after = rss_bytes(pids)
    growth = {
        str(pid): round((rss_after[pid] - baseline["rss"][pid]) / baseline["rss"][pid], 4)
        for pid in pids
        if pid in baseline["rss"]
    }
    expiry_s = wait_for_expiry(soak, timeout_s=soak.result_expires_s + 120)
    memory_after = soak.used_memory()
    return {
        "jobs": count,
        "ops": list(OPS),
        "submit_s": round(submit_s, 3),
        "wall_s": round(wall_s, 3),
        "jobs_per_s": round(count / wall_s, 1),
        "succeeded": done.statuses.get("SUCCESS", 0) - sum(done.errors.values()),
        "statuses": dict(done.statuses),
        "errors": dict(done.errors),
        "lost": len(done.missing) + sum(done.errors.values()) + done.statuses.get("FAILURE", 0),
        "missing_ids": done.missing[:20],
        "missing_that_ran": sum(1 for task_id in done.missing if runs[task_id]),  # result expired unread
        "duplicated": len(duplicated) + len(foreign),
        "duplicated_ids": (duplicated + foreign)[:20],
        "never_logged": len(never_ran),
        "same_worker_pids": pids == baseline["pids"],
        "worker_pids": pids,
        "rss_after_warmup_mb": {str(p): round(v / MB, 1) for p, v in baseline["rss"].items()},
        "rss_after_run_mb": {str(p): round(v / MB, 1) for p, v in rss_after.items()},
        "rss_growth": growth,
        "rss_growth_max": max(growth.values()) if growth else None,
        "rss_timeline": timeline,
        "redis_used_memory": {
            "before": baseline["redis_used_memory"],
            "peak": done.peak_memory,
            "after_expiry": memory_after,
        },
        "result_expires_s": soak.result_expires_s,
        "expiry_wait_s": round(expiry_s, 1),
        "result_keys_left": len(result_keys(soak)),
    }


def redis_memory(soak: Soak) -> dict[str, int]:
    """used_memory, the dataset part of it, the AOF buffers, and whether an AOF rewrite runs."""
    assert soak.redis is not None
    memory = soak.redis.info("memory")
    persistence = soak.redis.info("persistence")
    return {
        "used_memory": int(memory["used_memory"]),
        "used_memory_dataset": int(memory["used_memory_dataset"]),
        "mem_aof_buffer": int(memory.get("mem_aof_buffer", 0)),
        "aof_rewrite_in_progress": int(persistence.get("aof_rewrite_in_progress", 0)),
    }


def queue_length(soak: Soak) -> int:
    assert soak.redis is not None
    return sum(int(soak.redis.llen(q)) for q in QUEUES)


def set_consuming(soak: Soak, on: bool) -> None:
    """Let the workers take jobs from every queue, or stop them taking any (they stay up, idle)."""
    assert soak.client is not None
    control = soak.client.app.control
    for queue in QUEUES:
        if on:
            control.add_consumer(queue, reply=True, limit=1, timeout=10)
        else:
            control.cancel_consumer(queue, reply=True, limit=1, timeout=10)


def wait_for_aof_rewrite(soak: Soak, timeout_s: float = 300.0) -> None:
    """Until no AOF rewrite runs (its buffer counts in used_memory while it does)."""
    assert soak.redis is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = soak.redis.info("persistence")
        if not int(info.get("aof_rewrite_in_progress", 0)) and not int(info.get("aof_rewrite_scheduled", 0)):
            return
        time.sleep(0.5)


def queued_phase(soak: Soak, count: int, chunks: int = 10) -> dict[str, Any]:
    """Producer rate with workers consuming vs not, in alternating chunks; Redis bytes per queued job.

    Chunks alternate so that both conditions share whatever else happens meanwhile (AOF
    rewrites, other load on the machine). "Not consuming" is the workers' consumers cancelled
    (Celery remote control): the processes stay up, idle, as if there were none.
    """
    wait_for_aof_rewrite(soak)
    base = redis_memory(soak)
    size = count // chunks
    rates: dict[str, list[float]] = {"with_workers": [], "without_workers": []}
    checkpoints = []
    for chunk in range(chunks):
        consuming = chunk % 2 == 0
        set_consuming(soak, consuming)
        _, seconds = submit(soak, size, offset=chunk * size)
        rates["with_workers" if consuming else "without_workers"].append(size / seconds)
        checkpoints.append(
            {"submitted": (chunk + 1) * size, "queued": queue_length(soak), **redis_memory(soak)}
        )
    set_consuming(soak, False)
    wait_for_expiry(soak, timeout_s=soak.result_expires_s + 120)  # results of the jobs that did run
    wait_for_aof_rewrite(soak)
    queued = queue_length(soak)
    full = redis_memory(soak)
    soak.purge_queues()
    wait_for_aof_rewrite(soak)
    after_purge = redis_memory(soak)
    set_consuming(soak, True)
    rate_with = statistics.median(rates["with_workers"])
    rate_without = statistics.median(rates["without_workers"])
    return {
        "jobs": size * chunks,
        "chunks": chunks,
        "producer_jobs_per_s_with_workers": round(rate_with, 1),
        "producer_jobs_per_s_without_workers": round(rate_without, 1),
        "producer_rates_per_chunk": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "slowdown": round(rate_without / rate_with, 3),
        "queued_at_end": queued,
        "consumed_while_producing": size * chunks - queued,
        "redis_memory_base": base,
        "redis_memory_checkpoints": checkpoints,
        "redis_memory_queued": full,
        "redis_memory_after_purge": after_purge,
        "bytes_per_queued_job": round((full["used_memory"] - base["used_memory"]) / max(1, queued), 1),
        "dataset_bytes_per_queued_job": round(
            (full["used_memory_dataset"] - base["used_memory_dataset"]) / max(1, queued), 1
        ),
        "peak_used_memory": max(c["used_memory"] for c in checkpoints),
        "aof_rewrite_seen": any(c["aof_rewrite_in_progress"] for c in checkpoints),
    }


def run(
    jobs: int,
    queued: int,
    workers: int = 2,
    warmup: int = 300,
    result_expires_s: int = 30,
    folder: Path | None = None,
    collect_timeout_s: float | None = None,
) -> dict[str, Any]:
    """All phases; the dict written to `soak.json` (`collect_timeout_s`: how long the soak phase
    waits for its results, by default 600 s or 0.2 s a job)."""
    started = time.time()
    with soak_cluster(folder, workers, result_expires_s) as soak:
        baseline = warm_up(soak, warmup)
        report: dict[str, Any] = {
            "machine": {
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "workers": workers,
            "clip_seconds": list(CLIP_SECONDS),
            "warmup_jobs": warmup,
            "soak": soak_phase(soak, jobs, baseline, collect_timeout_s),
        }
        if queued:
            report["queued"] = queued_phase(soak, queued)
    report["total_s"] = round(time.time() - started, 1)
    return report


# --------------------------------------------------------------------------- report


def mb(value: int) -> str:
    return f"{value / MB:.2f} MB"


def table(report: dict[str, Any]) -> str:
    s = report["soak"]
    memory = s["redis_used_memory"]
    rows = [
        ("soak jobs (tiny models, by path, ops mixed)", f"{s['jobs']} through {report['workers']} workers"),
        ("throughput", f"{s['jobs_per_s']} jobs/s ({s['wall_s']} s)"),
        ("lost / duplicated", f"{s['lost']} / {s['duplicated']}"),
        ("same worker PIDs at the end", str(s["same_worker_pids"])),
        ("worker RSS after warm-up", ", ".join(f"{v} MB" for v in s["rss_after_warmup_mb"].values())),
        ("worker RSS after the run", ", ".join(f"{v} MB" for v in s["rss_after_run_mb"].values())),
        ("RSS growth (max; target < 10 %)", f"{100 * (s['rss_growth_max'] or 0):.2f} %"),
        ("Redis used_memory before", mb(memory["before"])),
        ("Redis used_memory at peak", mb(memory["peak"])),
        (
            f"Redis used_memory after results expired ({s['result_expires_s']} s TTL)",
            f"{mb(memory['after_expiry'])} ({memory['after_expiry'] - memory['before']:+d} bytes)",
        ),
    ]
    if "queued" in report:
        q = report["queued"]
        base, full, purged = q["redis_memory_base"], q["redis_memory_queued"], q["redis_memory_after_purge"]
        rows += [
            ("queued jobs (alternating chunks)", f"{q['jobs']} in {q['chunks']} chunks"),
            ("producer rate, workers consuming (median)", f"{q['producer_jobs_per_s_with_workers']} jobs/s"),
            (
                "producer rate, no worker consuming (median)",
                f"{q['producer_jobs_per_s_without_workers']} jobs/s",
            ),
            ("slowdown (target <= 2x)", f"{q['slowdown']}x"),
            (
                "Redis bytes per queued job",
                f"{q['bytes_per_queued_job']} (dataset {q['dataset_bytes_per_queued_job']})",
            ),
            (f"Redis with {q['queued_at_end']} queued", mb(full["used_memory"])),
            (
                "Redis peak while producing",
                f"{mb(q['peak_used_memory'])} (AOF rewrite seen: {q['aof_rewrite_seen']})",
            ),
            (
                "Redis after purging the queue",
                f"{mb(purged['used_memory'])} (base {mb(base['used_memory'])})",
            ),
        ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--result-expires-s", type=int, default=30)
    parser.add_argument("--keep", type=Path, default=None, help="Keep logs and Redis data in this folder.")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    args = parser.parse_args()
    report = run(args.jobs, args.queued, args.workers, args.warmup, args.result_expires_s, args.keep)
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
