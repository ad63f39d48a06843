"""Corpora and outputs in object storage, against a real S3 API over HTTP on loopback (moto's
server mode), with real worker processes, real ONNX files and real tar files.

- the storage layer on a real S3 API: an object read as audio equals the file, sizes before
  reads, `not_found`, `store_error` for an unreachable store with no secret in the message, shard
  files and the merge on a bucket equal to a folder's;
- no shared disk: two worker "hosts" that share only Redis and the S3 server (their own working
  folder, their own model copy, allowed roots that hold no local path at all) extract a corpus
  listed as s3:// URLs into s3://, one host SIGKILLed mid-run; then the same audio as WebDataset
  tar shards in the bucket; both equal a local run of the same audio, every utterance once; a
  second run on the bucket resumes as done. About 10 s on two cores;
- reads in flight: a shard of objects read ahead (8 at once, a budget of two clips) gives what
  the same shard read one clip at a time gives, failures in place (missing, empty, undecodable,
  outside the prefixes, a local file among them), for whole objects and for segments; a reset
  connection under a delaying proxy (`benchmarks.delay_proxy`) costs nothing but a retry;
- the merge reads shard objects ahead: the outputs byte for byte what a serial merge writes (and
  equal to a folder's), at most `reads_in_flight` requests at once, a missing or unreadable shard
  object the same error at the same place.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.delay_proxy import DelayProxy
from pipeline.audio.decode import load_audio
from pipeline.audio.sources import prefetch_clips
from pipeline.errors import NOT_FOUND, STORE_ERROR, TOO_LARGE, ErrorRecord, RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.merge import merge_outputs
from pipeline.outputs.report import RunReport
from pipeline.outputs.writers import read_shard, write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance
from pipeline.run.ledger import Ledger
from pipeline.run.lock import lock_output
from pipeline.run.plan import Planner
from pipeline.settings import AudioLimits, Settings
from pipeline.storage import objects, urls
from pipeline.storage.prefetch import ReadAhead
from tests.conftest import make_settings
from tests.helpers import make_audio_folder, read_outputs
from tests.unit.test_merge_reads import output_bytes, write_run
from workers.embedded import PROJECT_ROOT, free_port, worker_command
from workers.extract import extract_corpus

SECRET = "wJalrXUtnFEMI-test-secret-do-not-print"
KEY_ID = "AKIAVOXMILLTEST"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3 API (moto in server mode) on a loopback port, for this module."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The store's standard variables, in this process and so in every process it starts."""
    env = {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    objects._FILESYSTEMS.clear()  # made again with these variables
    yield env
    objects._FILESYSTEMS.clear()


def _bucket(name: str) -> str:
    fs = objects.filesystem("s3")
    with contextlib.suppress(FileExistsError):
        fs.mkdir(name)
    return f"s3://{name}"


def _upload(local: Path, url: str) -> None:
    objects.filesystem("s3").put_file(str(local), urls.parse_url(url).fs_path)


def _download(url: str, folder: Path) -> Path:
    """Every object below `url` into `folder` (to read the outputs with the local helpers)."""
    fs = objects.filesystem("s3")
    prefix = urls.parse_url(url).fs_path.rstrip("/")
    for key in fs.find(prefix):
        target = folder / key[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(key, str(target))
    return folder


# --------------------------------------------------------------------------- the storage layer


def test_the_storage_layer_on_a_real_s3_api(
    s3_env: dict[str, str], audio_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _bucket("layer")
    clip = audio_dir / "chirp_3s.wav"
    _upload(clip, f"{bucket}/audio/chirp.wav")
    limits = AudioLimits()
    remote = load_audio(f"{bucket}/audio/sub/../chirp.wav", limits)
    local = load_audio(clip, limits)
    assert (remote.samples == local.samples).all() and remote.codec == local.codec
    assert objects.url_size(f"{bucket}/audio/chirp.wav") == clip.stat().st_size
    with pytest.raises(VoxmillError) as missing:
        load_audio(f"{bucket}/audio/nope.wav", limits)
    assert missing.value.code == NOT_FOUND and "s3://layer/audio/nope.wav" in missing.value.message
    with pytest.raises(VoxmillError) as large:
        load_audio(f"{bucket}/audio/chirp.wav", AudioLimits(max_file_bytes=1000))
    assert large.value.code == TOO_LARGE

    # Shard files and the merge on the bucket: the same outputs as on a folder.
    utts = [Utterance("a", "/x/a.wav", "s1"), Utterance("b", "/x/b.wav", "s1")]
    results = [
        TaskResult(input="a", op="embed", embedding=[0.5] * 4, audio_seconds=1.0),
        TaskResult(input="b", op="embed", error=ErrorRecord("empty", "clip is digital silence")),
    ]
    specs = [ShardSpec(0, "embed", "", utts[:1]), ShardSpec(1, "embed", "", utts[1:])]
    out = f"{bucket}/run"
    remote, local = RunFolder.of(out), RunFolder.of(tmp_path / "local")
    for spec, result in zip(specs, results, strict=True):
        path = write_shard(remote, spec, [result])
        assert path == f"{out}/shards/embed-{spec.shard:06d}.parquet"
        assert read_shard(path).column("utt").to_pylist() == [spec.utts[0].utt]
        write_shard(local, spec, [result])
    assert remote.location.names(RunFolder.SHARDS) == {"embed-000000.parquet", "embed-000001.parquet"}
    assert merge_outputs(remote, specs, RunReport()) == merge_outputs(local, specs, RunReport())
    assert read_outputs(_download(out, tmp_path / "copy")) == read_outputs(tmp_path / "local")

    # An unreachable store: store_error, bounded, and no secret in what is said.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    objects._FILESYSTEMS.clear()
    started = time.monotonic()
    with pytest.raises(VoxmillError) as down:
        load_audio(f"{bucket}/audio/chirp.wav", limits)
    assert down.value.code == STORE_ERROR and time.monotonic() - started < 30
    assert "s3://layer/audio/chirp.wav" in down.value.message
    assert SECRET not in down.value.message and KEY_ID not in down.value.message


# --------------------------------------------------------------------------- the lock of a store


class _LockStore(DelayProxy):
    """The store a lock sees: a proxy that records each request ("GET .lock.json", "LIST") and when it
    was in flight (`spans`, the last of each, its end `inf` until answered); that drops `If-None-Match`
    from requests (`ignore_conditions`: a store that does not honour exclusive creates); that writes
    `racer` as the marker, straight to the server, just before the first request `racer_before`
    passes (a racing run's write)."""

    def __init__(
        self, upstream_port: int, ignore_conditions: bool = False, racer: bytes = b"", racer_before: str = ""
    ) -> None:
        super().__init__(upstream_port)
        self.ignore_conditions = ignore_conditions
        self.racer, self.racer_before = racer, racer_before
        self.seen: list[str] = []
        self.spans: dict[str, tuple[float, float]] = {}

    async def _exchange(self, request: bytes, client_reader: Any, client: Any) -> bool:
        method, path = request.split(b" ", 2)[:2]
        name = path.split(b"?")[0].rsplit(b"/", 1)[-1].decode()
        seen = "LIST" if b"list-type=" in path else f"{method.decode()} {name}"
        self.seen.append(seen)
        if self.ignore_conditions:
            lines = request.split(b"\r\n")
            request = b"\r\n".join(line for line in lines if not line.lower().startswith(b"if-none-match:"))
        if self.racer and seen == self.racer_before:
            import s3fs

            endpoint, fresh = f"http://127.0.0.1:{self.upstream_port}", {"skip_instance_cache": True}
            server = s3fs.S3FileSystem(endpoint_url=endpoint, key=KEY_ID, secret=SECRET, **fresh)
            server.pipe_file(path.split(b"?")[0].decode().lstrip("/"), self.racer)
            self.racer = b""
        started = time.monotonic()
        # Noted on arrival too: the client may hold its answer before this thread notes the end.
        self.spans[seen] = (started, math.inf)
        try:
            return await super()._exchange(request, client_reader, client)
        finally:
            self.spans[seen] = (started, time.monotonic())


@contextlib.contextmanager
def _lock_store(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, **behaviour: Any
) -> Iterator[_LockStore]:
    with _LockStore(int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), **behaviour) as store:
        monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
        objects._FILESYSTEMS.clear()
        try:
            yield store
        finally:
            monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
            objects._FILESYSTEMS.clear()


RACER = {"host": "racer", "pid": 7, "token": "theirs"}


def test_a_store_lock_is_sure_at_once_where_the_store_creates_exclusively_and_refuses_a_live_run(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder.of(f"{_bucket('locks')}/sure")
    with _lock_store(s3_env, monkeypatch) as store:
        held = lock_output(folder, tmp_path / "state")
        # One listing (of the folder alone, though it is empty), no marker in it: created exclusively.
        assert store.seen == ["LIST", "PUT .lock.json"]
        held.settle()
        # A second create the store refused: it honours them, no race is possible; nothing looked
        # at again, nothing waited for.
        assert store.seen[2:] == ["PUT .lock.json"]
        with pytest.raises(RunError, match=r"another `voxmill extract` \(host .*\) holds s3://locks/sure/.lock.json"):
            lock_output(folder, tmp_path / "elsewhere")  # another machine's run: a state folder of its own
        assert store.seen[3:] == ["LIST", "GET .lock.json"]  # it read the marker, and leaves it
        held.close()
        # Created exclusively and refreshed within LOCK_STALE_S / 2: no run can have taken it over.
        assert store.seen[5:] == ["DELETE .lock.json"]
    assert not folder.location.exists(RunFolder.STORE_LOCK)  # freed: the marker is gone

    # A run that looked when this one did, and created the marker first: this one's create is refused.
    racer = json.dumps({**RACER, "refreshed": time.time()}).encode()
    with (
        _lock_store(s3_env, monkeypatch, racer=racer, racer_before="PUT .lock.json"),
        pytest.raises(RunError, match="host racer, pid 7"),
    ):
        lock_output(folder, tmp_path / "state")
    assert folder.location.entries("") == {".lock.json"}
    assert json.loads(folder.location.read_bytes(RunFolder.STORE_LOCK))["token"] == "theirs"


def test_a_store_lock_without_exclusive_creates_settles_and_a_run_that_loses_a_race_writes_nothing(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder.of(f"{_bucket('locks')}/settled")
    with _lock_store(s3_env, monkeypatch, ignore_conditions=True) as store:
        held = lock_output(folder, tmp_path / "state")
        held.settle()
        # Both creates written: looked at again once it settled, the marker read only then.
        assert store.seen == ["LIST", "PUT .lock.json", "PUT .lock.json", "GET .lock.json"]
        held.close()  # a store that let a racer write over it: looked at before it is deleted
        assert store.seen[4:] == ["GET .lock.json", "DELETE .lock.json"]

    # A run that looked before this one's marker was written writes its own before this one settles.
    racer = json.dumps({**RACER, "refreshed": time.time()}).encode()
    with _lock_store(s3_env, monkeypatch, ignore_conditions=True, racer=racer, racer_before="GET .lock.json"):
        late = lock_output(folder, tmp_path / "state")
        listing = tmp_path / "wav.scp"
        listing.write_text("a /data/a.wav\n")
        planner = Planner(listing, folder, ["embed"], 4, Settings(), 1, before_writing=late.settle).start()
        planner.join()  # it read the listing, then waited for the lock before its first write
        assert planner.error is not None and "host racer, pid 7" in planner.error.message
        with pytest.raises(RunError, match="host racer, pid 7"):
            late.settle()  # what the driver asks before it sends a shard: the same answer
        late.close()
    assert folder.location.entries("") == {".lock.json"}  # no plan written, and the racer's marker kept
    assert json.loads(folder.location.read_bytes(RunFolder.STORE_LOCK))["token"] == "theirs"


def test_a_new_plan_in_a_store_writes_its_header_beside_its_first_chunk(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder.of(f"{_bucket('locks')}/planned")
    listing = tmp_path / "wav.scp"
    listing.write_text("a /data/a.wav\nb /data/b.wav\n")
    with _lock_store(s3_env, monkeypatch) as store:
        store.delay_ms = 100  # a PUT takes 100 ms or more: one after the other they could not overlap
        planner = Planner(listing, folder, ["embed"], 1, Settings(), 1).start()
        planner.join()
    assert planner.error is None and planner.planned == 2
    header, chunk = store.spans["PUT header.json"], store.spans["PUT chunk-000000.parquet"]
    assert header[0] < chunk[1] and chunk[0] < header[1]  # in flight together
    assert store.spans["PUT complete.json"][0] > max(header[1], chunk[1])
    resumed = Planner(listing, folder, ["embed"], 1, Settings(), 1)  # the header is there to resume
    assert resumed.resumed and resumed.header is not None and planner.header is not None
    assert resumed.header.run == planner.header.run


# --------------------------------------------------------------------------- no shared disk


def _start_host(folder: Path, models: Path, redis_url: str, env: dict[str, str], name: str) -> Any:
    """A worker host: its own working folder and model copy, allowed to read s3://corpus only."""
    folder.mkdir(parents=True)
    shutil.copytree(models, folder / "models")
    settings = make_settings(redis_url, folder / "models", [], allowed_roots=("s3://corpus",))
    assert settings.roots() == ()  # no local path at all: nothing can come from a shared disk
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("VOXMILL_")}
    child_env.update({**settings.to_env(), **env, "PYTHONPATH": str(PROJECT_ROOT), "PYTHONUNBUFFERED": "1"})
    log = open(folder / "worker.log", "wb")  # noqa: SIM115 - closed with the test's tmp folder
    return subprocess.Popen(
        worker_command(["tokenize", "embed"], 1, "prefork", f"{name}@%h"),
        cwd=folder,
        env=child_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_ready(redis_url: str, hosts: list[Any], count: int, timeout_s: float = 90.0) -> None:
    import redis

    from workers.heartbeat import count_ready_workers

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while count_ready_workers(client) < count:
        assert all(h.poll() is None for h in hosts), "a worker host exited while starting"
        assert time.monotonic() < deadline, "the worker hosts did not load their models"
        time.sleep(0.2)
    client.close()


def _tar_shards(corpus: Path, entries: list[dict[str, str]], per_tar: int, folder: Path) -> list[Path]:
    """WebDataset tars of the corpus: key.json ({"speaker", "text"}) + key.wav, in listing order."""
    tars = []
    for number in range(0, len(entries), per_tar):
        path = folder / f"{number // per_tar:06d}.tar"
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w") as tar:
            for entry in entries[number : number + per_tar]:
                meta = json.dumps({"speaker": entry["spk"], "text": f"text of {entry['utt']}"}).encode()
                info = tarfile.TarInfo(f"{entry['utt']}.json")
                info.size = len(meta)
                tar.addfile(info, io.BytesIO(meta))
                tar.add(corpus / f"{entry['utt']}.wav", arcname=f"{entry['utt']}.wav")
        tars.append(path)
    return tars


def _comparable(outputs: dict[str, Any]) -> dict[str, Any]:
    outputs["report.json"].pop("input", None)
    return outputs


def test_two_hosts_sharing_only_redis_and_s3_one_killed_match_a_local_run(
    s3_env: dict[str, str], redis_url: str, redis_client: Any, tiny_models: Path, tmp_path: Path
) -> None:
    bucket = _bucket("corpus")
    corpus = make_audio_folder(tmp_path / "audio", count=24, min_s=0.5, max_s=1.5)
    entries = [
        {"utt": f"spk{i % 3}/utt{i:04d}", "spk": f"spk{i % 3}"} for i in range(24)
    ]  # make_audio_folder's layout
    for entry in entries:
        _upload(corpus / f"{entry['utt']}.wav", f"{bucket}/audio/{entry['utt']}.wav")
    s3_manifest = tmp_path / "s3.jsonl"
    s3_manifest.write_text(
        "".join(json.dumps({**e, "path": f"{bucket}/audio/{e['utt']}.wav"}) + "\n" for e in entries)
    )
    local_manifest = tmp_path / "local.jsonl"
    local_manifest.write_text(
        "".join(json.dumps({**e, "path": str(corpus / f"{e['utt']}.wav")}) + "\n" for e in entries)
    )
    for tar in _tar_shards(corpus, entries, 6, tmp_path / "tars"):
        _upload(tar, f"{bucket}/tars/{tar.name}")
    ops = ["tokenize", "embed"]

    # The reference: a local run of the same audio (embedded Redis, local worker, local folders).
    local_settings = Settings(model_dir=tiny_models, allowed_roots=(tmp_path,), speech_check=False)
    local_out = RunFolder.of(tmp_path / "local-out")
    extract_corpus(local_settings, local_manifest, local_out, ops, 1, 3, quiet=True)
    reference = _comparable(read_outputs(tmp_path / "local-out"))

    hosts = [
        _start_host(tmp_path / name, tiny_models, redis_url, s3_env, name) for name in ("host-a", "host-b")
    ]
    try:
        _wait_ready(redis_url, hosts, 2)
        driver = make_settings(
            redis_url, tiny_models, [tmp_path], shard_deadline_min_s=3.0, shard_deadline_factor=2.0
        )
        out = f"{bucket}/out-manifest/"
        killed: dict[str, int] = {}

        def kill_host_a_mid_run() -> None:
            """Once 3 shards are done, at host A's next task received: a shard of 1 utterance is
            done within tens of ms, so a kill at a time of its own may find A between shards."""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(objects.list_url(f"{out}shards/")) < 3:
                time.sleep(0.05)
            log = tmp_path / "host-a" / "worker.log"
            seen = log.read_bytes().count(b"] received")
            while time.monotonic() < deadline:
                if log.read_bytes().count(b"] received") > seen:
                    os.killpg(hosts[0].pid, signal.SIGKILL)
                    killed["at"] = len(objects.list_url(f"{out}shards/"))
                    return
                time.sleep(0.002)

        killer = threading.Thread(target=kill_host_a_mid_run)
        killer.start()
        # One utterance per shard: 24 shards, so that the run is still going when A is killed.
        report = extract_corpus(driver, s3_manifest, RunFolder.of(out), ops, 2, 1, quiet=True).to_dict()
        killer.join()
        assert "at" in killed and killed["at"] < 24, "host A was not killed mid-run"
        assert hosts[0].wait(timeout=10) == -signal.SIGKILL
        # Host A's shard in flight was lost with it and done again by host B.
        assert report["resubmitted_shards"] >= 1, (killed, report.get("wall_seconds"))
        assert report["utterances"] == 24
        outputs = _comparable(read_outputs(_download(out, tmp_path / "copy-manifest")))
        tokens = [row["utt"] for row in outputs["speech_tokens.parquet"]]  # type: ignore[union-attr]
        assert tokens == [e["utt"] for e in entries]  # every utterance once, in listing order
        assert outputs == reference

        # Resumed on the bucket: every shard object and the outputs are there; nothing is redone.
        again = extract_corpus(driver, s3_manifest, RunFolder.of(out), ops, 2, 1, quiet=True).to_dict()
        assert again == report

        # The same audio as WebDataset tar shards in the bucket, by a brace pattern, to s3://.
        tars_out = f"{bucket}/out-tars"
        tar_report = extract_corpus(
            driver, f"{bucket}/tars/{{000000..000003}}.tar", RunFolder.of(tars_out), ops, 1, 0, True
        ).to_dict()
        assert tar_report["utterances"] == 24
        tar_outputs = _comparable(read_outputs(_download(tars_out, tmp_path / "copy-tars")))
        assert tar_outputs == reference
        assert RunFolder.of(tars_out).location.names(RunFolder.SHARDS) == {
            f"extract-{n:06d}.parquet" for n in range(4)
        }  # one shard per tar, both ops in one task (every worker serves extract)
    finally:
        for host in hosts:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host.pid, signal.SIGKILL)
            host.wait(timeout=10)


# --------------------------------------------------------------------------- reads in flight


def test_reads_in_flight_survive_a_dropped_connection(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _bucket("dropped")
    clips = {f"{bucket}/c{i}.wav": bytes([i]) * 3000 for i in range(6)}
    for url, data in clips.items():
        objects.filesystem("s3").pipe_file(urls.parse_url(url).fs_path, data)
    with DelayProxy(int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), delay_ms=5) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        objects._FILESYSTEMS.clear()
        proxy.drop(1)  # the first GET's connection is reset, unanswered
        fetched = list(prefetch_clips(list(clips), AudioLimits(), ReadAhead(in_flight=3)))
        assert proxy.dropped == 1
    assert [f.open().read() for f in fetched if f is not None] == list(clips.values())


def test_a_shard_read_ahead_equals_a_serial_read_with_errors_in_place(
    s3_env: dict[str, str],
    redis_url: str,
    redis_client: Any,
    tiny_models: Path,
    tmp_path: Path,
    start_worker: Any,
) -> None:
    bucket = _bucket("ahead")
    corpus = make_audio_folder(tmp_path / "audio", count=9, min_s=0.5, max_s=1.5)
    names = [f"spk{i % 3}/utt{i:04d}" for i in range(9)]
    for name in names:
        _upload(corpus / f"{name}.wav", f"{bucket}/audio/{name}.wav")
    fs = objects.filesystem("s3")
    fs.pipe_file("ahead/audio/empty.wav", b"")
    fs.pipe_file("ahead/audio/noise.wav", b"not audio at all " * 200)
    paths = [f"{bucket}/audio/{n}.wav" for n in names]
    # Failures between the clips: a missing, an empty and an undecodable object, a URL outside the
    # allowed prefixes, and a local file (read as always, among the objects read ahead).
    odd = {
        "x/missing": f"{bucket}/audio/missing.wav",
        "x/empty": f"{bucket}/audio/empty.wav",
        "x/noise": f"{bucket}/audio/noise.wav",
        "x/elsewhere": "s3://elsewhere/audio/a.wav",
        "x/local": str(corpus / f"{names[0]}.wav"),
    }
    listed = [(n, p) for n, p in zip(names, paths, strict=True)]
    for at, item in zip((1, 3, 4, 6, 8), odd.items(), strict=True):
        listed.insert(at, item)
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text("".join(json.dumps({"utt": u, "spk": "s", "path": p}) + "\n" for u, p in listed))
    # Segments: three ranges of each of two recordings (each recording fetched once per run of
    # them), and a range of a recording that is not there.
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    (kaldi / "wav.scp").write_text(f"r0 {paths[0]}\nr1 {paths[1]}\nr9 {bucket}/audio/missing.wav\n")
    segments = [f"r{r}-{k} r{r} {k * 0.15:.2f} {(k + 1) * 0.15:.2f}" for r in (0, 1) for k in range(3)]
    (kaldi / "segments").write_text("\n".join([*segments[:3], "r9-0 r9 0.00 0.30", *segments[3:]]) + "\n")

    outputs: dict[tuple[str, int], dict[str, Any]] = {}
    for in_flight, budget in ((1, 0), (8, 70_000)):  # 70 kB: about two clips held ahead
        settings = make_settings(
            redis_url,
            tiny_models,
            [tmp_path],
            allowed_roots=(tmp_path, bucket),
            reads_in_flight=in_flight,
            read_ahead_bytes=budget,
        )
        workers = start_worker(settings, queues=("embed",))
        for name, listing in (("clips", manifest), ("segments", kaldi)):
            out = tmp_path / f"out-{name}-{in_flight}"
            extract_corpus(settings, listing, RunFolder.of(out), ["embed"], 1, 8, quiet=True)
            outputs[name, in_flight] = _comparable(read_outputs(out))
        workers.stop()
    assert outputs["clips", 8] == outputs["clips", 1]
    assert outputs["segments", 8] == outputs["segments", 1]

    clips = outputs["clips", 8]
    embedded = [row["utt"] for row in clips["utt_embeddings.parquet"]]  # type: ignore[union-attr]
    assert embedded == [u for u, _ in listed if u not in odd or u == "x/local"]
    failures = {e["utt"]: e for e in map(json.loads, clips["errors.jsonl"])}
    assert {utt: e["code"] for utt, e in failures.items()} == {
        "x/missing": NOT_FOUND,
        "x/empty": "empty",
        "x/noise": "unreadable",
        "x/elsewhere": "forbidden_path",
    }
    assert f"{bucket}/audio/missing.wav" in failures["x/missing"]["message"]
    assert f"{bucket}/audio/noise.wav" in failures["x/noise"]["message"]
    segmented = outputs["segments", 8]
    rows = [row["utt"] for row in segmented["utt_embeddings.parquet"]]  # type: ignore[union-attr]
    assert rows == [s.split()[0] for s in segments]
    assert [json.loads(e)["utt"] for e in segmented["errors.jsonl"]] == ["r9-0"]


# --------------------------------------------------------------------------- the merge read ahead


class _CountingProxy(DelayProxy):
    """A delaying proxy that counts the requests in flight at once (all on the proxy's one loop:
    no lock). A request is in flight from its arrival to the end of its answer."""

    def __init__(self, upstream_port: int, delay_ms: float) -> None:
        super().__init__(upstream_port, delay_ms)
        self.open = self.most_open = 0
        self.puts: list[tuple[str, float, float]] = []  # (object name, arrived, answered)
        self.asked: list[tuple[str, str]] = []  # (method, object name), as they arrived

    async def _exchange(self, request: bytes, client_reader: Any, client: Any) -> bool:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        arrived = time.monotonic()
        method, path = request.split(b" ", 2)[:2]
        name = path.split(b"?")[0].rsplit(b"/", 1)[-1].decode()
        self.asked.append((method.decode(), name))
        try:
            return await super()._exchange(request, client_reader, client)
        finally:
            self.open -= 1
            if method == b"PUT":
                self.puts.append((name, arrived, time.monotonic()))

    def most_puts_at_once(self) -> int:
        return max(sum(1 for _, a, e in self.puts if a <= at < e) for _, at, _ in self.puts)


def _merged_bytes(out: str) -> dict[str, bytes]:
    return output_bytes(lambda name: objects.read_url(f"{out}/{name}"))


def test_the_merge_reads_shard_objects_ahead_as_a_serial_merge_does(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = f"{_bucket('merged')}/run"
    remote, local = RunFolder.of(out), RunFolder.of(tmp_path / "local")
    specs = write_run(remote, shards=12)
    write_run(local, shards=12)
    merged: dict[tuple[int, int], dict[str, bytes]] = {}
    most_open: dict[tuple[int, int], int] = {}
    moto_port = int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    for buffer_rows in (7, 65536):  # 7: windows of one shard (two files); 65536: one window of 24
        for in_flight in (1, 4):
            with _CountingProxy(moto_port, delay_ms=20) as proxy:  # requests overlap only if sent so
                monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
                objects._FILESYSTEMS.clear()  # a new client: no connection left from the last merge
                ahead = ReadAhead(in_flight=in_flight, budget_bytes=4096)  # a few shard tables
                merge_outputs(remote, specs, RunReport(), buffer_rows=buffer_rows, read_ahead=ahead)
                merged[buffer_rows, in_flight] = _merged_bytes(out)
            most_open[buffer_rows, in_flight] = proxy.most_open
            # The outputs are uploaded together (as many at once as reads), the report after them.
            *outputs, (last, report_sent, _) = proxy.puts
            assert last == "report.json" and all(answered <= report_sent for _, _, answered in outputs)
            assert len(outputs) == 5
            assert proxy.most_puts_at_once() == 1 if in_flight == 1 else proxy.most_puts_at_once() >= 2
    objects._FILESYSTEMS.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
    assert merged[7, 4] == merged[7, 1] and merged[65536, 4] == merged[65536, 1]  # byte for byte
    assert most_open[7, 1] == most_open[65536, 1] == 1  # one read after another
    # Reads in flight, in windows of one shard (two files) and of the whole run (their bounds are
    # tests/unit/test_prefetch.py's on requests and test_merge_reads.py's on windows).
    assert most_open[7, 4] >= 2 and most_open[65536, 4] >= 2
    merge_outputs(local, specs, RunReport(), read_ahead=ReadAhead(in_flight=4))
    assert read_outputs(_download(out, tmp_path / "copy")) == read_outputs(tmp_path / "local")


def test_the_driver_looks_for_the_shard_objects_of_a_round_at_once(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder.of(f"{_bucket('looks')}/run")
    specs = write_run(folder, shards=4)  # shard 2's embed file is a given-up one: no shard file
    never = ShardSpec(shard=9, op="embed", out_dir=folder.name, utts=specs[0].utts)
    moto_port = int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with _CountingProxy(moto_port, delay_ms=20) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        objects._FILESYSTEMS.clear()
        found = Ledger(folder).existing([*specs, never])
    objects._FILESYSTEMS.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
    assert found == {s.name for s in specs} - {"embed-000002"}
    assert proxy.most_open >= 2  # looked at together: a round trip for the round, not one a shard


def test_the_files_of_shards_announced_done_are_read_when_looked_for_and_merged_from_memory(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunFolder.of(f"{_bucket('kept')}/run")
    specs = write_run(folder, shards=4)  # shard 2's embed file is a given-up one: no shard file
    given_up = {RunFolder.given_up_file("embed", 2)}
    first_file = len(objects.read_url(str(Ledger(folder).file_of(specs[0]))))
    moto_port = int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with _CountingProxy(moto_port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        objects._FILESYSTEMS.clear()
        ledger = Ledger(folder, keep_bytes=10 * first_file)
        announced = {spec.name for spec in specs if spec.shard != 3}  # shard 3's: not heard yet
        found = ledger.existing(specs, announced)
        assert found == {spec.name for spec in specs} - {"embed-000002"}
        gets = sorted(name for method, name in proxy.asked if method == "GET")
        heads = sorted(name for method, name in proxy.asked if method == "HEAD")
        assert gets == sorted(f"{spec.name}.parquet" for spec in specs if spec.shard != 3)  # one GET each
        assert heads == ["embed-000003.parquet", "tokenize-000003.parquet"]
        read_then = found - {"embed-000003", "tokenize-000003"}
        assert sorted(ledger.kept) == sorted(str(ledger.file_of(s)) for s in specs if s.name in read_then)
        proxy.asked.clear()
        reads = ReadAhead(in_flight=4)
        merge_outputs(folder, specs, RunReport(), read_ahead=reads, given_up=given_up, kept=ledger.kept)
        read = sorted(name for method, name in proxy.asked if method == "GET")
        assert read == ["embed-000002.given-up.parquet", "embed-000003.parquet", "tokenize-000003.parquet"]
        assert ledger.kept == {}  # taken out as merged
        kept_merge = _merged_bytes(folder.name)

        small = Ledger(folder, keep_bytes=first_file + 1)  # room for one file: the rest looked at only
        small.existing(specs, {spec.name for spec in specs})
        assert len(small.kept) == 1
    objects._FILESYSTEMS.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
    merge_outputs(folder, specs, RunReport(), given_up=given_up)  # every file read from the store
    assert _merged_bytes(folder.name) == kept_merge


def test_a_missing_or_bad_shard_object_stops_a_merge_read_ahead_as_a_serial_one(
    s3_env: dict[str, str],
) -> None:
    out = f"{_bucket('broken')}/run"
    folder = RunFolder.of(out)
    specs = write_run(folder, shards=8)
    fs = objects.filesystem("s3")
    bad, missing = f"{out}/shards/embed-000003.parquet", f"{out}/shards/tokenize-000005.parquet"
    fs.pipe_file(urls.parse_url(bad).fs_path, b"PAR1 not a parquet file PAR1")
    fs.rm_file(urls.parse_url(missing).fs_path)
    messages: dict[int, list[str]] = {1: [], 8: []}
    for in_flight, said in messages.items():
        with pytest.raises(VoxmillError) as caught:  # the bad file comes first in plan order
            merge_outputs(folder, specs, RunReport(), read_ahead=ReadAhead(in_flight=in_flight))
        said.append(caught.value.message)
        assert caught.value.code == "output_error"
    write_run(folder, shards=4)  # the bad file written again: the missing one is next
    for in_flight, said in messages.items():
        with pytest.raises(VoxmillError) as caught:
            merge_outputs(folder, specs, RunReport(), read_ahead=ReadAhead(in_flight=in_flight))
        said.append(caught.value.message)
    assert messages[8] == messages[1]
    assert messages[1][0].startswith(f"shard file {bad} cannot be read: ")
    assert messages[1][1] == f"shard file {missing} is missing"
    assert not objects.url_exists(f"{out}/report.json")  # the outputs as they were: none


# --------------------------------------------------------------------------- uploads behind


def test_a_shard_file_is_uploaded_behind_its_task_and_announced_once_written(
    s3_env: dict[str, str],
    redis_url: str,
    redis_client: Any,
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    start_worker: Any,
) -> None:
    """A store that answers in 1.5 s, one worker process: the shard task ends before its upload
    does (a job sent after it is answered before the shard is announced), its id stays in the
    heartbeat record until the file is written, and the announcement comes once the object
    exists. A first attempt makes one request (the PUT); a second attempt finds the file, reads
    its counts (HEAD, GET) and writes nothing."""
    from celery import Celery

    from workers import keys
    from workers.heartbeat import read_worker_records
    from workers.queue.app import SHARD_TASK, TASK_NAMES

    bucket = _bucket("behind")
    audio = make_audio_folder(tmp_path / "audio", count=2, min_s=0.5, max_s=1.0)
    wavs = sorted(audio.rglob("*.wav"))
    utts = [Utterance(p.stem, str(p), "spk") for p in wavs]
    port = int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with DelayProxy(port, delay_ms=1500) as proxy, _StoreRequests.recorded() as requests:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the worker's (this process's store is cached)
        settings = make_settings(redis_url, tiny_models, [tmp_path], allowed_roots=(tmp_path, bucket))
        start_worker(settings, queues=("embed",))
        spec = ShardSpec(shard=0, op="embed", out_dir=f"{bucket}/out", utts=utts, run="behind-run")
        app = Celery(broker=redis_url, backend=redis_url)
        channel = redis_client.pubsub()
        channel.subscribe(keys.SHARDS_DONE_CHANNEL.format(run="behind-run"))
        running: set[str] = set()

        def announced(job: Any = None) -> tuple[dict[str, Any], bool]:
            """The shard's announcement, and whether `job` was answered before it."""
            answered = False
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                answered = answered or (job is not None and job.ready())
                message = channel.get_message(timeout=0.02)
                if message and message["type"] == "message":
                    return dict(json.loads(message["data"])), answered
                running.update(i for r in read_worker_records(redis_client) for i in r.running)
            raise AssertionError("no announcement")

        sent = app.send_task(SHARD_TASK, args=[{**spec.to_dict(), "attempt": 1}], queue="embed")
        job = app.send_task(TASK_NAMES["embed"], args=[{"path": str(wavs[0])}], queue="embed")
        result, job_first = announced(job)
        assert job_first  # the process served the job while the shard's file was uploaded
        assert job.get(timeout=10)["error"] is None
        methods = requests.methods()
        assert objects.url_exists(f"{bucket}/out/{RunFolder.SHARDS}/embed-000000.parquet")
        assert result["error"] is None and result["ok"] == 2
        assert methods == ["PUT"]  # a first attempt does not look for its file first
        assert sent.id in running  # in the heartbeat record while its file was uploaded

        requests.methods()
        app.send_task(SHARD_TASK, args=[{**spec.to_dict(), "attempt": 2}], queue="embed")
        again, _ = announced()
        assert again["ok"] == 2 and again["seconds"] == 0.0  # found written: counted, not redone
        assert requests.methods() == ["HEAD", "GET"]
        app.close()
        channel.close()


class _StoreRequests(logging.Handler):
    """The methods of the requests the loopback S3 server answers (its werkzeug log lines)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(record.getMessage())

    def methods(self) -> list[str]:
        """The methods answered since the last call, in order."""
        lines, self._lines = self._lines, []
        return [line.split('"')[1].split()[0] for line in lines if line.count('"') >= 2]

    @classmethod
    @contextlib.contextmanager
    def recorded(cls) -> Iterator[_StoreRequests]:
        handler, server_log = cls(), logging.getLogger("werkzeug")
        level, disabled = server_log.level, server_log.disabled  # a logging setup may disable it
        server_log.setLevel(logging.INFO)
        server_log.disabled = False
        server_log.addHandler(handler)
        try:
            yield handler
        finally:
            server_log.removeHandler(handler)
            server_log.setLevel(level)
            server_log.disabled = disabled


# --------------------------------------------------------------------------- signed GETs


def test_objects_are_read_with_signed_gets_of_their_own_and_the_sdk_where_they_cannot_be(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys of every kind read byte for byte without the SDK; a missing key is `not_found` at
    once; a bucket the store does not answer for as expected (none by that name) goes to the SDK,
    which says what it is."""
    bucket = _bucket("signed-gets")
    keys = ["clip.wav", "spk 1/utt+2=3.flac", "dir/ünï cödé/a~b_c-d.e.wav", "a%20b/(x)!*'.ogg", "empty"]
    blobs = {key: (b"" if key == "empty" else key.encode() * 700) for key in keys}
    for key, data in blobs.items():
        objects.filesystem("s3").pipe_file(f"signed-gets/{key}", data)
    sdk_reads: list[str] = []
    sdk_get = objects._s3_sdk_get

    def counted(url: Any, *args: Any) -> Any:
        sdk_reads.append(str(url))
        return sdk_get(url, *args)

    monkeypatch.setattr(objects, "_s3_sdk_get", counted)
    for key, data in blobs.items():
        assert objects.read_url(f"{bucket}/{key}") == data
        size, stream = objects.fetch_checked(f"{bucket}/{key}", 10_000_000)
        assert size == len(data) and (stream is None) == (not data)
        assert stream is None or stream.read() == data
    assert objects.fetch_checked(f"{bucket}/clip.wav", 100) == (len(blobs["clip.wav"]), None)  # too big
    assert objects.read_url(f"{bucket}/clip.wav") == blobs["clip.wav"]  # the connection is good again
    with pytest.raises(VoxmillError) as missing:
        objects.read_url(f"{bucket}/no-such-key")
    assert missing.value.code == NOT_FOUND
    assert sdk_reads == []  # all of it signed and sent by voxmill itself
    direct = objects._direct_s3()
    assert direct is not None and direct.usable("signed-gets")

    with pytest.raises(VoxmillError) as no_bucket:
        objects.read_url("s3://no-such-bucket-here/key")
    assert no_bucket.value.code in (NOT_FOUND, STORE_ERROR)
    assert sdk_reads == ["s3://no-such-bucket-here/key"]  # the SDK was asked, and said so
    assert not direct.usable("no-such-bucket-here") and direct.usable("signed-gets")
