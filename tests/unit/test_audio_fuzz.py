"""Decoding fuzz: seeded mutations of small real WAV/FLAC/Ogg/MP3 encodings through `load_audio`.

Every case either decodes to finite float32 mono 16 kHz samples within the amplitude limit, or is
refused with a `VoxmillError` whose code is one of `pipeline.errors.CODES`: never another
exception, never a crash or a hang, and the decoding process's peak RSS grows by no more than the
limits allow (`rss_bound_bytes`, with `max_decoded_bytes` lowered to 16 MiB so that the bound
means something).

The cases are real encodings (made with soundfile) with bytes flipped, overwritten, zeroed,
duplicated, cut or appended, and header fields patched: WAV channels, rate, block align, bits,
format tag and chunk sizes; FLAC STREAMINFO rate, channels, bits and total samples; Ogg Vorbis
channels, rate and granule positions (page checksums fixed, so the lies get past libogg); MP3
frame headers and the Xing frame count. Two constant-signal FLACs are decode bombs: 8 channels
for 300 s (150 MB decoded from 40 KB) and for 30 s (just under the lowered budget).

They run in a child process (`python -m tests.unit.test_audio_fuzz SEED FOLDER`) that reports
each case on a line before and after it, so a hang or a crash names its case and the RSS
measured is the decoding's own. Reproduce one run by hand with the same command.
"""

from __future__ import annotations

import io
import json
import os
import select
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio.decode import DECODE_BLOCK_BYTES, TARGET_RATE_HZ, Audio, load_audio
from pipeline.audio.header import AUDIOREAD_FORMAT
from pipeline.errors import CODES, VoxmillError
from pipeline.settings import AudioLimits

ROOT = Path(__file__).resolve().parents[2]
SEED = 31
MUTANTS_PER_SEED = 50
RANDOM_BLOBS = 12
FILE_EVERY = 9  # every 9th case is decoded from a file (libsndfile on a descriptor, audioread)
CASE_TIMEOUT_S = 30.0  # a case takes milliseconds; a hang is anything near this
RUN_TIMEOUT_S = 180.0
MIB = 1024 * 1024
FUZZ_LIMITS = AudioLimits(max_decoded_bytes=16 * MIB)
# soxr's filter rings: a resampled peak may exceed the source's (never by this much)
RESAMPLE_HEADROOM = 4.0
OK = "ok"


def rss_bound_bytes(limits: AudioLimits) -> int:
    """The most decoding one clip may add to a process: its mono samples (a one-channel clip may
    take the whole budget), their 16 kHz copy (twice as many from the lowest rate), two decode
    blocks, and 24 MiB for the decoders' own state and the allocator."""
    mono = limits.max_decoded_bytes
    resampled = mono * TARGET_RATE_HZ // limits.min_sample_rate_hz
    return mono + resampled + 2 * DECODE_BLOCK_BYTES + 24 * MIB


# --------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Seed:
    """A real encoding to mutate: `kind` picks its header mutations; `bomb`: not decoded at warm-up;
    `as_files`: every case of it is a file (for the audioread fallback, which reads only paths)."""

    name: str
    kind: str
    data: bytes
    bomb: bool = False
    as_files: bool = False


def encode(samples: np.ndarray, rate: int, format: str = "WAV", **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=format, **kwargs)
    return buffer.getvalue()


def constant_flac(channels: int, rate: int, seconds: int) -> bytes:
    """A FLAC of a constant signal: a few KB per minute, whatever it decodes to."""
    buffer = io.BytesIO()
    block = np.full((rate, channels), 0.25, dtype=np.float32)
    with sf.SoundFile(buffer, "w", rate, channels, format="FLAC", subtype="PCM_16") as sound:
        for _ in range(seconds):
            sound.write(block)
    return buffer.getvalue()


def tone(seconds: float, rate: int, channels: int = 1, level: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    rng = np.random.default_rng(rate + channels)
    wave = level * np.sin(2 * np.pi * 220.0 * t)[:, None] + rng.normal(0.0, 0.01, (len(t), channels))
    out = wave.astype(np.float32)
    return out[:, 0] if channels == 1 else out


def wide_wav(channels: int, frames: int) -> bytes:
    """16-bit PCM WAV with more channels than libsndfile takes (1024): only audioread reads it."""
    pcm = np.random.default_rng(channels).integers(-8000, 8000, (frames, channels), dtype=np.int16)
    block = 2 * channels
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + pcm.nbytes,
        b"WAVE",
        b"fmt ",
        16,
        1,
        channels,
        16000,
        16000 * block,
        block,
        16,
        b"data",
        pcm.nbytes,
    )
    return header + pcm.tobytes()


def loud(value: float, channels: int) -> np.ndarray:
    samples = tone(0.25, 16000, channels)
    samples[100:110] = value
    return samples


def make_seeds() -> list[Seed]:
    return [
        Seed("wav16", "wav", encode(tone(0.25, 16000), 16000, subtype="PCM_16")),
        Seed("wav_float_st", "wav", encode(tone(0.25, 22050, 2), 22050, subtype="FLOAT")),
        Seed("wav24_3ch", "wav", encode(tone(0.2, 44100, 3), 44100, subtype="PCM_24")),
        Seed("wav_u8", "wav", encode(tone(0.3, 8000), 8000, subtype="PCM_U8")),
        Seed("wav_double", "wav", encode(tone(0.2, 16000), 16000, subtype="DOUBLE")),
        Seed("wav_1e30", "wav", encode(loud(1e30, 1), 16000, subtype="FLOAT")),
        Seed("wav_3e38_st", "wav", encode(loud(3e38, 2), 16000, subtype="FLOAT")),
        Seed("flac_st", "flac", encode(tone(0.3, 48000, 2), 48000, format="FLAC")),
        Seed("ogg", "ogg", encode(tone(0.5, 16000), 16000, format="OGG", subtype="VORBIS")),
        Seed("mp3", "mp3", encode(tone(0.5, 16000), 16000, format="MP3")),
        Seed("mp3_st", "mp3", encode(tone(0.5, 44100, 2), 44100, format="MP3")),
        Seed("wav_1030ch", "wav", wide_wav(1030, 1300), as_files=True),  # 81 ms: 5.4 MB decoded
        Seed("flac_bomb", "flac", constant_flac(8, 16000, 300), bomb=True),  # 154 MB decoded
        Seed("flac_legal", "flac", constant_flac(8, 16000, 30), bomb=True),  # 15.4 MB: under 16 MiB
    ]


# --------------------------------------------------------------------------- mutations

Mutation = Callable[[bytearray, np.random.Generator], str]
INTERESTING_16 = (0, 1, 2, 3, 8, 255, 256, 1024, 0x7FFF, 0x8000, 0xFFFF)
INTERESTING_32 = (0, 1, 2, 8000, 16000, 44100, 192000, 384000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def pick(rng: np.random.Generator, values: tuple[int, ...]) -> int:
    return int(values[int(rng.integers(len(values)))])


def random_bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def flip_bits(data: bytearray, rng: np.random.Generator) -> str:
    n = int(rng.integers(1, 17))
    for _ in range(n):
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    return f"flip {n} bits"


def overwrite(data: bytearray, rng: np.random.Generator) -> str:
    at, n = int(rng.integers(len(data))), int(rng.integers(1, 65))
    data[at : at + n] = random_bytes(rng, n)
    return f"overwrite {n} at {at}"


def zero_span(data: bytearray, rng: np.random.Generator) -> str:
    at, n = int(rng.integers(len(data))), int(rng.integers(1, 4097))
    data[at : at + n] = bytes(len(data[at : at + n]))
    return f"zero {n} at {at}"


def truncate(data: bytearray, rng: np.random.Generator) -> str:
    cut = int(rng.integers(len(data)))
    del data[cut:]
    return f"cut at {cut}"


def extend(data: bytearray, rng: np.random.Generator) -> str:
    n = int(rng.integers(1, 8193))
    how = int(rng.integers(3))
    if how == 0:
        data += random_bytes(rng, n)
    elif how == 1:
        data += bytes(n)
    else:
        at = int(rng.integers(len(data)))
        data += data[at : at + n]
    return f"extend {('random', 'zeros', 'copy')[how]} {n}"


def duplicate_span(data: bytearray, rng: np.random.Generator) -> str:
    at, n, to = int(rng.integers(len(data))), int(rng.integers(1, 2049)), int(rng.integers(len(data)))
    data[to:to] = data[at : at + n]
    return f"copy {n} from {at} to {to}"


def header_int(data: bytearray, rng: np.random.Generator) -> str:
    at = int(rng.integers(min(len(data), 64)))
    if rng.integers(2):
        data[at : at + 2] = struct.pack("<H", pick(rng, INTERESTING_16))
    else:
        data[at : at + 4] = struct.pack("<I", pick(rng, INTERESTING_32))
    return f"header int at {at}"


def riff_chunks(data: bytearray) -> dict[bytes, int]:
    """{chunk id: offset of its data} of a RIFF file, as far as its sizes can be followed."""
    chunks: dict[bytes, int] = {}
    pos = 12
    while pos + 8 <= len(data) and len(chunks) < 32:
        chunk_id, size = bytes(data[pos : pos + 4]), struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        chunks.setdefault(chunk_id, pos + 8)
        pos += 8 + size + (size & 1)
    return chunks


def wav_field(data: bytearray, rng: np.random.Generator) -> str:
    chunks = riff_chunks(data)
    fields: list[tuple[str, int, int, tuple[int, ...]]] = [("riff size", 4, 4, INTERESTING_32)]
    fmt = chunks.get(b"fmt ")
    if fmt is not None:
        fields += [
            ("format tag", fmt, 2, (0, 1, 2, 3, 6, 7, 0x55, 0xFFFE, 0xFFFF)),
            ("channels", fmt + 2, 2, (0, 1, 2, 3, 8, 64, 255, 1024, 0xFFFF)),
            ("rate", fmt + 4, 4, INTERESTING_32),
            ("byte rate", fmt + 8, 4, INTERESTING_32),
            ("block align", fmt + 12, 2, INTERESTING_16),
            ("bits", fmt + 14, 2, (0, 1, 4, 8, 12, 16, 20, 24, 32, 64, 0xFFFF)),
        ]
    for chunk_id in (b"data", b"fact", b"PEAK"):
        if chunk_id in chunks:
            fields.append((f"{chunk_id.decode()} size", chunks[chunk_id] - 4, 4, INTERESTING_32))
    name, at, width, values = fields[int(rng.integers(len(fields)))]
    value = pick(rng, values) & (0xFFFF if width == 2 else 0xFFFFFFFF)
    data[at : at + width] = struct.pack("<H" if width == 2 else "<I", value)
    return f"wav {name}={value}"


def flac_streaminfo(data: bytearray, rng: np.random.Generator) -> str:
    """Patch STREAMINFO: 20 bits of rate, 3 of channels - 1, 5 of bits - 1, 36 of total samples."""
    if data[:4] != b"fLaC" or len(data) < 42:
        return header_int(data, rng)
    info = int.from_bytes(data[18:26], "big")
    fields = {
        "rate": (44, 20, (0, 1, 8000, 16000, 48000, 192000, 655350, (1 << 20) - 1)),
        "channels-1": (41, 3, tuple(range(8))),
        "bits-1": (36, 5, (0, 3, 7, 15, 23, 31)),
        "total": (0, 36, (0, 1, 100, 48000, 10**6, 16000 * 600, 192000 * 599, (1 << 36) - 1)),
    }
    name = list(fields)[int(rng.integers(len(fields)))]
    shift, bits, values = fields[name]
    value = pick(rng, values) & ((1 << bits) - 1)
    info = (info & ~(((1 << bits) - 1) << shift)) | (value << shift)
    data[18:26] = info.to_bytes(8, "big")
    return f"flac {name}={value}"


def _ogg_crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        table.append(crc & 0xFFFFFFFF)
    return table


OGG_CRC = _ogg_crc_table()


def fix_ogg_page(data: bytearray, page: int) -> None:
    """Recompute the checksum of the Ogg page at `page` (so libogg accepts a patched one)."""
    if page + 27 > len(data):
        return
    segments = data[page + 26]
    length = 27 + segments + sum(data[page + 27 : page + 27 + segments])
    data[page + 22 : page + 26] = bytes(4)
    crc = 0
    for byte in data[page : page + length]:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ OGG_CRC[((crc >> 24) & 0xFF) ^ byte]
    data[page + 22 : page + 26] = struct.pack("<I", crc)


def ogg_field(data: bytearray, rng: np.random.Generator) -> str:
    ident = data.find(b"\x01vorbis")
    last = data.rfind(b"OggS")
    if ident < 0 or last < 0:
        return header_int(data, rng)
    which = int(rng.integers(3))
    if which == 0:
        value = pick(rng, (0, 1, 2, 8, 32, 64, 255))
        data[ident + 11] = value
        name = "channels"
    elif which == 1:
        value = pick(rng, INTERESTING_32)
        data[ident + 12 : ident + 16] = struct.pack("<I", value)
        name = "rate"
    else:
        value = pick(rng, (0, 1, 100, 16000 * 600, 96000 * 120 * 32, 2**62))
        data[last + 6 : last + 14] = struct.pack("<q", value)
        name = "last granule"
    fix_ogg_page(data, data.rfind(b"OggS", 0, ident + 1))
    fix_ogg_page(data, last)
    return f"ogg {name}={value}"


def mp3_field(data: bytearray, rng: np.random.Generator) -> str:
    tag = max(data.find(b"Xing"), data.find(b"Info"))
    sync = next(
        (i for i in range(min(len(data) - 4, 4096)) if data[i] == 0xFF and data[i + 1] & 0xE0 == 0xE0), -1
    )
    if tag >= 0 and rng.integers(2):
        value = pick(rng, (0, 1, 10, 0x7FFFFFFF, 0xFFFFFFFF))
        data[tag + 8 : tag + 12] = struct.pack(">I", value)
        return f"mp3 xing frames={value}"
    if sync < 0:
        return header_int(data, rng)
    at = sync + int(rng.integers(1, 4))
    data[at] = int(rng.integers(256))
    return f"mp3 frame header byte {at - sync}={data[at]}"


GENERIC: tuple[Mutation, ...] = (
    flip_bits,
    overwrite,
    zero_span,
    truncate,
    extend,
    duplicate_span,
    header_int,
)
BY_KIND: dict[str, tuple[Mutation, ...]] = {
    "wav": (wav_field, wav_field),
    "flac": (flac_streaminfo, flac_streaminfo),
    "ogg": (ogg_field, ogg_field),
    "mp3": (mp3_field, mp3_field),
}


def mutate(seed: Seed, rng: np.random.Generator) -> tuple[bytes, str]:
    data = bytearray(seed.data)
    steps = []
    for _ in range(int(rng.integers(1, 4))):
        if not data:
            break
        choices = GENERIC + BY_KIND[seed.kind]
        steps.append(choices[int(rng.integers(len(choices)))](data, rng))
    return bytes(data), f"{seed.name}: {'; '.join(steps)}"


def random_blob(rng: np.random.Generator, index: int) -> tuple[bytes, str]:
    magic = (b"", b"RIFF", b"RIFF\xff\xff\xff\x7fWAVEfmt ", b"fLaC", b"OggS", b"ID3\x03", b"\xff\xfb")[
        index % 7
    ]
    return magic + random_bytes(rng, int(rng.integers(0, 4097))), f"random after {magic!r}"


def cases(seeds: list[Seed], seed: int) -> Iterator[tuple[str, bytes, bool]]:
    """Every case's name, bytes and whether it is a file, the same for the same seed."""
    index = 0
    for number, source in enumerate(seeds):
        rng = np.random.default_rng([seed, number])
        for _ in range(MUTANTS_PER_SEED):
            data, name = mutate(source, rng)
            yield name, data, source.as_files or index % FILE_EVERY == 0
            index += 1
    rng = np.random.default_rng([seed, len(seeds)])
    for blob in range(RANDOM_BLOBS):
        data, name = random_blob(rng, blob)
        yield name, data, index % FILE_EVERY == 0
        index += 1


# --------------------------------------------------------------------------- the child process


def check_audio(audio: Audio, limits: AudioLimits) -> str | None:
    """Why a decoded clip breaks the contract, or None."""
    samples = audio.samples
    if not isinstance(samples, np.ndarray) or samples.dtype != np.float32 or samples.ndim != 1:
        return f"samples are {getattr(samples, 'dtype', type(samples))} {getattr(samples, 'shape', '')}"
    if samples.size == 0 or not np.isfinite(samples).all():
        return f"{samples.size} samples, {int(np.count_nonzero(~np.isfinite(samples)))} not finite"
    headroom = 1.0 if audio.source_rate_hz == TARGET_RATE_HZ else RESAMPLE_HEADROOM
    peak = float(np.max(np.abs(samples)))
    if peak > limits.max_amplitude * headroom:
        return f"peak {peak:g} beyond the limit {limits.max_amplitude:g}"
    if (
        not limits.min_sample_rate_hz <= audio.source_rate_hz <= limits.max_sample_rate_hz
        or audio.channels < 1
    ):
        return f"source {audio.source_rate_hz} Hz, {audio.channels} channels"
    if not limits.min_duration_s - 1e-3 <= audio.duration_s <= limits.max_duration_s:
        return f"{audio.duration_s} s"
    return None


def run_case(data: bytes, path: Path | None, limits: AudioLimits) -> dict[str, Any]:
    """{"outcome": ok or a code} or {"failure": why} for one case."""
    try:
        if path is not None:
            path.write_bytes(data)
        audio = load_audio(path if path is not None else data, limits)
    except VoxmillError as exc:
        if exc.code not in CODES or not isinstance(exc.message, str) or not exc.message:
            return {"failure": f"VoxmillError with code {exc.code!r}, message {exc.message!r}"}
        return {"outcome": exc.code, "message": exc.message[:200], "audioread": "audioread" in exc.message}
    except Exception as exc:  # the point of the harness: report it, with where it came from
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {"failure": f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"}
    problem = check_audio(audio, limits)
    if problem:
        return {"failure": f"decoded, but {problem}"}
    return {"outcome": OK, "audioread": audio.codec == AUDIOREAD_FORMAT}


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak RSS since it started or since `reset_peak_rss` (VmHWM: `ru_maxrss` also
    counts the parent's memory, forked before the exec)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    """Start the peak afresh from the current RSS (Linux 4.0+), so the warm-up is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def child(seed: int, folder: Path) -> None:
    """Run every case, one JSON line before and after each on the original stdout."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # decoders that print go to stderr, not into the reports

    def emit(**fields: Any) -> None:
        report.write(json.dumps(fields) + "\n")

    seeds = make_seeds()
    for warm in seeds:  # load every decoder once, outside the measurement
        if not warm.bomb:
            run_case(warm.data, None, FUZZ_LIMITS)
    reset_peak_rss()
    base = current_rss()
    emit(base_rss=base, peak_rss=peak_rss())
    for index, (name, data, as_file) in enumerate(cases(seeds, seed)):
        path = folder / f"case{index}.audio" if as_file else None
        emit(start=index, name=name)
        started = time.perf_counter()
        outcome = run_case(data, path, FUZZ_LIMITS)
        if path is not None:
            path.unlink(missing_ok=True)
        elapsed_ms = round((time.perf_counter() - started) * 1000, 2)
        emit(index=index, name=name, ms=elapsed_ms, peak_rss=peak_rss(), file=path is not None, **outcome)
    emit(done=True)


# --------------------------------------------------------------------------- the test


def read_reports(process: subprocess.Popen[bytes], deadline: float) -> Iterator[dict[str, Any]]:
    """The child's report lines; TimeoutError when one takes over `CASE_TIMEOUT_S` (or the run
    passes `deadline`)."""
    assert process.stdout is not None
    fd, buffer = process.stdout.fileno(), b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield json.loads(line)
        wait_s = min(CASE_TIMEOUT_S, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], max(0.0, wait_s))
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buffer += chunk


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="measures RSS through /proc")
def test_fuzzed_audio_decodes_or_is_refused_with_a_code(tmp_path: Path) -> None:
    stderr = tmp_path / "decoders.log"
    started = time.monotonic()
    with stderr.open("wb") as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.test_audio_fuzz", str(SEED), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
    reports: list[dict[str, Any]] = []
    current = "setting up"
    try:
        for report in read_reports(process, started + RUN_TIMEOUT_S):
            if "start" in report:
                current = f"case {report['start']} ({report['name']})"
            else:
                reports.append(report)
    except TimeoutError:
        process.kill()
        pytest.fail(f"{current} did not finish within {CASE_TIMEOUT_S:g} s")
    finally:
        process.wait(timeout=30)
    log_tail = stderr.read_text(errors="replace")[-2000:]
    assert process.returncode == 0, (
        f"the decoding process died ({process.returncode}) in {current}:\n{log_tail}"
    )
    assert reports and reports[-1] == {"done": True}, f"the run stopped after {current}"
    base = reports[0]["base_rss"]
    done = [r for r in reports if "index" in r]
    failures = [f"case {r['index']} ({r['name']}): {r['failure']}" for r in done if "failure" in r]
    outcomes = Counter(r.get("outcome", "FAILED") for r in done)
    growth = max(0, max(r["peak_rss"] for r in done) - base)
    bound = rss_bound_bytes(FUZZ_LIMITS)
    over = next((r for r in done if r["peak_rss"] - base > bound), None)
    seconds = time.monotonic() - started
    jumps, high = [], reports[0]["peak_rss"]  # the cases that raised the peak most
    for r in done:
        if r["peak_rss"] > high:
            jumps.append((r["peak_rss"] - high, f"+{(r['peak_rss'] - high) / MIB:.1f} MiB at {r['name']}"))
            high = r["peak_rss"]
    raised = [text for _, text in sorted(jumps, reverse=True)]
    slowest = max(done, key=lambda r: r["ms"])
    fallback = sum(bool(r.get("audioread")) for r in done)
    print(
        f"{len(done)} cases ({sum(r['file'] for r in done)} as files, {fallback} through audioread) "
        f"in {seconds:.1f} s: {dict(outcomes)}; "
        f"peak RSS growth {growth / MIB:.1f} MiB (bound {bound / MIB:.0f} MiB); "
        f"slowest {slowest['ms']:.0f} ms ({slowest['name']}); the peak rose {'; '.join(raised[:3])}"
    )
    assert not failures, "\n".join(failures)
    assert over is None, (
        f"RSS grew by {(over['peak_rss'] - base) / MIB:.0f} MiB at case {over['index']} ({over['name']})"
    )
    assert len(done) == len(make_seeds()) * MUTANTS_PER_SEED + RANDOM_BLOBS
    # the mutations reach past the header checks, and the bombs and the loud seeds are caught
    assert {OK, "unreadable", "too_large", "out_of_range", "empty"} <= set(outcomes)
    assert fallback >= 10


if __name__ == "__main__":
    child(int(sys.argv[1]), Path(sys.argv[2]))
