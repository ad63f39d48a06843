"""Validating a candidate model file in a separate process, before any worker loads it.

The check is what a worker does at load (`pipeline.inference.open_session`), with the workers'
provider settings: hash the file once, check the signature against the registry, run the
reference clip once (a worker warms up with `warmup_runs`, 1 by default), check the outputs are finite. It
runs in a child process, so a file that crashes or hangs ONNX Runtime costs a rejection, never
the watcher.

Children are forked from a multiprocessing *forkserver* that imported ONNX Runtime, numpy and
the feature code (with scipy's FFT and sparse kernels) once: a validation costs the model's own
load and warm-up (~0.1 s for the tiny stand-ins), not ~1.5 s of Python imports on every
candidate. The forkserver itself never builds a session, so each child starts clean. Its Unix
socket lives in the temporary folder: where that path is too long for a socket (a deep
`TMPDIR`), children are spawned instead, paying the imports.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pipeline import tuning
from pipeline.errors import VoxmillError
from pipeline.models.registry import Registry
from pipeline.settings import Settings


@dataclass(frozen=True)
class Validation:
    """The verdict on one file: ok with its sha256 and facts, or a reason."""

    ok: bool
    sha256: str = ""
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def verdict_from(data: Any, exitcode: int | None) -> Validation:
    """The verdict a child sent (None when it sent nothing); a child that died is a rejection."""
    if isinstance(data, dict) and isinstance(data.get("ok"), bool):
        return Validation(
            ok=data["ok"],
            sha256=str(data.get("sha256", "")),
            reason=str(data.get("reason", "")),
            details=dict(data.get("details") or {}),
        )
    how = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"code {exitcode}"
    return Validation(ok=False, reason=f"the validator process died ({how}) before giving a verdict")


def validate_here(path: Path, role: str, settings: Settings) -> dict[str, Any]:
    """Open the session as a worker would; the verdict as a JSON-ready dict."""
    from pipeline.inference import open_session
    from pipeline.models.options import SessionOptions

    # One warm-up run checks what a validation must (the model runs, its outputs are finite),
    # whatever `warmup_runs` the workers use. A session run once gains nothing
    # from pre-packed weights, and skipping them saves about a third of the load's memory
    # traffic (the cache entry it writes is the same).
    options = replace(SessionOptions.from_settings(settings), warmup_runs=1, prepack=False)
    try:
        session = open_session(path, role, options, Registry.load())
    except VoxmillError as exc:
        return {"ok": False, "reason": exc.message}
    except Exception as exc:  # anything that makes the file unusable is a rejection
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    facts = session.describe()
    details = {k: facts[k] for k in ("variant", "providers", "load_s", "warm_latency_ms")}
    return {"ok": True, "sha256": session.sha256, "details": details}


def _child(path: str, role: str, settings: Settings, sender: Connection) -> None:
    """The validator process: one verdict down the pipe."""
    sender.send(validate_here(Path(path), role, settings))
    sender.close()


# A Unix socket's path holds at most 107 bytes; the forkserver's is TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX.
SOCKET_PATH_MAX = 107
FORKSERVER_SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def start_method(temp_dir: str) -> str:
    """`forkserver`, unless its socket's path under `temp_dir` would be too long: `spawn`."""
    fits = len(os.fsencode(temp_dir)) + FORKSERVER_SOCKET_SUFFIX <= SOCKET_PATH_MAX
    return "forkserver" if fits else "spawn"


class Validator:
    """Validates candidate files, each in a fresh child process, within `watch_validate_timeout_s`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        method = start_method(tempfile.gettempdir())
        self.context: Any = multiprocessing.get_context(method)
        if method == "forkserver":
            from pipeline.inference import SERVING_IMPORTS

            self.context.set_forkserver_preload(list(SERVING_IMPORTS))

    def validate(self, path: Path, role: str) -> Validation:
        """Load, check and warm up `path` as a `role` model in a child process."""
        timeout_s = self.settings.watch_validate_timeout_s
        receiver, sender = self.context.Pipe(duplex=False)
        child = self.context.Process(
            target=_child, args=(str(path), role, self.settings, sender), name=f"voxmill-validate-{role}"
        )
        started = time.perf_counter()
        child.start()
        sender.close()
        data = None
        try:
            if receiver.poll(timeout_s):
                data = receiver.recv()
            else:
                child.kill()
                return Validation(ok=False, reason=f"validation did not finish within {timeout_s:g} s")
        except EOFError:
            pass  # the child died before sending a verdict
        finally:
            receiver.close()
            child.join(tuning.VALIDATOR_EXIT_GRACE_S)
            if child.is_alive():
                child.kill()
                child.join()
        verdict = verdict_from(data, child.exitcode)
        return replace(verdict, seconds=time.perf_counter() - started)
