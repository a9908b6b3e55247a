"""The hand-written C kernels of codegen/library.py (softmax cross-entropy, dropout, optimizer rules),
compiled once per dtype and wrapped for numpy arrays. Every kernel has a numpy twin that stays the reference
(ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two."""
from __future__ import annotations

import functools
import math

import numpy as np

from ..codegen.library import RULES, render
from ..sparse import RowSparse
from . import compiler as cgen


class Library:
    """The kernels for one float dtype; methods take and return numpy arrays (C-contiguous)."""

    def __init__(self, dtype, lib, ffi):
        self.dtype = np.dtype(dtype)
        self.T = "float" if self.dtype == np.float32 else "double"
        self.lib, self.ffi = lib, ffi
        names = ("xent", "xent_grad", "dropout", *RULES, *(f"{r}_rows" for r in RULES))
        self._fn = {name: getattr(lib, f"{name}_{self.T}") for name in names}

    def _p(self, a: np.ndarray):
        kind = {np.dtype(np.int64): "long[]", np.dtype(np.uint64): "unsigned long long[]"}.get(a.dtype)
        return self.ffi.from_buffer(kind or f"{self.T}[]", a)

    def xent(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(logits)
        lab = np.ascontiguousarray(labels, np.int64)
        loss = np.empty(x.shape[:-1], self.dtype)
        if loss.size:
            self._fn["xent"](loss.size, x.shape[-1], self._p(x), self._p(lab), self._p(loss))
        return loss

    def xent_grad(self, g: np.ndarray, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(logits)
        gg = np.ascontiguousarray(np.broadcast_to(g, x.shape[:-1]), self.dtype)
        lab = np.ascontiguousarray(labels, np.int64)
        out = np.empty(x.shape, self.dtype)
        if gg.size:
            self._fn["xent_grad"](gg.size, x.shape[-1], self._p(gg), self._p(x), self._p(lab), self._p(out))
        return out

    def dropout(self, x: np.ndarray, keys: np.ndarray, h: int, p: float) -> np.ndarray:
        """``x`` (rows, cols) times its dropout mask from the row ``keys`` (uint64) and ``h`` =
        random.hash_words(seed, step, site): the interface of minicavs.cuda.RowKernels.dropout."""
        if x.dtype != self.dtype or (x.shape[1] > 1 and x.strides[1] != x.itemsize):
            x = np.ascontiguousarray(x, self.dtype)
        keys = np.ascontiguousarray(keys, np.uint64).reshape(-1)
        if len(keys) != x.shape[0]:
            raise ValueError(f"dropout: {len(keys)} row keys for {x.shape[0]} rows")
        y = np.empty(x.shape, self.dtype)
        if y.size:
            ldx = x.strides[0] // x.itemsize if x.shape[0] > 1 else x.shape[1]
            self._fn["dropout"](x.shape[0], x.shape[1], h, self._p(keys), math.ceil(p * (1 << 24)), 1.0 / (1.0 - p),
                                self.ffi.cast(f"{self.T} *", x.ctypes.data), ldx, self._p(y))
        return y

    def update(self, rule: str, p: np.ndarray, g, slots: tuple, hyper: tuple, apply: bool) -> int:
        """One optimizer rule (a key of RULES) over all of ``p``: apply=False returns the number of
        non-finite results and writes nothing, apply=True writes ``p`` and the slots in place (all
        C-contiguous). ``g`` is a dense array or a coalesced RowSparse (sorted unique indices)."""
        if not p.size:
            return 0
        arrays = [self._p(a) for a in slots]
        if isinstance(g, RowSparse):
            idx = np.ascontiguousarray(g.indices, np.int64)
            rows = np.ascontiguousarray(g.rows, self.dtype)
            return self._fn[f"{rule}_rows"](p.shape[0], p.size // p.shape[0], self._p(p), self._p(idx), len(idx),
                                            self._p(rows), *arrays, *hyper, int(apply))
        return self._fn[rule](p.size, self._p(p), self._p(np.ascontiguousarray(g, self.dtype)), *arrays, *hyper,
                              int(apply))


@functools.lru_cache(maxsize=None)
def library(dtype) -> Library | None:
    """The compiled kernels for ``dtype`` (float32 or float64), or None without a C compiler."""
    import cffi
    dtype = np.dtype(dtype)
    cc = cgen.compiler()
    if cc is None or dtype not in (np.float32, np.float64):
        return None
    T = "float" if dtype == np.float32 else "double"
    source, decls = render(T)
    ffi = cffi.FFI()
    ffi.cdef(decls)
    return Library(dtype, ffi.dlopen(str(cgen.compiled(source, cc, f"library-{T}"))), ffi)
