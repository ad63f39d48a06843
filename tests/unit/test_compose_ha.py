"""docker-compose.ha.yml (Redis primary, replica, three sentinels) over docker-compose.yml is valid
and puts every voxmill container on the sentinels (checked with `docker-compose config`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_compose import COMPOSE_VARIABLES
from workers.queue.connections import parse_sentinel_url

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
VOXMILL_SERVICES = ("worker-cpu", "worker-gpu", "watcher", "flower")

pytestmark = pytest.mark.skipif(
    COMPOSE is None,
    reason="docker-compose is not installed (apt-get install docker-compose; .ci/run installs it)",
)


def ha_services(tmp_path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES and not k.startswith("FLOWER_")}
    env.update(REDIS_PASSWORD="s3cret", FLOWER_BASIC_AUTH="admin:pw")  # what the base file requires
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.ha.yml")]
    done = subprocess.run(
        [str(COMPOSE), "--env-file", str(env_file), *files, "--profile", "gpu", "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config["services"]  # type: ignore[no-any-return]


def test_every_voxmill_container_reaches_redis_through_three_sentinels(tmp_path: Path) -> None:
    services = ha_services(tmp_path)
    assert {"redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(services)
    for name in VOXMILL_SERVICES:
        environment = services[name]["environment"]
        target = parse_sentinel_url(environment["VOXMILL_BROKER_URL"])
        assert target.sentinels == (("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379))
        assert target.password == "s3cret" and target.db == 0
        assert environment["VOXMILL_SENTINEL_MASTER_NAME"] == "voxmill"
        assert {"sentinel-1", "sentinel-2", "sentinel-3"} <= set(services[name]["depends_on"])


def test_the_replica_follows_the_primary_and_either_can_serve_the_other(tmp_path: Path) -> None:
    services = ha_services(tmp_path)
    primary, replica = services["redis"]["command"], services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 : replica.index("--replicaof") + 3] == ["redis", "6379"]
    for command in (primary, replica):  # after a failover the old primary is a replica: it needs both
        assert command[command.index("--requirepass") + 1] == "s3cret"
        assert command[command.index("--masterauth") + 1] == "s3cret"
        assert command[command.index("--appendonly") + 1] == "yes"
        assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


def test_the_sentinels_watch_the_primary_by_name_with_a_quorum_of_two(tmp_path: Path) -> None:
    services = ha_services(tmp_path)
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = " ".join(services[name]["command"])
        assert "sentinel monitor voxmill redis 6379 2" in script
        assert "sentinel resolve-hostnames yes" in script and "--sentinel" in script
        assert "auth-pass voxmill" in script
