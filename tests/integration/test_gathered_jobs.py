"""A real `--pool threads` worker gathering concurrent single jobs' tokens into shared batches
(issue 33, item 5), on the CPU: the plumbing and the exactness; its speed is a GPU's to show."""

from __future__ import annotations

from pathlib import Path

import redis

from pipeline.inference import open_session, run_clip
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.standin import TOKENIZER_BATCH_FILE, TOKENIZER_FILE
from pipeline.settings import AudioLimits
from tests.conftest import WorkerFactory, make_settings, wait_for
from tests.helpers import make_audio_folder, reexported, worker_dicts
from workers.queue.client import Client


def test_a_threads_worker_gathers_concurrent_jobs_into_one_batch(
    redis_url: str, tiny_models: Path, tmp_path: Path, start_worker: WorkerFactory
) -> None:
    audio = make_audio_folder(tmp_path / "audio", 8, 0.8, 2.5, seed=21)
    paths = sorted(audio.rglob("*.wav"))
    # A leader waits up to 3 s for the jobs running beside it.
    settings = make_settings(redis_url, tiny_models, [audio], batch_gather_ms=3000.0, batch_max_clip_s=3.0)
    start_worker(settings, concurrency=4, queues=("tokenize",), pool="threads", wait=False)
    broker = redis.Redis.from_url(redis_url)
    wait_for(lambda: any(r.get("models") for r in worker_dicts(broker)), timeout_s=120)
    results = Client(settings).run("tokenize", paths, timeout_s=120)

    single = open_session(
        tiny_models / TOKENIZER_FILE, "tokenizer", SessionOptions(provider="cpu"), Registry.load()
    )
    expected = [run_clip(p.name, p, "tokenize", {"tokenizer": single}, AudioLimits()) for p in paths]
    assert [r.error for r in results] == [None] * len(paths)
    assert [r.speech_token for r in results] == [e.speech_token for e in expected]
    files = [r.models["tokenizer"].file for r in results]
    assert files.count(TOKENIZER_BATCH_FILE) >= 2, files  # jobs that ran side by side shared batches


def test_a_worker_reloads_a_batch_file_that_changed(
    redis_url: str, tiny_models: Path, tmp_path: Path, start_worker: WorkerFactory
) -> None:
    import hashlib
    import shutil

    folder, other = tmp_path / "models", tmp_path / "other"
    shutil.copytree(tiny_models, folder)
    other.mkdir()
    reexported(tiny_models / TOKENIZER_BATCH_FILE, other / TOKENIZER_BATCH_FILE)  # same weights, new bytes
    settings = make_settings(redis_url, folder, [tmp_path], worker_reload_check_s=0.2, batch_max_clip_s=3.0)
    start_worker(settings, queues=("tokenize",))
    broker = redis.Redis.from_url(redis_url)

    def batch_sha() -> str | None:
        records = [r for r in worker_dicts(broker) if r.get("models", {}).get("tokenizer")]
        return records[0]["models"]["tokenizer"].get("batch_file", {}).get("sha256") if records else None

    assert batch_sha() == hashlib.sha256((folder / TOKENIZER_BATCH_FILE).read_bytes()).hexdigest()
    shutil.copy(other / TOKENIZER_BATCH_FILE, folder / TOKENIZER_BATCH_FILE)  # the watcher publishes nothing
    new = hashlib.sha256((other / TOKENIZER_BATCH_FILE).read_bytes()).hexdigest()
    wait_for(lambda: batch_sha() == new, timeout_s=60)
