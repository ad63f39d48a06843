"""`voxmill doctor`: the troubleshooting table of docs/operations.md as checks of this machine.

`run_checks(settings)` returns one `Check` per thing looked at, each `ok`, `warning` (works, but
something is off: what to do is in `fix`) or `error` (something voxmill needs is broken). Checks
read and never change anything: no model is hashed into the cache, no key is written to Redis.

What is checked: Python and the installed packages against voxmill's requirements; the ONNX
Runtime providers the settings ask for, by building a one-node session on each (and, for CUDA and
TensorRT, the shared libraries they need, found or missing by name); each model file (a git-lfs
pointer, IR version and opsets against this ONNX Runtime, the signature against the registry, the
variant by sha256, a TensorRT engine for this GPU); the broker (reachable, authenticated, AOF,
`maxmemory-policy`); the allowed roots; the optimized-model cache folder (owner and mode); free
memory against what a worker process needs to load the models.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rich.console import Console
from rich.markup import escape

from pipeline.errors import VoxmillError
from pipeline.settings import Settings

Status = Literal["ok", "warning", "error"]
DOCTOR_VERSION = 1
STATUS_RANK = {"ok": 0, "warning": 1, "error": 2}
STATUS_STYLE = {"ok": "green", "warning": "yellow", "error": "red"}
# Shown with their versions; every requirement of voxmill is checked, these are the ones people ask for.
KEY_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnx", "celery", "redis", "numpy")
# Memory of one worker process holding models of N bytes (BENCHMARKS.md, "Memory"): the full
# tokenizer (471 MB) peaks at ~0.7 GB from the optimized-model cache and ~1.3 GB on the load that
# builds the entry; the embedder (26 MB) at ~0.23 GB.
PROCESS_BASE_BYTES = 200 * 1024 * 1024
STEADY_PER_MODEL_BYTE = 1.2
FIRST_LOAD_PER_MODEL_BYTE = 2.4
PROBE_OPSET = 13
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
URL_ROOT = re.compile(r"^[a-z][a-z0-9+.-]*:/", re.IGNORECASE)


@dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, how it is, and what to do about it."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warning(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warning", detail, fix)


def error(name: str, detail: str, fix: str) -> Check:
    return Check(name, "error", detail, fix)


# --------------------------------------------------------------------------- the whole report
def run_checks(settings: Settings) -> list[Check]:
    """Every check: software and providers, each model file, the broker, roots and cache, memory."""
    import onnxruntime as ort

    from pipeline.models.registry import Registry

    available = list(ort.get_available_providers())
    checks = [python_check(), *package_checks()]
    checks += provider_checks(settings, available)
    models, model_lines = model_checks(settings, Registry.load(), available)
    checks += model_lines
    checks += broker_checks(settings)
    checks += root_checks(settings)
    checks.append(cache_check(settings))
    checks.append(memory_check(available_memory(), sum(m.load_bytes for m in models), os.cpu_count() or 1))
    return checks


def worst(checks: Sequence[Check]) -> Status:
    return max((c.status for c in checks), key=STATUS_RANK.__getitem__, default="ok")


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check is an error (what `voxmill doctor` exits with), else 0."""
    return 1 if worst(checks) == "error" else 0


def checks_json(checks: Sequence[Check]) -> dict[str, Any]:
    """The report for scripts (`voxmill doctor --json`)."""
    counts = {status: sum(c.status == status for c in checks) for status in STATUS_RANK}
    return {
        "version": DOCTOR_VERSION,
        "status": worst(checks),
        "counts": counts,
        "checks": [dataclasses.asdict(c) for c in checks],
    }


def render(checks: Sequence[Check], console: Console) -> None:
    """One line per check: status, name, what was found, and for a warning or error what to do."""
    width = max((len(c.name) for c in checks), default=0)
    for check in checks:
        style = STATUS_STYLE[check.status]
        line = (
            f"[{style}]{check.status:7s}[/{style}]  {escape(check.name.ljust(width))}  {escape(check.detail)}"
        )
        if check.fix and check.status != "ok":
            line += f" [bold]->[/bold] {escape(check.fix)}"
        console.print(line)
    counts = checks_json(checks)["counts"]
    console.print(f"\n{counts['ok']} ok, {counts['warning']} warning(s), {counts['error']} error(s)")


def doctor_command(settings: Settings, as_json: bool, console: Console) -> int:
    """`voxmill doctor [--json]`: print the report; the exit status."""
    checks = run_checks(settings)
    if as_json:
        print(json.dumps(checks_json(checks), indent=2))
    else:
        render(checks, console)
    return exit_code(checks)


# --------------------------------------------------------------------------- Python and packages
def python_check() -> Check:
    """The interpreter (pip's requires-python keeps it at 3.10 or newer) and where it lives."""
    return ok("python", f"{'.'.join(str(n) for n in sys.version_info[:3])} ({sys.executable})")


def package_checks(version_of: Callable[[str], str] = importlib.metadata.version) -> list[Check]:
    """voxmill's requirements installed and new enough; one onnxruntime flavour only."""
    found = {}
    for name in KEY_PACKAGES:
        try:
            found[name] = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    shown = ", ".join(f"{name} {version}" for name, version in found.items())
    checks = []
    problems = unmet_requirements(version_of)
    if problems is None:
        checks.append(
            warning(
                "packages",
                f"voxmill is not installed as a package; {shown}",
                "pip install -e . in the checkout",
            )
        )
    elif problems:
        checks.append(
            error("packages", "; ".join(problems), "pip install -e . (or pip install -U the ones named)")
        )
    else:
        checks.append(ok("packages", f"voxmill {version_of('voxmill')}; {shown}"))
    if "onnxruntime" in found and "onnxruntime-gpu" in found:
        checks.append(
            error(
                "onnxruntime",
                f"both onnxruntime {found['onnxruntime']} and onnxruntime-gpu {found['onnxruntime-gpu']} are "
                "installed: they share one module, and whichever was installed last wins",
                "pip uninstall -y onnxruntime onnxruntime-gpu, then pip install onnxruntime-gpu (GPU) "
                "or onnxruntime (CPU)",
            )
        )
    return checks


def unmet_requirements(version_of: Callable[[str], str]) -> list[str] | None:
    """voxmill's own requirements that are missing or too old; None when voxmill is not installed."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("voxmill") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    problems = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement (gpu, monitor, dev)
        try:
            installed = version_of(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is missing")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} does not satisfy {requirement.specifier}")
    return problems


# --------------------------------------------------------------------------- providers
def find_shared_library(name: str) -> str | None:
    """Where the loader (or onnxruntime-gpu, from pip's nvidia-* packages) finds `lib{name}`, or None."""
    import ctypes.util

    found = ctypes.util.find_library(name)
    if found:
        return found
    folders = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    for site in sys.path:  # pip's nvidia-cudnn-cu12 & co. keep theirs in site-packages/nvidia/*/lib
        folders += glob.glob(os.path.join(site, "nvidia", "*", "lib"))
        folders += glob.glob(os.path.join(site, "tensorrt_libs"))
    for folder in folders:
        hits = sorted(glob.glob(os.path.join(folder, f"lib{name}.so*")))
        if hits:
            return hits[0]
    return None


def library_report(
    provider: str, find: Callable[[str], str | None] = find_shared_library
) -> tuple[str, list[str]]:
    """`cudart found, cudnn missing, ...` for the libraries `provider` needs, and the missing ones."""
    from pipeline.models.providers import REQUIRED_LIBRARIES

    parts, missing = [], []
    for lib in REQUIRED_LIBRARIES.get(provider, ()):
        where = find(lib)
        parts.append(f"lib{lib} {'found' if where else 'missing'}")
        if not where:
            missing.append(f"lib{lib}")
    return ", ".join(parts), missing


def probe_model_bytes(ir_version: int = 8, opsets: Sequence[tuple[str, int]] = (("", PROBE_OPSET),)) -> bytes:
    """A one-node (Identity) ONNX model with the given IR version and opsets."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "voxmill-doctor-probe", [x], [y])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=ir_version
    )
    return bytes(model.SerializeToString())


def ort_refusal(
    data: bytes, providers: Sequence[Any] = ("CPUExecutionProvider",)
) -> tuple[str | None, list[str]]:
    """Build a session from `data`: (ONNX Runtime's reason for refusing it or None, the providers it got)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the report says what failed; ONNX Runtime's own log is noise here
    try:
        session = ort.InferenceSession(data, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own exception types
        return ort_message(str(exc)), []
    return None, list(session.get_providers())


def ort_message(text: str) -> str:
    """ONNX Runtime's sentence without its error prefix and C++ signature."""
    first = text.strip().splitlines()[0] if text.strip() else "unknown error"
    first = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", first)
    return re.sub(r"^\S+\.(cc|h):\d+ .*?\) (?=[A-Z])", "", first)


def provider_checks(settings: Settings, available: Sequence[str]) -> list[Check]:
    """What serves for the requested provider, and whether each GPU provider really starts."""
    from pipeline.models.host import detect_versions
    from pipeline.models.providers import (
        CPU,
        CUDA,
        GPU_INSTALL_HINT,
        PROVIDER_NAMES,
        TENSORRT,
        TENSORRT_INSTALL_HINT,
        ProviderOptions,
        choose_providers,
        cuda_options,
    )

    requested = settings.provider
    options = ProviderOptions(device_id=settings.cuda_device_id)
    checks, usable = [], {CPU: True}
    for provider, name in ((TENSORRT, "tensorrt"), (CUDA, "cuda")):
        if provider not in available:
            continue
        entry = (
            provider,
            cuda_options(options) if provider == CUDA else {"device_id": str(options.device_id)},
        )
        usable[provider] = provider in ort_refusal(probe_model_bytes(), [entry, CPU])[1]
        report, missing = library_report(provider)
        if usable[provider]:
            version = (
                f"; TensorRT {detect_versions().get('tensorrt', '(version unknown)')}"
                if name == "tensorrt"
                else ""
            )
            checks.append(ok(name, f"{provider} starts ({report}){version}"))
            continue
        fix = (
            f"install {', '.join(missing)} of the CUDA/cuDNN versions onnxruntime-gpu was built for "
            "(pip install 'voxmill[gpu]' brings them) or put their folder on LD_LIBRARY_PATH"
            if missing
            else "check nvidia-smi sees the GPU and that CUDA/cuDNN match onnxruntime-gpu's build"
        )
        detail = f"{provider} is installed but does not start ({report})"
        checks.append((error if requested == name else warning)(name, detail, fix))
    chain = choose_providers(requested, available, options).names
    serving = next(p for p in chain if usable.get(p))
    wanted = PROVIDER_NAMES.get(requested)
    installed = ", ".join(available)
    if wanted is None or serving == wanted:
        checks.insert(0, ok("provider", f"{requested}: {serving} serves (installed: {installed})"))
    elif wanted in available:
        fix = "see the check of that provider below, or VOXMILL_PROVIDER=auto"
        checks.insert(
            0,
            error("provider", f"{requested} asked for, {serving} would serve: {wanted} does not start", fix),
        )
    else:
        hint = TENSORRT_INSTALL_HINT if wanted == TENSORRT else GPU_INSTALL_HINT
        detail = (
            f"{requested} asked for, {serving} would serve: this onnxruntime has no {wanted} ({installed})"
        )
        checks.insert(0, error("provider", detail, hint))
    return checks


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelFile:
    """A model file that passed its checks far enough to be sized."""

    role: str
    path: Path
    sha256: str
    load_bytes: int


@dataclass(frozen=True)
class GraphArg:
    """An input or output as `check_signature` reads one from ONNX Runtime: name, shape, type."""

    name: str
    shape: list[int | str | None]
    type: str


def graph_args(values: Sequence[Any], skip: Collection[str] = ()) -> list[GraphArg]:
    """The graph's value infos as ONNX Runtime would show them (initializers are no inputs)."""
    from onnx import TensorProto

    args = []
    for value in values:
        if value.name in skip:
            continue
        tensor = value.type.tensor_type
        shape: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        ]
        type_name = TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "undefined"
        args.append(GraphArg(value.name, shape, f"tensor({type_name})"))
    return args


def model_checks(
    settings: Settings, registry: Any, available: Sequence[str]
) -> tuple[list[ModelFile], list[Check]]:
    """Each role's file in the model folder, checked without building a session from it."""
    folder = settings.model_dir
    if not folder.is_dir():
        return [], [
            error(
                "models",
                f"model folder {folder} does not exist",
                "set VOXMILL_MODEL_DIR, or make stand-ins: voxmill models make-standin --out DIR",
            )
        ]
    models, checks = [], []
    for role in registry.roles:
        spec = registry.role(role)
        try:
            path = registry.find_model(role, folder)
        except VoxmillError:
            checks.append(
                warning(
                    f"{role} file",
                    f"no {spec.file_glob} in {folder}",
                    f"put the model there; workers serving {spec.op} cannot start without it",
                )
            )
            continue
        model, lines = check_model_file(role, path, registry, settings, available)
        checks += lines
        if model is not None:
            models.append(model)
        twin = registry.find_batch_model(role, folder)
        if twin is not None:  # checked, but not sized: no worker loads it yet
            checks += check_model_file(role, twin, registry, settings, available, batch=True)[1]
    if not models and not any(c.status == "error" for c in checks):
        checks.append(
            error("models", f"no model in {folder}", "voxmill models make-standin --out DIR to try")
        )
    return models, checks


def check_model_file(
    role: str,
    path: Path,
    registry: Any,
    settings: Settings,
    available: Sequence[str],
    batch: bool = False,
) -> tuple[ModelFile | None, list[Check]]:
    """One file: readable and no git-lfs pointer, IR/opsets, signature, variant, TensorRT engine.

    A `batch` file (checks named `<role> batch ...`) has its batch axes checked too, and no engine.
    """
    from pipeline.models.files import hash_model_file
    from pipeline.models.signature import check_batch_signature, check_signature

    label = f"{role} batch" if batch else role
    try:
        sha256 = hash_model_file(path)  # refuses an empty file or a git-lfs pointer by name
    except VoxmillError as exc:
        fix = "git lfs install && git lfs pull in the model folder" if "git-lfs" in exc.message else ""
        return None, [error(f"{label} file", exc.message, fix or "copy the real model file there")]
    lines = [ok(f"{label} file", f"{path} ({path.stat().st_size / 1e6:.1f} MB, sha256 {sha256[:12]})")]
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        what = f"{path.name} is not an ONNX model ({type(exc).__name__}: {str(exc)[:120]})"
        return None, [
            *lines,
            error(f"{label} onnx", what, "copy the file again: it is truncated or of another kind"),
        ]
    onnx_line, external_bytes = onnx_check(label, path, model)
    lines.append(onnx_line)
    inputs = graph_args(model.graph.input, {init.name for init in model.graph.initializer})
    outputs = graph_args(model.graph.output)
    spec = registry.role(role)
    try:
        check_signature(spec, path.name, inputs, outputs)
        if batch:
            check_batch_signature(path.name, inputs, outputs)
        what = f"matches the {role} role of the registry" + (", with a dynamic batch axis" if batch else "")
        lines.append(ok(f"{label} signature", what))
    except VoxmillError as exc:
        glob = spec.batch_glob if batch else spec.file_glob
        lines.append(
            error(f"{label} signature", exc.message, f"put a real {glob} there; this file is another model")
        )
    lines.append(variant_check(registry, role, path, sha256, label))
    if not batch:
        lines += engine_checks(role, sha256, settings, available)
    return ModelFile(role, path, sha256, path.stat().st_size + external_bytes), lines


def onnx_check(role: str, path: Path, model: Any) -> tuple[Check, int]:
    """IR version and opsets against this ONNX Runtime (a probe model of the same stamps), external data."""
    import onnxruntime as ort
    from onnx import TensorProto

    opsets = [(o.domain, int(o.version)) for o in model.opset_import]
    stamps = f"IR {model.ir_version}, opset " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in opsets)
    refusal, _ = ort_refusal(probe_model_bytes(int(model.ir_version), opsets))
    if refusal is not None:
        return error(
            f"{role} onnx",
            f"{path.name} ({stamps}) needs a newer onnxruntime than {ort.__version__}: {refusal}",
            "pip install -U onnxruntime (or onnxruntime-gpu), or re-export the model with an older opset",
        ), 0
    external, missing = 0, []
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        location = {entry.key: entry.value for entry in tensor.external_data}.get("location", "")
        target = path.parent / location
        if target.is_file():
            external += target.stat().st_size
        elif location not in missing:
            missing.append(location)
    if missing:
        return error(
            f"{role} onnx",
            f"{path.name} keeps weights in {', '.join(missing)}, not found beside it",
            "copy the external data files next to the model (or git lfs pull)",
        ), 0
    return ok(f"{role} onnx", f"{stamps}: loadable by onnxruntime {ort.__version__}"), external


def variant_check(registry: Any, role: str, path: Path, sha256: str, label: str = "") -> Check:
    """A known release by sha256, or only by name (its token rate is then the name's guess)."""
    label = label or role
    try:
        identified = registry.identify(role, path.name, sha256)
    except VoxmillError as exc:
        return error(f"{label} variant", exc.message, f"name the file like {registry.role(role).file_glob}")
    variant = identified.variant
    facts = [variant.description, f"{variant.token_rate_hz} tokens/s" if variant.token_rate_hz else ""]
    what = f"{variant.name}: {', '.join(f for f in facts if f)}"
    if identified.by == "sha256":
        return ok(f"{label} variant", f"{what}: sha256 of the known release")
    if registry.role(role).is_batch_name(path.name):
        return ok(
            f"{label} variant", f"{what}; known by its name (the registry lists no sha256 for batch files)"
        )
    if not any(v.sha256 for v in registry.role(role).variants):
        return ok(
            f"{label} variant", f"{what}; known by its name (the registry lists no sha256 for this role)"
        )
    v1 = (
        " (speech_tokenizer_v1.onnx: the 25 Hz release is told only by sha256)"
        if path.name.endswith("v1.onnx")
        else ""
    )
    return warning(
        f"{label} variant",
        f"sha256 {sha256[:12]} is no known release; taken by its name as {what}",
        "expected for a stand-in or your own export; for a released model download it again" + v1,
    )


def engine_checks(role: str, sha256: str, settings: Settings, available: Sequence[str]) -> list[Check]:
    """With TensorRT installed and asked for: an engine for this model, GPU, versions and precision."""
    from pipeline.models.engines import engine_status
    from pipeline.models.providers import ProviderOptions, uses_tensorrt

    if not uses_tensorrt(settings.provider, available):
        return []
    options = ProviderOptions(
        device_id=settings.cuda_device_id,
        trt_fp16=settings.trt_fp16,
        engine_cache_dir=settings.engine_cache_dir,
    )
    status = engine_status(sha256, options, available)
    if status.state == "ready":
        return [ok(f"{role} engine", status.detail)]
    return [
        warning(
            f"{role} engine",
            f"no TensorRT engine for this model on this GPU and TensorRT version ({status.engine_dir})",
            f"voxmill models build-engine {settings.model_dir} (else a worker's first start builds it)",
        )
    ]


# --------------------------------------------------------------------------- broker
def broker_checks(settings: Settings, timeout_s: float = 3.0) -> list[Check]:
    """Reachable and authenticated; AOF (queued jobs survive a restart); no eviction of queued jobs."""
    import redis

    url = settings.broker_url
    shown = settings.redacted_broker_url()
    if not url:
        return [
            warning(
                "broker",
                "VOXMILL_BROKER_URL is not set: extract, up and demo start an embedded Redis; "
                "worker, submit and status need one",
                "export VOXMILL_BROKER_URL=redis://[:password@]host:6379/0",
            )
        ]
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix", "sentinel"):
        return [
            warning(
                "broker", f"{shown}: not checked (doctor reaches redis://, rediss:// and sentinel://)", ""
            )
        ]
    from workers.queue import connections

    client = connections.broker_client(settings, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        try:
            client.ping()
            info = client.info()
        except redis.AuthenticationError as exc:
            return [auth_failure(shown, bool(parts.password), str(exc))]
        except redis.RedisError as exc:
            return [
                error(
                    "broker",
                    f"cannot reach {shown}: {exc}",
                    "start Redis, or fix the host and port in VOXMILL_BROKER_URL (firewall, TLS: rediss://)",
                )
            ]
        return [reach_check(shown, parts, info), persistence_check(info), eviction_check(info)]
    finally:
        client.close()


def auth_failure(shown: str | None, has_password: bool, message: str) -> Check:
    if not has_password:
        detail = f"{shown} wants a password and the URL has none ({message})"
    elif "without any password" in message or "no password is set" in message:
        detail = f"{shown} has no password set, but the URL gives one ({message})"
    else:
        detail = f"{shown} refused the password ({message})"
    return error(
        "broker", detail, "put the broker's requirepass in VOXMILL_BROKER_URL: redis://:PASSWORD@host:6379/0"
    )


def reach_check(shown: str | None, parts: Any, info: dict[str, Any]) -> Check:
    detail = f"{shown}: Redis {info.get('redis_version', '?')}"
    if not parts.password and parts.hostname not in LOOPBACK_HOSTS and parts.scheme != "unix":
        return warning(
            "broker",
            f"{detail}, reached without a password over the network",
            "set requirepass in redis.conf and the password in VOXMILL_BROKER_URL (docs/security.md)",
        )
    return ok("broker", f"{detail}, {'authenticated' if parts.password else 'no password (loopback)'}")


def persistence_check(info: dict[str, Any]) -> Check:
    if int(info.get("aof_enabled", 0)):
        return ok("broker persistence", "AOF on: queued jobs survive a Redis restart")
    return warning(
        "broker persistence",
        "AOF off: a Redis restart loses every queued job (producers send theirs again; corpus runs resume)",
        "appendonly yes in redis.conf (config/redis.conf), or CONFIG SET appendonly yes",
    )


def eviction_check(info: dict[str, Any]) -> Check:
    policy = str(info.get("maxmemory_policy", "unknown"))
    limit = int(info.get("maxmemory", 0))
    if policy == "noeviction":
        return ok(
            "broker maxmemory", "maxmemory-policy noeviction: a full Redis refuses new jobs, drops none"
        )
    detail = f"maxmemory-policy {policy}: Redis may evict queued jobs and results"
    fix = "maxmemory-policy noeviction in redis.conf (or CONFIG SET maxmemory-policy noeviction)"
    if limit > 0:
        return error("broker maxmemory", f"{detail} once it holds {limit / 2**20:.0f} MiB", fix)
    return warning("broker maxmemory", f"{detail} as soon as a maxmemory is set", fix)


# --------------------------------------------------------------------------- files and memory
def root_checks(settings: Settings) -> list[Check]:
    """Every allowed root a folder this user can read (object-store prefixes are not looked at)."""
    if not settings.allowed_roots:
        return [ok("allowed roots", f"none set: path jobs read below the working directory ({Path.cwd()})")]
    checks = []
    for root in settings.allowed_roots:
        text = str(root)
        if URL_ROOT.match(text):
            checks.append(ok("allowed root", f"{text}: an object-store prefix, not checked here"))
            continue
        resolved = Path(root).resolve()
        if not resolved.is_dir():
            checks.append(
                error(
                    "allowed root",
                    f"{root} does not exist or is no folder",
                    "mount it, or fix VOXMILL_ALLOWED_ROOTS",
                )
            )
        elif not os.access(resolved, os.R_OK | os.X_OK):
            checks.append(
                error(
                    "allowed root",
                    f"{root} is not readable by this user (uid {os.getuid()})",
                    "chmod/chown it so the workers' user can read it",
                )
            )
        else:
            checks.append(
                ok("allowed root", f"{root} readable" + (f" ({resolved})" if resolved != root else ""))
            )
    return checks


def cache_check(settings: Settings) -> Check:
    """The optimized-model cache folder: this user's and writable by nobody else, or ignored."""
    from pipeline.models.cache import untrusted_reason

    folder = settings.model_cache_dir
    if not settings.model_cache:
        return ok("model cache", "off (model_cache: false): every load optimises the graph again")
    if not folder.exists():
        parent = next((p for p in folder.absolute().parents if p.exists()), Path("/"))
        if os.access(parent, os.W_OK | os.X_OK):
            return ok("model cache", f"{folder} not there yet: made on the first load")
        return warning(
            "model cache",
            f"{folder} cannot be made: {parent} is not writable",
            "set VOXMILL_MODEL_CACHE_DIR to a folder of this user's",
        )
    reason = untrusted_reason(folder)
    if reason is not None:
        return error(
            "model cache",
            f"not used: {reason}; every load optimises the graph again",
            f"chown $(id -u) {folder} && chmod 700 {folder} (entries are models the workers run)",
        )
    return ok("model cache", f"{folder}: this user's, not writable by others")


def available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def memory_check(available: int, model_bytes: int, processes: int) -> Check:
    """Free memory against one worker process per core holding the models (see PROCESS_BASE_BYTES)."""
    if model_bytes <= 0:
        return ok("memory", f"{gib(available)} available (no model to size it against)")
    steady = PROCESS_BASE_BYTES + STEADY_PER_MODEL_BYTE * model_bytes
    first = PROCESS_BASE_BYTES + FIRST_LOAD_PER_MODEL_BYTE * model_bytes
    need = f"a worker process with these models ({model_bytes / 1e6:.1f} MB) needs about {gib(steady)}"
    if available < first:
        return error(
            "memory",
            f"{gib(available)} available; {need}, {gib(first)} on a first load",
            "free memory, or serve one op per machine (-Q tokenize / -Q embed)",
        )
    fits = int(available // steady)
    if fits < processes:
        return warning(
            "memory",
            f"{gib(available)} available; {need}: room for {fits} of the {processes} a worker starts",
            f"voxmill worker -c {max(fits, 1)}, or more memory",
        )
    return ok("memory", f"{gib(available)} available; {need}: room for {fits} (default -c {processes})")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


if __name__ == "__main__":  # `python -m workers.observe.doctor [--json]`, until the CLI has `voxmill doctor`
    sys.exit(doctor_command(Settings.load(), "--json" in sys.argv[1:], Console(soft_wrap=True)))
