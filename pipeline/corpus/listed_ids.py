"""The utterance ids of a corpus listing, to find the ones listed twice.

Apart from `pipeline.corpus` so that naming a corpus imports no numpy: `voxmill extract` spawns its
local workers first, and imports numpy, Arrow and redis-py while they start.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


class ListedIds:
    """The ids as 16-byte digests in blocks (about 24 bytes per utterance instead of a set of
    strings), sorted once at the end."""

    BLOCK = 65536

    def __init__(self) -> None:
        self._blocks: list[np.ndarray[Any, Any]] = []
        self._digests = np.empty(self.BLOCK, dtype="V16")
        self._lines = np.empty(self.BLOCK, dtype=np.int64)
        self._filled = 0

    @staticmethod
    def digest(utt: str) -> bytes:
        return hashlib.blake2b(utt.encode(), digest_size=16).digest()

    def add(self, utt: str, line: int) -> None:
        self._digests[self._filled] = self.digest(utt)
        self._lines[self._filled] = line
        self._filled += 1
        if self._filled == self.BLOCK:
            self._flush()

    def _flush(self) -> None:
        block = np.empty(self._filled, dtype=[("id", "V16"), ("line", np.int64)])
        block["id"], block["line"] = self._digests[: self._filled], self._lines[: self._filled]
        self._blocks.append(block)
        self._filled = 0

    def sorted(self) -> np.ndarray[Any, Any]:
        if self._filled:
            self._flush()
        if not self._blocks:
            return np.empty(0, dtype=[("id", "V16"), ("line", np.int64)])
        everything = np.concatenate(self._blocks)
        self._blocks = [everything]
        return everything[np.argsort(everything, order=("id", "line"), kind="stable")]

    def repeats(self) -> dict[int, int]:
        """{line of a repeat: line of the first listing of that id}."""
        ordered = self.sorted()
        if len(ordered) < 2:
            return {}
        same = ordered["id"][1:] == ordered["id"][:-1]
        repeats: dict[int, int] = {}
        first = 0
        for index in range(1, len(ordered)):
            if same[index - 1]:
                repeats[int(ordered["line"][index])] = int(ordered["line"][first])
            else:
                first = index
        return repeats

    def contains(self, utt: str) -> bool:
        ordered = self.sorted()
        key = np.array([self.digest(utt)], dtype="V16")
        index = int(np.searchsorted(ordered["id"], key)[0])
        return index < len(ordered) and ordered["id"][index] == key[0]
