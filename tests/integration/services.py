"""Real monitoring services (Prometheus, Flower) started by a test and always stopped."""

from __future__ import annotations

import contextlib
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.conftest import wait_for


@contextlib.contextmanager
def running_http_service(
    argv: Sequence[str],
    log_path: Path,
    ready_url: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 60.0,
) -> Iterator[None]:
    """Run `argv` (its output in `log_path`) until `ready_url` answers 200; stop it on the way out.

    A service that exits while starting fails the test with the end of its log.
    """
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:

            def ready() -> bool:
                assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                with contextlib.suppress(OSError), urllib.request.urlopen(ready_url, timeout=2) as answer:
                    return bool(answer.status == 200)
                return False

            wait_for(ready, timeout_s=timeout_s, interval_s=0.2)
            yield
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
