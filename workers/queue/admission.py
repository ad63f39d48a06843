"""Admission: which broker messages a worker takes as voxmill tasks, decided before Celery sees them.

Anything can land on voxmill's queues: a foreign Celery task (`celery.chord_unlock` re-runs
itself every second), a body that is not Celery's `[args, kwargs, embed]` (Celery unpacks it in
the worker's main process, and an exception there stops the worker), a body far larger than any
job. `Admission.refusal` looks at what a message claims (headers, content type, body size), then
at its decoded body, and names the reason it is refused, or returns None; the worker's consumer
(`workers.queue.consumer`) does the refusing and keeps a `DeadLetter` of it. Pure: no Celery,
no Redis.

A refusal is for messages no voxmill producer sends. A voxmill task whose job is wrong (a field
of the wrong type, two arguments instead of one) is admitted and answered with `bad_request`.
"""

from __future__ import annotations

import json
import reprlib
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from pipeline.redaction import redact
from workers.queue.transport import CONTENT_TYPES, NOT_AN_ENVELOPE

# kombu's names of the content types it knows but a worker refuses (for the words of a refusal).
SERIALIZER_NAMES = {"application/x-python-serialize": "pickle", "application/x-yaml": "yaml"}
# A raw-bytes job travels as msgpack: the bytes plus a few of framing. Room for base64 (4/3)
# and a margin for the rest of the call (name, embed, headers) makes the body limit.
BODY_MARGIN_BYTES = 1024 * 1024
# Celery's task ids are uuids; a longer id is not one of ours.
MAX_TASK_ID_CHARS = 200
# The embed's workflow parts: voxmill tasks run alone, they never send others when done.
WORKFLOW_KEYS = ("callbacks", "errbacks", "chain", "chord")
# How far past a cut a URL password is looked for (`shown`, `text_head`); reprs of long values are
# cut to about that much before anything else.
READ_AHEAD_CHARS = 1024
# Celery headers a worker reads before or around the task, and the type each must have (or null).
HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "retries": (int,),
    "eta": (str,),
    "expires": (str,),
    "shadow": (str,),
    "root_id": (str,),
    "parent_id": (str,),
    "group": (str,),
    "group_index": (int,),
    "groups": (list, tuple),
    "ignore_result": (bool,),
    "argsrepr": (str,),
    "kwargsrepr": (str,),
    "replaced_task_nesting": (int,),
    "stamped_headers": (list, tuple),  # of names (strings): Celery looks each up in `stamps`
    "stamps": (dict,),
}

MALFORMED_HEADERS = "malformed_headers"
NO_TASK_HEADER = "no_task_header"
NOT_VOXMILL_TASK = "not_voxmill_task"
BAD_TASK_ID = "bad_task_id"
TIME_LIMIT_HEADER = "time_limit_header"
UNTRUSTED_CONTENT = "untrusted_content"
OVERSIZED = "oversized"
UNDECODABLE = "undecodable"
MALFORMED_BODY = "malformed_body"
WORKFLOW = "workflow"
INVALID_TASK = "invalid_task"
HANDLER_ERROR = "handler_error"

# Every reason a message is refused for (stable strings: extend, never rename), and what it means.
REASONS: dict[str, str] = {
    MALFORMED_HEADERS: "its headers are not an object, or a Celery header has the wrong type",
    NO_TASK_HEADER: "it names no task (no 'task' header: not Celery's message protocol 2)",
    NOT_VOXMILL_TASK: "it names a task that is not voxmill's",
    BAD_TASK_ID: "its 'id' header is missing, not a string, empty or too long",
    TIME_LIMIT_HEADER: "it sets its own time limits (a 'timelimit' other than [null, null]); a worker's "
    "come from its settings",
    UNTRUSTED_CONTENT: "Refusing to deserialize untrusted content of this type (JSON and msgpack only)",
    OVERSIZED: "its body is larger than any voxmill job can be",
    UNDECODABLE: "Can't decode message body",
    MALFORMED_BODY: "its body is not Celery's [args (a list), kwargs (an object), embed (an object or null)]",
    WORKFLOW: "it carries callbacks, errbacks, a chain or a chord: voxmill tasks run alone",
    INVALID_TASK: "Celery refused it as an invalid task message (e.g. an unreadable eta)",
    HANDLER_ERROR: "handling it raised an unexpected error",
    NOT_AN_ENVELOPE: "an item on a queue list that is no kombu message (a raw push): dropped as read",
}


class NotDecoded:
    """The body argument of `Admission.refusal` before the body is decoded."""


NOT_DECODED = NotDecoded()


def body_limit_bytes(max_payload_bytes: int) -> int:
    """The largest message body a worker decodes: 4/3 of the raw-bytes job limit plus a margin."""
    return max_payload_bytes * 4 // 3 + BODY_MARGIN_BYTES


@dataclass(frozen=True)
class Admission:
    """What a worker admits: `tasks` (voxmill's task names) with bodies of at most `body_limit_bytes`."""

    tasks: frozenset[str]
    body_limit_bytes: int

    def refusal(
        self, headers: object, content_type: object, body_size: int | None, body: object = NOT_DECODED
    ) -> str | None:
        """Why a message is refused (a `REASONS` key), or None to hand it to Celery.

        `body_size`: its raw body's length in bytes (None when the body is not bytes or text);
        `body`: the decoded body, or `NOT_DECODED` to decide on what the message claims alone.
        """
        if not isinstance(headers, Mapping):
            return MALFORMED_HEADERS
        task = headers.get("task")
        if task is None:
            return NO_TASK_HEADER
        if not isinstance(task, str) or task not in self.tasks:
            return NOT_VOXMILL_TASK
        task_id = headers.get("id")
        if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID_CHARS:
            return BAD_TASK_ID
        if not headers_well_typed(headers):
            return MALFORMED_HEADERS
        if sets_time_limit(headers):
            return TIME_LIMIT_HEADER
        if content_type not in CONTENT_TYPES:
            return UNTRUSTED_CONTENT
        if body_size is None:
            return MALFORMED_BODY
        if body_size > self.body_limit_bytes:
            return OVERSIZED
        if isinstance(body, NotDecoded):
            return None
        return body_refusal(body)

    def explain(self, reason: str, content_type: object, body_size: int | None) -> str:
        """One line on why a message was refused for `reason`."""
        if reason == UNTRUSTED_CONTENT:  # kombu's words, which operators may already grep for
            plain = isinstance(content_type, str) and content_type.isprintable() and len(content_type) <= 80
            if not plain:
                return f"Refusing to deserialize untrusted content of type {shown(content_type)}"
            named = SERIALIZER_NAMES.get(str(content_type), str(content_type))
            return f"Refusing to deserialize untrusted content of type {named} ({content_type})"
        if reason == OVERSIZED:
            return f"body is {body_size} bytes; the limit is {self.body_limit_bytes}"
        return REASONS.get(reason, reason)


def headers_well_typed(headers: Mapping[Any, Any]) -> bool:
    """Whether every Celery header a worker reads is null or of its type (`HEADER_TYPES`)."""
    typed = all(
        headers.get(name) is None or isinstance(headers.get(name), t) for name, t in HEADER_TYPES.items()
    )
    return typed and all(isinstance(name, str) for name in headers.get("stamped_headers") or ())


def sets_time_limit(headers: Mapping[Any, Any]) -> bool:
    """Whether a message sets its own time limits (Celery's `timelimit: [hard, soft]` header).

    voxmill's producers never do: a worker's limits come from its settings. A message's own
    limits would let it kill the pool process that runs it (a hard limit of 0.01 s), and
    with `task_reject_on_worker_lost` the message would come back to kill the next one.
    """
    limits = headers.get("timelimit")
    return limits is not None and (not isinstance(limits, (list, tuple)) or list(limits) != [None, None])


def body_refusal(body: object) -> str | None:
    """Why a decoded body is refused, or None: it must be `[args, kwargs, embed]` of one task."""
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return MALFORMED_BODY
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        return MALFORMED_BODY
    if not all(isinstance(key, str) for key in kwargs):
        return MALFORMED_BODY
    if embed is None:
        return None
    if not isinstance(embed, dict):
        return MALFORMED_BODY
    if any(embed.get(key) for key in WORKFLOW_KEYS):
        return WORKFLOW
    return None


def shown(value: object, limit: int = 80) -> str:
    """`value` for a log line or a dead letter: its repr (control characters escaped) with URL
    passwords hidden, cut to `limit` characters (a password is hidden before the cut)."""
    cut = reprlib.Repr()
    cut.maxstring = cut.maxother = READ_AHEAD_CHARS
    text = redact(cut.repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def text_head(raw: bytes, limit: int) -> str:
    """The first `limit` characters of `raw` as text: non-UTF-8 bytes backslash-escaped, URL
    passwords hidden (before the cut)."""
    return redact(raw[: limit + READ_AHEAD_CHARS].decode("utf-8", "backslashreplace"))[:limit]


@dataclass(frozen=True)
class DeadLetter:
    """A refused message, as kept in `workers.keys.DEAD_LETTERS` (newest first), e.g.

        {"time": 1767225600.125, "reason": "not_voxmill_task", "detail": "it names a task that is
         not voxmill's", "task": "'celery.accumulate'", "id": "'a1'", "queue": "embed",
         "body_bytes": 15, "body_head": "[[1], {}, null]"}

    `task` and `id` are as `shown` shows them (reprs, cut short); `body_bytes` is the raw body's
    length (characters if it was text); `body_head` its first `HEAD_BYTES` bytes as text
    (`text_head`).
    """

    time: float
    reason: str
    detail: str
    task: str
    id: str
    queue: str
    body_bytes: int | None
    body_head: str

    HEAD_BYTES: ClassVar[int] = 256

    @classmethod
    def of(cls, reason: str, detail: str, headers: object, queue: object, body: object) -> DeadLetter:
        """The dead letter of a message refused for `reason`, from what it carried."""
        fields = headers if isinstance(headers, Mapping) else {}
        size, head = None, shown(body, cls.HEAD_BYTES)
        if isinstance(body, (bytes, bytearray, memoryview, str)):  # only its head is copied
            start = body[: cls.HEAD_BYTES + READ_AHEAD_CHARS]
            raw = start.encode("utf-8", "surrogateescape") if isinstance(start, str) else bytes(start)
            size, head = len(body), text_head(raw, cls.HEAD_BYTES)
        return cls(
            time=round(time.time(), 3),
            reason=reason,
            detail=detail[:300],
            task=shown(fields.get("task")),
            id=shown(fields.get("id")),
            queue=queue if isinstance(queue, str) else shown(queue),
            body_bytes=size,
            body_head=head,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        return cls(**json.loads(text))
