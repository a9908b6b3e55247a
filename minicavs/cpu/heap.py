"""Keep freed memory for the next batch: glibc's malloc settings for a training process.

Every training step allocates and frees the same large arrays (a language model's logits and their gradient:
25-37 MB each at a 6k-word vocabulary). With glibc's defaults the heap grows by them and is trimmed back at
the end of each step (its trim threshold follows the largest freed block), so the next step faults the pages
in again and the kernel zeroes them: 5-8% of a Fixed-LSTM h512 batch-16 step, serial (``perf``:
clear_page_erms; 18-30 ms of system time per step, 0.5 ms with these settings). A framework's caching
allocator does the same job (PyTorch's on the GPU); here it is three ``mallopt`` calls:

- ``M_TRIM_THRESHOLD`` 1 GiB: free memory at the top of the heap stays mapped up to that much;
- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest on 64-bit): blocks up to that size come from the heap, and
  the threshold stops adapting;
- ``M_MMAP_MAX`` 0: larger blocks come from the heap too. A Var-LSTM's logits and their gradient at batch 64
  (1.5k rows of a 6k-word vocabulary: 37 MB each, above the largest threshold) were otherwise mapped, faulted
  in (275 page faults, 2-4 ms of system time per step) and unmapped at every step; with it, 0.2 faults and
  0.2-0.4 ms, peak memory 318 -> 326 MB. (glibc still maps where the heap cannot grow.)

Only on glibc, only once per process, and never when the user chose malloc settings through the environment
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES`` with ``glibc.malloc``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4     # glibc's malloc.h
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_chose() -> bool:
    """Whether the environment sets glibc's malloc parameters (then they are the user's to keep)."""
    return any(k in os.environ for k in USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Apply the settings above to this process; True if they were applied (glibc, not chosen by the user)."""
    if user_chose():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc (macOS, musl without mallopt): its defaults stay
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_MMAP_MAX, 0))
