"""CPU vs CUDA vs TensorRT (fp32, fp16): latency, throughput, load and engine build times.

Anyone with an NVIDIA GPU can run it (providers that are not installed or do not start are
skipped and reported as such, so it also runs on a CPU-only machine):

    pip install -e '.[gpu]'                                  # onnxruntime-gpu and tensorrt
    voxmill models make-standin --profile full --out models-full
    python -m benchmarks.gpu_bench --models models-full      # or a CosyVoice model folder

It writes `benchmarks/results/gpu-<hostname>.json` (or `--out`) and prints a table.

Configurations:
- `cpu`: the CPU provider with one intra-op thread, as every worker process runs;
- `cpu-all`: the CPU provider with one thread per core (the fairest single-stream CPU baseline);
- `cuda`: the CUDA provider (cuDNN conv search HEURISTIC);
- `tensorrt-fp32`, `tensorrt-fp16`: the TensorRT provider with the registry's shape profile.

Per configuration and model:
- `load_s`: building the session; for TensorRT with an empty engine cache this is
  `engine_build_s` (session + the first run, which builds the engine), then the session is
  built again from the cache: `load_s` and `first_run_ms` are those of a pre-built engine;
- `first_run_ms`: the first inference after the load (the guide: < 100 ms);
- `latency_ms` p50/p95/mean over `--runs` inferences on a `--clip-s` clip (model only, no
  feature extraction), single stream;
- `throughput_x`: audio seconds per wall second for that stream (clip_s / mean latency).

`claims` compares the results with the reference deployment guide: ONNX Runtime on GPU cuts
latency 30-40 % against CPU, TensorRT 60-80 %, a model loads in under 5 s, the first inference
takes under 100 ms. Each claim is "met", "not met" or "not measured" (no such provider here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.errors import VoxmillError
from pipeline.models.engines import profile_inputs
from pipeline.models.host import detect_host
from pipeline.models.options import SessionOptions
from pipeline.models.providers import CPU, CUDA, TENSORRT, ProviderOptions, session_fallback_warning
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONFIGS = ("cpu", "cpu-all", "cuda", "tensorrt-fp32", "tensorrt-fp16")
PROVIDER_OF = {"cpu": CPU, "cpu-all": CPU, "cuda": CUDA, "tensorrt-fp32": TENSORRT, "tensorrt-fp16": TENSORRT}
FRAMES_PER_S = 100  # 10 ms feature frames (whisper log-mel and Kaldi fbank)
GUIDE = {"cuda_cut": (0.30, 0.40), "tensorrt_cut": (0.60, 0.80), "load_s": 5.0, "first_run_ms": 100.0}


@dataclasses.dataclass(frozen=True)
class Config:
    """One column of the table: a provider, its options and a name."""

    name: str
    options: SessionOptions

    @property
    def provider(self) -> str:
        return PROVIDER_OF[self.name]


def make_config(name: str, engine_root: Path, device_id: int) -> Config:
    """The session options of configuration `name` (TensorRT engines in a fresh folder of their own)."""
    threads = (os.cpu_count() or 1) if name == "cpu-all" else 1
    provider = {"cpu": "cpu", "cpu-all": "cpu", "cuda": "cuda"}.get(name, "tensorrt")
    provider_options = ProviderOptions(
        device_id=device_id, trt_fp16=name == "tensorrt-fp16", engine_cache_dir=engine_root / name
    )
    options = SessionOptions(
        provider=provider, intra_op_threads=threads, warmup_runs=0, provider_options=provider_options
    )
    return Config(name, options)


def skip_reason(config: Config, available: list[str]) -> str | None:
    """Why `config` cannot run here, or None."""
    if config.provider not in available:
        return f"{config.provider} is not in this onnxruntime (installed: {', '.join(available)})"
    return None


def clip_inputs(role: str, clip_s: float) -> list[Any]:
    """Model inputs for a `clip_s` second clip: [1,128,T] + length (tokenizer) or [1,T,80] (embedder)."""
    frames = int(clip_s * FRAMES_PER_S)
    shape = (1, 128, frames) if role == "tokenizer" else (1, frames, 80)
    return profile_inputs(role, shape)


def timed_ms(session: ModelSession, inputs: list[Any]) -> float:
    started = time.perf_counter()
    session.run(inputs)
    return (time.perf_counter() - started) * 1000.0


def load(path: Path, role: str, config: Config, registry: Registry) -> tuple[ModelSession, float]:
    """A session of `config` and its load seconds; a session that fell back elsewhere is refused."""
    started = time.perf_counter()
    session = ModelSession.load(path, role, config.options, registry)
    load_s = time.perf_counter() - started
    if session.active_providers[0] != config.provider:
        why = session_fallback_warning(session.choice, session.active_providers) or "it did not start"
        session.close()
        raise VoxmillError("model_error", why)
    return session, load_s


def measure(
    path: Path, role: str, config: Config, registry: Registry, clip_s: float, runs: int
) -> dict[str, Any]:
    """Load, first-run, latency and throughput numbers of one model under one configuration."""
    inputs = clip_inputs(role, clip_s)
    session, load_s = load(path, role, config, registry)
    result: dict[str, Any] = {"sha256": session.sha256}
    first_ms = timed_ms(session, inputs)
    if config.provider == TENSORRT:  # that load and first run built the engine; now use it
        result["engine_build_s"] = round(load_s + first_ms / 1000.0, 3)
        result["engine_dir"] = str(session.engine_dir)
        session.close()
        session, load_s = load(path, role, config, registry)
        first_ms = timed_ms(session, inputs)
    timings = [timed_ms(session, inputs) for _ in range(runs)]
    session.close()
    mean = statistics.fmean(timings)
    result.update(
        load_s=round(load_s, 3),
        first_run_ms=round(first_ms, 3),
        latency_ms={
            "p50": round(statistics.median(timings), 3),
            "p95": round(sorted(timings)[max(0, int(round(0.95 * len(timings))) - 1)], 3),
            "mean": round(mean, 3),
        },
        throughput_x=round(clip_s / (mean / 1000.0), 2),
    )
    return result


def run_config(
    config: Config,
    models: dict[str, Path],
    registry: Registry,
    available: list[str],
    clip_s: float,
    runs: int,
) -> dict[str, Any]:
    """Every model under one configuration, or why it was skipped."""
    reason = skip_reason(config, available)
    if reason:
        return {"status": "skipped", "reason": reason}
    out: dict[str, Any] = {
        "status": "ok",
        "provider": config.provider,
        "threads": config.options.intra_op_threads,
    }
    for role, path in models.items():
        try:
            out[role] = measure(path, role, config, registry, clip_s, runs)
        except VoxmillError as exc:
            return {"status": "skipped", "reason": exc.message}
    return out


def latency_cut(results: dict[str, Any], name: str, role: str) -> float | None:
    """1 - latency(name) / latency(cpu-all, else cpu): how much faster than the CPU."""
    base = next((results[c] for c in ("cpu-all", "cpu") if results.get(c, {}).get("status") == "ok"), None)
    other = results.get(name, {})
    if base is None or other.get("status") != "ok":
        return None
    return 1.0 - other[role]["latency_ms"]["mean"] / base[role]["latency_ms"]["mean"]


def verdict(value: float | None, ok: bool) -> str:
    return "not measured" if value is None else ("met" if ok else "not met")


def compare_with_guide(results: dict[str, Any], roles: list[str]) -> list[dict[str, Any]]:
    """Each of the guide's claims, per model, with the measured value and a verdict."""
    claims = []
    for role in roles:
        cuda = latency_cut(results, "cuda", role)
        trt_cuts = [latency_cut(results, n, role) for n in ("tensorrt-fp32", "tensorrt-fp16")]
        trt = max((c for c in trt_cuts if c is not None), default=None)
        gpu = [
            results[n][role]
            for n in ("cuda", "tensorrt-fp32", "tensorrt-fp16")
            if results[n]["status"] == "ok"
        ]
        load_s = max((g["load_s"] for g in gpu), default=None)
        first = max((g["first_run_ms"] for g in gpu), default=None)
        claims += [
            claim(
                role,
                "CUDA cuts latency 30-40 % vs CPU",
                cuda,
                cuda is not None and cuda >= GUIDE["cuda_cut"][0],
            ),
            claim(
                role,
                "TensorRT cuts latency 60-80 % vs CPU",
                trt,
                trt is not None and trt >= GUIDE["tensorrt_cut"][0],
            ),
            claim(
                role,
                "GPU load < 5 s (pre-built engine)",
                load_s,
                load_s is not None and load_s < GUIDE["load_s"],
            ),
            claim(
                role,
                "GPU first inference < 100 ms",
                first,
                first is not None and first < GUIDE["first_run_ms"],
            ),
        ]
    return claims


def claim(role: str, text: str, value: float | None, ok: bool) -> dict[str, Any]:
    return {
        "role": role,
        "claim": text,
        "measured": None if value is None else round(value, 3),
        "verdict": verdict(value, ok),
    }


COLUMNS = ("config", "model", "load s", "first ms", "p50 ms", "p95 ms", "x real", "build s")
WIDTHS = (14, 9, 8, 9, 9, 9, 8, 8)


def row(cells: tuple[str, ...]) -> str:
    """Cells padded to the table's widths (text left, numbers right)."""
    return " ".join(
        c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, WIDTHS, strict=True))
    )


def render(report: dict[str, Any]) -> str:
    """The results as a plain-text table, then the guide's claims."""
    lines = [f"{report['hostname']}: GPU {report['gpu']}; clip {report['clip_s']} s, {report['runs']} runs"]
    header = row(COLUMNS)
    lines += [header, "-" * len(header)]
    for name, result in report["configs"].items():
        if result["status"] != "ok":
            lines.append(f"{name:14s} skipped: {result['reason']}")
            continue
        for role in report["models"]:
            r = result[role]
            cells = (
                name,
                role,
                f"{r['load_s']:.2f}",
                f"{r['first_run_ms']:.1f}",
                f"{r['latency_ms']['p50']:.1f}",
                f"{r['latency_ms']['p95']:.1f}",
                f"{r['throughput_x']:.1f}",
                f"{r['engine_build_s']:.1f}" if "engine_build_s" in r else "-",
            )
            lines.append(row(cells))
    lines.append("")
    for c in report["claims"]:
        value = "-" if c["measured"] is None else c["measured"]
        lines.append(f"{c['role']:9s} {c['claim']:40s} {str(value):>10s}  {c['verdict']}")
    return "\n".join(lines)


def find_models(model_dir: Path, registry: Registry) -> dict[str, Path]:
    models = {}
    for role in registry.roles:
        try:
            models[role] = registry.find_model(role, model_dir)
        except VoxmillError:
            continue
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--models", type=Path, required=True, help="model folder (full stand-ins or real)")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}"
    )
    parser.add_argument("--clip-s", type=float, default=10.0, help="clip length in seconds (default 10)")
    parser.add_argument("--runs", type=int, default=20, help="timed inferences per model (default 20)")
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="result JSON (default results/gpu-<hostname>.json)"
    )
    args = parser.parse_args(argv)

    import onnxruntime as ort

    registry = Registry.load()
    models = find_models(args.models, registry)
    if not models:
        print(f"no tokenizer or embedder model in {args.models}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    available = ort.get_available_providers()
    host = detect_host(args.device_id)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="voxmill-engines-") as engine_root:
        configs = [make_config(n, Path(engine_root), args.device_id) for n in names]
        results = {
            c.name: run_config(c, models, registry, available, args.clip_s, args.runs) for c in configs
        }
    for name in CONFIGS:
        results.setdefault(name, {"status": "skipped", "reason": "not selected (--configs)"})
    report = {
        "hostname": socket.gethostname(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": host.gpu_name,
        "versions": host.versions,
        "cpu": {"model": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "available_providers": available,
        "models": {role: {"file": p.name, "size_bytes": p.stat().st_size} for role, p in models.items()},
        "clip_s": args.clip_s,
        "runs": args.runs,
        "configs": {name: results[name] for name in CONFIGS},
        "claims": compare_with_guide(results, list(models)),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    out = args.out or RESULTS_DIR / f"gpu-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
