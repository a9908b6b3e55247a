"""C kernels for fused groups: render, compile once with the system compiler, load with cffi, cache on disk.

The cache lives in ``$MINICAVS_CACHE`` (default ``~/.cache/minicavs``), keyed by sha256 of the source, the
flags, the compiler's version and ``CODEGEN_VERSION``. A build goes to a temporary file that is renamed into
place, so two processes building the same kernel cannot corrupt each other. Kernels are compiled without
``-ffast-math`` (a library linked with it would set flush-to-zero for the whole process).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..dtypes import as_dtype
from ..passes.fusion import FusedGroup
from .cstyle import render_body

CODEGEN_VERSION = 1
FLAGS = ("-O2", "-fPIC", "-shared", "-std=c99", "-fno-math-errno")


def cache_dir() -> Path:
    return Path(os.environ.get("MINICAVS_CACHE") or Path.home() / ".cache" / "minicavs")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


@functools.lru_cache(maxsize=None)
def compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def render(group: FusedGroup) -> tuple[str, str, str]:
    """(kernel name, C declaration, C source) of a group: y[i] = expr(x0[...], x1[...], ...), i < n."""
    dt = group.output.dtype
    T = dt.c_type
    index = {"full": "i", "row": "i % cols", "col": "i / cols", "scalar": "0"}
    reads = [f"x{i}[{index[kind]}]" for i, kind in enumerate(group.broadcast)]
    body = render_body(group.expr(), reads, dt, "y[i]")
    params = ", ".join([f"const {T} *restrict x{i}" for i in range(len(group.inputs))] + [f"{T} *restrict y"])
    sig_body = "\n".join(body)
    name = "fused_" + hashlib.sha1(f"{params}\n{sig_body}".encode()).hexdigest()[:10]
    decl = f"void {name}(long n, long cols, {params});"
    source = (f"#include <math.h>\n{decl[:-1]}\n{{\n    for (long i = 0; i < n; i++) {{\n        "
              + "\n        ".join(body) + "\n    }\n}\n")
    return name, decl, source


class Kernel:
    """A compiled group, bound once; calling it runs the fused loop over contiguous arrays."""

    def __init__(self, group: FusedGroup, lib, name: str, ffi):
        self.group = group
        self.fn = getattr(lib, name)
        self.ffi = ffi
        self.lib = lib  # keep the library loaded
        self.dtype = group.output.dtype.np

    def __call__(self, arrays):
        arrays = [np.ascontiguousarray(a, self.dtype) for a in arrays]
        out_shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
        y = np.empty(out_shape, self.dtype)
        cols = out_shape[-1] if out_shape else 1
        ptrs = [self.ffi.from_buffer(a) for a in arrays] + [self.ffi.from_buffer(y)]
        self.fn(y.size, cols, *[self.ffi.cast(f"{as_dtype(self.dtype).c_type} *", p) for p in ptrs])
        return y


def build(group: FusedGroup) -> Kernel | None:
    """Compile (or load from the cache) the group's kernel; None if no C compiler is available or an input
    broadcasts in a way a flat index cannot express (the caller then evaluates the group with numpy)."""
    import cffi
    cc = compiler()
    if cc is None or "other" in group.broadcast:
        return None
    name, decl, source = render(group)
    key = hashlib.sha256("\n".join([source, " ".join(FLAGS), compiler_version(cc),
                                    str(CODEGEN_VERSION)]).encode()).hexdigest()[:24]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            so = Path(tmp) / f"{name}.so"
            subprocess.run([cc, *FLAGS, str(src), "-o", str(so), "-lm"], check=True, capture_output=True)
            os.replace(so, target)  # atomic: a concurrent build of the same kernel just replaces it
    ffi = cffi.FFI()
    ffi.cdef(decl)
    return Kernel(group, ffi.dlopen(str(target)), name, ffi)
