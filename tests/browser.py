"""A real headless Chromium for tests (Debian's `chromium`), and a PNG reader in numpy (no imaging
package: voxmill does not depend on one)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
NO_CHROMIUM = "chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
WINDOW = (1200, 2000)

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, NO_CHROMIUM
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *extra,
        page.resolve().as_uri(),
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)


def screenshot(page: Path, png: Path, profile: Path) -> np.ndarray:
    """The page as Chromium draws it in a 1200x2000 window: uint8 [height, width, 3]."""
    _chromium(page, profile, f"--screenshot={png}")
    return read_png(png)


def dump_dom(page: Path, profile: Path) -> str:
    """The DOM after the page's scripts ran (`--dump-dom`)."""
    return _chromium(page, profile, "--dump-dom").stdout


def boxes(dom: str) -> dict[str, tuple[int, int, int, int]]:
    """{chart id: (x, y, width, height)} from the `data-box` attributes the page stamps on its charts."""
    found = {}
    for tag in re.findall(r"<svg[^>]*>", dom):
        chart_id, box = re.search(r'id="([^"]+)"', tag), re.search(r'data-box="([^"]+)"', tag)
        if chart_id and box:
            x, y, w, h = (int(v) for v in box.group(1).split(","))
            found[chart_id.group(1)] = (x, y, w, h)
    return found


def read_png(path: Path) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG as uint8 [height, width, 3] (alpha dropped)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int64)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, dtype=np.uint8, count=stride, offset=y * (stride + 1) + 1).astype(np.int64)
        if kind == 0:
            out = line
        elif kind == 1:  # Sub: a running sum per channel
            out = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:  # Up
            out = (line + previous) % 256
        else:
            out = _average_or_paeth(kind, line.tolist(), previous.tolist(), bpp)
        rows[y] = out
        previous = out.astype(np.int64)
    return rows.reshape(height, width, bpp)[:, :, :3]


def _average_or_paeth(kind: int, line: list[int], up: list[int], bpp: int) -> np.ndarray:
    out = [0] * len(line)
    for i, value in enumerate(line):
        left = out[i - bpp] if i >= bpp else 0
        if kind == 3:
            out[i] = (value + (left + up[i]) // 2) % 256
            continue
        corner = up[i - bpp] if i >= bpp else 0
        p = left + up[i] - corner
        pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
        pred = left if pa <= pb and pa <= pc else up[i] if pb <= pc else corner
        out[i] = (value + pred) % 256
    return np.array(out, dtype=np.int64)


def color_mask(image: np.ndarray, hex_color: str, tolerance: int = 24) -> np.ndarray:
    """Pixels within `tolerance` of `#rrggbb` on every channel (anti-aliased edges fall outside)."""
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    return np.all(np.abs(image.astype(np.int64) - rgb) <= tolerance, axis=-1)
