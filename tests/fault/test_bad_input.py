"""The bad-input catalogue: every kind of broken, hostile or unusual input gets a stable code.

Each case is built in a temporary folder (small files; sparse files for the big ones) and goes
(a) through the producer `Client` by path and, where it makes sense, by bytes, and (b) into one
`voxmill extract` run whose single shard per op mixes every bad file with good ones (a JSONL
manifest, so it can also name directories, missing paths, `..` paths, paths outside the roots,
symlinks and FIFOs). Wire-level cases (a payload over the size limit, wrong field types, a
malformed call, an unknown content type, a body that is not JSON) are sent straight to the queue.

The same two worker processes serve all of it: at the end they have the same PIDs and still
serve a good job. `docs/bad-input.md` holds the table these runs produce; regenerate it with

    UPDATE_BAD_INPUT_DOC=1 .venv/bin/python -m pytest tests/fault/test_bad_input.py
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import redis
import soundfile as sf
from kombu import Connection, Exchange, Producer

from pipeline.audio.decode import load_audio
from pipeline.demo import speechlike
from pipeline.errors import VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.records import TaskResult
from pipeline.settings import AudioLimits
from tests import speech_audio
from tests.conftest import flush_keeping_claim, make_settings, voxmill, wait_for
from tests.helpers import worker_dicts
from workers.embedded import LocalWorkers
from workers.keys import QUEUES
from workers.queue.client import Client

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"
DOC_START, DOC_END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"
UPDATE_DOC_ENV = "UPDATE_BAD_INPUT_DOC"
OK = "ok"
SAME = "same"  # the bytes payload gets the same code as the path
RATE = 16000
THREE_HOURS_S = 3 * 3600
TWO_GB = 2 * 1024**3
READ_BOUND = 1024 * 1024  # a refused huge file costs less than this in read() calls
JOB_TIMEOUT_S = 60.0
WORKERS = 2


# --------------------------------------------------------------------------- building inputs


def speech(seconds: float = 1.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    return speechlike(seconds, rate, 120.0, seed=seed)


def encoded(samples: np.ndarray, rate: int = RATE, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, subtype=subtype, format=fmt)
    return buffer.getvalue()


def pcm16_header(rate_hz: int, channels: int, data_bytes: int) -> bytes:
    """A canonical 44-byte WAV header for 16-bit PCM claiming `data_bytes` of samples."""
    block = 2 * channels
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, rate_hz, rate_hz * block, block, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def sparse_wav(path: Path, rate_hz: int, total_bytes: int) -> None:
    """A WAV header followed by a hole: `total_bytes` long on paper, a few KB on disk."""
    with path.open("wb") as handle:
        handle.write(pcm16_header(rate_hz, 1, total_bytes - 44))
        handle.truncate(total_bytes)


def corrupt_middle(data: bytes, length: int, seed: int = 0) -> bytes:
    """`data` with `length` random bytes written over its middle."""
    junk = np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()
    middle = len(data) // 2
    return data[:middle] + junk + data[middle + length :]


@dataclass(frozen=True)
class Place:
    """Where inputs are built: `folder` lies inside the allowed root, `outside` does not."""

    folder: Path
    outside: Path

    def write(self, name: str, data: bytes) -> Path:
        path = self.folder / name
        path.write_bytes(data)
        return path

    def outside_audio(self) -> Path:
        path = self.outside / "elsewhere.wav"
        if not path.exists():
            path.write_bytes(encoded(speech(seed=9)))
        return path


def nonfinite(value: float) -> bytes:
    samples = speech()
    samples[100] = value
    return encoded(samples, subtype="FLOAT")


def wav_claiming_more_data(place: Place) -> Path:
    data = bytearray(encoded(speech()))
    data[40:44] = struct.pack("<I", 10 * len(data))  # the data chunk says 10x what follows
    return place.write("claims_more.wav", bytes(data))


def three_hour_wav(place: Place) -> Path:
    path = place.folder / "three_hours.wav"
    sparse_wav(path, 8000, 44 + THREE_HOURS_S * 8000 * 2)  # 8 kHz 16-bit: 173 MB, under the size limit
    return path


def two_gb_wav(place: Place) -> Path:
    path = place.folder / "two_gb.wav"
    sparse_wav(path, RATE, TWO_GB)
    return path


def fifo(place: Place) -> Path:
    path = place.folder / "fifo.wav"
    os.mkfifo(path)
    return path


def char_device(place: Place) -> Path | None:
    """A character device (like /dev/zero) inside the root, when this process may create one."""
    path = place.folder / "device.wav"
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except (PermissionError, OSError):
        return None
    return path


def directory(place: Place) -> Path:
    path = place.folder / "folder.wav"
    path.mkdir()
    return path


def symlink(place: Place, name: str, target: Path) -> Path:
    path = place.folder / name
    path.symlink_to(target)
    return path


def broken_mp3(place: Place) -> Path:
    return place.write(
        "broken_frame.mp3", corrupt_middle(encoded(speech(3.0), fmt="MP3", subtype="MPEG_LAYER_III"), 400)
    )


def ogg_with_garbage(place: Place) -> Path:
    junk = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    return place.write("garbage_after.ogg", encoded(speech(), fmt="OGG", subtype="VORBIS") + junk)


def corrupt_flac(place: Place) -> Path:
    return place.write("corrupt.flac", corrupt_middle(encoded(speech(), fmt="FLAC"), 300))


def flac_8ch_192k_long(place: Place) -> Path:
    """Issue 31's FLAC: 8 channels at 192 kHz, 599 s of a constant signal (952 KB, 3.4 GB decoded)."""
    path = place.folder / "eight_channels_192k.flac"
    second = np.full((192000, 8), 0.25, dtype=np.float32)
    with sf.SoundFile(path, "w", 192000, 8, format="FLAC", subtype="PCM_16") as sound:
        for _ in range(599):
            sound.write(second)
    return path


def beyond_full_scale(peak: float, channels: int = 1) -> bytes:
    """A 32-bit float WAV of speech scaled to `peak` (1.0 is full scale): numbers, not audio."""
    samples = speech().astype(np.float64)
    samples = (samples / np.max(np.abs(samples)) * peak).astype(np.float32)
    return encoded(np.stack([samples] * channels, axis=1) if channels > 1 else samples, subtype="FLOAT")


# --------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Case:
    """One input: how it is built, the code it must get and a fragment of its message.

    `by_bytes`: the expected code when the file's bytes are sent instead of its path (`SAME`:
    as by path; None: not sent as bytes, e.g. a directory). `bytes_fragment` when it differs.
    """

    name: str
    title: str
    build: Callable[[Place], Path | None]
    code: str
    fragment: str = ""
    by_bytes: str | None = SAME
    bytes_fragment: str | None = None
    audio_seconds: float | None = None


def file_case(
    name: str, title: str, data: Callable[[], bytes], code: str, fragment: str = "", **kw: Any
) -> Case:
    suffix = kw.pop("suffix", ".wav")
    return Case(name, title, lambda place: place.write(name + suffix, data()), code, fragment, **kw)


CASES: list[Case] = [
    file_case(
        "good_pcm16", "16-bit PCM WAV, 1 s (the baseline)", lambda: encoded(speech()), OK, audio_seconds=1.0
    ),
    file_case(
        "zero_bytes",
        "zero-byte file",
        lambda: b"",
        "empty",
        "is empty (0 bytes)",
        bytes_fragment="payload is empty",
    ),
    file_case(
        "text_as_wav",
        "text file named .wav",
        lambda: b"this is not audio\n" * 20,
        "unreadable",
        "it looks like a text file",
    ),
    file_case(
        "truncated_header",
        "WAV cut inside its header (first 30 bytes)",
        lambda: encoded(speech())[:30],
        "unreadable",
        "not a recognised audio file",
    ),
    file_case(
        "header_only",
        "WAV header with no sample data",
        lambda: encoded(speech())[:44],
        "empty",
        "no audio frames",
    ),
    Case(
        "claims_more",
        "WAV whose header claims 10x more data than present",
        wav_claiming_more_data,
        OK,
        audio_seconds=1.0,
    ),
    file_case(
        "clip_10ms",
        "10 ms clip",
        lambda: encoded(speech()[:160]),
        "too_short",
        "clip is 10 ms; at least 80 ms of audio is needed",
    ),
    file_case("clip_79ms", "79 ms clip", lambda: encoded(speech()[:1264]), "too_short", "clip is 79 ms"),
    file_case(
        "clip_80ms",
        "80 ms clip (exactly the limit)",
        lambda: encoded(speech()[:1280]),
        OK,
        audio_seconds=0.08,
    ),
    file_case("clip_81ms", "81 ms clip", lambda: encoded(speech()[:1296]), OK, audio_seconds=0.081),
    file_case(
        "all_zero",
        "all-zero audio (digital silence)",
        lambda: encoded(np.zeros(RATE)),
        "empty",
        "digital silence",
    ),
    file_case(
        "nan_samples",
        "32-bit float WAV with a NaN sample",
        lambda: nonfinite(np.nan),
        "non_finite",
        "1 non-finite samples",
    ),
    file_case(
        "inf_samples",
        "32-bit float WAV with an Inf sample",
        lambda: nonfinite(np.inf),
        "non_finite",
        "1 non-finite samples",
    ),
    file_case(
        "pcm_u8", "8-bit unsigned PCM WAV", lambda: encoded(speech(), subtype="PCM_U8"), OK, audio_seconds=1.0
    ),
    file_case("pcm_24", "24-bit PCM WAV", lambda: encoded(speech(), subtype="PCM_24"), OK, audio_seconds=1.0),
    file_case(
        "float32", "32-bit float WAV", lambda: encoded(speech(), subtype="FLOAT"), OK, audio_seconds=1.0
    ),
    file_case(
        "float64", "64-bit float WAV", lambda: encoded(speech(), subtype="DOUBLE"), OK, audio_seconds=1.0
    ),
    file_case(
        "rate_4k",
        "4 kHz WAV",
        lambda: encoded(speech(rate=4000), 4000),
        "unsupported_rate",
        "sample rate 4000 Hz is not supported; 8000-192000 Hz are",
    ),
    file_case("rate_8k", "8 kHz WAV", lambda: encoded(speech(rate=8000), 8000), OK, audio_seconds=1.0),
    file_case(
        "rate_192k", "192 kHz WAV", lambda: encoded(speech(rate=192000), 192000), OK, audio_seconds=1.0
    ),
    file_case(
        "rate_384k",
        "384 kHz WAV",
        lambda: encoded(speech(0.5, rate=384000), 384000),
        "unsupported_rate",
        "384000 Hz is not supported",
    ),
    file_case(
        "six_channels",
        "6-channel WAV",
        lambda: encoded(np.stack([speech()] * 6, axis=1)),
        OK,
        audio_seconds=1.0,
    ),
    Case(
        "three_hours",
        "3-hour WAV (sparse, 173 MB on paper)",
        three_hour_wav,
        "too_long",
        "clip is 3 h 0 min; the limit is 10 min",
        by_bytes=None,
    ),
    Case(
        "two_gb",
        "2 GB file (sparse)",
        two_gb_wav,
        "too_large",
        "file is 2.0 GB; the limit is 256 MB",
        by_bytes=None,
    ),
    Case(
        "directory",
        "a directory (named folder.wav)",
        directory,
        "unreadable",
        "is a directory, not an audio file",
        by_bytes=None,
    ),
    Case(
        "missing",
        "a missing path",
        lambda place: place.folder / "missing.wav",
        "not_found",
        "no such file",
        by_bytes=None,
    ),
    Case(
        "dotdot_escape",
        "a path with `..` leading out of the root",
        lambda place: place.folder / ".." / ".." / place.outside.name / place.outside_audio().name,
        "forbidden_path",
        "is outside the allowed roots",
        by_bytes=None,
    ),
    Case(
        "dotdot_inside",
        "a path with `..` that stays inside the root",
        lambda place: place.folder / "sub" / ".." / "good_pcm16.wav",
        OK,
        by_bytes=None,
        audio_seconds=1.0,
    ),
    Case(
        "outside_abs",
        "an absolute path outside the allowed roots",
        lambda place: place.outside_audio(),
        "forbidden_path",
        "is outside the allowed roots",
        by_bytes=None,
    ),
    Case(
        "symlink_outside",
        "a symlink inside the root pointing outside",
        lambda place: symlink(place, "escape.wav", place.outside_audio()),
        "forbidden_path",
        "is outside the allowed roots",
        by_bytes=None,
    ),
    Case(
        "symlink_inside",
        "a symlink inside the root pointing inside",
        lambda place: symlink(place, "alias.wav", place.folder / "good_pcm16.wav"),
        OK,
        by_bytes=None,
        audio_seconds=1.0,
    ),
    Case(
        "unicode_spaces",
        "unicode and spaces in the name (`grüße 音声 clip.wav`)",
        lambda place: place.write("grüße 音声 clip.wav", encoded(speech())),
        OK,
        audio_seconds=1.0,
    ),
    Case("fifo", "a FIFO named .wav", fifo, "unreadable", "is not a regular file (a FIFO)", by_bytes=None),
    Case(
        "char_device",
        "a character device (/dev/zero's numbers) named .wav",
        char_device,
        "unreadable",
        "is not a regular file (a character device)",
        by_bytes=None,
    ),
    Case("mp3_broken_frame", "MP3 (3 s) with 400 random bytes over a frame in the middle", broken_mp3, OK),
    Case("ogg_garbage", "Ogg Vorbis with 4 KB of garbage appended", ogg_with_garbage, OK, audio_seconds=1.0),
    Case(
        "flac_corrupt",
        "FLAC with 300 random bytes over a frame in the middle",
        corrupt_flac,
        "unreadable",
        "could not be decoded",
    ),
    Case(
        "flac_8ch_192k_long",
        "FLAC, 8 channels at 192 kHz, 599 s of a constant signal (952 KB; 3.4 GB decoded)",
        flac_8ch_192k_long,
        "too_large",
        "decoding would take 3.4 GB (8 channels at 192000 Hz for 9 min 59 s); the limit is 256 MB",
    ),
    file_case(
        "float_1e30",
        "32-bit float WAV of speech peaking at 1e30",
        lambda: beyond_full_scale(1e30),
        "out_of_range",
        "clip has a sample of magnitude 1e+30; the limit is 100 (1.0 is full scale)",
    ),
    file_case(
        "float_3e38_stereo",
        "stereo 32-bit float WAV peaking at 3e38 (the channels' mean overflows float32)",
        lambda: beyond_full_scale(3e38, channels=2),
        "out_of_range",
        "clip has a sample of magnitude 3e+38",
    ),
]
CASE_NAMES = [case.name for case in CASES]
GOOD_UTTS = [f"good_{i}" for i in range(4)]  # spread through the corpus around the bad files


def build_inputs(place: Place) -> dict[str, Path]:
    """Write every case's input; {case name: path}. A case that cannot be built here is left out."""
    place.folder.mkdir(parents=True, exist_ok=True)
    (place.folder / "sub").mkdir(exist_ok=True)
    paths: dict[str, Path] = {}
    for case in CASES:
        path = case.build(place)
        if path is not None:
            paths[case.name] = path
    for index, utt in enumerate(GOOD_UTTS):
        place.write(f"{utt}.wav", encoded(speech(1.0 + 0.5 * index, seed=100 + index)))
    return paths


# --------------------------------------------------------------------------- one run of everything


@dataclass
class Observed:
    """What one path, bytes or corpus run gave for a case: (code, message), with `ok` for success."""

    code: str
    message: str = ""
    audio_seconds: float | None = None
    result: TaskResult | None = None


@dataclass
class Run:
    """Everything the catalogue run observed."""

    root: Path
    outside: Path
    paths: dict[str, Path]
    by_path: dict[str, Observed] = field(default_factory=dict)
    by_bytes: dict[str, Observed] = field(default_factory=dict)
    by_cli: dict[str, str] = field(default_factory=dict)
    cli_exit: int = -1
    corpus_out: Path | None = None
    corpus_exit: int = -1
    corpus_stderr: str = ""
    wire: dict[str, Observed] = field(default_factory=dict)
    huge_read_bytes: int = -1
    worker_pids_before: set[int] = field(default_factory=set)
    workers: LocalWorkers | None = None
    settings: Any = None
    redis_url: str = ""

    def normalise(self, text: str) -> str:
        """Messages with this run's temporary folders replaced by `<root>` and `<outside>`."""
        for folder, tag in ((self.root, "<root>"), (self.outside, "<outside>")):
            text = text.replace(str(folder.resolve()), tag).replace(str(folder), tag)
        return text


def observed(result: TaskResult) -> Observed:
    if result.error:
        return Observed(result.error.code, result.error.message, result=result)
    return Observed(OK, "", result.audio_seconds, result)


def children_of(client: redis.Redis, parent_pid: int) -> set[int]:
    return {r["pid"] for r in worker_dicts(client) if r.get("ppid") == parent_pid}


def read_chars(pids: set[int]) -> int:
    """Bytes the processes passed through read() calls so far (Linux /proc/PID/io `rchar`)."""
    return sum(psutil.Process(pid).io_counters().read_chars for pid in pids)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_models: Path) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("badinput")
    outside = tmp_path_factory.mktemp("outside")
    place = Place(root / "in", outside)
    paths = build_inputs(place)
    settings = make_settings(redis_url, tiny_models, [root])
    client_redis = redis.Redis.from_url(redis_url)
    flush_keeping_claim(client_redis)
    workers = LocalWorkers(settings, WORKERS, QUEUES, log_path=root / "worker.log")
    workers.start()
    try:
        workers.wait_ready(120)
        assert workers.process is not None
        state = Run(root, outside, paths, workers=workers, settings=settings, redis_url=redis_url)
        state.worker_pids_before = children_of(client_redis, workers.process.pid)
        client = Client(settings)
        submit_huge(state, client)
        submit_catalogue(state, client)
        send_wire_cases(state, client)
        run_cli(state)
        run_corpus(state, place)
        yield state
    finally:
        workers.stop()
        flush_keeping_claim(client_redis)
        client_redis.close()


def submit_huge(state: Run, client: Client) -> None:
    """The 3-hour and 2 GB files alone on idle workers, counting what the workers read meanwhile."""
    pids = state.worker_pids_before
    before = read_chars(pids)
    jobs = [client.submit("extract", state.paths[name]) for name in ("three_hours", "two_gb")]
    client.wait_all(jobs, JOB_TIMEOUT_S)
    state.huge_read_bytes = read_chars(pids) - before


def submit_catalogue(state: Run, client: Client) -> None:
    """Every case by path, and by bytes where it makes sense, in one batch."""
    jobs, keys = [], []
    for case in CASES:
        path = state.paths.get(case.name)
        if path is None:
            continue
        jobs.append(client.submit("extract", path))
        keys.append(("path", case.name))
        if case.by_bytes is not None:
            jobs.append(client.submit("extract", path.read_bytes(), name=f"bytes:{case.name}"))
            keys.append(("bytes", case.name))
    for (how, name), result in zip(keys, client.wait_all(jobs, JOB_TIMEOUT_S), strict=True):
        (state.by_path if how == "path" else state.by_bytes)[name] = observed(result)


def send_wire_cases(state: Run, client: Client) -> None:
    """Messages no well-behaved producer sends: too big, wrong types, wrong shape, wrong encoding."""
    app = client.app
    limit = AudioLimits().max_payload_bytes
    big = pcm16_header(RATE, 1, limit) + bytes(limit)  # a valid WAV, 32 MB of silence + header
    state.wire["payload_over_limit"] = observed(client.wait_all([client.submit("embed", big, name="big")])[0])
    wrong_types: list[tuple[str, Any]] = [
        ("path_is_int", {"path": 5}),
        ("path_is_list", {"path": ["a.wav"]}),
        ("audio_is_str", {"audio": "UklGRg=="}),
        ("name_is_int", {"audio": b"RIFF", "name": 7}),
        ("job_is_list", ["a.wav"]),
        ("no_known_field", {"file": "a.wav"}),
        ("path_has_nul", {"path": "a\x00b.wav"}),
        ("path_too_long", {"path": "a/" * 500_000 + "b.wav"}),
        ("name_too_long", {"audio": b"RIFF", "name": "n" * 200_000}),
    ]
    for name, payload in wrong_types:
        serializer = "msgpack" if name.startswith("name_") else "json"
        value = app.send_task("voxmill.embed", args=[payload], queue="embed", serializer=serializer)
        state.wire[name] = observed(TaskResult.from_dict(value.get(timeout=JOB_TIMEOUT_S)))
    call = app.send_task("voxmill.embed", args=[{"path": "a.wav"}, "extra"], queue="embed")
    state.wire["two_arguments"] = observed(TaskResult.from_dict(call.get(timeout=JOB_TIMEOUT_S)))
    send_undecodable(state, client)


UNKNOWN_TYPE = "application/x-voxmill-unknown"


def send_undecodable(state: Run, client: Client) -> None:
    """An unknown content type and a JSON body that does not parse: refused, logged, no result."""
    assert state.settings is not None
    with Connection(state.settings.broker_url) as conn:
        producer = Producer(conn, exchange=Exchange("embed", type="direct"), routing_key="embed")
        producer.publish(
            b"\x00\x01garbage",
            content_type=UNKNOWN_TYPE,
            content_encoding="binary",
            headers={"task": "voxmill.embed", "id": "unknown-type-1", "lang": "py"},
            declare=[],
        )
        producer.publish(
            b"{not json",
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "voxmill.embed", "id": "not-json-1", "lang": "py"},
            declare=[],
        )
    good = client.run("embed", [state.root / "in" / "good_0.wav"], timeout_s=JOB_TIMEOUT_S)[0]
    assert good.error is None, good.error
    assert state.workers is not None and state.workers.log_path is not None
    log_path = state.workers.log_path
    wait_for(lambda: "Can't decode message body" in log_path.read_text(errors="replace"), timeout_s=20)
    log = log_path.read_text(errors="replace")
    backend = client.app.backend
    for name, task_id, marker in (
        (
            "unknown_content_type",
            "unknown-type-1",
            f"Refusing to deserialize untrusted content of type {UNKNOWN_TYPE}",
        ),
        ("body_not_json", "not-json-1", "Can't decode message body"),
    ):
        stored = backend.client.get(backend.get_key_for_task(task_id))
        line = next((ln for ln in log.splitlines() if marker in ln), "")
        refused = "refused" if stored is None and line else "NOT REFUSED"
        state.wire[name] = Observed(refused, line.split("] ", 1)[-1].split(" [type:", 1)[0])


def run_cli(state: Run) -> None:
    """`voxmill submit extract PATH... --json` over every path case: the same codes as the Client."""
    assert state.settings is not None
    names = [case.name for case in CASES if case.name in state.paths]
    args = [str(state.paths[name]) for name in names]
    done = voxmill("submit", "extract", *args, "--json", env=state.settings.to_env(), timeout=120)
    state.cli_exit = done.returncode
    by_input = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        by_input[row["input"]] = row["error"]["code"] if row["error"] else OK
    state.by_cli = {name: by_input.get(arg, "missing") for name, arg in zip(names, args, strict=True)}


def run_corpus(state: Run, place: Place) -> None:
    """One `voxmill extract` over a manifest of every path case plus good files, one shard per op."""
    manifest = state.root / "manifest.jsonl"
    bad = [name for name in CASE_NAMES if name in state.paths]
    good_at = {round(i * len(bad) / (len(GOOD_UTTS) - 1)): utt for i, utt in enumerate(GOOD_UTTS)}
    entries = []
    for index in range(len(bad) + 1):
        if index in good_at:
            utt = good_at[index]
            entries.append({"utt": utt, "path": str(place.folder / f"{utt}.wav"), "spk": "good"})
        if index < len(bad):
            entries.append({"utt": bad[index], "path": str(state.paths[bad[index]]), "spk": "catalogue"})
    manifest.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
    out = state.root / "out"
    assert state.settings is not None
    done = voxmill(
        "extract",
        str(manifest),
        "--out",
        str(out),
        "--shard-size",
        str(len(entries)),
        "--quiet",
        env=state.settings.to_env(),
        timeout=180,
    )
    state.corpus_exit, state.corpus_stderr, state.corpus_out = done.returncode, done.stderr + done.stdout, out


# --------------------------------------------------------------------------- (a) through submit


def expected_bytes(case: Case) -> tuple[str, str]:
    assert case.by_bytes is not None
    code = case.code if case.by_bytes == SAME else case.by_bytes
    return code, case.bytes_fragment if case.bytes_fragment is not None else case.fragment


def check(seen: Observed, code: str, fragment: str, case: Case) -> None:
    assert seen.code == code, f"{case.name}: expected {code}, got {seen.code}: {seen.message}"
    assert fragment in seen.message, f"{case.name}: {fragment!r} not in {seen.message!r}"
    if code == OK:
        assert seen.result is not None
        assert seen.result.speech_token is not None and len(seen.result.embedding or []) == 192
        if case.audio_seconds is not None:
            assert seen.audio_seconds == pytest.approx(case.audio_seconds, abs=1e-3)
    else:
        assert len(seen.message) > 10 and "Traceback" not in seen.message
        assert ": )" not in seen.message, f"{case.name}: a reason is missing: {seen.message}"


@pytest.mark.parametrize("case", CASES, ids=CASE_NAMES)
def test_case_by_path(case: Case, run: Run) -> None:
    if case.name not in run.paths:
        pytest.skip(f"{case.title} cannot be created here")
    check(run.by_path[case.name], case.code, case.fragment, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.by_bytes is not None], ids=lambda c: c.name)
def test_case_by_bytes(case: Case, run: Run) -> None:
    code, fragment = expected_bytes(case)
    seen = run.by_bytes[case.name]
    check(seen, code, fragment, case)
    if code != OK:
        assert str(run.paths[case.name]) not in seen.message  # a payload has no path to name


def test_the_command_line_gives_the_same_codes(run: Run) -> None:
    assert run.by_cli == {name: run.by_path[name].code for name in run.by_cli}
    assert run.cli_exit == 1  # some inputs failed


def test_a_broken_mp3_frame_is_skipped_and_the_rest_decoded(run: Run) -> None:
    """mpg123 resynchronises after the damaged frame: accepted, a little shorter than 3 s."""
    seconds = run.by_path["mp3_broken_frame"].audio_seconds
    assert seconds is not None and 2.0 < seconds <= 3.05


def test_huge_files_are_refused_without_reading_their_data(run: Run) -> None:
    """The 3 h and 2 GB files (173 MB and 2 GB on paper) cost the workers less than 1 MB of reads."""
    assert run.by_path["three_hours"].code == "too_long" and run.by_path["two_gb"].code == "too_large"
    print(f"workers read {run.huge_read_bytes} bytes while refusing 2.2 GB of input")
    assert 0 <= run.huge_read_bytes < READ_BOUND, f"workers read {run.huge_read_bytes} bytes"


@pytest.mark.parametrize(("name", "code"), [("three_hours", "too_long"), ("two_gb", "too_large")])
def test_huge_files_are_refused_without_reading_their_data_in_process(
    name: str, code: str, tmp_path: Path
) -> None:
    place = Place(tmp_path, tmp_path)
    path = three_hour_wav(place) if name == "three_hours" else two_gb_wav(place)
    me = psutil.Process()
    before = me.io_counters().read_chars
    with pytest.raises(VoxmillError) as refused:
        load_audio(path, AudioLimits())
    assert refused.value.code == code
    assert me.io_counters().read_chars - before < READ_BOUND


# --------------------------------------------------------------------------- wire-level cases

WIRE_EXPECTED = {
    "payload_over_limit": ("too_large", "payload is 32.0 MB; the limit is 32 MB"),
    "path_is_int": ("bad_request", "'path' must be a string, not int"),
    "path_is_list": ("bad_request", "'path' must be a string, not list"),
    "audio_is_str": ("bad_request", "'audio' must be raw bytes (msgpack), not str"),
    "name_is_int": ("bad_request", "'name' must be a string, not int"),
    "job_is_list": ("bad_request", "job must be an object, not list"),
    "no_known_field": ("bad_request", "job needs 'path' (a string) or 'audio' (bytes)"),
    "path_has_nul": ("bad_request", "contains a NUL byte"),
    "path_too_long": ("bad_request", "'path' is 1000005 characters long; the limit is 4096"),
    "name_too_long": ("bad_request", "'name' is 200000 characters long; the limit is 4096"),
    "two_arguments": ("bad_request", "takes one job argument; got 2 positional"),
    "unknown_content_type": ("refused", f"untrusted content of type {UNKNOWN_TYPE}"),
    "body_not_json": ("refused", "Can't decode message body"),
}
WIRE_TITLES = {
    "payload_over_limit": (
        "bytes payload over `max_payload_bytes` (a valid 32 MB WAV): answered by the producer, nothing sent"
    ),
    "path_is_int": 'JSON job `{"path": 5}`',
    "path_is_list": 'JSON job `{"path": ["a.wav"]}`',
    "audio_is_str": 'JSON job `{"audio": "UklGRg=="}` (base64 text, not bytes)',
    "name_is_int": 'msgpack job `{"audio": <bytes>, "name": 7}`',
    "job_is_list": 'JSON job `["a.wav"]` (not an object)',
    "no_known_field": 'JSON job `{"file": "a.wav"}`',
    "path_has_nul": "JSON job whose path holds a NUL byte",
    "path_too_long": "JSON job whose path is `a/` 500,000 times (1 MB of slashes)",
    "name_too_long": "msgpack job whose name is 200,000 characters",
    "two_arguments": "task called with two arguments instead of one job",
    "unknown_content_type": f"message with content type `{UNKNOWN_TYPE}`",
    "body_not_json": "message claiming `application/json` whose body does not parse",
}


@pytest.mark.parametrize("name", list(WIRE_EXPECTED))
def test_wire_case(name: str, run: Run) -> None:
    code, fragment = WIRE_EXPECTED[name]
    seen = run.wire[name]
    assert seen.code == code, f"{name}: {seen.code}: {seen.message}"
    assert fragment in seen.message


# --------------------------------------------------------------------------- (b) inside a corpus shard


def corpus_outcomes(out: Path) -> dict[tuple[str, str], str]:
    """{(utt, op): code or ok} from the outputs of an extract run."""
    outcomes: dict[tuple[str, str], str] = {}
    for line in (out / "errors.jsonl").read_text().splitlines():
        error = json.loads(line)
        outcomes[(error["utt"], error["op"])] = error["code"]
    for name, op in (("speech_tokens.parquet", "tokenize"), ("utt_embeddings.parquet", "embed")):
        for row in pq.read_table(out / name).to_pylist():
            assert (row["utt"], op) not in outcomes, f"{row['utt']} is both an output and an error"
            outcomes[(row["utt"], op)] = OK
    return outcomes


def test_a_corpus_shard_mixing_bad_and_good_files(run: Run) -> None:
    assert run.corpus_exit == 0, run.corpus_stderr
    assert run.corpus_out is not None
    from pipeline.run.plan import PlanReader

    shards = list(PlanReader(RunFolder.of(run.corpus_out)).specs())
    assert len(shards) == 1  # one shard holds every file, bad and good (both ops: one extract task)
    assert {u.utt for u in shards[0].utts} >= set(GOOD_UTTS) | {"fifo", "two_gb", "missing"}
    outcomes = corpus_outcomes(run.corpus_out)
    expected = {(utt, op): OK for utt in GOOD_UTTS for op in ("tokenize", "embed")}
    for case in CASES:
        if case.name in run.paths:
            expected.update({(case.name, op): case.code for op in ("tokenize", "embed")})
    assert outcomes == expected
    errors = [json.loads(line) for line in (run.corpus_out / "errors.jsonl").read_text().splitlines()]
    by_utt = {e["utt"]: e["message"] for e in errors}
    for case in CASES:
        if case.name in by_utt:
            assert case.fragment in by_utt[case.name]
    report = json.loads((run.corpus_out / "report.json").read_text())
    ok = sum(1 for (_, op), code in expected.items() if op == "embed" and code == OK)
    assert report["ops"]["embed"] == {"ok": ok, "failed": len(run.paths) + len(GOOD_UTTS) - ok}


# --------------------------------------------------------------------------- nobody died


def test_no_worker_died_and_they_still_serve(run: Run) -> None:
    assert run.workers is not None and run.workers.process is not None and run.workers.alive()
    client = redis.Redis.from_url(run.redis_url)
    try:
        assert children_of(client, run.workers.process.pid) == run.worker_pids_before
    finally:
        client.close()
    result = Client(run.settings).run("extract", [run.root / "in" / "good_1.wav"], timeout_s=JOB_TIMEOUT_S)[0]
    assert result.error is None and len(result.embedding or []) == 192
    log = run.workers.log_path.read_text(errors="replace") if run.workers.log_path else ""
    for sign in ("WorkerLostError", "exited with 'signal", "Process 'ForkPoolWorker"):
        assert sign not in log


# --------------------------------------------------------------------------- the published table


def catalogue_rows(run: Run) -> list[tuple[str, str, str, str, str]]:
    """(input, code by path, message, bytes, corpus) for every case, wire cases last."""
    rows = []
    for case in CASES:
        if case.name not in run.paths:
            continue
        seen = run.by_path[case.name]
        message = (
            run.normalise(seen.message) if seen.message else f"accepted: {seen.audio_seconds:g} s decoded"
        )
        if case.by_bytes is None:
            as_bytes = "n/a"
        else:
            got = run.by_bytes[case.name]
            as_bytes = "same" if (got.code, got.message) == (seen.code, seen.message) else got.code
            if as_bytes not in ("same", OK):
                as_bytes += f": {got.message}"
        rows.append((case.title, seen.code, message, as_bytes, "same"))
    for name in WIRE_EXPECTED:
        seen = run.wire[name]
        message = seen.message if seen.code != "refused" else f"no result; worker log: {seen.message}"
        rows.append(
            (
                WIRE_TITLES[name],
                seen.code,
                message,
                "(bytes)" if name == "payload_over_limit" else "n/a",
                "n/a",
            )
        )
    return rows


CATALOGUE_HEADER = ("input", "code", "message (by path)", "by bytes", "in a corpus shard")


def render_table(
    rows: list[tuple[str, str, str, str, str]],
    header: tuple[str, ...] = CATALOGUE_HEADER,
    code_columns: tuple[int, ...] = (1,),
) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [cell.replace("|", "\\|").replace("\n", " ") for cell in row]
        for column in code_columns:
            cells[column] = f"`{cells[column]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def documented_codes(text: str) -> list[tuple[str, str]]:
    """(input, code) of each row of the catalogue table in docs/bad-input.md."""
    block = text.split(DOC_START, 1)[1].split(DOC_END, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")][2:]  # after header and rule
    cells = [row[2:].split(" | ") for row in rows]
    return [(row[0].strip(), row[1].strip().strip("`")) for row in cells]


def test_docs_table_matches_this_run(run: Run) -> None:
    """docs/bad-input.md lists every case with the code it really gets (messages regenerate on request)."""
    # The corpus column claims "same": check it is (codes per utt equal the path codes).
    assert run.corpus_out is not None
    outcomes = corpus_outcomes(run.corpus_out)
    for name in run.paths:
        assert outcomes[(name, "tokenize")] == run.by_path[name].code
    table = render_table(catalogue_rows(run))
    if os.environ.get(UPDATE_DOC_ENV):
        text = DOC.read_text()
        head, rest = text.split(DOC_START, 1)
        tail = rest.split(DOC_END, 1)[1]
        DOC.write_text(f"{head}{DOC_START}\n{table}\n{DOC_END}{tail}")
    rows = catalogue_rows(run)
    assert documented_codes(DOC.read_text()) == [(row[0], row[1]) for row in rows], (
        f"docs/bad-input.md is out of date; regenerate: {UPDATE_DOC_ENV}=1 pytest {Path(__file__).name}"
    )


def test_the_catalogue_is_at_least_25_cases() -> None:
    assert len(CASES) + len(WIRE_EXPECTED) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------- the speech check
#
# Audio that decodes fine but holds no speech. These cases go through `run_clip` (what every
# worker task runs) in this process, on the tiny stand-ins, with the speech check a worker builds
# from the default settings, and once more with `speech_check: false`. Real speech comes from
# espeak-ng; the cases that need it skip without it.

SPEECH_START, SPEECH_END = "<!-- speech:start -->", "<!-- speech:end -->"


@dataclass(frozen=True)
class SpeechCase:
    """One clip for the speech check: how it is made (from espeak-ng's speech, when it needs it)."""

    name: str
    title: str
    wave: Callable[[np.ndarray], np.ndarray]
    code: str
    fragment: str = ""
    needs_speech: bool = False


SPEECH_CASES: list[SpeechCase] = [
    SpeechCase(
        "silence_dither",
        "silence: 2 s of +-1 LSB 16-bit dither (about -95 dBFS; not all zero)",
        lambda s: speech_audio.dither(),
        "no_speech",
        "detected speech is 0 ms of a 2.00 s clip",
    ),
    SpeechCase(
        "hum_50hz",
        "hum: 50 Hz with its 3rd harmonic, 2 s at -13 dBFS",
        lambda s: speech_audio.hum(),
        "no_speech",
        "detected speech is 0 ms",
    ),
    SpeechCase(
        "tone_1khz",
        "pure tone: 1 kHz sine, 2 s at -9 dBFS",
        lambda s: speech_audio.tone(),
        "no_speech",
        "detected speech is 0 ms",
    ),
    SpeechCase(
        "white_noise",
        "white noise, 2 s at -20 dBFS",
        lambda s: speech_audio.white_noise(),
        "no_speech",
        "detected speech is 0 ms",
    ),
    SpeechCase(
        "single_click",
        "a single click: one sample at 0.9 in 2 s of digital silence",
        lambda s: speech_audio.click(),
        "no_speech",
        "detected speech is 0 ms",
    ),
    SpeechCase(
        "speechlike_1s",
        "voxmill's synthetic speech-like test clip (`pipeline.demo.speechlike`, 1 s at 120 Hz)",
        lambda s: speech(),
        "no_speech",
        "at least 80 ms is needed",
    ),
    SpeechCase(
        "speech_burst_60ms",
        "60 ms of speech (espeak-ng) in 2 s of digital silence",
        lambda s: speech_audio.burst(s, 60),
        "no_speech",
        "at least 80 ms is needed",
        needs_speech=True,
    ),
    SpeechCase(
        "speech_clean", "synthetic speech (espeak-ng, one sentence)", lambda s: s, OK, needs_speech=True
    ),
    SpeechCase(
        "speech_noise_0db",
        "speech under loud noise: white noise as loud as the speech (0 dB SNR)",
        lambda s: speech_audio.with_noise(s, 0.0),
        OK,
        needs_speech=True,
    ),
    SpeechCase(
        "speech_noise_minus20db",
        "speech drowned: white noise 20 dB above the speech (-20 dB SNR)",
        lambda s: speech_audio.with_noise(s, -20.0),
        "no_speech",
        "detected speech is",
        needs_speech=True,
    ),
]


@dataclass
class SpeechSeen:
    """A speech case's result with the check on, and its code with the check off."""

    on: TaskResult
    off_code: str

    @property
    def code(self) -> str:
        return self.on.error.code if self.on.error else OK


@pytest.fixture(scope="module")
def speech_run(tmp_path_factory: pytest.TempPathFactory, tiny_models: Path) -> dict[str, SpeechSeen]:
    from pipeline import Extractor
    from pipeline.audio.vad import SpeechCheck
    from pipeline.inference import run_clip
    from pipeline.settings import Settings

    folder = tmp_path_factory.mktemp("speech-cases")
    sessions = Extractor.from_model_dir(tiny_models).sessions
    check = SpeechCheck.from_settings(Settings())
    off = SpeechCheck.from_settings(Settings(speech_check=False))
    voice = speech_audio.espeak_wave() if speech_audio.ESPEAK else None
    seen: dict[str, SpeechSeen] = {}
    for case in SPEECH_CASES:
        if case.needs_speech and voice is None:
            continue
        path = folder / f"{case.name}.wav"
        sf.write(path, case.wave(voice if voice is not None else np.zeros(0)), RATE, subtype="PCM_16")
        on = run_clip(case.name, path, "extract", sessions, AudioLimits(), check)
        without = run_clip(case.name, path, "extract", sessions, AudioLimits(), off)
        seen[case.name] = SpeechSeen(on, without.error.code if without.error else OK)
    return seen


@pytest.mark.parametrize("case", SPEECH_CASES, ids=[c.name for c in SPEECH_CASES])
def test_speech_case(case: SpeechCase, speech_run: dict[str, SpeechSeen]) -> None:
    if case.name not in speech_run:
        pytest.skip(speech_audio.NO_ESPEAK)
    seen = speech_run[case.name]
    message = seen.on.error.message if seen.on.error else ""
    assert seen.code == case.code, f"{case.name}: {seen.code}: {message} ({seen.on.stats})"
    assert case.fragment in message
    assert seen.on.stats is not None and seen.on.stats["speech_s"] is not None
    assert seen.off_code == OK  # with the check off every one of them gets features


def speech_rows(seen: dict[str, SpeechSeen]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for case in SPEECH_CASES:
        got = seen[case.name]
        stats = got.on.stats or {}
        message = got.on.error.message if got.on.error else f"accepted: {stats.get('duration_s'):g} s decoded"
        detected = f"{stats.get('speech_s', 0.0):.3f} s of {stats.get('duration_s', 0.0):.2f} s"
        rows.append((case.title, got.code, message, detected, got.off_code))
    return rows


SPEECH_HEADER = ("input", "code", "message", "speech detected", "with `speech_check: false`")


def test_docs_speech_table_matches_this_run(speech_run: dict[str, SpeechSeen]) -> None:
    """docs/bad-input.md's speech-check table lists every case with the code it really gets."""
    if len(speech_run) < len(SPEECH_CASES):
        pytest.skip(speech_audio.NO_ESPEAK)
    rows = speech_rows(speech_run)
    if os.environ.get(UPDATE_DOC_ENV):
        text = DOC.read_text()
        head, rest = text.split(SPEECH_START, 1)
        tail = rest.split(SPEECH_END, 1)[1]
        DOC.write_text(
            f"{head}{SPEECH_START}\n{render_table(rows, SPEECH_HEADER, (1, 4))}\n{SPEECH_END}{tail}"
        )
    block = DOC.read_text().split(SPEECH_START, 1)[1].split(SPEECH_END, 1)[0]
    documented = [line[2:].split(" | ") for line in block.splitlines() if line.startswith("| ")][2:]
    assert [(cells[0], cells[1].strip("`")) for cells in documented] == [(r[0], r[1]) for r in rows], (
        f"docs/bad-input.md is out of date; regenerate: {UPDATE_DOC_ENV}=1 pytest {Path(__file__).name}"
    )
