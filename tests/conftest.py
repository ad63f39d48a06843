"""Shared fixtures: a real Redis, tiny stand-in models, settings, and real worker processes.

Redis: the server on 127.0.0.1:6379 when it answers (database 11, flushed around each use),
else a private `redis-server` started here. Workers are real `celery worker` subprocesses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from pipeline.models.standin import make_embedder_model, make_standins, make_tokenizer_model, write_model
from pipeline.settings import Settings
from workers.embedded import EmbeddedRedis, LocalWorkers

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEST_DB = 11
LOCK_KEY = "voxmill-test-session"


def _system_redis_answers() -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _claim_database() -> int:
    """A database of the system Redis that no other test session holds (sessions may run at once)."""
    for db in (TEST_DB, *range(1, 16)):
        client = redis.Redis(host="127.0.0.1", port=6379, db=db)
        if client.set(LOCK_KEY, os.getpid(), nx=True, ex=3600):
            return db
    raise RuntimeError("every Redis database is claimed by another test session")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis database reserved for this test session."""
    if _system_redis_answers():
        db = _claim_database()
        try:
            yield f"redis://127.0.0.1:6379/{db}"
        finally:
            redis.Redis(host="127.0.0.1", port=6379, db=db).flushdb()
        return
    server = EmbeddedRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    flush_keeping_claim(client)
    yield client
    flush_keeping_claim(client)
    client.close()


def flush_keeping_claim(client: redis.Redis) -> None:
    """Empty the test database but keep this session's claim on it."""
    owner = client.get(LOCK_KEY)
    client.flushdb()
    if owner is not None:
        client.set(LOCK_KEY, owner, ex=3600)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny stand-in tokenizer and embedder (seed 0)."""
    folder = tmp_path_factory.mktemp("models-tiny")
    make_standins(folder, profile="tiny", seed=0)
    return folder


@pytest.fixture(scope="session")
def slow_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny tokenizer + full-size embedder: a corpus run lasts long enough to be interrupted."""
    folder = tmp_path_factory.mktemp("models-slow")
    write_model(make_tokenizer_model("tiny"), folder / "speech_tokenizer_v2.onnx")
    write_model(make_embedder_model("full"), folder / "campplus.onnx")
    return folder


@pytest.fixture(scope="session")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder (an allowed root) holding copies of the reference WAV fixtures."""
    folder = tmp_path_factory.mktemp("audio")
    for wav in FIXTURES.glob("*.wav"):
        shutil.copy(wav, folder / wav.name)
    return folder


def make_settings(redis_url: str, model_dir: Path, roots: list[Path], **overrides: object) -> Settings:
    """Test settings: the test Redis, the given models and roots, fast reload checks."""
    values: dict[str, object] = {
        "broker_url": redis_url,
        "model_dir": model_dir,
        "allowed_roots": tuple(roots),
        "worker_reload_check_s": 0.2,
        "log_level": "INFO",
        # The synthetic fixtures hold no speech; the speech check's tests turn it on.
        "speech_check": False,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


WorkerFactory = Callable[..., LocalWorkers]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start real worker processes; every one is stopped at teardown."""
    started: list[LocalWorkers] = []

    def start(
        settings: Settings,
        concurrency: int = 1,
        queues: tuple[str, ...] = ("tokenize", "embed", "extract"),
        pool: str = "prefork",
        wait: bool = True,
        timeout_s: float = 120.0,
    ) -> LocalWorkers:
        log = tmp_path / f"worker-{len(started)}.log"
        workers = LocalWorkers(settings, concurrency, queues, pool=pool, log_path=log)
        started.append(workers)
        workers.start()
        if wait:
            try:
                workers.wait_ready(timeout_s)
            except Exception:
                print(log.read_text(errors="replace")[-5000:])
                raise
        return workers

    yield start
    for workers in started:
        workers.stop()


def wait_for(check: Callable[[], object], timeout_s: float = 30.0, interval_s: float = 0.1) -> object:
    """Poll until `check()` is truthy; fail the test otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


VOXMILL = str(Path(sys.executable).parent / "voxmill")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment without any VOXMILL_* of the caller's, the speech check off (the synthetic
    fixtures hold no speech), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXMILL_")}
    return {**env, "VOXMILL_SPEECH_CHECK": "false", **(extra or {})}


def voxmill(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the `voxmill` command line as a user would."""
    return subprocess.run(
        [VOXMILL, *args], env=clean_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
