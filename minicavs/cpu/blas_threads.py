"""Set how many threads numpy's BLAS computes with, from inside a running process (``minicavs serve
--blas-threads``).

Why a setter: ``OPENBLAS_NUM_THREADS`` is read once, when numpy loads OpenBLAS, so a command that wants its
own count must ask the library itself. The first choice is OpenBLAS's ``openblas_set_num_threads``, read with
ctypes from the very library numpy loaded (found as the C runner finds its GEMM, cpu/interpreter.py): numpy's
products and the C runner's share that one pool, and it needs nothing installed. threadpoolctl (a test and
bench extra, never required to run) is the fallback, when importable, for a numpy built on another BLAS
(MKL, BLIS), which has no OpenBLAS symbol.
"""
from __future__ import annotations

import ctypes
import functools
import os

from ..core.errors import MinicavsError
from .interpreter import _numpy_blas, blas_threads

# OpenBLAS's setter as numpy's wheels export it: ILP64 scipy-openblas (numpy 2.x), openblas64_ (older), LP64
SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
           "scipy_openblas_set_num_threads", "openblas_set_num_threads")


class BlasThreadsError(MinicavsError, ValueError):
    """A thread count that cannot be set (not a positive integer, or no way to set one)."""


@functools.lru_cache(maxsize=None)
def _openblas_setter() -> tuple[object, str] | None:
    """(the setter, its symbol) of the OpenBLAS numpy loaded, or None (another BLAS, or none found)."""
    import numpy  # noqa: F401  (loads the BLAS whose setter this reads)
    path = _numpy_blas()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # numpy's copy, never a second one
    except OSError:
        return None
    for name in SETTERS:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = None, [ctypes.c_int]
            return fn, name
    return None


def _threadpoolctl_setter(threads: int) -> str | None:
    """Set through threadpoolctl (it stays set: the controller is not used as a context); None if it is not
    installed or sees no BLAS."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    blas = ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        return None
    blas.limit(limits=threads)
    return "threadpoolctl (" + ", ".join(c.internal_api for c in blas.lib_controllers) + ")"


def set_blas_threads(threads: int) -> str:
    """Make numpy's BLAS (and so the C runner's products) compute with ``threads`` threads from now on
    (``minicavs.set_blas_threads``, as ``torch.set_num_threads``); returns how it was set, for the caller's log
    line. BlasThreadsError if ``threads`` < 1, if the library will not run that many (the count is read back;
    the old one is kept), or if no way to set it is found."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise BlasThreadsError(f"BLAS threads: {threads!r} is not an integer >= 1")
    found = _openblas_setter()
    if found is None:
        return _by_threadpoolctl(threads)
    fn, name = found
    before = blas_threads()
    fn(threads)
    if blas_threads() != threads:
        now = blas_threads()
        fn(before)
        raise BlasThreadsError(f"BLAS threads: OpenBLAS runs {now} when asked for {threads} (its build's limit); "
                               f"left at {before}")
    return f"OpenBLAS {name}"


def _by_threadpoolctl(threads: int) -> str:
    how = _threadpoolctl_setter(threads)
    if how is None:
        raise BlasThreadsError(f"cannot set {threads} BLAS thread(s): numpy's BLAS is not OpenBLAS and "
                               "threadpoolctl is not installed (pip install threadpoolctl, or set "
                               "OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / MKL_NUM_THREADS before starting)")
    return how
