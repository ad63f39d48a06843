"""The producer's decisions, without Redis: consumers, unservable jobs, deadlines, lost jobs."""

from __future__ import annotations

import pytest

from pipeline.settings import Settings
from workers.heartbeat import WorkerRecord
from workers.queue import connections
from workers.queue.client import NoConsumer, message_task_id
from workers.queue.delivery import (
    RESEND,
    SUSPECT,
    WAIT,
    Delivery,
    WorkerView,
    absence,
    consumer_missing,
    consumers_gone,
    deadline_s,
    late_reason,
    no_consumer_message,
    queues_without_consumer,
    start_command,
    verdict,
)
from workers.worker import roles_for_queues, served_queues


def record(worker: str, queues: list[str], models=(), errors=None, running=()) -> WorkerRecord:
    return WorkerRecord.from_dict(
        {
            "worker_id": worker,
            "queues": queues,
            "models": {role: {"sha256": "0" * 64} for role in models},
            "load_errors": errors or {},
            "running": list(running),
        }
    )


# -- which queues a worker serves ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("asked", "served"),
    [
        (["tokenize", "embed"], ("tokenize", "embed", "extract")),
        (["embed", "tokenize"], ("embed", "tokenize", "extract")),
        (["tokenize"], ("tokenize",)),
        (["embed"], ("embed",)),
        (["extract"], ("extract", "tokenize", "embed")),  # it holds both models anyway
        (["tokenize", "embed", "extract"], ("tokenize", "embed", "extract")),
        ([], ()),
    ],
)
def test_a_worker_serves_every_queue_whose_models_it_holds(asked: list[str], served: tuple) -> None:
    assert served_queues(asked) == served
    assert set(roles_for_queues(served_queues(asked))) == set(roles_for_queues(asked))


# -- consumers ----------------------------------------------------------------------------------
def test_queues_without_consumer_are_those_with_jobs_and_no_live_worker() -> None:
    workers = [record("h:1", ["tokenize"]), record("h:2", ["embed"])]
    depths = {"tokenize": 3, "embed": 0, "extract": 2}
    assert queues_without_consumer(depths, workers) == ["extract"]
    assert queues_without_consumer({"extract": 0, "embed": 5}, workers) == []  # no jobs: nothing to mark
    assert queues_without_consumer({"embed": 1, "tokenize": 1, "extract": 1}, []) == [
        "tokenize",
        "embed",
        "extract",
    ]


def test_the_view_says_who_consumes_what_and_what_runs() -> None:
    view = WorkerView.from_records(
        [record("h:1", ["embed"], ["embedder"], running=["a"]), record("h:2", ["embed"], ["embedder"])]
    )
    assert view.serves("embed") and not view.serves("tokenize")
    assert view.consumers["embed"] == ("h:1", "h:2")
    assert view.running == frozenset({"a"})
    assert WorkerView.from_records([]).serves("embed") is False


def test_a_queue_is_without_consumer_only_after_looks_spanning_a_heartbeat() -> None:
    confirm_s = 3.0
    absent = absence(None, 100.0, confirm_s)
    assert absent == (100.0, 100.0) and not consumer_missing(absent, confirm_s)
    absent = absence(absent, 102.0, confirm_s)
    assert not consumer_missing(absent, confirm_s)  # a Redis restart: records return within 2 s
    absent = absence(absent, 103.5, confirm_s)
    assert consumer_missing(absent, confirm_s)
    # looks far apart prove nothing about the time in between: the absence starts again
    assert absence((100.0, 103.5), 200.0, confirm_s) == (200.0, 200.0)
    assert not consumer_missing(None, confirm_s)


def test_no_consumer_names_the_queue_and_the_command_that_starts_a_worker() -> None:
    error = NoConsumer("extract")
    assert error.queue == "extract"
    assert "voxmill worker -Q extract" in str(error) and "-Q tokenize,embed" in str(error)
    assert start_command("embed") == "voxmill worker -Q embed"


def test_a_run_stops_only_for_a_queue_of_its_own_without_consumer_for_the_whole_grace() -> None:
    """`extract` on a broker: only `-Q embed` workers and a run that needs tokenize. Before its
    first shard the grace is a heartbeat interval (as `submit`); mid-run a longer one, and a queue
    whose shards are all done (no longer asked about) forgets its absence."""
    view = WorkerView.from_records([record("h:1", ["embed"], ["embedder"])])
    absent, gone = consumers_gone(["tokenize", "embed"], view, {}, 100.0, 3.0)
    assert absent == {"tokenize": (100.0, 100.0)} and gone == []
    absent, gone = consumers_gone(["tokenize", "embed"], view, absent, 102.0, 3.0)
    assert gone == []  # a Redis restart: the records come back within a heartbeat interval
    absent, gone = consumers_gone(["tokenize", "embed"], view, absent, 103.0, 3.0)
    assert gone == ["tokenize"]
    message = no_consumer_message(gone)
    assert "no live worker consumes the tokenize queue" in message and "voxmill worker -Q tokenize" in message
    # several queues, named in voxmill's queue order, each with its command
    nobody = WorkerView.from_records([])
    absent, _ = consumers_gone(["extract", "embed", "tokenize"], nobody, {}, 0.0, 3.0)
    assert consumers_gone(["extract", "embed", "tokenize"], nobody, absent, 3.0, 3.0)[1] == [
        "tokenize",
        "embed",
        "extract",
    ]
    # mid-run (grace 180 s): the worker back within it clears the absence; a gap in looking (a
    # broker outage) proves nothing, so the absence starts again
    absent, gone = consumers_gone(["embed"], nobody, {}, 0.0, 180.0)
    absent, gone = consumers_gone(["embed"], nobody, absent, 179.0, 180.0)
    assert gone == []
    assert consumers_gone(["embed"], view, absent, 181.0, 180.0) == ({}, [])
    assert consumers_gone(["embed"], nobody, absent, 181.0, 180.0)[1] == ["embed"]
    assert consumers_gone(["embed"], nobody, {"embed": (0.0, 10.0)}, 400.0, 180.0) == (
        {"embed": (400.0, 400.0)},
        [],
    )
    # a queue no shard waits in any more is not asked about: its absence is dropped
    assert consumers_gone([], nobody, {"embed": (0.0, 179.0)}, 181.0, 180.0) == ({}, [])


# -- a worker that cannot load a model ----------------------------------------------------------
def test_a_job_is_unservable_when_every_consumer_reports_its_model_unloadable() -> None:
    broken = record("h:1", ["embed"], errors={"embedder": "no model file in /models"})
    also = record("h:2", ["embed"], errors={"embedder": "sha256 mismatch"})
    reason = WorkerView.from_records([broken, also]).unservable("embed")
    assert reason is not None
    assert "h:1: embedder: no model file in /models" in reason and "h:2: embedder: sha256 mismatch" in reason
    healthy = record("h:3", ["embed"], ["embedder"])
    assert WorkerView.from_records([broken, healthy]).unservable("embed") is None
    loading = record("h:4", ["embed"])  # no model and no error (yet): it may still serve
    assert WorkerView.from_records([broken, loading]).unservable("embed") is None
    assert WorkerView.from_records([]).unservable("embed") is None  # nobody: NoConsumer's case


def test_extract_is_unservable_when_each_consumer_lacks_one_of_its_models() -> None:
    no_tokenizer = record("h:1", ["tokenize", "embed", "extract"], ["embedder"], {"tokenizer": "bad file"})
    view = WorkerView.from_records([no_tokenizer])
    assert "tokenizer: bad file" in (view.unservable("extract") or "")
    assert view.unservable("embed") is None


def test_late_reason_says_what_the_producer_saw() -> None:
    assert "voxmill worker -Q tokenize" in late_reason("tokenize", WorkerView.from_records([]), None)
    assert late_reason("embed", WorkerView.from_records([record("h:1", ["embed"], ["embedder"])]), None) == ""
    assert "sent 3 times" in late_reason("embed", None, Delivery("embed", 0.0, attempts=3))


# -- deadlines and lost jobs --------------------------------------------------------------------
def test_the_deadline_follows_the_median_latency_with_a_minimum() -> None:
    assert deadline_s([], 5.0, 4.0) == 5.0
    assert deadline_s([0.1, 0.2, 0.3], 5.0, 4.0) == 5.0
    assert deadline_s([1.0, 2.0, 30.0], 5.0, 4.0) == 8.0
    delivery = Delivery("embed", sent_at=0.0)
    assert delivery.deadline_s(5.0) == 5.0
    assert Delivery("embed", 0.0, attempts=3).deadline_s(5.0) == 20.0
    assert Delivery("embed", 0.0, attempts=30).deadline_s(5.0) == 40.0  # bounded doubling


def test_a_burst_served_in_order_never_reaches_its_deadline() -> None:
    """100 jobs queued at once, 2 workers, 1 s each: the job waiting longest has always waited
    less than 4x the median latency of the jobs answered so far (after the first answers)."""
    latencies: list[float] = []
    for step in range(1, 51):
        now = float(step)
        latencies += [now, now]  # two answered each second, each having waited `now`
        oldest_waiting = now  # every job was sent at 0
        assert oldest_waiting < deadline_s(latencies, 0.5, 4.0)


def test_a_late_job_found_nowhere_on_two_looks_is_sent_again() -> None:
    base, confirm = 5.0, 3.0
    job = Delivery("embed", sent_at=0.0)
    assert verdict(job, 4.0, base, queued=False, running=False, confirm_s=confirm)[0] == WAIT  # not late
    step, job = verdict(job, 6.0, base, queued=False, running=False, confirm_s=confirm)
    assert step == SUSPECT and job.missing_since == 6.0
    step, job = verdict(job, 7.0, base, queued=False, running=False, confirm_s=confirm)
    assert step == SUSPECT  # a task that just started shows in its record within a heartbeat
    step, job = verdict(job, 9.5, base, queued=False, running=False, confirm_s=confirm)
    assert step == RESEND and job.attempts == 2 and job.sent_at == 9.5 and job.missing_since is None
    # the second attempt has a doubled deadline
    assert verdict(job, 9.5 + 9.0, base, queued=False, running=False, confirm_s=confirm)[0] == WAIT


@pytest.mark.parametrize("where", ["queued", "running"])
def test_a_job_in_its_queue_or_running_is_never_sent_again(where: str) -> None:
    job = Delivery("embed", sent_at=0.0, missing_since=10.0)
    for now in (20.0, 100.0, 10_000.0):
        step, job = verdict(
            job, now, 5.0, queued=where == "queued", running=where == "running", confirm_s=3.0
        )
        assert step == WAIT and job.missing_since is None and job.attempts == 1


def test_a_job_found_again_between_looks_starts_its_confirmation_over() -> None:
    job = Delivery("embed", sent_at=0.0)
    _, job = verdict(job, 6.0, 5.0, queued=False, running=False, confirm_s=3.0)
    _, job = verdict(job, 7.0, 5.0, queued=False, running=True, confirm_s=3.0)  # it was running
    assert job.missing_since is None and job.seen_at == 7.0
    # seen a moment ago: not looked for again before another deadline has passed
    assert not job.overdue(10.0, 5.0)
    assert verdict(job, 10.0, 5.0, queued=False, running=False, confirm_s=3.0)[0] == WAIT
    step, job = verdict(job, 12.5, 5.0, queued=False, running=False, confirm_s=3.0)
    assert step == SUSPECT and job.missing_since == 12.5


def test_the_task_id_of_a_queued_message() -> None:
    raw = b'{"body": "W10=", "headers": {"id": "abc-1", "task": "voxmill.embed"}, "properties": {}}'
    assert message_task_id(raw) == "abc-1"
    assert message_task_id(b"not json") is None
    assert message_task_id(b'{"headers": null}') is None
    assert message_task_id(b"[1, 2]") is None


# -- Redis URLs ---------------------------------------------------------------------------------
def test_sentinel_urls_name_the_sentinels_the_database_and_the_password() -> None:
    url = "sentinel://:s3cret@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://host3"
    target = connections.parse_sentinel_url(url)
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("host3", 26379))
    assert target.db == 2 and target.password == "s3cret" and target.username is None
    assert connections.is_sentinel(url) and not connections.is_sentinel("redis://h:6379/0")
    assert not connections.is_sentinel(None)
    with pytest.raises(ValueError, match="sentinel"):
        connections.parse_sentinel_url("sentinel://a:1;redis://b:2")
    with pytest.raises(ValueError, match="at least one"):
        connections.parse_sentinel_url(";")


def test_only_sentinel_urls_get_a_master_name_in_celerys_options() -> None:
    settings = Settings(sentinel_master_name="prod")
    assert connections.transport_options(settings, "sentinel://h:26379") == {"master_name": "prod"}
    assert connections.transport_options(settings, "redis://h:6379/0") == {}


def test_the_app_uses_voxmills_sentinel_transport_and_backend_for_sentinel_urls() -> None:
    from workers.queue.app import backend_url, create_app

    url = "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2"
    app = create_app(Settings(broker_url=url, sentinel_master_name="m"), polled_results=True)
    assert app.conf.broker_transport_options["master_name"] == "m"
    assert app.conf.result_backend_transport_options["master_name"] == "m"
    assert type(app.backend).__name__ == "PolledSentinelBackend"
    with app.connection_for_write() as connection:
        assert type(connection.transport).__name__ == "SentinelTransport"
        assert type(connection.transport).__module__ == "workers.queue.app"
    assert backend_url("redis://h:1/0", polled=False) == "workers.queue.app:VoxmillRedisBackend+redis://h:1/0"
