"""Graceful reload end to end: a real watcher process, real worker processes, real ONNX files.

Every test works on its own copy of the tiny stand-ins, so it can replace, truncate and delete
model files freely.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import pytest
import redis
from onnx import TensorProto, helper

from pipeline.models.standin import EMBEDDER_FILE, make_embedder_model, write_model
from pipeline.records import TaskResult
from pipeline.settings import Settings
from tests.conftest import VOXMILL, clean_env, make_settings, voxmill, wait_for
from workers import keys
from workers.observe.status import collect_status
from workers.queue.client import Client, Job

QUIET_S = 0.3
WAV = "chirp_3s.wav"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256(path: Path) -> str:
    return sha256_of(path.read_bytes())


def land(path: Path, data: bytes) -> None:
    """Put `data` at `path` with an atomic rename, as a deploy tool does."""
    tmp = path.with_name(f".{path.name}.landing")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def published(client: redis.Redis, role: str) -> dict[str, str]:
    raw = client.hgetall(keys.GENERATION.format(role=role))
    return {k.decode(): v.decode() for k, v in raw.items()}


def rejection(client: redis.Redis, role: str) -> dict[str, str]:
    raw = client.hgetall(keys.REJECTION.format(role=role))
    return {k.decode(): v.decode() for k, v in raw.items()}


def serving(client: redis.Redis, role: str) -> dict[str, list[str]]:
    return collect_status(client)["models"][role]["serving"]


def all_serve(client: redis.Redis, role: str, sha: str, workers: int) -> bool:
    """`sha` is published and all `workers` processes report it (and no other) in their heartbeat."""
    current = serving(client, role)
    return (
        published(client, role).get("sha256") == sha
        and current == {sha: current.get(sha, [])}
        and len(current[sha]) == workers
    )


def embed_ok(settings: Settings, audio_dir: Path, n: int = 4) -> list[TaskResult]:
    """Run `n` embed jobs and check that all succeed."""
    client = Client(settings)
    jobs = [client.submit("embed", audio_dir / WAV) for _ in range(n)]
    results = client.wait_all(jobs, timeout_s=60)
    assert [r.error for r in results] == [None] * n
    return results


def wrong_rank_embedder() -> bytes:
    """A valid, loadable ONNX model whose input is [T, 80] (rank 2) instead of [B, T, 80]."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [80, 192], [0.01] * (80 * 192))
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[0], keepdims=1),
        helper.make_node("MatMul", ["pooled", "w"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "wrong_rank",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def settings(redis_url: str, redis_client: redis.Redis, models: Path, audio_dir: Path) -> Settings:
    return make_settings(redis_url, models, [audio_dir], watch_quiet_s=QUIET_S)


class WatcherProcess:
    """`voxmill watch` as a subprocess, its output in a log file."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [VOXMILL, "watch"],
                env=clean_env(settings.to_env()),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def start_watcher(tmp_path: Path, redis_client: redis.Redis) -> Iterator[Callable[..., WatcherProcess]]:
    """Start `voxmill watch`; waits until both roles are published. Stopped at teardown."""
    started: list[WatcherProcess] = []

    def start(settings: Settings, wait: bool = True) -> WatcherProcess:
        watcher = WatcherProcess(settings, tmp_path / f"watcher-{len(started)}.log")
        started.append(watcher)
        if wait:
            model_dir = Path(settings.model_dir)
            expected = {
                "tokenizer": sha256(model_dir / "speech_tokenizer_v2.onnx"),
                "embedder": sha256(model_dir / EMBEDDER_FILE),
            }
            try:
                wait_for(
                    lambda: all(published(redis_client, r).get("sha256") == s for r, s in expected.items()),
                    timeout_s=30,
                )
            except AssertionError:
                print(watcher.log())
                raise
        return watcher

    yield start
    for watcher in started:
        watcher.stop()


# -- tests ---------------------------------------------------------------------------------------
def test_swap_under_a_steady_stream_loses_no_job(
    start_worker, start_watcher, settings, models, audio_dir, redis_client
) -> None:
    start_worker(settings, concurrency=2, queues=("embed",))
    start_watcher(settings)
    old = sha256(models / EMBEDDER_FILE)
    wait_for(lambda: all_serve(redis_client, "embedder", old, 2))
    client = Client(settings)
    jobs: list[tuple[float, Job]] = []
    settled_at: list[float] = []

    def submit() -> None:  # on until 60 jobs went in after the swap settled, however long it takes
        after = 0
        while after < 60 and len(jobs) < 5000:
            submitted = time.monotonic()
            jobs.append((submitted, client.submit("embed", audio_dir / WAV)))
            if settled_at and submitted >= settled_at[0]:
                after += 1
            time.sleep(0.012)

    submitter = threading.Thread(target=submit)
    submitter.start()
    wait_for(lambda: len(jobs) >= 100)
    new_model = make_embedder_model("tiny", seed=1).SerializeToString()
    new = sha256_of(new_model)
    land(models / EMBEDDER_FILE, new_model)
    landed = time.monotonic()
    wait_for(lambda: all_serve(redis_client, "embedder", new, 2), timeout_s=30, interval_s=0.02)
    settled = time.monotonic()
    settled_at.append(settled)
    print(f"\nfile landed -> last worker serving it: {settled - landed:.2f} s")
    submitter.join()

    by_id = {job.id: result for job, result in client.completed([job for _, job in jobs], timeout_s=60)}
    results = [(submitted, by_id[job.id]) for submitted, job in jobs]
    assert len(results) == len(jobs) > 100
    assert [r.error for _, r in results if r.error] == []
    shas = [r.models["embedder"].sha256 for _, r in results]
    assert set(shas) == {old, new}
    after = [sha for (submitted, _), sha in zip(results, shas, strict=True) if submitted >= settled]
    assert len(after) >= 50, "too few jobs after the swap to tell anything"
    assert set(after) == {new}


def test_a_slow_copy_is_never_loaded_half_written(
    start_worker, start_watcher, settings, models, audio_dir, redis_client
) -> None:
    start_worker(settings, concurrency=1, queues=("embed",))
    start_watcher(settings)
    generation = int(published(redis_client, "embedder")["generation"])
    data = make_embedder_model("tiny", seed=2).SerializeToString()
    chunk = len(data) // 20 + 1
    with open(models / EMBEDDER_FILE, "wb") as f:  # in place, over ~3 s
        for index in range(20):
            f.write(data[index * chunk : (index + 1) * chunk])
            f.flush()
            time.sleep(1.2 if index == 9 else 0.1)  # a stall longer than quiet + validation:
            # only close-after-write tracking keeps the half file from being validated
    full = sha256_of(data)
    assert sha256(models / EMBEDDER_FILE) == full
    wait_for(lambda: all_serve(redis_client, "embedder", full, 1), timeout_s=30)
    assert rejection(redis_client, "embedder") == {}
    assert int(published(redis_client, "embedder")["generation"]) == generation + 1
    assert {r.models["embedder"].sha256 for r in embed_ok(settings, audio_dir)} == {full}


def test_bad_models_are_rejected_and_the_old_one_keeps_serving(
    start_worker, start_watcher, settings, models, audio_dir, redis_client
) -> None:
    start_worker(settings, concurrency=1, queues=("embed",))
    start_watcher(settings)
    old = sha256(models / EMBEDDER_FILE)
    before = published(redis_client, "embedder")
    good = make_embedder_model("tiny", seed=3).SerializeToString()
    cases = [
        ("truncated", good[: len(good) // 2], "not a loadable ONNX model"),
        ("random bytes", os.urandom(len(good)), "not a loadable ONNX model"),
        ("wrong input rank", wrong_rank_embedder(), "has rank 2"),
    ]
    for name, bad, reason in cases:
        land(models / EMBEDDER_FILE, bad)
        rejected = sha256_of(bad)
        wait_for(lambda r=rejected: rejection(redis_client, "embedder").get("sha256") == r, timeout_s=30)

        assert published(redis_client, "embedder") == before, name
        assert {r.models["embedder"].sha256 for r in embed_ok(settings, audio_dir)} == {old}, name
        status = voxmill("status", "--json", env={"VOXMILL_BROKER_URL": settings.broker_url or ""})
        assert status.returncode == 0, status.stderr
        embedder = json.loads(status.stdout)["models"]["embedder"]
        assert embedder["last_rejection"]["sha256"] == rejected, name
        assert reason in embedder["last_rejection"]["reason"], (name, embedder["last_rejection"])
        assert embedder["published"]["sha256"] == old, name
        assert list(embedder["serving"]) == [old], name
    assert rejection(redis_client, "embedder")["count"] == "3"


def test_a_symlink_swap_is_picked_up_and_a_deleted_file_keeps_the_old_session(
    start_worker, start_watcher, redis_url, redis_client, models, audio_dir, tmp_path
) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(models, root / "v1")
    shutil.copytree(models, root / "v2")
    write_model(make_embedder_model("tiny", seed=4), root / "v2" / EMBEDDER_FILE)
    (root / "current").symlink_to("v1")
    settings = make_settings(redis_url, root / "current", [audio_dir], watch_quiet_s=QUIET_S)
    start_worker(settings, concurrency=1, queues=("embed",))
    watcher = start_watcher(settings)
    v2 = sha256(root / "v2" / EMBEDDER_FILE)

    (root / "next").symlink_to("v2")
    os.replace(root / "next", root / "current")  # the atomic symlink swap
    wait_for(lambda: all_serve(redis_client, "embedder", v2, 1), timeout_s=30)
    generation = published(redis_client, "embedder")["generation"]

    (root / "v2" / EMBEDDER_FILE).unlink()
    wait_for(lambda: "embedder: no model file" in watcher.log(), timeout_s=30)
    assert {r.models["embedder"].sha256 for r in embed_ok(settings, audio_dir)} == {v2}
    assert published(redis_client, "embedder")["generation"] == generation
    assert serving(redis_client, "embedder") == {v2: serving(redis_client, "embedder")[v2]}


def test_a_late_worker_serves_the_new_generation_and_a_watcher_restart_reloads_nothing(
    start_worker, start_watcher, settings, models, audio_dir, redis_client
) -> None:
    first = start_worker(settings, concurrency=1, queues=("embed",))
    watcher = start_watcher(settings)
    write_model(make_embedder_model("tiny", seed=5), models / EMBEDDER_FILE)
    new = sha256(models / EMBEDDER_FILE)
    wait_for(lambda: all_serve(redis_client, "embedder", new, 1), timeout_s=30)

    start_worker(settings, concurrency=1, queues=("embed",))
    wait_for(lambda: all_serve(redis_client, "embedder", new, 2), timeout_s=30)
    before = {role: published(redis_client, role) for role in ("tokenizer", "embedder")}
    generation = int(before["embedder"]["generation"])
    assert all(
        w["models"]["embedder"]["generation"] == generation for w in collect_status(redis_client)["workers"]
    )

    reloads = first.log_path.read_text().count("now serves")
    watcher.stop()
    again = start_watcher(settings, wait=False)
    wait_for(lambda: again.log().count("unchanged (generation") == 2, timeout_s=30)
    assert {role: published(redis_client, role) for role in ("tokenizer", "embedder")} == before
    assert int(redis_client.get(keys.GENERATION_COUNTER.format(role="embedder"))) == generation
    time.sleep(0.5)  # a reload, if one were triggered, would show up within a few checks
    assert first.log_path.read_text().count("now serves") == reloads
    assert {r.models["embedder"].sha256 for r in embed_ok(settings, audio_dir)} == {new}


def test_a_worker_started_before_its_model_serves_it_once_it_lands(
    start_worker, start_watcher, redis_url, redis_client, tiny_models, audio_dir, tmp_path
) -> None:
    empty = tmp_path / "no-models-yet"
    empty.mkdir()
    settings = make_settings(redis_url, empty, [audio_dir], watch_quiet_s=QUIET_S)
    start_worker(settings, concurrency=1, queues=("embed",), wait=False)
    wait_for(lambda: any(w["load_errors"] for w in collect_status(redis_client)["workers"]), timeout_s=60)
    client = Client(settings)
    job = client.submit("embed", audio_dir / WAV)  # retried until the model is there
    watcher = start_watcher(settings, wait=False)
    wait_for(lambda: "embedder: no model file" in watcher.log(), timeout_s=30)

    shutil.copy(tiny_models / EMBEDDER_FILE, empty / EMBEDDER_FILE)
    wait_for(lambda: all_serve(redis_client, "embedder", sha256(empty / EMBEDDER_FILE), 1), timeout_s=30)
    assert client.wait_all([job], timeout_s=60)[0].error is None


def test_machines_converge_each_loading_its_own_copy(
    start_worker, start_watcher, redis_url, redis_client, models, audio_dir, tmp_path
) -> None:
    other = tmp_path / "other-machine-models"  # a second machine's copy of the model folder
    shutil.copytree(models, other)
    start_worker(make_settings(redis_url, models, [audio_dir]), concurrency=1, queues=("embed",))
    lagging = make_settings(redis_url, other, [audio_dir])
    start_worker(lagging, concurrency=1, queues=("embed",))
    start_watcher(make_settings(redis_url, models, [audio_dir], watch_quiet_s=QUIET_S))
    old = sha256(models / EMBEDDER_FILE)
    new_model = make_embedder_model("tiny", seed=6).SerializeToString()
    new = sha256_of(new_model)

    land(models / EMBEDDER_FILE, new_model)  # lands on the watcher's machine first
    embedder = lambda: collect_status(redis_client)["models"]["embedder"]  # noqa: E731
    wait_for(lambda: set(embedder()["serving"]) == {old, new} and embedder()["reload_failures"], timeout_s=30)
    (failure,) = embedder()["reload_failures"].values()
    assert failure["sha256"] == new and "expected" in failure["reason"], failure
    assert {r.models["embedder"].sha256 for r in embed_ok(lagging, audio_dir, n=8)} <= {old, new}
    generation = published(redis_client, "embedder")["generation"]

    land(other / EMBEDDER_FILE, new_model)  # the copy reaches the other machine
    wait_for(lambda: all_serve(redis_client, "embedder", new, 2), timeout_s=30)
    assert embedder()["reload_failures"] == {}
    assert published(redis_client, "embedder")["generation"] == generation


def test_voxmill_up_starts_a_watcher_that_publishes(
    tiny_models: Path, audio_dir: Path, tmp_path: Path
) -> None:
    env = clean_env({"VOXMILL_ALLOWED_ROOTS": str(audio_dir)})
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [VOXMILL, "up", "--workers", "1", "-Q", "embed", "--models", str(tiny_models), "--log", str(log)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "voxmill up exited early"
            if "export VOXMILL_BROKER_URL=" in line:
                url = line.split("=", 1)[1].strip()
        client = redis.Redis.from_url(url)
        wait_for(lambda: published(client, "embedder").get("sha256"), timeout_s=30)
        assert published(client, "embedder")["sha256"] == sha256(tiny_models / EMBEDDER_FILE)
        sha = published(client, "embedder")["sha256"]
        wait_for(lambda: list(serving(client, "embedder")) == [sha])
        client.close()
        # The workers' and the watcher's lines go to the log file `up` names, not to its terminal.
        logged = log.read_text()
        assert "loaded embedder campplus.onnx" in logged and "voxmill.watcher" in logged
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
