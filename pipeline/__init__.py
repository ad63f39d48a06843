"""voxmill's pure library: audio, features, models, sessions, extraction, corpora.

Importing it is cheap; `Extractor` (and ONNX Runtime with it) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.errors import VoxmillError
from pipeline.records import ModelRef, ShardResult, ShardSpec, TaskResult, Utterance

if TYPE_CHECKING:
    from pipeline.extractor import Extractor

__all__ = ["Extractor", "ModelRef", "ShardResult", "ShardSpec", "TaskResult", "Utterance", "VoxmillError"]


def __getattr__(name: str) -> Any:
    if name == "Extractor":
        from pipeline.extractor import Extractor

        return Extractor
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
