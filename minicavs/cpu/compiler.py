"""The C compiler behind the CPU backend: codegen/c.py's sources compiled once with the system compiler,
loaded with cffi and cached on disk; fused groups and row movement bound as callables.

The cache lives in ``$MINICAVS_CACHE`` (default ``~/.cache/minicavs``), keyed by sha256 of the source, the
flags, the compiler's version, the target CPU and ``CODEGEN_VERSION``. A build goes to a temporary file
renamed into place, so two processes building the same library cannot corrupt each other. ``-ffast-math``
is never used (a library linked with it would set flush-to-zero for the whole process); ``-fopenmp-simd``
honours the simd pragma without linking the OpenMP runtime. ``-fno-trapping-math`` (no value changes:
nothing here unmasks floating-point traps) lets gcc turn the selects of ``exp``/``tanh`` into vector blends:
without it gcc 12 on AVX2 (no masked AVX-512 ops) leaves every loop with a select scalar, about 6x slower.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.onetime import one_time
from ..core.validate import check_rows
from ..engine.codegen.c import CODEGEN_VERSION, ROWS_SOURCE, row_decls, translation_unit
from ..engine.backend import FusedGroup
# -mprefer-vector-width=512: gcc otherwise keeps AVX-512 machines at 256-bit vectors (x86 only).
FLAGS = (("-O3", "-march=native")
         + (("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())
         + ("-fPIC", "-shared", "-std=c99", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd")
         # extra flags, e.g. "-fsanitize=address -fno-omit-frame-pointer" to run the kernels under ASan
         # (then LD_PRELOAD the compiler's libasan.so): part of the cache key like every flag
         + tuple(os.environ.get("MINICAVS_CFLAGS", "").split()))


def cache_dir() -> Path:
    return Path(os.environ.get("MINICAVS_CACHE") or Path.home() / ".cache" / "minicavs")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def kept_once_built(build):
    """``build(*args, cc_setting)`` (an lru-cached loader of a compiled library, None without a compiler)
    called as ``f(*args)``: asked again for each ``CC`` setting while it gives None, so that an answer made
    while ``CC`` named no compiler does not outlive that setting; once it gave a library, that one for good
    (a compiled library stays valid whatever ``CC`` says later, and reading ``CC`` costs about a microsecond
    per call of a kernel that runs every step)."""
    built: dict = {}

    @functools.wraps(build)
    def loaded(*args):
        found = built.get(args)
        if found is None:
            found = build(*args, os.environ.get("CC"))
            if found is not None:
                built[args] = found
        return found
    return loaded


@functools.lru_cache(maxsize=None)
def compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


@functools.lru_cache(maxsize=None)
def target_cpu() -> str:
    """What ``-march=native`` means here: the machine and its CPU's model and feature flags."""
    info = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        info = "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))}))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {hashlib.sha256(info.encode()).hexdigest()[:16]}"


class Kernel:
    """A compiled group, bound once. ``kernel(arrays, out=None)`` runs it; inputs and ``out`` may be views
    with a row stride (unit stride along the last axis). Per-call work is kept to attribute lookups: the
    engine calls small kernels thousands of times per batch."""

    def __init__(self, group: FusedGroup, fn, ffi, lib, address: int = 0):
        self.group = group
        self.fn = fn
        self.address = address   # of the kernel's uniform-signature twin (the C runner calls it)
        self.lib = lib  # keep the library loaded
        self.dtype = group.output.dtype.np
        self.kinds = list(group.broadcast)
        self.nout = len(group.outputs)
        self.full = next((i for i, k in enumerate(self.kinds) if k == "full"), None)
        T = group.output.dtype.c_type
        self._buf = functools.partial(ffi.from_buffer, ffi.typeof(f"{T}[]"))
        self._cast = functools.partial(ffi.cast, ffi.typeof(f"{T} *"))

    def _ptr(self, a: np.ndarray):
        # (a strided view's address from __array_interface__: ``ctypes.data`` costs twice as much)
        return self._buf(a) if a.flags.c_contiguous else self._cast(a.__array_interface__["data"][0])

    def _matrix(self, a: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, int]:
        """``a`` as a (rows, cols) matrix with unit column stride, and its row stride in elements."""
        if a.dtype != self.dtype:
            a = a.astype(self.dtype)
        if a.ndim != 2 or a.shape[1] > 1 and a.strides[1] != a.itemsize:
            a = np.ascontiguousarray(a).reshape(rows, -1)
        return a, (a.strides[0] // a.itemsize if a.shape[0] > 1 else a.shape[1])

    def __call__(self, arrays: Sequence[np.ndarray], out=None):
        """Run over the rows; ``out`` (an array, or a list with None where to allocate, for a group with
        several outputs) receives the results. Returns the output, or the list of outputs."""
        shape = arrays[self.full].shape if self.full is not None else \
            np.broadcast_shapes(*(np.shape(a) for a in arrays))
        if len(shape) == 2:
            rows, cols = shape
        else:
            cols = shape[-1] if shape else 1
            rows = math.prod(shape[:-1])
        outs = out if isinstance(out, list) else [out] * self.nout
        ys = [np.empty(shape, self.dtype) if o is None else o for o in outs]
        if rows * cols == 0:
            return ys if self.nout > 1 else ys[0]
        args = []
        for a, kind in zip(arrays, self.kinds):
            if kind == "full" and a.ndim == 2 and a.dtype is self.dtype and a.strides[1] == a.itemsize:
                args += [self._ptr(a), a.strides[0] // a.itemsize]   # the common case, without copies
            elif kind == "full" or kind == "col":
                a, ld = self._matrix(a, rows, cols if kind == "full" else 1)
                args += [self._ptr(a), ld]
            else:
                args += [self._ptr(np.ascontiguousarray(a, self.dtype)), 0]
        mats = []
        for y in ys:
            if y.ndim == 2 and y.dtype is self.dtype and y.strides[1] == y.itemsize:   # the common case
                args += [self._ptr(y), y.strides[0] // y.itemsize if rows > 1 else cols]
                mats.append(y)
            else:
                ym, ld = self._matrix(y, rows, cols)
                args += [self._ptr(ym), ld]
                mats.append(ym)
        self.fn(rows, cols, *args)
        for y, ym in zip(ys, mats):
            if ym is not y and not np.shares_memory(ym, y):
                y[...] = ym.reshape(y.shape)
        return ys if self.nout > 1 else ys[0]


_warned = False


def warn_no_compiler() -> None:
    """The one warning per process that there is no C compiler (fused kernels and the C runner)."""
    global _warned
    if not _warned:
        warnings.warn(f"no C compiler ({os.environ.get('CC', 'cc')}) found: fused elementwise groups run "
                      "unfused with numpy, and the reference runner runs the batch programs (no C "
                      "runner)", RuntimeWarning, stacklevel=3)
        _warned = True


def build(groups: FusedGroup | Sequence[FusedGroup]) -> Kernel | None | list:
    """Compile (or load from the cache) the groups' kernels as one library. Returns one Kernel per group,
    or None for a group an index over (rows, cols) cannot express (the caller evaluates it unfused); all
    None, with one warning per process, if there is no C compiler. A single group gives a single result."""
    import cffi
    single = isinstance(groups, FusedGroup)
    groups = [groups] if single else list(groups)
    ok = [g for g in groups if "other" not in g.broadcast]
    cc = compiler()
    if cc is None:
        warn_no_compiler()
        ok = []
    kernels: dict = {}
    if ok:
        source, decls, rendered = translation_unit(ok)
        target = compiled(source, cc, "fused")
        ffi = cffi.FFI()
        ffi.cdef(decls)
        lib = ffi.dlopen(str(target))
        for g, (name, _, _) in zip(ok, rendered):
            address = int(ffi.cast("intptr_t", ffi.addressof(lib, name + "_u")))
            kernels[id(g)] = Kernel(g, getattr(lib, name), ffi, lib, address)
    out = [kernels.get(id(g)) for g in groups]
    return out[0] if single else out


class RowKernels:
    """Row movement for one dtype, all rows of a task in one call: ``gather`` (dst[r] = src[idx[r]]) and
    ``scatter_add`` (dst[idx[r]] += src[r], in row order, so repeated indices — a DAG vertex with several
    parents — add up deterministically). numpy's ``take`` / ``add.at`` when there is no compiler."""

    def __init__(self, dtype):
        import cffi
        self.dtype = np.dtype(dtype)
        T = {"float32": "float", "float64": "double"}[self.dtype.name]
        self.lib = None
        cc = compiler()
        if cc is None:
            return
        source = ROWS_SOURCE.format(T=T)
        ffi = cffi.FFI()
        ffi.cdef(row_decls(T))
        self.lib = ffi.dlopen(str(compiled(source, cc)))
        self.ffi = ffi
        self._gather = getattr(self.lib, f"gather_rows_{T}")
        self._add = getattr(self.lib, f"scatter_add_rows_{T}")
        self._cast = functools.partial(ffi.cast, ffi.typeof(f"{T} *"))
        self._idx = functools.partial(ffi.cast, ffi.typeof("long *"))

    def _rows(self, a: np.ndarray):
        """(columns, row stride) of a 2-D array with unit column stride, else None (numpy handles it)."""
        if a.dtype != self.dtype or a.ndim != 2 or (a.shape[1] > 1 and a.strides[1] != a.itemsize):
            return None
        return a.shape[1], a.strides[0] // a.itemsize

    def scatter_add(self, dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
        idx = check_rows("scatter_add", idx, len(src), len(dst), src.shape[1:], dst.shape[1:])
        d, s = self._rows(dst), self._rows(src)
        if self.lib is None or d is None or s is None or d[0] != s[0]:
            np.add.at(dst, idx, src)
            return
        self._add(len(idx), s[0], self._cast(src.ctypes.data), s[1], self._idx(idx.ctypes.data),
                  self._cast(dst.ctypes.data), d[1])

    def gather(self, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
        idx = check_rows("gather", idx, None, len(src))
        s = self._rows(src)
        if self.lib is None or s is None:
            return np.take(src, idx, axis=0)
        out = np.empty((len(idx),) + src.shape[1:], src.dtype)
        self._gather(len(idx), s[0], self._cast(src.ctypes.data), s[1], self._idx(idx.ctypes.data),
                     self._cast(out.ctypes.data), s[0])
        return out


@functools.lru_cache(maxsize=None)
def row_kernels(dtype) -> RowKernels:
    return RowKernels(np.dtype(dtype).name)


def compiled(source: str, cc: str, stem: str = "rows") -> Path:
    """The cached shared library of ``source`` (built once, atomically)."""
    key = hashlib.sha256("\n".join([source, " ".join(FLAGS), compiler_version(cc), target_cpu(),
                                    str(CODEGEN_VERSION)]).encode()).hexdigest()[:24]
    target = cache_dir() / f"{stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with one_time(f"compiling kernels (once, cached in {target.parent})"), \
                tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{stem}.c"
            src.write_text(source)
            so = Path(tmp) / f"{stem}.so"
            res = subprocess.run([cc, *FLAGS, str(src), "-o", str(so), "-lm"], capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"C compiler failed on generated kernels ({src}):\n{res.stderr[-3000:]}")
            os.replace(so, target)  # atomic: a concurrent build of the same library just replaces it
    return target
