"""Every error voxmill reports, under one root that carries a stable code.

Codes are part of the contract (DESIGN.md): add new ones, never rename.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_FOUND = "not_found"
FORBIDDEN_PATH = "forbidden_path"
UNREADABLE = "unreadable"
EMPTY = "empty"
TOO_SHORT = "too_short"
TOO_LONG = "too_long"
TOO_LARGE = "too_large"
NON_FINITE = "non_finite"
UNSUPPORTED_RATE = "unsupported_rate"
MODEL_ERROR = "model_error"
# Extensions beyond the design's first list.
BAD_REQUEST = "bad_request"
OUTPUT_ERROR = "output_error"
INTERNAL = "internal"
# Wave 2: detected speech shorter than `min_speech_ms` (pipeline/audio/vad.py).
NO_SPEECH = "no_speech"
# Wave 2: an object store refused the request or could not be reached (pipeline/storage/objects.py).
STORE_ERROR = "store_error"
# Wave 2: an utterance left out of a corpus's features by a quality filter (pipeline/audio/quality.py).
FILTERED = "filtered"
# Wave 3: samples beyond `max_amplitude` after the decoder's own scaling: numbers, not audio.
OUT_OF_RANGE = "out_of_range"
# The producer gave up waiting for a job's result (`Client`): never a worker's answer.
TIMEOUT = "timeout"
# A command cannot go on (these end a command with exit status 1 or 2; no result carries them).
RUN_ERROR = "run_error"  # a corpus run: bad listing, output not writable, another run in the folder
NO_BROKER = "no_broker"  # no broker URL configured where a command needs one
NO_CONSUMER = "no_consumer"  # no live worker consumes the queue a job needs
PROCESS_EXITED = "process_exited"  # a process voxmill started (embedded Redis, a worker) exited

CODES: tuple[str, ...] = (
    NOT_FOUND,
    FORBIDDEN_PATH,
    UNREADABLE,
    EMPTY,
    TOO_SHORT,
    TOO_LONG,
    TOO_LARGE,
    NON_FINITE,
    UNSUPPORTED_RATE,
    MODEL_ERROR,
    BAD_REQUEST,
    OUTPUT_ERROR,
    INTERNAL,
    NO_SPEECH,
    STORE_ERROR,
    FILTERED,
    OUT_OF_RANGE,
    TIMEOUT,
    RUN_ERROR,
    NO_BROKER,
    NO_CONSUMER,
    PROCESS_EXITED,
)


@dataclass(frozen=True)
class ErrorRecord:
    """An error as a result carries it across processes: its stable code and a person's message.

    >>> ErrorRecord("not_found", "no such file: a.wav").to_dict()
    {'code': 'not_found', 'message': 'no such file: a.wav'}
    """

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """The wire form: `{"code", "message"}`."""
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> ErrorRecord:
        return cls(str(data["code"]), str(data["message"]))


class VoxmillError(Exception):
    """A failure with a stable `code` and a message a person understands."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def record(self) -> ErrorRecord:
        """What a result carries of this error."""
        return ErrorRecord(self.code, self.message)

    def to_dict(self) -> dict[str, str]:
        """The wire form: `{"code", "message"}`."""
        return self.record().to_dict()

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> VoxmillError:
        """Inverse of `to_dict`."""
        return cls(data["code"], data["message"])


class ModelUnavailable(VoxmillError):
    """A model this work needs has no loaded session in this process (yet): the work may be tried
    again once it loads (a worker retries it, then answers `model_error`)."""

    def __init__(self, message: str) -> None:
        super().__init__(MODEL_ERROR, message)


class RunError(VoxmillError):
    """The run cannot go on (bad input, output not writable, a different run in the folder);
    `code`: a more telling one of the catalogue's (`no_consumer`), else `run_error`."""

    def __init__(self, message: str, code: str = RUN_ERROR) -> None:
        super().__init__(code, message)
