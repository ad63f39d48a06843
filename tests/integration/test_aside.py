"""Standing aside during a reload: real Redis, real ONNX sessions, coordinators driven step by step.

Each `ReloadCoordinator` (and its `ModelHolder`) here is what one worker process runs; the test
plays its reload thread (`round`) by hand, so every step can be checked. The worker processes
end to end are in `test_reload.py`.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from pathlib import Path

import pytest
import redis
from rich.console import Console

from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.standin import EMBEDDER_FILE, make_embedder_model, write_model
from pipeline.settings import Settings
from tests.conftest import make_settings, wait_for
from workers import keys
from workers.observe.status import collect_status
from workers.observe.status_view import render_status
from workers.reload import generations
from workers.reload.coordinator import ReloadCoordinator
from workers.reload.holder import ModelHolder
from workers.reload.validation import Validation
from workers.reload.watcher import Watcher

HOST = socket.gethostname()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, models: Path, audio_dir: Path) -> Settings:
    settings = make_settings(redis_url, models, [audio_dir], reload_aside_min_mb=0)  # tiny models too
    generations.publish(redis_client, "embedder", sha256(models / EMBEDDER_FILE), {"file": EMBEDDER_FILE})
    return settings


def embed_process(settings: Settings, number: int) -> ReloadCoordinator:
    """An embed-only worker process, loaded and in Redis (its heartbeat), threads not started."""
    registry = Registry.load()
    holder = ModelHolder(
        ("embedder",), SessionOptions.from_settings(settings), registry, name=f"{HOST}:{90000 + number}"
    )
    client = redis.Redis.from_url(settings.broker_url or "")
    process = ReloadCoordinator(settings, holder, registry, ["embed"], "solo", client)
    process.load_models()
    process.heartbeat()
    return process


def aside(process: ReloadCoordinator) -> bool:
    return process.record().aside


def serving_sha256(process: ReloadCoordinator) -> str:
    return process.holder.sessions["embedder"].sha256


def announce(client: redis.Redis, sha: str, size: int = 100) -> None:
    fields = {"sha256": sha, "file": EMBEDDER_FILE, "size": size}
    generations.announce_candidate(client, HOST, "embedder", fields, 60)


def test_one_process_stands_aside_while_a_candidate_is_validated(
    settings: Settings, redis_client: redis.Redis
) -> None:
    first, second = embed_process(settings, 1), embed_process(settings, 2)
    announce(redis_client, "c" * 64)
    assert first.round() is True  # waits for the verdict, holding the slot
    second.round()
    assert aside(first) and not aside(second)
    assert redis_client.get(keys.ASIDE.format(host=HOST)) == first.worker_id.encode()
    slot = keys.RELOAD_SLOT.format(host=HOST, role="embedder", slot=0)
    assert redis_client.get(slot) == first.worker_id.encode()
    status = collect_status(redis_client)
    assert [c["sha256"] for c in status["models"]["embedder"]["validating"]] == ["c" * 64]
    shown_aside = {w["worker_id"]: w["aside"] for w in status["workers"]}
    assert shown_aside == {first.worker_id: True, second.worker_id: False}
    console = Console(record=True, width=300)
    render_status({**status, "broker": "redis://test"}, console)
    shown = console.export_text()
    assert f"{first.worker_id} (aside: reloading)" in shown and "(validating cccccccccccc)" in shown

    # A task reaching the process standing aside waits; the other one serves at once.
    with second.holder.serving(["embedder"]) as sessions:
        assert "embedder" in sessions
    done = threading.Event()

    def task() -> None:
        with first.holder.serving(["embedder"]):
            done.set()

    thread = threading.Thread(target=task)
    thread.start()
    assert not done.wait(0.5)

    # Rejected (the watcher withdraws the candidate, nothing is published): back in rotation.
    generations.withdraw_candidate(redis_client, HOST, "embedder")
    first.round()
    assert done.wait(5)
    thread.join()
    assert not aside(first)
    assert redis_client.get(keys.ASIDE.format(host=HOST)) is None
    assert redis_client.get(slot) is None


def test_the_process_standing_aside_loads_first_then_the_next_one(
    settings: Settings, redis_client: redis.Redis, models: Path
) -> None:
    first, second = embed_process(settings, 1), embed_process(settings, 2)
    old = serving_sha256(first)
    path = models / EMBEDDER_FILE
    write_model(make_embedder_model("tiny", seed=5), path)
    new = sha256(path)
    announce(redis_client, new)
    first.round()
    second.round()
    assert aside(first)

    generations.publish(redis_client, "embedder", new, {"file": EMBEDDER_FILE, "size": path.stat().st_size})
    generations.withdraw_candidate(redis_client, HOST, "embedder")
    # The second process finds the slot taken: it keeps serving the old model and waits.
    assert second.round() is True
    assert serving_sha256(second) == old and not aside(second)
    first.round()
    assert serving_sha256(first) == new and not aside(first)
    second.round()
    assert serving_sha256(second) == new and not aside(second)
    assert redis_client.get(keys.ASIDE.format(host=HOST)) is None


def test_a_lone_process_never_stands_aside(settings: Settings, redis_client: redis.Redis) -> None:
    alone = embed_process(settings, 1)
    announce(redis_client, "c" * 64)
    alone.round()
    assert not aside(alone)
    with alone.holder.serving(["embedder"]) as sessions:  # serves without waiting
        assert "embedder" in sessions


def test_a_process_standing_aside_loads_after_its_running_task_ends(
    settings: Settings, redis_client: redis.Redis, models: Path
) -> None:
    first, _second = embed_process(settings, 1), embed_process(settings, 2)
    old = serving_sha256(first)
    task_may_end, task_started = threading.Event(), threading.Event()

    def long_task() -> None:
        with first.holder.serving(["embedder"]):
            task_started.set()
            task_may_end.wait(10)

    task = threading.Thread(target=long_task)
    task.start()
    assert task_started.wait(5)
    path = models / EMBEDDER_FILE
    write_model(make_embedder_model("tiny", seed=6), path)
    new = sha256(path)
    generations.publish(redis_client, "embedder", new, {"file": EMBEDDER_FILE, "size": path.stat().st_size})
    reload = threading.Thread(target=first.round)
    reload.start()
    wait_for(lambda: aside(first), timeout_s=10, interval_s=0.02)
    assert reload.is_alive()  # stands aside, waiting for its task
    assert serving_sha256(first) == old
    task_may_end.set()
    task.join()
    reload.join(10)
    assert not reload.is_alive()
    assert serving_sha256(first) == new and not aside(first)


def test_a_candidate_whose_sha256_is_not_known_yet_counts_as_new(
    settings: Settings, redis_client: redis.Redis
) -> None:
    first, _second = embed_process(settings, 1), embed_process(settings, 2)
    announce(redis_client, "")  # announced as soon as a changed file settles, before it is hashed
    first.round()
    assert aside(first)


def test_the_watcher_announces_a_candidate_until_its_verdict(
    settings: Settings, redis_client: redis.Redis, models: Path
) -> None:
    watcher = Watcher(settings, redis_client)
    seen: list[dict[str, object]] = []
    validate = watcher.validator.validate

    def validate_and_look(path: Path, role: str) -> Validation:  # the real validation, watched
        seen.append(generations.candidate(redis_client, HOST, role))
        return validate(path, role)

    watcher.validator.validate = validate_and_look  # type: ignore[method-assign]
    path = models / EMBEDDER_FILE
    write_model(make_embedder_model("tiny", seed=7), path)
    new = sha256(path)
    watcher.settle("embedder", watcher._stamp("embedder"))
    assert [c["sha256"] for c in seen] == [new]
    assert generations.published(redis_client, "embedder")["sha256"] == new
    assert generations.candidate(redis_client, HOST, "embedder") == {}
    write_model(make_embedder_model("tiny", seed=7), path)  # the same bytes again: nothing to validate
    watcher.settle("embedder", watcher._stamp("embedder"))
    assert len(seen) == 1 and generations.candidate(redis_client, HOST, "embedder") == {}


def test_only_a_model_of_reload_aside_min_mb_or_more_makes_a_process_stand_aside(
    settings: Settings, redis_client: redis.Redis, models: Path
) -> None:
    settings = settings.model_copy(update={"reload_aside_min_mb": 1.0})  # tiny embedders are 0.2 MB
    first, _second = embed_process(settings, 1), embed_process(settings, 2)
    announce(redis_client, "c" * 64, size=200_000)
    assert first.round() is True  # waits for the verdict, serving meanwhile
    assert not aside(first)
    announce(redis_client, "c" * 64, size=2_000_000)
    first.round()
    assert aside(first)
    generations.withdraw_candidate(redis_client, HOST, "embedder")
    first.round()
    assert not aside(first)
    path = models / EMBEDDER_FILE  # a small new generation: loaded beside serving
    write_model(make_embedder_model("tiny", seed=8), path)
    generations.publish(redis_client, "embedder", sha256(path), {"file": EMBEDDER_FILE})
    with first.holder.serving(["embedder"]):  # a running task does not hold the small load back
        first.round()
        assert serving_sha256(first) == sha256(path)
