"""The one place voxmill makes Redis clients from settings: plain `redis://` URLs and Sentinel.

A broker or result-backend URL is either `redis://[:password@]host:port/db` (or `rediss://`) or a
list of sentinels, kombu's form: `sentinel://[:password@]host:26379/db;sentinel://host2:26379;...`,
with the master's name in the `sentinel_master_name` setting. The password and database are the
master's and are read from the first sentinel URL that names them (as kombu and Celery do). A
Sentinel client asks the sentinels where the master is whenever it (re)connects, so a failover
costs the clients one reconnect, never a restart.

Celery's side (broker and result backend) gets the same master name through its transport options
(`transport_options`); everything else (worker heartbeats, the watcher, the corpus driver, the
producer's checks, `voxmill status`) calls `broker_client` or `redis_client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from pipeline.settings import Settings

SENTINEL_SCHEMES = ("sentinel",)
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_MASTER_NAME = "voxmill"


def is_sentinel(url: str | None) -> bool:
    """Whether `url` names sentinels rather than one Redis server."""
    return bool(url) and str(url).split("://", 1)[0].lower() in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `sentinel://...;sentinel://...` URL: where the sentinels are, and the master's
    credentials and database."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The sentinels, database and credentials of a `sentinel://` URL (`;`-separated hosts)."""
    sentinels: list[tuple[str, int]] = []
    db: int | None = None
    username = password = None
    for chunk in (part.strip() for part in url.split(";")):
        if not chunk:
            continue
        parts = urlsplit(chunk)
        if parts.scheme.lower() not in SENTINEL_SCHEMES:
            raise ValueError(f"not a sentinel URL: {chunk.split('@')[-1]!r} (expected sentinel://host:port)")
        if not parts.hostname:
            raise ValueError("a sentinel URL needs a host: sentinel://host:26379")
        sentinels.append((parts.hostname, parts.port or DEFAULT_SENTINEL_PORT))
        if password is None and parts.password is not None:
            username, password = unquote(parts.username or "") or None, unquote(parts.password)
        path = parts.path.strip("/")
        if db is None and path:
            db = int(path)
    if not sentinels:
        raise ValueError("a sentinel URL needs at least one sentinel://host:port")
    return SentinelTarget(tuple(sentinels), db or 0, username, password)


def redis_client(url: str, master_name: str = DEFAULT_MASTER_NAME, **options: Any) -> redis.Redis:
    """A client of the Redis server `url` names: that server, or the master the sentinels name.

    `options` are redis-py connection options (socket_timeout, socket_connect_timeout, ...); for
    Sentinel they also apply to the connections to the sentinels themselves (socket options only).
    """
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel_options = {key: value for key, value in options.items() if key.startswith("socket_")}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options, **options)
    credentials: dict[str, Any] = {"db": target.db}
    if target.password is not None:
        credentials.update(password=target.password, username=target.username)
    client: redis.Redis = sentinel.master_for(master_name, **credentials)
    return client


def broker_client(settings: Settings, **options: Any) -> redis.Redis:
    """A client of the broker (queues, heartbeats, generations, run channels)."""
    if not settings.broker_url:
        raise ValueError("no broker configured (VOXMILL_BROKER_URL)")
    return redis_client(settings.broker_url, settings.sentinel_master_name, **options)


def result_client(settings: Settings, **options: Any) -> redis.Redis:
    """A client of the result backend (the broker unless `result_backend_url` is set)."""
    url = settings.result_backend_url or settings.broker_url
    if not url:
        raise ValueError("no broker configured (VOXMILL_BROKER_URL)")
    return redis_client(url, settings.sentinel_master_name, **options)


def transport_options(settings: Settings, url: str | None) -> dict[str, Any]:
    """What Celery's transport (broker) or result backend needs to reach `url`: the master name
    for Sentinel URLs, nothing for plain ones."""
    return {"master_name": settings.sentinel_master_name} if is_sentinel(url) else {}
