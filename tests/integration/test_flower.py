"""Flower, really: `celery -A workers.app flower` against the test Redis shows a real worker with its
queues and the voxmill tasks it ran, by name and state, through its HTTP API. Flower comes with
the `monitor` extra (pip install -e '.[monitor]'); without it these tests are skipped."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.settings import Settings
from tests.conftest import clean_env, make_settings, wait_for
from tests.integration.services import running_http_service
from workers.embedded import free_port
from workers.queue.client import Client

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flower") is None,
    reason="flower is not installed: pip install -e '.[monitor]'",
)


@contextlib.contextmanager
def running_flower(settings: Settings, folder: Path, **env: str) -> Iterator[str]:
    """Flower on a free loopback port, watching the settings' broker; its base URL."""
    port = free_port()
    argv = [CELERY, "-A", "workers.app", "flower", f"--port={port}", "--address=127.0.0.1"]
    environment = clean_env({**settings.to_env(), "PYTHONPATH": str(ROOT), **env})
    url = f"http://127.0.0.1:{port}"
    with running_http_service(argv, folder / f"flower-{port}.log", f"{url}/healthcheck", environment, ROOT):
        yield url


def get(url: str, auth: str | None = None) -> Any:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=15) as response:
        return json.loads(response.read())


def test_flower_shows_the_worker_its_queues_and_its_tasks(
    start_worker,
    redis_url: str,
    redis_client: redis.Redis,
    tiny_models: Path,
    audio_dir: Path,
    tmp_path: Path,
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir, tmp_path])
    start_worker(settings, concurrency=1, queues=("embed",))
    with running_flower(settings, tmp_path, FLOWER_UNAUTHENTICATED_API="true") as url:

        def embed_worker() -> dict[str, Any] | None:
            workers = get(f"{url}/api/workers?refresh=1")
            for name, info in workers.items():
                if name.startswith("voxmill-local-") and info.get("active_queues"):
                    return dict(info)
            return None

        worker = wait_for(embed_worker, timeout_s=30, interval_s=0.5)
        assert isinstance(worker, dict)
        assert [q["name"] for q in worker["active_queues"]] == ["embed"]
        assert {"voxmill.embed", "voxmill.shard"} <= set(worker["registered"])

        client = Client(settings)  # Flower hears task events only while it runs: jobs go in now
        jobs = client.submit_many("embed", [audio_dir / "chirp_3s.wav"] * 2 + [tmp_path / "missing.wav"])
        results = client.wait_all(jobs, timeout_s=60)
        assert [r.error.code if r.error else "ok" for r in results] == ["ok", "ok", "not_found"]

        def tasks_seen() -> dict[str, Any] | None:
            tasks = get(f"{url}/api/tasks?taskname=voxmill.embed")
            done = {tid: t for tid, t in tasks.items() if t.get("state") == "SUCCESS"}
            return done if set(done) >= {job.id for job in jobs} else None

        tasks = wait_for(tasks_seen, timeout_s=30, interval_s=0.5)
        assert isinstance(tasks, dict)
        for job in jobs:  # bad input is a result, not a failed task: every one succeeded
            assert tasks[job.id]["name"] == "voxmill.embed" and tasks[job.id]["worker"].startswith(
                "voxmill-local-"
            )


def test_flower_api_with_basic_auth_as_compose_should_run_it(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url)
    with running_flower(settings, tmp_path, FLOWER_BASIC_AUTH="voxmill:s3cret") as url:
        with pytest.raises(urllib.error.HTTPError) as refused:
            get(f"{url}/api/workers")
        assert refused.value.code == 401
        assert isinstance(get(f"{url}/api/workers", auth="voxmill:s3cret"), dict)
    with running_flower(settings, tmp_path) as url:  # neither auth nor FLOWER_UNAUTHENTICATED_API
        with pytest.raises(urllib.error.HTTPError) as closed:
            get(f"{url}/api/workers")
        assert closed.value.code == 401
