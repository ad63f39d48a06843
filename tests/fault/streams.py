"""Streams of jobs that fault tests run while something breaks, and the counts they end with.

- `ClientStream`: a producer through `workers.queue.client.Client` that submits a batch of
  jobs, waits for every one of them, and starts the next batch, until stopped.
- `SubmitRun`: one `voxmill submit embed FILE... --json` process (every input a distinct path).

Both count per task id or per input, so a job answered twice, or not at all, shows; a submit
refused at once (no broker, no consumer) is counted apart: the producer was told.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis
import soundfile as sf
from kombu.exceptions import OperationalError

from pipeline.demo import speechlike
from pipeline.settings import Settings
from tests.conftest import VOXMILL, clean_env
from workers.queue.client import Client, Job, NoConsumer

SUBMIT_INPUTS = 16


def make_clips(folder: Path, inputs: int = SUBMIT_INPUTS) -> Path:
    """Three 30 s clips (`clip*.wav`: about 0.4 s each for the full-size embedder) and `inputs`
    more names for them (hard links `input*.wav`: distinct inputs for `voxmill submit`)."""
    for index in range(3):
        wave = speechlike(30.0, 16000, 110.0 + 30 * index, seed=40 + index)
        sf.write(folder / f"clip{index}.wav", wave, 16000, subtype="PCM_16")
    for index in range(inputs):
        os.link(folder / f"clip{index % 3}.wav", folder / f"input{index:02d}.wav")
    return folder


@dataclass
class Tally:
    """What a producer saw: jobs submitted, answers per job, error codes, refusals, waits."""

    submitted: set[str] = field(default_factory=set)
    answers: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    longest_wait_s: float = 0.0

    def answer(self, key: str, code: str, wait_s: float) -> None:
        self.answers[key] += 1
        self.codes[code] += 1
        self.longest_wait_s = max(self.longest_wait_s, wait_s)

    @property
    def lost(self) -> int:
        """Jobs without an answer, or whose answer was a timeout."""
        unanswered = len(self.submitted - set(self.answers))
        return unanswered + self.codes.get("timeout", 0)

    @property
    def seen_twice(self) -> int:
        return sum(count - 1 for count in self.answers.values() if count > 1)

    def counts(self) -> dict[str, object]:
        return {
            "submitted": len(self.submitted),
            "answered": len(set(self.answers) & self.submitted),
            "lost": self.lost,
            "seen_twice": self.seen_twice,
            "codes": dict(self.codes),
            "refused": dict(self.refused),
            "longest_wait_s": round(self.longest_wait_s, 1),
        }

    def check(self, max_wait_s: float) -> None:
        """Every job answered once, successfully, within `max_wait_s`."""
        counts = self.counts()
        assert self.submitted, counts
        assert self.lost == 0 and self.seen_twice == 0, counts
        assert set(self.answers) == self.submitted, counts
        assert set(self.codes) == {"ok"}, counts
        assert self.longest_wait_s < max_wait_s, counts


class ClientStream:
    """A producer that submits `batch` embed jobs, waits for all of them, and goes again."""

    def __init__(self, settings: Settings, wavs: list[Path], batch: int = 4, timeout_s: float = 120.0):
        self.settings, self.wavs, self.batch, self.timeout_s = settings, wavs, batch, timeout_s
        self.tally = Tally()
        self.client = Client(settings)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="client-stream", daemon=True)

    def start(self) -> ClientStream:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            index = 0
            while not self._stop.is_set():
                jobs: list[Job] = []
                for _ in range(self.batch):
                    try:
                        jobs.append(self.client.submit("embed", self.wavs[index % len(self.wavs)]))
                    except NoConsumer:
                        self.tally.refused["no_consumer"] += 1
                        break
                    except (OperationalError, redis.RedisError, OSError):
                        self.tally.refused["broker_unreachable"] += 1
                        break
                    index += 1
                self.tally.submitted.update(job.id for job in jobs)
                for job, result in self.client.completed(jobs, timeout_s=self.timeout_s):
                    code = "ok" if result.error is None else result.error.code
                    self.tally.answer(job.id, code, time.monotonic() - job.sent_at)
                if not jobs:
                    self._stop.wait(0.5)  # refused: the producer tries again a little later
        except BaseException as exc:  # shown by `stop`, not lost in a thread
            self.error = exc

    def stop(self, timeout_s: float = 180.0) -> Tally:
        """Stop submitting, wait for the batch in flight, and return the counts."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), "the producer is still waiting for its last batch"
        if self.error is not None:
            raise AssertionError(f"the producer failed: {self.error!r}") from self.error
        return self.tally


class SubmitRun:
    """`voxmill submit embed FILE... --json` as a process; its inputs are distinct paths."""

    def __init__(self, settings: Settings, files: list[Path], timeout_s: float = 120.0) -> None:
        self.settings, self.files, self.timeout_s = settings, files, timeout_s
        self.started = time.monotonic()
        self.stderr = ""
        args = [VOXMILL, "submit", "embed", *map(str, files), "--json", "--timeout", str(timeout_s)]
        self.process = subprocess.Popen(
            args, env=clean_env(settings.to_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def finish(self) -> tuple[int, Tally]:
        """The exit code and the counts (a wait is the whole command's, the longest any input had)."""
        try:
            stdout, stderr = self.process.communicate(timeout=self.timeout_s + 60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            stdout, stderr = self.process.communicate()
            raise AssertionError(f"voxmill submit did not finish:\n{stderr[-3000:]}") from None
        wall_s = time.monotonic() - self.started
        self.stderr = stderr  # its log: what it sent again, broker trouble
        tally = Tally(submitted={str(f) for f in self.files})
        for line in stdout.splitlines():
            row = json.loads(line)
            tally.answer(row["input"], "ok" if row["error"] is None else row["error"]["code"], wall_s)
        if self.process.returncode == 2:
            tally.refused["exit_2"] += 1
            print(f"voxmill submit refused: {stderr.strip()[-500:]}")
        return self.process.returncode, tally


def queued_paths(client: redis.Redis, queue: str) -> set[str]:
    """The audio paths of the path jobs waiting in `queue` (from each message's JSON body)."""
    paths = set()
    for raw in client.lrange(queue, 0, -1):
        try:
            body = json.loads(base64.b64decode(json.loads(raw)["body"]))
            paths.add(str(body[0][0]["path"]))
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return paths


def wait_submitted(client: redis.Redis, path: Path, logs: list[Path], timeout_s: float = 60.0) -> None:
    """Until a job for `path` (a `SubmitRun`'s last input) is queued or has run: the run has sent
    every job (a fault before that would only make it exit 2, "cannot reach the broker")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if str(path) in queued_paths(client, "embed"):
            return
        if any(f"input={path} " in log.read_text(errors="replace") for log in logs if log.exists()):
            return
        time.sleep(0.02)
    raise AssertionError(f"voxmill submit never sent its job for {path}")


def executions(log: str, ids: set[str]) -> Counter[str]:
    """How often each task id ran, from the workers' one log line per task ("task <id> op=...")."""
    ran: Counter[str] = Counter()
    for line in log.splitlines():
        marker = line.find("task ")
        if marker >= 0 and " op=" in line:
            task_id = line[marker + 5 :].split(" ", 1)[0]
            if task_id in ids:
                ran[task_id] += 1
    return ran
