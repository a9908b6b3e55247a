"""C source of the CUDA issuing loop, and the CUDA kernels it launches: strings only (minicavs/cuda/issue.py
compiles the loop with the project's C compiler, through cffi, and hands it its function pointers).

The loop walks a lowered batch program (instructions.py) over its task table on the host, exactly as the C
interpreter of codegen/machine.py does, but where the interpreter computes, it *issues*: registers hold device
addresses, views only set registers (host arithmetic), and every instruction that moves or computes numbers
becomes one kernel launch or one product on the current stream. It never calls Python and never reads device
memory, so a pass costs one C call whatever its number of tasks.

What it issues through (launch, products, events: the ``dev`` array) is codegen/issue_shims.py's.

Every register an instruction reads or writes is checked against its buffer before anything is issued (host
arithmetic, always on: a wrong instruction fails with its index and operand instead of writing outside a
buffer on the device); the row numbers inside index arrays are checked on their host copies with ``check``
set (as the C runner's check mode and the reference runner's). ``err`` gets (1, task, instruction, operand,
driver result, stream) of the first failure; operand -5: a copy whose source and destination partly overlap
(a parallel kernel cannot copy it as memmove does), -6: a launch or product refused (by the driver or
cuBLAS, or by the loop itself: result MC_NO_KERNEL, MC_NO_HANDLE or MC_TOO_LARGE).

Streaming: the eager table's chunk t is issued on the second stream, then an event recorded there, which the
main stream waits for before task t (cuda/device.py's EventStream, interleaved: one event re-recorded, since a
stream wait takes the event's state when it is issued). The eager stream first waits for the main stream's
earlier work; the main stream waits for the last chunk at the end.
"""
from __future__ import annotations

from ...core.limits import MAX_ARGS, MAX_REGISTERS
from .cuda import MAX_BLOCKS, BLOCK
from .issue_kernels import MOVES, ROWOP_PER_THREAD, ROWOP_THREADS
from .issue_shims import CPU_GEMM, HELPERS, shim_decls
from .machine import OPS, WIDTH, register_cases, viewed
from .opcodes import SPAN_HELPERS, checked


ROWOP_GEOMETRY = """
/* threads of a ROWOP block for rows of ``cols`` numbers (one block per row): a warp for a short row, doubled
   while a thread would have more than ROWOP_PER_THREAD columns, at most ROWOP_THREADS */
int64_t mc_rowop_threads(int64_t cols) {{
    int64_t threads = 32;
    while (threads < {ROWOP_THREADS} && threads * {ROWOP_PER_THREAD} < cols) threads *= 2;
    return threads;
}}
"""

LOOP_SOURCE = r"""
typedef struct {{ {T} *p; int64_t ld, trans, buf; }} reg_{T}_t;

/* one stream's machine: its buffer table (device base, host copy, size, ld, transposed), registers, stream */
typedef struct {{
    const int64_t *base, *host, *size, *ld, *trans;
    int64_t nbufs, scratch_buf, nregs, stream_id;
    reg_{T}_t *R;
    void *stream;
    const int64_t *dev, *rk, *fk;
    int64_t nkernels, forest, check;
    int64_t *err, *stats, *counts;
    /* issued late, to batch them: consecutive moves (one ``moves`` launch), consecutive products of one
       shape (one strided-batched product); at most one kind pending, flushed before anything else is issued */
    struct {{
        int64_t n, start[MOVES + 1], cols[MOVES], add[MOVES];
        const {T} *src[MOVES];
        int64_t lsr[MOVES], lsc[MOVES];
        {T} *dst[MOVES];
        int64_t ldr[MOVES], ldc[MOVES];
        const int64_t *sidx[MOVES], *didx[MOVES];
    }} mv;
    int64_t mv_srows[MOVES], mv_drows[MOVES], mv_commutes[MOVES];   /* rows each side spans (by index: all) */
    struct {{
        int64_t count, ta, tb, m, n, k, lda, ldb, ldc, sa, sb, sc, beta;
        const {T} *A, *B;
        {T} *C;
    }} pr;
}} mach_{T}_t;

static int out_of_{T}(const mach_{T}_t *M, int64_t buf, const void *p, int64_t rows, int64_t cols, int64_t ld,
                      int64_t trans, int64_t esz) {{
    if (buf < 0 || buf >= M->nbufs) return 1;
    if (rows <= 0 || cols <= 0) return 0;
    const char *lo = (const char *)M->base[buf], *hi = lo + M->size[buf] * esz, *first = (const char *)p;
    const int64_t r = trans ? cols : rows, c = trans ? rows : cols;
    if (ld < 0) return 1;
    const char *last = first + ((r - 1) * ld + (c - 1)) * esz;
    return first < lo || last >= hi;
}}

/* do two rows x cols blocks (element strides sr, sc >= 0) share an element? (exact for column blocks of
   rows of one stride; otherwise whether their spans meet: never a wrong "no") */
static inline int overlaps_{T}(const {T} *p, int64_t rows, int64_t cols, int64_t sr, int64_t sc, const {T} *q,
                               int64_t rows2, int64_t cols2, int64_t sr2, int64_t sc2) {{
    if (rows <= 0 || cols <= 0 || rows2 <= 0 || cols2 <= 0) return 0;
    const {T} *p1 = p + (rows - 1) * sr + (cols - 1) * sc, *q1 = q + (rows2 - 1) * sr2 + (cols2 - 1) * sc2;
    if (p1 < q || q1 < p) return 0;
    /* column blocks of rows of one stride (a concat's parts, the children's rows side by side): apart when,
       within a row of ``sr`` elements, one's columns end before the other's begin */
    if (sc == 1 && sc2 == 1 && sr == sr2 && sr > 0 && cols <= sr && cols2 <= sr) {{
        const int64_t o = (((q - p) % sr) + sr) % sr, o2 = (((p - q) % sr) + sr) % sr;
        if ((o >= cols && o + cols2 <= sr) || (o2 >= cols2 && o2 + cols <= sr)) return 0;
    }}
    return 1;
}}

static int flush_{T}(mach_{T}_t *M);

/* one launch of kernel handle ``h`` (``slot``: its entry in the launch counts): ``blocks`` of ``threads`` */
static int launch_{T}(mach_{T}_t *M, int64_t h, int64_t slot, int64_t blocks, int64_t threads, void **params) {{
    if (!h) return MC_NO_KERNEL;   /* (a kernel whose handle was never had: never a launch of function 0) */
    M->stats[0]++;
    M->counts[slot]++;
    return ((launch_t)M->dev[0])((void *)h, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, 0, M->stream, params, 0);
}}
/* blocks of BLOCK threads for ``n`` elements (a grid-stride kernel covers the rest) */
static inline int64_t blocks_for_{T}(int64_t n) {{
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    return blocks > MAXBLOCKS ? MAXBLOCKS : blocks;
}}
/* a launch of ``blocks`` x ``threads`` (nothing for no blocks), after the pending moves or product */
static int go_grid_{T}(mach_{T}_t *M, int64_t h, int64_t slot, int64_t blocks, int64_t threads, arg_t *args,
                       int nargs) {{
    void *params[MAXPARAMS];
    if (blocks <= 0) return 0;
    const int rc = flush_{T}(M);
    if (rc) return rc;
    for (int i = 0; i < nargs; i++) params[i] = &args[i];
    return launch_{T}(M, h, slot, blocks, threads, params);
}}
/* a launch over ``n`` elements, one thread each */
static int go_{T}(mach_{T}_t *M, int64_t h, int64_t slot, int64_t n, arg_t *args, int nargs) {{
    return go_grid_{T}(M, h, slot, n > 0 ? blocks_for_{T}(n) : 0, BLOCK, args, nargs);
}}
#define RK(name) M->rk[K_##name], K_##name

/* the pending moves, one launch; the pending product, one call */
static int flush_{T}(mach_{T}_t *M) {{
    if (M->mv.n) {{
        void *params[1] = {{ &M->mv }};
        const int64_t n = M->mv.start[M->mv.n];
        int rc = 0;
        if (n > 0) rc = launch_{T}(M, RK(moves), blocks_for_{T}(n), BLOCK, params);
        M->mv.n = 0;
        return rc;
    }}
    if (M->pr.count) {{
        M->stats[1]++;
        const int64_t count = M->pr.count;
        M->pr.count = 0;
        return ((gemm_fn)M->dev[1])((void *)M->dev[2], M->stream, (int)M->pr.ta, (int)M->pr.tb, M->pr.m, M->pr.n,
                                    M->pr.k, M->pr.A, M->pr.lda, M->pr.sa, M->pr.B, M->pr.ldb, M->pr.sb, M->pr.C,
                                    M->pr.ldc, M->pr.sc, count, (int)M->pr.beta);
    }}
    return 0;
}}

/* dst (+)= src, rows x cols with element strides; ``sidx``/``didx`` (not NULL): row r reads source row
   sidx[r] (-1: zeros) / writes row didx[r] (an add by index: atomic); ``srows``/``drows``: the rows each side
   may touch (by index: all the buffer's). It joins the pending moves when it touches nothing they write and
   writes nothing they touch (they run at once, in one launch), else they are issued first. ``commutes``
   (nonzero): entries of the same value may write the same rows (atomic adds; a forest's adjoints, whose
   rows are distinct vertices). */
static int move_{T}(mach_{T}_t *M, int add, const {T} *src, int64_t lsr, int64_t lsc, const void *sidx,
                    int64_t srows, {T} *dst, int64_t ldr, int64_t ldc, const void *didx, int64_t drows, int64_t rows,
                    int64_t cols, int64_t commutes) {{
    if (rows <= 0 || cols <= 0) return 0;
    int rc = 0;
    if (M->pr.count) rc = flush_{T}(M);
    if (rc) return rc;
    int clash = M->mv.n >= MOVES;
    for (int64_t e = 0; e < M->mv.n && !clash; e++) {{
        const int64_t c2 = M->mv.cols[e];
        clash = (!(commutes && commutes == M->mv_commutes[e])
                 && overlaps_{T}(dst, drows, cols, ldr, ldc, M->mv.dst[e], M->mv_drows[e], c2, M->mv.ldr[e], M->mv.ldc[e]))
             || overlaps_{T}(dst, drows, cols, ldr, ldc, M->mv.src[e], M->mv_srows[e], c2, M->mv.lsr[e], M->mv.lsc[e])
             || overlaps_{T}(src, srows, cols, lsr, lsc, M->mv.dst[e], M->mv_drows[e], c2, M->mv.ldr[e], M->mv.ldc[e]);
    }}
    if (clash) {{ rc = flush_{T}(M); if (rc) return rc; }}
    const int64_t e = M->mv.n;
    if (e == 0) M->mv.start[0] = 0;
    M->mv.cols[e] = cols; M->mv.add[e] = add; M->mv.src[e] = src; M->mv.lsr[e] = lsr; M->mv.lsc[e] = lsc;
    M->mv.dst[e] = dst; M->mv.ldr[e] = ldr; M->mv.ldc[e] = ldc;
    M->mv.sidx[e] = (const int64_t *)sidx; M->mv.didx[e] = (const int64_t *)didx;
    M->mv_srows[e] = srows; M->mv_drows[e] = drows; M->mv_commutes[e] = commutes;
    M->mv.start[e + 1] = M->mv.start[e] + rows * cols;
    M->mv.n = e + 1;
    return 0;
}}
/* does a rows x cols block touch anything the pending moves touch? (a launch that does not may go first) */
static int touches_moves_{T}(const mach_{T}_t *M, const {T} *p, int64_t rows, int64_t cols, int64_t sr, int64_t sc) {{
    for (int64_t e = 0; e < M->mv.n; e++) {{
        const int64_t c2 = M->mv.cols[e];
        if (overlaps_{T}(p, rows, cols, sr, sc, M->mv.dst[e], M->mv_drows[e], c2, M->mv.ldr[e], M->mv.ldc[e])
            || overlaps_{T}(p, rows, cols, sr, sc, M->mv.src[e], M->mv_srows[e], c2, M->mv.lsr[e], M->mv.lsc[e]))
            return 1;
    }}
    return 0;
}}
#define COPY_(src, lsr, lsc, dst, ldr, ldc, rows, cols) \
    move_{T}(M, 0, src, lsr, lsc, 0, rows, dst, ldr, ldc, 0, rows, rows, cols, 0)
#define ADD_(src, lsr, lsc, dst, ldr, ldc, rows, cols) \
    move_{T}(M, 1, src, lsr, lsc, 0, rows, dst, ldr, ldc, 0, rows, rows, cols, 0)
static int zero_{T}(mach_{T}_t *M, {T} *dst, int64_t ldr, int64_t ldc, int64_t rows, int64_t cols) {{
    arg_t a[5];
    a[0].i = rows; a[1].i = cols; a[2].p = dst; a[3].i = ldr; a[4].i = ldc;
    return go_{T}(M, RK(zero2d), rows * cols, a, 5);
}}
/* one value of device memory read on the host (a while_loop's condition, once per iteration): the pending
   work issued first, the copy made on the stream and waited for; counted (stats[3]). A device without the
   entry points (dev[9], dev[10] 0) refuses it. */
static int read_{T}(mach_{T}_t *M, const {T} *src, {T} *dst) {{
    int rc = flush_{T}(M);
    if (rc) return rc;
    if (!M->dev[9] || !M->dev[10]) return MC_NO_READ;
    M->stats[3]++;
    rc = ((read_t)M->dev[9])(dst, src, sizeof({T}), M->stream);
    return rc ? rc : ((sync_t)M->dev[10])(M->stream);
}}
/* one value written to device memory from the host (a while_loop's count of steps run, where a loop's body
   reads it): the pending work issued first, the copy made on the stream and waited for; counted (stats[4]) */
static int write_{T}(mach_{T}_t *M, {T} *dst, {T} value) {{
    int rc = flush_{T}(M);
    if (rc) return rc;
    if (!M->dev[11] || !M->dev[10]) return MC_NO_READ;
    M->stats[4]++;
    rc = ((write_t)M->dev[11])(dst, &value, sizeof({T}), M->stream);
    return rc ? rc : ((sync_t)M->dev[10])(M->stream);
}}
/* C = op(A) op(B): ``batch`` 1 joins the pending product as one more of a strided batch when it has the same
   shape, its operands are evenly spaced from the pending ones' and it reads nothing they write (else the
   pending one is issued first); a batch of its own is issued at once */
static int product_{T}(mach_{T}_t *M, int ta, int tb, int64_t m, int64_t n, int64_t k, const {T} *A, int64_t lda,
                       int64_t sa, const {T} *B, int64_t ldb, int64_t sb, {T} *C, int64_t ldc, int64_t sc,
                       int64_t batch, int64_t beta) {{
    int rc = 0;
    if (M->mv.n) rc = flush_{T}(M);
    if (rc) return rc;
    if (batch == 1 && M->pr.count && M->pr.ta == ta && M->pr.tb == tb && M->pr.m == m && M->pr.n == n
        && M->pr.k == k && M->pr.lda == lda && M->pr.ldb == ldb && M->pr.ldc == ldc && M->pr.beta == beta) {{
        const int64_t c = M->pr.count;
        const int64_t dA = A - M->pr.A, dB = B - M->pr.B, dC = C - M->pr.C;
        /* (strides >= 0: two products whose operands all lie the other way round are batched new one first) */
        const int flip = c == 1 && dA <= 0 && dB <= 0 && dC < 0;
        const int ok = c == 1 ? (dA >= 0 && dB >= 0 && dC > 0) || flip
                              : dA == c * M->pr.sa && dB == c * M->pr.sb && dC == c * M->pr.sc;
        /* what the new one reads or writes must not be what the pending ones write, nor may it write what
           they read (they all run at once) */
        const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
        int clash = !ok;
        for (int64_t i = 0; i < c && !clash; i++) {{
            const int64_t step = c == 1 ? 0 : i;
            const {T} *Ci = M->pr.C + step * M->pr.sc, *Ai = M->pr.A + step * M->pr.sa, *Bi = M->pr.B + step * M->pr.sb;
            clash = overlaps_{T}(C, m, n, ldc, 1, Ci, m, n, ldc, 1)
                 || overlaps_{T}(A, ar, ac, lda, 1, Ci, m, n, ldc, 1)
                 || overlaps_{T}(B, br, bc, ldb, 1, Ci, m, n, ldc, 1)
                 || overlaps_{T}(C, m, n, ldc, 1, Ai, ar, ac, lda, 1)
                 || overlaps_{T}(C, m, n, ldc, 1, Bi, br, bc, ldb, 1);
        }}
        if (!clash) {{
            if (flip) {{ M->pr.A = A; M->pr.B = B; M->pr.C = C; }}
            if (c == 1) {{ M->pr.sa = flip ? -dA : dA; M->pr.sb = flip ? -dB : dB; M->pr.sc = flip ? -dC : dC; }}
            M->pr.count = c + 1;
            return 0;
        }}
    }}
    if (M->pr.count) {{ rc = flush_{T}(M); if (rc) return rc; }}
    if (batch != 1) {{
        M->stats[1]++;
        return ((gemm_fn)M->dev[1])((void *)M->dev[2], M->stream, ta, tb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc,
                                    sc, batch, (int)beta);
    }}
    M->pr.beta = beta;
    M->pr.count = 1; M->pr.ta = ta; M->pr.tb = tb; M->pr.m = m; M->pr.n = n; M->pr.k = k; M->pr.lda = lda;
    M->pr.ldb = ldb; M->pr.ldc = ldc; M->pr.sa = M->pr.sb = M->pr.sc = 0; M->pr.A = A; M->pr.B = B; M->pr.C = C;
    return 0;
}}

/* a register's element strides as a rows x cols matrix (transposed: the stored matrix read by columns) */
#define STRIDES(reg, sr, sc) const int64_t sr = R[reg].trans ? 1 : R[reg].ld, sc = R[reg].trans ? R[reg].ld : 1
#define FAIL(operand) do {{ M->err[0] = 1; M->err[1] = t; M->err[2] = pc; M->err[3] = (operand); \
    M->err[5] = M->stream_id; return 1; }} while (0)
#define ISSUED(call) do {{ const int rc_ = (call); if (rc_) {{ M->err[4] = rc_; FAIL(-6); }} }} while (0)
#define DIM(x) ((x) < 0 ? -(x) * bs : (x))
#define REGOK(r, operand) do {{ if ((r) < 0 || (r) >= M->nregs || R[r].buf < 0) FAIL(operand); }} while (0)
#define DSTOK(r, operand) do {{ if ((r) < 0 || (r) >= M->nregs) FAIL(operand); }} while (0)
#define BUFOK(b, operand) do {{ if ((b) < 0 || (b) >= M->nbufs) FAIL(operand); }} while (0)
#define CHECKR(reg, rows, cols, operand) do {{ if (out_of_{T}(M, R[reg].buf, R[reg].p, rows, cols, R[reg].ld, \
    R[reg].trans, sizeof({T}))) FAIL(operand); }} while (0)
#define NOTRANS(reg, operand) do {{ if (R[reg].trans) FAIL(operand); }} while (0)
#define SET(r, ptr, ld_, trans_, buf_) do {{ R[r].p = (ptr); R[r].ld = (ld_); R[r].trans = (trans_); \
    R[r].buf = (buf_); }} while (0)
#define FBASE(b) (({T} *)M->base[b])
#define BSIZE(b) (M->size[b])
#define BLD(b) (M->ld[b])
#define BTRANS(b) (M->trans[b])
#define CHECKING 1
#define IVALUES(b) ((const int64_t *)M->host[b])
#define IWANT (M->check)
#define KERNELOK(k, operand) do {{ if ((k) < 0 || (k) >= M->nkernels || !M->fk[k]) FAIL(operand); }} while (0)
#define FOREST (M->forest)
#define SCRATCH_BUF sbuf
#define PRED(b) ((const {T} *)M->host[b])   /* a cond's pred: its host copy (issue.py reads it once a pass) */
#define COUNTS(b) ((const int64_t *)M->host[b])   /* a loop's run-time trip count: the same */
#define READ1(r, name) {T} name##_; ISSUED(read_{T}(M, R[r].p, &name##_)); const double name = name##_
#define IDX(b) ((const void *)((const int64_t *)M->base[b] + task_row))
#define NROWS(b, w) ((w) > 0 ? M->size[b] / (w) : 0)

static int row_{T}(mach_{T}_t *M, const int64_t *code, const int64_t *pool, const int64_t *kinds, int64_t nkinds,
                   const int64_t *task, int64_t t) {{
    reg_{T}_t *R = M->R;
    int64_t pc = -1;
    int64_t lt[MAXDEPTH] = {{0}}, lim[MAXDEPTH] = {{0}};   /* per loop depth: its counter and trip count */
    const int64_t kind_id = task[0], task_row = task[1], task_bs = task[2], scatter_row = task[3], catfirst = task[4];
    int64_t bs = task_bs;   /* the rows an instruction runs over: a loop's active rows (ROWS), else the task's */
    if (kind_id < 0 || kind_id >= nkinds || bs < 0) FAIL(-2);
    const int64_t begin = kinds[2 * kind_id], end = kinds[2 * kind_id + 1];
    {T} *scratch = FBASE(M->scratch_buf);
    const int64_t sbuf = M->scratch_buf;
    for (pc = begin; pc < end; pc++) {{
        const int64_t *in = code + pc * W;
        const int64_t *a = in + 1;
        switch (in[0]) {{
        case GATHER: {{
            @CHECKS GATHER@
            @VIEW GATHER@
            const int64_t width = a[2];
            SET(a[0], scratch + a[6] * task_bs, width, 0, sbuf);
            ISSUED(move_{T}(M, 0, FBASE(a[1]), width, 1, IDX(a[3]), NROWS(a[1], width), R[a[0]].p, width, 1, 0, bs, bs,
                            width, 0));
            break;
        }}
        case TAKE: {{
            @CHECKS TAKE@
            const int64_t width = a[2], cols = a[4];
            SET(a[0], scratch + a[5] * task_bs, cols, 0, sbuf);
            ISSUED(move_{T}(M, 0, FBASE(a[1]), width, 1, IDX(a[3]), NROWS(a[1], width), R[a[0]].p, cols, 1, 0, bs, bs,
                            cols, 0));
            break;
        }}
        case TAKETO: {{
            @CHECKS TAKETO@
            const int64_t width = a[2], cols = a[4], col = a[5];
            ISSUED(move_{T}(M, 0, FBASE(a[1]) + col, width, 1, IDX(a[3]), NROWS(a[1], width), R[a[0]].p, R[a[0]].ld, 1,
                            0, bs, bs, cols, 0));
            break;
        }}
        case SROWS: {{
            @CHECKS SROWS@
            @VIEW SROWS@
            const int64_t col = a[2], ldb = a[3], cols = a[5];
            SET(a[0], scratch + a[6] * task_bs, cols, 0, sbuf);
            if (a[7])
                ISSUED(move_{T}(M, 0, FBASE(a[1]) + col, ldb, 1, IDX(a[4]), NROWS(a[1], ldb), R[a[0]].p, cols, 1, 0, bs,
                                bs, cols, 0));
            break;
        }}
        case SPUT: {{
            @CHECKS SPUT@
            const int64_t col = a[1], ldb = a[2], cols = a[5];
            if (scatter_row >= 0 && !a[6]) break;
            if (scatter_row >= 0) {{
                STRIDES(a[4], sr, sc);
                ISSUED(COPY_(R[a[4]].p, sr, sc, FBASE(a[0]) + scatter_row * ldb + col, ldb, 1, bs, cols));
                break;
            }}
            ISSUED(move_{T}(M, 0, R[a[4]].p, R[a[4]].ld, 1, 0, bs, FBASE(a[0]) + col, ldb, 1, IDX(a[3]),
                            NROWS(a[0], ldb), bs, cols, 0));
            break;
        }}
{REGISTER_CASES}
        case STEPS: {{
            @CHECKS STEPS@
            const {T} value = ({T})lt[a[1]];   /* a while_loop's steps run: one counted write to the device */
            ISSUED(write_{T}(M, R[a[0]].p, value));
            break;
        }}
        case GEMM: {{
            @CHECKS GEMM@
            const int64_t m = DIM(a[3]), n = DIM(a[4]), k = DIM(a[5]);
            if (m == 0 || n == 0) break;
            const reg_{T}_t *A = &R[a[1]], *Bm = &R[a[2]], *C = &R[a[0]];
            if (a[6] >= 0) {{   /* the bias row copied into every row of C first: the product adds onto it */
                STRIDES(a[6], br, bc);
                (void)br;
                ISSUED(COPY_(R[a[6]].p, 0, bc, C->p, C->ld, 1, m, n));
            }} else if (k == 0 && a[6] != -2) ISSUED(zero_{T}(M, C->p, C->ld, 1, m, n));   /* (-2: c += a . b) */
            if (k > 0) {{
                const int64_t need_a = A->trans ? m : k, need_b = Bm->trans ? k : n;
                const int64_t lda = A->ld < need_a ? need_a : A->ld, ldb = Bm->ld < need_b ? need_b : Bm->ld;
                const int64_t ldc = C->ld < n ? n : C->ld;
                ISSUED(product_{T}(M, (int)A->trans, (int)Bm->trans, m, n, k, A->p, lda, 0, Bm->p, ldb, 0, C->p, ldc,
                                   0, 1, a[6] >= 0 || a[6] == -2));
            }}
            break;
        }}
        case FUSED: {{
            @CHECKS FUSED@
            const int64_t nargs = a[1], rows = DIM(a[2]), cols = a[3];
            if (nargs < 0 || nargs > MAXARGS) FAIL(1);   /* (the launch's parameters hold MAXARGS) */
            if (rows == 0 || cols == 0) break;
            const int64_t *args = pool + a[4];
            arg_t p[2 + 2 * MAXARGS];
            void *params[2 + 2 * MAXARGS];
            p[0].i = rows; p[1].i = cols;
            int apart = M->pr.count == 0;   /* touches nothing the pending moves touch: goes before them */
            for (int64_t i = 0; i < nargs; i++) {{
                const int64_t r = args[2 * i], kind = args[2 * i + 1];
                const int64_t ar = kind == 0 || kind == 2 ? rows : 1, ac = kind <= 1 ? cols : 1;
                p[2 + 2 * i].p = R[r].p;
                p[3 + 2 * i].i = kind == 0 || kind == 2 ? R[r].ld : 0;
                if (apart && M->mv.n) apart = !touches_moves_{T}(M, R[r].p, ar, ac, R[r].ld, 1);
            }}
            if (!apart) ISSUED(flush_{T}(M));
            for (int64_t i = 0; i < 2 + 2 * nargs; i++) params[i] = &p[i];
            ISSUED(launch_{T}(M, M->fk[a[0]], NRK + a[0], blocks_for_{T}(rows * cols), BLOCK, params));
            break;
        }}
        case ROWPERM: {{
            @CHECKS ROWPERM@
            ISSUED(move_{T}(M, 0, R[a[1]].p, R[a[1]].ld, 1, IDX(a[2]), bs, R[a[0]].p, R[a[0]].ld, 1, 0, bs, bs, a[3], 0));
            break;
        }}
        case COPY: case ADD: {{
            @CHECKS COPY@
            const int64_t rows = DIM(a[2]), cols = a[3];
            STRIDES(a[0], dr, dc);
            STRIDES(a[1], sr, sc);
            if (in[0] == COPY && rows > 0 && cols > 0 && R[a[0]].buf == R[a[1]].buf) {{
                if (R[a[0]].p == R[a[1]].p && dr == sr && dc == sc) break;   /* onto itself: nothing moves */
                const {T} *d0 = R[a[0]].p, *d1 = d0 + (rows - 1) * dr + (cols - 1) * dc;
                const {T} *s0 = R[a[1]].p, *s1 = s0 + (rows - 1) * sr + (cols - 1) * sc;
                if (!(d1 < s0 || s1 < d0)) FAIL(-5);
            }}
            ISSUED(move_{T}(M, in[0] == ADD, R[a[1]].p, sr, sc, 0, rows, R[a[0]].p, dr, dc, 0, rows, rows, cols, 0));
            break;
        }}
        case ZERO: {{
            @CHECKS ZERO@
            const int64_t rows = DIM(a[1]), cols = a[2];
            STRIDES(a[0], dr, dc);
            ISSUED(zero_{T}(M, R[a[0]].p, dr, dc, rows, cols));
            break;
        }}
        case SUMROWS: {{
            @CHECKS SUMROWS@
            const int64_t rows = DIM(a[2]), cols = a[3];
            STRIDES(a[0], dr, dc);
            STRIDES(a[1], sr, sc);
            (void)dr;
            arg_t p[7];
            p[0].i = rows; p[1].i = cols; p[2].p = R[a[1]].p; p[3].i = sr; p[4].i = sc; p[5].p = R[a[0]].p; p[6].i = dc;
            ISSUED(go_{T}(M, RK(sumrows), cols, p, 7));
            break;
        }}
        case PUT: {{
            @CHECKS PUT@
            const int64_t width = a[1], cols = a[4];
            ISSUED(move_{T}(M, 0, R[a[3]].p, R[a[3]].ld, 1, 0, bs, FBASE(a[0]), width, 1, IDX(a[2]), NROWS(a[0], width),
                            bs, cols, 0));
            break;
        }}
        case ADJ: {{
            @CHECKS ADJ@
            const int64_t width = a[1], cols = a[6];
            const int64_t start = task[5 + 2 * a[3]], step = task[6 + 2 * a[3]];
            if (a[4] && step >= 0) {{
                if (step == 0) break;   /* only the sentinel row: its gradient is discarded */
                ISSUED(move_{T}(M, !M->forest, R[a[5]].p, R[a[5]].ld, 1, 0, bs, FBASE(a[0]) + start * width, step * width,
                                1, 0, bs, bs, cols, 0));
                break;
            }}
            /* (a forest's children are distinct vertices: the slots' puts never meet; a DAG's adds are atomic) */
            ISSUED(move_{T}(M, !M->forest, R[a[5]].p, R[a[5]].ld, 1, 0, bs, FBASE(a[0]), width, 1, IDX(a[2]),
                            NROWS(a[0], width), bs, cols, M->forest ? 2 : 1));
            break;
        }}
        case GACC: {{
            @CHECKS GACC@
            const int64_t rows = DIM(a[2]), cols = a[3];
            ISSUED(ADD_(R[a[1]].p, R[a[1]].ld, 1, FBASE(a[0]), cols, 1, rows, cols));
            break;
        }}
        case DROPOUT: {{
            @CHECKS DROPOUT@
            const int64_t cols = a[2];
            const int64_t *e = (const int64_t *)M->host[a[4]];
            if (!e) FAIL(4);   /* (the table is read on the host) */
            e += 3 * a[5];
            double scale;
            memcpy(&scale, &e[2], sizeof scale);
            arg_t p[10];
            p[0].i = bs; p[1].i = cols; p[2].u = (uint64_t)e[0]; p[3].p = (const uint64_t *)M->base[a[3]] + task_row;
            p[4].u = (uint64_t)e[1];
            if (sizeof({T}) == 4) p[5].f = (float)scale; else p[5].d = scale;
            p[6].p = R[a[1]].p; p[7].i = R[a[1]].ld; p[8].p = R[a[0]].p; p[9].i = R[a[0]].ld;
            ISSUED(go_{T}(M, RK(dropout_rows), bs * cols, p, 10));
            break;
        }}
        case BMM: {{
            @CHECKS BMM@
            const int64_t m = a[3], n = a[4], k = a[5], arows = a[6], brows = a[7];
            if (bs == 0 || m == 0 || n == 0) break;
            const reg_{T}_t *A = &R[a[1]], *Bm = &R[a[2]], *C = &R[a[0]];
            if (k == 0) {{ ISSUED(zero_{T}(M, C->p, C->ld, 1, bs, m * n)); break; }}
            const int64_t ta = arows ? 0 : A->trans, tb = brows ? 0 : Bm->trans;
            const int64_t need_a = ta ? m : k, need_b = tb ? k : n;
            const int64_t lda0 = arows ? k : A->ld, ldb0 = brows ? n : Bm->ld;
            const int64_t lda = lda0 < need_a ? need_a : lda0, ldb = ldb0 < need_b ? need_b : ldb0;
            if (arows && !brows && A->ld == m * k && C->ld == m * n) {{
                /* every row's a side by side is one (bs m) x k matrix: one product by the shared b */
                ISSUED(product_{T}(M, 0, (int)tb, bs * m, n, k, A->p, k, 0, Bm->p, ldb, 0, C->p, n, 0, 1, 0));
                break;
            }}
            /* one product per row, issued as one strided batch (a shared operand: stride 0) */
            ISSUED(product_{T}(M, (int)ta, (int)tb, m, n, k, A->p, lda, arows ? A->ld : 0, Bm->p, ldb,
                               brows ? Bm->ld : 0, C->p, n, C->ld, bs, 0));
            break;
        }}
        case ROWOP: {{
            @CHECKS ROWOP@
            const int64_t fn = a[0], cols = a[5];
            if (fn < 0 || fn > 3) FAIL(0);
            const int64_t *lab = 0;
            if ((fn == 1 || fn == 2) && !a[6]) {{   /* (checked on the host copy, as the other loops check them) */
                const int64_t *hl = (const int64_t *)M->host[a[4]];
                if (!hl) FAIL(4);
                for (int64_t r = 0; r < bs; r++) if (hl[task_row + r] < 0 || hl[task_row + r] >= cols) FAIL(4);
                lab = (const int64_t *)M->base[a[4]] + task_row;
            }}
            /* labels in a register (a[6]): whole numbers on the device, not read here (a read would be a crossing);
               the kernel writes NaN for a row whose label is no class */
            const int labreg = (fn == 1 || fn == 2) && a[6];
            arg_t p[12];
            p[0].i = fn; p[1].i = bs; p[2].i = cols; p[3].p = R[a[2]].p; p[4].i = fn == 3 ? 0 : R[a[2]].ld;
            p[5].p = fn == 2 ? R[a[3]].p : R[a[2]].p; p[6].i = fn == 2 ? R[a[3]].ld : 0; p[7].p = lab;
            p[8].p = labreg ? R[a[4]].p : R[a[2]].p; p[9].i = labreg ? R[a[4]].ld : 0;
            p[10].p = R[a[1]].p; p[11].i = R[a[1]].ld;
            /* one block per row (a grid-stride loop past MAXBLOCKS), its threads over the row's columns */
            ISSUED(go_grid_{T}(M, RK(rowop), bs < MAXBLOCKS ? bs : MAXBLOCKS, mc_rowop_threads(cols), p, 12));
            break;
        }}
        case TRANSROWS: {{
            @CHECKS TRANSROWS@
            const int64_t m = a[2], n = a[3];
            arg_t p[7];
            p[0].i = bs; p[1].i = m; p[2].i = n; p[3].p = R[a[1]].p; p[4].i = R[a[1]].ld; p[5].p = R[a[0]].p;
            p[6].i = R[a[0]].ld;
            ISSUED(go_{T}(M, RK(transrows), bs * m * n, p, 7));
            break;
        }}
        default:   /* APPLY (a step only Python runs: the Python side declines such a program), or no opcode */
            FAIL(-3);
        }}
    }}
    ISSUED(flush_{T}(M));   /* (the task's last moves or product, before its stream's event) */
    return 0;
}}

/* Issue a pass: every row of ``tasks`` on the main stream, streaming every row of ``etasks`` on the eager
   stream (chunk t before task t). ``bufs`` and ``ebufs``: 5 x nbufs (device base, host copy, size, ld,
   transposed) of the main and the eager machine; ``dev``: launch, gemm, gemm context, record, wait, main
   stream, eager stream, the start event, the chunk event, a device-to-host copy, a stream's synchronize, a
   host-to-device copy;
   ``rk``: the row kernels' handles (ISSUE_KERNEL_NAMES),
   ``fk``: the fused kernels'. ``stats``: launches, products, events, reads, writes (added to); ``counts``: launches per
   handle (row kernels, then fused). Returns 0, or 1 with ``err`` filled. */
int issue_{T}(const int64_t *code, const int64_t *pool, const int64_t *kinds, int64_t nkinds,
              const int64_t *tasks, int64_t ntasks, const int64_t *etasks, int64_t neager, int64_t tw,
              const int64_t *bufs, const int64_t *ebufs, int64_t nbufs, int64_t scratch_buf, int64_t nregs,
              const int64_t *dev, const int64_t *rk, const int64_t *fk, int64_t nkernels, int64_t forest,
              int64_t check, int64_t *err, int64_t *stats, int64_t *counts) {{
    static __thread reg_{T}_t regs[2][MAXREGS];
    mach_{T}_t M[2];
    int64_t t = -1, pc = -1;
    err[0] = 0;
    for (int s = 0; s < 2; s++) {{
        const int64_t *b = s ? ebufs : bufs;
        M[s].base = b; M[s].host = b + nbufs; M[s].size = b + 2 * nbufs; M[s].ld = b + 3 * nbufs;
        M[s].trans = b + 4 * nbufs; M[s].nbufs = nbufs; M[s].scratch_buf = scratch_buf; M[s].nregs = nregs;
        M[s].stream_id = s; M[s].R = regs[s]; M[s].stream = (void *)dev[5 + s]; M[s].dev = dev; M[s].rk = rk;
        M[s].fk = fk; M[s].nkernels = nkernels; M[s].forest = forest; M[s].check = check; M[s].err = err;
        M[s].stats = stats; M[s].counts = counts; M[s].mv.n = 0; M[s].pr.count = 0;
    }}
    mach_{T}_t *main_ = &M[0], *eager = &M[1];
    {{
        mach_{T}_t *M = main_;
        if (nregs < 0 || nregs > MAXREGS) FAIL(-1);
        for (int s = 0; s < 2; s++)
            for (int64_t i = 0; i < nregs; i++) {{ regs[s][i].p = 0; regs[s][i].ld = 0; regs[s][i].trans = 0;
                                                 regs[s][i].buf = -1; }}
        if (neager > 0) {{   /* the eager stream starts after the main stream's earlier work (its inputs) */
            ISSUED(((record_t)dev[3])((void *)dev[7], main_->stream));
            ISSUED(((wait_t)dev[4])(eager->stream, (void *)dev[7], 0));
            stats[2] += 2;
        }}
    }}
    const int64_t rows = ntasks > neager ? ntasks : neager;
    for (t = 0; t < rows; t++) {{
        if (t < neager) {{
            if (row_{T}(eager, code, pool, kinds, nkinds, etasks + t * tw, t)) return 1;
            mach_{T}_t *M = eager;
            ISSUED(((record_t)dev[3])((void *)dev[8], eager->stream));
            stats[2]++;
        }}
        if (t < ntasks) {{
            mach_{T}_t *M = main_;
            if (t < neager) {{ ISSUED(((wait_t)dev[4])(main_->stream, (void *)dev[8], 0)); stats[2]++; }}
            if (row_{T}(main_, code, pool, kinds, nkinds, tasks + t * tw, t)) return 1;
        }}
    }}
    if (neager > ntasks) {{   /* chunks past the tasks: the main stream waits for them all */
        mach_{T}_t *M = main_;
        ISSUED(((wait_t)dev[4])(main_->stream, (void *)dev[8], 0));
        stats[2]++;
    }}
    return 0;
}}
"""


def issue_source() -> str:
    """The issuing loop's C source, float and double, with the stand-in's and cuBLAS's product shims."""
    enum = ", ".join([f"{name} = {i}" for name, i in OPS.items()] + [f"NOPCODES = {len(OPS)}"])
    head = (HELPERS + f"enum {{ {enum} }};\n#define W {WIDTH}\n#define MAXARGS {MAX_ARGS}\n"
            f"#define MAXREGS {MAX_REGISTERS}\n#define MAXPARAMS {2 + 2 * MAX_ARGS}\n#define BLOCK {BLOCK}\n"
            f"#define MAXBLOCKS {MAX_BLOCKS}\n#define MOVES {MOVES}\n" + SPAN_HELPERS
            + ROWOP_GEOMETRY.format(ROWOP_THREADS=ROWOP_THREADS, ROWOP_PER_THREAD=ROWOP_PER_THREAD))
    body = ""
    for T in ("float", "double"):
        loop = LOOP_SOURCE.format(T=T, REGISTER_CASES=register_cases("DSTOK", 8))
        body += CPU_GEMM.format(T=T) + viewed(checked(loop, "DSTOK"))
        body += "#undef STRIDES\n#undef FAIL\n#undef ISSUED\n#undef DIM\n#undef REGOK\n#undef DSTOK\n#undef BUFOK\n" \
                "#undef CHECKR\n#undef NOTRANS\n#undef SET\n#undef FBASE\n#undef IDX\n#undef NROWS\n#undef RK\n" \
                "#undef BSIZE\n#undef BLD\n#undef BTRANS\n#undef CHECKING\n#undef FOREST\n#undef SCRATCH_BUF\n" \
                "#undef IVALUES\n#undef IWANT\n#undef KERNELOK\n#undef PRED\n#undef COUNTS\n#undef READ1\n"
    return head + body


ISSUE_SIGNATURE = ("int issue_{T}(const int64_t *code, const int64_t *pool, const int64_t *kinds, int64_t nkinds,"
                   " const int64_t *tasks, int64_t ntasks, const int64_t *etasks, int64_t neager, int64_t tw,"
                   " const int64_t *bufs, const int64_t *ebufs, int64_t nbufs, int64_t scratch_buf, int64_t nregs,"
                   " const int64_t *dev, const int64_t *rk, const int64_t *fk, int64_t nkernels, int64_t forest,"
                   " int64_t check, int64_t *err, int64_t *stats, int64_t *counts);")
def issue_decls() -> str:
    """cffi declarations of the loop, the product shims and the stand-in's function pointers."""
    return "\n".join([shim_decls(), "int64_t mc_rowop_threads(int64_t cols);"]
                     + [ISSUE_SIGNATURE.format(T=T) for T in ("float", "double")])
