"""One row's softmax functions in C, written once for the two places that run them: the library's
softmax cross-entropy kernels (``xent``, ``xent_grad``: the step runner's loss) and the interpreter's ROWOP
(a static program's softmax, cross-entropy and its gradient, rows at any stride).

ROWOP had its own scalar loops (``exp`` in double, a float sum that the compiler may not reorder): over a
Fixed-LSTM's 10k-word vocabulary they took 351 ms of a 1.17 s training step, where these vectorized ones (the
vecmath ``exp``, ``omp simd`` reductions) take a tenth. Formatted with T, EXP_NONPOS and LOG as
library_source.SOURCE is; the float32 source needs vecmath.PRELUDE_F32 before it.
"""
from __future__ import annotations

from .vecmath import PRELUDE_F32

ROW_SOURCE = """
/* Rows shorter than a vector (SST's 5 classes over every tree vertex) take plain loops: the simd versions'
   set-up and remainder cost ~3x more per row there. */
static inline {T} row_max(const {T} *x, long n) {{
    {T} m = x[0];
    if (n < 16) {{
        for (long c = 1; c < n; c++) m = x[c] > m ? x[c] : m;
        return m;
    }}
    #pragma omp simd reduction(max:m)
    for (long c = 0; c < n; c++) m = x[c] > m ? x[c] : m;
    return m;
}}
/* The exp passes are compute-bound (about 5 of xent's 6 ms over 1.5k x 6k float32 here) while the next row's
   max pass waits on memory: each block of 256 columns first prefetches the same block of the next row
   (``next``; the row itself on the last row), so that the max pass finds it in cache: 10% off both kernels. */
#define ROW_BLOCK 256
#define PREFETCH_BLOCK(next, c0, c1) for (long c = c0; c < c1; c += 64 / (long)sizeof({T})) \\
    __builtin_prefetch(next + c, 0, 3)
/* sum of exp(x[c] - m) over the row; with ``o``, each exp is stored in o[c] too (the softmax's numerators) */
static inline {T} row_sumexp(const {T} *x, long n, {T} m, const {T} *next, {T} *o) {{
    {T} s = 0;
    if (n < 16) {{
        for (long c = 0; c < n; c++) {{ {T} e = {EXP_NONPOS}(x[c] - m); if (o) o[c] = e; s += e; }}
        return s;
    }}
    for (long c0 = 0; c0 < n; c0 += ROW_BLOCK) {{
        long c1 = c0 + ROW_BLOCK < n ? c0 + ROW_BLOCK : n;
        {T} block = 0;
        PREFETCH_BLOCK(next, c0, c1);
        if (o) {{
            #pragma omp simd reduction(+:block)
            for (long c = c0; c < c1; c++) {{ {T} e = {EXP_NONPOS}(x[c] - m); o[c] = e; block += e; }}
        }} else {{
            #pragma omp simd reduction(+:block)
            for (long c = c0; c < c1; c++) block += {EXP_NONPOS}(x[c] - m);
        }}
        s += block;
    }}
    return s;
}}
/* One row x of n numbers (``next``: the row after it, prefetched): fn 0 its softmax into o, 1 the cross-entropy
   of label lab (o[0] = logsumexp(x) - x[lab]), 2 that cross-entropy's gradient times g
   (o = (softmax(x) - onehot(lab)) * g). One exp per element: the exps go into o with their sum, then one
   scaling pass over o (a row of a 10k-word vocabulary stays in L1/L2); the exp was two thirds of the
   kernel's time when it ran twice. o may be x itself (each element is read before it is written). */
static inline void row_softmax_fn(long fn, long n, const {T} *x, const {T} *next, long lab, {T} g, {T} *o) {{
    if (n <= 0) return;
    {T} m = row_max(x, n);
    if (fn == 1) {{
        {T} picked = x[lab];
        o[0] = m + {LOG}(row_sumexp(x, n, m, next, 0)) - picked;
        return;
    }}
    {T} scale = (fn == 2 ? g : ({T})1) / row_sumexp(x, n, m, next, o);
    #pragma omp simd
    for (long c = 0; c < n; c++) o[c] *= scale;
    if (fn == 2) o[lab] -= g;
}}
"""


def row_functions(c_type: str) -> str:
    """The row functions' C source for ``c_type`` ("float" or "double"), with float32's vector exp before them
    (float64 keeps libm: the reference precision of gradient checks)."""
    f32 = c_type == "float"
    return (PRELUDE_F32 if f32 else "") + ROW_SOURCE.format(
        T=c_type, EXP_NONPOS="mc_expf_nonpos" if f32 else "exp", LOG="logf" if f32 else "log")
