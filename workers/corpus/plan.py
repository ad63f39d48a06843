"""The plan of a `voxmill extract` run: its shards, fixed for the run, in `plan.json`.

`load_or_make_plan` is the one way to a plan: a resume reuses the plan of the same corpus, ops
and shard size; a folder holding another run's plan is refused; otherwise the durations are
probed (file headers, nothing decoded), the shards cut and `plan.json` written. Light on purpose
(no Celery, no Arrow, no audio code until durations are probed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from pipeline.corpus import auto_shard_size, plan_fingerprint, plan_shards, probe_durations, read_corpus
from pipeline.errors import VoxmillError
from pipeline.records import ShardSpec, Utterance
from pipeline.settings import Settings

PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
PLAN_VERSION = 1


class RunError(Exception):
    """The run cannot go on (bad input, output not writable, a different run in the folder)."""


@dataclass
class Plan:
    """What `plan.json` holds. `run` names the run on the broker (its shards' announcements)."""

    fingerprint: str
    source: str
    ops: list[str]
    shard_size: int
    specs: list[ShardSpec]
    order: list[str] = field(default_factory=list)
    run: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "input": self.source,
            "ops": self.ops,
            "shard_size": self.shard_size,
            "run": self.run,
            "order": self.order,
            "shards": [spec.to_dict() for spec in self.specs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            fingerprint=data["fingerprint"],
            source=data["input"],
            ops=list(data["ops"]),
            shard_size=int(data["shard_size"]),
            specs=[ShardSpec.from_dict(s) for s in data["shards"]],
            order=list(data.get("order", [])),
            run=str(data.get("run") or ""),
        )

    def utterances(self) -> list[Utterance]:
        seen: dict[str, Utterance] = {}
        for spec in self.specs:
            for utt in spec.utts:
                seen.setdefault(utt.utt, utt)
        return list(seen.values())


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


def read_utterances(source: Path) -> list[Utterance]:
    """The corpus at `source` (`RunError` when it is unreadable or empty)."""
    try:
        utts = read_corpus(source)
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    if not utts:
        raise RunError(f"{source} holds no utterances")
    return utts


def run_id(out_dir: Path, fingerprint: str) -> str:
    """The run's name on the broker: its output folder and corpus, so no two runs share one."""
    return hashlib.sha256(f"{out_dir.resolve()}\n{fingerprint}".encode()).hexdigest()[:16]


def load_or_make_plan(
    utts: list[Utterance],
    source: Path,
    out_dir: Path,
    ops: Sequence[str],
    shard_size: int,
    settings: Settings,
    workers: int | None = None,
) -> Plan:
    """The plan in `out_dir` when it describes this run (a resume), else a new one, written.

    `RunError` when `out_dir` holds another run's plan. `shard_size` 0 is automatic:
    `settings.shard_size`, or smaller so that `workers` processes (when known) get several shards
    each (`auto_shard_size`). The fingerprint uses the requested shard size (the settings' for
    automatic), so a resume reuses the plan whatever the number of workers.
    """
    fingerprint = plan_fingerprint(utts, ops, shard_size or settings.shard_size)
    plan_file = out_dir / PLAN_FILE
    if plan_file.exists():
        existing = Plan.from_dict(json.loads(plan_file.read_text()))
        if existing.fingerprint != fingerprint:
            raise RunError(
                f"{out_dir} holds a run of a different corpus, ops or shard size; "
                "use another --out folder, or delete this one to start over"
            )
        run = run_id(out_dir, fingerprint)  # plans written before runs were named get one too
        existing.specs = [replace(spec, run=run) for spec in existing.specs]
        existing.run = run
        return existing
    size = shard_size
    if not size:
        size = auto_shard_size(len(utts), workers, settings.shard_size) if workers else settings.shard_size
    from pipeline.writers import write_text  # Arrow: imported once the workers are on their way

    run = run_id(out_dir, fingerprint)
    timed = probe_durations(utts, settings.audio_limits)
    specs = [replace(spec, run=run) for spec in plan_shards(timed, ops, str(out_dir.resolve()), size)]
    plan = Plan(fingerprint, str(source), list(ops), size, specs, [u.utt for u in utts], run)
    try:
        write_text(plan_file, json.dumps(plan.to_dict()))
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    return plan
