"""Redis Sentinel: a primary, one replica and three sentinels on loopback ports; workers, a
corpus run and producers on `sentinel://` URLs; the primary killed mid-run.

Checks that the sentinels promote the replica, that every process (the workers' consumers,
result stores and heartbeats, the corpus driver, the producers) finds the new primary by itself,
that the outputs hold every utterance exactly once, and that every job is answered once.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
import redis

from pipeline.outputs.folder import RunFolder
from tests.conftest import make_settings
from tests.fault.conftest import SHARD_SIZE
from tests.fault.streams import ClientStream, SubmitRun, make_clips, wait_submitted
from tests.helpers import worker_dicts
from workers.embedded import free_port, redis_server_binary, wait_until

pytestmark = pytest.mark.slow
MASTER = "voxmill"


class Server:
    """One redis-server (or sentinel) process on a loopback port, with its own folder."""

    def __init__(self, folder: Path, port: int, args: list[str], config: str | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = port
        command = [redis_server_binary()]
        if config is not None:  # a sentinel rewrites its config file: it must be its own
            (folder / "sentinel.conf").write_text(config)
            command += [str(folder / "sentinel.conf"), "--sentinel"]
        command += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), *args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2)
        wait_until(lambda: self.client.ping(), 10, f"redis on {port}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


@pytest.fixture
def sentinels(tmp_path: Path):
    """A primary, a replica and three sentinels (quorum 2, a primary is down after 1 s)."""
    servers: list[Server] = []
    try:
        primary = Server(tmp_path / "primary", free_port(), ["--save", "", "--appendonly", "no"])
        servers.append(primary)
        replica_args = ["--save", "", "--appendonly", "no", "--replicaof", "127.0.0.1", str(primary.port)]
        replica = Server(tmp_path / "replica", free_port(), replica_args)
        servers.append(replica)
        wait_until(
            lambda: replica.client.info("replication")["master_link_status"] == "up", 20, "replication"
        )
        config = (
            f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )
        watchers = [Server(tmp_path / f"sentinel{i}", free_port(), [], config) for i in range(3)]
        servers.extend(watchers)

        def ready() -> bool:
            state = sentinel_master(watchers[0])
            return int(state["num-slaves"]) == 1 and int(state["num-other-sentinels"]) == 2

        wait_until(ready, 30, "sentinels that know the replica and each other")
        url = ";".join(f"sentinel://127.0.0.1:{s.port}" for s in watchers)
        yield {"url": url, "primary": primary, "replica": replica, "sentinels": watchers}
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def clips_for_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clips(tmp_path_factory.mktemp("sentinel-clips"))


def corpus_utts(corpus: Path) -> list[str]:
    """The utterance ids of a folder corpus: each file's path below it, without extension."""
    return sorted(str(p.relative_to(corpus).with_suffix("")) for p in corpus.rglob("*.wav"))


def sentinel_master(sentinel: Server) -> dict[str, Any]:
    """`SENTINEL MASTER` as a dict of text keys (redis-py answers a list or a dict of bytes)."""
    state = sentinel.client.execute_command("SENTINEL", "MASTER", MASTER)
    if isinstance(state, list):
        state = dict(zip(state[::2], state[1::2], strict=True))
    return {key.decode() if isinstance(key, bytes) else key: value for key, value in state.items()}


def master_port(sentinel: Server) -> int:
    _, port = sentinel.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
    return int(port)


def test_primary_killed_mid_run_the_replica_takes_over(
    sentinels, start_worker, fault_models, fault_corpus, clips_for_jobs, tmp_path
) -> None:
    settings = make_settings(
        sentinels["url"],
        fault_models,
        [fault_corpus, clips_for_jobs, tmp_path],
        sentinel_master_name=MASTER,
        shard_deadline_min_s=5.0,
        shard_deadline_factor=3.0,
        job_deadline_min_s=3.0,
        heartbeat_ttl_s=8,
    )
    workers = start_worker(settings, concurrency=2, queues=("tokenize", "embed"))
    pool = {p.pid for p in psutil.Process(workers.process.pid).children()}
    stream = ClientStream(settings, sorted(clips_for_jobs.glob("clip*.wav")), batch=4).start()
    out = tmp_path / "out"
    run: dict[str, Any] = {}

    def extract() -> None:
        from workers.extract import extract_corpus

        try:
            run["report"] = extract_corpus(
                settings, fault_corpus, RunFolder.of(out), ["tokenize", "embed"], 2, SHARD_SIZE, True
            ).to_dict()
        except BaseException as exc:
            run["error"] = exc

    driver = threading.Thread(target=extract, daemon=True)
    driver.start()
    shards = out / "shards"

    def progress() -> bool:
        if "error" in run:
            raise AssertionError(f"the corpus run failed: {run['error']!r}")
        return shards.exists() and len(list(shards.glob("*.parquet"))) >= 6

    try:
        wait_until(progress, 120, "6 shards", give_up=AssertionError)
    except Exception:
        print(workers.log_path.read_text()[-6000:])
        raise
    submit = SubmitRun(settings, sorted(clips_for_jobs.glob("input*.wav")))
    primary, replica = sentinels["primary"], sentinels["replica"]
    assert workers.log_path is not None
    wait_submitted(primary.client, submit.files[-1], [workers.log_path])  # its jobs are all sent
    assert master_port(sentinels["sentinels"][0]) == primary.port
    primary.kill()
    killed_at = time.monotonic()
    wait_until(lambda: master_port(sentinels["sentinels"][0]) == replica.port, 60, "the replica's promotion")
    print(f"\nreplica promoted {time.monotonic() - killed_at:.1f} s after the primary was killed")
    assert replica.client.info("replication")["role"] == "master"

    driver.join(timeout=300)
    assert not driver.is_alive(), "the corpus run did not finish after the failover"
    assert "error" not in run, run.get("error")
    code, submitted = submit.finish()
    tally = stream.stop()
    print(f"Client stream {tally.counts()}, sent again: {stream.client.resent}")
    print(f"voxmill submit (exit {code}) {submitted.counts()}")
    print(f"voxmill submit's log:\n{submit.stderr[-1500:]}")
    tally.check(90.0)
    submitted.check(90.0)
    assert code == 0

    # every utterance exactly once, in each output
    utts = corpus_utts(fault_corpus)
    for name in ("speech_tokens.parquet", "utt_embeddings.parquet"):
        assert sorted(pq.read_table(out / name).column("utt").to_pylist()) == utts, name
    assert (out / "errors.jsonl").read_text() == ""
    assert run["report"]["ops"] == {op: {"ok": len(utts), "failed": 0} for op in ("tokenize", "embed")}
    # the same worker processes serve on, and write their records on the new primary
    assert workers.alive() and {p.pid for p in psutil.Process(workers.process.pid).children()} == pool
    wait_until(
        lambda: {r["pid"] for r in worker_dicts(replica.client)} >= pool,
        30,
        "records on the new primary",
    )
