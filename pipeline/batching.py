"""Speech tokens of many clips in length-bucketed batches through a batch tokenizer, exactly as `tokenize`.

A batch tokenizer (CosyVoice's `speech_tokenizer_v2.batch.onnx`, the stand-in's twin) takes
`feats` [B, 128, T] zero-padded and `feats_length` [B], and gives tokens [B, T'] of which a row's
first (len - 1) // 4 + 1 (at 25 Hz) are its own. Each clip's features are `tokenize`'s
(`log_mel_windows`: the 30 s windows of a long clip are rows like any other), rows are sorted by
frame count and grouped under a frame budget and a batch cap (`plan_batches`), each batch runs
once, and each clip gets its windows' tokens back, merged as `tokenize` merges them.

Where batching pays is `BatchRule` (by provider, from settings); `run_clips` is a shard's clips
through it: each clip decoded and checked as `run_clip` does, its tokens from a batch of the
clips near it, every other step and every error its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.audio.decode import Segment
from pipeline.audio.sources import Source
from pipeline.audio.vad import SpeechCheck
from pipeline.errors import ErrorRecord, VoxmillError
from pipeline.features import HOP, SAMPLE_RATE_HZ
from pipeline.inference import (
    ClipRun,
    FloatArray,
    checked_tokens,
    log_mel_windows,
    merge_windows,
    models_of,
    run_op,
    tokenize,
    tokenizer_inputs,
    warm_up,
    warmup_wave,
)
from pipeline.models.identity import FileIdentity
from pipeline.models.options import SessionOptions
from pipeline.models.providers import CPU
from pipeline.models.registry import Registry, batch_name
from pipeline.models.sessions import ModelSession
from pipeline.models.signature import check_batch_signature
from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER, ROLES_BY_OP, TaskResult
from pipeline.settings import AudioLimits, Settings

log = logging.getLogger("voxmill.batching")

FRAME_RATE_HZ = SAMPLE_RATE_HZ // HOP  # log-mel frames per second (100)
# On the CPU a batch pays only for short clips (issue 33: 8 clips of 2 s 1.21x the throughput of
# single runs, 5 s 1.0x, 10 s a loss): the default budget fills a batch of 8 with clips of 2 s.
DEFAULT_MAX_BATCH = 8
DEFAULT_FRAME_BUDGET = 8 * 200
# On a GPU a batch always pays (issue 33: batch 1 leaves the device idle between launches).
GPU_MAX_BATCH = 32
GPU_FRAME_BUDGET = 32 * 3000
# Rows (clips, windows) a shard gathers before their batches run: sorted by length, too few
# rows leave each batch padded to a longest row well above its others. Bounded in frames too
# (log-mel, 512 bytes a frame: 128 clips of 3 s are 20 MB, 128 windows of 30 s 196 MB); 4
# batches' worth where batches are larger (a GPU's: 128 windows, 4 x 96,000 frames).
GATHER_ROWS = 128
GATHER_FRAMES = 128 * 300
GATHER_BATCHES = 4


@dataclass(frozen=True)
class BatchRule:
    """Which clips' tokens go through the batch file, and how batches are cut.

    A clip longer than `max_clip_frames` (None: no limit) is tokenized alone on the single file;
    the others are gathered, `max_batch` rows and `frame_budget` padded frames at most a batch
    (a batch of any size: 2 or 3 rows already paid on the CPU). Which file makes a clip's tokens
    depends on its length only, never on the clips beside it.
    """

    max_batch: int = DEFAULT_MAX_BATCH
    frame_budget: int = DEFAULT_FRAME_BUDGET
    max_clip_frames: int | None = 300

    @classmethod
    def from_settings(cls, settings: Settings, serving: str) -> BatchRule | None:
        """The rule of a worker whose batch file runs on provider `serving`; None: batch nothing."""
        if settings.batch_tokenize == "off":
            return None
        cpu = serving == CPU
        longest = int(settings.batch_max_clip_s * FRAME_RATE_HZ)
        where_it_pays = cpu and settings.batch_tokenize == "auto"  # on a GPU, and with `on`: every clip
        if where_it_pays and longest <= 0:  # the CPU's default: batches did not pay on every CPU
            return None
        return cls(
            max_batch=settings.batch_max_clips or (DEFAULT_MAX_BATCH if cpu else GPU_MAX_BATCH),
            frame_budget=settings.batch_frame_budget or (DEFAULT_FRAME_BUDGET if cpu else GPU_FRAME_BUDGET),
            max_clip_frames=longest if where_it_pays else None,
        )

    @staticmethod
    def loads_twin(settings: Settings, serving: str) -> bool:
        """Whether a worker serving on `serving` loads the batch file: where its rule batches."""
        return BatchRule.from_settings(settings, serving) is not None

    def takes(self, frames: int) -> bool:
        """Whether a clip of `frames` log-mel frames joins a batch."""
        return self.max_clip_frames is None or frames <= self.max_clip_frames


def plan_batches(frames: Sequence[int], frame_budget: int, max_batch: int) -> list[list[int]]:
    """Group rows (given by frame count) into batches of row indices, shortest rows first.

    Rows are sorted by frame count (ties by index); a batch takes the next row while it holds
    fewer than `max_batch` rows and its padded size (rows x the longest row) stays within
    `frame_budget`. A row longer than the budget runs alone.
    """
    if frame_budget < 1 or max_batch < 1:
        raise ValueError(f"frame_budget and max_batch must be at least 1, not {frame_budget} and {max_batch}")
    batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(frames)), key=lambda i: (frames[i], i)):
        # Sorted: this row is the batch's longest, so it sets the padded size.
        if current and (len(current) == max_batch or (len(current) + 1) * frames[index] > frame_budget):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def batch_inputs(rows: Sequence[FloatArray]) -> list[npt.NDArray[Any]]:
    """Inputs of log-mel rows [128, T_i]: feats [B, 128, max T_i] zero-padded, feats_length [B] int32."""
    lengths = np.array([row.shape[1] for row in rows], dtype=np.int32)
    feats = np.zeros((len(rows), rows[0].shape[0], int(lengths.max())), dtype=np.float32)
    for slot, row in enumerate(rows):
        feats[slot, :, : row.shape[1]] = row
    return [feats, lengths]


def own_tokens(n_frames: int, token_rate_hz: int) -> int:
    """How many of a padded row's tokens are its own: (len - 1) // 4 + 1 at 25 Hz."""
    return (n_frames - 1) // (FRAME_RATE_HZ // token_rate_hz) + 1


def run_rows(
    session: ModelSession, rows: Sequence[FloatArray], frame_budget: int, max_batch: int
) -> list[list[int]]:
    """The tokens of each log-mel row (one window), in the order given, one session run per batch.
    A batch that fails raises its error (`run_batches` keeps it to the rows that caused it)."""
    tokens: list[list[int]] = [[] for _ in rows]
    for batch in plan_batches([row.shape[1] for row in rows], frame_budget, max_batch):
        for index, row_tokens in zip(batch, batch_tokens(session, [rows[i] for i in batch]), strict=True):
            tokens[index] = row_tokens
    return tokens


def batch_tokens(session: ModelSession, rows: Sequence[FloatArray]) -> list[list[int]]:
    """One session run of `rows`: each row's own tokens; `model_error` when the output is short."""
    output = session.run(batch_inputs(rows))[0]
    tokens = []
    for slot, row in enumerate(rows):
        wanted = own_tokens(row.shape[1], session.token_rate_hz)
        if output.ndim != 2 or output.shape[0] != len(rows) or output.shape[1] < wanted:
            raise VoxmillError(
                errors.MODEL_ERROR,
                f"{session.path.name} gave tokens of shape {list(output.shape)} for a batch of "
                f"{len(rows)}; row {slot} needs {wanted}",
            )
        tokens.append(checked_tokens(session, output[slot, :wanted]))
    return tokens


def tokenize_windows(
    session: ModelSession,
    clips: Sequence[Sequence[FloatArray]],
    frame_budget: int = DEFAULT_FRAME_BUDGET,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> list[list[int]]:
    """The tokens of each clip given as its `log_mel_windows`: every window a row of the batches."""
    owners = [clip for clip, windows in enumerate(clips) for _ in windows]
    tokens = run_rows(session, [window for windows in clips for window in windows], frame_budget, max_batch)
    per_clip: list[list[list[int]]] = [[] for _ in clips]
    for clip, row_tokens in zip(owners, tokens, strict=True):
        per_clip[clip].append(row_tokens)  # rows keep their clip's window order
    return [w[0] if len(w) == 1 else merge_windows(w, session.token_rate_hz) for w in per_clip]


def tokenize_batch(
    session: ModelSession,
    waves: Sequence[FloatArray],
    frame_budget: int = DEFAULT_FRAME_BUDGET,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> list[list[int]]:
    """Speech tokens of each 16 kHz wave, as `tokenize` gives them on the single-clip model.

    `session` is a batch tokenizer (`open_batch_session`); its `ref` names the file that made the
    tokens. A clip whose features are not finite raises `non_finite` for the whole call: a caller
    that must fail it alone computes `log_mel_windows` per clip and calls `tokenize_windows`.
    """
    return tokenize_windows(session, [log_mel_windows(wave) for wave in waves], frame_budget, max_batch)


def open_batch_session(
    path: Path, options: SessionOptions, registry: Registry, expected_sha256: str | None = None
) -> ModelSession:
    """Load a batch tokenizer: the tokenizer role's checks, then the batch axes; warmed up."""
    session = ModelSession.load(path, ROLE_TOKENIZER, options, registry, expected_sha256)
    check_batch_signature(path.name, session.session.get_inputs(), session.session.get_outputs())
    warm_up(session, options.warmup_runs)
    return session


# Clips of the exactness check: one padded batch of two lengths, whose rows must be the single file's.
CHECK_SECONDS = (1.3, 2.2)


def check_exact(single: ModelSession, twin: ModelSession) -> None:
    """`model_error` unless a padded batch through `twin` gives every row `single`'s tokens
    (speech-like clips of `CHECK_SECONDS`): a batch file is used exactly or not at all."""
    waves = [warmup_wave(seconds) for seconds in CHECK_SECONDS]
    expected = [tokenize(single, wave) for wave in waves]
    got = tokenize_batch(twin, waves, frame_budget=len(waves) * 1000, max_batch=len(waves))
    differ = [f"{seconds} s" for seconds, a, b in zip(CHECK_SECONDS, expected, got, strict=True) if a != b]
    if differ:
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{twin.path.name} gives other tokens than {single.path.name} for the {', '.join(differ)} "
            "clip(s) of a padded batch: it is not used",
        )


def twin_path(session: ModelSession) -> Path:
    """Where the batch twin of a session's file would be: `X.batch.onnx` beside `X.onnx`."""
    return session.path.with_name(batch_name(session.path.name))


def file_now(path: Path) -> FileIdentity | None:
    try:
        return FileIdentity.of(path)
    except OSError:
        return None


def attach_twin(session: ModelSession, options: SessionOptions, registry: Registry) -> ModelSession:
    """Load the batch twin of a tokenizer's file into `session.twin`, named as the single file's
    twin; a folder without one, or a twin that does not load, leaves the single file serving alone
    (the reason logged). `session.twin_file` is the twin's file as it was looked at."""
    path = twin_path(session)
    if session.role != ROLE_TOKENIZER or not registry.role(ROLE_TOKENIZER).is_batch_name(path.name):
        return session
    session.twin_file = file_now(path)
    if session.twin_file is None:
        session.twin = None
        return session
    try:
        twin = open_batch_session(path, options, registry)
        check_exact(session, twin)
    except VoxmillError as exc:
        log.warning("batch tokenizer %s not used: %s", path, exc.message)
        return session
    twin.ref = replace(twin.ref, twin_sha256=session.sha256)
    session.twin = twin
    return session


class TokenBatches:
    """Clips waiting for their tokens: their windows gathered, run in length-sorted batches on the
    batch file when enough are waiting (`full`) or at the end (`run`).

    A batch that fails is run again row by row on the single file, so an error stays with the clip
    that caused it; a clip's batch time is shared out by its rows' frames.
    """

    def __init__(self, single: ModelSession, twin: ModelSession, rule: BatchRule) -> None:
        self.single, self.twin, self.rule = single, twin, rule
        self.clips: list[tuple[ClipRun, list[FloatArray]]] = []

    @property
    def full(self) -> bool:
        rows = [window.shape[1] for _, windows in self.clips for window in windows]
        rule = self.rule
        return len(rows) >= max(GATHER_ROWS, rule.max_batch * GATHER_BATCHES) or sum(rows) >= max(
            GATHER_FRAMES, rule.frame_budget * GATHER_BATCHES
        )

    def add(self, clip: ClipRun, windows: list[FloatArray]) -> None:
        self.clips.append((clip, windows))

    def run(self) -> None:
        """Every waiting clip's tokens (or its error), then none wait."""
        owners = [clip for clip, windows in self.clips for _ in windows]
        rows = [window for _, windows in self.clips for window in windows]
        found: list[list[int] | VoxmillError] = [[] for _ in rows]
        batched: set[int] = set()  # the clips (by id) a row of which the batch file made
        rule = self.rule
        for batch in plan_batches([row.shape[1] for row in rows], rule.frame_budget, rule.max_batch):
            started = time.perf_counter()
            tokens, on_twin = self._tokens([rows[i] for i in batch])
            for index, row_tokens in zip(batch, tokens, strict=True):
                found[index] = row_tokens
                if on_twin:
                    batched.add(id(owners[index]))
            share_ms = (time.perf_counter() - started) * 1000.0 / sum(rows[i].shape[1] for i in batch)
            for index in batch:
                timings = owners[index].timings.stages
                timings["tokenize"] = round(timings.get("tokenize", 0.0) + share_ms * rows[index].shape[1], 3)
        per_clip: dict[int, list[list[int]]] = {}
        for clip, row_tokens in zip(owners, found, strict=True):
            if isinstance(row_tokens, VoxmillError):
                clip.error = clip.error or row_tokens.record()
            else:
                per_clip.setdefault(id(clip), []).append(row_tokens)
        for clip, windows in self.clips:
            made_by = self.twin if id(clip) in batched else self.single
            clip.models = {**clip.models, ROLE_TOKENIZER: made_by.ref}
            got = per_clip.get(id(clip), [])
            if clip.error is None and len(got) == len(windows):
                clip.fields["speech_token"] = (
                    got[0] if len(got) == 1 else merge_windows(got, made_by.token_rate_hz)
                )
        self.clips = []

    def _tokens(self, rows: list[FloatArray]) -> tuple[list[list[int] | VoxmillError], bool]:
        """The rows' tokens, and whether the batch file made them: a batch whose run failed runs
        row by row on the single file."""
        try:
            return list(batch_tokens(self.twin, rows)), True
        except VoxmillError as exc:
            log.warning("a batch of %d failed (%s); its rows run alone", len(rows), exc.message)
        alone: list[list[int] | VoxmillError] = []
        for row in rows:
            try:
                alone.append(checked_tokens(self.single, self.single.run(tokenizer_inputs(row))[0]))
            except VoxmillError as exc:
                alone.append(exc)
        return alone, False


class JobGathering:
    """Single jobs' tokens in shared batches, for a worker running several jobs at once (a threads
    pool: N threads, one session per role; on a GPU, batch 1 leaves the device idle).

    Each job hands over its clip's `TokenBatches`. The first to arrive leads: while fewer jobs wait
    than run (`running()`), it waits for them, at most `wait_s`, and never when it runs alone;
    then it runs every waiting clip's rows in batches and wakes their jobs. Jobs that arrive
    meanwhile wait for the next leader.
    """

    def __init__(self, wait_s: float, running: Callable[[], int]) -> None:
        self.wait_s = wait_s
        self.running = running
        self._cond = threading.Condition()
        self._waiting: list[tuple[TokenBatches, threading.Event]] = []
        self._leading = False

    def run(self, batches: TokenBatches) -> None:
        """Run `batches`' clips with those of the jobs beside it; returns once they have tokens."""
        if not batches.clips:
            return
        done = threading.Event()
        with self._cond:
            self._waiting.append((batches, done))
            self._cond.notify_all()
            lead, self._leading = not self._leading, True
        if not lead:  # the leader has not taken the waiting list yet: it takes this job too
            done.wait()
            return
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while len(self._waiting) < self.running() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            taken, self._waiting, self._leading = self._waiting, [], False
        try:
            _run_together([b for b, _ in taken])
        finally:
            for _, event in taken:
                event.set()


def _run_together(jobs: list[TokenBatches]) -> None:
    """The clips of several jobs' `TokenBatches` in shared batches, per batch file."""
    shared: dict[int, TokenBatches] = {}
    for job in jobs:
        group = shared.setdefault(id(job.twin), TokenBatches(job.single, job.twin, job.rule))
        group.clips += job.clips
        job.clips = []
    for group in shared.values():
        clips = [clip for clip, _ in group.clips]
        try:
            group.run()
        except Exception as exc:  # a bug: every clip of the batch fails with a code, no job hangs
            log.exception("a gathered batch failed unexpectedly")
            for clip in clips:
                clip.error = clip.error or ErrorRecord(errors.INTERNAL, f"{type(exc).__name__}: {exc}")


ClipSource = tuple[str, Source | VoxmillError, Segment | None]


def run_clips(
    clips: Iterable[ClipSource],
    op: str,
    sessions: Mapping[str, ModelSession],
    limits: AudioLimits,
    speech: SpeechCheck | None,
    rule: BatchRule,
    gathering: JobGathering | None = None,
) -> list[TaskResult]:
    """Each clip's result, in order, as `run_clip` gives it, the tokens of those the rule takes
    from batches of the tokenizer's twin (`sessions[tokenizer].twin`, which must be loaded).

    `clips`: (label, what to read or why it cannot be read, segment); it is consumed as the clips
    are decoded, so a read-ahead stays ahead of the model. With `gathering`, the clips' tokens
    share batches with those of the jobs running beside this one.
    """
    tokenizer = sessions[ROLE_TOKENIZER]
    if tokenizer.twin is None:
        raise ValueError(f"{tokenizer.path.name} has no batch twin loaded")
    waiting = TokenBatches(tokenizer, tokenizer.twin, rule)
    runs: list[ClipRun] = []
    for label, source, segment in clips:
        clip = ClipRun(label, op, models_of(op, sessions))
        runs.append(clip)
        if isinstance(source, VoxmillError):
            clip.error = source.record()
        elif clip.step(lambda: clip.decode(source, limits, speech, segment)):  # noqa: B023 (runs at once)
            _models(clip, op, sessions, waiting)
            clip.audio = None  # what waits is its log-mel windows, not its samples
        if waiting.full:
            waiting.run()
    if gathering is None:
        waiting.run()
    else:
        gathering.run(waiting)
    return [clip.result() for clip in runs]


def _models(clip: ClipRun, op: str, sessions: Mapping[str, ModelSession], waiting: TokenBatches) -> None:
    """The clip's embedding now; its tokens now when the rule leaves it alone, else later."""
    audio = clip.audio
    assert audio is not None
    if ROLE_EMBEDDER in ROLES_BY_OP[op]:
        clip.step(lambda: clip.fields.update(run_op("embed", audio, sessions, clip.timings)))
    if ROLE_TOKENIZER not in ROLES_BY_OP[op]:
        return
    if not waiting.rule.takes(int(audio.duration_s * FRAME_RATE_HZ)):
        clip.step(lambda: clip.fields.update(run_op("tokenize", audio, sessions, clip.timings)))
        return
    started = time.perf_counter()
    windows: list[FloatArray] = []
    if clip.step(lambda: windows.extend(log_mel_windows(audio.samples))):
        clip.timings.add("log_mel", started)
        waiting.add(clip, windows)
