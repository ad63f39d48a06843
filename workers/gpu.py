"""GPU-specific worker rules: never fork after CUDA is initialised."""

from __future__ import annotations

from pipeline.providers import CPU, choose_providers
from pipeline.settings import Settings

FORK_SAFE_POOLS = ("solo", "threads")


def serving_provider(settings: Settings) -> str:
    """The provider a session built with `settings` would run on (by what is installed)."""
    import onnxruntime as ort

    from pipeline.sessions import SessionOptions

    options = SessionOptions.from_settings(settings)
    return choose_providers(options.provider, ort.get_available_providers(), options.provider_options).serving


def check_pool_for_provider(settings: Settings, pool: str, serving: str | None = None) -> str | None:
    """A clear refusal when a GPU worker would use the prefork pool; None when the pool is fine.

    ONNX Runtime's CUDA and TensorRT providers are not fork-safe: a child forked after CUDA
    initialised in the parent crashes or hangs. GPU workers run `--pool solo` (one session per
    GPU) or `--pool threads` (several threads sharing one session).
    """
    if pool in FORK_SAFE_POOLS:
        return None
    provider = serving or serving_provider(settings)
    if provider == CPU:
        return None
    return (
        f"the {pool} pool forks worker processes, which is unsafe once CUDA is initialised "
        f"(provider {provider}); run GPU workers with --pool solo (one process per GPU) or --pool threads"
    )
