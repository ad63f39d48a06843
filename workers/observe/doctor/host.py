"""This machine: the allowed roots, the optimized-model cache folder, free memory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.settings import Settings
from workers.observe.doctor.check import (
    Check,
    error,
    ok,
    warning,
)

# Memory of one worker process holding models of N bytes (BENCHMARKS.md, "Memory"): the full
# tokenizer (471 MB) peaks at ~0.7 GB from the optimized-model cache and ~1.3 GB on the load that
# builds the entry; the embedder (26 MB) at ~0.23 GB.
PROCESS_BASE_BYTES = 200 * 1024 * 1024
STEADY_PER_MODEL_BYTE = 1.2
FIRST_LOAD_PER_MODEL_BYTE = 2.4
URL_ROOT = re.compile(r"^[a-z][a-z0-9+.-]*:/", re.IGNORECASE)


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
