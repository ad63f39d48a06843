"""Generation records in Redis: what the watcher publishes and rejects, and what workers read.

A generation is keyed by content: per role, one hash (`keys.GENERATION`) holds the sha256 every
worker must serve, the path and size of the file the watcher validated, the generation number
(from `keys.GENERATION_COUNTER`) and the time. `publish` is one atomic script: publishing the
sha256 that is already published changes nothing (no new number, no announcement), so any number
of watchers, restarts and machines holding the same file agree on one generation.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import redis

from workers import keys

# KEYS: generation hash, counter, channel. ARGV: sha256, role, then field/value pairs.
# Returns the new generation number, or 0 when that sha256 is already the published one.
_PUBLISH = """
if redis.call('HGET', KEYS[1], 'sha256') == ARGV[1] then
  return 0
end
local generation = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'sha256', ARGV[1], 'generation', generation, unpack(ARGV, 3))
redis.call('PUBLISH', KEYS[3], ARGV[2])
return generation
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decoded(raw: dict[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items()}


def published(client: redis.Redis, role: str) -> dict[str, str]:
    """The published generation of `role` ({} when none): sha256, generation, path, file, size, time..."""
    return _decoded(client.hgetall(keys.GENERATION.format(role=role)))


def last_rejection(client: redis.Redis, role: str) -> dict[str, str]:
    """The last rejected candidate of `role` ({} when none): path, sha256, reason, time, count."""
    return _decoded(client.hgetall(keys.REJECTION.format(role=role)))


def publish(client: redis.Redis, role: str, sha256: str, fields: dict[str, Any]) -> int:
    """Make `sha256` the generation of `role` and announce it; 0 when it already was (a no-op).

    `fields` (path, file, size, host, ...) are stored beside sha256, generation and time.
    """
    values = {"time": f"{time.time():.3f}", **fields}
    flat: list[str] = []
    for name, value in values.items():
        flat += [name, str(value)]
    script = client.register_script(_PUBLISH)
    keys_ = [
        keys.GENERATION.format(role=role),
        keys.GENERATION_COUNTER.format(role=role),
        keys.GENERATION_CHANNEL,
    ]
    return int(script(keys=keys_, args=[sha256, role, *flat]))


def record_rejection(client: redis.Redis, role: str, fields: dict[str, Any]) -> None:
    """Store a rejected candidate (path, sha256, reason, ...) as the role's last rejection; count it."""
    key = keys.REJECTION.format(role=role)
    pipe = client.pipeline()
    pipe.hset(key, mapping={"time": f"{time.time():.3f}", **{k: str(v) for k, v in fields.items()}})
    pipe.hincrby(key, "count", 1)
    pipe.execute()


def announce_candidate(
    client: redis.Redis, host: str, role: str, fields: dict[str, Any], ttl_s: float
) -> None:
    """Say that `host`'s watcher validates a candidate (sha256, file...) for `role`, and wake the workers.

    Workers on `host` use it to stand one process aside, so that the validation gets a core
    (`workers.reload.holder`). The record expires after `ttl_s` if the watcher dies meanwhile.
    """
    record = json.dumps({"since": round(time.time(), 3), "host": host, **fields})
    pipe = client.pipeline()
    pipe.set(keys.CANDIDATE.format(host=host, role=role), record, ex=max(1, math.ceil(ttl_s)))
    pipe.publish(keys.GENERATION_CHANNEL, role)
    pipe.execute()


def withdraw_candidate(client: redis.Redis, host: str, role: str) -> None:
    """The validation of `host`'s candidate for `role` is over (published or rejected)."""
    client.delete(keys.CANDIDATE.format(host=host, role=role))


def candidate(client: redis.Redis, host: str, role: str) -> dict[str, Any]:
    """The candidate `host`'s watcher is validating for `role` ({} when none)."""
    raw = client.get(keys.CANDIDATE.format(host=host, role=role))
    return dict(json.loads(raw)) if raw else {}


def candidates(client: redis.Redis, role: str) -> list[dict[str, Any]]:
    """Every machine's candidate under validation for `role`."""
    found = []
    for key in client.scan_iter(match=keys.CANDIDATE_PATTERN.format(role=role), count=500):
        raw = client.get(key)
        if raw:
            found.append(dict(json.loads(raw)))
    return found
