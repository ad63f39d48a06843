"""Reads in flight (`pipeline.storage.prefetch`, `pipeline.audio.sources.prefetch_clips`) against a
real HTTP server on loopback: results in order and identical to a serial read, errors in place, a
slow object not reordering anything, requests really concurrent and bounded, one fetch per run of
a URL, the byte budget, closing early, reader threads kept from one read-ahead to the next. (A
retry after a dropped connection: tests/integration/test_object_storage.py, on S3.)
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pipeline.audio.sources import Fetched, fetch_url, prefetch_clips
from pipeline.errors import VoxmillError
from pipeline.settings import AudioLimits
from pipeline.storage.objects import Reserve
from pipeline.storage.prefetch import ReadAhead, prefetch, runs

LIMITS = AudioLimits(max_file_bytes=50_000)
SLOW = "/slow.wav"


class Store(ThreadingHTTPServer):
    """Objects by path; counts GETs per path and the most requests in flight at once. Each answer
    waits `delay_s`; a GET of SLOW waits until `slow_after` other GETs were answered."""

    daemon_threads = True

    def __init__(self, objects_: dict[str, bytes], delay_s: float = 0.0, slow_after: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects = objects_
        self.delay_s = delay_s
        self.slow_after = slow_after
        self.gets: Counter[str] = Counter()
        self.answered: list[str] = []  # GETs in the order their answers began
        self.in_flight = 0
        self.most_in_flight = 0
        self.others_done = threading.Event()
        self.lock = threading.Lock()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class _Handler(BaseHTTPRequestHandler):
    server: Store

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        store, path = self.server, self.path
        with store.lock:
            store.in_flight += 1
            store.most_in_flight = max(store.most_in_flight, store.in_flight)
        try:
            time.sleep(store.delay_s)
            if body and path == SLOW:
                assert store.others_done.wait(30), "the objects after the slow one were not read meanwhile"
        finally:
            # Counted before a byte of the answer: its client cannot have asked again, nor have
            # read it (a count after the send could lag behind a test that already has its bytes).
            with store.lock:
                store.in_flight -= 1
                if body:
                    store.gets[path] += 1
                    store.answered.append(path)
                    if path != SLOW and len(store.answered) >= store.slow_after:
                        store.others_done.set()
        self._send(store.objects.get(path), body)

    def _send(self, data: bytes | None, body: bool) -> None:
        if self.path == "/moved.wav":
            self.send_response(302)
            self.send_header("Location", "http://example.invalid/elsewhere.wav")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif data is None:
            self.send_error(404)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Store] = []

    def start(objects_: dict[str, bytes], delay_s: float = 0.0, slow_after: int = 0) -> Store:
        store = Store(objects_, delay_s, slow_after)
        threading.Thread(target=store.serve_forever, daemon=True).start()
        started.append(store)
        return store

    yield start
    for store in started:
        store.shutdown()
        store.server_close()


def _clip(index: int, size: int = 1000) -> bytes:
    return bytes([index % 251]) * size


def _read(fetched: Fetched | None) -> bytes | tuple[str, str]:
    assert fetched is not None
    try:
        return fetched.open().read()
    except VoxmillError as exc:
        return exc.code, exc.message


def _serial(url: str) -> bytes | tuple[str, str]:
    """What a clip read the way it always was, one at a time, gives."""
    try:
        return fetch_url(url, LIMITS).read()
    except VoxmillError as exc:
        return exc.code, exc.message


def test_runs_group_consecutive_equal_urls_only() -> None:
    assert runs(["a", "a", None, None, "b", "a", "a"]) == [("a", 2), (None, 1), (None, 1), ("b", 1), ("a", 2)]
    assert runs([]) == []


def test_results_are_in_order_identical_to_a_serial_read_with_errors_in_place(serve: Any) -> None:
    clips = {f"/c{i}.wav": _clip(i) for i in range(12)}
    clips["/empty.wav"] = b""
    clips["/big.wav"] = _clip(99, LIMITS.max_file_bytes + 1)
    store = serve(clips)
    names = ["/c0.wav", "/missing.wav", "/c1.wav", "/empty.wav", "/c2.wav", "/big.wav", "/moved.wav"]
    names += [f"/c{i}.wav" for i in range(3, 12)]
    urls: list[str | None] = [store.url(n) for n in names]
    urls.insert(4, None)  # a local file among them: passed over, in place
    fetched = list(prefetch_clips(urls, LIMITS, ReadAhead(in_flight=4)))
    assert fetched[4] is None
    got = [_read(f) for f in fetched[:4] + fetched[5:]]
    assert got == [_serial(store.url(n)) for n in names]
    codes = [g[0] for g in got if isinstance(g, tuple)]
    assert codes == ["not_found", "empty", "too_large", "forbidden_path"]
    assert all(isinstance(f.url, str) and f.url.startswith("http://") for f in fetched if f is not None)


def test_a_slow_object_does_not_reorder_results(serve: Any) -> None:
    # The slow object's GET is answered only after four objects behind it were: they must have
    # been read meanwhile, and still come out after it.
    clips = {f"/c{i}.wav": _clip(i) for i in range(8)}
    clips[SLOW] = _clip(200)
    store = serve(clips, slow_after=5)
    names = ["/c0.wav", SLOW, *(f"/c{i}.wav" for i in range(1, 8))]
    fetched = list(prefetch_clips([store.url(n) for n in names], LIMITS, ReadAhead(in_flight=4)))
    assert [_read(f) for f in fetched] == [clips[n] for n in names]
    assert store.answered.index(SLOW) >= 5  # it finished after later ones


def test_requests_are_concurrent_and_bounded(serve: Any) -> None:
    clips = {f"/c{i}.wav": _clip(i) for i in range(16)}
    store = serve(clips, delay_s=0.05)
    urls = [store.url(n) for n in clips]
    fetched = list(prefetch_clips(urls, LIMITS, ReadAhead(in_flight=4)))
    assert [_read(f) for f in fetched] == list(clips.values())
    assert 2 <= store.most_in_flight <= 4


def test_a_run_of_one_url_is_fetched_once(serve: Any) -> None:
    store = serve({"/a.wav": _clip(1), "/b.wav": _clip(2)})
    a, b = store.url("/a.wav"), store.url("/b.wav")
    fetched = list(prefetch_clips([a, a, a, b, a], LIMITS, ReadAhead(in_flight=3)))
    assert [_read(f) for f in fetched] == [_clip(1)] * 3 + [_clip(2), _clip(1)]
    assert store.gets == Counter({"/a.wav": 2, "/b.wav": 1})


@pytest.mark.parametrize("budget", [1, 2500, 4000])
def test_bytes_held_ahead_stay_within_the_budget(serve: Any, budget: int) -> None:
    sizes = [1000, 2000, 1500, 1000, 2500, 500, 1000, 2000, 1000, 1500]
    clips = {f"/c{i}.wav": _clip(i, size) for i, size in enumerate(sizes)}
    store = serve(clips)
    held, peak, lock = [0], [0], threading.Lock()

    def fetch(url: str, reserve: Reserve) -> bytes:
        data = fetch_url(url, LIMITS, reserve).read()
        with lock:
            held[0] += len(data)
            peak[0] = max(peak[0], held[0])
        return data

    got = []
    for data in prefetch([store.url(n) for n in clips], fetch, ReadAhead(8, budget)):
        assert data is not None
        time.sleep(0.02)  # the model's pace: the reads run ahead of it
        got.append(data)
        with lock:
            held[0] -= len(data)  # done with it before asking for the next
    assert got == list(clips.values())
    assert peak[0] <= max(budget, max(sizes))
    if budget == 4000:  # room for more than one: it did read ahead
        assert peak[0] > max(sizes)


def test_closing_early_stops_reading(serve: Any) -> None:
    clips = {f"/c{i}.wav": _clip(i) for i in range(40)}
    store = serve(clips, delay_s=0.02)
    fetched = prefetch_clips([store.url(n) for n in clips], LIMITS, ReadAhead(2, 2000))
    assert _read(next(fetched)) == clips["/c0.wav"]
    fetched.close()
    time.sleep(0.3)  # what was in flight ends
    assert sum(store.gets.values()) < len(clips)


def test_reader_threads_outlive_a_read_ahead_and_serve_the_next_alone(serve: Any) -> None:
    clips = {f"/c{i}.wav": _clip(i) for i in range(6)}
    store = serve(clips, delay_s=0.01)
    urls = [store.url(n) for n in clips]
    readers: list[set[int]] = []

    def fetch(url: str, reserve: Reserve) -> bytes:
        readers[-1].add(threading.get_ident())
        return fetch_url(url, LIMITS, reserve).read()

    for _ in range(3):  # one shard after another
        readers.append(set())
        assert list(prefetch(urls, fetch, ReadAhead(in_flight=3))) == list(clips.values())
    assert readers[0] == readers[1] == readers[2] and len(readers[0]) <= 3
    early = prefetch(urls, fetch, ReadAhead(in_flight=3))
    assert next(early) == clips["/c0.wav"]
    early.close()  # with reads in flight: its threads are kept only once idle
    assert list(prefetch(urls[::-1], fetch, ReadAhead(in_flight=3))) == list(clips.values())[::-1]


def test_a_later_read_is_let_in_once_the_one_before_it_reserves(serve: Any) -> None:
    # b's fetch asks for room before a's: it waits for a to reserve first, not for the consumer
    # to move past a (that would read one object at a time).
    store = serve({"/a.wav": _clip(1), "/b.wav": _clip(2)})
    a_may_read, b_reserved = threading.Event(), threading.Event()

    def fetch(url: str, reserve: Reserve) -> bytes:
        if url.endswith("/a.wav"):
            assert a_may_read.wait(5)
            return fetch_url(url, LIMITS, reserve).read()

        def reserve_b(size: int) -> None:
            reserve(size)
            b_reserved.set()

        return fetch_url(url, LIMITS, reserve_b).read()

    reads = prefetch([store.url("/a.wav"), store.url("/b.wav")], fetch, ReadAhead(2, 1 << 20))
    threading.Timer(0.3, a_may_read.set).start()  # b has asked by then
    assert next(reads) == _clip(1)
    assert b_reserved.wait(5)  # while the consumer still holds a
    assert list(reads) == [_clip(2)]
