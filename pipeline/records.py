"""Plain data records passed between the pure functions and over the wire.

Every record is a frozen dataclass of JSON-native fields with `to_dict`/`from_dict`.
Records carry paths, never samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeline.errors import ErrorRecord

OPS = ("tokenize", "embed", "extract")
ROLE_TOKENIZER = "tokenizer"
ROLE_EMBEDDER = "embedder"
ROLES = (ROLE_TOKENIZER, ROLE_EMBEDDER)
ROLES_BY_OP: dict[str, tuple[str, ...]] = {
    "tokenize": (ROLE_TOKENIZER,),
    "embed": (ROLE_EMBEDDER,),
    "extract": (ROLE_TOKENIZER, ROLE_EMBEDDER),
}


def encodable(text: object) -> bool:
    """Whether `text` is a string a record's file can hold: UTF-8 encodable (a JSON escape such as
    \\ud800 gives a lone surrogate, which is not)."""
    if not isinstance(text, str):
        return False
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Utterance:
    """One clip of a corpus: a whole file (or object URL), or the segment [start_s, end_s) of a
    recording (Kaldi `segments`, lhotse supervisions); `channel` picks one channel (None: the mean
    of all). `end_s` None: to the end of the recording.

    >>> Utterance(utt="spk1/a", path="/data/spk1/a.wav", spk="spk1", text="hello")
    """

    utt: str
    path: str
    spk: str = ""
    text: str = ""
    duration_s: float | None = None
    start_s: float | None = None
    end_s: float | None = None
    channel: int | None = None

    @property
    def is_segment(self) -> bool:
        return self.start_s is not None or self.end_s is not None or self.channel is not None

    def to_dict(self) -> dict[str, Any]:
        # Spelled out, not `asdict` (which copies deeply): the driver writes one per utterance.
        data: dict[str, Any] = {
            "utt": self.utt,
            "path": self.path,
            "spk": self.spk,
            "text": self.text,
            "duration_s": self.duration_s,
        }
        if self.is_segment:  # only a segment names its range: a whole file's message stays small
            data.update(start_s=self.start_s, end_s=self.end_s, channel=self.channel)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Utterance:
        return cls(
            utt=str(data["utt"]),
            path=str(data["path"]),
            spk=str(data.get("spk") or ""),
            text=str(data.get("text") or ""),
            duration_s=None if data.get("duration_s") is None else float(data["duration_s"]),
            start_s=None if data.get("start_s") is None else float(data["start_s"]),
            end_s=None if data.get("end_s") is None else float(data["end_s"]),
            channel=None if data.get("channel") is None else int(data["channel"]),
        )

    def copy_with(self, **changes: Any) -> Utterance:
        return replace(self, **changes)


@dataclass(frozen=True)
class ModelRef:
    """Which model file, by content, produced a result, and how it ran: the provider actually used
    (`CPUExecutionProvider`, `TensorrtExecutionProvider (fp16)`...) and the ONNX Runtime version.
    A batch file (`speech_tokenizer_v2.batch.onnx`) is named as itself, with `twin_sha256` the
    single-clip file whose weights it holds: one model, two files (`model_sha256`).

    >>> ModelRef(role="embedder", file="campplus.onnx", sha256="ab12...")
    """

    role: str
    file: str
    sha256: str
    provider: str = ""
    onnxruntime: str = ""
    twin_sha256: str = ""  # a batch file's: the sha256 of the single-clip file it is the twin of

    @property
    def model_sha256(self) -> str:
        """The model, whichever of its files ran: a batch twin counts as its single-clip file."""
        return self.twin_sha256 or self.sha256

    def to_dict(self) -> dict[str, str]:
        ran = {"provider": self.provider, "onnxruntime": self.onnxruntime, "twin_sha256": self.twin_sha256}
        return {"file": self.file, "sha256": self.sha256, **{k: v for k, v in ran.items() if v}}

    @classmethod
    def from_dict(cls, role: str, data: dict[str, str]) -> ModelRef:
        return cls(
            role=role,
            file=data["file"],
            sha256=data["sha256"],
            provider=data.get("provider", ""),
            onnxruntime=data.get("onnxruntime", ""),
            twin_sha256=data.get("twin_sha256", ""),
        )


def models_to_dict(models: dict[str, ModelRef]) -> dict[str, dict[str, str]]:
    """The wire form of a result's models: `{role: {"file", "sha256", ...}}`."""
    return {role: ref.to_dict() for role, ref in models.items()}


def models_from_dict(data: dict[str, dict[str, str]] | None) -> dict[str, ModelRef]:
    return {role: ModelRef.from_dict(role, ref) for role, ref in (data or {}).items()}


def error_from_dict(data: dict[str, str] | None) -> ErrorRecord | None:
    return None if data is None else ErrorRecord.from_dict(data)


@dataclass(frozen=True)
class ShardSpec:
    """One unit of corpus work: some utterances, one op, one output file.

    `run` names the run whose driver hears of the shard once its file is written ('' : nobody).
    `out_dir` is a folder or an object-store URL (`s3://bucket/run`). `tar`, when set, is a
    WebDataset tar shard (path or URL) whose samples are the shard's utterances, known only once
    it is read (`utts` is then empty).

    >>> ShardSpec(shard=3, op="embed", out_dir="/runs/x", utts=[Utterance("a", "/d/a.wav")])
    """

    shard: int
    op: str
    out_dir: str
    utts: list[Utterance] = field(default_factory=list)
    run: str = ""
    tar: str = ""

    @property
    def name(self) -> str:
        return f"{self.op}-{self.shard:06d}"

    @property
    def audio_s(self) -> float:
        """Seconds of audio in the shard, as far as the plan knows (unknown durations count 0)."""
        return sum(u.duration_s or 0.0 for u in self.utts)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "shard": self.shard,
            "op": self.op,
            "out_dir": self.out_dir,
            "utts": [u.to_dict() for u in self.utts],
            "run": self.run,
        }
        if self.tar:
            data["tar"] = self.tar
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSpec:
        return cls(
            shard=int(data["shard"]),
            op=str(data["op"]),
            out_dir=str(data["out_dir"]),
            utts=[Utterance.from_dict(u) for u in data["utts"]],
            run=str(data.get("run") or ""),
            tar=str(data.get("tar") or ""),
        )


@dataclass(frozen=True)
class ShardResult:
    """What a shard task announces once its file is written: counts, where the file is, the
    models used; or, with `error`, why the whole shard could not be done."""

    shard: int
    op: str
    path: str
    ok: int
    failed: int
    audio_seconds: float
    seconds: float
    models: dict[str, ModelRef] = field(default_factory=dict)
    error: ErrorRecord | None = None

    @property
    def name(self) -> str:
        return f"{self.op}-{self.shard:06d}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["models"] = models_to_dict(self.models)
        data["error"] = None if self.error is None else self.error.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardResult:
        return cls(
            shard=int(data["shard"]),
            op=str(data["op"]),
            path=str(data["path"]),
            ok=int(data["ok"]),
            failed=int(data["failed"]),
            audio_seconds=float(data["audio_seconds"]),
            seconds=float(data["seconds"]),
            models=models_from_dict(data.get("models")),
            error=error_from_dict(data.get("error")),
        )


@dataclass(frozen=True)
class TaskResult:
    """The contract's result object for one input (DESIGN.md, `voxmill submit`).

    >>> TaskResult(input="a.wav", op="tokenize", speech_token=[1, 2], audio_seconds=0.1)
    """

    input: str
    op: str
    speech_token: list[int] | None = None
    embedding: list[float] | None = None
    audio_seconds: float | None = None
    models: dict[str, ModelRef] = field(default_factory=dict)
    error: ErrorRecord | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    # Wave 2: the clip's quality statistics (pipeline/audio/quality.py `STAT_FIELDS`), also for a clip
    # refused after decoding (`no_speech`); None when it was never decoded.
    stats: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["models"] = models_to_dict(self.models)
        data["error"] = None if self.error is None else self.error.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskResult:
        return cls(
            input=str(data["input"]),
            op=str(data["op"]),
            speech_token=data.get("speech_token"),
            embedding=data.get("embedding"),
            audio_seconds=data.get("audio_seconds"),
            models=models_from_dict(data.get("models")),
            error=error_from_dict(data.get("error")),
            timings_ms=dict(data.get("timings_ms") or {}),
            stats=None if data.get("stats") is None else dict(data["stats"]),
        )
