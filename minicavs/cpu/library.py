"""The hand-written C kernels of codegen/library.py (softmax cross-entropy, dropout, optimizer rules),
compiled once per dtype and wrapped for numpy arrays. Every kernel has a numpy twin that stays the reference
(ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two."""
from __future__ import annotations

import functools

import numpy as np

from ..codegen.library import RULES, render
from ..errors import FeedError
from ..sparse import RowSparse
from ..validate import check_dropout, check_labels
from . import compiler as cgen


class Library:
    """The kernels for one float dtype; methods take and return numpy arrays (C-contiguous)."""

    def __init__(self, dtype, lib, ffi):
        self.dtype = np.dtype(dtype)
        self.T = "float" if self.dtype == np.float32 else "double"
        self.lib, self.ffi = lib, ffi
        names = ("xent", "xent_grad", "dropout", "heights", *RULES, *(f"{r}_rows" for r in RULES))
        self._fn = {name: getattr(lib, f"{name}_{self.T}") for name in names}

    def _p(self, a: np.ndarray):
        kind = {np.dtype(np.int64): "long[]", np.dtype(np.uint64): "unsigned long long[]"}.get(a.dtype)
        return self.ffi.from_buffer(kind or f"{self.T}[]", a)

    def _matrix(self, a, what: str, ndim_min: int = 1) -> np.ndarray:
        """``a`` as a C-contiguous array of this library's dtype (a copy only when needed)."""
        a = np.asarray(a)
        if a.dtype.kind != "f" or a.ndim < ndim_min:
            raise FeedError(f"{what}: need a float array with at least {ndim_min} axes, got {a.dtype}{a.shape}")
        return np.ascontiguousarray(a, self.dtype)

    def xent(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        x = self._matrix(logits, "xent logits")
        lab = check_labels(x, labels, "xent")
        loss = np.empty(x.shape[:-1], self.dtype)
        if loss.size:
            self._fn["xent"](loss.size, x.shape[-1], self._p(x), self._p(lab), self._p(loss))
        return loss

    def xent_grad(self, g: np.ndarray, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        x = self._matrix(logits, "xent_grad logits")
        lab = check_labels(x, labels, "xent_grad")
        g = np.asarray(g)
        try:
            gg = np.ascontiguousarray(np.broadcast_to(g, x.shape[:-1]), self.dtype)
        except ValueError:
            raise FeedError(f"xent_grad: a gradient of shape {g.shape} for logits of shape {x.shape}: need "
                            f"one value per row, shape {x.shape[:-1]}") from None
        out = np.empty(x.shape, self.dtype)
        if gg.size:
            self._fn["xent_grad"](gg.size, x.shape[-1], self._p(gg), self._p(x), self._p(lab), self._p(out))
        return out

    def heights(self, ptr: np.ndarray, parent_ptr: np.ndarray, parent_idx: np.ndarray) -> np.ndarray:
        """inputs.py's vertex heights (children CSR ``ptr``, parents CSR) in one call, not one numpy round per
        level; -1 on or above a cycle. The CSR arrays are validated int64 (make_batch built them)."""
        n = len(ptr) - 1
        ptr, parent_ptr, parent_idx = (np.ascontiguousarray(a, np.int64) for a in (ptr, parent_ptr, parent_idx))
        height, pending, best, queue = (np.empty(max(n, 1), np.int64) for _ in range(4))
        self._fn["heights"](n, self._p(ptr), self._p(parent_ptr), self._p(parent_idx) if len(parent_idx) else
                            self.ffi.NULL, self._p(height), self._p(pending), self._p(best), self._p(queue))
        return height[:n]

    def dropout(self, x: np.ndarray, keys: np.ndarray, h: int, p: float) -> np.ndarray:
        """``x`` (rows, cols) times its dropout mask from the row ``keys`` (uint64) and ``h`` =
        random.hash_words(seed, step, site): the interface of minicavs.cuda.RowKernels.dropout."""
        x = np.asarray(x)
        if x.ndim != 2 or x.dtype.kind != "f":
            raise FeedError(f"dropout: need a 2-D float array, got {x.dtype}{x.shape}")
        if x.dtype != self.dtype or (x.shape[1] > 1 and x.strides[1] != x.itemsize) or x.strides[0] < 0:
            x = np.ascontiguousarray(x, self.dtype)
        keys, h, t, scale = check_dropout(x.shape[0], keys, h, p)
        y = np.empty(x.shape, self.dtype)
        if y.size:
            ldx = x.strides[0] // x.itemsize if x.shape[0] > 1 else x.shape[1]
            self._fn["dropout"](x.shape[0], x.shape[1], h, self._p(keys), t, scale,
                                self.ffi.cast(f"{self.T} *", x.ctypes.data), ldx, self._p(y))
        return y

    def update(self, rule: str, p: np.ndarray, g, slots: tuple, hyper: tuple, apply: bool) -> int:
        """One optimizer rule (a key of RULES) over all of ``p``: apply=False returns the number of
        non-finite results and writes nothing, apply=True writes ``p`` and the slots in place (all
        C-contiguous). ``g`` is a dense array or a coalesced RowSparse (sorted unique indices)."""
        if rule not in RULES:
            raise ValueError(f"unknown update rule {rule!r}; known: {sorted(RULES)}")
        nslots, nhyper = (len(RULES[rule][i].split(",")) for i in (0, 1))
        if len(slots) != nslots or len(hyper) != nhyper:
            raise ValueError(f"update {rule}: {len(slots)} slots and {len(hyper)} hyperparameters given, "
                             f"need {nslots} and {nhyper}")
        for what, a in (("parameter", p),) + tuple((f"slot {i}", a) for i, a in enumerate(slots)):
            if not (isinstance(a, np.ndarray) and a.dtype == self.dtype and a.flags.c_contiguous
                    and a.flags.writeable and a.shape == p.shape):
                raise FeedError(f"update {rule}: the {what} must be a writable C-contiguous {self.dtype} array "
                                f"of the parameter's shape {getattr(p, 'shape', None)}, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}")
        if not p.size:
            return 0
        arrays = [self._p(a) for a in slots]
        if isinstance(g, RowSparse):
            g = g.checked(f"update {rule}: row-sparse gradient")
            idx = g.indices
            if p.ndim < 1 or tuple(g.shape) != p.shape:
                raise FeedError(f"update {rule}: a row-sparse gradient of shape {tuple(g.shape)} for a parameter "
                                f"of shape {p.shape}")
            if len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all()):
                pos = int(np.flatnonzero(idx[1:] <= idx[:-1])[0]) + 1
                raise FeedError(f"update {rule}: row-sparse gradient indices must be sorted and unique "
                                f"(coalesced); index {int(idx[pos])} at position {pos} follows {int(idx[pos - 1])}")
            rows = np.ascontiguousarray(g.rows, self.dtype)
            return self._fn[f"{rule}_rows"](p.shape[0], p.size // p.shape[0], self._p(p), self._p(idx), len(idx),
                                            self._p(rows), *arrays, *hyper, int(apply))
        g = np.asarray(g)
        if g.shape != p.shape or g.dtype.kind != "f":
            raise FeedError(f"update {rule}: a gradient {g.dtype}{g.shape} for a parameter {p.dtype}{p.shape}")
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
