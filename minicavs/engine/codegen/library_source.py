"""Hand-written C kernels that are not elementwise, compiled once per dtype like the generated ones:
softmax cross-entropy over rows (forward and gradient), dropout masks and the optimizers' update rules.

Each optimizer rule has two kernels: one for a dense gradient and one for a row-sparse gradient (an
embedding's: sorted unique row indices and their rows) that still updates every row, as the dense rule does
(weight decay and the slots' decay reach rows no batch looked up), without building the dense gradient.
Both run twice per step: apply = 0 returns non-zero if a result is not finite and writes nothing, apply = 1
writes in place; both passes compute the same values, so a checked update cannot fail when applied. Two more variants
serve the optimizer's one-call step (optim.py): ``_many`` runs the dense kernel over a table of parameters
(addresses and per-parameter hyperparameters), ``_lazy`` updates only the looked-up rows of an embedding in
place (lazy sparse updates; the same arithmetic as the dense kernel over gathered rows, without the gather
and scatter). ``coalesce`` sums a row-sparse gradient's repeated rows as numpy's ``add.reduceat`` does.

This module renders their C source (strings only); minicavs/cpu/library.py compiles, loads and wraps it.
Each replaces several numpy passes (and their temporaries) over large arrays by one or two: a softmax over a
6k-word vocabulary or an Adam step over a 3M-float table is memory-bound. Every kernel has a numpy twin that
stays the reference (ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two.
Reductions use ``#pragma omp simd reduction`` so they vectorize without ``-ffast-math``.
"""
from __future__ import annotations

import functools

from .row_source import row_functions

SOURCE = """
#include <math.h>
{rows}
/* loss[r] = logsumexp(x[r]) - x[r, label[r]] */
void xent_{T}(long rows, long n, const {T} *x, const long *label, {T} *loss) {{
    for (long r = 0; r < rows; r++) {{
        const {T} *xr = x + r * n;
        row_softmax_fn(1, n, xr, r + 1 < rows ? xr + n : xr, label[r], 0, loss + r);
    }}
}}
/* out[r] = (softmax(x[r]) - onehot(label[r])) * g[r] */
void xent_grad_{T}(long rows, long n, const {T} *g, const {T} *x, const long *label, {T} *out) {{
    for (long r = 0; r < rows; r++) {{
        const {T} *xr = x + r * n;
        row_softmax_fn(2, n, xr, r + 1 < rows ? xr + n : xr, label[r], g[r], out + r * n);
    }}
}}
/* dst (cols x rows, C-contiguous) = the transpose of src (rows x cols, row stride ld), in panels of 16 source
   columns (16 destination rows) walked down the source in 16 x 16 tiles: each source cache line (16 floats) is
   read once, and the panel's 16 destination rows are written front to back, whole lines at a time. 512 x 2048
   float32 took 0.96 ms, 8 x 8 tiles row by row 1.4 ms, numpy's strided copy 3 ms; 32-wide tiles were slower. */
void transpose_{T}(long rows, long cols, const {T} *src, long ld, {T} *dst) {{
    for (long j0 = 0; j0 < cols; j0 += 16) {{
        long j1 = j0 + 16 < cols ? j0 + 16 : cols;
        for (long i0 = 0; i0 < rows; i0 += 16) {{
            long i1 = i0 + 16 < rows ? i0 + 16 : rows;
            for (long j = j0; j < j1; j++)
                for (long i = i0; i < i1; i++) dst[j * rows + i] = src[i * ld + j];
        }}
    }}
}}
static inline unsigned long long mc_mix(unsigned long long z) {{  /* SplitMix64's finaliser */
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ULL; z ^= z >> 27; z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}}
/* y = x * dropout mask, minicavs/core/random.py's hash word for word: h is the hash after (seed, step, site),
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
/* Heights of a graph's vertices (0 without children, else 1 + the children's largest), Kahn's algorithm over
   the parents (pptr, pidx: one entry per edge); vertices on or above a cycle keep -1. The same numbers as
   minicavs/runtime/inputs.py's level-by-level numpy loop, in one call however deep the graph. */
void heights_{T}(long n, const long *ptr, const long *pptr, const long *pidx, long *height, long *pending,
                 long *best, long *queue) {{
    long head = 0, tail = 0;
    for (long v = 0; v < n; v++) {{
        pending[v] = ptr[v + 1] - ptr[v];
        best[v] = 0;
        height[v] = -1;
        if (!pending[v]) {{ height[v] = 0; queue[tail++] = v; }}
    }}
    while (head < tail) {{
        const long v = queue[head++];
        for (long e = pptr[v]; e < pptr[v + 1]; e++) {{
            const long p = pidx[e];
            if (height[v] + 1 > best[p]) best[p] = height[v] + 1;
            if (--pending[p] == 0) {{ height[p] = best[p]; queue[tail++] = p; }}
        }}
    }}
}}
/* numpy's pairwise summation (loops_utils.h.src, FLOAT_pairwise_sum: -0 start below 8 terms, 8 accumulators
   up to 128, halves aligned to 8 above) of the terms rows[ord[j] * width + c], j < n, for the columns c < cw
   (at most MC_CB) at once, so that the column loops vectorize; each column's sum is numpy's, term for term. */
#define MC_CB 64
static void mc_pairwise(const {T} *rows, const long *ord, long n, long width, long cw, {T} *res) {{
    if (n < 8) {{
        for (long c = 0; c < cw; c++) res[c] = -0.0;
        for (long j = 0; j < n; j++) {{
            const {T} *x = rows + ord[j] * width;
            for (long c = 0; c < cw; c++) res[c] += x[c];
        }}
        return;
    }}
    if (n <= 128) {{
        {T} r[8][MC_CB];
        for (int a = 0; a < 8; a++) {{
            const {T} *x = rows + ord[a] * width;
            for (long c = 0; c < cw; c++) r[a][c] = x[c];
        }}
        long j = 8;
        for (; j < n - (n % 8); j += 8)
            for (int a = 0; a < 8; a++) {{
                const {T} *x = rows + ord[j + a] * width;
                for (long c = 0; c < cw; c++) r[a][c] += x[c];
            }}
        for (long c = 0; c < cw; c++)
            res[c] = ((r[0][c] + r[1][c]) + (r[2][c] + r[3][c])) + ((r[4][c] + r[5][c]) + (r[6][c] + r[7][c]));
        for (; j < n; j++) {{
            const {T} *x = rows + ord[j] * width;
            for (long c = 0; c < cw; c++) res[c] += x[c];
        }}
        return;
    }}
    long half = n / 2;
    half -= half % 8;
    {T} right[MC_CB];
    mc_pairwise(rows, ord, half, width, cw, res);
    mc_pairwise(rows, ord + half, n - half, width, cw, right);
    for (long c = 0; c < cw; c++) res[c] += right[c];
}}
/* RowSparse.coalesce bit for bit: ``order`` is the stable argsort of idx[0..n); each run of equal indices
   becomes one row, its first row plus the pairwise sum of the others, as np.add.reduceat(rows[order], starts,
   axis=0) computes it. Writes the unique indices and their rows; returns how many. */
long coalesce_{T}(long n, long width, const long *idx, const long *order, const {T} *rows, long *out_idx,
                  {T} *out_rows) {{
    long u = 0;
    for (long s = 0; s < n; u++) {{
        const long key = idx[order[s]];
        long e = s + 1;
        while (e < n && idx[order[e]] == key) e++;
        const {T} *first = rows + order[s] * width;
        {T} *o = out_rows + u * width;
        out_idx[u] = key;
        if (e - s == 1) {{
            for (long c = 0; c < width; c++) o[c] = first[c];
        }} else {{
            {T} sum[MC_CB];
            for (long c0 = 0; c0 < width; c0 += MC_CB) {{
                const long cw = width - c0 < MC_CB ? width - c0 : MC_CB;
                mc_pairwise(rows + c0, order + s + 1, e - s - 1, width, cw, sum);
                for (long c = 0; c < cw; c++) o[c0 + c] = first[c0 + c] + sum[c];
            }}
        }}
        s = e;
    }}
    return u;
}}
"""

DECLS = """
long coalesce_{T}(long n, long width, const long *idx, const long *order, const {T} *rows, long *out_idx,
                  {T} *out_rows);
void heights_{T}(long n, const long *ptr, const long *pptr, const long *pidx, long *height, long *pending,
                 long *best, long *queue);
void xent_{T}(long rows, long n, const {T} *x, const long *label, {T} *loss);
void xent_grad_{T}(long rows, long n, const {T} *g, const {T} *x, const long *label, {T} *out);
void transpose_{T}(long rows, long cols, const {T} *src, long ld, {T} *dst);
void dropout_{T}(long rows, long cols, unsigned long long h, const unsigned long long *keys,
                 unsigned long long t, {T} scale, const {T} *x, long ldx, {T} *y);
"""

# name: (slot arrays, scalar hyperparameters, one element's update from its gradient GRAD, slot write-back,
# the results that must be finite). Every rule takes L2 weight decay ``wd``, added to the gradient; each is optim.py's numpy
# rule operation for operation (``-std=c99`` keeps gcc from contracting into FMAs), so the optimizers may use
# either. A non-finite gradient always fails the finiteness test (gi is one of the results).
RULES = {
    "sgd": ("", "lr, wd", "{T} gi = GRAD + wd * p[i]; {T} pi = p[i] - lr * gi;", "", "gi pi"),
    "momentum": ("u", "lr, mu, wd", "{T} gi = GRAD + wd * p[i]; {T} ui = mu * u[i] + gi; {T} pi = p[i] - lr * ui;",
                 "u[i] = ui;", "gi pi ui"),
    # lr and eps bias-corrected (optim.Adam.kernel): one division and one square root an element, not three
    # and one; the divider bounds this loop
    "adam": ("m, v", "lr, b1, b2, eps, wd",
             "{T} gi = GRAD + wd * p[i]; {T} mi = b1 * m[i] + (1 - b1) * gi; "
             "{T} vi = b2 * v[i] + (1 - b2) * (gi * gi); {T} pi = p[i] - lr * mi / ({SQRT}(vi) + eps);",
             "m[i] = mi; v[i] = vi;", "gi pi mi vi"),
    "adagrad": ("a", "lr, eps, wd",
                "{T} gi = GRAD + wd * p[i]; {T} ai = a[i] + gi * gi; {T} pi = p[i] - lr * gi / ({SQRT}(ai) + eps);",
                "a[i] = ai;", "gi pi ai"),
}


@functools.lru_cache(maxsize=None)
def rule_arity(name: str) -> tuple[int, int]:
    """(slot arrays, scalar hyperparameters) of a rule's kernels."""
    slots, hyper = RULES[name][:2]
    return len([a for a in slots.split(",") if a.strip()]), len(hyper.split(","))


# Elements [lo, hi) with gradient GRAD: apply in place, or add 1 to ``bad`` if a result is not finite. The test
# is one sum in the element type: x - x is 0 for a finite x and NaN for an infinite or NaN one, and a NaN
# stays in the sum (no -ffast-math, so x - x is not folded). It vectorizes at full width, where counting
# into a long converted every lane (Adam's check pass over 181k floats: 74 -> 53 us).
LOOP = """
        if (apply) {{
            #pragma omp simd
            for (long i = lo; i < hi; i++) {{ STEP WRITE p[i] = pi; }}
        }} else {{
            {T} nonfinite = 0;
            #pragma omp simd reduction(+:nonfinite)
            for (long i = lo; i < hi; i++) {{ STEP nonfinite += FINITE; }}
            bad += !(nonfinite == 0);
        }}"""

# g of the _rows kernel holds the rows of the sorted unique indices idx[0..nidx); other rows' gradient is 0.
# The _lazy kernel updates only those rows (idx in range, unique), fetching the parameter's and slots' row
# LAZY_AHEAD rows on into cache while it updates this one: the rows a batch looked up are scattered over the
# table, and without it each row's first lines waited on memory (Adam, 800 of 21,701 rows of 128 floats, caches
# cold: 370 -> 270 us for the check and the apply pass). The _many kernel runs NAME over ``count``
# parameters: ptrs holds each one's addresses (parameter, gradient, slots), hyper its hyperparameters.
LAZY_AHEAD = 2
RULE = """
long NAME_{T}(long n, {T} *p, const {T} *g, ARGS, int apply) {{
    long bad = 0;
    {{ long lo = 0, hi = n; DENSE }}
    return bad;
}}
long NAME_rows_{T}(long nrows, long width, {T} *p, const long *idx, long nidx, const {T} *g, ARGS, int apply) {{
    long bad = 0;
    for (long r = 0, k = 0; r < nrows; r++) {{
        long lo = r * width, hi = lo + width;
        if (k < nidx && idx[k] == r) {{
            const {T} *gr = g + (k++) * width; ROWS
        }} else {{ ZERO }}
    }}
    return bad;
}}
long NAME_lazy_{T}(long width, {T} *p, const long *idx, long nidx, const {T} *g, ARGS, int apply) {{
    long bad = 0;
    for (long k = 0; k < nidx; k++) {{
        long lo = idx[k] * width, hi = lo + width;
        if (k + LAZY_AHEAD < nidx) {{
            const long ahead = idx[k + LAZY_AHEAD] * width;
            for (long o = 0; o < width; o += 64 / (long)sizeof({T})) {{ PREFETCH }}
        }}
        const {T} *gr = g + k * width; ROWS
    }}
    return bad;
}}
long NAME_many_{T}(long count, const long *n, const long *ptrs, const {T} *hyper, int apply) {{
    long bad = 0;
    for (long k = 0; k < count; k++) {{
        const long *q = ptrs + k * NPTR;
        const {T} *h = hyper + k * NHYPER;
        bad += NAME_{T}(n[k], ({T} *)q[0], (const {T} *)q[1], CALL, apply);
    }}
    return bad;
}}
"""


def _rule_source(name: str) -> tuple[str, str]:
    """C source and declarations of one optimizer rule's kernels (dense, row-sparse, lazy rows, many
    parameters); still to be formatted with T and SQRT like SOURCE."""
    slots, hyper, step, write, finite = RULES[name]
    slot_names = [a.strip() for a in slots.split(",") if a.strip()]
    hyper_names = [h.strip() for h in hyper.split(",")]
    args = ", ".join([f"{{T}} *{a}" for a in slot_names] + [f"{{T}} {h}" for h in hyper_names])
    call = ", ".join([f"({{T}} *)q[{2 + i}]" for i in range(len(slot_names))]
                     + [f"h[{i}]" for i in range(len(hyper_names))])

    finite = " + ".join(f"({x} - {x})" for x in finite.split())

    def loop(grad):
        return LOOP.replace("STEP", step.replace("GRAD", grad)).replace("WRITE", write).replace("FINITE", finite)
    prefetch = " ".join(f"__builtin_prefetch({a} + ahead + o, 1);" for a in ["p"] + slot_names)
    src = (RULE.replace("DENSE", loop("g[i]")).replace("ROWS", loop("gr[i - lo]")).replace("ZERO", loop("0"))
           .replace("PREFETCH", prefetch).replace("LAZY_AHEAD", str(LAZY_AHEAD))
           .replace("NAME", name).replace("ARGS", args).replace("CALL", call)
           .replace("NPTR", str(2 + len(slot_names))).replace("NHYPER", str(len(hyper_names))))
    decls = "".join(line[:-len(" {{")] + ";\n" for line in src.splitlines() if line.startswith("long "))
    return src, decls


def render(T: str) -> tuple[str, str]:
    """(C source, cffi declarations) of the library for the C type ``T`` ("float" or "double")."""
    f32 = T == "float"
    rules = [_rule_source(name) for name in RULES]
    fmt = dict(T=T, SQRT="sqrtf" if f32 else "sqrt", rows=row_functions(T))
    source = (SOURCE + "".join(src for src, _ in rules)).format(**fmt)
    return source, (DECLS + "".join(decls for _, decls in rules)).format(T=T)
