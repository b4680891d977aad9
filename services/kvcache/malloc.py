"""Tell glibc's malloc to keep the store's freed block buffers for reuse, once, when the shard starts.

By default glibc serves every allocation over 128 KiB (then over a threshold that it raises as such buffers are
freed) with an `mmap` of its own and hands it back on `free`, and trims the heap's free top: a store that receives,
evicts and reads MiB-sized blocks all day then pays the page faults of fresh memory for almost every block (on the
development VM ~0.55 s per GB, against ~0.08 s for reused memory; docs/journal/kvstore-2026-12.md, "Where the time
went"). These are the
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` environment variables, set from inside the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's ceiling for the threshold on 64-bit: 32 MiB).
MMAP_THRESHOLD_BYTES = 32 << 20
#: The heap's free top is handed back only beyond this (the largest value mallopt takes: an int).
TRIM_THRESHOLD_BYTES = (1 << 31) - 1


def keep_freed_buffers() -> bool:
    """Set both thresholds with mallopt; False (and a log line) where there is no glibc or it refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt: freed block buffers are left to the allocator's defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not done:
        log.warning("mallopt refused the thresholds: freed block buffers are left to the allocator's defaults")
    return done
