"""A cut network between one worker and Redis: every connection dropped for 60 s mid-task.

A TCP forwarder started by the test sits between the worker and a private Redis; the producer
and the corpus driver reach Redis directly. While the worker runs a long job (about 3 s) the
forwarder closes every connection and refuses new ones for 60 s, then forwards again. The worker
must resume by itself (same processes), the job's result must arrive once, and a corpus run
going on meanwhile must hold every utterance once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
import redis
import soundfile as sf

from pipeline.demo import speechlike
from pipeline.outputs.folder import RunFolder
from tests.conftest import make_settings
from tests.fault.conftest import SHARD_SIZE, PrivateRedis
from tests.fault.streams import executions
from tests.helpers import worker_dicts
from workers.embedded import wait_until
from workers.queue.client import Client

pytestmark = pytest.mark.slow
CUT_S = 60.0


class CuttableProxy:
    """A threaded TCP forwarder from a loopback port to `target_port`; `cut()` drops every
    connection (both ends closed) and every new one until `mend()`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.dropped = 0  # connections closed by a cut, or refused during one
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                self._drop(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                self._drop(client)
                continue
            with self._lock:  # looked at again with `cut()` shut out: a cut since the look drops it
                admitted = self.open.is_set()
                if admitted:
                    self._live |= {client, upstream}
            if not admitted:
                self._drop(client)
                self._close(upstream)
                continue
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                self._close(sock)

    def _drop(self, sock: socket.socket) -> None:
        self.dropped += 1
        self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def cut(self) -> None:
        with self._lock:
            self.open.clear()
            live = list(self._live)
        self.dropped += len(live) // 2
        for sock in live:
            self._close(sock)

    def mend(self) -> None:
        self.open.set()

    def close(self) -> None:
        self._closing = True
        self.cut()
        with contextlib.suppress(OSError):
            self.listener.close()


@pytest.fixture
def proxy(private_redis: PrivateRedis):
    forwarder = CuttableProxy(private_redis.port)
    yield forwarder
    forwarder.close()


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 s of speech-like audio: about 3.5 s of work for the full-size embedder."""
    path = tmp_path_factory.mktemp("partition") / "long_300s.wav"
    sf.write(path, speechlike(300.0, 16000, 130.0, seed=9), 16000, subtype="PCM_16")
    return path


def test_a_worker_cut_off_from_redis_for_60_s_resumes_and_answers_once(
    private_redis: PrivateRedis,
    proxy: CuttableProxy,
    start_worker,
    fault_models,
    fault_corpus,
    long_clip,
    tmp_path,
) -> None:
    direct = make_settings(
        private_redis.url,
        fault_models,
        [fault_corpus, long_clip.parent, tmp_path],
        shard_deadline_min_s=5.0,
        shard_deadline_factor=3.0,
        job_deadline_min_s=3.0,
        heartbeat_ttl_s=8,
    )
    behind = direct.model_copy(update={"broker_url": f"redis://127.0.0.1:{proxy.port}/0"})
    workers = start_worker(behind, concurrency=2, queues=("embed",))
    pool = {p.pid for p in psutil.Process(workers.process.pid).children()}
    out = tmp_path / "out"
    run: dict[str, Any] = {}

    def extract() -> None:
        from workers.extract import extract_corpus

        try:
            folder = RunFolder.of(out)
            run["report"] = extract_corpus(
                direct, fault_corpus, folder, ["embed"], 2, SHARD_SIZE, True
            ).to_dict()
        except BaseException as exc:
            run["error"] = exc

    driver = threading.Thread(target=extract, daemon=True)
    driver.start()
    wait_until(lambda: len(list((out / "shards").glob("*.parquet"))) >= 4, 120, "4 shards", interval_s=0.05)

    client = Client(direct)
    job = client.submit("embed", long_clip)
    watcher = redis.Redis.from_url(direct.broker_url)

    def running() -> bool:
        return any(job.id in r.get("running", []) for r in worker_dicts(watcher))

    wait_until(running, 60, "the long job running", interval_s=0.05)
    answered: list[tuple[str, Any, float]] = []

    def wait_for_the_job() -> None:  # one producer waiting through the whole cut
        for seen, result in client.completed([job], timeout_s=CUT_S + 120):
            answered.append((seen.id, result.error, time.monotonic()))

    proxy.cut()
    cut_at = time.monotonic()
    producer = threading.Thread(target=wait_for_the_job, daemon=True)
    producer.start()
    time.sleep(CUT_S)
    shards_during_cut = len(list((out / "shards").glob("*.parquet")))
    proxy.mend()
    mended_at = time.monotonic()
    print(f"\nconnections dropped: {proxy.dropped}; cut for {mended_at - cut_at:.0f} s")
    producer.join(timeout=150)
    assert [(job_id, error) for job_id, error, _ in answered] == [(job.id, None)]  # once, and right
    print(f"the job's result arrived {answered[0][2] - mended_at:.1f} s after the network came back")
    assert answered[0][2] > mended_at  # nothing could have answered it during the cut
    driver.join(timeout=300)
    assert not driver.is_alive(), "the corpus run did not finish after the cut"
    assert "error" not in run, run.get("error")
    utts = sorted(str(p.relative_to(fault_corpus).with_suffix("")) for p in fault_corpus.rglob("*.wav"))
    assert sorted(pq.read_table(out / "utt_embeddings.parquet").column("utt").to_pylist()) == utts
    assert run["report"]["ops"] == {"embed": {"ok": len(utts), "failed": 0}}
    # the worker resumed by itself: the same processes, consuming and recording again
    assert workers.alive() and {p.pid for p in psutil.Process(workers.process.pid).children()} == pool
    wait_until(lambda: {r["pid"] for r in worker_dicts(watcher)} >= pool, 30, "the worker's records")
    ran = executions(workers.log_path.read_text(), {job.id})
    print(
        f"the long job ran {ran[job.id]} time(s); the producer sent it {1 + client.resent} time(s); "
        f"{shards_during_cut} shard files at the end of the cut"
    )
    assert ran[job.id] >= 1
    watcher.close()
