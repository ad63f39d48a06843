"""GPU-specific worker rules: never fork after CUDA is initialised.

ONNX Runtime's CUDA and TensorRT providers initialise CUDA in the process that builds the
session, and a CUDA context does not survive `fork()`. A GPU worker therefore runs

- `--pool solo`: one process, one session per GPU, one task at a time (the compose file's
  `worker-gpu`); run one worker per GPU (`VOXMILL_CUDA_DEVICE_ID`, or one GPU reserved per
  container); or
- `--pool threads -c N`: N threads in one process sharing one session per role. ONNX Runtime's
  `InferenceSession.run` is thread-safe, so N tasks run concurrently on the same GPU without a
  second copy of the weights; N of 2-4 keeps the GPU busy while other threads decode audio.

and never `prefork` (refused below, before Celery starts). The model holder loads sessions in
the worker's main process for solo/threads pools, so nothing forks after CUDA is up.

Hot reload on a GPU works as on CPU: the new session is built and warmed up *beside* the old
one, then swapped between two tasks. The GPU must hold two copies of a model for that moment;
`cuda_mem_limit_bytes` caps each session's CUDA arena, so two sessions may use up to twice
that. With TensorRT, a new model (new sha256) needs a new engine: build it ahead of time with
`voxmill models build-engine` (engines are keyed by sha256, not path) or the reload spends
minutes building it in the background while the old model keeps serving.
"""

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
