"""glibc's malloc told to keep the memory a training step frees on the CPU, for the next step to reuse.

By default glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a mapping
of its own, unmapped when freed, and hands the free top of its heap back to the system. A training step allocates
and frees the same activations every step, so each step faulted their pages in anew, and the kernel zeroed them
(`benchmarks/run.py`'s 5M model: 1.7-2.8 million page faults in 160 steps, 260,000 once kept; the ~100M shape:
7-8 million in 30 steps, 1 million once kept). Kept, a bf16-mixed step on 2 cores of an AMD EPYC took 71 instead
of 85 ms at 5M and 990 instead of 1,240-1,320 ms at ~100M; the peak RSS moved by under 6 %.

A user's own malloc settings win: nothing changes when the environment sets any (MALLOC_*_ variables or glibc's
malloc tunables), nor on a system without glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The free top of the heap kept from the system: more than a large step frees at once.
KEEP_FREE_BYTES = 1 << 30
MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                    "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")


def malloc_set_by_user() -> bool:
    """Whether this process's environment sets glibc's malloc itself."""
    return any(name in os.environ for name in MALLOC_VARIABLES) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Serve allocations from the heap (no mapping of their own) and keep up to `KEEP_FREE_BYTES` of its free top, on
    Linux with glibc unless `malloc_set_by_user`; returns whether it did. Only later allocations are affected."""
    if sys.platform != "linux" or malloc_set_by_user():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES) == 1
