"""Hand-written C kernels that are not elementwise, compiled once per dtype like the generated ones:
softmax cross-entropy over rows (forward and gradient), dropout masks and the optimizers' update rules.

Each optimizer rule has two kernels: one for a dense gradient and one for a row-sparse gradient (an
embedding's: sorted unique row indices and their rows) that still updates every row, as the dense rule does
(weight decay and the slots' decay reach rows no batch looked up), without building the dense gradient.
Both run twice per step: apply = 0 counts the non-finite results and writes nothing, apply = 1 writes in
place; both passes compute the same values, so a checked update cannot fail when applied.

This module renders their C source (strings only); minicavs/cpu/library.py compiles, loads and wraps it.
Each replaces several numpy passes (and their temporaries) over large arrays by one or two: a softmax over a
6k-word vocabulary or an Adam step over a 3M-float table is memory-bound. Every kernel has a numpy twin that
stays the reference (ops/nn.py, optim.py) and runs when there is no C compiler; tests compare the two.
Reductions use ``#pragma omp simd reduction`` so they vectorize without ``-ffast-math``.
"""
from __future__ import annotations

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
/* Heights of a graph's vertices (0 without children, else 1 + the children's largest), Kahn's algorithm over
   the parents (pptr, pidx: one entry per edge); vertices on or above a cycle keep -1. The same numbers as
   minicavs/inputs.py's level-by-level numpy loop, in one call however deep the graph. */
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
"""

DECLS = """
void heights_{T}(long n, const long *ptr, const long *pptr, const long *pidx, long *height, long *pending,
                 long *best, long *queue);
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


def render(T: str) -> tuple[str, str]:
    """(C source, cffi declarations) of the library for the C type ``T`` ("float" or "double")."""
    f32 = T == "float"
    rules = [_rule_source(name) for name in RULES]
    fmt = dict(T=T, SQRT="sqrtf" if f32 else "sqrt", prelude=PRELUDE_F32 if f32 else "",
               EXP="mc_expf" if f32 else "exp", LOG="logf" if f32 else "log")
    source = (SOURCE + "".join(src for src, _ in rules)).format(**fmt)
    return source, (DECLS + "".join(decls for _, decls in rules)).format(T=T)
