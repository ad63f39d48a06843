"""ONNX Runtime sessions, the one place they are built: load -> warm up -> serve -> close.

The sha256 of exactly the bytes a session is built from is what every result names. On the
CPU the model file is opened once (`PinnedModelFile`), hashed through that descriptor, and the
session is built from the cache entry of that sha256 (`pipeline/model_cache.py`) or else from the
same open file (`/proc/self/fd/N`), so a model renamed over the path meanwhile cannot mix in, and
one written in place is caught by its size or time changing. GPU sessions are built from the
bytes read once into memory (TensorRT's shape profile is read from them). Input and output
names are read from the session, never hard-coded; the signature (rank, dtype by position) is
checked against the registry at load, so a wrong model is refused with `model_error` before
any request.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.host import HostInfo, detect_host
from pipeline.identity import FileIdentity
from pipeline.model_cache import CacheEntry, ModelCache, cache_key, save_options
from pipeline.providers import (
    CPU,
    ProviderChoice,
    ProviderOptions,
    ShapeProfile,
    choose_providers,
    engine_cache_dir,
    session_fallback_warning,
    uses_tensorrt,
)
from pipeline.records import ModelRef
from pipeline.registry import Identified, Registry, RoleSpec, TensorSpec
from pipeline.settings import Settings

log = logging.getLogger("voxmill.sessions")

RACY_MARGIN_NS = 1_000_000_000  # a file changed this recently is hashed, never remembered
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/"
ORT_DTYPES = {"float32": "tensor(float)", "int32": "tensor(int32)", "int64": "tensor(int64)"}
DTYPE_KINDS = {
    "int": ("tensor(int32)", "tensor(int64)", "tensor(int16)", "tensor(int8)", "tensor(uint8)"),
    "float": ("tensor(float)", "tensor(float16)", "tensor(double)"),
}
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class SessionOptions:
    """How to build sessions: provider, threads, warm-up runs, provider options, optimized-model cache.

    `model_cache_dir` None: no cache (every load optimises the graph from the source file).
    `prepack` False: ONNX Runtime does not pre-pack weights for the CPU kernels. A session run
    once (the watcher's validation) loads faster and touches about a third less memory; the
    optimised graph it saves to the cache is byte for byte the same. Serving sessions pre-pack.
    """

    provider: str = "cpu"
    intra_op_threads: int = 1
    warmup_runs: int = 1
    provider_options: ProviderOptions = field(default_factory=ProviderOptions)
    model_cache_dir: Path | None = None
    model_cache_keep: int = 6
    prepack: bool = True

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
        )

    def model_cache(self) -> ModelCache | None:
        """The optimized-model cache when configured and trustworthy."""
        if self.model_cache_dir is None:
            return None
        cache = ModelCache(self.model_cache_dir, self.model_cache_keep)
        return cache if cache.usable() else None


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def read_model_bytes(path: Path) -> bytes:
    """The model file's bytes; a missing file, folder or git-lfs pointer is a `model_error`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    _check_model_head(path, data, len(data))
    return data


def hash_model_file(path: Path, known: ModelCache | None = None, check_head: bool = True) -> str:
    """The sha256 of the model file, read in chunks (never whole in memory), or known (`PinnedModelFile`).

    Errors as `read_model_bytes`; `check_head` False hashes an empty file or a git-lfs pointer too.
    """
    with PinnedModelFile(path, known, check_head) as pinned:
        return pinned.sha256


class PinnedModelFile:
    """A model file opened once: hashed through its descriptor, and read by ONNX Runtime through it.

    `source` is what ONNX Runtime opens: `/proc/self/fd/N` where the platform has it (the very
    file that was hashed, even if another is renamed over the path meanwhile), else the path.
    `check_unchanged()` after building catches a file written in place (or, without
    `/proc`, replaced) while it was read. Opening and hashing raise `model_error` as
    `read_model_bytes` does.

    With `known` (the optimized-model cache), a file this machine already hashed, unchanged
    since (same `FileIdentity`), takes its sha256 from there instead of
    being read (`hashed` False); a file hashed here is recorded for the next load.
    """

    CHUNK_BYTES = 8 * 1024 * 1024

    def __init__(self, path: Path, known: ModelCache | None = None, check_head: bool = True) -> None:
        self.path = path
        self.check_head = check_head
        opened_at_ns = time.time_ns()
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise _unreadable(path, exc) from None
        try:
            self.opened = FileIdentity.from_stat(path, os.fstat(self.fd))
            remembered = known.known_sha256(self.opened) if known is not None else None
            self.hashed = remembered is None
            if remembered and check_head:  # still refused as precisely as when it is read
                head = os.pread(self.fd, len(LFS_POINTER_PREFIX), 0)
                _check_model_head(path, head, self.opened.size)
            self.sha256 = remembered or self._hash()
            if known is not None and self.hashed and self._settled_before(opened_at_ns):
                known.remember_sha256(self.opened, self.sha256)
        except BaseException:
            os.close(self.fd)
            raise
        by_fd = Path(f"/proc/self/fd/{self.fd}")
        self.source = str(by_fd) if by_fd.exists() else str(path)

    def _hash(self) -> str:
        digest = hashlib.sha256()
        size = 0
        try:
            with open(self.fd, "rb", closefd=False) as stream:
                while chunk := stream.read(self.CHUNK_BYTES):
                    if size == 0 and self.check_head:
                        _check_model_head(self.path, chunk, len(chunk))
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise _unreadable(self.path, exc) from None
        if self.check_head:
            _check_model_head(self.path, b"", size)
        return digest.hexdigest()

    def _settled_before(self, opened_at_ns: int) -> bool:
        """Unchanged while hashed, and last changed well before it was opened.

        File times tick coarsely (a few ms): a write landing in the same tick as the previous
        one could leave the identity unchanged. A file last changed `RACY_MARGIN_NS` before it
        was opened cannot: any later write stamps a later time (git's "racy clean" rule).
        """
        unchanged = FileIdentity.from_stat(self.path, os.fstat(self.fd)) == self.opened
        return unchanged and self.opened.last_change_ns < opened_at_ns - RACY_MARGIN_NS

    def check_unchanged(self) -> None:
        """`model_error` when the file was written in place (or, read by path, replaced) since hashing."""
        changed = FileIdentity.from_stat(self.path, os.fstat(self.fd)).written_since(self.opened)
        if not changed and self.source == str(self.path):
            with contextlib.suppress(OSError):
                changed = os.stat(self.path).st_ino != self.opened.inode
        if changed:
            raise VoxmillError(
                errors.MODEL_ERROR,
                f"{self.path} changed while it was read (sha256 {self.sha256[:12]}… no longer holds)",
            )

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> PinnedModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unreadable(path: Path, exc: OSError) -> VoxmillError:
    if isinstance(exc, FileNotFoundError):
        return VoxmillError(errors.MODEL_ERROR, f"model file {path} does not exist")
    return VoxmillError(errors.MODEL_ERROR, f"cannot read model file {path}: {exc.strerror}")


def _check_model_head(path: Path, data: bytes, size: int) -> None:
    if data.startswith(LFS_POINTER_PREFIX):
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{path} is a git-lfs pointer file ({size} bytes), not the model: "
            "run `git lfs pull` in the model folder (or download the real file)",
        )
    if size == 0:
        raise VoxmillError(errors.MODEL_ERROR, f"model file {path} is empty")


def check_signature(spec: RoleSpec, file_name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Refuse a session whose inputs/outputs do not match the role (by position)."""
    if len(inputs) < len(spec.inputs):
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"{file_name} has {len(inputs)} input(s); a {spec.role} model needs {len(spec.inputs)}",
        )
    if len(outputs) < len(spec.outputs):
        raise VoxmillError(errors.MODEL_ERROR, f"{file_name} has no output; a {spec.role} model needs one")
    for kind, declared, wanted in (("input", inputs, spec.inputs), ("output", outputs, spec.outputs)):
        for index, (arg, want) in enumerate(zip(declared, wanted, strict=False)):
            problem = _tensor_mismatch(arg, want)
            if problem:
                raise VoxmillError(
                    errors.MODEL_ERROR,
                    f"{file_name} {kind} {index} ({arg.name!r}) {problem}; "
                    f"not {_article(spec.role)} {spec.role} model",
                )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _tensor_mismatch(arg: Any, want: TensorSpec) -> str | None:
    shape = list(arg.shape)
    if want.rank is not None and len(shape) != want.rank:
        return f"has rank {len(shape)} (shape {shape}), expected rank {want.rank}"
    if want.dtype is not None and arg.type != ORT_DTYPES[want.dtype]:
        return f"has type {arg.type}, expected {ORT_DTYPES[want.dtype]}"
    if want.dtype_kind is not None and arg.type not in DTYPE_KINDS[want.dtype_kind]:
        return f"has type {arg.type}, expected {_article(want.dtype_kind)} {want.dtype_kind} tensor"
    if want.dims is not None:
        for axis, (got, expected) in enumerate(zip(shape, want.dims, strict=False)):
            if expected is not None and isinstance(got, int) and got != expected:
                return f"has size {got} on axis {axis}, expected {expected}"
    return None


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
        spec = registry.role(role)
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
        """Run the model on inputs given by position; returns the outputs by position."""
        feeds = dict(zip(self.input_names, inputs, strict=False))
        try:
            outputs: list[Array] = self.session.run(None, feeds)
        except Exception as exc:  # ONNX Runtime raises its own exception types
            raise VoxmillError(errors.MODEL_ERROR, f"{self.path.name} failed to run: {exc}") from exc
        return outputs

    def close(self) -> None:
        """Release the ONNX Runtime session."""
        self.session = None
        self.warm = False

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
        }


def plan_providers(
    options: SessionOptions,
    spec: RoleSpec,
    data: bytes,
    sha256: str,
    available: Sequence[str],
    host: HostInfo | None = None,
) -> tuple[ProviderChoice, Path | None]:
    """The provider choice for one model, and its TensorRT engine cache folder when TensorRT may serve.

    Only when TensorRT is installed and wanted are the GPU and versions detected (`host`, when
    not given) and the registry's shape profile read from the model; a CPU load does neither.
    """
    provider_options = options.provider_options
    if not uses_tensorrt(options.provider, available):
        return choose_providers(options.provider, available, provider_options), None
    host = host or detect_host(provider_options.device_id)
    cache_dir = engine_cache_dir(provider_options, sha256, host)
    profile = _shape_profile(spec, data)
    return choose_providers(options.provider, available, provider_options, cache_dir, profile), cache_dir


def make_engine_dir(path: Path) -> None:
    """Create the engine cache folder; an unwritable one is a `model_error` that names the setting."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VoxmillError(
            errors.MODEL_ERROR,
            f"cannot create the TensorRT engine cache folder {path}: {exc.strerror}; "
            "point engine_cache_dir (VOXMILL_ENGINE_CACHE_DIR) at a writable folder",
        ) from None


def _session_options(ort: Any, options: SessionOptions, optimise: bool = True) -> Any:
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


def _shape_profile(spec: RoleSpec, data: bytes) -> ShapeProfile:
    """TensorRT min/opt/max shapes for the model's inputs, named as the file names them."""
    if not spec.profiles:
        return ShapeProfile()
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception:
        return ShapeProfile()
    initializers = {init.name for init in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    first = names[0]
    profile: dict[str, dict[str, tuple[int, ...]]] = {"min": {}, "opt": {}, "max": {}}
    for level in profile:
        shape = spec.profiles[level]
        profile[level][first] = shape
        if len(names) > 1:  # the tokenizer's feats_length
            profile[level][names[1]] = (shape[0],)
    return ShapeProfile(min=profile["min"], opt=profile["opt"], max=profile["max"])
