"""The native planner's C library (codegen/planner_source.py's source) compiled with the system C compiler and loaded
with cffi; :mod:`minicavs.engine.planner` unpacks what it makes (this package provides it there on import)."""
from __future__ import annotations

import functools

from ..engine.codegen.planner_source import DECLS, SOURCE
from . import compiler as cgen


@functools.lru_cache(maxsize=None)
def _planner(cc_setting: str | None):
    import cffi
    cc = cgen.compiler()
    if cc is None:
        return None
    ffi = cffi.FFI()
    ffi.cdef(DECLS)
    return ffi, ffi.dlopen(str(cgen.compiled(SOURCE, cc, "planner"))), ffi.typeof("int64_t[]"), \
        ffi.typeof("unsigned char[]"), ffi.typeof("uint64_t[]")


# () -> (ffi, library, ...) of the compiled planner, or None without a C compiler (cached per ``CC`` setting until
# built: cpu/compiler.py kept_once_built)
planner = cgen.kept_once_built(_planner)
