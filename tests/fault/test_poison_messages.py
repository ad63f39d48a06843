"""Poison messages: whatever lands on a queue, the worker stays up (issue 31, items 1 and 7).

Messages no voxmill producer sends are pushed straight onto the `embed` queue with kombu's
Producer, as a foreign producer would: bodies that are not Celery's `[args, kwargs, embed]`,
Celery's own tasks (`celery.accumulate`, `celery.backend_cleanup`, a `celery.chord_unlock` that
would re-run every second), a body far over the size bound, a message with no task header, a
callback that would make the worker send a task, a time limit that would kill its pool
process... Then a seeded fuzz of random bodies and headers. One worker (2 pool processes, tiny
stand-in models, a metrics port) takes all of it. Afterwards its main and pool processes have
the same PIDs, every refused message is in the dead-letter list once with its reason and in the
log once, nothing comes back, /metrics counts the refusals, and a good job is answered.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from kombu import Connection, Exchange, Producer
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import CODES
from pipeline.settings import Settings
from tests.conftest import FIXTURES, flush_keeping_claim, make_settings, wait_for
from tests.helpers import celery_headers, worker_dicts
from workers import keys
from workers.embedded import LocalWorkers, free_port
from workers.queue import admission
from workers.queue.admission import DeadLetter
from workers.queue.client import Client

JSON = "application/json"
MSGPACK = "application/x-msgpack"
PICKLE = "application/x-python-serialize"
EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
# A small raw-bytes limit, so that a body far over the bound is a few MiB to send.
MAX_PAYLOAD_BYTES = 1024 * 1024
BODY_LIMIT = admission.body_limit_bytes(MAX_PAYLOAD_BYTES)
QUEUE = "embed"
SETTLE_S = 2.0  # long enough for Celery's chord_unlock to have run again (it retries every second)
JOB_TIMEOUT_S = 60.0
FUZZ_SEED = 31
FUZZ_MESSAGES = 160


@dataclass
class Worker:
    """The worker under attack and what it looked like before."""

    settings: Settings
    workers: LocalWorkers
    redis: redis.Redis
    root: Path
    main_pid: int
    pool_pids: set[int] = field(default_factory=set)

    def log(self) -> str:
        assert self.workers.log_path is not None
        return self.workers.log_path.read_text(errors="replace")

    def dead_letters(self) -> list[DeadLetter]:
        """Every kept refusal, oldest first."""
        return [DeadLetter.from_json(raw) for raw in reversed(self.redis.lrange(keys.DEAD_LETTERS, 0, -1))]

    def pool(self) -> set[int]:
        return {r["pid"] for r in worker_dicts(self.redis) if r.get("ppid") == self.main_pid}

    def assert_unharmed(self) -> None:
        """Same main process, same pool processes, nothing left on or taken from the queue."""
        assert self.workers.alive(), f"the worker exited:\n{self.log()[-3000:]}"
        assert self.workers.process is not None and self.workers.process.pid == self.main_pid
        assert self.pool() == self.pool_pids
        assert self.redis.llen(QUEUE) == 0
        assert self.redis.hlen("unacked") == 0  # kombu's unacknowledged messages: none held back
        for sign in ("Unrecoverable error", "WorkerLostError", "exited with 'signal", "Traceback"):
            assert sign not in self.log()

    def assert_still_serves(self) -> None:
        result = Client(self.settings).run("embed", [self.root / "good.wav"], timeout_s=JOB_TIMEOUT_S)[0]
        assert result.error is None and len(result.embedding or []) == 192

    def refused_counts(self) -> dict[str, float]:
        """`voxmill_messages_refused_total` by reason, scraped from the worker's /metrics."""
        url = f"http://127.0.0.1:{self.settings.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "voxmill_messages_refused_total":
                    counts[sample.labels["reason"]] = sample.value
        return counts


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_models: Path) -> Iterator[Worker]:
    root = tmp_path_factory.mktemp("poison")
    (root / "good.wav").write_bytes((FIXTURES / "chirp_3s.wav").read_bytes())
    settings = make_settings(
        redis_url,
        tiny_models,
        [root],
        metrics_port=free_port(),
        metrics_bind="127.0.0.1",
        max_payload_bytes=MAX_PAYLOAD_BYTES,
    )
    client = redis.Redis.from_url(redis_url)
    flush_keeping_claim(client)
    workers = LocalWorkers(settings, 2, ("tokenize", "embed", "extract"), log_path=root / "worker.log")
    workers.start()
    try:
        workers.wait_ready(120)
        assert workers.process is not None
        state = Worker(settings, workers, client, root, workers.process.pid)
        state.pool_pids = state.pool()
        assert len(state.pool_pids) == 2
        yield state
    finally:
        workers.stop()
        flush_keeping_claim(client)
        client.close()


def publish(settings: Settings, messages: list[tuple[bytes, str | None, dict[str, Any]]]) -> None:
    """(body, content type, headers) straight onto the embed queue, as a foreign producer would."""
    with Connection(settings.broker_url) as conn:
        producer = Producer(conn, exchange=Exchange(QUEUE, type="direct"), routing_key=QUEUE)
        for body, content_type, headers in messages:
            encoding = "binary" if content_type == MSGPACK else "utf-8"
            producer.publish(
                body, content_type=content_type, content_encoding=encoding, headers=headers, declare=[]
            )


# --------------------------------------------------------------------------- named cases


@dataclass(frozen=True)
class Poison:
    """One message no voxmill producer sends, and the reason it must be refused for."""

    name: str
    reason: str
    body: bytes
    headers: dict[str, Any]
    content_type: str | None = JSON

    @property
    def task_id(self) -> object:
        return self.headers.get("id")


def as_json(value: object) -> bytes:
    return json.dumps(value).encode()


def poison(name: str, reason: str, body: object, content_type: str | None = JSON, **headers: Any) -> Poison:
    """A case whose id names it; `body` is encoded as `content_type` says unless it is bytes."""
    task_id = headers.pop("task_id", f"poison-{name}")
    head = celery_headers(headers.pop("task", "voxmill.embed"), task_id, **headers)
    if not isinstance(body, bytes):
        body = msgpack.packb(body) if content_type == MSGPACK else as_json(body)
    return Poison(name, reason, body, head, content_type)


def without(head: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in head.items() if k != name}


GOOD_CALL = [[{"path": "good.wav"}], {}, EMBED]
BACKEND_CLEANUP = {
    "task": "celery.backend_cleanup",
    "args": [],
    "kwargs": {},
    "options": {},
    "immutable": True,
}


def poisons() -> list[Poison]:
    no_task = poison("no-task-header", admission.NO_TASK_HEADER, {"task": "voxmill.embed", "args": []})
    no_id = poison("no-id", admission.BAD_TASK_ID, GOOD_CALL)
    return [
        poison("dict", admission.MALFORMED_BODY, {"args": [{"path": "a.wav"}], "kwargs": {}}),
        poison("two-list", admission.MALFORMED_BODY, [[{"path": "a.wav"}], {}]),
        poison("four-list", admission.MALFORMED_BODY, [[{"path": "a.wav"}], {}, EMBED, None]),
        poison("null", admission.MALFORMED_BODY, None),
        poison("string", admission.MALFORMED_BODY, "hello"),
        poison("number", admission.MALFORMED_BODY, 42),
        poison("nested-garbage", admission.MALFORMED_BODY, [[[[["x"]]]], "y", {"z": [1, {"w": None}]}]),
        poison("msgpack-dict", admission.MALFORMED_BODY, {"audio": b"RIFF"}, MSGPACK),
        poison(
            "huge",
            admission.OVERSIZED,
            [[{"audio": bytes(3 * BODY_LIMIT), "name": "huge"}], {}, EMBED],
            MSGPACK,
        ),
        poison("accumulate", admission.NOT_VOXMILL_TASK, [[1, 2, 3], {}, EMBED], task="celery.accumulate"),
        poison("backend-cleanup", admission.NOT_VOXMILL_TASK, [[], {}, EMBED], task="celery.backend_cleanup"),
        poison(
            "chord-unlock",
            admission.NOT_VOXMILL_TASK,
            [["bogus-group"], {"callback": BACKEND_CLEANUP, "interval": 1, "result": [["x", None]]}, EMBED],
            task="celery.chord_unlock",
        ),
        poison("unknown-task", admission.NOT_VOXMILL_TASK, GOOD_CALL, task="evil.task"),
        Poison(no_task.name, no_task.reason, no_task.body, without(no_task.headers, "task")),
        Poison(no_id.name, no_id.reason, no_id.body, without(no_id.headers, "id")),
        poison(
            "callback",
            admission.WORKFLOW,
            [[{"path": "good.wav"}], {}, {**EMBED, "callbacks": [BACKEND_CLEANUP]}],
        ),
        poison("hard-limit", admission.TIME_LIMIT_HEADER, GOOD_CALL, timelimit=[0.01, None]),
        poison("retries-text", admission.MALFORMED_HEADERS, GOOD_CALL, retries="many"),
        poison("bad-eta", admission.INVALID_TASK, GOOD_CALL, eta="not a date"),
        poison("pickle", admission.UNTRUSTED_CONTENT, b"\x80\x04K\x01.", PICKLE),
        poison("not-json", admission.UNDECODABLE, b"{not json"),
    ]


def test_poison_messages_are_refused_once_and_the_worker_stays(worker: Worker) -> None:
    cases = poisons()
    started = time.monotonic()
    publish(worker.settings, [(c.body, c.content_type, c.headers) for c in cases])
    wait_for(lambda: len(worker.dead_letters()) >= len(cases) or not worker.workers.alive(), timeout_s=30)
    print(f"{len(cases)} poison messages refused in {time.monotonic() - started:.2f} s")
    time.sleep(SETTLE_S)  # nothing comes back: not redelivered, chord_unlock not re-run
    worker.assert_unharmed()

    letters = worker.dead_letters()
    assert len(letters) == len(cases), [letter.id for letter in letters]
    by_id = {letter.id: letter for letter in letters}
    log = worker.log()
    for case in cases:
        letter = by_id.get(repr(case.task_id))
        assert letter is not None, f"{case.name} was not dead-lettered"
        assert letter.reason == case.reason, f"{case.name}: {letter.reason} ({letter.detail})"
        assert letter.queue == QUEUE and letter.body_bytes == len(case.body)
        assert len(letter.body_head) <= DeadLetter.HEAD_BYTES
        lines = [ln for ln in log.splitlines() if f" id={case.task_id!r} " in ln]
        assert len(lines) == 1, f"{case.name}: {lines}"
        assert f"reason={case.reason} " in lines[0] and "WARNING" in lines[0]
        assert len(lines[0]) < 600  # never the body
    assert "Refusing to deserialize untrusted content of type pickle (application/x-python-serialize)" in log
    assert "Can't decode message body" in log
    assert not worker.redis.keys("celery-task-meta-poison-*")  # no task ran, no result was stored

    assert worker.refused_counts() == dict(Counter(c.reason for c in cases))
    worker.assert_still_serves()


# --------------------------------------------------------------------------- the fuzz

PATHS = ["good.wav", "missing.wav", "/etc/passwd", "../../../etc/shadow", "a\x00b.wav", "", "é" * 300]
CONTENT_TYPES = [JSON] * 7 + [MSGPACK] * 2 + [PICKLE, "text/plain", None, "application/x-yaml"]
TASKS = [
    *["voxmill.embed", "voxmill.tokenize", "voxmill.extract"] * 6,
    "celery.accumulate",
    "celery.chord_unlock",
    "celery.group",
    "celery.chain",
    "voxmill.nothing",
    "",
    None,
    7,
]
KWARG_KEYS = ["job", "path", "audio", "x", "name"]
HEADER_NOISE = [
    "shadow",
    "group",
    "group_index",
    "groups",
    "root_id",
    "parent_id",
    "stamped_headers",
    "stamps",
    "argsrepr",
    "kwargsrepr",
    "replaced_task_nesting",
    "origin",
    "reply_to",
]


class Fuzz:
    """Random messages from one seed: JSON values, near-miss calls, odd headers and content types."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def value(self, depth: int = 0) -> Any:
        """A random JSON value."""
        rng = self.rng
        kind = rng.randrange(7 if depth < 3 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice([0, -1, 1, 2**31, -(2**63), rng.randrange(-1000, 1000)])
        if kind == 3:
            return rng.choice([0.0, -1.5, 1e300, rng.random()])
        if kind == 4:
            return "".join(rng.choice("ab/.\\\"'\n\x00é音") for _ in range(rng.randrange(12)))
        if kind == 5:
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(self.value(depth + 1))[:8]: self.value(depth + 1) for _ in range(rng.randrange(4))}

    def job(self, binary: bool) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            return {"path": rng.choice([*PATHS, self.value()])}
        if roll < 0.6 and binary:
            return {"audio": rng.randbytes(rng.randrange(64)), "name": rng.choice(["x", 5, None])}
        if roll < 0.7:
            return {"audio": self.value()}
        return self.value()

    def call(self, binary: bool) -> list[Any]:
        """A 3-list whose parts are mostly, not always, of the right type."""
        rng = self.rng
        args = rng.choice([[self.job(binary)], [], [self.job(binary), self.job(binary)], self.value()])
        kwargs = rng.choice([{}, {}, {"job": self.job(binary)}, {rng.choice(KWARG_KEYS): self.value()}])
        if rng.random() < 0.1:
            kwargs = self.value()
        embed = rng.choice([EMBED, EMBED, EMBED, None, {}, self.value(), {"callbacks": [BACKEND_CLEANUP]}])
        return [args, kwargs, embed]

    def body(self, content_type: str | None) -> bytes:
        rng = self.rng
        binary = content_type == MSGPACK
        roll = rng.random()
        if roll < 0.05 or content_type not in (JSON, MSGPACK):
            return rng.randbytes(rng.randrange(1, 40))
        if roll < 0.2:
            value = self.value()
        elif roll < 0.9:
            value = self.call(binary)
        else:
            value = [self.value() for _ in range(rng.choice([0, 1, 2, 4, 5]))]
        return msgpack.packb(value) if binary else as_json(value)

    def headers(self, index: int) -> dict[str, Any]:
        rng = self.rng
        head = celery_headers(rng.choice(TASKS), f"fuzz-{index}-{rng.randrange(10**6)}")
        roll = rng.random()
        if roll < 0.08:
            del head["id"]
        elif roll < 0.12:
            head["id"] = rng.choice(["", 5, ["x"], "y" * 300])
        if head["task"] is None:
            del head["task"]
        if rng.random() < 0.1:
            head["retries"] = rng.choice([3, -1, "x", None])
        if rng.random() < 0.08:
            head["timelimit"] = rng.choice([None, [0.01, None], "junk", [None, None, None], []])
        if rng.random() < 0.08:
            head["eta"] = rng.choice(["not a date", 7, "2001-01-01T00:00:00+00:00"])
        if rng.random() < 0.05:
            head["expires"] = rng.choice(["soon", 7])
        if rng.random() < 0.2:
            head[rng.choice(HEADER_NOISE)] = self.value()
        return head

    def messages(self, count: int) -> list[tuple[bytes, str | None, dict[str, Any]]]:
        out = []
        for index in range(count):
            content_type = self.rng.choice(CONTENT_TYPES)
            out.append((self.body(content_type), content_type, self.headers(index)))
        return out


def proper_id(head: dict[str, Any]) -> str | None:
    """The id a fuzz message can be found by: its own, when it is a fuzz id."""
    task_id = head.get("id")
    return task_id if isinstance(task_id, str) and task_id.startswith("fuzz-") else None


def stored_result(client: redis.Redis, task_id: str) -> dict[str, Any] | None:
    raw = client.get(f"celery-task-meta-{task_id}")
    return json.loads(raw) if raw is not None else None


def test_a_fuzz_of_messages_is_answered_or_refused(worker: Worker) -> None:
    messages = Fuzz(FUZZ_SEED).messages(FUZZ_MESSAGES)
    worker.redis.delete(keys.DEAD_LETTERS)  # the list is capped: count this test's letters alone
    counts_before = worker.refused_counts()
    started = time.monotonic()
    publish(worker.settings, messages)
    ids = [proper_id(head) for _, _, head in messages]

    def accounted() -> tuple[int, int]:
        answered = sum(1 for i in ids if i is not None and worker.redis.exists(f"celery-task-meta-{i}"))
        return answered, worker.redis.llen(keys.DEAD_LETTERS)

    wait_for(lambda: sum(accounted()) >= len(messages) or not worker.workers.alive(), timeout_s=60)
    time.sleep(SETTLE_S)
    worker.assert_unharmed()
    answered, refused = accounted()
    print(f"fuzz: {answered} answered, {refused} refused in {time.monotonic() - started:.1f} s")
    assert answered + refused == len(messages)

    refusals = worker.dead_letters()
    refused_ids = Counter(letter.id for letter in refusals)
    codes: Counter[str] = Counter()
    for task_id in ids:
        if task_id is None:
            continue
        result = stored_result(worker.redis, task_id)
        was_refused = refused_ids[repr(task_id)]
        assert (result is not None) + was_refused == 1, f"{task_id}: result {result}, refused {was_refused}"
        if result is not None:
            assert result["status"] == "SUCCESS", result
            error = result["result"]["error"]
            codes["ok" if error is None else error["code"]] += 1
            assert error is None or error["code"] in CODES, error
    reasons = Counter(letter.reason for letter in refusals)
    print(f"fuzz answers: {dict(codes)}; refusals: {dict(reasons)}")
    assert codes and reasons  # both kinds happened
    unforeseen = [letter for letter in refusals if letter.reason == admission.HANDLER_ERROR]
    assert not unforeseen, unforeseen  # admission foresaw every refusal
    after = worker.refused_counts()
    assert {r: after.get(r, 0.0) - counts_before.get(r, 0.0) for r in after} == {
        r: float(reasons.get(r, 0)) for r in after
    }
    worker.assert_still_serves()


# Items on a queue list that are no kombu envelope at all (a raw LPUSH): kombu's read loop raised
# on them and the worker's main process exited.
NOT_ENVELOPES = [
    b"garbage",
    b"\xff\xfe\x00",
    b"[1, 2, 3]",
    b"null",
    b'{"properties": 5}',
    json.dumps({"body": 5, "headers": [], "properties": {}, "content-type": JSON}).encode(),
    json.dumps({"body": "", "headers": {}, "properties": {"delivery_tag": None}}).encode(),
]


def test_items_that_are_no_message_are_dropped_and_the_worker_stays(worker: Worker) -> None:
    before = worker.log().count("reason=not_an_envelope")
    for item in NOT_ENVELOPES:
        worker.redis.lpush(QUEUE, item)
    wait_for(lambda: worker.redis.llen(QUEUE) == 0 or not worker.workers.alive(), timeout_s=30)
    time.sleep(SETTLE_S)
    worker.assert_unharmed()
    assert worker.log().count("reason=not_an_envelope") - before == len(NOT_ENVELOPES)
    worker.assert_still_serves()
