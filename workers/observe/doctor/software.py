"""Python, the installed packages and the ONNX Runtime providers the settings ask for."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.settings import Settings
from workers.observe.doctor.check import (
    Check,
    error,
    ok,
    warning,
)

# Shown with their versions; every requirement of voxmill is checked, these are the ones people ask for.
KEY_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnx", "celery", "redis", "numpy")
PROBE_OPSET = 13


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
