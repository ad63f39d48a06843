"""`ModelHolder`: the warm sessions of one worker process (Triton's load -> warm up -> serve -> unload).

- `load(role, path)`: build and warm up a session beside whatever serves now;
- `swap(role, session)`: make it the role's session between two tasks; the old one is freed
  when the last task using it ends;
- `serving(roles)`: the sessions of one task, fixed for the task even if a swap happens meanwhile;
- `stand_aside()` / `rejoin()` and `drain()`: take no new task for a while, and wait for the
  running ones (a reload that should have a core to itself);
- `close()`.

No Redis here: when to load what is `workers.reload.policy`'s decision, carried out by
`workers.reload.coordinator`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipeline.batching import attach_twin
from pipeline.errors import ModelUnavailable
from pipeline.inference import open_session
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.records import ROLE_TOKENIZER
from workers.metrics import NoMetrics

log = logging.getLogger("voxmill.holder")


class ModelHolder:
    """Per-process model state: the current session of each role, and which generation it is."""

    def __init__(
        self,
        roles: Sequence[str],
        options: SessionOptions,
        registry: Registry,
        metrics: NoMetrics | None = None,
        aside_wait_max_s: float = 30.0,
        name: str = "",
        batch_twins: bool = False,
    ) -> None:
        """`name`: the worker process, as a refused task is told; `batch_twins`: load a tokenizer's
        batch file beside it when its folder has one (`pipeline.batching.attach_twin`)."""
        self.roles = tuple(roles)
        self.batch_twins = batch_twins
        self.name = name
        self.options = options
        self.registry = registry
        self.metrics = metrics or NoMetrics()
        self.aside_wait_max_s = aside_wait_max_s
        self.sessions: dict[str, ModelSession] = {}
        self.generations: dict[str, int] = {}
        self.load_errors: dict[str, str] = {}
        self.tasks_done = 0
        self.task_ended = threading.Event()  # set after every task (the heartbeat shows it soon)
        self._recent: deque[float] = deque()
        self._lock = threading.RLock()
        self._tasks_running = 0
        self._task_finished = threading.Condition(self._lock)
        self._in_rotation = threading.Event()  # cleared while this process stands aside
        self._in_rotation.set()

    # -- load -> warm up -> swap ------------------------------------------------------------
    def load(self, role: str, path: Path, expected_sha256: str | None = None) -> ModelSession:
        """Load and warm up `path` as the `role` model (and its batch twin), beside the one serving."""
        session = open_session(path, role, self.options, self.registry, expected_sha256=expected_sha256)
        return attach_twin(session, self.options, self.registry) if self.batch_twins else session

    def reload_twin(self, role: str, session: ModelSession) -> bool:
        """Load the batch file beside `session`'s again (it changed) and serve it from the next task
        on; a running task keeps the twin it started with. False when none is served or it did not
        load (the one before serves on)."""
        if role != ROLE_TOKENIZER or session.session is None:
            return False
        before = session.twin
        attach_twin(session, self.options, self.registry)
        return session.twin is not before

    def swap(self, role: str, session: ModelSession, generation: int | None) -> ModelSession | None:
        """Make `session` the role's session between two tasks; returns the one it replaced.

        Tasks that started before hold their own reference: ONNX Runtime frees the old session
        when the last of them ends. `generation` None: a file that is not the published one.
        """
        with self._lock:
            old = self.sessions.get(role)
            self.sessions[role] = session
            if generation is None:
                self.generations.pop(role, None)
            else:
                self.generations[role] = generation
            self.load_errors.pop(role, None)
        self.metrics.model_loaded(role, session.sha256, session.load_s, session.warm_latency_ms or 0.0)
        return old

    def note_generation(self, role: str, generation: int) -> None:
        """The role's session is the published `generation` (published after it was loaded)."""
        with self._lock:
            if role in self.sessions:
                self.generations[role] = generation

    def unavailable(self, role: str, reason: str) -> None:
        """The role has no session, and this is why (what a task that needs it is told)."""
        with self._lock:
            if role not in self.sessions:
                self.load_errors[role] = reason

    # -- serve --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self, roles: Sequence[str]) -> Iterator[dict[str, ModelSession]]:
        """The sessions for `roles`, fixed for the whole task; `ModelUnavailable` when one is missing.

        While the process stands aside a task first waits, at most `aside_wait_max_s`.
        """
        if not self._in_rotation.is_set() and not self._in_rotation.wait(self.aside_wait_max_s):
            log.warning("worker %s stood aside for %.0f s; serving again", self.name, self.aside_wait_max_s)
            self._in_rotation.set()
        with self._lock:
            missing = [role for role in roles if role not in self.sessions]
            if missing:
                reasons = "; ".join(f"{r}: {self.load_errors.get(r, 'not loaded')}" for r in missing)
                raise ModelUnavailable(f"worker {self.name} has no {', '.join(missing)} model ({reasons})")
            snapshot = {role: self.sessions[role] for role in roles}
            self._tasks_running += 1
        try:
            yield snapshot
        finally:
            with self._task_finished:
                self._tasks_running -= 1
                self.tasks_done += 1
                self._recent.append(time.time())
                self._task_finished.notify_all()
            self.task_ended.set()

    @property
    def running_tasks(self) -> int:
        """How many tasks hold their sessions now (several in a threads pool)."""
        with self._lock:
            return self._tasks_running

    def tasks_last_minute(self) -> int:
        with self._lock:
            while self._recent and self._recent[0] < time.time() - 60:
                self._recent.popleft()
            return len(self._recent)

    # -- standing aside ---------------------------------------------------------------------
    @property
    def aside(self) -> bool:
        return not self._in_rotation.is_set()

    def stand_aside(self) -> None:
        """Take no new task until `rejoin` (one that arrives waits, at most `aside_wait_max_s`)."""
        self._in_rotation.clear()

    def rejoin(self) -> None:
        self._in_rotation.set()

    def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the tasks this process runs to end."""
        deadline = time.monotonic() + timeout_s
        with self._task_finished:
            while self._tasks_running and (left_s := deadline - time.monotonic()) > 0:
                self._task_finished.wait(left_s)

    # -- describe, close ----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The models, their load errors and the task counts, as `voxmill status` shows them."""
        with self._lock:
            models = {
                role: {**s.describe(), "generation": self.generations.get(role)}
                for role, s in self.sessions.items()
            }
            errors = dict(self.load_errors)
        return {
            "models": models,
            "load_errors": errors,
            "tasks_done": self.tasks_done,
            "tasks_last_minute": self.tasks_last_minute(),
            "aside": self.aside,
        }

    def close(self) -> None:
        """Release every session (a task still running keeps its own until it ends)."""
        self.rejoin()
        with self._lock:
            self.sessions.clear()
