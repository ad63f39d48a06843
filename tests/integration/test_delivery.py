"""Every job answered once, on a real Redis with real workers: no silent queue, a worker that
cannot load its model, the first result wins, and the producer's redelivery of lost jobs only."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import redis
import soundfile as sf

from pipeline.demo import speechlike
from tests.conftest import make_settings, voxmill
from workers.queue.app import VoxmillRedisBackend, create_app
from workers.queue.client import Client, NoConsumer, queues_to_mark


def records_of(client: redis.Redis, parent_pid: int) -> list[dict]:
    from tests.helpers import worker_dicts

    return [r for r in worker_dicts(client) if r.get("ppid") == parent_pid]


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 s of speech-like audio: about 3 s of work for the full-size embedder."""
    path = tmp_path_factory.mktemp("long") / "long_240s.wav"
    sf.write(path, speechlike(240.0, 16000, 120.0, seed=3), 16000, subtype="PCM_16")
    return path


def test_a_tokenize_embed_worker_serves_extract_too(
    start_worker, redis_url, redis_client, tiny_models, audio_dir
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    workers = start_worker(settings, concurrency=1, queues=("tokenize", "embed"))
    assert all("extract" in r["queues"] for r in records_of(redis_client, workers.process.pid))
    result = Client(settings).run("extract", [audio_dir / "chirp_3s.wav"], timeout_s=60)[0]
    assert result.error is None and result.speech_token and result.embedding


def test_a_queue_nobody_consumes_is_refused_at_once_and_marked(
    start_worker, redis_url, redis_client, tiny_models, audio_dir
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    start_worker(settings, concurrency=1, queues=("embed",))
    client = Client(settings)
    started = time.monotonic()
    with pytest.raises(NoConsumer) as caught:
        client.submit("tokenize", audio_dir / "chirp_3s.wav")
    waited = time.monotonic() - started
    assert caught.value.queue == "tokenize" and "voxmill worker -Q tokenize" in str(caught.value)
    # looked at for a heartbeat interval (records come back that fast after a Redis restart), no longer
    assert settings.heartbeat_interval_s <= waited < settings.heartbeat_interval_s + 5
    assert redis_client.llen("tokenize") == 0  # nothing was sent
    started = time.monotonic()
    with pytest.raises(NoConsumer):
        client.submit("extract", audio_dir / "chirp_3s.wav")
    assert client.submit("embed", audio_dir / "chirp_3s.wav")  # the queue that has a worker
    # jobs sent around the check (another producer's) are what `voxmill status` marks
    Client(settings, check_consumers=False).submit("tokenize", audio_dir / "chirp_3s.wav")
    assert queues_to_mark(redis_client) == ["tokenize"]


def test_voxmill_submit_to_a_queue_nobody_consumes_exits_2_naming_the_command(
    start_worker, redis_url, tiny_models, audio_dir
) -> None:
    """Needs `voxmill submit` to turn `NoConsumer` into exit 2 (workers/cli/serve.py)."""
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    start_worker(settings, concurrency=1, queues=("embed",))
    done = voxmill("submit", "extract", str(audio_dir / "chirp_3s.wav"), env=settings.to_env(), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())  # as one line, however the terminal wrapped it
    assert "no live worker consumes the extract queue" in message and "voxmill worker -Q extract" in message


def test_a_worker_that_cannot_load_its_model_is_a_model_error_at_once(
    start_worker, redis_url, redis_client, tmp_path, audio_dir
) -> None:
    empty = tmp_path / "no-models"
    empty.mkdir()
    settings = make_settings(redis_url, empty, [audio_dir])
    workers = start_worker(settings, concurrency=1, queues=("embed",), wait=False)
    deadline = time.monotonic() + 60
    while not any(r.get("load_errors") for r in records_of(redis_client, workers.process.pid)):
        assert time.monotonic() < deadline, "the worker never reported its load error"
        time.sleep(0.1)
    started = time.monotonic()
    (result,) = Client(settings).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=120)
    assert result.error is not None and result.error.code == "model_error", result.error
    assert "embedder" in result.error.message and str(empty) in result.error.message
    assert time.monotonic() - started < 10  # not the timeout, nor the worker's 8 retries


def test_the_first_stored_result_of_a_task_id_stays(redis_url: str, redis_client: redis.Redis) -> None:
    settings = make_settings(redis_url, Path("models"), [])
    backend = create_app(settings).backend
    assert isinstance(backend, VoxmillRedisBackend)
    task_id = str(uuid.uuid4())
    key = backend.get_key_for_task(task_id)
    listener = redis_client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(key)
    backend.store_result(task_id, None, "RETRY")  # a retry's state is not a result: replaced
    backend.store_result(task_id, {"run": 1}, "SUCCESS")
    # a second execution's write, past Celery's own read-then-write check (two finishing at once)
    late = {"status": "SUCCESS", "result": {"run": 2}, "task_id": task_id, "traceback": None}
    backend.set(key, backend.encode(late))
    backend.set(key, backend.encode({**late, "status": "FAILURE"}))
    stored = json.loads(redis_client.get(key))
    assert stored["status"] == "SUCCESS" and stored["result"] == {"run": 1}
    assert 0 < redis_client.ttl(key) <= settings.result_expires_s
    # a failure stored first stays too: the producer may have read it already
    failed_id = str(uuid.uuid4())
    backend.store_result(failed_id, ValueError("first"), "FAILURE")
    backend.store_result(failed_id, {"run": 2}, "SUCCESS")
    assert json.loads(redis_client.get(backend.get_key_for_task(failed_id)))["status"] == "FAILURE"
    announced = []
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        message = listener.get_message(timeout=0.1)
        if message:
            announced.append(json.loads(message["data"])["status"])
    assert announced == ["RETRY", "SUCCESS"]  # the result is announced once
    listener.close()


def test_a_lost_job_is_sent_again_and_a_queued_one_is_not(
    start_worker, redis_url, redis_client, tiny_models, audio_dir
) -> None:
    """The worker stops consuming (its record stays): the job waits in its queue past its
    deadline and is not sent again; then the queue is emptied (what a Redis restart without
    persistence does): the job is sent again under its id and answered once."""
    settings = make_settings(redis_url, tiny_models, [audio_dir], job_deadline_min_s=1.0)
    workers = start_worker(settings, concurrency=1, queues=("embed",))
    client = Client(settings)
    control = client.app.control
    node = [f"voxmill-local-{os.getpid()}@{socket.gethostname()}"]  # `LocalWorkers`' node name
    control.cancel_consumer("embed", destination=node, reply=True, timeout=10)
    job = client.submit("embed", audio_dir / "chirp_3s.wav")
    results = [result for _, result in client.completed([job], timeout_s=6)]
    assert [r.error.code for r in results] == ["timeout"]  # waited in the queue all along
    assert client.resent == 0 and redis_client.llen("embed") == 1
    redis_client.delete("embed")  # the queue is lost
    control.add_consumer("embed", destination=node, reply=True, timeout=10)
    started = time.monotonic()
    answered = list(client.completed([job], timeout_s=60))
    assert [(j.id, r.error) for j, r in answered] == [(job.id, None)]
    assert client.resent == 1
    assert time.monotonic() - started < 30
    log = workers.log_path.read_text()
    assert log.count(f"task {job.id} ") == 1  # run once: the lost copy never ran


def test_a_job_running_past_its_deadline_is_not_sent_again(
    start_worker, redis_url, redis_client, slow_models, long_clip
) -> None:
    settings = make_settings(redis_url, slow_models, [long_clip.parent], job_deadline_min_s=0.2)
    workers = start_worker(settings, concurrency=1, queues=("embed",))
    client = Client(settings)
    job = client.submit("embed", long_clip)
    seen_running = False
    deadline = time.monotonic() + 30
    while not seen_running and time.monotonic() < deadline:
        records = records_of(redis_client, workers.process.pid)
        seen_running = any(job.id in r.get("running", []) for r in records)
        time.sleep(0.05)
    assert seen_running  # the heartbeat record names the running task
    (result,) = client.wait_all([job], timeout_s=120)
    assert result.error is None and client.resent == 0
    assert workers.log_path.read_text().count(f"task {job.id} ") == 1
