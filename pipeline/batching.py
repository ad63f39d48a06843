"""Speech tokens of many clips in length-bucketed batches through a batch tokenizer, exactly as `tokenize`.

A batch tokenizer (CosyVoice's `speech_tokenizer_v2.batch.onnx`, the stand-in's twin) takes
`feats` [B, 128, T] zero-padded and `feats_length` [B], and gives tokens [B, T'] of which a row's
first (len - 1) // 4 + 1 (at 25 Hz) are its own. Each clip's features are `tokenize`'s
(`log_mel_windows`: the 30 s windows of a long clip are rows like any other), rows are sorted by
frame count and grouped under a frame budget and a batch cap (`plan_batches`), each batch runs
once, and each clip gets its windows' tokens back, merged as `tokenize` merges them.

Nothing here decides whether batching pays; the caller passes the budget and the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.features import HOP, SAMPLE_RATE_HZ
from pipeline.inference import FloatArray, checked_tokens, log_mel_windows, merge_windows, warm_up
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.signature import check_batch_signature
from pipeline.records import ROLE_TOKENIZER

FRAME_RATE_HZ = SAMPLE_RATE_HZ // HOP  # log-mel frames per second (100)
# On the CPU a batch pays only for short clips (issue 33: 8 clips of 2 s 1.21x the throughput of
# single runs, 5 s 1.0x, 10 s a loss): the default budget fills a batch of 8 with clips of 2 s.
DEFAULT_MAX_BATCH = 8
DEFAULT_FRAME_BUDGET = 8 * 200


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
    """The tokens of each log-mel row (one window), in the order given, one session run per batch."""
    tokens: list[list[int]] = [[] for _ in rows]
    for batch in plan_batches([row.shape[1] for row in rows], frame_budget, max_batch):
        output = session.run(batch_inputs([rows[i] for i in batch]))[0]
        for slot, index in enumerate(batch):
            wanted = own_tokens(rows[index].shape[1], session.token_rate_hz)
            if output.ndim != 2 or output.shape[1] < wanted:
                raise VoxmillError(
                    errors.MODEL_ERROR,
                    f"{session.path.name} gave tokens of shape {list(output.shape)} for a batch of "
                    f"{len(batch)}; row {slot} needs {wanted}",
                )
            tokens[index] = checked_tokens(session, output[slot, :wanted])
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
