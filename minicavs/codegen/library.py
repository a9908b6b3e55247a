"""Hand-written C kernels that are not elementwise, compiled once per dtype like the generated ones:
softmax cross-entropy over rows (forward and gradient), dropout masks and the optimizers' update rules.

Each optimizer rule has two kernels: one for a dense gradient and one for a row-sparse gradient (an
embedding's: sorted unique row indices and their rows) that still updates every row, as the dense rule does
(weight decay and the slots' decay reach rows no batch looked up), without building the dense gradient.
Both run twice per step: apply = 0 counts the non-finite results and writes nothing, apply = 1 writes in
place; both passes compute the same values, so a checked update cannot fail when applied.

Each replaces several numpy passes (and their temporaries) over large arrays by one or two: a softmax over a
6k-word vocabulary or an Adam step over a 3M-float table is memory-bound. Every kernel has a numpy twin that
stays the reference (ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two.
Reductions use ``#pragma omp simd reduction`` so they vectorize without ``-ffast-math``.
"""
from __future__ import annotations

import functools

import numpy as np

from . import c as cgen
from .vecmath import PRELUDE_F32
from ..errors import FeedError
from ..sparse import RowSparse
from ..validate import check_dropout, check_labels

SOURCE = """
#include <math.h>
{prelude}
static inline {T} row_max(const {T} *x, long n) {{
    {T} m = x[0];
    #pragma omp simd reduction(max:m)
    for (long c = 0; c < n; c++) m = x[c] > m ? x[c] : m;
    return m;
}}
static inline {T} row_sumexp(const {T} *x, long n, {T} m) {{
    {T} s = 0;
    #pragma omp simd reduction(+:s)
    for (long c = 0; c < n; c++) s += {EXP}(x[c] - m);
    return s;
}}
/* loss[r] = logsumexp(x[r]) - x[r, label[r]] */
void xent_{T}(long rows, long n, const {T} *x, const long *label, {T} *loss) {{
    for (long r = 0; r < rows; r++) {{
        const {T} *xr = x + r * n;
        {T} m = row_max(xr, n);
        loss[r] = m + {LOG}(row_sumexp(xr, n, m)) - xr[label[r]];
    }}
}}
/* out[r] = (softmax(x[r]) - onehot(label[r])) * g[r] */
void xent_grad_{T}(long rows, long n, const {T} *g, const {T} *x, const long *label, {T} *out) {{
    for (long r = 0; r < rows; r++) {{
        const {T} *xr = x + r * n;
        {T} *o = out + r * n;
        {T} m = row_max(xr, n);
        {T} scale = g[r] / row_sumexp(xr, n, m);
        #pragma omp simd
        for (long c = 0; c < n; c++) o[c] = {EXP}(xr[c] - m) * scale;
        o[label[r]] -= g[r];
    }}
}}
static inline unsigned long long mc_mix(unsigned long long z) {{  /* SplitMix64's finaliser */
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ULL; z ^= z >> 27; z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}}
/* y = x * dropout mask, minicavs/random.py's hash word for word: h is the hash after (seed, step, site),
   then row key keys[r], then column c; kept where uniform >= p, compared as integers:
   (z >> 40) / 2^24 >= p  <=>  (z >> 40) >= t = ceil(p * 2^24) (a double compare would not vectorize). */
void dropout_{T}(long rows, long cols, unsigned long long h, const unsigned long long *keys,
                 unsigned long long t, {T} scale, const {T} *x, long ldx, {T} *y) {{
    const unsigned long long golden = 0x9E3779B97F4A7C15ULL;
    for (long r = 0; r < rows; r++) {{
        unsigned long long hr = mc_mix(h ^ keys[r]) + golden;
        const {T} *xr = x + r * ldx;
        #pragma omp simd
        for (long c = 0; c < cols; c++) {{
            unsigned long long z = mc_mix(hr ^ (unsigned long long)c) + golden;
            y[r * cols + c] = xr[c] * ((z >> 40) >= t ? scale : 0);
        }}
    }}
}}
"""

DECLS = """
void xent_{T}(long rows, long n, const {T} *x, const long *label, {T} *loss);
void xent_grad_{T}(long rows, long n, const {T} *g, const {T} *x, const long *label, {T} *out);
void dropout_{T}(long rows, long cols, unsigned long long h, const unsigned long long *keys,
                 unsigned long long t, {T} scale, const {T} *x, long ldx, {T} *y);
"""

# name: (slot arrays, scalar hyperparameters, one element's update from its gradient GRAD, slot write-back,
# finiteness test). Every rule takes L2 weight decay ``wd``, added to the gradient.
RULES = {
    "adam": ("m, v", "lr, b1, b2, c1, c2, eps, wd",
             "{T} gi = GRAD + wd * p[i]; {T} mi = b1 * m[i] + (1 - b1) * gi; "
             "{T} vi = b2 * v[i] + (1 - b2) * (gi * gi); {T} pi = p[i] - lr * (mi / c1) / ({SQRT}(vi / c2) + eps);",
             "m[i] = mi; v[i] = vi;", "isfinite(pi) && isfinite(mi) && isfinite(vi)"),
    "adagrad": ("a", "lr, eps, wd",
                "{T} gi = GRAD + wd * p[i]; {T} ai = a[i] + gi * gi; {T} pi = p[i] - lr * gi / ({SQRT}(ai) + eps);",
                "a[i] = ai;", "isfinite(pi) && isfinite(ai)"),
}

# Elements [lo, hi) with gradient GRAD: apply in place, or count the non-finite results into ``bad``.
LOOP = """
        if (apply) {{
            #pragma omp simd
            for (long i = lo; i < hi; i++) {{ STEP WRITE p[i] = pi; }}
        }} else {{
            #pragma omp simd reduction(+:bad)
            for (long i = lo; i < hi; i++) {{ STEP bad += !(FINITE); }}
        }}"""

# g of the _rows kernel holds the rows of the sorted unique indices idx[0..nidx); other rows' gradient is 0.
RULE = """
long NAME_{T}(long n, {T} *p, const {T} *g, SLOTS, HYPER, int apply) {{
    long bad = 0;
    {{ long lo = 0, hi = n; DENSE }}
    return bad;
}}
long NAME_rows_{T}(long nrows, long width, {T} *p, const long *idx, long nidx, const {T} *g, SLOTS, HYPER, int apply) {{
    long bad = 0;
    for (long r = 0, k = 0; r < nrows; r++) {{
        long lo = r * width, hi = lo + width;
        if (k < nidx && idx[k] == r) {{
            const {T} *gr = g + (k++) * width; ROWS
        }} else {{ ZERO }}
    }}
    return bad;
}}
"""


def _rule_source(name: str) -> tuple[str, str]:
    """C source and declarations of one optimizer rule's two kernels (dense and row-sparse gradient);
    still to be formatted with T and SQRT like SOURCE."""
    slots, hyper, step, write, finite = RULES[name]
    slots = ", ".join(f"{{T}} *{a.strip()}" for a in slots.split(","))
    hyper = ", ".join(f"{{T}} {h.strip()}" for h in hyper.split(","))

    def loop(grad):
        return LOOP.replace("STEP", step.replace("GRAD", grad)).replace("WRITE", write).replace("FINITE", finite)
    src = (RULE.replace("DENSE", loop("g[i]")).replace("ROWS", loop("gr[i - lo]")).replace("ZERO", loop("0"))
           .replace("NAME", name).replace("SLOTS", slots).replace("HYPER", hyper))
    decls = "".join(line[:-len(" {{")] + ";\n" for line in src.splitlines() if line.startswith("long "))
    return src, decls


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
    f32 = dtype == np.float32
    T = "float" if f32 else "double"
    rules = [_rule_source(name) for name in RULES]
    fmt = dict(T=T, SQRT="sqrtf" if f32 else "sqrt", prelude=PRELUDE_F32 if f32 else "",
               EXP="mc_expf" if f32 else "exp", LOG="logf" if f32 else "log")
    source = (SOURCE + "".join(src for src, _ in rules)).format(**fmt)
    ffi = cffi.FFI()
    ffi.cdef((DECLS + "".join(decls for _, decls in rules)).format(T=T))
    return Library(dtype, ffi.dlopen(str(cgen._compiled(source, cc, f"library-{T}"))), ffi)
