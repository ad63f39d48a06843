"""One frozen `Settings`, read once from `config/voxmill.yaml` and `VOXMILL_*` variables.

`Settings.load(environ, path)` is the only place in voxmill that reads the environment;
everything else receives the result as an argument.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

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


class Settings(BaseSettings):
    """Everything configurable. Field `x` is set by `VOXMILL_X` or by key `x` in the YAML file."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    # Broker and results
    broker_url: str | None = None
    result_backend_url: str | None = None
    visibility_timeout_s: int = 3600
    result_expires_s: int = 3600
    task_time_limit_s: int = 1800
    # Models and providers
    model_dir: Path = Path("models")
    provider: Provider = "auto"
    intra_op_threads: int = 1
    warmup_runs: int = 1
    cuda_device_id: int = 0
    cuda_mem_limit_bytes: int = 0
    cudnn_conv_algo_search: Literal["HEURISTIC", "EXHAUSTIVE", "DEFAULT"] = "HEURISTIC"
    trt_fp16: bool = False
    engine_cache_dir: Path = Path(".voxmill/engines")
    model_cache: bool = True
    model_cache_dir: Path = Path(".voxmill/ort-cache")
    model_cache_keep: int = 6
    # Input safety
    allowed_roots: tuple[Path, ...] = ()
    max_file_bytes: int = AudioLimits.max_file_bytes
    max_payload_bytes: int = AudioLimits.max_payload_bytes
    min_duration_s: float = AudioLimits.min_duration_s
    max_duration_s: float = AudioLimits.max_duration_s
    min_sample_rate_hz: int = AudioLimits.min_sample_rate_hz
    max_sample_rate_hz: int = AudioLimits.max_sample_rate_hz
    # Workers
    worker_proc_alive_timeout_s: float = 120.0
    worker_max_memory_per_child_kb: int = 0
    worker_reload_check_s: float = 1.0
    reload_slots: int = 0
    reload_retry_max_s: float = 60.0
    reload_aside_min_mb: float = 100.0
    # Corpus runs
    shard_size: int = 32
    shard_deadline_min_s: float = 60.0
    shard_deadline_factor: float = 4.0
    # Watcher
    watch_quiet_s: float = 1.0
    watch_writing_max_s: float = 30.0
    watch_validate_timeout_s: float = 600.0
    # Observability
    metrics_port: int | None = None
    watcher_metrics_port: int | None = None
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"

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

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p for p in value.split(":") if p)
        return value

    @field_validator(
        "broker_url", "result_backend_url", "metrics_port", "watcher_metrics_port", mode="before"
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
        )

    def roots(self) -> tuple[Path, ...]:
        """Allowed roots, resolved; the working directory when none are configured."""
        roots = self.allowed_roots or (Path.cwd(),)
        return tuple(Path(r).resolve() for r in roots)

    def to_env(self) -> dict[str, str]:
        """`VOXMILL_*` variables that reproduce these settings in a child process."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if name == "allowed_roots":
                value = ":".join(str(p) for p in value)
            env[ENV_PREFIX + name.upper()] = str(value)
        return env

    def redacted_broker_url(self) -> str | None:
        """The broker URL with any password replaced by `***`, for logs and status."""
        return redact_url(self.broker_url)


def redact_url(url: str | None) -> str | None:
    """Hide the password of a `scheme://user:password@host/...` URL."""
    if not url or "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"
