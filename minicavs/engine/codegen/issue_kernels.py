"""The CUDA kernels the issuing loop (codegen/issue_source.py) launches besides the fused groups: the row kernels of
codegen/cuda.py and the loop's own (zeros, row sums, per-row transposes, batched copies and adds). Strings
only."""
from __future__ import annotations

from .cuda import LOOP, ROW_KERNELS

# the kernels the loop launches, in the order of its ``rk`` handle array (names end in _float / _double)
ISSUE_KERNEL_NAMES = ("zero2d", "sumrows", "transrows", "dropout_rows", "moves", "rowop")
MOVES = 8   # copies and adds one ``moves`` launch makes at most

ISSUE_KERNELS = """
extern "C" __global__ void zero2d_{T}(long rows, long cols, {T} *__restrict__ dst, long ldr, long ldc)
{{
    const long n = rows * cols;
    {LOOP} {{
        const long r = i / cols, c = i - r * cols;
        dst[r * ldr + c * ldc] = ({T})0;
    }}
}}
/* dst[c] = the sum of src's rows, one thread per column in row order */
extern "C" __global__ void sumrows_{T}(long rows, long cols, const {T} *__restrict__ src, long lsr, long lsc,
                                       {T} *__restrict__ dst, long ldc)
{{
    const long n = cols;
    {LOOP} {{
        {T} acc = 0;
        for (long r = 0; r < rows; r++) acc += src[r * lsr + i * lsc];
        dst[i * ldc] = acc;
    }}
}}
/* up to MOVES independent copies or adds (``add``) of rows x cols blocks, rows by index or not, one launch:
   the loop's consecutive row moves of a task (gathers, copies, adds, adjoints, puts: codegen/issue_source.py) */
#ifndef MC_MOVES_{T}
#define MC_MOVES_{T}
struct mc_moves_{T} {{
    long n, start[{MOVES} + 1], cols[{MOVES}], add[{MOVES}];
    const {T} *src[{MOVES}];
    long lsr[{MOVES}], lsc[{MOVES}];
    {T} *dst[{MOVES}];
    long ldr[{MOVES}], ldc[{MOVES}];
    const long *sidx[{MOVES}], *didx[{MOVES}];   /* row r reads source row sidx[r] (-1: zeros), writes didx[r] */
}};
#endif
extern "C" __global__ void moves_{T}(mc_moves_{T} m)
{{
    const long n = m.start[m.n];
    {LOOP} {{
        long e = 0;
        while (i >= m.start[e + 1]) e++;
        const long j = i - m.start[e], r = j / m.cols[e], c = j - r * m.cols[e];
        const long sr = m.sidx[e] ? m.sidx[e][r] : r, dr = m.didx[e] ? m.didx[e][r] : r;
        const {T} v = sr < 0 ? ({T})0 : m.src[e][sr * m.lsr[e] + c * m.lsc[e]];
        {T} *d = &m.dst[e][dr * m.ldr[e] + c * m.ldc[e]];
        if (!m.add[e]) *d = v;
        else if (m.didx[e]) atomicAdd(d, v);   /* (rows by index: several may name one row) */
        else *d += v;
    }}
}}
/* per row r: dst's flat row (n x m) = src's (m x n) transposed */
extern "C" __global__ void transrows_{T}(long rows, long m, long n_, const {T} *__restrict__ src, long lds,
                                         {T} *__restrict__ dst, long ldd)
{{
    const long n = rows * m * n_;
    {LOOP} {{
        const long r = i / (m * n_), e = i - r * (m * n_), a = e / n_, b = e - a * n_;
        dst[r * ldd + b * m + a] = src[r * lds + a * n_ + b];
    }}
}}
/* per row i over its cols numbers (the ROWOP opcode): fn 0 softmax, 1 the cross-entropy of label lab[i] (one
   number), 2 its gradient x g[i], 3 src's one row copied; no lab: the labels are whole numbers labf[i * ldl] of
   the float type (NaN written for a row whose label is no class) */
extern "C" __global__ void rowop_{T}(long fn, long rows, long cols, const {T} *__restrict__ src, long lds,
                                     const {T} *__restrict__ g, long ldg, const long *__restrict__ lab,
                                     const {T} *__restrict__ labf, long ldl, {T} *__restrict__ dst, long ldd)
{{
    const long n = rows;
    {LOOP} {{
        const {T} *s = src + i * lds;
        {T} *d = dst + i * ldd;
        if (fn == 3) {{ for (long j = 0; j < cols; j++) d[j] = s[j]; continue; }}
        long y = 0;
        if (fn == 1 || fn == 2) {{
            const {T} v = lab ? ({T})0 : labf[i * ldl];
            y = lab ? lab[i] : (v >= 0 && v < ({T})cols && ({T})(long)v == v) ? (long)v : -1;
            if (y < 0) {{ for (long j = 0; j < (fn == 1 ? 1 : cols); j++) d[j] = sqrt(({T})-1); continue; }}   /* (NaN) */
        }}
        {T} mx = cols ? s[0] : ({T})0, sum = 0;
        for (long j = 1; j < cols; j++) mx = s[j] > mx ? s[j] : mx;
        for (long j = 0; j < cols; j++) sum += exp(s[j] - mx);
        const {T} lse = mx + log(sum);
        if (fn == 1) {{ d[0] = lse - s[y]; continue; }}
        const {T} scale = fn == 2 ? g[i * ldg] : ({T})1;
        for (long j = 0; j < cols; j++) d[j] = exp(s[j] - lse) * scale;
        if (fn == 2) d[y] -= scale;
    }}
}}
"""


def issue_kernels(c_type: str) -> str:
    """The CUDA source of every kernel the loop launches for ``c_type`` (the row kernels of codegen/cuda.py and
    the loop's own), one module."""
    return ROW_KERNELS.format(T=c_type, LOOP=LOOP) + ISSUE_KERNELS.format(T=c_type, LOOP=LOOP, MOVES=MOVES)
