"""One frozen `Settings`, read once from `config/voxmill.yaml` and `VOXMILL_*` variables.

Every default is defined here, once, with the sentence that explains it; `config/voxmill.yaml`
is rendered from these fields (`python -m pipeline.settings > config/voxmill.yaml`, and a test
checks the file is what that prints). `Settings.load(environ, path)` is the only place in
voxmill that reads the environment; everything else receives the result as an argument.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pipeline.redaction import redact_url

ENV_PREFIX = "VOXMILL_"
CONFIG_ENV = "VOXMILL_CONFIG"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = PROJECT_ROOT / "config" / "voxmill.yaml"

Provider = Literal["auto", "cpu", "cuda", "tensorrt"]


@dataclass(frozen=True)
class AudioLimits:
    """Bounds applied to every clip before and after decoding."""

    max_file_bytes: int = 256 * 1024 * 1024
    max_payload_bytes: int = 32 * 1024 * 1024
    min_duration_s: float = 0.08
    max_duration_s: float = 600.0
    min_sample_rate_hz: int = 8000
    max_sample_rate_hz: int = 192000
    max_decoded_bytes: int = 256 * 1024 * 1024
    max_amplitude: float = 100.0


def _f(default: Any, about: str) -> Any:
    return Field(default, description=about)


class Settings(BaseSettings):
    """Everything configurable. Field `x` is set by `VOXMILL_X` or by key `x` in the YAML file."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    # Broker and results
    broker_url: str | None = _f(
        None,
        "redis://[:password@]host:6379/0, or rediss:// for TLS. Unset: the commands that can start "
        "an embedded Redis (extract, up, demo) do; the others say what to set.",
    )
    result_backend_url: str | None = _f(None, "Where results are stored; unset: the broker.")
    sentinel_master_name: str = _f(
        "voxmill",
        "The master's name in Redis Sentinel, for broker and result-backend URLs of the form "
        "sentinel://host:26379;sentinel://host2:26379 (the sentinels; password and db in the first).",
    )
    visibility_timeout_s: int = _f(
        3600, "An unacknowledged task is delivered again after this long; must exceed task_time_limit_s."
    )
    result_expires_s: int = _f(3600, "Results nobody read are deleted after this long.")
    task_time_limit_s: int = _f(1800, "A task running longer is killed (its soft limit is 30 s earlier).")
    job_deadline_min_s: float = _f(
        30.0,
        "A producer sends a job again (same task id; the first stored result wins) when it has no "
        "result after max(this, job_deadline_factor x the median latency seen), is in no queue and "
        "no live worker runs it: lost with a killed worker or a Redis restart.",
    )
    job_deadline_factor: float = _f(4.0, "See job_deadline_min_s; each new attempt waits twice as long.")
    # Models and providers
    model_dir: Path = _f(
        Path("models"),
        "The model folder: speech_tokenizer_v*.onnx and/or campplus.onnx (a CosyVoice model folder "
        "such as pretrained_models/CosyVoice2-0.5B works as it is).",
    )
    provider: Provider = _f(
        "auto", "auto (TensorRT, else CUDA, else CPU, by what is installed) | cpu | cuda | tensorrt."
    )
    intra_op_threads: int = _f(1, "ONNX Runtime threads per session: one per process, one process per core.")
    warmup_runs: int = _f(
        1,
        "Runs of a 3 s clip before a new session serves (a second run did not change the first real "
        "clip's latency).",
    )
    batch_tokenize: Literal["auto", "on", "off"] = _f(
        "auto",
        "Speech tokens of a shard in batches through the model folder's batch tokenizer "
        "(speech_tokenizer_v2.batch.onnx, CosyVoice's name), where the folder has one. auto: where it "
        "pays, by provider (CPU: clips up to batch_max_clip_s, none by default; GPU: every clip and "
        "window); on: every clip and window; off: one clip per run, the batch file never loaded. Tokens "
        "are the same either way; each result names the file that made them.",
    )
    batch_max_clips: int = _f(
        0, "Rows (clips, or 30 s windows of long ones) per batch; 0: 8 on the CPU, 32 on a GPU."
    )
    batch_frame_budget: int = _f(
        0,
        "Most log-mel frames (100 a second) a batch holds once padded (rows x its longest row); 0: 1,600 "
        "on the CPU (8 clips of 2 s), 96,000 on a GPU (32 windows of 30 s).",
    )
    batch_gather_ms: float = _f(
        3.0,
        "In a --pool threads worker, a single job's tokens wait at most this long for those of the jobs "
        "running beside it, to share one batch (never when it runs alone); 0: never gather.",
    )
    batch_max_clip_s: float = _f(
        0.0,
        "With batch_tokenize auto on the CPU, clips up to this long are batched, longer ones run alone; "
        "0: none (the batch file is not loaded). Whether batches pay depends on the CPU: clips up to 3 s "
        "ran 1.09-1.16x on an Intel Xeon and 1.03x on an AMD EPYC (docs/models.md): set 3 where a "
        "benchmark says so.",
    )
    cuda_device_id: int = _f(0, "The GPU a worker uses (run one worker per GPU).")
    cuda_mem_limit_bytes: int = _f(0, "Cap of each session's CUDA memory arena; 0: none.")
    cudnn_conv_algo_search: Literal["HEURISTIC", "EXHAUSTIVE", "DEFAULT"] = _f(
        "HEURISTIC", "cuDNN's convolution search; EXHAUSTIVE searches again for every new input length."
    )
    trt_fp16: bool = _f(False, "Build and use fp16 TensorRT engines.")
    engine_cache_dir: Path = _f(Path(".voxmill/engines"), "Where TensorRT engines are kept.")
    model_cache: bool = _f(
        True,
        "Optimized-model cache (CPU): ONNX Runtime's optimised graph of each model is saved on first load "
        "and reused, and the sha256 of model files already hashed on this machine is remembered. The "
        "folder must be yours and not writable by others, or it is ignored with a warning.",
    )
    model_cache_dir: Path = _f(Path(".voxmill/ort-cache"), "The optimized-model cache's folder.")
    model_cache_keep: int = _f(6, "Cache entries kept; the least recently used go first.")
    ort_mem_pattern: bool = _f(
        False,
        "ONNX Runtime's memory patterns (one block planned and kept per input shape). Off: memory stays "
        "flat over clips of every length, at no measured cost (BENCHMARKS.md, memory under varied "
        "lengths); on: the CPU arena creeps up with each new clip length.",
    )
    ort_arena_shrink: Literal["long", "always", "never"] = _f(
        "long",
        "When a model run hands what it added to ONNX Runtime's CPU arena back to the system. long: after "
        "an input longer than the role's largest profile shape in config/models.yaml (30 s), so a long "
        "clip leaves no lasting growth; always: after every run (the least memory, slower); never: the "
        "arena keeps its peak for the life of the process.",
    )
    malloc_mmap_threshold_kb: int = _f(
        8192,
        "Worker processes fix the C allocator's (glibc's) mmap threshold at this many KiB, so buffers "
        "larger than a 30 s clip's (8 MiB) are given back when freed and one long clip leaves no lasting "
        "growth; 0: glibc's own threshold, which rises after each large buffer freed.",
    )
    # Input safety
    allowed_roots: tuple[Path, ...] = _f(
        (),
        "Folders path jobs may read, after resolving symlinks (a list here, ':'-separated in the "
        "environment); empty: the worker's working directory. URL prefixes (s3://bucket/prefix, "
        "gs://bucket, https://host/path) listed here are moved to allowed_url_roots.",
    )
    allowed_url_roots: tuple[str, ...] = _f(
        (),
        "URL prefixes jobs, corpus audio, tar shards and shard outputs may be read from or written to "
        "(s3://bucket/prefix; compared by scheme, bucket and path on a '/' boundary, after removing "
        "'.' and '..'). Set them in allowed_roots or VOXMILL_ALLOWED_ROOTS with the folders. With URL "
        "prefixes but no folder, no local path is allowed. Store credentials and endpoints are the "
        "store's own (AWS_ENDPOINT_URL, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS...), never here.",
    )
    allowed_roots_file: Path | None = _f(
        None,
        "A file of more folders path jobs may read, one per line, added to allowed_roots: how `voxmill "
        "extract` in embedded mode hands its local workers the folders its corpus names (thousands "
        "would overflow the environment). Refused when others may write to it.",
    )
    max_file_bytes: int = _f(
        AudioLimits.max_file_bytes, "Largest audio file read (256 MiB), checked before reading."
    )
    max_payload_bytes: int = _f(AudioLimits.max_payload_bytes, "Largest raw-bytes job (32 MiB).")
    min_duration_s: float = _f(AudioLimits.min_duration_s, "Shorter clips are too_short.")
    max_duration_s: float = _f(AudioLimits.max_duration_s, "Longer clips are too_long, told from the header.")
    min_sample_rate_hz: int = _f(AudioLimits.min_sample_rate_hz, "Lowest sample rate accepted.")
    max_sample_rate_hz: int = _f(AudioLimits.max_sample_rate_hz, "Highest sample rate accepted.")
    max_decoded_bytes: int = _f(
        AudioLimits.max_decoded_bytes,
        "Largest decoded clip (frames x channels x 4 bytes), told from the header before decoding "
        "(256 MiB: 10 min of 48 kHz stereo); a larger one is too_large.",
    )
    max_amplitude: float = _f(
        AudioLimits.max_amplitude,
        "A clip with a sample beyond this (1.0 is full scale, after the decoder's own scaling) is "
        "out_of_range: numbers, not audio (100: 40 dB over full scale).",
    )
    max_text_chars: int = _f(
        4096,
        "Longest name, path or URL a job or a listing line may carry (Linux's PATH_MAX), checked before "
        "any pattern or path call; longer is bad_request.",
    )
    speech_check: bool = _f(
        True,
        "Run the speech detector (Silero VAD, vendored) on every clip: its speech seconds go into the "
        "stats, and a clip with less speech than min_speech_ms is no_speech. false: no detector runs.",
    )
    min_speech_ms: float = _f(80.0, "Clips with less detected speech are no_speech.")
    speech_threshold: float = _f(
        0.5, "A 32 ms frame is speech when the detector's probability reaches this (Silero's default)."
    )
    # Workers
    worker_proc_alive_timeout_s: float = _f(
        120.0, "Time a pool process may take to load and warm up its models."
    )
    worker_max_memory_per_child_kb: int = _f(
        3 * 1024 * 1024,
        "A prefork pool process whose peak resident memory (KiB; Celery reads ru_maxrss) passed this "
        "is replaced after its task, and the replacement loads and warms its models before it takes "
        "one. 3 GiB: above what a process holding both full models reaches on a 10-minute clip "
        "(docs/operations.md, worker memory); 0: never.",
    )
    model_retries: int = _f(
        8, "A job that finds its model not loaded (still loading, or a broken file) is retried this often."
    )
    heartbeat_interval_s: float = _f(
        2.0, "How often a worker process writes its record for `voxmill status`."
    )
    heartbeat_ttl_s: int = _f(15, "A worker process whose record is older is taken for dead.")
    # Hot reload
    worker_reload_check_s: float = _f(
        1.0, "How often a worker looks at the published generations without an announcement."
    )
    reload_slots: int = _f(
        0, "Processes per machine loading a new model of a role at once; 0: half of those serving it."
    )
    reload_slot_ttl_s: int = _f(
        300,
        "A reload slot, or the machine's aside lock, held by a dead process is free again after this long.",
    )
    reload_retry_max_s: float = _f(
        60.0, "A failed reload (out of memory, say) is retried, backing off to this."
    )
    reload_aside_min_mb: float = _f(
        100.0,
        "A process reloading a model file at least this large stands aside (takes no task; one per "
        "machine, and only when other processes serve its roles).",
    )
    reload_aside_wait_max_s: float = _f(30.0, "A task waits at most this long for a process standing aside.")
    reload_drain_max_s: float = _f(
        5.0, "A process standing aside waits this long at most for its running task."
    )
    # Corpus runs
    shard_size: int = _f(
        32,
        "Utterances per shard; fewer for a small corpus, so that every worker process gets six shards "
        "(`extract --shard-size` fixes it).",
    )
    shard_seconds: float = _f(
        600.0,
        "When the listing gives durations, or its first clips are local files whose headers give them: "
        "shards of short clips hold more than shard_size utterances, about this many seconds of audio "
        "(at most 4096 utterances). 0: shard_size always.",
    )
    shard_deadline_min_s: float = _f(
        60.0, "A shard not done within max(this, factor x the median shard time) is submitted again."
    )
    shard_deadline_factor: float = _f(4.0, "See shard_deadline_min_s.")
    shard_max_attempts: int = _f(
        4,
        "A shard sent this many times without being written (its task failed, or it was late each "
        "time) is given up: its utterances are failures in errors.jsonl, the run goes on.",
    )
    reads_in_flight: int = _f(
        16,
        "Objects (s3://, gs://, http(s)://) a shard task reads at once ahead of the model, in the order "
        "it takes them (16: a store's 50 ms per request costs the tiny stand-ins 2 % of their rate, 8 "
        "cost them 28 %; docs/operations.md). 1: none ahead, each clip read when the model wants it. "
        "Local files are never read ahead.",
    )
    read_ahead_bytes: int = _f(
        64 * 1024 * 1024,
        "Most bytes of objects a shard task holds read ahead (64 MiB); one larger object is still read, "
        "alone. With outputs in a store, the most bytes of shard files the driver keeps for the merge "
        "from its looks at the shards announced done (each read, not only looked at), and the merge "
        "holds read ahead.",
    )
    uploads_behind: int = _f(
        2,
        "Shard files (outputs in s3:// or gs://) a worker process uploads behind its tasks, while it "
        "computes the next shards: at most this many waiting or uploading. 0: each shard task uploads "
        "its file before it ends. Local folders are always written by the task.",
    )
    uploads_drain_s: float = _f(
        30.0, "A stopping worker process waits this long at most for its shard uploads to finish."
    )
    merge_buffer_rows: int = _f(
        65536,
        "Rows the merge gathers before writing them to an output file: its memory, whatever the corpus.",
    )
    local_ready_timeout_s: float = _f(
        120.0, "An embedded run whose local workers have not loaded their models by then stops."
    )
    consumer_grace_s: float = _f(
        180.0,
        "A run on a broker stops (no_consumer) when no live worker has consumed a queue its shards "
        "wait in for this long: more than a worker restart takes (worker_proc_alive_timeout_s to load).",
    )
    run_state_dir: Path = _f(
        Path(".voxmill/runs"),
        "Where a run whose --out is an object store keeps what must stay local: its lock file and, "
        "for an embedded run, workers.log (one sub-folder per output URL).",
    )
    audit_min_token_agreement: float = _f(
        1.0,
        "`voxmill audit`: the share of equal tokens each re-extracted utterance must reach (1.0: identical).",
    )
    audit_min_cosine: float = _f(
        0.9999, "`voxmill audit`: the cosine similarity every re-extracted embedding must reach."
    )
    # Watcher
    watch_quiet_s: float = _f(1.0, "A model file is a candidate once unchanged this long...")
    watch_writing_max_s: float = _f(
        30.0, "... and closed by its writer, or unchanged this long while held open."
    )
    watch_validate_timeout_s: float = _f(
        600.0, "A validation (load, signature, one run) that takes longer is a rejection."
    )
    # Observability
    metrics_port: int | None = _f(None, "Prometheus endpoint of a worker host (all its pool processes).")
    metrics_bind: str = _f(
        "127.0.0.1",
        "Address every Prometheus endpoint (worker, watcher, extract --metrics-port) listens on; they "
        "have no login. 0.0.0.0 to be scraped from other hosts (the compose file sets it).",
    )
    watcher_metrics_port: int | None = _f(None, "The watcher's own endpoint (publications, rejections).")
    run_metrics_port: int | None = _f(
        None,
        "Prometheus endpoint of a corpus run's driver (`voxmill extract --metrics-port`): shards done, "
        "in flight and resubmitted, utterances and audio done, failures by code, ETA.",
    )
    log_format: Literal["text", "json"] = _f("text", "text | json (one object per line).")
    log_level: str = _f("INFO", "DEBUG | INFO | WARNING | ERROR.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # `load` merges the file and the environment itself, so tests can pass both in.
        return (init_settings,)

    @model_validator(mode="before")
    @classmethod
    def _url_roots_apart(cls, data: Any) -> Any:
        """URL prefixes among the allowed roots go to `allowed_url_roots` (a Path cannot hold one)."""
        from pipeline.storage.urls import is_url, split_roots

        if not isinstance(data, dict) or "allowed_roots" not in data:
            return data
        raw = data["allowed_roots"]
        entries = split_roots(raw) if isinstance(raw, str) else list(raw or ())
        urls = [e for e in entries if is_url(e)]
        if not urls:
            return data
        extra = data.get("allowed_url_roots") or ()
        extra = split_roots(extra) if isinstance(extra, str) else list(extra)
        kept = tuple(e for e in entries if not is_url(e))
        return {**data, "allowed_roots": kept, "allowed_url_roots": (*extra, *urls)}

    @field_validator("allowed_roots", "allowed_url_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            from pipeline.storage.urls import split_roots

            return tuple(split_roots(value))
        return value

    @field_validator(
        "broker_url",
        "result_backend_url",
        "metrics_port",
        "watcher_metrics_port",
        "run_metrics_port",
        mode="before",
    )
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, path: Path | None = None) -> Settings:
        """Merge the YAML file (`path`, `$VOXMILL_CONFIG`, or `config/voxmill.yaml`) with `VOXMILL_*`."""
        env = os.environ if environ is None else environ
        config_path = path or (Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else DEFAULT_CONFIG)
        values: dict[str, Any] = {}
        if config_path.exists():
            loaded = yaml.safe_load(config_path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{config_path}: expected a mapping of settings")
            values.update(loaded)
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key in env:
                values[name] = env[key]
        return cls(**values)

    @property
    def audio_limits(self) -> AudioLimits:
        return AudioLimits(
            max_file_bytes=self.max_file_bytes,
            max_payload_bytes=self.max_payload_bytes,
            min_duration_s=self.min_duration_s,
            max_duration_s=self.max_duration_s,
            min_sample_rate_hz=self.min_sample_rate_hz,
            max_sample_rate_hz=self.max_sample_rate_hz,
            max_decoded_bytes=self.max_decoded_bytes,
            max_amplitude=self.max_amplitude,
        )

    def roots(self) -> tuple[Path, ...]:
        """Allowed roots (those of `allowed_roots_file` too), resolved; the working directory when
        none are configured."""
        listed = (*self.allowed_roots, *self.roots_from_file())
        if not listed and self.allowed_url_roots:
            return ()  # only URL prefixes were allowed: no local path is
        roots = listed or (Path.cwd(),)
        return tuple(Path(r).resolve() for r in roots)

    def roots_from_file(self) -> tuple[Path, ...]:
        """The folders `allowed_roots_file` lists, one per line (none without one); ValueError when
        the file may be written by others than its owner (it would widen what jobs read)."""
        if self.allowed_roots_file is None:
            return ()
        path = Path(self.allowed_roots_file)
        if path.stat().st_mode & 0o022:
            raise ValueError(f"allowed_roots_file {path} may be written by others; make it mode 0644 or less")
        text = path.read_text(encoding="utf-8", errors="surrogateescape")  # any folder name
        return tuple(Path(line) for line in text.split("\n") if line)

    def to_env(self) -> dict[str, str]:
        """`VOXMILL_*` variables that reproduce these settings in a child process."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if name == "allowed_url_roots":
                continue  # travels in VOXMILL_ALLOWED_ROOTS, with the folders
            if name == "allowed_roots":
                value = ":".join([*(str(p) for p in value), *self.allowed_url_roots])
            env[ENV_PREFIX + name.upper()] = str(value)
        return env

    def redacted_broker_url(self) -> str | None:
        """The broker URL with any password replaced by `***`, for logs and status."""
        return redact_url(self.broker_url)


# The comment above each group of keys in config/voxmill.yaml, by the group's first key.
SECTIONS = {
    "broker_url": "Broker and results",
    "model_dir": "Models and providers",
    "allowed_roots": "Input safety",
    "worker_proc_alive_timeout_s": "Workers",
    "worker_reload_check_s": "Hot reload",
    "shard_size": "Corpus runs",
    "watch_quiet_s": "Watcher",
    "metrics_port": "Observability",
}
CONFIG_HEADER = """\
# voxmill's settings and their defaults, rendered from pipeline/settings.py
# (`python -m pipeline.settings > config/voxmill.yaml`; edit the defaults there, not here).
# Every key can be overridden by an environment variable VOXMILL_<KEY> (for example
# VOXMILL_BROKER_URL, VOXMILL_MODEL_DIR). Point VOXMILL_CONFIG at another file to replace this one.
"""


def render_config() -> str:
    """`config/voxmill.yaml`: every setting with its default, under its explanation."""
    lines = [CONFIG_HEADER.rstrip()]
    defaults = Settings().model_dump(mode="json")
    for name, info in Settings.model_fields.items():
        if name in SECTIONS:
            lines.append(f"\n# -- {SECTIONS[name]} " + "-" * (95 - len(SECTIONS[name])))
        lines += textwrap.wrap(info.description or "", width=98, initial_indent="# ", subsequent_indent="# ")
        value = yaml.safe_dump(defaults[name], default_flow_style=True, width=200)
        lines.append(f"{name}: {value.removesuffix(chr(10) + '...' + chr(10)).strip()}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_config())
