"""The benchmark's inputs: stand-in models and synthetic corpora, generated once and cached.

Everything lives under `benchmarks/work/` (git-ignored; `BENCH_WORK_DIR` moves it) and is rebuilt
only when missing or when its recipe changed (a `recipe.json` next to the files records what made
them).

A corpus is a folder of speech-like clips (`pipeline.demo.speechlike`, three pitches as three
speakers) in mixed formats and rates, drawn with a fixed seed: 16-bit WAV and FLAC at 16 kHz (most
of a typical corpus), FLAC 22.05 kHz, 24-bit stereo WAV 44.1 kHz, Ogg Vorbis 48 kHz, MP3 24 kHz
and 16-bit WAV 48 kHz. Durations are log-uniform (most clips short, a few long, as in read-speech
corpora) or uniform between the given bounds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.demo import FLAC, MP3, OGG, WAV16, WAV24_STEREO, _Format, encode, speechlike
from pipeline.models.standin import make_standins
from pipeline.storage.locations import atomic_write

# BENCH_WORK_DIR moves everything generated elsewhere (the smoke test uses a temporary folder).
WORK_DIR = Path(os.environ.get("BENCH_WORK_DIR") or Path(__file__).resolve().parent / "work")
FLAC16 = _Format("flac", "FLAC", "PCM_16", 16000)
WAV48 = _Format("wav", "WAV", "PCM_16", 48000)
# (format, weight): what a crawled/read-speech corpus looks like, roughly.
FORMAT_MIX: tuple[tuple[_Format, float], ...] = (
    (WAV16, 0.30),
    (FLAC16, 0.15),
    (FLAC, 0.10),
    (WAV24_STEREO, 0.10),
    (OGG, 0.15),
    (MP3, 0.10),
    (WAV48, 0.10),
)
PITCHES_HZ = (110.0, 165.0, 220.0)
RECIPE_FILE = "recipe.json"


@dataclass(frozen=True)
class CorpusRecipe:
    """How a corpus is drawn: count, duration bounds and distribution, seed."""

    name: str
    count: int
    min_s: float
    max_s: float
    distribution: str = "loguniform"  # or "uniform"
    seed: int = 0
    version: int = 1


@dataclass(frozen=True)
class Clip:
    """One clip of a generated corpus."""

    utt: str
    path: str
    spk: str
    duration_s: float
    format: str
    rate_hz: int
    channels: int


# The main benchmark corpus (`make bench`'s main sections, the speech check's extract runs).
MAIN_CORPUS = CorpusRecipe("main", 240, 1.0, 25.0)


def draw_durations(recipe: CorpusRecipe) -> list[float]:
    """The clip durations of `recipe` (seconds, rounded to 10 ms)."""
    rng = np.random.default_rng(recipe.seed)
    if recipe.distribution == "uniform":
        raw = rng.uniform(recipe.min_s, recipe.max_s, recipe.count)
    else:
        raw = np.exp(rng.uniform(math.log(recipe.min_s), math.log(recipe.max_s), recipe.count))
    return [round(float(d), 2) for d in raw]


def make_corpus(recipe: CorpusRecipe, work_dir: Path = WORK_DIR) -> list[Clip]:
    """Write (or reuse) the corpus of `recipe` under `work_dir/corpora/<name>/audio`; its clips."""
    folder = work_dir / "corpora" / recipe.name
    manifest = folder / RECIPE_FILE
    if manifest.exists():
        saved = json.loads(manifest.read_text())
        if saved.get("recipe") == asdict(recipe):
            clips = [Clip(**c) for c in saved["clips"]]
            if all(Path(c.path).exists() for c in clips):
                return clips
    rng = np.random.default_rng(recipe.seed + 1)
    weights = np.array([w for _, w in FORMAT_MIX])
    clips = []
    for index, seconds in enumerate(draw_durations(recipe)):
        fmt = FORMAT_MIX[int(rng.choice(len(FORMAT_MIX), p=weights / weights.sum()))][0]
        spk = f"spk{index % len(PITCHES_HZ)}"
        pitch = PITCHES_HZ[index % len(PITCHES_HZ)]
        samples = speechlike(seconds, fmt.rate_hz, pitch, recipe.seed * 100_000 + index, fmt.channels)
        path = folder / "audio" / spk / f"utt{index:04d}.{fmt.ext}"
        data = encode(samples, fmt, recipe.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda stream, data=data: stream.write(data))  # type: ignore[misc]
        clips.append(
            Clip(f"{spk}/utt{index:04d}", str(path), spk, seconds, fmt.ext, fmt.rate_hz, fmt.channels)
        )
    manifest.write_text(json.dumps({"recipe": asdict(recipe), "clips": [asdict(c) for c in clips]}, indent=1))
    return clips


def corpus_folder(recipe: CorpusRecipe, work_dir: Path = WORK_DIR) -> Path:
    """The audio folder of a corpus (what `voxmill extract` reads)."""
    return work_dir / "corpora" / recipe.name / "audio"


def subset(clips: Sequence[Clip], count: int) -> list[Clip]:
    """The first `count` clips (clips are drawn independently, so any prefix is a fair sample)."""
    return list(clips[:count])


def make_models(profile: str, work_dir: Path = WORK_DIR) -> Path:
    """Stand-in models of `profile` in `work_dir/models-<profile>` (written once; the generator is
    deterministic, so a cached copy is the same bytes)."""
    folder = work_dir / f"models-{profile}"
    marker = folder / RECIPE_FILE
    if not marker.exists():
        make_standins(folder, profile)
        marker.write_text(json.dumps({"profile": profile}))
    return folder


def format_counts(clips: Sequence[Clip]) -> dict[str, int]:
    """How many clips per `ext@rate` (for the report)."""
    counts: dict[str, int] = {}
    for clip in clips:
        key = f"{clip.format} {clip.rate_hz // 1000 if clip.rate_hz % 1000 == 0 else clip.rate_hz / 1000} kHz"
        key += " stereo" if clip.channels > 1 else ""
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
