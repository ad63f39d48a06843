"""The C allocator's knob that matters for long runs: glibc's mmap threshold.

glibc raises its threshold each time a large block is freed (up to 32 MiB), so after one long
clip every buffer below that size is carved from the heap, whose fragments a process never gives
back: a lasting step in resident memory. A fixed threshold keeps buffers larger than a 30 s clip's
in their own mappings, returned to the system when freed (BENCHMARKS.md, memory under varied
lengths). Fixing it also fixes glibc's trim threshold at 128 KiB, and handing the heap's top back
after every large free cost about 5 % of a worker's time: the trim threshold is kept at 8 times
the mmap threshold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("voxmill.allocator")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers in glibc's malloc.h
TRIM_FACTOR = 8


def fix_mmap_threshold(kb: int) -> bool:
    """Fix this process's mmap threshold at `kb` KiB (0: leave glibc's dynamic one); True if set.

    Elsewhere than glibc (macOS, musl) it does nothing and says so at debug level.
    """
    if kb <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no glibc mallopt here: the allocator's mmap threshold stays as it is")
        return False
    mapped = mallopt(M_MMAP_THRESHOLD, kb * 1024)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_FACTOR * kb * 1024))
