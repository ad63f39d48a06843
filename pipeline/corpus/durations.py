"""The clips' mean duration that sizes a plan's shards (`pipeline.corpus.sharding.shard_size_for_durations`):
listed (`utt2dur`, a manifest's `duration`, a segment's bounds) or, when the listing gives none, read
from the headers of a few of its files.

A listing without durations is common (CosyVoice's data preparation writes no `utt2dur`; a folder
of files never has one), and its short clips cut 32 to a shard ran at 0.56 of a plain loop on fast
models instead of about 0.8 (issue 34). A header read (libsndfile, no decode) costs well under a
millisecond on a local disk: a sample of `HEADER_SAMPLE` costs little before the first shard. Object
URLs cost a GET each (10-50 ms on a real bucket; a short clip is read whole): they are read
`in_flight` at once, spread over the sample from the first round on, and the reading stops once
`ENOUGH_READ` headers give the mean within `PRECISE` (its standard error): clips of similar
lengths cost the planner 2 round trips before its first shard, not 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import soundfile as sf

from pipeline.audio.sources import open_source
from pipeline.errors import VoxmillError
from pipeline.records import Utterance
from pipeline.settings import AudioLimits
from pipeline.storage.urls import is_url

HEADER_SAMPLE = 64  # headers read at most
LEAST_READ = 8  # fewer headers than this say too little about a corpus
ENOUGH_READ = 16  # objects: at least this many headers before the reading may stop early
PRECISE = 0.1  # ... once the mean's standard error is within this share of it (shards within ~10 %)


def listed_mean(utts: Sequence[Utterance]) -> float | None:
    """The mean listed duration of `utts`; None when any of them lists none (or there are none)."""
    durations = [u.duration_s for u in utts]
    if not durations or any(d is None for d in durations):
        return None
    return sum(d or 0.0 for d in durations) / len(durations)


def header_sample(utts: Sequence[Utterance], most: int = HEADER_SAMPLE) -> list[str]:
    """The paths whose headers stand for `utts`' durations: up to `most`, evenly spread over them.

    None at all unless every one is a whole file, local (an absolute path) or an object URL: a
    segment's length is its bounds, not its recording's.
    """
    if not all((u.path.startswith("/") or is_url(u.path)) and not u.is_segment for u in utts):
        return []
    count = min(most, len(utts))
    return [utts[i * len(utts) // count].path for i in range(count)]


def sample_mean(seconds: Sequence[float | None], least: int = LEAST_READ) -> float | None:
    """The mean of the durations read (None: a header that could not be read), when at least half
    of the sample and at least `least` headers were read: a few readable files among many missing
    ones are not the corpus. None otherwise."""
    read = [s for s in seconds if s is not None]
    if not read or len(read) < least or 2 * len(read) < len(seconds):
        return None
    return sum(read) / len(read)


def header_seconds(path: str, limits: AudioLimits) -> float | None:
    """A file's or an object's duration from its header, or None when it cannot be read.

    `open_source` opens regular files only (never a FIFO or a device) and objects within
    `max_file_bytes`. libsndfile only: audioread's fallback would start a decoder process per
    file, and a file it cannot read is merely left out of the sample.
    """
    try:
        with open_source(path if is_url(path) else Path(path), limits) as opened:
            sound = opened.soundfile()
            return sound.frames / sound.samplerate if sound.samplerate > 0 else None
    except (VoxmillError, OSError, ValueError, RuntimeError, sf.SoundFileError):
        return None


def headers_mean(utts: Sequence[Utterance], limits: AudioLimits, in_flight: int = 8) -> float | None:
    """The mean duration of a header sample of `utts` (`header_sample`), when enough were read;
    objects `in_flight` at once, local files one after another."""
    paths = header_sample(utts)
    if not any(is_url(path) for path in paths) or in_flight <= 1:
        return sample_mean([header_seconds(path, limits) for path in paths])
    from concurrent.futures import ThreadPoolExecutor

    spread = [paths[i] for first in (0, 2, 1, 3) for i in range(first, len(paths), 4)]  # any prefix spans
    seconds: list[float | None] = []
    with ThreadPoolExecutor(in_flight, thread_name_prefix="voxmill-headers") as pool:
        for start in range(0, len(spread), in_flight):
            batch = spread[start : start + in_flight]
            seconds += pool.map(lambda path: header_seconds(path, limits), batch)
            if known_well(seconds):
                break
    return sample_mean(seconds)


def known_well(seconds: Sequence[float | None]) -> bool:
    """Whether the durations read so far give their mean within `PRECISE` (standard error), from
    at least `ENOUGH_READ` headers."""
    read = [s for s in seconds if s is not None]
    if len(read) < ENOUGH_READ:
        return False
    mean = sum(read) / len(read)
    variance = sum((s - mean) ** 2 for s in read) / (len(read) - 1)
    return mean > 0 and (variance / len(read)) ** 0.5 <= PRECISE * mean
