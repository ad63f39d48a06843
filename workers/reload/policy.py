"""The reload decision of one worker process: pure, given what it serves and what Redis says.

`decide(view)` looks at each role the process serves: the sha256 it serves, the generation the
watchers published, the candidate this machine's watcher is validating, this machine's model
file and the last failure, and says what to do now:

- `Adopt`: the published generation is what the process already serves (note its number);
- `AwaitVerdict`: the watcher is validating a new candidate; hold the role's reload slot (and,
  for a large model, stand aside) so the validation, then this process's load, get a core;
- `Load`: load this machine's file beside the serving session and swap (with the published
  sha256 expected, or, for a process holding nothing, its own file as it is);
- `Refuse`: this machine's file cannot be the published one (missing, another size); wait
  until it changes.

No step for a role: nothing to do. `ReloadCoordinator` (`workers.reload.coordinator`) carries
the steps out against Redis and the holder; the times here are monotonic seconds passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipeline.models.identity import FileIdentity


@dataclass(frozen=True)
class Published:
    """A role's published generation: the sha256 every worker must serve, its number and size."""

    sha256: str
    generation: int
    size: int | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> Published | None:
        """From a generation record in Redis (`workers.reload.generations`); None when empty."""
        if not record.get("sha256"):
            return None
        size = record.get("size")
        return cls(record["sha256"], int(record.get("generation") or 0), int(size) if size else None)


@dataclass(frozen=True)
class Candidate:
    """A file this machine's watcher is validating for a role (sha256 '' until it is hashed)."""

    sha256: str
    size: int


@dataclass(frozen=True)
class ReloadFailure:
    """Why this process did not load a published generation, and when it tries again."""

    sha256: str
    generation: int
    identity: FileIdentity | None
    reason: str
    attempts: int
    retry_at: float  # monotonic seconds; inf: when the file changes
    time: float  # epoch seconds, for people

    def to_dict(self) -> dict[str, object]:
        return {
            "sha256": self.sha256,
            "generation": self.generation,
            "reason": self.reason,
            "attempts": self.attempts,
            "time": round(self.time, 3),
        }


@dataclass(frozen=True)
class RoleState:
    """What one role looks like from this process."""

    role: str
    serving: str | None  # the sha256 this process serves; None: nothing loaded
    published: Published | None
    candidate: Candidate | None
    local: FileIdentity | None  # this machine's model file for the role
    failure: ReloadFailure | None = None


@dataclass(frozen=True)
class ReloadView:
    """Everything a decision looks at. `peers`: live processes on this machine serving each role
    (this one included)."""

    roles: tuple[RoleState, ...]
    peers: Mapping[str, int]
    aside_min_bytes: float
    now: float


@dataclass(frozen=True)
class Adopt:
    role: str
    generation: int


@dataclass(frozen=True)
class AwaitVerdict:
    role: str
    stand_aside: bool


@dataclass(frozen=True)
class Load:
    role: str
    file: FileIdentity
    sha256: str  # the published sha256 ('' when none is)
    generation: int
    expected_sha256: str | None  # what the file must hash to; None: take it as it is
    stand_aside: bool


@dataclass(frozen=True)
class Refuse:
    role: str
    sha256: str
    generation: int
    identity: FileIdentity | None
    reason: str


Step = Adopt | AwaitVerdict | Load | Refuse


def decide(view: ReloadView) -> list[Step]:
    """The steps of one reload round, role by role."""
    # Standing aside leaves the process's roles to the others on this machine: only when there are.
    may_stand_aside = all(view.peers.get(state.role, 1) >= 2 for state in view.roles)

    def aside_for(size: int) -> bool:
        return may_stand_aside and size >= view.aside_min_bytes

    steps: list[Step] = []
    for state in view.roles:
        steps += _role_steps(state, view.now, aside_for)
    return steps


def _role_steps(state: RoleState, now: float, aside_for: Callable[[int], bool]) -> list[Step]:
    steps: list[Step] = []
    candidate = state.candidate
    if state.serving is not None and candidate is not None and candidate.sha256 != state.serving:
        steps.append(AwaitVerdict(state.role, aside_for(candidate.size)))
    published = state.published
    if state.serving is not None and published is None:
        return steps
    if state.serving is not None and published is not None and published.sha256 == state.serving:
        return [Adopt(state.role, published.generation), *steps]
    sha256 = published.sha256 if published else ""
    generation = published.generation if published else 0
    if not retry_due(state.failure, sha256, state.local, now):
        return steps
    # A process holding nothing (its file was missing or broken at start-up) takes its own file as
    # it is, published or not, as at start-up; one that serves swaps only to the published sha256.
    problem = local_mismatch(state.local, published if state.serving is not None else None)
    if problem or state.local is None:
        return [*steps, Refuse(state.role, sha256, generation, state.local, problem)]
    expected = sha256 if state.serving is not None else None
    return [*steps, Load(state.role, state.local, sha256, generation, expected, aside_for(state.local.size))]


def retry_due(failure: ReloadFailure | None, sha256: str, local: FileIdentity | None, now: float) -> bool:
    """Load now unless the same file already failed for this generation and its retry is not due."""
    if failure is None or failure.sha256 != sha256 or failure.identity != local:
        return True
    return now >= failure.retry_at


def local_mismatch(local: FileIdentity | None, published: Published | None) -> str:
    """Why this machine's file cannot be the published one, without reading it ('' when it may be)."""
    if local is None:
        return "this machine has no such model file"
    if published is not None and published.size is not None and published.size != local.size:
        name = local.path.rsplit("/", 1)[-1]
        return f"this machine's {name} has {local.size} bytes, the published file {published.size}"
    return ""


def after_failure(
    previous: ReloadFailure | None,
    step: Refuse | Load,
    reason: str,
    now: float,
    wall_time: float,
    retry_max_s: float,
) -> ReloadFailure:
    """The failure record of a refused or failed load: a refusal waits for the file to change; a
    failed load (out of memory, say) is retried with exponential backoff, at most `retry_max_s`."""
    identity = step.file if isinstance(step, Load) else step.identity
    attempts = previous.attempts + 1 if previous is not None and previous.sha256 == step.sha256 else 1
    delay_s = math.inf if isinstance(step, Refuse) else min(retry_max_s, 2.0**attempts)
    return ReloadFailure(step.sha256, step.generation, identity, reason, attempts, now + delay_s, wall_time)


def slot_count(reload_slots: int, peers: int) -> int:
    """`reload_slots`, or (0) half of this machine's live processes serving the role, at least 1."""
    return max(1, reload_slots if reload_slots > 0 else peers // 2)


def twin_step(loaded: FileIdentity | None, seen: FileIdentity | None, now: FileIdentity | None) -> str:
    """What a worker does about its tokenizer's batch file (`X.batch.onnx`), which the watcher does
    not publish: `keep` it as loaded; `wait` while it changes (it differs from the last look);
    `reload` once it held still for a round (also when it was removed: then none is served)."""
    if now == loaded:
        return "keep"
    return "wait" if now != seen else "reload"
