"""Per-utterance quality statistics, computed on the wave the models see (16 kHz mono float32).

Rules:
- `rms_dbfs`, `peak_dbfs`: 20 log10 of the RMS and of the largest |sample|, relative to full
  scale 1.0 (a full-scale square wave is 0 dBFS RMS, a full-scale sine -3.01), floored at
  `DBFS_FLOOR` so that the value stays a finite number.
- `clipped_fraction`: the share of samples with |x| >= `CLIP_LEVEL` (0.999 of full scale). It is
  measured after mixdown and resampling: for a 16 kHz mono source it counts the clipped source
  samples exactly; for other rates the resampler's ringing moves a few plateau samples below the
  level, so it reads slightly low.
- `speech_s`, `speech_ratio`: from the speech detector (pipeline/audio/vad.py), None when it did not run.
- `source_rate_hz`, `source_channels`, `source_codec`: what the file header said (`Audio`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

CLIP_LEVEL = 0.999
DBFS_FLOOR = -150.0  # below a 24-bit LSB (-144 dBFS); digital silence reads as this
RATE_HZ = 16000
_CHUNK = 1 << 20  # float64 sums chunk by chunk: a 10 min clip never gets a float64 copy

STAT_FIELDS: tuple[str, ...] = (
    "source_rate_hz",
    "source_channels",
    "source_codec",
    "duration_s",
    "speech_s",
    "speech_ratio",
    "rms_dbfs",
    "peak_dbfs",
    "clipped_fraction",
)


def dbfs(amplitude: float) -> float:
    """20 log10(amplitude) relative to full scale 1.0, floored at `DBFS_FLOOR`, to 0.01 dB."""
    if amplitude <= 0.0 or not math.isfinite(amplitude):
        return DBFS_FLOOR
    return round(max(DBFS_FLOOR, 20.0 * math.log10(amplitude)), 2)


def clip_stats(
    samples: npt.NDArray[np.floating[Any]],
    *,
    source_rate_hz: int | None = None,
    channels: int | None = None,
    codec: str | None = None,
    speech_s: float | None = None,
    rate_hz: int = RATE_HZ,
) -> dict[str, Any]:
    """The quality columns of one clip (module docstring), keyed by `STAT_FIELDS`; pure."""
    import numpy as np  # here: `voxmill extract` imports `QualityFilter` before it spawns its workers

    wave = np.asarray(samples).reshape(-1)
    n = int(wave.shape[0])
    duration_s = n / rate_hz
    squares = 0.0
    for start in range(0, n, _CHUNK):
        # Squared in float32, summed in float64 (pairwise): the same level to 0.01 dB without a
        # float64 copy of the clip. Not np.dot: a BLAS call starts a thread per core, which then
        # competes with the other worker processes' models (each clip took 15x longer in a
        # 2-process run).
        squares += float(np.square(wave[start : start + _CHUNK]).sum(dtype=np.float64))
    low, high = (float(wave.min()), float(wave.max())) if n else (0.0, 0.0)
    peak = max(high, -low)
    clipped = 0
    if peak >= CLIP_LEVEL:  # counted only when a sample reaches the level: most clips have none
        clipped = int(np.count_nonzero(wave >= CLIP_LEVEL) + np.count_nonzero(wave <= -CLIP_LEVEL))
    speech = None if speech_s is None else round(min(float(speech_s), duration_s), 4)
    return {
        "source_rate_hz": source_rate_hz,
        "source_channels": channels,
        "source_codec": codec,
        "duration_s": round(duration_s, 4),
        "speech_s": speech,
        "speech_ratio": None if speech is None or n == 0 else round(speech / duration_s, 4),
        "rms_dbfs": dbfs(math.sqrt(squares / n)) if n else DBFS_FLOOR,
        "peak_dbfs": dbfs(peak),
        "clipped_fraction": clipped / n if n else 0.0,
    }


@dataclass(frozen=True)
class QualityFilter:
    """Which utterances a run leaves out of its features, by their quality statistics.

    Applied when the shards are merged (`pipeline.outputs.merge`): changing it needs no re-extraction. A
    statistic a clip does not have (no speech ratio with the speech check off) never filters it.
    """

    min_speech_ratio: float | None = None
    max_clipped_fraction: float | None = None
    min_duration_s: float | None = None
    max_duration_s: float | None = None

    @property
    def active(self) -> bool:
        return any(value is not None for value in self.to_dict().values())

    def to_dict(self) -> dict[str, float | None]:
        return {
            "min_speech_ratio": self.min_speech_ratio,
            "max_clipped_fraction": self.max_clipped_fraction,
            "min_duration_s": self.min_duration_s,
            "max_duration_s": self.max_duration_s,
        }

    def reason(self, stats: Mapping[str, Any]) -> str | None:
        """Why a clip with these statistics is left out, or None when it is kept."""
        checks = (
            ("speech_ratio", self.min_speech_ratio, "below", "--min-speech-ratio"),
            ("clipped_fraction", self.max_clipped_fraction, "above", "--max-clipped"),
            ("duration_s", self.min_duration_s, "below", "--min-duration"),
            ("duration_s", self.max_duration_s, "above", "--max-duration"),
        )
        for name, limit, side, option in checks:
            value = stats.get(name)
            if limit is None or value is None:
                continue
            if (side == "below" and value < limit) or (side == "above" and value > limit):
                return f"{name.replace('_', ' ')} {value:g} is {side} {option} {limit:g}"
        return None
