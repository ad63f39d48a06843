"""ONNX Runtime sessions, the one place they are built: load -> warm up -> serve -> close.

The sha256 of exactly the bytes a session is built from is what every result names. On the
CPU the model file is opened once (`pipeline.models.files.PinnedModelFile`), hashed through that
descriptor, and the session is built from the cache entry of that sha256
(`pipeline/models/cache.py`) or else from the same open file. GPU sessions are built from the
bytes read once into memory (`pipeline.models.planning` reads TensorRT's shape profile from
them). Input and output names are read from the session, never hard-coded; the signature is
checked against the registry at load (`pipeline.models.signature`), so a wrong model is refused
with `model_error` before any request.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.models.cache import CacheEntry, ModelCache, cache_key, save_options
from pipeline.models.files import PinnedModelFile, read_model_bytes, sha256_bytes
from pipeline.models.host import HostInfo
from pipeline.models.identity import FileIdentity
from pipeline.models.options import SessionOptions
from pipeline.models.planning import make_engine_dir, plan_providers
from pipeline.models.providers import CPU, ProviderChoice, choose_providers, session_fallback_warning
from pipeline.models.registry import Identified, Registry, RoleSpec
from pipeline.models.signature import check_signature
from pipeline.records import ModelRef

log = logging.getLogger("voxmill.sessions")

Array = npt.NDArray[Any]
ARENA_SHRINK = ("memory.enable_memory_arena_shrinkage", "cpu:0")  # a run option: ONNX Runtime's CPU arena


class Built(NamedTuple):
    """A freshly built ONNX Runtime session, how it serves, and the sha256 it was built from."""

    session: Any
    choice: ProviderChoice
    engine_dir: Path | None
    sha256: str


class ModelSession:
    """A loaded and checked model of one role. Build with `load`, then `warm_up` before use."""

    def __init__(
        self,
        *,
        spec: RoleSpec,
        identified: Identified,
        ref: ModelRef,
        path: Path,
        session: Any,
        choice: ProviderChoice,
        load_s: float,
        engine_dir: Path | None = None,
        shrink_above: int | None = None,
    ) -> None:
        self.spec = spec
        self.identified = identified
        self.ref = ref
        self.path = path
        self.session = session
        self.choice = choice
        self.load_s = load_s
        self.engine_dir = engine_dir
        self.input_names: list[str] = [i.name for i in session.get_inputs()]
        self.output_names: list[str] = [o.name for o in session.get_outputs()]
        self.active_providers: list[str] = list(session.get_providers())
        self.first_run_ms: float | None = None
        self.warm_latency_ms: float | None = None
        self.warmup_s = 0.0
        self.warm = False
        self.cache_state = "off"  # optimized-model cache: off | hit | built | rebuilt
        self.shrink_above = shrink_above  # see `shrink_above`
        self._shrink_options: Any = None
        self.twin: ModelSession | None = None  # a tokenizer's batch file beside it (`pipeline.batching`)
        self.twin_file: FileIdentity | None = None  # that file as it was when the twin was (re)loaded

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def sha256(self) -> str:
        return self.ref.sha256

    @property
    def token_rate_hz(self) -> int:
        return self.identified.variant.token_rate_hz or 25

    @classmethod
    def load(
        cls,
        path: Path,
        role: str,
        options: SessionOptions,
        registry: Registry,
        expected_sha256: str | None = None,
        host: HostInfo | None = None,
    ) -> ModelSession:
        """Read `path` once, check its sha256 (when given) and signature, and build the session.

        On the CPU, `path` is hashed as a stream and the session built from the optimized-model
        cache entry of that sha256, else from the open file (saving the entry when the cache is on).

        When TensorRT may serve, its engine cache is `engine_cache_dir/<key of model, GPU,
        versions, precision>`; `host` (GPU name and versions) is detected when not given.
        Raises `VoxmillError(model_error)` for anything that makes the file unusable.
        """
        import onnxruntime as ort

        started = time.perf_counter()
        spec = registry.role(role).for_file(path.name)
        available = ort.get_available_providers()
        choice = choose_providers(options.provider, available, options.provider_options)
        cache_state = "off"
        if choice.providers == [(CPU, {})]:
            cache = options.model_cache()
            with PinnedModelFile(path, known=cache) as pinned:
                _check_expected(path, pinned.sha256, expected_sha256)
                built, cache_state = _cpu_session(ort, pinned, cache, spec, options, choice)
        else:  # GPU: TensorRT has its own engine cache, and reads its shape profile from the bytes
            built = _session_from_bytes(ort, path, spec, options, available, host, expected_sha256)
        session, choice, engine_dir, sha256 = built
        if choice.warning:
            log.warning("%s: %s", path.name, choice.warning)
        check_signature(spec, path.name, session.get_inputs(), session.get_outputs())
        identified = registry.identify(role, path.name, sha256)
        provider = str(session.get_providers()[0])
        if "Tensorrt" in provider and options.provider_options.trt_fp16:
            provider += " (fp16)"
        ref = ModelRef(role, path.name, sha256, provider, str(ort.__version__))
        loaded = cls(
            spec=spec,
            identified=identified,
            ref=ref,
            path=path,
            session=session,
            choice=choice,
            load_s=time.perf_counter() - started,
            engine_dir=engine_dir,
            shrink_above=shrink_above(options.arena_shrink, spec),
        )
        loaded.cache_state = cache_state
        warning = session_fallback_warning(choice, loaded.active_providers)
        if warning:
            log.warning("%s: %s", path.name, warning)
        return loaded

    def warm_up(self, inputs: Sequence[Array], runs: int) -> float:
        """Run `inputs` `runs` times (at least once) and check outputs are finite; the last latency (ms)."""
        warmup_started = time.perf_counter()
        for index in range(max(1, runs)):
            started = time.perf_counter()
            outputs = self.run(inputs)
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            if index == 0:
                self.first_run_ms = elapsed_ms
            self.warm_latency_ms = elapsed_ms
            for out in outputs:
                if np.issubdtype(out.dtype, np.floating) and not np.isfinite(out).all():
                    raise VoxmillError(
                        errors.MODEL_ERROR, f"{self.path.name} gives non-finite outputs on the warm-up clip"
                    )
        self.warmup_s = time.perf_counter() - warmup_started
        self.warm = True
        return self.warm_latency_ms or 0.0

    def run(self, inputs: Sequence[Array]) -> list[Array]:
        """Run the model on inputs given by position; returns the outputs by position.

        A run whose first input has more elements than `shrink_above` hands what it added to the
        CPU arena back to the system as it ends.
        """
        feeds = dict(zip(self.input_names, inputs, strict=False))
        run_options = None
        if self.shrink_above is not None and inputs and np.size(inputs[0]) > self.shrink_above:
            run_options = self._shrink_run_options()
        try:
            outputs: list[Array] = self.session.run(None, feeds, run_options)
        except Exception as exc:  # ONNX Runtime raises its own exception types
            raise VoxmillError(errors.MODEL_ERROR, f"{self.path.name} failed to run: {exc}") from exc
        return outputs

    def _shrink_run_options(self) -> Any:
        if self._shrink_options is None:
            import onnxruntime as ort

            self._shrink_options = ort.RunOptions()
            self._shrink_options.add_run_config_entry(*ARENA_SHRINK)
        return self._shrink_options

    def close(self) -> None:
        """Release the ONNX Runtime session (and its batch twin's)."""
        self.session = None
        self.warm = False
        if self.twin is not None:
            self.twin.close()

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts about this session (for status and logs)."""
        return {
            "role": self.role,
            "file": self.ref.file,
            "path": str(self.path),
            "sha256": self.sha256,
            "variant": self.identified.variant.name,
            "recognised_by": self.identified.by,
            "providers": self.active_providers,
            "load_s": round(self.load_s, 4),
            "first_run_ms": None if self.first_run_ms is None else round(self.first_run_ms, 3),
            "warm_latency_ms": None if self.warm_latency_ms is None else round(self.warm_latency_ms, 3),
            "warmup_s": round(self.warmup_s, 4),
            "engine_dir": None if self.engine_dir is None else str(self.engine_dir),
            "model_cache": self.cache_state,
            **({"batch_file": self.twin.ref.to_dict()} if self.twin is not None else {}),
        }


def shrink_above(policy: str, spec: RoleSpec | None) -> int | None:
    """Above how many elements of its first input a run shrinks the CPU arena; None: never.

    `long`: above the role's largest profile shape (a 30 s clip): the arena keeps what clips up to
    that length need, and a longer one's growth does not outlive its run. `always`: every run.
    """
    if policy == "always":
        return 0
    if policy == "long" and spec is not None and spec.profiles.get("max"):
        return int(np.prod(spec.profiles["max"]))
    if policy not in ("long", "always", "never"):
        raise ValueError(f"arena_shrink must be long, always or never, not {policy!r}")
    return None


def _session_options(ort: Any, options: SessionOptions, optimise: bool = True) -> Any:
    """The one place ONNX Runtime's session options are set (role models and helper models alike).

    Memory patterns are off by default: planned and kept per input shape, they make the CPU arena
    grow with each new clip length, and cost nothing measurable to do without (BENCHMARKS.md).
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimise else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = options.intra_op_threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if not options.prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_mem_pattern = options.mem_pattern
    so.log_severity_level = 3
    return so


def helper_session(path: Path, options: SessionOptions) -> tuple[Any, str]:
    """A CPU session of a small helper model (the speech detector), and the sha256 it was built from.

    Built as the role models are (`_session_options`: ORT_ENABLE_ALL, the configured intra-op
    threads, no spinning; the provider named explicitly) from the very file that was hashed. It
    always runs on the CPU: a 32 ms frame recurrence gains nothing on a GPU.
    """
    import onnxruntime as ort

    with PinnedModelFile(path) as pinned:
        so = _session_options(ort, options)
        try:
            session = ort.InferenceSession(pinned.source, sess_options=so, providers=[CPU])
        except Exception as exc:
            raise VoxmillError(errors.MODEL_ERROR, _load_failure_message(path, str(exc))) from exc
        pinned.check_unchanged()
        return session, pinned.sha256


def _build_session(
    ort: Any,
    model: bytes | str,
    path: Path,
    options: SessionOptions,
    choice: ProviderChoice,
    save_to: Path | None = None,
) -> Any:
    """The session of `model` (bytes, or a file to open); with `save_to`, its optimised graph goes there."""
    so = _session_options(ort, options)
    if save_to is not None:
        save_options(so, save_to)
    try:
        return ort.InferenceSession(model, sess_options=so, providers=choice.providers)
    except Exception as exc:
        raise VoxmillError(errors.MODEL_ERROR, _load_failure_message(path, str(exc))) from exc


def _session_from_cache(
    ort: Any,
    cache: ModelCache,
    entry: CacheEntry,
    sha256: str,
    options: SessionOptions,
    choice: ProviderChoice,
) -> Built | None:
    """The session of a cache entry (graph already optimised); None (entry discarded) when it fails."""
    try:
        so = _session_options(ort, options, optimise=False)
        session = ort.InferenceSession(str(entry.model_path), sess_options=so, providers=choice.providers)
    except Exception as exc:
        name = entry.folder.name
        log.warning("optimized-model cache entry %s does not load (%s); rebuilding it", name, exc)
        cache.discard(entry)
        return None
    return Built(session, choice, None, sha256)


def _cpu_session(
    ort: Any,
    pinned: PinnedModelFile,
    cache: ModelCache | None,
    spec: RoleSpec,
    options: SessionOptions,
    choice: ProviderChoice,
) -> tuple[Built, str]:
    """A CPU session from the cache entry of the sha256, else from the open file; and its cache state."""
    if cache is None:
        return _session_from_file(ort, pinned, spec, options, choice, None), "off"
    key = cache_key(pinned.sha256, ort.__version__)
    entry = cache.lookup(key)
    if entry is not None:
        built = _session_from_cache(ort, cache, entry, pinned.sha256, options, choice)
        if built is not None:
            return built, "hit"
    built = _session_from_file(ort, pinned, spec, options, choice, (cache, key))
    return built, "rebuilt" if entry else "built"


def _session_from_file(
    ort: Any,
    pinned: PinnedModelFile,
    spec: RoleSpec,
    options: SessionOptions,
    choice: ProviderChoice,
    saving: tuple[ModelCache, str] | None,
) -> Built:
    """The session of the open model file (no copy of it in Python); with `saving`, write its cache entry."""
    staging = saving[0].prepare(saving[1]) if saving is not None else None
    try:
        session = _build_session(ort, pinned.source, pinned.path, options, choice, staging)
        pinned.check_unchanged()
    except VoxmillError:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if saving is not None and staging is not None:
        cache, key = saving
        _commit_checked(cache, key, staging, spec, pinned.path, session, pinned.sha256, ort.__version__)
    return Built(session, choice, None, pinned.sha256)


def _session_from_bytes(
    ort: Any,
    path: Path,
    spec: RoleSpec,
    options: SessionOptions,
    available: Sequence[str],
    host: HostInfo | None,
    expected_sha256: str | None,
) -> Built:
    """Read the file once, check its sha256, build the session from those bytes (GPU providers)."""
    data = read_model_bytes(path)
    sha256 = sha256_bytes(data)
    _check_expected(path, sha256, expected_sha256)
    choice, engine_dir = plan_providers(options, spec, data, sha256, available, host)
    if engine_dir is not None:
        make_engine_dir(engine_dir)
    session = _build_session(ort, data, path, options, choice)
    return Built(session, choice, engine_dir, sha256)


def _commit_checked(
    cache: ModelCache,
    key: str,
    staging: Path,
    spec: RoleSpec,
    path: Path,
    session: Any,
    sha256: str,
    ort_version: str,
) -> None:
    """Keep the entry ONNX Runtime wrote only for a model that passes the signature check."""
    try:
        check_signature(spec, path.name, session.get_inputs(), session.get_outputs())
    except VoxmillError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    facts = {"source": path.name, "sha256": sha256, "onnxruntime": ort_version, "role": spec.role}
    cache.commit(key, staging, facts)


def _check_expected(path: Path, sha256: str, expected_sha256: str | None) -> None:
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{path} has sha256 {sha256[:12]}…, expected {expected_sha256[:12]}… "
            "(the file changed while it was read)",
        )


def _load_failure_message(path: Path, reason: str) -> str:
    """ONNX Runtime's reason, naming the user's file (not the descriptor it was read through)."""
    first_line = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
    first_line = re.sub(r"/proc/self/fd/\d+", str(path), first_line)
    first_line = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", first_line)
    if "IR version" in reason or "opset" in reason.lower():
        return (
            f"{path} needs a newer onnxruntime than this one ({first_line}); "
            "upgrade onnxruntime or re-export the model with an older opset"
        )
    if "Protobuf parsing failed" in reason:
        what = "the file is truncated, corrupted or of another kind (ONNX Runtime: Protobuf parsing failed)"
        return f"{path} is not a loadable ONNX model: {what}"
    return f"{path} is not a loadable ONNX model: {first_line}"


