"""The hand-written C kernels of codegen/library_source.py (softmax cross-entropy, dropout, optimizer rules),
compiled once per dtype and wrapped for numpy arrays. Every kernel has a numpy twin that stays the reference
(ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two."""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..core.errors import FeedError
from ..core.sparse import RowSparse
from ..core.validate import check_dropout, check_labels
from ..engine.codegen.library_source import RULES, render, rule_arity
from . import compiler as cgen
from .interpreter import blas, blas_threads


# Row kernels over at least this many elements split their rows over the BLAS's threads (cffi releases the GIL
# for the call): a softmax over 1.5k rows of a 6k-word vocabulary took 6 ms (xent) and 11 ms (xent_grad, with
# the page faults of its fresh output) on one core, the largest serial work of a Var-LSTM step besides the
# optimizer once the GEMMs ran on two.
PARALLEL_ELEMENTS = 1 << 20

# Products with at least this many output elements take :meth:`Library.linear`'s one-call bias (smaller ones
# stay with numpy, whose call costs less than the cffi set-up).
LINEAR_ELEMENTS = 1 << 16


@functools.lru_cache(maxsize=None)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minicavs-rows")


def over_rows(rows: int, cols: int, run) -> None:
    """``run(lo, hi)`` over row ranges that cover ``rows``: one call, or one per BLAS thread (the calling
    thread takes the first) when the array is large. Each call writes only its own rows."""
    threads = min(blas_threads(), rows) if rows * cols >= PARALLEL_ELEMENTS else 1
    if threads <= 1:
        run(0, rows)
        return
    bounds = [rows * k // threads for k in range(threads + 1)]
    pending = [_pool(threads - 1).submit(run, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    try:
        run(bounds[0], bounds[1])
    finally:
        for f in pending:
            f.result()


class Library:
    """The kernels for one float dtype; methods take and return numpy arrays (C-contiguous)."""

    def __init__(self, dtype, lib, ffi):
        self.dtype = np.dtype(dtype)
        self.T = "float" if self.dtype == np.float32 else "double"
        self.lib, self.ffi = lib, ffi
        names = ("xent", "xent_grad", "transpose", "dropout", "heights", "coalesce",
                 *(f"{r}{v}" for r in RULES for v in ("", "_rows", "_lazy", "_many")))
        self._fn = {name: getattr(lib, f"{name}_{self.T}") for name in names}
        # the C array type of each element type, as cffi types made once (a type named by a string is looked
        # up in cffi's parser cache by a Python call on every from_buffer)
        self._c_arrays = {dtype: ffi.typeof(c_type) for dtype, c_type in _C_ARRAY.items()}
        self._c_floats = ffi.typeof(f"{self.T}[]")

    def _p(self, a: np.ndarray):
        return self.ffi.from_buffer(self._c_arrays.get(a.dtype, self._c_floats), a)

    def _matrix(self, a, what: str, ndim_min: int = 1) -> np.ndarray:
        """``a`` as a C-contiguous array of this library's dtype (a copy only when needed)."""
        a = np.asarray(a)
        if a.dtype.kind != "f" or a.ndim < ndim_min:
            raise FeedError(f"{what}: need a float array with at least {ndim_min} axes, got {a.dtype}{a.shape}")
        return np.ascontiguousarray(a, self.dtype)

    def xent(self, logits: np.ndarray, labels: np.ndarray, op: str = "xent") -> np.ndarray:
        """Per row, the cross-entropy of the softmax at its label; the labels are checked (errors name ``op``)."""
        x = self._matrix(logits, f"{op} logits")
        lab = check_labels(x, labels, op)
        loss = np.empty(x.shape[:-1], self.dtype)
        if loss.size:
            n = x.shape[-1]
            x2, lab1, loss1 = x.reshape(-1, n), lab.reshape(-1), loss.reshape(-1)
            over_rows(loss.size, n, lambda lo, hi: self._fn["xent"](
                hi - lo, n, self._p(x2[lo:hi]), self._p(lab1[lo:hi]), self._p(loss1[lo:hi])))
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
            n = x.shape[-1]
            g1, x2, lab1, out2 = gg.reshape(-1), x.reshape(-1, n), lab.reshape(-1), out.reshape(-1, n)
            over_rows(gg.size, n, lambda lo, hi: self._fn["xent_grad"](
                hi - lo, n, self._p(g1[lo:hi]), self._p(x2[lo:hi]), self._p(lab1[lo:hi]), self._p(out2[lo:hi])))
        return out

    def linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray | None:
        """``x·w + b`` with the bias as the GEMM's C operand: ``b``'s rows copied into the result, then one
        BLAS call with beta = 1 adds the product. numpy's ``x @ w`` has OpenBLAS zero-fill C first (beta = 0)
        and ``y += b`` then reads and writes all of it again: 3 ms of a 1.5k x 6k float32 Var-LSTM softmax
        layer (96 ms) here, which this saves whole. None where a BLAS call does not fit (another dtype, a
        strided operand, no BLAS, a small product): the caller runs numpy."""
        if not (isinstance(x, np.ndarray) and isinstance(w, np.ndarray) and x.ndim == 2 and w.ndim == 2) \
                or x.shape[0] * w.shape[1] < LINEAR_ELEMENTS:   # (small ones first: they are most calls)
            return None
        gemm = self._gemm()
        if gemm is None or not all(isinstance(a, np.ndarray) and a.dtype == self.dtype for a in (x, w, b)):
            return None
        if b.shape != (w.shape[1],) or x.shape[1] != w.shape[0]:
            return None
        (rows, k), n = x.shape, w.shape[1]
        if not k or not b.flags.c_contiguous:
            return None
        operands = [_blas_operand(a) for a in (x, w)]
        if None in operands:
            return None
        (xa, x_trans, ldx), (wa, w_trans, ldw) = operands
        y = np.empty((rows, n), self.dtype)
        over_rows(rows, n, lambda lo, hi: np.copyto(y[lo:hi], b))
        fn, ilp64 = gemm
        fn(101, 112 if x_trans else 111, 112 if w_trans else 111, rows, n, k, 1.0, self._p(xa), ldx, self._p(wa),
           ldw, 1.0, self._p(y), n)   # CblasRowMajor; 112: CblasTrans, 111: CblasNoTrans
        return y

    def _gemm(self):
        """(numpy's cblas gemm of this dtype as a cffi function, whether it takes 64-bit ints), or None."""
        if not hasattr(self, "_gemm_fn"):
            found = blas(self.T)
            if found is None:
                self._gemm_fn = None
            else:
                address, ilp64, _ = found
                i = "int64_t" if ilp64 else "int"
                T = self.T
                self._gemm_fn = (self.ffi.cast(f"void (*)(int, int, int, {i}, {i}, {i}, {T}, const {T} *, {i}, "
                                               f"const {T} *, {i}, {T}, {T} *, {i})", address), ilp64)
        return self._gemm_fn

    def contiguous(self, a: np.ndarray) -> np.ndarray:
        """``a`` (2-D, this dtype) as a C-contiguous array: itself, or for a transposed view of a C-contiguous
        matrix a copy made in cache-sized tiles (numpy's strided copy of a 2048 x 512 float32 transpose took
        3 ms). The C runner multiplies by such a copy rather than by the view: OpenBLAS's sgemm with
        a transposed B was 25-40% slower per product at 16-64 rows (cpu/c_runner.py)."""
        if not (isinstance(a, np.ndarray) and a.ndim == 2 and a.dtype == self.dtype):
            raise FeedError(f"contiguous: need a 2-D {self.dtype} array, got {getattr(a, 'dtype', type(a))}"
                            f"{getattr(a, 'shape', '')}")
        if a.flags.c_contiguous:
            return a
        if not a.T.flags.c_contiguous:
            return np.ascontiguousarray(a)
        out = np.empty(a.shape, self.dtype)
        if a.size:
            self._fn["transpose"](a.shape[1], a.shape[0], self._p(a.T), a.shape[0], self._p(out))
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
        """One optimizer rule (a key of RULES) over all of ``p``: apply=False returns non-zero if a result
        is not finite and writes nothing, apply=True writes ``p`` and the slots in place (all
        C-contiguous). ``g`` is a dense array or a coalesced RowSparse (sorted unique indices)."""
        self._check_update(rule, p, slots, hyper)
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

    def _check_update(self, rule: str, p, slots: tuple, hyper: tuple) -> None:
        """The rule exists and takes these many slots and hyperparameters; the parameter and its slots are
        writable C-contiguous arrays of this dtype and one shape (what the kernels write in place)."""
        if rule not in RULES:
            raise ValueError(f"unknown update rule {rule!r}; known: {sorted(RULES)}")
        nslots, nhyper = rule_arity(rule)
        if len(slots) != nslots or len(hyper) != nhyper:
            raise ValueError(f"update {rule}: {len(slots)} slots and {len(hyper)} hyperparameters given, "
                             f"need {nslots} and {nhyper}")
        for what, a in (("parameter", p),) + tuple((f"slot {i}", a) for i, a in enumerate(slots)):
            if not (isinstance(a, np.ndarray) and a.dtype == self.dtype and a.flags.c_contiguous
                    and a.flags.writeable and a.shape == p.shape):
                raise FeedError(f"update {rule}: the {what} must be a writable C-contiguous {self.dtype} array "
                                f"of the parameter's shape {getattr(p, 'shape', None)}, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}")

    def update_many(self, rule: str, entries: list, hypers: list) -> Callable[[bool], int]:
        """:meth:`update` over many parameters in one C call: ``entries`` holds (parameter, dense gradient,
        slots) triples, ``hypers`` each one's hyperparameters. The same as
        ``update_table(rule, [(p, slots), ...]).bind(gradients, hypers)``: see :meth:`UpdateTable.bind`."""
        return self.update_table(rule, [(p, slots) for p, _, slots in entries]).bind([g for _, g, _ in entries],
                                                                                   hypers)

    def update_table(self, rule: str, params: list) -> "UpdateTable":
        """The checked table of (parameter, slots) pairs that :meth:`update_many` runs a rule over, to keep
        while the same arrays are updated step after step (see :class:`UpdateTable`)."""
        return UpdateTable(self, rule, params)

    def update_lazy(self, rule: str, p: np.ndarray, idx: np.ndarray, rows: np.ndarray, slots: tuple,
                    hyper: tuple) -> Callable[[bool], int]:
        """Lazy sparse updates: the rule on rows ``idx`` (sorted, unique, in range; checked) of ``p`` and its
        slots only, with gradient ``rows``, in place: the same values as :meth:`update` over the gathered rows.
        Returns ``run(apply)`` as :meth:`update_many` does."""
        self._check_update(rule, p, slots, hyper)
        idx = np.asarray(idx)
        if p.ndim < 1 or idx.ndim != 1 or idx.dtype != np.int64:
            raise FeedError(f"update {rule}: lazy rows need int64 indices (n,) into a parameter with rows, got "
                            f"{idx.dtype}{idx.shape} for {p.shape}")
        if not (isinstance(rows, np.ndarray) and rows.dtype == self.dtype and rows.flags.c_contiguous
                and rows.shape == (len(idx),) + p.shape[1:]):
            raise FeedError(f"update {rule}: gradient rows {getattr(rows, 'dtype', '')}{getattr(rows, 'shape', '')} "
                            f"do not fit {len(idx)} rows of a {self.dtype} parameter of shape {p.shape}")
        if len(idx) and (idx[0] < 0 or idx[-1] >= p.shape[0] or not bool((idx[1:] > idx[:-1]).all())):
            raise FeedError(f"update {rule}: lazy row indices must be sorted, unique and in [0, {p.shape[0]})")
        width = p.size // p.shape[0] if p.shape[0] else 0
        fn, args = self._fn[f"{rule}_lazy"], (width, self._p(p), self._p(idx), len(idx), self._p(rows),
                                              *(self._p(a) for a in slots), *hyper)
        return lambda apply: fn(*args, int(apply))

    def coalesce(self, idx: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`RowSparse.coalesce` of (``idx``, ``rows``) bit for bit (its stable sort, then add.reduceat's
        summation order in C instead of numpy's slow axis-0 reduceat): sorted unique indices and their summed
        rows. ``idx`` is int64 (n,), ``rows`` (n, ...) of this dtype; indices are not range-checked (only
        ``rows`` is indexed, by position)."""
        idx = np.asarray(idx)
        rows = np.asarray(rows)
        if idx.ndim != 1 or idx.dtype != np.int64 or rows.ndim < 1 or rows.shape[0] != len(idx) \
                or rows.dtype != self.dtype:
            raise FeedError(f"coalesce: need int64 indices (n,) and {self.dtype} rows (n, ...), got "
                            f"{idx.dtype}{idx.shape} and {rows.dtype}{rows.shape}")
        if not len(idx):
            return idx.copy(), rows.copy()
        idx = np.ascontiguousarray(idx)
        rows = np.ascontiguousarray(rows)
        order = np.argsort(_narrowed(idx), kind="stable")
        out_idx, out_rows = np.empty_like(idx), np.empty_like(rows)
        width = rows.size // len(idx)
        u = self._fn["coalesce"](len(idx), width, self._p(idx), self._p(order), self._p(rows), self._p(out_idx),
                                 self._p(out_rows))
        return out_idx[:u], out_rows[:u]


def _narrowed(idx: np.ndarray) -> np.ndarray:
    """``idx`` in the narrowest unsigned type that holds its values, for a stable sort in the same order: numpy
    sorts 8- and 16-bit keys by radix (832 indices into 12 rows: ~6 us, as int64 ~30 us)."""
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= 1 << 16:
        return idx
    return idx.astype(np.uint8 if hi < 1 << 8 else np.uint16)


class UpdateTable:
    """The parameters and slots one rule updates together, checked once (:meth:`Library._check_update`), with
    their addresses. An optimizer keeps its table while its arrays stay the same, so a step only checks and
    addresses its gradients (``ctypes.data`` costs ~1-2 us an array, and a Tree-LSTM step has 36 of them);
    the table holds the arrays, so an address cannot be reused by another array while it lives, and it is
    the caller's (no cache in the library would keep a discarded model's arrays alive)."""

    def __init__(self, lib: "Library", rule: str, params: list):
        nslots = rule_arity(rule)[0] if rule in RULES else 0
        self.lib, self.rule, self.nhyper = lib, rule, (rule_arity(rule)[1] if rule in RULES else 0)
        self.arrays, self.addresses = [], np.zeros((len(params), 2 + nslots), np.int64)
        for k, (p, slots) in enumerate(params):
            lib._check_update(rule, p, slots, (0.0,) * self.nhyper)
            self.arrays += (p, *slots)
            self.addresses[k, 0] = p.ctypes.data
            self.addresses[k, 2:] = [a.ctypes.data for a in slots]
        self.params = [p for p, _ in params]
        self.sizes = np.array([p.size for p in self.params], np.int64)
        self.shapes = [p.shape for p in self.params]

    def bind(self, grads: list, hypers: list) -> Callable[[bool], int]:
        """``run(apply)``: the update of every parameter by its gradient (a C-contiguous array of its shape and
        the table's dtype; checked, and its address taken, here) with its hyperparameters (one sequence, or
        one row of an array, per parameter), in one C call.
        apply=False checks (non-zero if a result is not finite, nothing written), apply=True applies, element
        for element as :meth:`Library.update` does. The gradients must stay alive and unchanged while ``run``
        is used."""
        lib, rule = self.lib, self.rule
        if len(grads) != len(self.params) or len(hypers) != len(self.params):
            raise ValueError(f"update {rule}: {len(grads)} gradients and {len(hypers)} hyperparameter sets for "
                             f"{len(self.params)} parameters")
        for a in self.arrays:   # (their shapes cannot change; a view could have been made read-only)
            if not (a.flags.writeable and a.flags.c_contiguous):
                raise FeedError(f"update {rule}: a parameter or slot array is no longer writable and C-contiguous")
        table = np.asarray(hypers, lib.dtype) if len(hypers) else np.empty((0, self.nhyper), lib.dtype)
        if table.shape != (len(self.params), self.nhyper):
            raise ValueError(f"update {rule}: hyperparameters of shape {table.shape} given, need "
                             f"{(len(self.params), self.nhyper)}")
        table = np.ascontiguousarray(table)
        addresses = self.addresses.copy()
        cast, buf, dtype = lib.ffi.cast, lib.ffi.from_buffer, lib.dtype
        for k, (g, shape) in enumerate(zip(grads, self.shapes)):
            if not (type(g) is np.ndarray and g.dtype == dtype and g.flags.c_contiguous and g.shape == shape):
                raise FeedError(f"update {rule}: the gradient must be a C-contiguous {dtype} array of the "
                                f"parameter's shape {shape}, got {getattr(g, 'dtype', type(g).__name__)}"
                                f"{getattr(g, 'shape', '')}")
            addresses[k, 1] = int(cast("intptr_t", buf(g))) if g.size else 0
        fn = lib._fn[f"{rule}_many"]
        args = (len(grads), lib._p(self.sizes), lib._p(addresses), lib._p(table))
        keep = (self, grads, addresses, table)   # the addresses stay valid while run lives
        return lambda apply, keep=keep: fn(*args, int(apply))


def _blas_operand(a: np.ndarray):
    """(a C-contiguous array, whether BLAS reads it transposed, its leading dimension) for a 2-D ``a`` that is
    C-contiguous or the transpose of a C-contiguous array, else None."""
    if a.flags.c_contiguous:
        return a, False, max(1, a.shape[1])
    if a.T.flags.c_contiguous:
        return a.T, True, max(1, a.shape[0])
    return None


_C_ARRAY = {np.dtype(np.int64): "long[]", np.dtype(np.uint64): "unsigned long long[]"}   # index arrays' C types


def library(dtype) -> Library | None:
    """The compiled kernels for ``dtype`` (float32 or float64), or None without a C compiler. Cached per
    ``CC`` setting until built (not per resolved compiler: finding it on PATH costs ~50 us, and this runs per
    kernel call; see cpu/compiler.py kept_once_built)."""
    return _built_library(np.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _library(dtype: np.dtype, cc_setting: str | None) -> Library | None:
    import cffi
    cc = cgen.compiler()
    if cc is None or dtype not in (np.float32, np.float64):
        return None
    T = "float" if dtype == np.float32 else "double"
    source, decls = render(T)
    ffi = cffi.FFI()
    ffi.cdef(decls)
    return Library(dtype, ffi.dlopen(str(cgen.compiled(source, cc, f"library-{T}"))), ffi)


_built_library = cgen.kept_once_built(_library)
