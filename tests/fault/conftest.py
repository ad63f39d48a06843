"""Fault-injection harness: a private Redis we may kill, a 300-utterance corpus, a driver we may kill."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis

from pipeline.settings import Settings
from tests.conftest import VOXMILL, clean_env, make_settings, voxmill
from tests.helpers import make_audio_folder, read_outputs
from workers.embedded import free_port, redis_server_binary, wait_until
from workers.queue.client import Client, Job

CORPUS_SIZE = 300
SHARD_SIZE = 5


class PrivateRedis:
    """A redis-server on a fixed free port that a test may stop, kill and start again."""

    def __init__(self, data_dir: Path, appendonly: bool) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        wait_until(lambda: client.ping(), 10, f"private redis on {self.port}")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None


@pytest.fixture
def private_redis(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PrivateRedis]:
    appendonly = getattr(request, "param", True)
    server = PrivateRedis(tmp_path / "redis", appendonly=appendonly).start()
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def fault_models(slow_models: Path) -> Path:
    return slow_models


@pytest.fixture(scope="session")
def fault_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_audio_folder(tmp_path_factory.mktemp("fault-corpus"), CORPUS_SIZE, 0.5, 1.5, seed=5)


@pytest.fixture(scope="session")
def fault_reference(tmp_path_factory: pytest.TempPathFactory, fault_corpus: Path, fault_models: Path) -> dict:
    """The outputs of an undisturbed embedded run: what every faulted run must end with."""
    out = tmp_path_factory.mktemp("fault-reference") / "out"
    done = voxmill(
        "extract",
        str(fault_corpus),
        "--out",
        str(out),
        "--models",
        str(fault_models),
        "--workers",
        "2",
        "--shard-size",
        str(SHARD_SIZE),
        "--quiet",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return read_outputs(out)


def fault_settings(url: str, models: Path, corpus: Path, out_parent: Path, **overrides: object) -> Settings:
    # short deadlines: a late shard, or a lost job, is sent again within seconds
    values: dict[str, object] = {
        "shard_deadline_min_s": 5.0,
        "shard_deadline_factor": 3.0,
        "job_deadline_min_s": 3.0,
    }
    values.update(overrides)
    return make_settings(url, models, [corpus, out_parent], **values)


class Driver:
    """`voxmill extract` against the test's broker, as a process the test may kill."""

    def __init__(self, settings: Settings, corpus: Path, out: Path, shard_size: int = SHARD_SIZE) -> None:
        self.settings, self.corpus, self.out, self.shard_size = settings, corpus, out, shard_size
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> Driver:
        args = [
            VOXMILL,
            "extract",
            str(self.corpus),
            "--out",
            str(self.out),
            "--shard-size",
            str(self.shard_size),
        ]
        self.process = subprocess.Popen(
            args,
            env=clean_env(self.settings.to_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return self

    def shards_done(self) -> int:
        folder = self.out / "shards"
        return len(list(folder.glob("*.parquet"))) if folder.exists() else 0

    def wait_progress(self, shards: int, timeout_s: float = 120.0) -> None:
        wait_until(lambda: self.shards_done() >= shards, timeout_s, f"{shards} shard files", interval_s=0.02)
        assert self.process is not None and self.process.poll() is None, "the run ended before the fault"

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def finish(self, timeout_s: float = 300.0) -> tuple[int, str]:
        assert self.process is not None
        try:
            output, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
            raise AssertionError("driver did not finish:\n" + output[-4000:]) from None
        return self.process.returncode, output

    def cpu_seconds(self) -> float:
        assert self.process is not None
        times = psutil.Process(self.process.pid).cpu_times()
        return float(times.user + times.system)


@dataclass
class SubmitStream:
    """A producer submitting an embed job every `interval_s` while a fault happens."""

    settings: Settings
    wav: Path
    interval_s: float = 0.1
    jobs: list[Job] = field(default_factory=list)
    refused: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> SubmitStream:
        self.client = Client(self.settings)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.jobs.append(self.client.submit("embed", self.wav))
            except Exception:  # broker down: the producer is told at once, nothing is silently lost
                self.refused += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def finish(self, timeout_s: float = 30.0) -> dict[str, int]:
        self.stop()
        counts = {"submitted": len(self.jobs), "refused": self.refused, "ok": 0}
        for _, result in self.client.completed(self.jobs, timeout_s=timeout_s):
            key = "ok" if result.error is None else result.error.code
            counts[key] = counts.get(key, 0) + 1
            if key not in ("ok", "timeout"):
                print(f"unexpected result: {result.error}")
        return counts


@pytest.fixture
def submit_stream() -> Iterator[Callable[..., SubmitStream]]:
    """Start producers; each is stopped at teardown even when the test failed."""
    streams: list[SubmitStream] = []

    def start(settings: Settings, wav: Path, interval_s: float = 0.1) -> SubmitStream:
        stream = SubmitStream(settings, wav, interval_s).start()
        streams.append(stream)
        return stream

    yield start
    for stream in streams:
        stream.stop()


def pool_children(client: redis.Redis, parent_pid: int) -> list[int]:
    from tests.helpers import worker_dicts

    return [r["pid"] for r in worker_dicts(client) if r.get("ppid") == parent_pid]


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def settle(seconds: float) -> None:
    time.sleep(seconds)
