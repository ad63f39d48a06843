"""A run's output folder: one record, built once from `--out`, that owns every name in it.

`RunFolder.of(out)` takes a local folder or an object-store prefix (`s3://bucket/run`, `gs://...`)
and is the only place a `--out` value is read. The folder's files, by name inside it:

    plan/header.json, plan/chunk-NNNNNN.parquet, plan/complete.json   the plan (`pipeline.run.plan`)
    shards/{op}-{shard:06d}.parquet            a finished shard (`pipeline.outputs.writers`)
    shards/{op}-{shard:06d}.given-up.parquet   a shard the driver gave up on
    speech_tokens.parquet, utt_embeddings.parquet, spk_embeddings.parquet, utt_stats.parquet,
    errors.jsonl, report.json (written last)   the merged outputs (`pipeline.outputs.merge`)
    audit.json                                 `voxmill audit`
    .lock, workers.log                         the run's flock and an embedded run's workers' log
    .lock.json                                 in a store: the lock's marker object

A store has no flock and no log file of this machine: there `.lock` and `workers.log` are in the
run's local state folder (`local_state`). A `RunFolder` knows names and where they are; reading
and writing is its `location`'s (`pipeline.storage.locations.OutputLocation`).

>>> folder = RunFolder.of("s3://bucket/runs/./1/")
>>> folder.name, folder.ref(folder.shard_file("embed", 12))
('s3://bucket/runs/1', 's3://bucket/runs/1/shards/embed-000012.parquet')
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.storage.locations import LocalFolder, OutputLocation, output_location
from pipeline.storage.urls import mend_url


@dataclass(frozen=True)
class RunFolder:
    """The output folder of a `voxmill extract` run: where it is, what it is called, its files.

    `name`: the resolved path or the normalised URL, the run's identity (a run's name on the
    broker is made of it; a shard spec's `out_dir` is it). `given`: `--out` as given (a URL that
    went through `Path()` mended), what messages show.
    """

    location: OutputLocation
    name: str
    given: str

    # Every name in the folder, '/'-separated from its top (class constants, not fields).
    PLAN = "plan"
    PLAN_HEADER = "plan/header.json"
    PLAN_COMPLETE = "plan/complete.json"
    OLD_PLAN = "plan.json"  # a plan of voxmill before chunked plans
    SHARDS = "shards"
    GIVEN_UP_SUFFIX = ".given-up.parquet"
    SPEECH_TOKENS = "speech_tokens.parquet"
    UTT_EMBEDDINGS = "utt_embeddings.parquet"
    SPK_EMBEDDINGS = "spk_embeddings.parquet"
    UTT_STATS = "utt_stats.parquet"
    ERRORS = "errors.jsonl"
    REPORT = "report.json"
    AUDIT = "audit.json"
    LOCK = ".lock"
    STORE_LOCK = ".lock.json"
    WORKERS_LOG = "workers.log"

    @classmethod
    def of(cls, out: str | os.PathLike[str]) -> RunFolder:
        """The folder of a `--out` value: a URL (`s3://`, `gs://`; `bad_request` for any other
        scheme) or a local folder."""
        mended = mend_url(out)  # a URL given as a Path (`s3:/bucket/run`) is a URL again
        location = output_location(mended)
        if isinstance(location, LocalFolder):
            return cls(location, str(location.root.resolve()), str(mended))
        return cls(location, str(location.url), str(mended))

    @property
    def is_local(self) -> bool:
        return self.location.is_local

    def ref(self, name: str) -> Path | str:
        """Where the file `name` is: a path, or a URL."""
        return self.location.ref(name)

    def display(self, name: str = "") -> str:
        """The folder as given, or one of its files, for a message."""
        return self.location.display(name) if name else self.given

    # -- names -----------------------------------------------------------------------------------
    @staticmethod
    def chunk_file(number: int) -> str:
        return f"{RunFolder.PLAN}/chunk-{number:06d}.parquet"

    @staticmethod
    def shard_file(op: str, shard: int) -> str:
        """The file of a finished shard: `shards/{op}-{shard:06d}.parquet`."""
        return f"{RunFolder.SHARDS}/{op}-{shard:06d}.parquet"

    @staticmethod
    def given_up_file(op: str, shard: int) -> str:
        """The file of a shard the driver gave up on: `shards/{op}-{shard:06d}.given-up.parquet`."""
        return f"{RunFolder.SHARDS}/{op}-{shard:06d}{RunFolder.GIVEN_UP_SUFFIX}"

    @staticmethod
    def is_given_up(name: str) -> bool:
        return name.endswith(RunFolder.GIVEN_UP_SUFFIX)

    def shard_files(self) -> set[str]:
        """The names of the shard files there now (given-up ones too): one listing of `shards/`."""
        found = self.location.names(self.SHARDS)
        return {f"{self.SHARDS}/{name}" for name in found if name.endswith(".parquet")}

    # -- what stays on this machine ----------------------------------------------------------------
    def local_state(self, state_dir: Path) -> Path:
        """Where the run keeps what must stay local (its flock, an embedded run's `workers.log`):
        the folder itself, or for a store, `state_dir/<hash of the name>` (one per output URL)."""
        if isinstance(self.location, LocalFolder):
            return self.location.root
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:16]
        return Path(state_dir).absolute() / digest

    def lock_file(self, state_dir: Path) -> Path:
        return self.local_state(state_dir) / self.LOCK

    def workers_log(self, state_dir: Path) -> Path:
        return self.local_state(state_dir) / self.WORKERS_LOG
