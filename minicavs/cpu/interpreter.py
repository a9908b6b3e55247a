"""The C runner on the CPU: codegen/machine.py's interpreter compiled like the fused kernels (cached,
atomic), loaded with cffi (which releases the GIL for the call), and the BLAS it calls GEMMs through.

BLAS: the OpenBLAS numpy itself loaded. numpy 2.x wheels ship ``numpy.libs/libscipy_openblas64_-*.so``
exporting the ILP64 cblas ``scipy_cblas_{s,d}gemm64_``; we find it in ``/proc/self/maps``, dlopen it with
``RTLD_NOLOAD`` (the same copy numpy uses, never a second one) and hand the interpreter the symbols' addresses.
So there is one BLAS and one BLAS thread pool per process, and no link-time dependency: the interpreter is
compiled without ``-l``. If numpy's BLAS is not found (another numpy build), a system ``libopenblas`` /
``libcblas`` exporting the LP64 ``cblas_{s,d}gemm`` is used instead (a second library, with its own threads:
say ``OPENBLAS_NUM_THREADS`` when that matters). With no compiler or no BLAS, :func:`interpreter` returns None
and warns once per process naming why (no compiler: the same one warning as the fused kernels'); the engine
then runs the batch programs on the reference runner.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import warnings
from pathlib import Path

import numpy as np

from ..engine.codegen.machine import interpreter_decls, interpreter_source
from .compiler import compiled, compiler, warn_no_compiler

_warned: set = set()


def _warn_once(why: str) -> None:
    if not _warned:
        warnings.warn(f"C runner unavailable ({why}): the reference runner runs the batch programs (slowly)",
                      RuntimeWarning, stacklevel=3)
    _warned.add(why)


def _numpy_blas() -> str | None:
    """The path of the OpenBLAS numpy loaded (from this process's memory map), or None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        maps = []
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "openblas" in os.path.basename(path).lower():
            return path
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas*.so*")) if libs.is_dir() else []
    return str(found[0]) if found else None


@functools.lru_cache(maxsize=None)
def blas(c_type: str, routine: str = "gemm") -> tuple[int, bool, str] | None:
    """(address of the cblas ``routine`` (gemm, gemv), whether it takes 64-bit ints, where it came from) for
    ``float``/``double``."""
    letter = ("s" if c_type == "float" else "d") + routine
    path = _numpy_blas()
    if path is not None:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            lib = None
        if lib is not None:
            # ILP64 (numpy 2.x wheels: scipy-openblas64, older: openblas64_), else the LP64 names
            for name, ilp64 in ((f"scipy_cblas_{letter}64_", True), (f"cblas_{letter}64_", True),
                                (f"scipy_cblas_{letter}", False), (f"cblas_{letter}", False)):
                fn = getattr(lib, name, None)
                if fn is not None:
                    return ctypes.cast(fn, ctypes.c_void_p).value, ilp64, f"{path}:{name}"
    for candidate in ("openblas", "cblas", "blas"):
        found = ctypes.util.find_library(candidate)
        if not found:
            continue
        try:
            lib = ctypes.CDLL(found)
        except OSError:
            continue
        fn = getattr(lib, f"cblas_{letter}", None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value, False, f"{found}:cblas_{letter}"
    return None


def _openblas_fn(stem: str, restype):
    """numpy's OpenBLAS function ``openblas_<stem>`` under any of its builds' names, or None."""
    path = _numpy_blas()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    for name in (f"scipy_openblas_{stem}64_", f"openblas_{stem}64_", f"scipy_openblas_{stem}", f"openblas_{stem}"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, []
            return fn
    return None


@functools.lru_cache(maxsize=None)
def _blas_threads_fn():
    return _openblas_fn("get_num_threads", ctypes.c_int)


# OpenBLAS cores whose sgemm runs products of m n k <= 1e6 in small-matrix kernels (no packing of B): on them
# the interpreter splits a product a few rows past that bound into row blocks under it (codegen/machine.py).
# Measured on SkylakeX (1 thread, CPU time): 11-20 rows x 256 x 384 took 0.65-0.88x the time in two blocks,
# 21-40 x 128 x 384 0.67-0.78x, 62-122 x 128 x 128 0.84-0.88x, 4-6 x 512 x 512 0.39-0.51x; at three times the
# bound's rows one call won again (1.08x). Float only: dgemm was not measured.
SMALL_KERNEL_CORES = ("skylakex", "cooperlake", "sapphirerapids")
SMALL_MNK = 1_000_000


def corename() -> str | None:
    """The core numpy's OpenBLAS runs its kernels for (``openblas_get_corename``), None where it cannot be asked."""
    fn = _openblas_fn("get_corename", ctypes.c_char_p)
    found = fn() if fn is not None else None
    return found.decode() if found else None


def small_matrix_bound(c_type: str, core: str | None = None) -> int:
    """The m n k up to which the BLAS's products skip packing where the interpreter splits products past it into
    row blocks (SMALL_KERNEL_CORES), else 0: no blocks. ``core``: the OpenBLAS core (default: numpy's)."""
    core = corename() if core is None else core
    return SMALL_MNK if c_type == "float" and (core or "").lower() in SMALL_KERNEL_CORES else 0


def blas_threads() -> int:
    """How many threads numpy's OpenBLAS computes with now (``OPENBLAS_NUM_THREADS``, threadpoolctl), 1 when
    that cannot be asked: the row kernels (cpu/library.py) split large arrays over as many."""
    fn = _blas_threads_fn()
    return max(1, int(fn())) if fn is not None else 1


class CInterpreter:
    """The compiled interpreter for one element type, with its GEMM."""

    def __init__(self, c_type: str, lib, ffi, gemm: tuple):
        self.c_type = c_type
        self.lib, self.ffi = lib, ffi
        self.run = getattr(lib, f"run_{c_type}")
        self.gemm, self.ilp64, self.blas = gemm
        # One-row products go through gemv, as numpy's matmul does: OpenBLAS's sgemm at m = 1 was 5-10x
        # slower here (267 vs 54 us for 1x512 . 512x2048); 0 when the library has no gemv of the same ABI.
        gemv = blas(c_type, "gemv")
        self.gemv = gemv[0] if gemv is not None and gemv[1] == self.ilp64 and gemv[2].split(":")[0] == \
            self.blas.split(":")[0] else 0
        self._i64 = functools.partial(ffi.from_buffer, ffi.typeof("int64_t[]"))
        # columns of a panel of the packed product by a static (codegen/packed_gemm.py); 0: none here
        self.packed_nr = int(lib.mc_packed_nr())
        self.small_mnk = small_matrix_bound(c_type)   # (the GEMM case's row blocks: codegen/machine.py)
        lib.mc_set_small_mnk(self.small_mnk)
        self.t_ptr = ffi.typeof(f"{c_type} *")

    def ptr(self, a: np.ndarray):
        """A C pointer to a contiguous int64 array (cffi's ``from_buffer``: numpy's ``ctypes.data`` is slower)."""
        return self._i64(a)


@functools.lru_cache(maxsize=None)
def interpreter(dtype) -> CInterpreter | None:
    """The C runner for ``dtype`` (float32 / float64), or None (with one warning) when this process
    cannot build it: no C compiler, no BLAS."""
    import cffi
    name = np.dtype(dtype).name
    c_type = {"float32": "float", "float64": "double"}.get(name)
    if c_type is None:
        _warn_once(f"dtype {name}")
        return None
    cc = compiler()
    if cc is None:
        warn_no_compiler()
        return None
    gemm = blas(c_type)
    if gemm is None:
        _warn_once("no BLAS: neither numpy's OpenBLAS nor a system libopenblas/libcblas")
        return None
    ffi = cffi.FFI()
    ffi.cdef(interpreter_decls(c_type))
    lib = ffi.dlopen(str(compiled(interpreter_source(c_type), cc, "interpreter")))
    return CInterpreter(c_type, lib, ffi, gemm)
