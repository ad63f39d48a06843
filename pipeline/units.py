"""Sizes and durations in the words of voxmill's messages (`812 bytes`, `32 MB`, `4 min 30 s`)."""

from __future__ import annotations

import math


def format_bytes(n: int) -> str:
    """'812 bytes', '1.5 KB', '2.0 GB' (1024-based); whole limits such as 256 MB lose the '.0'."""
    if n < 1024:
        return f"{n} bytes"
    value, unit = n / 1024, "KB"
    for bigger in ("MB", "GB", "TB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    if value == int(value) and value >= 10:
        return f"{int(value)} {unit}"
    return f"{value:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """'42 ms', '3.5 s', '10 min', '4 min 30 s', '3 h 0 min'; milliseconds are rounded down."""
    if seconds < 1:
        return f"{math.floor(seconds * 1000 + 1e-6)} ms"
    if seconds < 59.95:
        return f"{seconds:.1f} s".replace(".0 s", " s")
    whole = round(seconds)
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes} min" if secs == 0 else f"{minutes} min {secs} s"
    hours, rest = divmod(whole, 3600)
    return f"{hours} h {rest // 60} min"


def audio_amount(seconds: float) -> str:
    """Seconds of audio as people say them: 42 s, 12.5 min, 3.25 h."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
