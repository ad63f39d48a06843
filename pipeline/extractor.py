"""In-process extraction: `Extractor.from_model_dir(dir).tokenize(audio)`, no queue involved.

from pipeline import Extractor
with Extractor.from_model_dir("pretrained_models/CosyVoice2-0.5B", provider="cpu") as ex:
    tokens = ex.tokenize("prompt.wav")     # list[int], 25 per second
    emb = ex.embed("prompt.wav")           # numpy float32 [192]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.audio.decode import load_audio
from pipeline.errors import VoxmillError
from pipeline.inference import embed, open_session, tokenize
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER, ROLES
from pipeline.settings import AudioLimits

AudioInput = str | Path | bytes | npt.NDArray[np.floating]


class Extractor:
    """Warm sessions for the tokenizer and/or the embedder of one model folder."""

    def __init__(self, sessions: dict[str, ModelSession], limits: AudioLimits | None = None) -> None:
        self.sessions = sessions
        self.limits = limits or AudioLimits()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        provider: str = "cpu",
        roles: Sequence[str] = ROLES,
        *,
        intra_op_threads: int = 1,
        limits: AudioLimits | None = None,
        registry: Registry | None = None,
    ) -> Extractor:
        """Load and warm up the models of `roles` found in `model_dir` (a CosyVoice folder works)."""
        registry = registry or Registry.load()
        options = SessionOptions(provider=provider, intra_op_threads=intra_op_threads)
        folder = Path(model_dir)
        sessions = {
            role: open_session(registry.find_model(role, folder), role, options, registry) for role in roles
        }
        return cls(sessions, limits)

    def _session(self, role: str) -> ModelSession:
        if role not in self.sessions:
            raise VoxmillError(errors.MODEL_ERROR, f"this Extractor was built without the {role} model")
        return self.sessions[role]

    def wave(self, audio: AudioInput) -> npt.NDArray[np.float32]:
        """16 kHz mono float32 samples of a path, raw file bytes, or an array already at 16 kHz."""
        if isinstance(audio, np.ndarray):
            return np.ascontiguousarray(audio, dtype=np.float32).reshape(-1)
        return load_audio(audio, self.limits).samples

    def tokenize(self, audio: AudioInput) -> list[int]:
        """Speech tokens (CosyVoice's `speech_token`)."""
        return tokenize(self._session(ROLE_TOKENIZER), self.wave(audio))

    def embed(self, audio: AudioInput) -> npt.NDArray[np.float32]:
        """Speaker embedding, float32 [192] (CosyVoice's `embedding`)."""
        return embed(self._session(ROLE_EMBEDDER), self.wave(audio))

    def close(self) -> None:
        """Release every session."""
        for session in self.sessions.values():
            session.close()
        self.sessions = {}

    def __enter__(self) -> Extractor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
