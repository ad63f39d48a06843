"""The broker: reachable, authenticated, AOF, `maxmemory-policy`."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pipeline.settings import Settings
from workers.observe.doctor.check import (
    Check,
    error,
    ok,
    warning,
)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def broker_checks(settings: Settings, timeout_s: float = 3.0) -> list[Check]:
    """Reachable and authenticated; AOF (queued jobs survive a restart); no eviction of queued jobs."""
    import redis

    url = settings.broker_url
    shown = settings.redacted_broker_url()
    if not url:
        return [
            warning(
                "broker",
                "VOXMILL_BROKER_URL is not set: extract, up and demo start an embedded Redis; "
                "worker, submit and status need one",
                "export VOXMILL_BROKER_URL=redis://[:password@]host:6379/0",
            )
        ]
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix", "sentinel"):
        return [
            warning(
                "broker", f"{shown}: not checked (doctor reaches redis://, rediss:// and sentinel://)", ""
            )
        ]
    from workers.queue import connections

    client = connections.broker_client(settings, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        try:
            client.ping()
            info = client.info()
        except redis.AuthenticationError as exc:
            return [auth_failure(shown, bool(parts.password), str(exc))]
        except redis.RedisError as exc:
            return [
                error(
                    "broker",
                    f"cannot reach {shown}: {exc}",
                    "start Redis, or fix the host and port in VOXMILL_BROKER_URL (firewall, TLS: rediss://)",
                )
            ]
        return [reach_check(shown, parts, info), persistence_check(info), eviction_check(info)]
    finally:
        client.close()


def auth_failure(shown: str | None, has_password: bool, message: str) -> Check:
    if not has_password:
        detail = f"{shown} wants a password and the URL has none ({message})"
    elif "without any password" in message or "no password is set" in message:
        detail = f"{shown} has no password set, but the URL gives one ({message})"
    else:
        detail = f"{shown} refused the password ({message})"
    return error(
        "broker", detail, "put the broker's requirepass in VOXMILL_BROKER_URL: redis://:PASSWORD@host:6379/0"
    )


def reach_check(shown: str | None, parts: Any, info: dict[str, Any]) -> Check:
    detail = f"{shown}: Redis {info.get('redis_version', '?')}"
    if not parts.password and parts.hostname not in LOOPBACK_HOSTS and parts.scheme != "unix":
        return warning(
            "broker",
            f"{detail}, reached without a password over the network",
            "set requirepass in redis.conf and the password in VOXMILL_BROKER_URL (docs/security.md)",
        )
    return ok("broker", f"{detail}, {'authenticated' if parts.password else 'no password (loopback)'}")


def persistence_check(info: dict[str, Any]) -> Check:
    if int(info.get("aof_enabled", 0)):
        return ok("broker persistence", "AOF on: queued jobs survive a Redis restart")
    return warning(
        "broker persistence",
        "AOF off: a Redis restart loses every queued job (producers send theirs again; corpus runs resume)",
        "appendonly yes in redis.conf (config/redis.conf), or CONFIG SET appendonly yes",
    )


def eviction_check(info: dict[str, Any]) -> Check:
    policy = str(info.get("maxmemory_policy", "unknown"))
    limit = int(info.get("maxmemory", 0))
    if policy == "noeviction":
        return ok(
            "broker maxmemory", "maxmemory-policy noeviction: a full Redis refuses new jobs, drops none"
        )
    detail = f"maxmemory-policy {policy}: Redis may evict queued jobs and results"
    fix = "maxmemory-policy noeviction in redis.conf (or CONFIG SET maxmemory-policy noeviction)"
    if limit > 0:
        return error("broker maxmemory", f"{detail} once it holds {limit / 2**20:.0f} MiB", fix)
    return warning("broker maxmemory", f"{detail} as soon as a maxmemory is set", fix)
