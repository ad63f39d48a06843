"""Shards sized from the clips' file headers when the listing gives no durations (issue 34, item 3)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.corpus.durations import header_sample, header_seconds, listed_mean, sample_mean
from pipeline.outputs.folder import RunFolder
from pipeline.records import Utterance
from pipeline.run.plan import Planner, PlanReader
from pipeline.settings import AudioLimits, Settings

# 20 s of audio a shard: 40 clips of 0.5 s, and never fewer than 32 (clips of 2 s would make 10).
SETTINGS = Settings(shard_size=32, shard_seconds=20.0)


def write_wavs(folder: Path, count: int, seconds: float) -> list[Path]:
    """`count` real WAVs of `seconds` at 8 kHz (rewritten in place when they exist)."""
    folder.mkdir(parents=True, exist_ok=True)
    wave = np.zeros(int(seconds * 8000), dtype=np.float32)
    paths = [folder / f"c{i:04d}.wav" for i in range(count)]
    for path in paths:
        sf.write(path, wave, 8000, subtype="PCM_16")
    return paths


def kaldi_dir(folder: Path, paths: list[Path]) -> Path:
    """wav.scp and utt2spk, no utt2dur (as CosyVoice's data preparation writes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wav.scp").write_text("".join(f"u{i:05d} {p}\n" for i, p in enumerate(paths)))
    (folder / "utt2spk").write_text("".join(f"u{i:05d} s{i % 3}\n" for i in range(len(paths))))
    return folder


def plan(source: Path, out: Path, workers: int | None = None) -> list[int]:
    """The shard sizes of the plan `Planner` writes (or keeps) in `out`."""
    planner = Planner(source, RunFolder.of(out), ["embed"], 0, SETTINGS, workers).start()
    planner.join()
    if planner.error is not None:
        raise planner.error
    return [len(utts) for _, utts in PlanReader(RunFolder.of(out)).shards()]


def header_size(out: Path) -> int:
    return int(json.loads((out / "plan" / "header.json").read_text())["shard_size"])


def utts(paths: list[str], **fields: object) -> list[Utterance]:
    return [Utterance(f"u{i}", path, **fields) for i, path in enumerate(paths)]  # type: ignore[arg-type]


def test_listed_durations_give_their_mean_only_when_every_utterance_lists_one() -> None:
    assert listed_mean(utts(["/a", "/b"], duration_s=1.5)) == 1.5
    assert listed_mean([Utterance("a", "/a", duration_s=1.0), Utterance("b", "/b")]) is None
    assert listed_mean([]) is None


def test_the_header_sample_is_spread_over_whole_files_only() -> None:
    local = utts([f"/data/c{i}.wav" for i in range(1000)])
    sample = header_sample(local, most=64)
    assert len(sample) == 64 and len(set(sample)) == 64
    assert sample[0] == "/data/c0.wav" and sample[-1] == "/data/c984.wav"  # evenly spread to the end
    assert header_sample(local[:5], most=64) == [f"/data/c{i}.wav" for i in range(5)]
    # Object URLs are whole files too; a relative path or a segment among them: no header is read.
    assert header_sample([*local[:9], Utterance("x", "s3://bucket/x.wav")])[-1] == "s3://bucket/x.wav"
    assert len(header_sample([*local[:9], Utterance("x", "https://host/x.wav")])) == 10
    assert header_sample([*local[:9], Utterance("x", "rel/x.wav")]) == []
    assert header_sample([*local[:9], Utterance("x", "/rec.wav", start_s=1.0, end_s=None)]) == []
    assert header_sample([]) == []


def test_a_sample_is_enough_when_half_of_it_and_a_few_headers_were_read() -> None:
    assert sample_mean([1.0, 2.0] * 4) == 1.5
    assert sample_mean([1.0] * 8 + [None] * 8) == 1.0  # half read
    assert sample_mean([1.0] * 8 + [None] * 9) is None  # fewer than half
    assert sample_mean([1.0] * 7) is None  # too few to say
    assert sample_mean([1.0] * 3, least=3) == 1.0
    assert sample_mean([]) is None


def test_a_header_that_cannot_be_read_is_left_out(tmp_path: Path) -> None:
    limits = AudioLimits()
    (wav,) = write_wavs(tmp_path, 1, 1.25)
    assert header_seconds(str(wav), limits) == 1.25
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    fifo = tmp_path / "fifo.wav"
    os.mkfifo(fifo)  # never opened: it would block a blocking read
    for path in (tmp_path / "missing.wav", text, fifo, tmp_path, tmp_path / "a\x00b.wav"):
        assert header_seconds(str(path), limits) is None, path
    assert header_seconds(str(wav), AudioLimits(max_file_bytes=100)) is None  # over the size limit


def test_a_kaldi_dir_of_short_clips_without_utt2dur_is_cut_by_their_headers(tmp_path: Path) -> None:
    short = kaldi_dir(tmp_path / "short", write_wavs(tmp_path / "short-wavs", 400, 0.5))
    assert plan(short, tmp_path / "short-out") == [40] * 10  # 20 s of 0.5 s clips a shard
    long = kaldi_dir(tmp_path / "long", write_wavs(tmp_path / "long-wavs", 400, 2.0))
    assert set(plan(long, tmp_path / "long-out")[:-1]) == {32}
    # With 2 local workers a large enough corpus keeps the larger size too.
    big = kaldi_dir(tmp_path / "big", [p for p in sorted((tmp_path / "short-wavs").iterdir())] * 3)
    assert set(plan(big, tmp_path / "big-out", workers=2)) == {40}


def test_too_few_readable_headers_leave_the_shards_by_count(tmp_path: Path) -> None:
    wavs = write_wavs(tmp_path / "wavs", 400, 0.5)
    for path in wavs[1::3] + wavs[2::3]:  # two of every three listed files are gone
        path.unlink()
    assert set(plan(kaldi_dir(tmp_path / "data", wavs), tmp_path / "out")[:-1]) == {32}


def test_a_listing_of_urls_without_durations_is_cut_by_count_as_before(tmp_path: Path) -> None:
    manifest = tmp_path / "urls.jsonl"
    rows = [{"utt": f"u{i}", "path": f"http://127.0.0.1:9/c{i}.wav"} for i in range(400)]
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert set(plan(manifest, tmp_path / "out")[:-1]) == {32}


def test_the_size_read_from_headers_is_kept_by_a_resume_whatever_the_files_say_now(tmp_path: Path) -> None:
    wavs = write_wavs(tmp_path / "wavs", 400, 0.5)
    data, out = kaldi_dir(tmp_path / "data", wavs), tmp_path / "out"
    first = plan(data, out)
    assert header_size(out) == 40
    write_wavs(tmp_path / "wavs", 400, 2.0)  # the same paths, now long clips: a new plan would say 32
    assert set(plan(data, tmp_path / "fresh")[:-1]) == {32}
    assert plan(data, out) == first  # a finished plan, adopted
    (out / "plan" / "complete.json").unlink()  # a plan interrupted before its end: read and compared
    assert plan(data, out, workers=2) == first
    assert header_size(out) == 40


class ObjectServer:
    """WAVs of the given lengths served over HTTP on loopback, each answer 20 ms late; which were
    asked for, and the most requests at once."""

    def __init__(self, seconds: list[float]) -> None:
        import io
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.objects: dict[str, bytes] = {}
        for index, length in enumerate(seconds):
            buffer = io.BytesIO()
            sf.write(buffer, np.zeros(int(16000 * length), dtype=np.float32), 16000, format="WAV")
            self.objects[f"/c{index}.wav"] = buffer.getvalue()
        self.now = self.most = 0
        self.asked: set[str] = set()  # the objects asked for (an http read asks its size first)
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.answer(False)

            def do_GET(self) -> None:
                self.answer(True)

            def answer(self, body: bool) -> None:
                with lock:
                    server.asked.add(self.path)
                    server.now += 1
                    server.most = max(server.most, server.now)
                time.sleep(0.02)
                data = server.objects.get(self.path)
                with lock:
                    server.now -= 1
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.http.server_address[1]}"

    def urls(self) -> list[str]:
        return [f"{self.base}/c{i}.wav" for i in range(len(self.objects))]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_the_headers_of_objects_are_read_a_few_at_once(tmp_path: Path) -> None:
    """A listing of http URLs without durations: a sample of their headers, from a real HTTP
    server on loopback, 4 requests at most at once; a missing object is left out of the sample."""
    from pipeline.corpus.durations import headers_mean

    server = ObjectServer([1.0 + 0.5 * index for index in range(20)])
    try:
        listing = utts([*server.urls(), f"{server.base}/missing.wav"])
        mean = headers_mean(listing, AudioLimits(), in_flight=4)
        assert mean is not None and abs(mean - (1.0 + 0.5 * 9.5)) < 1e-6  # lengths this spread: all read
        assert 1 < server.most <= 4
    finally:
        server.close()


def test_the_headers_of_objects_of_like_lengths_stop_once_their_mean_is_known(tmp_path: Path) -> None:
    """Objects: once 16 headers give the mean within 10 %, the other 48 of the sample are not read
    (2 round trips of 8, not 8); the 16 are spread over the whole sample."""
    from pipeline.corpus.durations import headers_mean

    lengths = [1.0 + 0.001 * index for index in range(64)]
    server = ObjectServer(lengths)
    try:
        mean = headers_mean(utts(server.urls()), AudioLimits(), in_flight=8)
        assert len(server.asked) == 16
        # Spread over the sample: its first 16 alone would say 1.0075.
        assert mean is not None and abs(mean - sum(lengths) / 64) < 0.01
    finally:
        server.close()
