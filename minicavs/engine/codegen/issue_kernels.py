"""The CUDA kernels the issuing loop (codegen/issue_source.py) launches besides the fused groups: the row kernels of
codegen/cuda.py and the loop's own (zeros, row sums, per-row transposes, batched copies and adds). Strings
only."""
from __future__ import annotations

from .cuda import LOOP, ROW_KERNELS

# the kernels the loop launches, in the order of its ``rk`` handle array (names end in _float / _double)
ISSUE_KERNEL_NAMES = ("zero2d", "sumrows", "transrows", "dropout_rows", "moves", "rowop")
MOVES = 8   # copies and adds one ``moves`` launch makes at most
ROWOP_THREADS = 512   # threads of a ROWOP block at most (one block per row); a power of two
ROWOP_PER_THREAD = 8   # columns per thread before a ROWOP block doubles its threads

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
/* a tree over the block's threads of each one's v (max or sum, through shared memory ``red``), the same for
   every thread: pairs (t, t + half) in a fixed order, so a row's result is the same bits on every run; any
   block size */
__device__ static inline {T} rowop_tree_{T}({T} *red, {T} v, int is_max)
{{
    const unsigned t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (unsigned width = blockDim.x; width > 1; ) {{
        const unsigned half = (width + 1) / 2;
        if (t < width - half) {{
            const {T} a = red[t], b = red[t + half];
            red[t] = is_max ? (b > a ? b : a) : a + b;
        }}
        __syncthreads();
        width = half;
    }}
    return red[0];
}}
/* per row i over its cols numbers (the ROWOP opcode): fn 0 softmax, 1 the cross-entropy of label lab[i] (one
   number), 2 its gradient x g[i], 3 src's one row copied; no lab: the labels are whole numbers labf[i * ldl] of
   the float type (NaN written for a row whose label is no class). One block per row (rows past the grid: the
   block's next, gridDim.x on), its threads over the row's columns (thread t: t, t + blockDim.x, ...), the max
   and the sum of exponentials trees over the block (the loop's rowop_threads: a warp for a short row, at most
   ROWOP_THREADS). The max ignores NaN as the scalar loop did; the sum carries it to the row. Two reduction
   arrays: the max's is rewritten only after every thread has passed the sum's barriers, which follow its read */
extern "C" __global__ void rowop_{T}(long fn, long rows, long cols, const {T} *__restrict__ src, long lds,
                                     const {T} *__restrict__ g, long ldg, const long *__restrict__ lab,
                                     const {T} *__restrict__ labf, long ldl, {T} *__restrict__ dst, long ldd)
{{
    __shared__ {T} red_max[{ROWOP_THREADS}], red_sum[{ROWOP_THREADS}];
    const long t = threadIdx.x, nt = blockDim.x;
    for (long i = blockIdx.x; i < rows; i += gridDim.x) {{
        const {T} *s = src + i * lds;
        {T} *d = dst + i * ldd;
        if (fn == 3) {{ for (long j = t; j < cols; j += nt) d[j] = s[j]; continue; }}
        long y = 0;
        if (fn == 1 || fn == 2) {{   /* (the same for every thread of the row: the branches below are uniform) */
            const {T} v = lab ? ({T})0 : labf[i * ldl];
            y = lab ? lab[i] : (v >= 0 && v < ({T})cols && ({T})(long)v == v) ? (long)v : -1;
            if (y < 0) {{   /* (NaN) */
                for (long j = t; j < (fn == 1 ? 1 : cols); j += nt) d[j] = sqrt(({T})-1);
                continue;
            }}
        }}
        {T} mx = cols ? s[0] : ({T})0, sum = 0;
        for (long j = t; j < cols; j += nt) mx = s[j] > mx ? s[j] : mx;
        mx = rowop_tree_{T}(red_max, mx, 1);
        for (long j = t; j < cols; j += nt) sum += exp(s[j] - mx);
        const {T} lse = mx + log(rowop_tree_{T}(red_sum, sum, 0));
        if (fn == 1) {{ if (t == 0) d[0] = lse - s[y]; continue; }}
        const {T} scale = fn == 2 ? g[i * ldg] : ({T})1;
        for (long j = t; j < cols; j += nt) {{
            {T} e = exp(s[j] - lse) * scale;
            if (fn == 2 && j == y) e -= scale;
            d[j] = e;
        }}
    }}
}}
"""


def issue_kernels(c_type: str) -> str:
    """The CUDA source of every kernel the loop launches for ``c_type`` (the row kernels of codegen/cuda.py and
    the loop's own), one module."""
    return ROW_KERNELS.format(T=c_type, LOOP=LOOP) + ISSUE_KERNELS.format(T=c_type, LOOP=LOOP, MOVES=MOVES,
                                                                    ROWOP_THREADS=ROWOP_THREADS)
