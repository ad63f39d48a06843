"""The producer `Client` at the door: a bytes job over the payload limit is answered, never sent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from pipeline.errors import ErrorRecord
from pipeline.records import TaskResult
from pipeline.settings import Settings
from tests.conftest import flush_keeping_claim
from workers.queue.client import Client, payload_refusal

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: any use of the broker fails


def test_bytes_over_the_limit_are_answered_too_large_without_a_broker() -> None:
    """Issue 31: 200 MB of bytes cost the worker 2.4 GB and Redis 770 MB before being refused."""
    client = Client(Settings(broker_url=DEAD_BROKER))
    limit = client.settings.max_payload_bytes
    job = client.submit("embed", bytes(limit + 200 * 1024), name="big.wav")
    assert job.payload is None  # nothing kept to send again either
    results = client.wait_all([job], timeout_s=5)
    assert results == [
        TaskResult(
            input="big.wav",
            op="embed",
            error=ErrorRecord("too_large", "payload is 32.2 MB; the limit is 32 MB"),
        )
    ]
    assert list(client.as_completed([job], timeout_s=5)) == results


def test_the_payload_limit_is_inclusive_and_comes_from_the_settings() -> None:
    assert payload_refusal("tokenize", "x", 1000, 1000) is None
    refused = payload_refusal("tokenize", "x", 1001, 1000)
    assert refused is not None and refused.error == ErrorRecord(
        "too_large", "payload is 1001 bytes; the limit is 1000 bytes"
    )
    client = Client(Settings(broker_url=DEAD_BROKER, max_payload_bytes=1000))
    assert client.submit("tokenize", b"x" * 1001).answer is not None


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    flush_keeping_claim(client)
    yield client
    flush_keeping_claim(client)
    client.close()


def test_a_refused_job_keeps_its_place_among_the_sent_ones(redis_url: str, broker: redis.Redis) -> None:
    client = Client(Settings(broker_url=redis_url, max_payload_bytes=1000), check_consumers=False)
    jobs = [
        client.submit("embed", b"RIFF" * 10, name="first"),
        client.submit("embed", b"RIFF" * 300, name="too big"),
        client.submit("embed", b"RIFF" * 20, name="third"),
    ]
    queued = broker.lrange("embed", 0, -1)
    assert len(queued) == 2 and not any(b"RIFF" * 300 in message for message in queued)
    backend = client.app.backend
    for job in (jobs[0], jobs[2]):  # answered as a worker answers
        done = TaskResult(input="<bytes>", op="embed", embedding=[0.5] * 192, audio_seconds=1.0)
        backend.store_result(job.id, done.to_dict(), "SUCCESS")
    results = client.wait_all(jobs, timeout_s=30)
    assert [r.input for r in results] == ["first", "too big", "third"]
    assert [r.error.code if r.error else "ok" for r in results] == ["ok", "too_large", "ok"]
    client.close()
