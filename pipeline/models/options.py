"""How sessions are built: provider, threads, warm-up runs, provider options, optimized-model cache,
memory patterns and when the CPU arena shrinks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.models.cache import ModelCache
from pipeline.models.providers import ProviderOptions, choose_providers
from pipeline.settings import Settings


@dataclass(frozen=True)
class SessionOptions:
    """How to build sessions: provider, threads, warm-up runs, provider options, optimized-model cache.

    `model_cache_dir` None: no cache (every load optimises the graph from the source file).
    `prepack` False: ONNX Runtime does not pre-pack weights for the CPU kernels. A session run
    once (the watcher's validation) loads faster and touches about a third less memory; the
    optimised graph it saves to the cache is byte for byte the same. Serving sessions pre-pack.
    `mem_pattern` and `arena_shrink`: the settings `ort_mem_pattern` and `ort_arena_shrink`
    (`pipeline.models.sessions.shrink_above` reads the latter).
    """

    provider: str = "cpu"
    intra_op_threads: int = 1
    warmup_runs: int = 1
    provider_options: ProviderOptions = field(default_factory=ProviderOptions)
    model_cache_dir: Path | None = None
    model_cache_keep: int = 6
    prepack: bool = True
    mem_pattern: bool = False
    arena_shrink: str = "long"  # long | always | never

    @classmethod
    def from_settings(cls, settings: Settings) -> SessionOptions:
        return cls(
            provider=settings.provider,
            intra_op_threads=settings.intra_op_threads,
            warmup_runs=settings.warmup_runs,
            provider_options=ProviderOptions(
                device_id=settings.cuda_device_id,
                cuda_mem_limit_bytes=settings.cuda_mem_limit_bytes,
                cudnn_conv_algo_search=settings.cudnn_conv_algo_search,
                trt_fp16=settings.trt_fp16,
                engine_cache_dir=settings.engine_cache_dir,
            ),
            model_cache_dir=settings.model_cache_dir if settings.model_cache else None,
            model_cache_keep=settings.model_cache_keep,
            mem_pattern=settings.ort_mem_pattern,
            arena_shrink=settings.ort_arena_shrink,
        )

    def serving_provider(self, available: Sequence[str]) -> str:
        """The provider a session built with these options serves on, given the installed ones."""
        return choose_providers(self.provider, available, self.provider_options).serving

    def model_cache(self) -> ModelCache | None:
        """The optimized-model cache when configured and trustworthy."""
        if self.model_cache_dir is None:
            return None
        cache = ModelCache(self.model_cache_dir, self.model_cache_keep)
        return cache if cache.usable() else None
