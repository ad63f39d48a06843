"""`voxmill doctor`'s broker checks against real Redis servers: the test Redis, a closed port, and
a password-protected embedded Redis reached with the wrong password and with none."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pipeline.settings import Settings
from tests.conftest import make_settings
from workers.embedded import EmbeddedRedis, free_port
from workers.observe.doctor import Check, broker_checks, exit_code, run_checks


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_the_test_setup_is_healthy(
    redis_url: str, redis_client: redis.Redis, tiny_models: Path, audio_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    settings = make_settings(redis_url, tiny_models, [audio_dir], model_cache_dir=cache, provider="cpu")
    checks = run_checks(settings)
    assert [c for c in checks if c.status == "error"] == [] and exit_code(checks) == 0
    found = by_name(checks)
    assert found["broker"].status == "ok" and "Redis " in found["broker"].detail
    # what the doctor says of persistence and eviction is what the server says of itself
    aof = redis_client.config_get("appendonly")["appendonly"] == "yes"
    assert found["broker persistence"].status == ("ok" if aof else "warning")
    policy = redis_client.config_get("maxmemory-policy")["maxmemory-policy"]
    assert (found["broker maxmemory"].status == "ok") == (policy == "noeviction")
    assert policy in found["broker maxmemory"].detail


def test_a_closed_broker_port_is_an_error(tmp_path: Path, tiny_models: Path) -> None:
    settings = make_settings(f"redis://127.0.0.1:{free_port()}/0", tiny_models, [tmp_path])
    checks = run_checks(settings)
    broker = by_name(checks)["broker"]
    assert broker.status == "error" and "cannot reach" in broker.detail and "start Redis" in broker.fix
    assert exit_code(checks) == 1


@pytest.fixture
def locked_redis() -> EmbeddedRedis:
    server = EmbeddedRedis().start()
    try:
        yield server  # type: ignore[misc]
    finally:
        server.stop()


def test_a_wrong_or_missing_password_is_an_error(locked_redis: EmbeddedRedis) -> None:
    right = locked_redis.url
    wrong = right.replace(locked_redis.password, "not-the-password")
    none = right.replace(f":{locked_redis.password}@", "")
    [good, persistence, eviction] = broker_checks(Settings(broker_url=right))
    assert good.status == "ok" and "authenticated" in good.detail
    assert locked_redis.password not in good.detail  # the URL is shown redacted
    assert persistence.status == "ok"  # config/redis.conf turns AOF on
    [refused] = broker_checks(Settings(broker_url=wrong))
    assert refused.status == "error" and "refused the password" in refused.detail
    assert "not-the-password" not in refused.detail
    [anonymous] = broker_checks(Settings(broker_url=none))
    assert anonymous.status == "error" and "wants a password" in anonymous.detail
