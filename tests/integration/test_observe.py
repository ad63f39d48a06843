"""Observability: Prometheus series, `voxmill status --json`, per-task log lines."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import psutil
import redis

from pipeline.settings import Settings
from tests.conftest import make_settings, voxmill, wait_for
from workers import keys
from workers.embedded import free_port
from workers.observe.run_metrics import RunObserver
from workers.queue.client import Client


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


def test_metrics_endpoint_has_the_named_series(
    start_worker,
    redis_url: str,
    redis_client: redis.Redis,
    tiny_models: Path,
    audio_dir: Path,
    tmp_path: Path,
) -> None:
    port = free_port()
    settings = make_settings(redis_url, tiny_models, [audio_dir, tmp_path], metrics_port=port)
    start_worker(settings, concurrency=2)
    client = Client(settings)
    results = client.run("embed", [audio_dir / "chirp_3s.wav"] * 3 + [tmp_path / "missing.wav"], timeout_s=60)
    assert [r.error.code if r.error else "ok" for r in results] == ["ok", "ok", "ok", "not_found"]
    sha = results[0].models["embedder"].sha256[:12]
    text = wait_for(lambda: (t := scrape(port)) and "voxmill_worker_rss_bytes" in t and t, timeout_s=20)
    count = [
        s for s in series(text, "voxmill_task_seconds_count") if 'op="embed"' in s and 'outcome="ok"' in s
    ]
    assert count and f'model_sha256="embedder:{sha}"' in count[0]
    assert sum(float(s.rsplit(" ", 1)[1]) for s in count) == 3
    failures = series(text, "voxmill_task_failures_total")
    assert any('code="not_found"' in s and 'op="embed"' in s and s.endswith(" 1.0") for s in failures)
    loads = series(text, "voxmill_model_load_seconds")
    assert any('role="embedder"' in s for s in loads) and any('role="tokenizer"' in s for s in loads)
    assert series(text, "voxmill_model_warmup_ms")
    assert series(text, "voxmill_tasks_in_flight")
    rss = series(text, "voxmill_worker_rss_bytes")
    assert len(rss) >= 2 and all(float(s.rsplit(" ", 1)[1]) > 10e6 for s in rss)  # one per pool process
    # No login on the endpoint: it listens on loopback unless metrics_bind says otherwise.
    assert listening_addresses(port) == {"127.0.0.1"}


def listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port`, on this machine."""
    sockets = psutil.net_connections("tcp")
    return {c.laddr.ip for c in sockets if c.status == "LISTEN" and c.laddr.port == port}


def test_a_run_observer_listens_where_metrics_bind_says(tmp_path: Path) -> None:
    for bind in ("127.0.0.1", "0.0.0.0"):
        port = free_port()
        observer = RunObserver(str(tmp_path), None, port, Settings(metrics_bind=bind).metrics_bind)
        observer.run_started()
        try:
            assert listening_addresses(port) == {bind}
        finally:
            observer.metrics.close()


def test_status_json_shape_and_a_stopping_worker(
    start_worker, redis_url: str, redis_client: redis.Redis, tiny_models: Path, audio_dir: Path
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    workers = start_worker(settings, concurrency=2, queues=("embed",))
    Client(settings).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=60)

    def heartbeats_counted() -> bool:  # a finished task reaches the heartbeat within HEARTBEAT_MIN_GAP_S
        beats = [redis_client.get(k) for k in redis_client.keys(keys.WORKER.format(worker_id="*"))]
        return sum(json.loads(b)["tasks_last_minute"] for b in beats if b) >= 1

    wait_for(heartbeats_counted, timeout_s=Settings().heartbeat_interval_s + 3)
    done = voxmill("status", "--json", env=settings.to_env())
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert set(status) >= {"version", "queues", "workers", "models", "throughput", "broker"}
    assert set(status["queues"]) == {"tokenize", "embed", "extract"}
    assert len(status["workers"]) == 2
    for worker in status["workers"]:
        assert set(worker) >= {"worker_id", "hostname", "pid", "queues", "pool", "models", "last_seen"}
        assert worker["queues"] == ["embed"] and worker["pool"] == "prefork"
        assert set(worker["models"]) == {"embedder"}
    embedder = status["models"]["embedder"]
    assert set(embedder) >= {"published", "last_rejection", "serving"}
    assert sum(len(ids) for ids in embedder["serving"].values()) == 2
    assert status["throughput"]["tasks_last_minute"] >= 1
    workers.stop()
    after = json.loads(voxmill("status", "--json", env=settings.to_env()).stdout)
    assert after["workers"] == []


def test_json_log_line_per_task_with_id_and_sha256(
    start_worker, redis_url: str, redis_client: redis.Redis, tiny_models: Path, audio_dir: Path
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir], log_format="json")
    workers = start_worker(settings, concurrency=1, queues=("tokenize",))
    job = Client(settings).submit("tokenize", audio_dir / "chirp_3s.wav")
    result = Client(settings).wait_all([job], timeout_s=60)[0]
    sha = result.models["tokenizer"].sha256

    def task_line() -> dict | None:
        for line in workers.log_path.read_text().splitlines():
            if line.startswith("{") and job.id in line:
                entry = json.loads(line)
                if entry.get("task_id") == job.id:
                    return entry
        return None

    entry = wait_for(task_line, timeout_s=10)
    assert entry["op"] == "tokenize" and entry["outcome"] == "ok"
    assert entry["models"]["tokenizer"]["sha256"] == sha
    assert entry["input"].endswith("chirp_3s.wav") and entry["duration_ms"] > 0


def test_broker_password_never_appears_in_status(redis_url: str) -> None:
    host_and_db = redis_url.rsplit("@", 1)[-1].removeprefix("redis://")  # the embedded Redis has its own
    secret_url = f"redis://:hunter2secret@{host_and_db}"
    done = voxmill("status", "--json", env={"VOXMILL_BROKER_URL": secret_url})
    assert "hunter2secret" not in done.stdout + done.stderr


def test_status_json_numbers_are_numbers_and_times_epoch_seconds(redis_client: redis.Redis) -> None:
    """The schema `voxmill status --json` promises scripts: numbers as numbers, one time format."""
    from workers.observe.status import collect_status
    from workers.reload import generations

    generations.publish(redis_client, "embedder", "a" * 64, {"file": "campplus.onnx", "size": 185393})
    generations.record_rejection(
        redis_client, "embedder", {"file": "campplus.onnx", "size": 12, "reason": "x"}
    )
    generations.announce_candidate(redis_client, "host", "embedder", {"sha256": "", "size": 99}, 60)
    status = json.loads(json.dumps(collect_status(redis_client)))
    embedder = status["models"]["embedder"]
    published, rejection, candidate = (
        embedder["published"],
        embedder["last_rejection"],
        embedder["validating"][0],
    )
    assert isinstance(published["generation"], int) and published["size"] == 185393
    assert isinstance(rejection["count"], int) and rejection["size"] == 12
    assert candidate["size"] == 99
    for record in (published, rejection, candidate, status):
        stamp = record.get("time", record.get("since"))
        assert isinstance(stamp, float) and abs(stamp - time.time()) < 60
    assert isinstance(status["version"], int) and all(isinstance(n, int) for n in status["queues"].values())
