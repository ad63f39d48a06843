"""The plan of a `voxmill extract` run: its shards, written as the corpus listing streams by.

`DIR/plan/` holds it, in files that are each written once, complete or absent:

- `header.json`: the input, the ops, the shard size asked for and the one used, the run's name;
- `chunk-NNNNNN.parquet`: the utterances of `SHARDS_PER_CHUNK` consecutive shards (shard, utt,
  path, spk, text, listed duration) and, in its metadata, each shard's digest;
- `complete.json`: written once the whole listing was read without a problem: the counts and the
  fingerprint (the header's fields and every shard's digest).

A `Planner` reads the listing in a thread, cuts it into shards by count in listing order
(`pipeline.corpus.ShardCutter`), and writes chunk after chunk; the driver takes the shards of the
chunks written so far (`PlanReader`), so the first shards go out while the rest of the listing
is still being read. Shard k is always the same utterances for the same listing, so a resume
plans again and compares each shard's digest with the one on disk: a different corpus in the
same folder is refused at its first differing shard; a listing fixed after a late problem
resumes. Nothing here opens an audio file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.corpus import CorpusError, CorpusListing, ShardCutter, auto_shard_size, check_ops, shard_digest
from pipeline.errors import VoxmillError
from pipeline.records import ShardSpec, Utterance
from pipeline.settings import Settings

PLAN_DIR = "plan"
HEADER_FILE = "header.json"
COMPLETE_FILE = "complete.json"
OLD_PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
PLAN_VERSION = 2
SHARDS_PER_CHUNK = 256
DIGESTS_KEY = b"voxmill.shard_digests"
SHARDS_PER_WORKER = 6  # a small corpus is cut so that every worker process gets this many shards


class RunError(Exception):
    """The run cannot go on (bad input, output not writable, a different run in the folder)."""


@dataclass(frozen=True)
class PlanHeader:
    """What `header.json` holds: what the run is, before any shard is known."""

    source: str
    ops: list[str]
    requested_shard_size: int
    shard_size: int
    run: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "input": self.source,
            "ops": self.ops,
            "requested_shard_size": self.requested_shard_size,
            "shard_size": self.shard_size,
            "run": self.run,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanHeader:
        return cls(
            str(data["input"]),
            list(data["ops"]),
            int(data["requested_shard_size"]),
            int(data["shard_size"]),
            str(data["run"]),
        )


def lock_output(out_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the output folder for the life of the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    handle = open(out_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(f"another `voxmill extract` is running on {out_dir}") from None
    return handle


def run_id(out_dir: Path, source: Path, ops: Sequence[str], shard_size: int) -> str:
    """The run's name on the broker: its output folder and what it extracts, so no two runs share one."""
    text = json.dumps([str(out_dir.resolve()), str(source), list(ops), shard_size])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def different_run(out_dir: Path) -> RunError:
    return RunError(
        f"{out_dir} holds a run of a different corpus, ops or shard size; "
        "use another --out folder, or delete this one to start over"
    )


class Planner:
    """Plans a run in a thread: reads the listing, writes (or, resuming, checks) its chunks.

    `wait_for(shards)` blocks until that many shards are planned (or the plan is done); `error`
    is the `RunError` that ended the planning, if any (a listing problem, another run's plan).
    """

    def __init__(
        self,
        source: Path,
        out_dir: Path,
        ops: Sequence[str],
        shard_size: int,
        settings: Settings,
        workers: int | None,
    ) -> None:
        requested = shard_size or settings.shard_size
        check_ops(ops, requested)
        self.source = source
        self.out_dir = out_dir
        self.folder = out_dir / PLAN_DIR
        self.ops = list(ops)
        self.requested = requested
        self.fixed_size = shard_size
        self.workers = workers
        self.header: PlanHeader | None = self._existing_header()
        self.planned = 0  # shards whose chunk is on disk
        self.utterances = 0
        self.listed_audio_s: float | None = None
        self.fingerprint = ""
        self.done = False
        self.error: RunError | None = None
        self._buffered: list[Utterance] = []  # read ahead to choose the shard size
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._plan, name="voxmill-planner", daemon=True)

    def _existing_header(self) -> PlanHeader | None:
        if (self.out_dir / OLD_PLAN_FILE).exists():
            raise RunError(
                f"{self.out_dir} holds a run of an earlier voxmill (plan.json); finish it with that "
                "version, or delete the folder to start over"
            )
        header_file = self.folder / HEADER_FILE
        if not header_file.exists():
            return None
        header = PlanHeader.from_dict(json.loads(header_file.read_text()))
        if header.ops != self.ops or header.requested_shard_size != self.requested:
            raise different_run(self.out_dir)
        return header

    def start(self) -> Planner:
        self._thread.start()
        return self

    def wait_for(self, shards: int, timeout_s: float) -> None:
        """Until `shards` shards are planned, the plan is done, or `timeout_s` passed."""
        with self._changed:
            self._changed.wait_for(lambda: self.planned >= shards or self.done, timeout_s)

    def join(self) -> None:
        self._thread.join()

    # -- the planning thread -------------------------------------------------------------------
    def _plan(self) -> None:
        try:
            self._read_and_write()
        except RunError as exc:
            self.error = exc
        except CorpusError as exc:
            self.error = RunError(exc.message)
        except VoxmillError as exc:  # output_error writing a chunk
            self.error = RunError(exc.message)
        except OSError as exc:
            self.error = RunError(f"cannot write the plan in {self.folder}: {exc.strerror or exc}")
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def _read_and_write(self) -> None:
        listing = CorpusListing(self.source)
        utts = iter(listing)
        header = self.header or self._new_header(utts)
        cutter = ShardCutter(header.shard_size)
        chunk: list[list[Utterance]] = []
        # What the outputs depend on: not the folder (nor the run's name, made from it).
        essentials = {k: v for k, v in header.to_dict().items() if k != "run"}
        fingerprint = hashlib.sha256(json.dumps(essentials, sort_keys=True).encode())
        listed_s = 0.0
        for utt in _chain(self._buffered, utts):
            listed_s += utt.duration_s or 0.0
            shard = cutter.add(utt)
            if shard is not None:
                chunk.append(shard)
                if len(chunk) == SHARDS_PER_CHUNK:
                    self._write_chunk(header, chunk, fingerprint)
                    chunk = []
        last = cutter.rest()
        if last is not None:
            chunk.append(last)
        if chunk:
            self._write_chunk(header, chunk, fingerprint)
        listing.raise_problems()
        if listing.count == 0:
            raise RunError(f"{self.source} holds no utterances")
        self.utterances = listing.count
        self.listed_audio_s = listed_s if listing.durations_listed else None
        self.fingerprint = fingerprint.hexdigest()
        self._write_complete()

    def _new_header(self, utts: Iterator[Utterance]) -> PlanHeader:
        """The shard size: fixed, or (automatic) the settings', fewer when the whole corpus is so
        small that the workers would get fewer than six shards each (read ahead to know)."""
        size = self.fixed_size or self.requested
        if not self.fixed_size and self.workers:
            enough = self.workers * SHARDS_PER_WORKER * self.requested
            for utt in utts:
                self._buffered.append(utt)
                if len(self._buffered) >= enough:
                    break
            if len(self._buffered) < enough:
                size = auto_shard_size(len(self._buffered), self.workers, self.requested, SHARDS_PER_WORKER)
        header = PlanHeader(
            str(self.source),
            self.ops,
            self.requested,
            size,
            run_id(self.out_dir, self.source, self.ops, self.requested),
        )
        from pipeline.writers import write_text

        write_text(self.folder / HEADER_FILE, json.dumps(header.to_dict(), indent=1) + "\n")
        self.header = header
        return header

    def _write_chunk(self, header: PlanHeader, shards: list[list[Utterance]], fingerprint: Any) -> None:
        first = self.planned
        digests = [shard_digest(utts) for utts in shards]
        for digest in digests:
            fingerprint.update(digest.encode())
        path = self.folder / chunk_name(first // SHARDS_PER_CHUNK)
        if path.exists():
            if read_chunk_digests(path) != digests:
                raise different_run(self.out_dir)
        else:
            write_chunk(path, first, shards, digests)
        with self._changed:
            self.planned = first + len(shards)
            self._changed.notify_all()

    def _write_complete(self) -> None:
        from pipeline.writers import write_text

        record = {
            "shards": self.planned,
            "utterances": self.utterances,
            "listed_audio_seconds": self.listed_audio_s,
            "fingerprint": self.fingerprint,
        }
        path = self.folder / COMPLETE_FILE
        if path.exists():
            if json.loads(path.read_text()).get("fingerprint") != self.fingerprint:
                raise different_run(self.out_dir)
            return
        write_text(path, json.dumps(record, indent=1) + "\n")


def _chain(first: list[Utterance], rest: Iterator[Utterance]) -> Iterator[Utterance]:
    yield from first
    yield from rest


def chunk_name(number: int) -> str:
    return f"chunk-{number:06d}.parquet"


def write_chunk(path: Path, first_shard: int, shards: list[list[Utterance]], digests: list[str]) -> None:
    import pyarrow as pa

    from pipeline.writers import write_parquet

    rows = [(first_shard + i, u) for i, utts in enumerate(shards) for u in utts]
    table = pa.table(
        {
            "shard": pa.array([shard for shard, _ in rows], pa.int32()),
            "utt": pa.array([u.utt for _, u in rows], pa.string()),
            "path": pa.array([u.path for _, u in rows], pa.string()),
            "spk": pa.array([u.spk for _, u in rows], pa.string()),
            "text": pa.array([u.text for _, u in rows], pa.string()),
            "duration_s": pa.array([u.duration_s for _, u in rows], pa.float64()),
        }
    )
    write_parquet(path, table.replace_schema_metadata({DIGESTS_KEY: json.dumps(digests).encode()}))


def read_chunk_digests(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    return list(json.loads(metadata.get(DIGESTS_KEY, b"[]")))


def read_chunk(path: Path) -> Iterator[tuple[int, list[Utterance]]]:
    """(shard, utterances) of one chunk file, in shard order."""
    import pyarrow.parquet as pq

    columns = pq.read_table(path).to_pydict()
    current, utts = -1, list[Utterance]()
    for shard, utt, audio, spk, text, seconds in zip(
        columns["shard"],
        columns["utt"],
        columns["path"],
        columns["spk"],
        columns["text"],
        columns["duration_s"],
        strict=True,
    ):
        if shard != current and utts:
            yield current, utts
            utts = []
        current = shard
        utts.append(Utterance(utt, audio, spk, text, seconds))
    if utts:
        yield current, utts


class PlanReader:
    """The shards of a plan in shard order, read chunk by chunk (one chunk in memory at a time);
    with a running `Planner`, it waits at the frontier for the next chunk."""

    def __init__(self, out_dir: Path, planner: Planner | None = None) -> None:
        self.folder = out_dir / PLAN_DIR
        self.out_dir = out_dir
        self.planner = planner

    def header(self) -> PlanHeader:
        if self.planner is not None and self.planner.header is not None:
            return self.planner.header
        return PlanHeader.from_dict(json.loads((self.folder / HEADER_FILE).read_text()))

    def shards(self) -> Iterator[tuple[int, list[Utterance]]]:
        number = 0
        while True:
            if self.planner is not None:
                self.planner.wait_for((number + 1) * SHARDS_PER_CHUNK, timeout_s=3600)
                if self.planner.error is not None:
                    raise self.planner.error
            path = self.folder / chunk_name(number)
            if not path.exists():
                return
            yield from read_chunk(path)
            number += 1

    def specs(self) -> Iterator[ShardSpec]:
        """Every (shard, op) task of the plan, shard by shard, ops in the plan's order."""
        header = self.header()
        out = str(self.out_dir.resolve())
        for shard, utts in self.shards():
            for op in header.ops:
                yield ShardSpec(shard=shard, op=op, out_dir=out, utts=utts, run=header.run)
