"""Admission of broker messages (`workers.queue.admission`): pure, no broker, no Celery worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from pipeline.settings import AudioLimits
from tests.helpers import celery_headers
from workers.queue import admission, transport
from workers.queue.admission import (
    NOT_DECODED,
    REASONS,
    Admission,
    DeadLetter,
    body_limit_bytes,
    body_refusal,
    shown,
)

VOXMILL_TASKS = frozenset({"voxmill.tokenize", "voxmill.embed", "voxmill.extract", "voxmill.shard"})
LIMIT = body_limit_bytes(AudioLimits().max_payload_bytes)
GATE = Admission(VOXMILL_TASKS, LIMIT)
JSON = "application/json"
MSGPACK = "application/x-msgpack"
EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


headers = celery_headers


def refusal(head: object, body: object, content_type: str = JSON) -> str | None:
    """The decision on a JSON (or msgpack) message: first on what it claims, then on its body."""
    raw = msgpack.packb(body) if content_type == MSGPACK else json.dumps(body).encode()
    first = GATE.refusal(head, content_type, len(raw))
    return first if first is not None else GATE.refusal(head, content_type, len(raw), body)


# --------------------------------------------------------------------------- what is admitted


@pytest.mark.parametrize(
    ("task", "body", "content_type"),
    [
        ("voxmill.embed", [[{"path": "a.wav"}], {}, EMBED], JSON),
        ("voxmill.tokenize", [[], {"job": {"path": "a.wav"}}, None], JSON),
        ("voxmill.extract", [[{"audio": b"RIFF....", "name": "x"}], {}, EMBED], MSGPACK),
        ("voxmill.shard", [[{"run": "r", "shard": 3, "op": "embed"}], {}, {}], JSON),
    ],
)
def test_voxmill_task_messages_are_admitted(task: str, body: Any, content_type: str) -> None:
    assert refusal(headers(task), body, content_type) is None


@pytest.mark.parametrize(
    "job",
    [{"path": 5}, ["a.wav"], {"file": "a.wav"}, None, "a.wav"],
    ids=["path_is_int", "job_is_list", "no_known_field", "null_job", "string_job"],
)
def test_a_wrong_job_in_a_well_formed_call_is_admitted_to_be_answered(job: object) -> None:
    """`bad_request` is the task's answer (`workers.queue.tasks.decode_job`), not a refusal."""
    assert refusal(headers(), [[job], {}, EMBED]) is None
    assert refusal(headers(), [[job, "extra"], {}, EMBED]) is None  # two arguments: answered too


def test_a_retried_task_is_admitted() -> None:
    """What `task.retry(countdown=...)` sends back: an eta and a retry count."""
    head = headers(eta="2030-01-01T00:00:00.000000+00:00", retries=3)
    assert refusal(head, [[{"path": "a.wav"}], {}, EMBED]) is None


def test_decided_on_claims_alone_until_the_body_is_decoded() -> None:
    assert GATE.refusal(headers(), JSON, 10, NOT_DECODED) is None
    assert GATE.refusal(headers(), JSON, 10) is None


# --------------------------------------------------------------------------- the body


@pytest.mark.parametrize(
    "body",
    [
        {"args": [], "kwargs": {}},
        [[], {}],
        [[], {}, None, None],
        None,
        "hello",
        42,
        3.5,
        True,
        [],
        [[[[["deep"]]]], "x", 5],
        ["args", {}, None],
        [{"path": "a.wav"}, {}, None],
        [[], [], None],
        [[], "kwargs", None],
        [[], {}, ["embed"]],
        [[], {}, "embed"],
    ],
    ids=repr,
)
def test_a_body_that_is_not_args_kwargs_embed_is_malformed(body: object) -> None:
    assert refusal(headers(), body) == admission.MALFORMED_BODY


def test_kwargs_keys_must_be_strings() -> None:
    """msgpack maps may have bytes keys: a task call would fail with a TypeError, not an answer."""
    assert body_refusal([[], {b"job": 1}, None]) == admission.MALFORMED_BODY
    assert refusal(headers(), [[], {b"job": {"path": "a"}}, None], MSGPACK) == admission.MALFORMED_BODY


@pytest.mark.parametrize("key", admission.WORKFLOW_KEYS)
def test_a_body_with_a_workflow_is_refused(key: str) -> None:
    """A callback or chain would make the worker send tasks of the message's choosing."""
    signature = {"task": "celery.backend_cleanup", "args": [], "kwargs": {}, "options": {}}
    embed: dict[str, Any] = {**EMBED, key: [signature]}
    assert refusal(headers(), [[{"path": "a.wav"}], {}, embed]) == admission.WORKFLOW
    assert refusal(headers(), [[{"path": "a.wav"}], {}, {**embed, key: []}]) is None  # empty is none


# --------------------------------------------------------------------------- the headers


@pytest.mark.parametrize(
    "task", ["celery.accumulate", "celery.backend_cleanup", "celery.chord_unlock", "evil.task", "", 5, ["x"]]
)
def test_only_voxmill_tasks_are_admitted(task: object) -> None:
    assert refusal(headers(task), [[], {}, None]) == admission.NOT_VOXMILL_TASK


def test_a_message_without_a_task_header_is_refused() -> None:
    head = headers()
    del head["task"]
    assert refusal(head, {"task": "voxmill.embed", "id": "x", "args": [], "kwargs": {}}) == (
        admission.NO_TASK_HEADER
    )


@pytest.mark.parametrize("head", [None, [], "task", 5, ["task", "voxmill.embed"]], ids=repr)
def test_headers_that_are_not_an_object_are_refused(head: object) -> None:
    assert refusal(head, [[], {}, None]) == admission.MALFORMED_HEADERS


@pytest.mark.parametrize("task_id", [None, "", 5, ["a"], "x" * (admission.MAX_TASK_ID_CHARS + 1)], ids=repr)
def test_a_task_id_must_be_a_short_string(task_id: object) -> None:
    assert refusal(headers(id=task_id), [[], {}, None]) == admission.BAD_TASK_ID


@pytest.mark.parametrize(
    "more",
    [
        {"retries": "3"},
        {"eta": 5},
        {"expires": ["x"]},
        {"shadow": 1},
        {"ignore_result": "no"},
        {"group": 1},
        {"groups": "g"},
        {"argsrepr": {"a": 1}},
        {"stamped_headers": True},
        {"stamped_headers": [["a"]]},
        {"stamps": []},
    ],
    ids=repr,
)
def test_a_celery_header_of_the_wrong_type_is_refused(more: dict[str, object]) -> None:
    assert refusal(headers(**more), [[], {}, None]) == admission.MALFORMED_HEADERS


@pytest.mark.parametrize(
    "limits", [[None, 0.01], [0.01, None], [300, 270], "1", 5, [1], [], [None, None, None]], ids=repr
)
def test_a_message_setting_its_own_time_limits_is_refused(limits: object) -> None:
    """A hard limit of 10 ms would kill the pool process that runs the task, again and again."""
    assert refusal(headers(timelimit=limits), [[], {}, None]) == admission.TIME_LIMIT_HEADER


@pytest.mark.parametrize("limits", [None, [None, None], (None, None)], ids=repr)
def test_no_time_limits_is_what_voxmill_sends(limits: object) -> None:
    assert refusal(headers(timelimit=limits), [[], {}, None]) is None


# --------------------------------------------------------------------------- content type and size


@pytest.mark.parametrize(
    "content_type", [None, "", "application/x-python-serialize", "application/x-yaml", "application/data"]
)
def test_only_json_and_msgpack_are_decoded(content_type: object) -> None:
    assert GATE.refusal(headers(), content_type, 10) == admission.UNTRUSTED_CONTENT


def test_the_content_types_are_celerys_json_and_msgpack() -> None:
    from kombu.serialization import registry

    assert (registry.name_to_type["json"], registry.name_to_type["msgpack"]) == admission.CONTENT_TYPES


def test_the_body_limit_holds_the_largest_raw_bytes_job_with_room_to_spare() -> None:
    limit_bytes = AudioLimits().max_payload_bytes
    largest = msgpack.packb([[{"audio": bytes(limit_bytes), "name": "n" * 4096}], {}, EMBED])
    assert len(largest) < LIMIT
    assert limit_bytes * 4 // 3 <= LIMIT  # the same job base64-encoded fits too
    assert 2 * limit_bytes > LIMIT  # and it is a bound: a 64 MiB body is refused


def test_a_body_over_the_limit_is_refused_before_decoding() -> None:
    assert GATE.refusal(headers(), MSGPACK, LIMIT) is None
    assert GATE.refusal(headers(), MSGPACK, LIMIT + 1) == admission.OVERSIZED
    assert GATE.refusal(headers(), MSGPACK, 64 * 1024 * 1024) == admission.OVERSIZED
    assert GATE.refusal(headers(), JSON, None) == admission.MALFORMED_BODY  # a body that is no bytes


def test_headers_are_judged_before_the_size() -> None:
    """A foreign task is refused as foreign, however large."""
    assert GATE.refusal(headers("celery.accumulate"), JSON, 10 * LIMIT) == admission.NOT_VOXMILL_TASK


# --------------------------------------------------------------------------- explanations


def test_every_reason_is_explained_and_stable() -> None:
    constants = {v for k, v in vars(admission).items() if k.isupper() and isinstance(v, str) and v.islower()}
    assert constants - {"json", "msgpack"} >= set(REASONS)
    assert all(REASONS[reason] for reason in REASONS)
    assert all(reason.replace("_", "").isalpha() and reason.islower() for reason in REASONS)


@pytest.mark.parametrize(
    "content_type", ["application/x-python-serialize", "application/x-yaml", "application/x-voxmill-unknown"]
)
def test_explanations_keep_kombus_words_for_an_untrusted_content_type(content_type: str) -> None:
    from kombu.exceptions import ContentDisallowed
    from kombu.serialization import loads

    with pytest.raises(ContentDisallowed) as kombus:
        loads(b"x", content_type, "binary", accept=admission.CONTENT_TYPES)
    assert GATE.explain(admission.UNTRUSTED_CONTENT, content_type, 9) == str(kombus.value)


def test_explanations_are_one_short_line() -> None:
    odd = GATE.explain(admission.UNTRUSTED_CONTENT, "a\nb" * 100, 9)
    assert "\n" not in odd and len(odd) < 200
    assert (
        GATE.explain(admission.OVERSIZED, JSON, LIMIT + 1)
        == f"body is {LIMIT + 1} bytes; the limit is {LIMIT}"
    )
    assert GATE.explain(admission.MALFORMED_BODY, JSON, 3) == REASONS[admission.MALFORMED_BODY]


# --------------------------------------------------------------------------- dead letters


def test_a_dead_letter_keeps_the_head_of_the_body_and_round_trips() -> None:
    body = json.dumps({"args": "x" * 10_000}).encode()
    head = headers("celery.accumulate", id="abc-1")
    letter = DeadLetter.of(admission.NOT_VOXMILL_TASK, "foreign", head, "embed", body)
    assert (letter.reason, letter.task, letter.id, letter.queue) == (
        "not_voxmill_task",
        "'celery.accumulate'",
        "'abc-1'",
        "embed",
    )
    assert letter.body_bytes == len(body)
    assert letter.body_head == body[: DeadLetter.HEAD_BYTES].decode()
    assert DeadLetter.from_json(letter.to_json()) == letter
    assert len(letter.to_json()) < 1000


def test_a_dead_letter_shows_no_control_characters_no_passwords_and_nothing_long() -> None:
    head = {"task": "evil\n[CRITICAL] forged line", "id": "i" * 100_000}
    body = b"\xff\xfe redis://user:hunter2@host:6379/0 " + bytes(range(32))
    letter = DeadLetter.of(admission.NOT_VOXMILL_TASK, "d" * 10_000, head, None, body)
    assert "\n" not in letter.task and len(letter.id) <= 80 and len(letter.detail) <= 300
    assert "hunter2" not in letter.body_head and "***" in letter.body_head
    assert letter.body_head.startswith("\\xff\\xfe")
    assert letter.queue == "None"
    assert "hunter2" not in shown("redis://user:hunter2@" + "h" * 5000)


@pytest.mark.parametrize("body", [None, 42, {"a": 1}], ids=repr)
def test_a_dead_letter_of_a_body_that_is_not_bytes(body: object) -> None:
    letter = DeadLetter.of(admission.MALFORMED_BODY, "", [1, 2], {"x": 1}, body)
    assert letter.body_bytes is None and letter.body_head == repr(body)
    assert (letter.task, letter.id) == ("None", "None")
    assert DeadLetter.from_json(letter.to_json()) == letter


ENVELOPE = {
    "body": "W10=",
    "content-encoding": "utf-8",
    "content-type": "application/json",
    "headers": {"task": "voxmill.embed", "id": "x"},
    "properties": {
        "body_encoding": "base64",
        "delivery_tag": "tag-1",
        "delivery_info": {"exchange": "embed", "routing_key": "embed"},
    },
}


def test_a_kombu_envelope_is_admitted_by_its_shape() -> None:
    assert transport.envelope_refusal(ENVELOPE) is None


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [1, 2],
        "text",
        {"properties": 5},
        {**ENVELOPE, "properties": {**ENVELOPE["properties"], "delivery_tag": None}},
        {**ENVELOPE, "properties": {**ENVELOPE["properties"], "delivery_info": {"routing_key": "embed"}}},
        {**ENVELOPE, "properties": {**ENVELOPE["properties"], "body_encoding": "rot13"}},
        {**ENVELOPE, "body": 5},
        {**ENVELOPE, "headers": []},
        {**ENVELOPE, "content-type": 7},
    ],
)
def test_what_is_no_envelope_is_refused(payload: object) -> None:
    assert transport.envelope_refusal(payload) == transport.NOT_AN_ENVELOPE


def test_docs_list_every_reason() -> None:
    """docs/bad-input.md's table of refusal reasons is `REASONS`, row for row."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bad-input.md").read_text()
    block = doc.split("<!-- reasons:start -->", 1)[1].split("<!-- reasons:end -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert rows == [f"| `{reason}` | {meaning} |" for reason, meaning in admission.REASONS.items()]
