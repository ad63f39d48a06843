"""Worker start-up and serving set-ups that need a worker of their own (not the shared one)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import VOXMILL, clean_env, make_settings, voxmill
from tests.helpers import worker_dicts
from workers.queue.client import Client, NoConsumer


def test_embed_only_worker_never_loads_the_tokenizer(
    start_worker, redis_url, redis_client, tiny_models, audio_dir
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    workers = start_worker(settings, concurrency=1, queues=("embed",))
    client = Client(settings)
    with pytest.raises(NoConsumer, match="voxmill worker -Q tokenize"):  # refused, not left waiting
        client.submit("tokenize", audio_dir / "chirp_3s.wav")
    assert client.run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=30)[0].error is None
    records = [r for r in worker_dicts(redis_client) if r["ppid"] == workers.process.pid]
    assert records and all(set(r["models"]) == {"embedder"} for r in records)
    assert all(r["queues"] == ["embed"] for r in records)
    assert redis_client.llen("tokenize") == 0


def test_worker_with_a_slow_loading_model_still_comes_up(
    start_worker, redis_url, redis_client, tmp_path, audio_dir
) -> None:
    """Warm-up takes longer than Celery's default 4 s proc-alive timeout; the pool must not kill it."""
    from pipeline.models.standin import make_embedder_model, write_model

    models = tmp_path / "models"
    models.mkdir()
    write_model(make_embedder_model("full"), models / "campplus.onnx")
    slow = make_settings(redis_url, models, [audio_dir], warmup_runs=250)
    workers = start_worker(slow, concurrency=1, queues=("embed",), timeout_s=180)
    record = next(r for r in worker_dicts(redis_client) if r["ppid"] == workers.process.pid)
    model = record["models"]["embedder"]
    assert model["load_s"] + model["warmup_s"] > 4.0  # longer than Celery's default proc-alive timeout
    result = Client(slow).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=60)[0]
    assert result.error is None
    log = workers.log_path.read_text()
    assert "Timed out waiting for UP message" not in log


def test_voxmill_up_serves_and_stops_cleanly(tiny_models: Path, audio_dir: Path, tmp_path: Path) -> None:
    env = clean_env({"VOXMILL_MODEL_DIR": str(tiny_models), "VOXMILL_ALLOWED_ROOTS": str(audio_dir)})
    proc = subprocess.Popen(
        [VOXMILL, "up", "--workers", "1", "--no-watch"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "voxmill up exited early:\n" + "".join(lines)
            lines.append(line)
            if "export VOXMILL_BROKER_URL=" in line:
                url = line.split("=", 1)[1].strip()
        done = voxmill(
            "submit", "embed", str(audio_dir / "chirp_3s.wav"), "--json", env={"VOXMILL_BROKER_URL": url}
        )
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)
    leftover = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "processes left behind: " + leftover.stdout
