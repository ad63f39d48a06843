"""Memory under clips of every length: ONNX Runtime's memory patterns off, the CPU arena shrunk
after a run on an input longer than the role's largest profile shape, and the worker's memory
bound handed to Celery. Real stand-in models, real sessions, a fresh process for each RSS check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from celery.result import allow_join_result

from pipeline.audio.vad import SpeechDetector
from pipeline.inference import open_session
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import shrink_above
from pipeline.settings import Settings
from workers.queue.app import create_app

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = Registry.load()

# A fresh process: warm the embedder on clips up to 30 s, then one 10-minute clip, then 30 s again;
# prints its resident memory before and after the long clip.
LONG_CLIP = """
import json, sys
from pathlib import Path
import numpy as np
from pipeline.inference import embed, open_session
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

registry = Registry.load()
path = registry.find_model("embedder", Path(sys.argv[1]))
session = open_session(path, "embedder", SessionOptions(arena_shrink=sys.argv[2]), registry)
rng = np.random.default_rng(0)
def clip(seconds):
    embed(session, (rng.standard_normal(int(seconds * 16000)) * 0.1).astype(np.float32))
for seconds in (30.0, 12.5, 29.9, 30.0):
    clip(seconds)
before = rss_mb()
clip(600.0)
clip(30.0)
print(json.dumps({"before_mb": before, "after_mb": rss_mb()}))
"""


def long_clip_growth_mb(models: Path, policy: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", LONG_CLIP, str(models), policy],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    return float(rss["after_mb"] - rss["before_mb"])


def test_memory_patterns_are_off_unless_asked_for(models: Path) -> None:
    def pattern(options: SessionOptions) -> bool:
        session = open_session(models / "campplus.onnx", "embedder", options, REGISTRY)
        return bool(session.session.get_session_options().enable_mem_pattern)

    assert pattern(SessionOptions()) is False
    assert pattern(SessionOptions.from_settings(Settings(provider="cpu"))) is False
    assert pattern(SessionOptions.from_settings(Settings(provider="cpu", ort_mem_pattern=True))) is True
    detector = SpeechDetector.load()  # the speech detector's helper session is built the same way
    assert detector.session.get_session_options().enable_mem_pattern is False


def test_the_arena_shrinks_above_the_roles_largest_profile_shape() -> None:
    embedder, tokenizer = REGISTRY.role("embedder"), REGISTRY.role("tokenizer")
    assert shrink_above("long", embedder) == 1 * 3000 * 80  # fbank [1, T, 80] of a 30 s clip
    assert shrink_above("long", tokenizer) == 1 * 128 * 3000  # its 30 s windows never exceed it
    assert shrink_above("always", embedder) == 0
    assert shrink_above("never", embedder) is None
    assert shrink_above("long", None) is None  # a helper model has no profile: never
    with pytest.raises(ValueError, match="long, always or never"):
        shrink_above("sometimes", embedder)
    settings = Settings(provider="cpu", ort_arena_shrink="always")
    assert SessionOptions.from_settings(settings).arena_shrink == "always"
    assert SessionOptions.from_settings(Settings()).arena_shrink == "long"


def test_a_ten_minute_clip_leaves_no_lasting_growth(models: Path) -> None:
    # The control shows the check can see the growth: without shrinking, the arena keeps it.
    kept = long_clip_growth_mb(models, "never")
    given_back = long_clip_growth_mb(models, "long")
    assert kept > 25.0, kept
    assert given_back < 0.25 * kept and given_back < 10.0, (given_back, kept)


def test_the_memory_bound_reaches_celery() -> None:
    default = Settings()
    assert default.worker_max_memory_per_child_kb > 0  # a safety net by default
    app = create_app(default)
    assert app.conf.worker_max_memory_per_child == default.worker_max_memory_per_child_kb
    from_env = Settings.load(environ={"VOXMILL_WORKER_MAX_MEMORY_PER_CHILD_KB": "800000"})
    # allow_join_result: building a Worker marks this process as a pool's, where result.get()
    # raises; the flag would outlive this test and fail the next that waits on a result.
    with warnings.catch_warnings(), allow_join_result():  # Celery warns when the tests run as root
        warnings.simplefilter("ignore")
        worker = create_app(from_env).Worker(pool_cls="prefork", concurrency=1, without_mingle=True)
    assert worker.max_memory_per_child == 800000  # what Celery hands the pool
    assert create_app(Settings(worker_max_memory_per_child_kb=0)).conf.worker_max_memory_per_child is None


# A fresh process: one 30 MB buffer freed (glibc then raises its threshold), then 10 buffers of
# 12 MB (above voxmill's threshold) of which all but the last are freed; prints the resident
# memory they leave behind.
FREED_BUFFERS = """
import json, sys
import numpy as np
from pipeline.allocator import fix_mmap_threshold

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

fix_mmap_threshold(int(sys.argv[1]))
large = np.ones(30 << 20, dtype=np.uint8)
del large
before = rss_mb()
buffers = [np.ones(12 << 20, dtype=np.uint8) for _ in range(10)]
del buffers[:-1]
print(json.dumps({"left_mb": rss_mb() - before}))
"""


def freed_buffers_left_mb(kb: int) -> float:
    done = subprocess.run(
        [sys.executable, "-c", FREED_BUFFERS, str(kb)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["left_mb"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_fixed_mmap_threshold_gives_freed_buffers_back() -> None:
    # The control: glibc's own threshold, raised by the large buffer, keeps the freed ones.
    assert freed_buffers_left_mb(0) > 80.0
    assert freed_buffers_left_mb(Settings().malloc_mmap_threshold_kb) < 20.0
