"""The plan of a `voxmill extract` run: its shards, written as the corpus listing streams by.

`DIR/plan/` holds it, in files that are each written once, complete or absent (DIR may be a
prefix in an object store, `s3://bucket/run/`: each file is then one object, one PUT; the names
are `pipeline.outputs.folder.RunFolder`'s):

- `header.json`: the input, the ops, the shard size asked for and the one used, the run's name,
  and the ops its tasks run when not those (`tasks`: both ops as one `extract` task, `task_ops`);
- `chunk-NNNNNN.parquet`: the utterances (shard, utt, path, spk, text, listed duration) of the
  header's `shards_per_chunk` consecutive shards (`SHARDS_PER_CHUNK`; fewer for shards of more
  than 32 utterances, about `CHUNK_UTTERANCES` in all) and, in its metadata, each shard's digest;
- `complete.json`: written once the whole listing was read without a problem: the counts, the
  fingerprint (the header's fields and every shard's digest) and, for a local Kaldi dir or
  manifest, the digest of its files (`pipeline.corpus.digest.listing_digest`): a resume of a complete
  plan whose listing files are unchanged takes the plan as it is, without reading the listing.

A `Planner` works in a thread: it looks at the whole listing first (`pipeline.corpus.check`:
a listing with a problem is refused before any shard is planned, so before any runs), then reads
it, cuts it into shards by count in listing order (`pipeline.corpus.sharding.ShardCutter`; the header's
shard size, chosen once from the first utterances and kept by every resume), and writes chunk
after chunk (the header with the first, side by side in a store: a resume that finds a chunk and
no header plans anew); the driver takes the shards of the chunks written so far (`PlanReader`),
so the first shards go out while the rest of the listing is still being read. Shard k is always
the same utterances for the same listing, so a resume plans again and compares each shard's
digest with the one on disk: a different corpus in the same folder is refused at its first
differing shard; a listing fixed after a late problem resumes.

The only audio opened here is for that shard size, when the listing gives no durations: the
headers of up to 64 files or objects spread over the first utterances (`pipeline.corpus.durations`;
libsndfile, nothing decoded; objects `reads_in_flight` at once), so that a corpus of short clips
without `utt2dur` is cut into shards of about `shard_seconds` of audio too.

A corpus of WebDataset tar shards is planned one shard per tar (the header's `unit` is `tar`):
a tar's utterances are known only once a worker reads it, so its plan entry names the tar, and
progress counts tars until their utterances are known.

The output folder's lock is `pipeline.run.lock`'s.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pipeline.corpus.digest import listing_digest
from pipeline.corpus.listing import CorpusError, CorpusListing
from pipeline.corpus.reading import Source, as_source
from pipeline.corpus.sharding import (
    ShardCutter,
    auto_shard_size,
    check_ops,
    shard_digest,
    shard_size_for_durations,
)
from pipeline.errors import RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.records import ShardSpec, Utterance
from pipeline.settings import Settings
from pipeline.storage.locations import OutputLocation

UNIT_TAR = "tar"
UNIT_UTTERANCE = "utterance"
PLAN_VERSION = 2
SHARDS_PER_CHUNK = 256
CHUNK_UTTERANCES = 8192  # what the planner, and the driver reading the plan, hold of it at a time
DIGESTS_KEY = b"voxmill.shard_digests"
SHARDS_PER_WORKER = 6  # a small corpus is cut so that every worker process gets this many shards
DURATION_SAMPLE = 1000  # the first utterances, whose mean duration sizes the shards (shard_seconds)
MAX_SHARD_SIZE = 4096


@dataclass(frozen=True)
class PlanHeader:
    """What `header.json` holds: what the run is, before any shard is known."""

    source: str
    ops: list[str]
    requested_shard_size: int
    shard_size: int
    run: str
    unit: str = UNIT_UTTERANCE  # what a shard is made of: utterances, or one tar
    tasks: list[str] | None = None  # the ops the shard tasks run, when not `ops` (`task_ops`)
    shards_per_chunk: int = SHARDS_PER_CHUNK

    @property
    def tars(self) -> bool:
        return self.unit == UNIT_TAR

    @property
    def task_ops(self) -> list[str]:
        return self.tasks or self.ops

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": PLAN_VERSION,
            "input": self.source,
            "ops": self.ops,
            "requested_shard_size": self.requested_shard_size,
            "shard_size": self.shard_size,
            "run": self.run,
        }
        if self.tars:  # an utterance plan's header (and fingerprint) is what it always was
            data["unit"] = self.unit
        if self.tasks and self.tasks != self.ops:
            data["tasks"] = self.tasks
        if self.shards_per_chunk != SHARDS_PER_CHUNK:
            data["shards_per_chunk"] = self.shards_per_chunk
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanHeader:
        return cls(
            str(data["input"]),
            list(data["ops"]),
            int(data["requested_shard_size"]),
            int(data["shard_size"]),
            str(data["run"]),
            str(data.get("unit") or UNIT_UTTERANCE),
            list(data["tasks"]) if data.get("tasks") else None,
            int(data.get("shards_per_chunk") or SHARDS_PER_CHUNK),
        )


def task_ops(ops: Sequence[str], workers_serve_extract: bool) -> list[str]:
    """The ops a run's shard tasks run: tokenize and embed together as one `extract` task (each
    clip decoded once, not twice) when every worker that would take them serves `extract`."""
    both = sorted(ops) == ["embed", "tokenize"]
    return ["extract"] if both and workers_serve_extract else list(ops)


def run_id(out_dir: RunFolder, source: Source, ops: Sequence[str], shard_size: int) -> str:
    """The run's name on the broker: its output folder and what it extracts, so no two runs share one."""
    text = json.dumps([out_dir.name, str(source), list(ops), shard_size])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def different_run(out_dir: RunFolder) -> RunError:
    return RunError(
        f"{out_dir.display()} holds a run of a different corpus, ops or shard size; "
        "use another --out folder, or delete this one to start over"
    )


@dataclass(frozen=True)
class PlanProgress:
    """The planner's progress at one moment (`Planner.progress`)."""

    header: PlanHeader | None  # the run's name and source once written; None before
    ops: tuple[str, ...]  # the ops its shard tasks run
    planned: int  # shards planned so far, each with every op
    done: bool  # the whole listing is planned (or planning stopped)
    utterances: int  # utterances in the listing, once `done`
    listed_audio_s: float | None  # their audio, when the listing gives durations
    error: RunError | None = None  # what stopped the planning, if anything did


class Planner:
    """Plans a run in a thread: reads the listing, writes (or, resuming, checks) its chunks.

    `wait_for(shards)` blocks until that many shards are planned (or the plan is done); `error`
    is the `RunError` that ended the planning, if any (a listing problem, another run's plan).
    """

    def __init__(
        self,
        source: Source,
        out_dir: RunFolder,
        ops: Sequence[str],
        shard_size: int,
        settings: Settings,
        workers: int | None,
        tasks: Sequence[str] | None = None,
        before_writing: Callable[[], None] = lambda: None,
        entries: set[str] | None = None,
    ) -> None:
        requested = shard_size or settings.shard_size
        check_ops(ops, requested)
        self.source = as_source(source)
        self.out_dir = out_dir
        self.out = out_dir.location
        self.requested_ops = list(ops)  # what the run is asked for: the report's ops, the resume check
        self.ops = list(tasks or ops)  # what its shard tasks run (a resume: what the plan says)
        self.requested = requested
        self.fixed_size = shard_size
        self.shard_seconds = settings.shard_seconds
        self.limits = settings.audio_limits
        self.reads_in_flight = settings.reads_in_flight
        self.max_text_chars = settings.max_text_chars
        self.workers = workers
        self.before_writing = before_writing  # called before each write: the output's lock is sure
        self.header: PlanHeader | None = self._existing_header(entries)
        self.resumed = self.header is not None  # else no chunk or complete.json to look for
        self.planned = 0  # shards whose chunk is on disk
        self.utterances = 0
        self.listed_audio_s: float | None = None
        self.fingerprint = ""
        self.done = False
        self.error: RunError | None = None
        self._buffered: list[Utterance] = []  # read ahead to choose the shard size
        self._unwritten_header: str | None = None  # a new plan's, written with its first chunk
        # The last chunk written, as (number, its shards): the driver takes the first shards, and
        # the merge a small plan, without reading back what was just written (a GET in a store).
        self._latest: tuple[int, list[tuple[int, list[Utterance]]]] | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._plan, name="voxmill-planner", daemon=True)

    def _existing_header(self, entries: set[str] | None) -> PlanHeader | None:
        """The plan's header, if the folder holds one; `entries`: the folder's listing, if just read
        (one listing, a request in a store, says whether to look further)."""
        found = self.out.entries("") if entries is None else entries
        if RunFolder.OLD_PLAN in found:
            raise RunError(
                f"{self.out_dir.display()} holds a run of an earlier voxmill (plan.json); finish it with "
                "that version, or delete the folder to start over"
            )
        if f"{RunFolder.PLAN}/" not in found or not self.out.exists(RunFolder.PLAN_HEADER):
            return None
        header = PlanHeader.from_dict(json.loads(self.out.read_bytes(RunFolder.PLAN_HEADER)))
        if header.ops != self.requested_ops or header.requested_shard_size != self.requested:
            raise different_run(self.out_dir)
        self.ops = header.task_ops
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

    def latest_chunk(self, number: int) -> list[tuple[int, list[Utterance]]] | None:
        """The (shard, utterances) of chunk `number` when it is the last one written; else None."""
        with self._changed:
            latest = self._latest
        return latest[1] if latest is not None and latest[0] == number else None

    def progress(self) -> PlanProgress:
        """What the plan holds now, as a snapshot (the planning thread goes on changing this)."""
        with self._changed:
            return PlanProgress(
                header=self.header,
                ops=tuple(self.ops),
                planned=self.planned,
                done=self.done,
                utterances=self.utterances,
                listed_audio_s=self.listed_audio_s,
                error=self.error,
            )

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
            plan = self.out_dir.display(RunFolder.PLAN)
            self.error = RunError(f"cannot write the plan in {plan}: {exc.strerror or exc}")
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def _read_and_write(self) -> None:
        digest = listing_digest(self.source)  # before reading: a change meanwhile shows next time
        if self.header is not None and digest is not None and self._adopt_finished_plan(digest):
            return
        from pipeline.corpus.check import check_listing  # numpy: imported once the workers are spawned

        check_listing(self.source, self.max_text_chars)  # every problem, before the first shard is planned
        listing = CorpusListing(self.source, max_text_chars=self.max_text_chars)
        utts = iter(listing)
        header = self.header or self._new_header(utts, listing.tars)
        if header.tars != listing.tars:
            raise different_run(self.out_dir)
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
                if len(chunk) == header.shards_per_chunk:
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
        self._write_complete(digest)

    def _adopt_finished_plan(self, digest: str) -> bool:
        """A resume whose plan is complete and whose listing files are those it was planned from:
        take the plan's counts as they are, without reading the listing again."""
        if not self.out.exists(RunFolder.PLAN_COMPLETE):
            return False
        record = json.loads(self.out.read_bytes(RunFolder.PLAN_COMPLETE))
        if record.get("listing_digest") != digest:
            return False
        self.utterances = int(record["utterances"])
        self.listed_audio_s = record.get("listed_audio_seconds")
        self.fingerprint = str(record["fingerprint"])
        with self._changed:
            self.planned = int(record["shards"])
            self._changed.notify_all()
        return True

    def _new_header(self, utts: Iterator[Utterance], tars: bool) -> PlanHeader:
        """The shard size: fixed, or (automatic) the settings', more for short clips (`shard_seconds`
        of audio, judged from the first utterances' listed durations, else their local files'
        headers), fewer when the whole corpus is so small that the workers would get fewer than
        six shards each (read ahead to know). A tar corpus: one tar per shard."""
        size = 1 if tars else self.fixed_size or self.requested
        if not tars and not self.fixed_size:
            size = self._size_for_durations(utts)
            if self.workers:
                enough = self.workers * SHARDS_PER_WORKER * size
                if not self._read_ahead(utts, enough):
                    size = auto_shard_size(len(self._buffered), self.workers, size, SHARDS_PER_WORKER)
        header = PlanHeader(
            str(self.source),
            self.requested_ops,
            self.requested,
            size,
            run_id(self.out_dir, self.source, self.requested_ops, self.requested),
            UNIT_TAR if tars else UNIT_UTTERANCE,
            self.ops,
            max(1, min(SHARDS_PER_CHUNK, CHUNK_UTTERANCES // size)),
        )
        self._unwritten_header = json.dumps(header.to_dict(), indent=1) + "\n"
        self.header = header
        return header

    def _size_for_durations(self, utts: Iterator[Utterance]) -> int:
        # soundfile and numpy: imported when a run plans, not by every command that imports this
        from pipeline.corpus.durations import headers_mean, listed_mean

        self._read_ahead(utts, DURATION_SAMPLE)
        mean_s = listed_mean(self._buffered)
        if mean_s is None and self.shard_seconds > 0:
            # Nothing listed: a sample of the files' headers (objects read a few at once).
            mean_s = headers_mean(self._buffered, self.limits, self.reads_in_flight)
        if mean_s is None:
            return self.requested
        return shard_size_for_durations(mean_s, self.requested, self.shard_seconds, MAX_SHARD_SIZE)

    def _read_ahead(self, utts: Iterator[Utterance], count: int) -> bool:
        """Buffer the listing up to `count` utterances; False when it ended before."""
        while len(self._buffered) < count:
            utt = next(utts, None)
            if utt is None:
                return False
            self._buffered.append(utt)
        return True

    def _write_chunk(self, header: PlanHeader, shards: list[list[Utterance]], fingerprint: Any) -> None:
        first = self.planned
        digests = [shard_digest(utts) for utts in shards]
        for digest in digests:
            fingerprint.update(digest.encode())
        number = first // header.shards_per_chunk
        name = RunFolder.chunk_file(number)
        if self.resumed and self.out.exists(name):
            if read_chunk_digests(self.out, name) != digests:
                raise different_run(self.out_dir)
        else:
            self.before_writing()
            self._with_header(lambda: write_chunk(self.out, name, first, shards, digests))
        with self._changed:
            self._latest = (number, [(first + i, utts) for i, utts in enumerate(shards)])
            self.planned = first + len(shards)
            self._changed.notify_all()

    def _with_header(self, write: Callable[[], None]) -> None:
        """`write`, and the header if it is not written yet: first on a disk, beside it in a store
        (two PUTs in the time of one)."""
        from pipeline.outputs.writers import write_text_at

        text, self._unwritten_header = self._unwritten_header, None
        if text is None:
            write()
        elif self.out_dir.is_local:
            write_text_at(self.out, RunFolder.PLAN_HEADER, text)
            write()
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="voxmill-plan") as pool:
                header = pool.submit(write_text_at, self.out, RunFolder.PLAN_HEADER, text)
                write()
                header.result()

    def _write_complete(self, listing_digest: str | None) -> None:
        """`complete.json`; on a resume, the check that the listing planned the same (its record of
        the listing's files is brought up to date: the listing was just read in full)."""
        from pipeline.outputs.writers import write_text_at

        record = {
            "shards": self.planned,
            "utterances": self.utterances,
            "listed_audio_seconds": self.listed_audio_s,
            "fingerprint": self.fingerprint,
        }
        if listing_digest is not None:
            record["listing_digest"] = listing_digest
        if self.resumed and self.out.exists(RunFolder.PLAN_COMPLETE):
            found = json.loads(self.out.read_bytes(RunFolder.PLAN_COMPLETE))
            if found.get("fingerprint") != self.fingerprint:
                raise different_run(self.out_dir)
            if found.get("listing_digest") == listing_digest:
                return
        self.before_writing()
        write_text_at(self.out, RunFolder.PLAN_COMPLETE, json.dumps(record, indent=1) + "\n")


def _chain(first: list[Utterance], rest: Iterator[Utterance]) -> Iterator[Utterance]:
    yield from first
    yield from rest


def write_chunk(
    out: OutputLocation, name: str, first_shard: int, shards: list[list[Utterance]], digests: list[str]
) -> None:
    import pyarrow as pa

    from pipeline.outputs.writers import write_table_at

    rows = [(first_shard + i, u) for i, utts in enumerate(shards) for u in utts]
    table = pa.table(
        {
            "shard": pa.array([shard for shard, _ in rows], pa.int32()),
            "utt": pa.array([u.utt for _, u in rows], pa.string()),
            "path": pa.array([u.path for _, u in rows], pa.string()),
            "spk": pa.array([u.spk for _, u in rows], pa.string()),
            "text": pa.array([u.text for _, u in rows], pa.string()),
            "duration_s": pa.array([u.duration_s for _, u in rows], pa.float64()),
            # A segment of a recording (Kaldi segments, lhotse): null for a whole file.
            "start_s": pa.array([u.start_s for _, u in rows], pa.float64()),
            "end_s": pa.array([u.end_s for _, u in rows], pa.float64()),
            "channel": pa.array([u.channel for _, u in rows], pa.int32()),
        }
    )
    write_table_at(out, name, table.replace_schema_metadata({DIGESTS_KEY: json.dumps(digests).encode()}))


def _parquet_source(out: OutputLocation, name: str) -> Any:
    """What pyarrow reads: the local path, or the object's bytes (one GET)."""
    import pyarrow as pa

    if out.is_local:
        return out.ref(name)
    return pa.BufferReader(out.read_bytes(name))


def read_chunk_digests(out: OutputLocation, name: str) -> list[str]:
    import pyarrow.parquet as pq

    metadata = pq.read_schema(_parquet_source(out, name)).metadata or {}
    return list(json.loads(metadata.get(DIGESTS_KEY, b"[]")))


def read_chunk(out: OutputLocation, name: str) -> Iterator[tuple[int, list[Utterance]]]:
    """(shard, utterances) of one chunk file, in shard order (a chunk written before segments
    existed has no segment columns: its utterances are whole files)."""
    import pyarrow.parquet as pq

    columns = pq.read_table(_parquet_source(out, name)).to_pydict()
    count = len(columns["shard"])
    nothing: list[Any] = [None] * count
    current, utts = -1, list[Utterance]()
    for shard, utt, audio, spk, text, seconds, start, end, channel in zip(
        columns["shard"],
        columns["utt"],
        columns["path"],
        columns["spk"],
        columns["text"],
        columns["duration_s"],
        columns.get("start_s", nothing),
        columns.get("end_s", nothing),
        columns.get("channel", nothing),
        strict=True,
    ):
        if shard != current and utts:
            yield current, utts
            utts = []
        current = shard
        utts.append(Utterance(utt, audio, spk, text, seconds, start, end, channel))
    if utts:
        yield current, utts


class PlanReader:
    """The shards of a plan in shard order, read chunk by chunk (one chunk in memory at a time);
    with a running `Planner`, it waits at the frontier for the next chunk, and takes the last one
    written from it."""

    def __init__(self, out_dir: RunFolder, planner: Planner | None = None) -> None:
        self.out_dir = out_dir
        self.out = out_dir.location
        self.planner = planner

    def header(self) -> PlanHeader:
        if self.planner is not None and self.planner.header is not None:
            return self.planner.header
        return PlanHeader.from_dict(json.loads(self.out.read_bytes(RunFolder.PLAN_HEADER)))

    def shards(self) -> Iterator[tuple[int, list[Utterance]]]:
        number, per_chunk = 0, self.header().shards_per_chunk
        while True:
            if self.planner is not None:  # a chunk is written whole: its first shard planned, it is
                self.planner.wait_for(number * per_chunk + 1, timeout_s=3600)  # (not the plan's end)
                if self.planner.error is not None:
                    raise self.planner.error
            name = RunFolder.chunk_file(number)
            held = None
            if self.planner is not None:  # it knows which chunks are written: no request to look
                if self.planner.planned <= number * per_chunk:
                    return
                held = self.planner.latest_chunk(number)
            elif not self.out.exists(name):
                return
            yield from read_chunk(self.out, name) if held is None else held
            number += 1

    def specs(self) -> Iterator[ShardSpec]:
        """Every (shard, op) task of the plan, shard by shard, ops in the plan's order. A tar
        shard's spec names its tar and no utterances."""
        header = self.header()
        out = self.out_dir.name
        for shard, utts in self.shards():
            for op in header.task_ops:
                if header.tars:
                    yield ShardSpec(shard=shard, op=op, out_dir=out, run=header.run, tar=utts[0].path)
                else:
                    yield ShardSpec(shard=shard, op=op, out_dir=out, utts=utts, run=header.run)
