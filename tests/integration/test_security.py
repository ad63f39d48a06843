"""Nobody in: a password-protected and a TLS broker, secrets kept out of logs, status and results,
models only from the model folder.

Covered elsewhere, not repeated here (docs/security.md lists them):
- pickle and unknown content types are refused and logged:
  `test_queue.py::test_pickle_and_unknown_content_types_are_refused` and the wire cases of
  `tests/fault/test_bad_input.py`;
- paths are confined after resolving symlinks:
  `test_queue.py::test_paths_outside_the_allowed_roots_are_forbidden`, `tests/unit/test_paths.py`
  and the path cases of `tests/fault/test_bad_input.py`;
- size and duration limits apply before decoding:
  `test_bad_input.py::test_huge_files_are_refused_without_reading_their_data*`.

Each test here starts a private `redis-server` (with `--requirepass`, and with TLS where the binary
supports it) on a free port, so a password can be set without touching the shared test Redis.
"""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pipeline.audio.decode import load_audio
from pipeline.errors import VoxmillError
from pipeline.models.files import sha256_bytes
from pipeline.records import TaskResult
from pipeline.settings import AudioLimits
from pipeline.storage import objects
from pipeline.storage.paths import resolve_allowed
from tests.conftest import WorkerFactory, make_settings, voxmill, wait_for
from tests.helpers import worker_dicts
from workers.embedded import LocalWorkers, free_port, redis_server_binary
from workers.queue.client import Client
from workers.reload import generations

PASSWORD = "vx-Secret-7f3a9c"  # distinctive, so any leak is found by a plain substring search
WRONG_PASSWORD = "vx-Wrong-51be02"
AUTH_FAILED = "invalid username-password pair"


@dataclass
class PrivateRedis:
    """A password-protected redis-server of this test only; `tls_dir` holds its CA when TLS is on."""

    process: subprocess.Popen[bytes]
    port: int
    tls_dir: Path | None = None

    def url(self, password: str | None = PASSWORD, verify: bool = True) -> str:
        auth = f":{password}@" if password is not None else ""
        if self.tls_dir is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = "ssl_cert_reqs=required"
        if verify:
            query += f"&ssl_ca_certs={self.tls_dir / 'ca.crt'}"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url(), socket_connect_timeout=2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def server_binary() -> str:
    """The system redis-server (Debian's is built with TLS), else the embedded one."""
    return shutil.which("redis-server") or redis_server_binary()


def start_redis(folder: Path, tls_dir: Path | None = None) -> PrivateRedis:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [server_binary(), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
    args += ["--save", "", "--appendonly", "no", "--dir", str(folder), "--daemonize", "no"]
    if tls_dir is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
        args += [
            "--tls-cert-file",
            str(tls_dir / "server.crt"),
            "--tls-key-file",
            str(tls_dir / "server.key"),
        ]
        args += ["--tls-ca-cert-file", str(tls_dir / "ca.crt")]
    log = open(folder / "redis.log", "wb")  # noqa: SIM115 - owned by the child
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = PrivateRedis(process, port, tls_dir)

    def answers() -> bool:
        if process.poll() is not None:
            return True  # exited: reported below
        try:
            return bool(server.client().ping())
        except redis.RedisError:
            return False

    wait_for(answers, timeout_s=10)
    if process.poll() is not None:
        output = (folder / "redis.log").read_text(errors="replace")[-2000:]
        if tls_dir is not None:
            pytest.skip(f"{server_binary()} cannot serve TLS here (built without it?): {output}")
        raise RuntimeError(f"redis-server did not start: {output}")
    return server


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def make_certificates(folder: Path) -> Path:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=voxmill test CA",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.cnf", "-out", "server.crt")  # fmt: skip
    return folder


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates to test TLS with")
    server = start_redis(tmp_path / "redis-tls", make_certificates(tmp_path / "tls"))
    yield server
    server.stop()


def everything_in(client: redis.Redis) -> str:
    """Every key and every string, hash, list and set value in the database, as one text."""
    parts: list[str] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        parts.append(key.decode(errors="replace"))
        if kind == "string":
            parts.append(client.get(key).decode(errors="replace"))
        elif kind == "hash":
            parts += [f"{k!r}={v!r}" for k, v in client.hgetall(key).items()]
        elif kind == "list":
            parts += [v.decode(errors="replace") for v in client.lrange(key, 0, -1)]
        elif kind == "set":
            parts += [v.decode(errors="replace") for v in client.smembers(key)]
    return "\n".join(parts)


def command_line(pid: int) -> str:
    """What `ps` shows every user for a process."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


# --------------------------------------------------------------------------- password


def test_a_password_protected_broker_works_and_the_password_appears_nowhere(
    locked_redis: PrivateRedis, start_worker, tiny_models: Path, audio_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(locked_redis.url(), tiny_models, [audio_dir, tmp_path])
    workers = start_worker(settings, concurrency=1)
    wav = audio_dir / "chirp_3s.wav"
    results = Client(settings).run("extract", [wav, wav.read_bytes()], timeout_s=60)
    assert [r.error for r in results] == [None, None]
    submitted = voxmill("submit", "embed", str(wav), "--json", env=settings.to_env())
    assert submitted.returncode == 0, submitted.stderr
    status = voxmill("status", "--json", env=settings.to_env())
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["broker"] == f"redis://:***@127.0.0.1:{locked_redis.port}/0"
    assert [w["pid"] for w in report["workers"]]  # it really read the protected Redis

    client = locked_redis.client()
    try:
        stored = everything_in(client)
        children = [r["pid"] for r in worker_dicts(client)]
    finally:
        client.close()
    assert workers.process is not None and workers.log_path is not None
    log = workers.log_path.read_text(errors="replace")
    assert f"127.0.0.1:{locked_redis.port}" in log  # the log does name the broker ...
    places = {
        "worker log": log,
        "status --json": status.stdout + status.stderr,
        "submit --json": submitted.stdout + submitted.stderr,
        "results": json.dumps([r.to_dict() for r in results]),
        "redis keys and values": stored,
        "worker command lines": " ".join(command_line(p) for p in [workers.process.pid, *children]),
    }
    leaks = [where for where, text in places.items() if PASSWORD in text]
    assert leaks == [], f"the broker password appears in: {leaks}"  # ... never its password


def test_a_wrong_or_missing_password_is_refused_with_a_clear_message(
    locked_redis: PrivateRedis, tmp_path: Path
) -> None:
    wrong = {"VOXMILL_BROKER_URL": locked_redis.url(WRONG_PASSWORD)}
    status = voxmill("status", "--json", env=wrong)
    assert status.returncode == 2
    assert "cannot reach the broker at redis://:***@" in status.stderr and AUTH_FAILED in status.stderr
    assert WRONG_PASSWORD not in status.stdout + status.stderr
    missing = voxmill("status", env={"VOXMILL_BROKER_URL": locked_redis.url(None)})
    assert missing.returncode == 2 and "cannot reach the broker" in missing.stderr
    assert "auth" in missing.stderr.lower()


def test_submit_with_a_wrong_password_fails_without_leaking_it(
    locked_redis: PrivateRedis, audio_dir: Path
) -> None:
    """Fails with one line naming the redacted URL, exit 2, and leaks nothing."""
    done = voxmill(
        "submit", "embed", str(audio_dir / "chirp_3s.wav"), "--json",
        env={"VOXMILL_BROKER_URL": locked_redis.url(WRONG_PASSWORD)},
    )  # fmt: skip
    assert done.returncode != 0
    assert AUTH_FAILED in done.stderr
    assert WRONG_PASSWORD not in done.stdout + done.stderr
    assert done.stdout == ""  # no result line pretends the job ran
    one_clear_line = (
        done.returncode == 2 and "Traceback" not in done.stderr and "redis://:***@" in done.stderr
    )
    assert one_clear_line, done.stderr[-2000:]


def test_a_worker_with_a_wrong_password_keeps_retrying_and_logs_no_secret(
    locked_redis: PrivateRedis, tiny_models: Path, audio_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(locked_redis.url(WRONG_PASSWORD), tiny_models, [audio_dir])
    log_path = tmp_path / "worker.log"
    workers = LocalWorkers(settings, 1, ["embed"], log_path=log_path).start()
    try:
        wait_for(lambda: log_path.read_text(errors="replace").count("Cannot connect to") >= 2, timeout_s=60)
        assert workers.alive()
    finally:
        workers.stop()
    log = log_path.read_text(errors="replace")
    assert AUTH_FAILED in log
    assert f"redis://:***@127.0.0.1:{locked_redis.port}/0" in log
    assert WRONG_PASSWORD not in log


# --------------------------------------------------------------------------- TLS


def test_a_tls_broker_works_end_to_end_and_an_unknown_ca_is_refused(
    tls_redis: PrivateRedis, start_worker, tiny_models: Path, audio_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(tls_redis.url(), tiny_models, [audio_dir])
    workers = start_worker(settings, concurrency=1, queues=("embed",))
    result = Client(settings).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=60)[0]
    assert result.error is None and len(result.embedding or []) == 192
    assert workers.log_path is not None
    log = workers.log_path.read_text(errors="replace")
    assert f"rediss://:**@127.0.0.1:{tls_redis.port}/0" in log and PASSWORD not in log
    # The same server without our CA: certificate verification fails, nothing is sent.
    unverified = voxmill("status", env={"VOXMILL_BROKER_URL": tls_redis.url(verify=False)})
    assert unverified.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in unverified.stderr
    assert PASSWORD not in unverified.stdout + unverified.stderr
    # Plain redis:// to the TLS port does not get through either.
    plain = voxmill("status", env={"VOXMILL_BROKER_URL": f"redis://:{PASSWORD}@127.0.0.1:{tls_redis.port}/0"})
    assert plain.returncode == 2 and "cannot reach the broker" in plain.stderr
    assert PASSWORD not in plain.stdout + plain.stderr


# --------------------------------------------------------------------------- models


def test_a_published_generation_never_makes_a_worker_load_a_path_from_redis(
    redis_url: str,
    redis_client: redis.Redis,
    start_worker,
    tiny_models: Path,
    audio_dir: Path,
    tmp_path: Path,
) -> None:
    """Workers load the role's file of *their* model folder and check its sha256 against the record;
    the path in the record is information for people, never opened."""
    settings = make_settings(redis_url, tiny_models, [audio_dir])
    start_worker(settings, concurrency=1, queues=("embed",))
    local = tiny_models / "campplus.onnx"
    elsewhere = tmp_path / "elsewhere" / "campplus.onnx"  # not created: opening it would fail loudly
    foreign_sha = "0" * 64
    generations.publish(
        redis_client,
        "embedder",
        foreign_sha,
        {"path": str(elsewhere), "file": local.name, "size": local.stat().st_size},
    )

    def failure() -> dict[str, str] | None:
        records = worker_dicts(redis_client)
        return next((r["reload_failures"]["embedder"] for r in records if r.get("reload_failures")), None)

    seen = wait_for(failure, timeout_s=30)
    assert isinstance(seen, dict)
    assert str(local) in seen["reason"] and "expected 000000000000" in seen["reason"]
    assert str(elsewhere) not in seen["reason"]
    result = Client(settings).run("embed", [audio_dir / "chirp_3s.wav"], timeout_s=60)[0]
    assert result.error is None
    assert result.models["embedder"].sha256 == sha256_bytes(local.read_bytes())


# --------------------------------------------------------------------------- URL roots over HTTP

BIG_BYTES = 20 * 1024 * 1024  # over objects.WHOLE_READ_BYTES: read with ranged GETs


class CorpusHandler(http.server.SimpleHTTPRequestHandler):
    """Serves its folder as http.server does (it decodes the path, then drops dot segments: so
    `/corpus/%2e%2e/secret/x.wav` is `/secret/x.wav`), records every request, and sets two traps:
    `/corpus/jump.wav` answers 302 to `/secret/x.wav` with the outside clip as its body, and
    `/corpus/big-jump.wav` answers HEAD with a 20 MB size and GET with that same 302."""

    server: CorpusServer

    def do_HEAD(self) -> None:
        self.server.seen.append(("HEAD", self.path))
        if self.path == "/corpus/big-jump.wav":
            self.send_response(200)
            self.send_header("Content-Length", str(BIG_BYTES))
            self.end_headers()
            return
        if self.path in ("/corpus/jump.wav",):
            self._redirect(with_body=False)
            return
        super().do_HEAD()

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path))
        if self.path in ("/corpus/jump.wav", "/corpus/big-jump.wav"):
            self._redirect(with_body=True)
            return
        super().do_GET()

    def _redirect(self, with_body: bool) -> None:
        body = self.server.outside
        self.send_response(302)
        self.send_header("Location", "/secret/x.wav")
        self.send_header("Content-Type", "audio/wav")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass


class CorpusServer(http.server.ThreadingHTTPServer):
    seen: list[tuple[str, str]]
    outside: bytes


@dataclass
class HttpCorpus:
    """A real HTTP server on loopback: `root` is the allowed URL prefix (`.../corpus`), `secret/`
    beside it holds the outside clip."""

    base: str
    root: str
    server: CorpusServer
    inside: bytes
    outside: bytes


@pytest.fixture
def http_corpus(tmp_path: Path, audio_dir: Path) -> Iterator[HttpCorpus]:
    served = tmp_path / "served"
    (served / "corpus").mkdir(parents=True)
    (served / "secret").mkdir()
    inside = (audio_dir / "chirp_3s.wav").read_bytes()
    outside = (audio_dir / "noise_1p37s.wav").read_bytes()
    (served / "corpus" / "in.wav").write_bytes(inside)
    (served / "secret" / "x.wav").write_bytes(outside)
    handler = functools.partial(CorpusHandler, directory=str(served))
    server = CorpusServer(("127.0.0.1", 0), handler)
    server.seen, server.outside = [], outside
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield HttpCorpus(base, f"{base}/corpus", server, inside, outside)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# Each spelling, and what a URL job gets: None is the inside clip, decoded.
URL_CASES = {
    "/corpus/in.wav": None,
    "/secret/x.wav": "forbidden_path",
    "/corpus/../secret/x.wav": "forbidden_path",
    "/corpus/%2e%2e/secret/x.wav": "bad_request",
    "/corpus/%2E%2E/secret/x.wav": "bad_request",
    "/corpus/..%2fsecret/x.wav": "bad_request",
    "/corpus/..;/secret/x.wav": "bad_request",
    "/corpus/jump.wav": "forbidden_path",
}


def test_url_roots_hold_against_escaped_dot_segments_and_redirects(http_corpus: HttpCorpus) -> None:
    base, root = http_corpus.base, http_corpus.root
    # The server really does normalise: unchecked, %2e%2e and ..%2f reach the outside file.
    for spelling in ("/corpus/%2e%2e/secret/x.wav", "/corpus/..%2fsecret/x.wav"):
        with urllib.request.urlopen(base + spelling, timeout=10) as unchecked:
            assert unchecked.read() == http_corpus.outside
    http_corpus.server.seen.clear()
    limits = AudioLimits()
    got: dict[str, str | None] = {}
    for spelling in URL_CASES:
        try:
            clip = load_audio(resolve_allowed(base + spelling, [], [root]), limits)
        except VoxmillError as exc:
            got[spelling] = exc.code
            if spelling == "/corpus/jump.wav":
                assert "answered 302 (a redirect); redirects are refused" in exc.message
        else:
            got[spelling] = None
            assert clip.duration_s == pytest.approx(3.0)  # the inside clip, never the 1.37 s one
    assert got == URL_CASES
    # Nothing outside the root was asked for; the refused spellings were never sent at all.
    assert {path for _, path in http_corpus.server.seen} == {"/corpus/in.wav", "/corpus/jump.wav"}

    # Every reader of the store layer refuses the redirect; none returns its body.
    jump = f"{root}/jump.wav"
    readers: dict[str, Callable[[], object]] = {
        "fetch_checked": lambda: objects.fetch_checked(jump, 10**9),
        "url_size": lambda: objects.url_size(jump),
        "read_url": lambda: objects.read_url(jump),
        "open_url": lambda: objects.open_url(jump, size=len(http_corpus.outside)),
    }
    for name, read in readers.items():
        with pytest.raises(VoxmillError) as caught:
            read()
        assert caught.value.code == "forbidden_path" and "redirects are refused" in caught.value.message, name
    # HEAD says 200 (20 MB), the ranged GETs get the 302: the stream refuses at its first read.
    stream = objects.open_url(f"{root}/big-jump.wav", size=BIG_BYTES)
    with pytest.raises(VoxmillError) as ranged:
        stream.read(4096)
    assert ranged.value.code == "forbidden_path"
    assert not any(path.startswith("/secret/") for _, path in http_corpus.server.seen)


def test_a_worker_confines_url_jobs_and_bounds_every_string(
    http_corpus: HttpCorpus, redis_url: str, start_worker: WorkerFactory, tiny_models: Path, audio_dir: Path
) -> None:
    settings = make_settings(redis_url, tiny_models, [audio_dir], allowed_url_roots=(http_corpus.root,))
    start_worker(settings, concurrency=1, queues=("embed",))
    client = Client(settings)
    results = client.run("embed", [http_corpus.base + spelling for spelling in URL_CASES], timeout_s=60)
    assert [r.error.code if r.error else None for r in results] == list(URL_CASES.values())
    assert results[0].audio_seconds == pytest.approx(3.0) and len(results[0].embedding or []) == 192
    assert not any(path.startswith("/secret/") for _, path in http_corpus.server.seen)
    # A megabyte of path or name is refused at the door, and the result does not carry it back.
    huge = "a/" * 500_000
    for job in ({"path": huge}, {"audio": http_corpus.inside, "name": huge}):
        serializer = "msgpack" if "audio" in job else "json"
        value = client.app.send_task("voxmill.embed", args=[job], serializer=serializer, queue="embed")
        result = TaskResult.from_dict(value.get(timeout=30))
        assert result.error is not None and result.error.code == "bad_request"
        assert f"is {len(huge)} characters long; the limit is 4096" in result.error.message
        assert len(result.input) < 4200
