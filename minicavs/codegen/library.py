"""Hand-written C kernels that are not elementwise, compiled once per dtype like the generated ones:
softmax cross-entropy over rows (forward and gradient) and the optimizers' update rules.

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
/* Adam with L2 weight decay. apply = 0: count the non-finite results, write nothing; apply = 1: write
   them in place. Both passes compute the same values, so a checked update cannot fail when applied. */
long adam_{T}(long n, {T} *p, const {T} *g, {T} *m, {T} *v, {T} lr, {T} b1, {T} b2, {T} c1, {T} c2, {T} eps,
              {T} wd, int apply) {{
    long bad = 0;
    if (apply) {{
        #pragma omp simd
        for (long i = 0; i < n; i++) {{
            ADAM_STEP
            m[i] = mi; v[i] = vi; p[i] = pi;
        }}
        return 0;
    }}
    #pragma omp simd reduction(+:bad)
    for (long i = 0; i < n; i++) {{
        ADAM_STEP
        bad += !(isfinite(pi) && isfinite(mi) && isfinite(vi));
    }}
    return bad;
}}
/* Adagrad with L2 weight decay; the same two passes. */
long adagrad_{T}(long n, {T} *p, const {T} *g, {T} *a, {T} lr, {T} eps, {T} wd, int apply) {{
    long bad = 0;
    if (apply) {{
        #pragma omp simd
        for (long i = 0; i < n; i++) {{
            ADAGRAD_STEP
            a[i] = ai; p[i] = pi;
        }}
        return 0;
    }}
    #pragma omp simd reduction(+:bad)
    for (long i = 0; i < n; i++) {{
        ADAGRAD_STEP
        bad += !(isfinite(pi) && isfinite(ai));
    }}
    return bad;
}}
"""

DECLS = """
void xent_{T}(long rows, long n, const {T} *x, const long *label, {T} *loss);
void xent_grad_{T}(long rows, long n, const {T} *g, const {T} *x, const long *label, {T} *out);
long adam_{T}(long n, {T} *p, const {T} *g, {T} *m, {T} *v, {T} lr, {T} b1, {T} b2, {T} c1, {T} c2, {T} eps,
              {T} wd, int apply);
long adagrad_{T}(long n, {T} *p, const {T} *g, {T} *a, {T} lr, {T} eps, {T} wd, int apply);
"""


class Library:
    """The kernels for one float dtype; methods take and return numpy arrays (C-contiguous)."""

    def __init__(self, dtype, lib, ffi):
        self.dtype = np.dtype(dtype)
        self.T = "float" if self.dtype == np.float32 else "double"
        self.lib, self.ffi = lib, ffi
        self._fn = {name: getattr(lib, f"{name}_{self.T}") for name in ("xent", "xent_grad", "adam", "adagrad")}

    def _p(self, a: np.ndarray):
        return self.ffi.from_buffer("long[]" if a.dtype == np.int64 else f"{self.T}[]", a)

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

    def adam(self, p, g, m, v, lr, b1, b2, c1, c2, eps, wd, apply: bool) -> int:
        """Check (apply=False: the number of non-finite results) or apply in place; p, m, v contiguous."""
        return self._fn["adam"](p.size, *(self._p(a) for a in (p, g, m, v)), lr, b1, b2, c1, c2, eps, wd,
                                int(apply)) if p.size else 0

    def adagrad(self, p, g, a, lr, eps, wd, apply: bool) -> int:
        return self._fn["adagrad"](p.size, *(self._p(x) for x in (p, g, a)), lr, eps, wd, int(apply)) if p.size else 0


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
    SQRT = "sqrtf" if f32 else "sqrt"
    steps = {"ADAM_STEP": f"{T} gi = g[i] + wd * p[i]; {T} mi = b1 * m[i] + (1 - b1) * gi; "
                          f"{T} vi = b2 * v[i] + (1 - b2) * (gi * gi); "
                          f"{T} pi = p[i] - lr * (mi / c1) / ({SQRT}(vi / c2) + eps);",
             "ADAGRAD_STEP": f"{T} gi = g[i] + wd * p[i]; {T} ai = a[i] + gi * gi; "
                             f"{T} pi = p[i] - lr * gi / ({SQRT}(ai) + eps);"}
    source = SOURCE
    for k, v in steps.items():
        source = source.replace(k, v)
    source = source.format(T=T, prelude=PRELUDE_F32 if f32 else "", EXP="mc_expf" if f32 else "exp",
                           LOG="logf" if f32 else "log")
    ffi = cffi.FFI()
    ffi.cdef(DECLS.format(T=T))
    return Library(dtype, ffi.dlopen(str(cgen._compiled(source, cc, f"library-{T}"))), ffi)
