"""Queue layer end to end: real Redis, real worker processes, real (tiny stand-in) ONNX files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Producer

from pipeline.outputs.folder import RunFolder
from pipeline.records import TaskResult
from tests.conftest import clean_env, flush_keeping_claim, make_settings, voxmill, wait_for
from tests.helpers import make_audio_folder
from workers.embedded import LocalWorkers
from workers.queue.client import Client
from workers.queue.wakeups import ResultWakeups


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder inside the workers' allowed roots for files the tests make."""
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def settings(redis_url: str, tiny_models: Path, audio_dir: Path, scratch: Path):
    flush_keeping_claim(redis.Redis.from_url(redis_url))
    return make_settings(redis_url, tiny_models, [audio_dir, scratch])


@pytest.fixture(scope="module")
def worker(settings, scratch: Path):
    """One worker (2 processes) that every test of this module shares; it must survive them all."""
    workers = LocalWorkers(settings, 2, ["tokenize", "embed", "extract"], log_path=scratch / "worker.log")
    workers.start()
    try:
        workers.wait_ready(120)
        yield workers
    finally:
        workers.stop()


@pytest.mark.parametrize("op", ["tokenize", "embed", "extract"])
def test_round_trip_by_path_and_by_bytes(
    op: str, worker, settings, audio_dir: Path, tiny_models: Path
) -> None:
    client = Client(settings)
    wav = audio_dir / "speechlike_7p5s.wav"
    by_path, by_bytes = client.run(op, [wav, wav.read_bytes()], timeout_s=60)
    for result in (by_path, by_bytes):
        assert result.error is None, result.error
        assert result.audio_seconds == pytest.approx(7.5)
        if op in ("tokenize", "extract"):
            assert len(result.speech_token or []) == 188
        if op in ("embed", "extract"):
            assert len(result.embedding or []) == 192
    assert by_path.speech_token == by_bytes.speech_token
    assert by_path.embedding == by_bytes.embedding
    if op in ("tokenize", "extract"):
        assert by_path.models["tokenizer"].sha256 == sha256(tiny_models / "speech_tokenizer_v2.onnx")
    if op in ("embed", "extract"):
        assert by_path.models["embedder"].sha256 == sha256(tiny_models / "campplus.onnx")
    assert set(by_path.timings_ms) >= {"decode"}


def test_the_client_wakes_on_the_result_announcement_not_on_its_poll(worker, settings, audio_dir) -> None:
    """With a 60 s poll interval, results still come back at once: the client listens for them."""
    client = Client(settings)
    clip = audio_dir / "chirp_3s.wav"
    client.run("embed", [clip], timeout_s=60)  # both worker processes warm
    jobs = client.submit_many("embed", [clip, clip, clip])
    started = time.monotonic()
    results = list(client.as_completed(jobs, timeout_s=120, poll_s=60))
    assert [r.error for r in results] == [None, None, None]
    assert time.monotonic() - started < 30  # a polling-only client would sleep 60 s
    polling = Client(settings, wakeups=False)
    assert polling.run("embed", [clip], timeout_s=60)[0].error is None


def test_the_corpus_driver_wakes_on_shard_announcements_not_on_its_read_interval(
    worker, settings, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With results read only every 60 s, six one-clip shards still finish at once: each shard
    task announces its result and the driver listens (a driver that only read would take minutes:
    4 shards in flight, each round a minute)."""
    import pipeline.tuning
    from workers.extract import extract_corpus

    monkeypatch.setattr(pipeline.tuning, "SHARD_LOOK_S", 60.0)
    corpus = make_audio_folder(scratch / "announced-corpus", 6, 1.0, 2.0, seed=11)
    started = time.monotonic()
    out = RunFolder.of(scratch / "announced-out")
    report = extract_corpus(settings, corpus, out, ["embed"], 2, 1, quiet=True).to_dict()
    assert report["ops"]["embed"]["ok"] == 6
    assert time.monotonic() - started < 45


def test_result_wakeups_name_the_announced_keys_and_survive_a_close(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    wakeups = ResultWakeups(client)
    wakeups.follow([b"voxmill-test-k1", b"voxmill-test-k2"])
    assert wakeups.listening
    announced: list[tuple[bytes, bytes]] = []
    for _ in range(50):  # the subscription becomes active asynchronously
        client.publish("voxmill-test-k2", "stored")
        announced = wakeups.wait(0.1)
        if announced:
            break
    assert announced == [(b"voxmill-test-k2", b"stored")]
    assert wakeups.wait(0.05) == []  # nothing more announced
    wakeups.close()
    assert not wakeups.listening and wakeups.wait(0.01) == []
    client.close()


def test_bad_inputs_come_back_as_codes_and_the_worker_keeps_serving(
    worker, settings, audio_dir, scratch
) -> None:
    text = scratch / "notes.wav"
    text.write_text("this is not audio\n" * 20)
    short = scratch / "short.wav"
    import numpy as np
    import soundfile as sf

    sf.write(short, np.full(160, 0.1, dtype=np.float32), 16000)
    client = Client(settings)
    results = client.run("embed", [text, short, scratch / "missing.wav", b"", audio_dir / "chirp_3s.wav"])
    codes = [r.error.code if r.error else "ok" for r in results]
    assert codes == ["unreadable", "too_short", "not_found", "empty", "ok"]
    assert "at least 80 ms" in results[1].error.message


def test_wrong_field_types_are_bad_request(worker, settings) -> None:
    app = Client(settings).app
    for payload in ({"path": 5}, {"audio": "not bytes"}, ["a list"], {"nothing": True}):
        value = app.send_task("voxmill.embed", args=[payload], queue="embed").get(timeout=30)
        assert TaskResult.from_dict(value).error.code == "bad_request"


def test_paths_outside_the_allowed_roots_are_forbidden(worker, settings, audio_dir, scratch) -> None:
    outside = Path("/tmp") / f"voxmill-outside-{os.getpid()}.wav"
    outside.write_bytes((audio_dir / "chirp_3s.wav").read_bytes())
    link = scratch / "escape.wav"
    link.symlink_to(outside)
    try:
        dotdot = str(audio_dir / ".." / ".." / outside.relative_to("/"))
        results = Client(settings).run("tokenize", [dotdot, outside, link, "/etc/passwd"])
        assert [r.error.code for r in results] == ["forbidden_path"] * 4
    finally:
        outside.unlink()


def test_pickle_and_unknown_content_types_are_refused(worker, settings, audio_dir) -> None:
    with Connection(settings.broker_url) as conn:
        producer = Producer(conn, exchange=Exchange("embed", type="direct"), routing_key="embed")
        for serializer in ("pickle",):
            producer.publish(
                {"task": "voxmill.embed", "id": "pickled-1", "args": [{"path": "/etc/passwd"}], "kwargs": {}},
                serializer=serializer,
                headers={"task": "voxmill.embed", "id": f"{serializer}-1", "lang": "py"},
                declare=[],
            )
        producer.publish(
            b"\x00\x01garbage",
            content_type="application/x-voxmill-unknown",
            content_encoding="binary",
            headers={"task": "voxmill.embed", "id": "unknown-1", "lang": "py"},
        )
    result = Client(settings).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=30)[0]
    assert result.error is None  # the worker survived both
    log = wait_for(lambda: "pickle" in worker.log_path.read_text() and worker.log_path.read_text(), 10)
    assert "untrusted content" in str(log) or "ContentDisallowed" in str(log)
    assert worker.alive()


def test_celery_inspect_ping_sees_the_worker(worker, settings) -> None:
    env = clean_env(settings.to_env())
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", "inspect", "ping", "--timeout", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "pong" in done.stdout


def test_submit_command_prints_contract_json_and_exit_codes(worker, settings, audio_dir, scratch) -> None:
    env = settings.to_env()
    good = voxmill("submit", "extract", str(audio_dir / "chirp_3s.wav"), "--json", env=env)
    assert good.returncode == 0, good.stderr
    row = json.loads(good.stdout.strip())
    assert set(row) >= {"input", "op", "speech_token", "embedding", "audio_seconds", "models", "error"}
    assert (
        row["error"] is None
        and len(row["speech_token"]) == 75
        and set(row["models"]) == {"tokenizer", "embedder"}
    )
    mixed = voxmill(
        "submit", "tokenize", str(audio_dir / "chirp_3s.wav"), str(scratch / "nope.wav"), "--json", env=env
    )
    assert mixed.returncode == 1
    rows = [json.loads(line) for line in mixed.stdout.splitlines()]
    assert sorted(r["error"]["code"] if r["error"] else "ok" for r in rows) == ["not_found", "ok"]
    # A relative path comes back as typed (the worker reads its absolute form).
    relative = voxmill("submit", "embed", "chirp_3s.wav", "--json", env=env, cwd=audio_dir)
    assert relative.returncode == 0, relative.stderr
    assert json.loads(relative.stdout)["input"] == "chirp_3s.wav"


def test_submit_without_broker_says_what_to_set() -> None:
    done = voxmill("submit", "tokenize", "a.wav")
    assert done.returncode == 2
    assert "VOXMILL_BROKER_URL" in done.stderr and "voxmill up" in done.stderr


def test_worker_without_broker_says_what_to_set() -> None:
    done = voxmill("worker")
    assert done.returncode == 2
    assert "VOXMILL_BROKER_URL" in done.stderr
