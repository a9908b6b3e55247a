"""C source of the C runner's interpreter: strings only (minicavs/cpu/interpreter.py compiles and loads it).

The interpreter runs a compact instruction stream (minicavs/engine/instructions.py builds it): one C call
runs every task of a batch. Each vertex kind has a *template* (its F or ∂F steps as instructions whose
addresses are relative to the task's rows); the call expands template x task table, so no Python runs per
task. Values live in registers (a pointer, a row stride, a transposed flag and the buffer the pointer points
into); instructions bind registers to rows of buffers, move rows, and run GEMMs (BLAS, by function pointer),
fused kernels (by function pointer, through a uniform wrapper) and the small loops in between.

Instruction layout (``WIDTH`` int64 each): ``op, a0 .. a{WIDTH-2}``; the meaning of a0.. per opcode is in
``OPCODES`` (instructions.py renders them by these names). A dimension given as -k means k times the task's row count.
With ``prof`` (not NULL) the call adds the nanoseconds spent in each opcode to prof[opcode] and the whole call's to
prof[len(OPCODES)] (two clock reads per instruction: for profiling only).
With ``check`` set every address an instruction computes is checked against its buffer's size first; a failure
returns its instruction index and operand instead of touching memory.
Streaming (two calls on two threads, cpu/c_runner.py): the eager call (``role`` 2) stores into ``sync[0]`` the
chunks it has finished after each row of its table; the main call (``role`` 1) runs row t once ``sync[0]``
reaches t + 1 (rows past the ``nwait`` chunks: all of them), spinning with ``sched_yield`` and failing with
operand -4 when ``sync[1]`` says the eager call failed. ``role`` 0: no second stream.
"""
from __future__ import annotations

import math
import re
import textwrap

from ...core.limits import MAX_ARGS, MAX_REGISTERS  # noqa: F401  (re-exported: the lowering's limits)
from .packed_gemm import PACKED_DECLS, packed_source
from .row_source import row_functions
from .opcodes import OPCODE_TABLE, OPCODES, OPERAND_KINDS, OPS, SPAN_HELPERS, checked, checks  # noqa: F401

WIDTH = 10

def matrix_shape(node) -> tuple[int, int]:
    """A value as the machine's registers see it, a matrix: rows (-1: the task's rows, for a per-row value)
    and columns. A per-row value of shape (None, *vshape) is rows of prod(vshape) numbers; a static of shape
    (r, *rest), r rows of prod(rest); (c,) one row; () one number (row-major, as numpy lays them out)."""
    if node.has_rows:
        return -1, math.prod(node.vshape)
    shape = node.shape
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(shape[1:])

# Per fused-kernel argument: how many rows it spans (full: the rows, row: 1 with ld 0, col: rows x 1, scalar).
ARG_KINDS = {"full": 0, "row": 1, "col": 2, "scalar": 3}

INTERPRETER_SOURCE = r"""
#define _POSIX_C_SOURCE 199309L
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <sched.h>
{PACKED}
{ROWS}
/* Products of at most this many multiply-adds (m n k) run in OpenBLAS's small-matrix kernels (its SkylakeX
   cores), larger ones through its packing path, which took 1.2-2.6x the time of two halves at a few rows past the
   bound; such a product, up to twice the rows the bound holds, runs in even row blocks under it. Set once a
   process by cpu/interpreter.py (0: never). */
static int64_t small_mnk = 0;
void mc_set_small_mnk(int64_t bound) {{ small_mnk = bound; }}

typedef {T} T;
typedef struct {{ T *p; int64_t ld; int64_t trans; int64_t buf; }} reg_t;
typedef void (*kernel_t)(long rows, long cols, void *const *ptrs, const long *lds);
typedef void (*gemm64_t)(int, int, int, int64_t, int64_t, int64_t, T, const T *, int64_t, const T *, int64_t,
                         T, T *, int64_t);
typedef void (*gemm32_t)(int, int, int, int, int, int, T, const T *, int, const T *, int, T, T *, int);
typedef void (*gemv64_t)(int, int, int64_t, int64_t, T, const T *, int64_t, const T *, int64_t, T, T *, int64_t);
typedef void (*gemv32_t)(int, int, int, int, T, const T *, int, const T *, int, T, T *, int);

enum {{ {ENUM} }};
#define W {WIDTH}
#define MAXARGS {MAX_ARGS}
#define MAXREGS {MAX_REGISTERS}

/* buffers: base pointers, sizes in elements, row strides, transposed flags, element size (T or int64) */
typedef struct {{
    const int64_t *base, *size, *ld, *trans;
}} buftab_t;

static int out_of(const buftab_t *b, int64_t buf, const void *p, int64_t rows, int64_t cols, int64_t ld,
                  int64_t trans, int64_t esz) {{
    if (buf < 0) return 1;
    if (rows <= 0 || cols <= 0) return 0;
    const char *lo = (const char *)b->base[buf];
    const char *hi = lo + b->size[buf] * esz;
    const char *first = (const char *)p;
    int64_t r = trans ? cols : rows, c = trans ? rows : cols;
    if (ld < 0) return 1;
    const char *last = first + ((r - 1) * ld + (c - 1)) * esz;
    return first < lo || last >= hi;
}}

{SPAN_HELPERS}
static inline uint64_t mc_mix(uint64_t z) {{   /* SplitMix64's finaliser (minicavs/core/random.py) */
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ULL; z ^= z >> 27; z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}}

#define FAIL(operand) do {{ err[0] = 1; err[1] = t; err[2] = pc; err[3] = (operand); return 1; }} while (0)
#define DIM(x) ((x) < 0 ? -(x) * bs : (x))
#define CHECKR(reg, rows, cols, operand) do {{ if (check && (\
    out_of(&B, R[reg].buf, R[reg].p, rows, cols, R[reg].ld, R[reg].trans, sizeof(T)))) FAIL(operand); }} while (0)
#define REGOK(r, operand) do {{ if (check && ((r) < 0 || (r) >= nregs)) FAIL(operand); }} while (0)
#define BUFOK(b, operand) do {{ if (check && ((b) < 0 || (b) >= nbufs)) FAIL(operand); }} while (0)
/* what the cases both C loops share (register_cases) read and write through */
#define SET(r, ptr, ld_, trans_, buf_) do {{ R[r].p = (ptr); R[r].ld = (ld_); R[r].trans = (trans_); \
    R[r].buf = (buf_); }} while (0)
#define FBASE(b) ((T *)base[b])
#define BSIZE(b) (size[b])
#define BLD(b) (ld[b])
#define BTRANS(b) (trans[b])
#define CHECKING check
#define IVALUES(b) ((const int64_t *)base[b])
#define IWANT 1
#define KERNELOK(k, operand) do {{ if ((k) < 0 || (k) >= nkernels) FAIL(operand); }} while (0)
#define FOREST forest
#define SCRATCH_BUF scratch_buf
#define PRED(b) ((const T *)base[b])
#define COUNTS(b) ((const int64_t *)base[b])
#define READ1(r, name) const double name = (double)R[r].p[0]

int run_{T}(const int64_t *code, const int64_t *pool, const int64_t *kinds, int64_t nkinds,
            const int64_t *tasks, int64_t ntasks, int64_t tw,
            const int64_t *base, const int64_t *size, const int64_t *ld, const int64_t *trans, int64_t nbufs,
            int64_t scratch_buf, int64_t max_bs, int64_t nregs, const int64_t *kernels, int64_t nkernels,
            int64_t gemm, int64_t gemv, int64_t ilp64, int64_t forest, int64_t check, int64_t *err, int64_t *prof,
            const int64_t *twin, const int64_t *packed, int64_t tmp_off, int64_t tmp_rows, int64_t tmp_cols,
            int64_t *sync, int64_t role, int64_t nwait) {{
    buftab_t B = {{base, size, ld, trans}};
    struct timespec t0, t1;
    int64_t start_ns = 0;
    if (prof) {{ clock_gettime(CLOCK_MONOTONIC, &t0); start_ns = t0.tv_sec * 1000000000LL + t0.tv_nsec; }}
    reg_t R[MAXREGS];
    void *ptrs[MAXARGS];
    long lds[MAXARGS];
    int64_t t = -1, pc = -1;
    int64_t lt[MAXDEPTH] = {{0}}, lim[MAXDEPTH] = {{0}};   /* per loop depth: its counter and trip count */
    if (nregs > MAXREGS) FAIL(-1);
    for (int64_t i = 0; i < nregs; i++) {{ R[i].p = 0; R[i].ld = 0; R[i].trans = 0; R[i].buf = -1; }}
    T *scratch = (T *)base[scratch_buf];
    for (t = 0; t < ntasks; t++) {{
        if (role == 1 && nwait > 0) {{   /* the main stream: row t waits for eager chunk t (after them, for all) */
            const int64_t need = t < nwait ? t + 1 : nwait;
            while (__atomic_load_n(&sync[0], __ATOMIC_ACQUIRE) < need) {{
                if (__atomic_load_n(&sync[1], __ATOMIC_ACQUIRE)) FAIL(-4);   /* the eager stream failed */
                sched_yield();
            }}
        }}
        const int64_t *task = tasks + t * tw;
        const int64_t kind_id = task[0], task_row = task[1], task_bs = task[2], scatter_row = task[3], catfirst = task[4];
        int64_t bs = task_bs;   /* the rows an instruction runs over: a loop's active rows (ROWS), else the task's */
        if (check && (kind_id < 0 || kind_id >= nkinds || bs < 0 || bs > max_bs)) FAIL(-2);
        const int64_t begin = kinds[2 * kind_id], end = kinds[2 * kind_id + 1];
        for (pc = begin; pc < end; pc++) {{
            const int64_t *in = code + pc * W;
            const int64_t *a = in + 1;
            if (prof) clock_gettime(CLOCK_MONOTONIC, &t0);
            switch (in[0]) {{
            case GATHER: {{
                @CHECKS GATHER@
                @VIEW GATHER@
                const int64_t width = a[2];
                const T *src = (const T *)base[a[1]];
                const int64_t *idx = (const int64_t *)base[a[3]] + task_row;
                T *dst = scratch + a[6] * task_bs;
                for (int64_t r = 0; r < bs; r++) memcpy(dst + r * width, src + idx[r] * width, (size_t)width * sizeof(T));
                R[a[0]].p = dst; R[a[0]].ld = width; R[a[0]].trans = 0; R[a[0]].buf = scratch_buf;
                break;
            }}
            case TAKE: {{
                @CHECKS TAKE@
                const int64_t width = a[2], cols = a[4];
                const T *src = (const T *)base[a[1]];
                const int64_t *idx = (const int64_t *)base[a[3]] + task_row;
                if (cols == width && bs > 0 && idx[0] >= 0) {{   /* whole rows, consecutive: a view (a pull of
                                                                    a block's leaves in order), no copy */
                    int64_t r = 1;
                    while (r < bs && idx[r] == idx[0] + r) r++;
                    if (r == bs) {{ SET(a[0], FBASE(a[1]) + idx[0] * width, width, 0, a[1]); break; }}
                }}
                T *dst = scratch + a[5] * task_bs;
                for (int64_t r = 0; r < bs; r++) {{
                    if (idx[r] == -1) {{ memset(dst + r * cols, 0, (size_t)cols * sizeof(T)); continue; }}
                    memcpy(dst + r * cols, src + idx[r] * width, (size_t)cols * sizeof(T));
                }}
                R[a[0]].p = dst; R[a[0]].ld = cols; R[a[0]].trans = 0; R[a[0]].buf = scratch_buf;
                break;
            }}
            case TAKETO: {{
                @CHECKS TAKETO@
                const int64_t width = a[2], cols = a[4], col = a[5];
                const T *src = (const T *)base[a[1]];
                const int64_t *idx = (const int64_t *)base[a[3]] + task_row;
                T *dst = R[a[0]].p;
                const int64_t ldd = R[a[0]].ld;
                for (int64_t r = 0; r < bs; r++) {{
                    if (idx[r] == -1) {{ memset(dst + r * ldd, 0, (size_t)cols * sizeof(T)); continue; }}
                    memcpy(dst + r * ldd, src + idx[r] * width + col, (size_t)cols * sizeof(T));
                }}
                break;
            }}
            case SROWS: {{
                @CHECKS SROWS@
                @VIEW SROWS@
                const int64_t col = a[2], ldb = a[3], cols = a[5];
                T *dst = scratch + a[6] * task_bs;
                if (a[7]) {{
                    const T *src = (const T *)base[a[1]];
                    const int64_t *idx = (const int64_t *)base[a[4]] + task_row;
                    for (int64_t r = 0; r < bs; r++) memcpy(dst + r * cols, src + idx[r] * ldb + col, (size_t)cols * sizeof(T));
                }}
                R[a[0]].p = dst; R[a[0]].ld = cols; R[a[0]].trans = 0; R[a[0]].buf = scratch_buf;
                break;
            }}
            case SPUT: {{
                @CHECKS SPUT@
                const int64_t col = a[1], ldb = a[2], cols = a[5];
                if (scatter_row >= 0 && !a[6]) break;   /* SROWS bound a view: the steps wrote the rows in place */
                T *dst = (T *)base[a[0]];
                const T *s = R[a[4]].p;
                const int64_t lds_ = R[a[4]].ld;
                if (scatter_row >= 0) {{   /* a copy into the offset's rows (as BIND and COPY) */
                    if (ldb == cols && lds_ == cols) {{
                        memmove(dst + scatter_row * ldb + col, s, (size_t)(bs * cols) * sizeof(T));
                        break;
                    }}
                    for (int64_t r = 0; r < bs; r++)
                        memmove(dst + (scatter_row + r) * ldb + col, s + r * lds_, (size_t)cols * sizeof(T));
                    break;
                }}
                const int64_t *idx = (const int64_t *)base[a[3]] + task_row;
                for (int64_t r = 0; r < bs; r++) memcpy(dst + idx[r] * ldb + col, s + r * lds_, (size_t)cols * sizeof(T));
                break;
            }}
{REGISTER_CASES}
            case STEPS:
                @CHECKS STEPS@
                R[a[0]].p[0] = (T)lt[a[1]];   /* a while_loop's steps run (its counter after its ENDLOOP) */
                break;
            case GEMM: {{
                @CHECKS GEMM@
                const int64_t m = DIM(a[3]), n = DIM(a[4]), k = DIM(a[5]);
                if (m == 0 || n == 0) break;
                const reg_t *A = &R[a[1]], *Bm = &R[a[2]];
                reg_t *C = &R[a[0]];
                /* BLAS wants ld >= the row length; a one-row operand's stride is never used */
                const int64_t need_a = A->trans ? m : k, need_b = Bm->trans ? k : n;
                const int64_t lda = A->ld < need_a ? need_a : A->ld, ldb = Bm->ld < need_b ? need_b : Bm->ld;
                const int64_t ldc = C->ld < n ? n : C->ld;
                const int64_t acc = a[6] == -2;   /* c += a . b: BLAS's beta 1 */
                if (k == 0) {{
                    for (int64_t r = 0; r < m && !acc; r++) memset(C->p + r * C->ld, 0, (size_t)n * sizeof(T));
                }} else if (MC_PACKED && !acc && m >= 2 && MC_PACKS(m, n, k) && !A->trans && Bm->buf >= 0 && packed[Bm->buf]
                           && Bm->p == (T *)base[Bm->buf] && Bm->trans == trans[Bm->buf] && Bm->ld == ld[Bm->buf]
                           && k == packed[nbufs + Bm->buf] && n == packed[2 * nbufs + Bm->buf]) {{
                    /* the static as packed for this run (packed_gemm.py), the bias added on the way out */
                    mc_gemm_packed(m, n, k, A->p, lda, (const T *)packed[Bm->buf], C->p, ldc, a[6] >= 0 ? R[a[6]].p : 0);
                    break;
                }} else if (m == 1 && gemv) {{
                    /* one row: c = op(B)^T a, B read as stored (k x n, or n x k when transposed) */
                    const int64_t inca = A->trans ? (A->ld < 1 ? 1 : A->ld) : 1;
                    const int64_t rows_b = Bm->trans ? n : k, cols_b = Bm->trans ? k : n;
                    if (ilp64)
                        ((gemv64_t)gemv)(101, Bm->trans ? 111 : 112, rows_b, cols_b, (T)1, Bm->p, ldb, A->p, inca,
                                         (T)acc, C->p, 1);
                    else
                        ((gemv32_t)gemv)(101, Bm->trans ? 111 : 112, (int)rows_b, (int)cols_b, (T)1, Bm->p, (int)ldb,
                                         A->p, (int)inca, (T)acc, C->p, 1);
                }} else if (!acc && m >= 2 && m <= tmp_rows && n <= tmp_cols && !Bm->trans && Bm->buf >= 0 && twin[Bm->buf]
                           && Bm->p == (T *)base[Bm->buf]) {{
                    /* few rows times a wide static B: C^T = B^T A^T, B^T from the static's contiguous transposed
                       twin (n x k), into the scratch arena's tail, then transposed into C: OpenBLAS takes 20-45% less
                       time at 2-32 rows this way (the few rows as its M dimension; cpu/c_runner.py's SMALL_M_ROWS) */
                    const T *bt = (const T *)twin[Bm->buf];
                    const int64_t ldt = size[Bm->buf] / ld[Bm->buf];   /* the twin's row: all of B's rows */
                    T *tmp = scratch + tmp_off;
                    if (ilp64)
                        ((gemm64_t)gemm)(101, 111, A->trans ? 111 : 112, n, m, k, (T)1, bt, ldt, A->p, lda, (T)0, tmp, m);
                    else
                        ((gemm32_t)gemm)(101, 111, A->trans ? 111 : 112, (int)n, (int)m, (int)k, (T)1, bt, (int)ldt,
                                         A->p, (int)lda, (T)0, tmp, (int)m);
                    for (int64_t j0 = 0; j0 < n; j0 += 64) {{
                        const int64_t j1 = j0 + 64 < n ? j0 + 64 : n;
                        for (int64_t r = 0; r < m; r++) {{
                            T *c = C->p + r * ldc;
                            for (int64_t j = j0; j < j1; j++) c[j] = tmp[j * m + r];
                        }}
                    }}
                }} else if (small_mnk && !A->trans && m * n * k > small_mnk && small_mnk / (n * k) >= 2
                           && m <= 2 * (small_mnk / (n * k))) {{
                    /* a few rows past the small-matrix bound: even row blocks under it (small_mnk above) */
                    const int64_t per = small_mnk / (n * k), parts = (m + per - 1) / per, step = (m + parts - 1) / parts;
                    for (int64_t r0 = 0; r0 < m; r0 += step) {{
                        const int64_t rows = m - r0 < step ? m - r0 : step;
                        if (ilp64)
                            ((gemm64_t)gemm)(101, 111, Bm->trans ? 112 : 111, rows, n, k, (T)1, A->p + r0 * lda, lda,
                                             Bm->p, ldb, (T)0, C->p + r0 * ldc, ldc);
                        else
                            ((gemm32_t)gemm)(101, 111, Bm->trans ? 112 : 111, (int)rows, (int)n, (int)k, (T)1,
                                             A->p + r0 * lda, (int)lda, Bm->p, (int)ldb, (T)0, C->p + r0 * ldc, (int)ldc);
                    }}
                }} else if (ilp64) {{
                    ((gemm64_t)gemm)(101, A->trans ? 112 : 111, Bm->trans ? 112 : 111, m, n, k, (T)1, A->p, lda,
                                     Bm->p, ldb, (T)acc, C->p, ldc);
                }} else {{
                    ((gemm32_t)gemm)(101, A->trans ? 112 : 111, Bm->trans ? 112 : 111, (int)m, (int)n, (int)k,
                                     (T)1, A->p, (int)lda, Bm->p, (int)ldb, (T)acc, C->p, (int)ldc);
                }}
                if (a[6] >= 0) {{
                    const T *b = R[a[6]].p;
                    for (int64_t r = 0; r < m; r++) {{
                        T *c = C->p + r * C->ld;
                        #pragma omp simd
                        for (int64_t j = 0; j < n; j++) c[j] += b[j];
                    }}
                }}
                break;
            }}
            case FUSED: {{
                @CHECKS FUSED@
                const int64_t nargs = a[1], rows = DIM(a[2]), cols = a[3];
                if (nargs > MAXARGS) FAIL(1);   /* (ptrs and lds hold MAXARGS) */
                if (rows == 0 || cols == 0) break;
                const int64_t *args = pool + a[4];
                for (int64_t i = 0; i < nargs; i++) {{
                    const int64_t r = args[2 * i];
                    ptrs[i] = R[r].p; lds[i] = (long)R[r].ld;
                }}
                ((kernel_t)kernels[a[0]])((long)rows, (long)cols, ptrs, lds);
                break;
            }}
            case ROWPERM: {{
                @CHECKS ROWPERM@
                const int64_t cols = a[3], *idx = (const int64_t *)base[a[2]] + task_row;
                for (int64_t r = 0; r < bs; r++)
                    memcpy(R[a[0]].p + r * R[a[0]].ld, R[a[1]].p + idx[r] * R[a[1]].ld, (size_t)cols * sizeof(T));
                break;
            }}
            case COPY: case ADD: {{
                @CHECKS COPY@
                const int64_t rows = DIM(a[2]), cols = a[3];
                if (in[0] == COPY && R[a[0]].ld == cols && R[a[1]].ld == cols) {{   /* both contiguous: one move */
                    memmove(R[a[0]].p, R[a[1]].p, (size_t)(rows * cols) * sizeof(T));
                    break;
                }}
                for (int64_t r = 0; r < rows; r++) {{
                    T *d = R[a[0]].p + r * R[a[0]].ld;
                    const T *s = R[a[1]].p + r * R[a[1]].ld;
                    if (in[0] == COPY) memmove(d, s, (size_t)cols * sizeof(T));
                    else {{
                        #pragma omp simd
                        for (int64_t j = 0; j < cols; j++) d[j] += s[j];
                    }}
                }}
                break;
            }}
            case ZERO: {{
                @CHECKS ZERO@
                const int64_t rows = DIM(a[1]), cols = a[2];
                for (int64_t r = 0; r < rows; r++) memset(R[a[0]].p + r * R[a[0]].ld, 0, (size_t)cols * sizeof(T));
                break;
            }}
            case SUMROWS: {{
                @CHECKS SUMROWS@
                const int64_t rows = DIM(a[2]), cols = a[3];
                T *d = R[a[0]].p;
                for (int64_t j = 0; j < cols; j++) d[j] = 0;
                for (int64_t r = 0; r < rows; r++) {{
                    const T *s = R[a[1]].p + r * R[a[1]].ld;
                    #pragma omp simd
                    for (int64_t j = 0; j < cols; j++) d[j] += s[j];
                }}
                break;
            }}
            case PUT: {{
                @CHECKS PUT@
                const int64_t width = a[1], cols = a[4];
                T *dst = (T *)base[a[0]];
                const int64_t *idx = (const int64_t *)base[a[2]] + task_row;
                for (int64_t r = 0; r < bs; r++)
                    memcpy(dst + idx[r] * width, R[a[3]].p + r * R[a[3]].ld, (size_t)cols * sizeof(T));
                break;
            }}
            case ADJ: {{
                @CHECKS ADJ@
                const int64_t width = a[1], cols = a[6];
                T *dst = (T *)base[a[0]];
                const int64_t start = task[5 + 2 * a[3]], step = task[6 + 2 * a[3]];
                const T *src = R[a[5]].p;
                const int64_t lds_ = R[a[5]].ld;
                if (a[4] && step >= 0) {{
                    if (step == 0) break;   /* only the sentinel row: its gradient is discarded */
                    for (int64_t r = 0; r < bs; r++) {{
                        T *d = dst + (start + step * r) * width;
                        const T *s = src + r * lds_;
                        if (forest) memcpy(d, s, (size_t)cols * sizeof(T));
                        else {{
                            #pragma omp simd
                            for (int64_t j = 0; j < cols; j++) d[j] += s[j];
                        }}
                    }}
                    break;
                }}
                const int64_t *idx = (const int64_t *)base[a[2]] + task_row;
                for (int64_t r = 0; r < bs; r++) {{
                    T *d = dst + idx[r] * width;
                    const T *s = src + r * lds_;
                    if (forest) memcpy(d, s, (size_t)cols * sizeof(T));
                    else {{
                        #pragma omp simd
                        for (int64_t j = 0; j < cols; j++) d[j] += s[j];
                    }}
                }}
                break;
            }}
            case GACC: {{
                @CHECKS GACC@
                const int64_t rows = DIM(a[2]), cols = a[3];
                T *d = (T *)base[a[0]];
                for (int64_t r = 0; r < rows; r++) {{
                    const T *s = R[a[1]].p + r * R[a[1]].ld;
                    #pragma omp simd
                    for (int64_t j = 0; j < cols; j++) d[r * cols + j] += s[j];
                }}
                break;
            }}
            case DROPOUT: {{
                @CHECKS DROPOUT@
                const int64_t cols = a[2];
                const uint64_t *keys = (const uint64_t *)base[a[3]] + task_row;
                const int64_t *e = (const int64_t *)base[a[4]] + 3 * a[5];
                const uint64_t h = (uint64_t)e[0], th = (uint64_t)e[1], golden = 0x9E3779B97F4A7C15ULL;
                double scale_d;
                memcpy(&scale_d, &e[2], sizeof scale_d);
                const T scale = (T)scale_d;
                if (th == 0 && scale == (T)1) {{   /* keeps every value as it is (inference, p = 0): no hashing */
                    for (int64_t r = 0; r < bs; r++) {{
                        T *d = R[a[0]].p + r * R[a[0]].ld;
                        const T *s = R[a[1]].p + r * R[a[1]].ld;
                        if (d != s) memmove(d, s, (size_t)cols * sizeof(T));
                    }}
                    break;
                }}
                for (int64_t r = 0; r < bs; r++) {{
                    const uint64_t hr = mc_mix(h ^ keys[r]) + golden;
                    T *d = R[a[0]].p + r * R[a[0]].ld;
                    const T *s = R[a[1]].p + r * R[a[1]].ld;
                    for (int64_t c = 0; c < cols; c++) {{
                        const uint64_t z = mc_mix(hr ^ (uint64_t)c) + golden;
                        d[c] = s[c] * ((z >> 40) >= th ? scale : (T)0);
                    }}
                }}
                break;
            }}
            case ROWOP: {{
                @CHECKS ROWOP@
                const int64_t fn = a[0], cols = a[5], labelled = fn == 1 || fn == 2;
                if (fn < 0 || fn > 3) FAIL(0);
                const int64_t *lab = labelled && !a[6] ? (const int64_t *)base[a[4]] + task_row : 0;
                const reg_t *lr = labelled && a[6] ? &R[a[4]] : 0;   /* (labels in a register: whole numbers) */
                for (int64_t r = 0; r < bs; r++) {{
                    T *d = R[a[1]].p + r * R[a[1]].ld;
                    const T *s = R[a[2]].p + (fn == 3 ? 0 : r * R[a[2]].ld);
                    if (fn == 3) {{ memmove(d, s, (size_t)cols * sizeof(T)); continue; }}
                    int64_t y = 0;
                    if (lab) y = lab[r];
                    if (lr) {{
                        const T v = lr->p[r * lr->ld];
                        if (!(v >= 0 && v < (T)cols)) FAIL(4);
                        y = (int64_t)v;
                        if ((T)y != v) FAIL(4);
                    }}
                    if (labelled && (y < 0 || y >= cols)) FAIL(4);
                    row_softmax_fn(fn, cols, s, r + 1 < bs ? s + R[a[2]].ld : s, y,
                                   fn == 2 ? R[a[3]].p[r * R[a[3]].ld] : (T)0, d);
                }}
                break;
            }}
            case BMM: {{
                @CHECKS BMM@
                const int64_t m = a[3], n = a[4], k = a[5], arows = a[6], brows = a[7];
                if (bs == 0 || m == 0 || n == 0) break;
                const reg_t *A = &R[a[1]], *Bm = &R[a[2]];
                const reg_t *C = &R[a[0]];
                /* one row's operand: stored row-major with row stride ld (transposed: stored k x m / n x k) */
                const int64_t ta = arows ? 0 : A->trans, tb = brows ? 0 : Bm->trans;
                const int64_t lda = arows ? k : A->ld, ldb = brows ? n : Bm->ld;
                const int64_t astep = arows ? A->ld : 0, bstep = brows ? Bm->ld : 0;
                if (k == 0) {{
                    for (int64_t r = 0; r < bs; r++) memset(C->p + r * C->ld, 0, (size_t)(m * n) * sizeof(T));
                    break;
                }}
                if (gemm && arows && !brows && A->ld == m * k && C->ld == m * n) {{
                    /* every row's a side by side is one (bs m) x k matrix: one GEMM by the shared b */
                    const int64_t need = tb ? k : n, ldb_ = ldb < need ? need : ldb;
                    if (ilp64)
                        ((gemm64_t)gemm)(101, 111, tb ? 112 : 111, bs * m, n, k, (T)1, A->p, k, Bm->p, ldb_, (T)0,
                                         C->p, n);
                    else
                        ((gemm32_t)gemm)(101, 111, tb ? 112 : 111, (int)(bs * m), (int)n, (int)k, (T)1, A->p, (int)k,
                                         Bm->p, (int)ldb_, (T)0, C->p, (int)n);
                    break;
                }}
                if (gemm && m * n * k > 4096) {{   /* larger products: BLAS per row */
                    const int64_t need_a = ta ? m : k, need_b = tb ? k : n;
                    const int64_t lda_ = lda < need_a ? need_a : lda, ldb_ = ldb < need_b ? need_b : ldb;
                    for (int64_t r = 0; r < bs; r++) {{
                        const T *ap = A->p + r * astep, *bp = Bm->p + r * bstep;
                        T *cp = C->p + r * C->ld;
                        if (ilp64)
                            ((gemm64_t)gemm)(101, ta ? 112 : 111, tb ? 112 : 111, m, n, k, (T)1, ap, lda_, bp, ldb_,
                                             (T)0, cp, n);
                        else
                            ((gemm32_t)gemm)(101, ta ? 112 : 111, tb ? 112 : 111, (int)m, (int)n, (int)k, (T)1, ap,
                                             (int)lda_, bp, (int)ldb_, (T)0, cp, (int)n);
                    }}
                    break;
                }}
                /* small products (H of 3 to 16, or a matrix times a vector): a loop per row beats a BLAS call's
                   overhead; a few columns (B.a, A.b: n = 1) as dot products, more as rows of b scaled and added */
                const int64_t sai = ta ? 1 : lda, sap = ta ? lda : 1, sbp = tb ? 1 : ldb, sbj = tb ? ldb : 1;
                for (int64_t r = 0; r < bs; r++) {{
                    const T *ap = A->p + r * astep, *bp = Bm->p + r * bstep;
                    T *cp = C->p + r * C->ld;
                    for (int64_t i = 0; i < m; i++) {{
                        T *ci = cp + i * n;
                        const T *ai = ap + i * sai;
                        if (n < 4) {{
                            for (int64_t j = 0; j < n; j++) {{
                                const T *bj = bp + j * sbj;
                                T sum = 0;
                                #pragma omp simd reduction(+:sum)
                                for (int64_t p = 0; p < k; p++) sum += ai[p * sap] * bj[p * sbp];
                                ci[j] = sum;
                            }}
                            continue;
                        }}
                        for (int64_t j = 0; j < n; j++) ci[j] = 0;
                        for (int64_t p = 0; p < k; p++) {{
                            const T aip = ai[p * sap];
                            const T *bpp = bp + p * sbp;
                            #pragma omp simd
                            for (int64_t j = 0; j < n; j++) ci[j] += aip * bpp[j * sbj];
                        }}
                    }}
                }}
                break;
            }}
            case TRANSROWS: {{
                @CHECKS TRANSROWS@
                const int64_t m = a[2], n = a[3];
                for (int64_t r = 0; r < bs; r++) {{
                    T *d = R[a[0]].p + r * R[a[0]].ld;
                    const T *s = R[a[1]].p + r * R[a[1]].ld;
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < n; j++) d[j * m + i] = s[i * n + j];
                }}
                break;
            }}
            default:
                FAIL(-3);
            }}
            if (prof) {{
                clock_gettime(CLOCK_MONOTONIC, &t1);
                prof[in[0]] += (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
            }}
        }}
        if (role == 2) __atomic_store_n(&sync[0], t + 1, __ATOMIC_RELEASE);   /* the eager stream: chunk t done */
    }}
    if (prof) {{ clock_gettime(CLOCK_MONOTONIC, &t1); prof[NOPCODES] += t1.tv_sec * 1000000000LL + t1.tv_nsec - start_ns; }}
    err[0] = 0;
    return 0;
}}

"""


def register_cases(dst_ok: str, indent: int) -> str:
    """The C cases of the instructions that only point a register or move pc (BIND, STATIC, SCRATCH, CATVIEW,
    SKIP_IF_CAT, BRANCH, IF, JUMP, LOOP, LOOPN, LOOPR, ENDLOOP, WHILE, ROWS; COLS, STEPCOLS: a column block, ALIAS,
    TRANSPOSE, FLAT: a stacked value's steps as rows): one text for the interpreter and the CUDA issuing loop,
    over the macros each defines (SET, FBASE, BLD, BTRANS, FOREST, SCRATCH_BUF, PRED, COUNTS, READ1, and the
    checks' macros), each checking a pointed register with its own ``dst_ok``; indented by ``indent`` spaces."""
    return textwrap.indent(checked(REGISTER_CASES, dst_ok), " " * indent)


REGISTER_CASES = """case NOP: break;
case BIND: {
    @CHECKS BIND@
    SET(a[0], FBASE(a[1]) + BASEROW(a[2]) * a[4] + a[3], a[4], 0, a[1]);
    break;
}
case STATIC:
    @CHECKS STATIC@
    SET(a[0], FBASE(a[1]), BLD(a[1]), BTRANS(a[1]), a[1]);
    break;
case SCRATCH:
    @CHECKS SCRATCH@
    SET(a[0], scratch + a[1] * task_bs, a[2], 0, SCRATCH_BUF);   /* (laid out by the task's rows) */
    break;
case CATVIEW:
    @CHECKS CATVIEW@
    if (catfirst >= 0 && (!a[4] || FOREST)) SET(a[0], FBASE(a[1]) + catfirst * a[2], a[3] * a[2], 0, a[1]);
    break;
case SKIP_IF_CAT:
    @CHECKS SKIP_IF_CAT@
    if (catfirst >= 0 && (!a[1] || FOREST)) pc += a[0];
    break;
case BRANCH:
    @CHECKS BRANCH@
    if (PRED(a[0])[0] == 0) pc += a[1];   /* a cond's pred 0: skip the then-branch and its JUMP (NaN is true) */
    break;
case JUMP:
    @CHECKS JUMP@
    pc += a[0];
    break;
case LOOP:
    @CHECKS LOOP@
    lt[a[2]] = 0; lim[a[2]] = a[0];
    if (a[0] == 0) pc += a[1];   /* no trips: skip the body and its ENDLOOP */
    break;
case LOOPN: {
    @CHECKS LOOPN@
    const int64_t trips = COUNTS(a[0])[0];   /* read where the loop runs (the CUDA loop: its host copy) */
    if (trips < 0 || trips > a[1]) FAIL(0);   /* more than the loop's memory holds, or negative: refused */
    lt[a[3]] = 0; lim[a[3]] = trips;
    if (trips == 0) pc += a[2];
    break;
}
case ENDLOOP:
    @CHECKS ENDLOOP@
    if (++lt[a[2]] < lim[a[2]] && lt[a[2]] < a[0]) pc -= a[1];   /* back to the instruction after the LOOP */
    break;
case STEPCOLS:
    @CHECKS STEPCOLS@
    R[a[0]] = R[a[1]]; R[a[0]].p += ((a[3] < 0 ? lim[a[5]] + a[3] : a[3]) + a[4] * lt[a[5]]) * a[2];
    break;
case LOOPR: {
    @CHECKS LOOPR@
    READ1(a[3], value);   /* the count a STEPS wrote (the CUDA loop: one counted read of the device's) */
    if (!(value >= 0 && value <= a[0] && value == (double)(int64_t)value)) FAIL(3);   /* not a whole count */
    lt[a[2]] = 0; lim[a[2]] = (int64_t)value;
    if (lim[a[2]] == 0) pc += a[1];
    break;
}
case IF: {
    @CHECKS IF@
    READ1(a[1], value);   /* a cond's pred the program computed (the CUDA loop: one counted read of the device's) */
    if (value == 0) pc += a[0];   /* 0: skip the then-branch and its JUMP (NaN is true) */
    break;
}
case WHILE: {
    @CHECKS WHILE@
    READ1(a[1], value);   /* the condition's one value (the CUDA loop: one counted read of the device's) */
    if (value == 0) pc += a[0];   /* 0: the loop ends (NaN is true) */
    break;
}
case COLS:
    @CHECKS COLS@
    R[a[0]] = R[a[1]]; R[a[0]].p += a[2];
    break;
case ALIAS:
    @CHECKS ALIAS@
    R[a[0]] = R[a[1]];
    break;
case TRANSPOSE:
    @CHECKS TRANSPOSE@
    R[a[0]] = R[a[1]]; R[a[0]].trans ^= 1;
    break;
case ROWS: {
    @CHECKS ROWS@
    if (a[0] < 0) { bs = task_bs; break; }   /* after the loop: the task's rows again */
    BUFOK(a[0], 0);
    const int64_t d_ = a[3], *active = COUNTS(a[0]);   /* (the CUDA loop: its host copy) */
    if (!active || BSIZE(a[0]) < lim[d_]) FAIL(0);
    if (lt[d_] == 0)   /* the loop's first step: every entry it will read checked once */
        for (int64_t s_ = 0; s_ < lim[d_]; s_++)
            if (active[s_] < 0 || active[s_] > task_bs || (s_ > 0 && active[s_] > active[s_ - 1])) FAIL(0);
    bs = active[(a[1] < 0 ? lim[d_] + a[1] : a[1]) + a[2] * lt[d_]];
    break;
}
case FLAT:
    @CHECKS FLAT@
    if (R[a[1]].trans || R[a[1]].ld != a[2] * a[3]) FAIL(3);   /* its rows not k blocks of cols: no such view */
    R[a[0]] = R[a[1]]; R[a[0]].ld = a[2];
    break;"""


def interpreter_source(c_type: str) -> str:
    """The interpreter's C source for one element type (``float`` or ``double``)."""
    enum = ", ".join([f"{name} = {i}" for name, i in OPS.items()] + [f"NOPCODES = {len(OPS)}"])
    source = INTERPRETER_SOURCE.format(T=c_type, ENUM=enum, WIDTH=WIDTH, MAX_ARGS=MAX_ARGS, MAX_REGISTERS=MAX_REGISTERS,
                                       REGISTER_CASES=register_cases("REGOK", 12), SPAN_HELPERS=SPAN_HELPERS,
                                       PACKED=packed_source(c_type), ROWS=row_functions(c_type))
    return viewed(checked(source, "REGOK"))


# The paths of an instruction that only point a register (a view where the rows lie evenly spaced): one text in
# both loops, over their SET, FBASE, START and STEP, rendered at each ``@VIEW NAME@`` marker.
VIEWS = {
    "GATHER": "if (a[5] && STEP(a[4]) >= 1) {   /* the children's rows evenly spaced: a strided view */\n"
              "    SET(a[0], FBASE(a[1]) + START(a[4]) * a[2], STEP(a[4]) * a[2], 0, a[1]);\n    break;\n}",
    "SROWS": "if (scatter_row >= 0) {   /* the kind's rows one block: a view, as BIND's */\n"
             "    SET(a[0], FBASE(a[1]) + scatter_row * a[3] + a[2], a[3], 0, a[1]);\n    break;\n}",
}


def viewed(source: str) -> str:
    """``source`` with each ``@VIEW NAME@`` marker replaced by VIEWS[NAME], indented as the marker is."""
    return re.sub(r"^( *)@VIEW (\w+)@", lambda m: textwrap.indent(VIEWS[m.group(2)], m.group(1)), source,
                  flags=re.M)


def interpreter_decls(c_type: str) -> str:
    return (f"int run_{c_type}(const int64_t *code, const int64_t *pool, const int64_t *kinds, int64_t nkinds,"
            " const int64_t *tasks, int64_t ntasks, int64_t tw, const int64_t *base, const int64_t *size,"
            " const int64_t *ld, const int64_t *trans, int64_t nbufs, int64_t scratch_buf, int64_t max_bs,"
            " int64_t nregs, const int64_t *kernels, int64_t nkernels, int64_t gemm, int64_t gemv, int64_t ilp64,"
            " int64_t forest, int64_t check, int64_t *err, int64_t *prof, const int64_t *twin,"
            " const int64_t *packed, int64_t tmp_off, int64_t tmp_rows, int64_t tmp_cols, int64_t *sync,"
            " int64_t role, int64_t nwait); void mc_set_small_mnk(int64_t bound);" + PACKED_DECLS[c_type])
