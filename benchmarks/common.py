"""What every benchmark shares: the machine record, summary statistics, result files, process
trees sampled for memory, and the environment child processes run in."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.corpus import WORK_DIR

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_DIR = WORK_DIR / "quick"
MODEL_CACHE_DIR = WORK_DIR / "ort-cache"
TRACE_DIR = Path(__file__).resolve().parent / "trace"
MB = 1024 * 1024


# --------------------------------------------------------------------------- machine and versions


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_features() -> str:
    """The CPU's family and model numbers and its widest vector extensions, from /proc/cpuinfo: a
    VM often names its CPU vaguely ("AMD EPYC"), and how batches pay depends on these."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    wide = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"family {family} model {model}, {' '.join(wide) or 'no AVX2'}"


def git_commit(tree: Path = ROOT) -> dict[str, Any]:
    """HEAD of the checkout `tree` and whether its working tree has changes (read-only git commands)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return {"commit": head, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    """The machine and versions a result was measured with (recorded in every result file)."""
    import numpy as np
    import onnxruntime as ort
    import soundfile as sf

    memory = psutil.virtual_memory()
    return {
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "memory_gb": round(memory.total / 1024**3, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "scipy": _version("scipy"),
        "soxr": _version("soxr"),
        "libsndfile": sf.__libsndfile_version__,
        "kaldi_native_fbank": _version("kaldi-native-fbank"),
        "celery": _version("celery"),
        "redis_py": _version("redis"),
        "pyarrow": _version("pyarrow"),
        **git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: other users of the machine show up here."""
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- statistics


def summary(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """Median, min, max and every run (rounded)."""
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --------------------------------------------------------------------------- result files


def results_dir(quick: bool) -> Path:
    """Where results go: `benchmarks/results`, or a scratch folder for `--quick` runs."""
    folder = QUICK_DIR / "results" if quick else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_result(folder: Path, name: str, data: dict[str, Any]) -> Path:
    """Write `<folder>/<name>.json` with the machine record added."""
    path = folder / f"{name}.json"
    payload = {"machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_result(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# --------------------------------------------------------------------------- child processes


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this one without `VOXMILL_*` (no broker: embedded mode),
    CPU provider, no speech check, the project importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXMILL_")}
    env["VOXMILL_PROVIDER"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["VOXMILL_MODEL_CACHE_DIR"] = str(MODEL_CACHE_DIR)
    env["VOXMILL_SPEECH_CHECK"] = "false"  # generated clips are not speech (benchmarks/speech_check.py)
    env.update(extra or {})
    return env


def prime_model_cache(models: Path) -> Path:
    """Load both models once in a child, so the optimized-model cache children use holds their entries.

    A deployment pays the entry's build once per model and machine (the watcher's validation
    pays it for a new model); the measured runs start from a warm cache, as a restarted worker
    does. Returns `models`.
    """
    code = (
        "import sys; from pathlib import Path; from pipeline.models.registry import Registry; "
        "from pipeline.models.options import SessionOptions; "
        "from pipeline.models.sessions import ModelSession; r = Registry.load(); "
        "o = SessionOptions(provider='cpu', model_cache_dir=Path(sys.argv[2])); "
        "[ModelSession.load(r.find_model(role, Path(sys.argv[1])), role, o, r) for role in r.roles]"
    )
    argv = [sys.executable, "-c", code, str(models), str(MODEL_CACHE_DIR)]
    subprocess.run(argv, env=child_env(), check=True)
    return models


def python_command(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_json_child(command: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run a child that prints one JSON object as its last stdout line; that object."""
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... exited {done.returncode}: {done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(command[:4])}... printed no result: {done.stdout[-1000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --------------------------------------------------------------------------- memory sampling


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of a live process, in MiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def classify(cmdline: Sequence[str]) -> str:
    """What a process of a voxmill run is: driver, celery (main), worker (pool child), redis, other."""
    text = " ".join(cmdline)
    if "redis-server" in text:
        return "redis"
    if ("celery" in text and "worker" in text) or "workers.worker" in text:
        return "celery"
    if "workers.cli" in text or text.endswith("voxmill") or " extract " in f" {text} ":
        return "driver"
    return "other"


@dataclass
class TreeSampler:
    """Samples a process tree every `interval_s`: peak RSS (VmHWM) and CPU seconds per process and
    the tree's summed RSS. Pool children have the same command line as the Celery main process;
    they are told apart by their parent."""

    root_pid: int
    interval_s: float = 0.25
    peaks_mb: dict[int, float] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    total_peak_mb: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.pid not in self.kinds:
                    kind = classify(proc.cmdline())
                    if kind == "celery" and self.kinds.get(proc.ppid()) == "celery":
                        kind = "worker"
                    self.kinds[proc.pid] = kind
                hwm = vm_hwm_mb(proc.pid)
                if hwm is not None:
                    self.peaks_mb[proc.pid] = max(self.peaks_mb.get(proc.pid, 0.0), hwm)
                times = proc.cpu_times()
                self.cpu_s[proc.pid] = max(self.cpu_s.get(proc.pid, 0.0), times.user + times.system)
                total += proc.memory_info().rss / MB
        self.total_peak_mb = max(self.total_peak_mb, total)

    def peaks_by_kind(self) -> dict[str, list[float]]:
        by_kind: dict[str, list[float]] = {}
        for pid, peak in self.peaks_mb.items():
            by_kind.setdefault(self.kinds.get(pid, "other"), []).append(round(peak, 1))
        return by_kind


@dataclass
class ChildRun:
    """A whole child process run: wall seconds (spawn to exit, timed from outside), CPU seconds of
    the whole process tree, output and the memory sampler.

    CPU seconds: user + system of every process of the tree, the larger of two counts: the
    kernel's (`RUSAGE_CHILDREN`: exact, but blind to descendants that were killed and reaped by
    init) and the sampler's (every process, but the last `interval_s` of each may be missed).
    """

    wall_s: float
    cpu_s: float
    done: subprocess.CompletedProcess[str]
    sampler: TreeSampler | None


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_child(
    command: list[str], env: dict[str, str], timeout_s: float, sample_memory: bool = True
) -> ChildRun:
    """Run `command` as a whole process, timed from outside (spawn to exit)."""
    cpu_before = children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    sampler = TreeSampler(proc.pid).start() if sample_memory else None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"{' '.join(command[:5])}... took longer than {timeout_s:g} s") from None
    finally:
        if sampler is not None:
            sampler.stop()
    elapsed = time.perf_counter() - started
    done = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])}... exited {proc.returncode}: {stderr[-2000:]}")
    cpu_s = children_cpu_s() - cpu_before
    if sampler is not None:
        cpu_s = max(cpu_s, sum(sampler.cpu_s.values()))
    return ChildRun(elapsed, cpu_s, done, sampler)


def s3_server(port: int, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """moto's S3 server in a process of its own on 127.0.0.1:`port`, once it accepts connections
    (the caller terminates it): a store that shares no interpreter with the benchmark."""
    import socket

    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not start on port {port}") from None
            time.sleep(0.1)


def log(message: str) -> None:
    """Progress on stderr, with the load average (the noise other users add)."""
    load = load_average()[0]
    print(f"[bench {time.strftime('%H:%M:%S')} load {load:.2f}] {message}", file=sys.stderr, flush=True)
