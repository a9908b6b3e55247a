"""C source of the C runner's product by a packed static (strings only; machine.py puts it into the interpreter).

Why: a per-level product of a tree model multiplies few rows by a large static (a Tree-LSTM's U, 2H x 3H: 6.3 MB
at H 512), and OpenBLAS packs that whole static into its panel layout on every call. At 2-64 rows the packing
costs more than the arithmetic (OpenBLAS, one thread, 1024 x 1536: ~0.9 ms a call at 2-16 rows, where reading
the static once takes ~0.25 ms). The C runner therefore packs each such static once per run (``mc_pack``: panels
of ``MC_NR`` columns, k rows each, zero-padded; a transposed static is packed from its transpose, so ∂F needs no
transposed copy) and multiplies by the packed panels (``mc_gemm_packed``: a 14 x 32 register block, one row of
A broadcast against two vectors of a panel row, the bias added on the way out), one pass over the static per
call. Float32 with AVX-512 only: elsewhere ``mc_packed_nr`` is 0 and the runner packs nothing.
"""
from __future__ import annotations

# MC_NR: a panel's columns (two 16-float vectors); MC_MR: the rows of a register block (14 x 2 accumulators, 30 of
# the 32 vector registers with the panel row's two: 14 FMAs per panel vector loaded, where 8 rows made 8); MC_MBLK: rows
# per pass over the panels (their A rows stay in L2 while every panel streams by); MC_KC: k per pass (a chunk of a
# panel, 32 KB, stays in L1 beside the block's A rows; 384 made it 48 KB, all of L1). 8 / 96 / 384 before: one
# thread, SkylakeX-class Xeon, 1024 x 1536, 1536 x 1024 and 512 x 512 statics at 32-512 rows 6-12% faster
PACKED_SOURCE_F32 = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
#define MC_NR 32
#define MC_MR 14
#define MC_MBLK 196
#define MC_KC 256
/* rows x cols (<= MC_NR) of C at c (row stride ldc) = mr rows of A (row stride lda) times one packed panel (k rows
   of MC_NR), plus bias (cols of it) when given; pf (or 0): the next panel's k rows, fetched into L2 meanwhile */
#define MC_BLOCK(MR) \
static inline void mc_block##MR(int64_t k, const float *a, int64_t lda, const float *bp, float *c, int64_t ldc, \
                                int64_t cols, const float *bias, int add, const float *pf) { \
    __m512 acc0[MR], acc1[MR]; \
    _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) { acc0[i] = _mm512_setzero_ps(); acc1[i] = _mm512_setzero_ps(); } \
    for (int64_t kk = 0; kk < k; kk++) { \
        if (pf) { \
            _mm_prefetch((const char *)(pf + kk * MC_NR), _MM_HINT_T1); \
            _mm_prefetch((const char *)(pf + kk * MC_NR + 16), _MM_HINT_T1); \
        } \
        const __m512 b0 = _mm512_loadu_ps(bp + kk * MC_NR), b1 = _mm512_loadu_ps(bp + kk * MC_NR + 16); \
        _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) { \
            const __m512 s = _mm512_set1_ps(a[i * lda + kk]); \
            acc0[i] = _mm512_fmadd_ps(s, b0, acc0[i]); acc1[i] = _mm512_fmadd_ps(s, b1, acc1[i]); \
        } \
    } \
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1); \
    const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1); \
    __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps(); \
    if (bias) { bias0 = _mm512_maskz_loadu_ps(m0, bias); bias1 = _mm512_maskz_loadu_ps(m1, bias + 16); } \
    _Pragma("GCC unroll 14") for (int i = 0; i < MR; i++) { \
        if (add) { \
            bias0 = _mm512_maskz_loadu_ps(m0, c + i * ldc); bias1 = _mm512_maskz_loadu_ps(m1, c + i * ldc + 16); \
        } \
        _mm512_mask_storeu_ps(c + i * ldc, m0, _mm512_add_ps(acc0[i], bias0)); \
        _mm512_mask_storeu_ps(c + i * ldc + 16, m1, _mm512_add_ps(acc1[i], bias1)); \
    } \
}
MC_BLOCK(1) MC_BLOCK(2) MC_BLOCK(3) MC_BLOCK(4) MC_BLOCK(5) MC_BLOCK(6) MC_BLOCK(7)
MC_BLOCK(8) MC_BLOCK(9) MC_BLOCK(10) MC_BLOCK(11) MC_BLOCK(12) MC_BLOCK(13) MC_BLOCK(14)

int64_t mc_packed_nr(void) { return MC_NR; }

/* the k x n matrix b (row stride ldb; trans: b is stored n x k, row stride ldb) as panels of MC_NR columns into bp
   (ceil(n / MC_NR) * MC_NR * k floats): panel j holds rows 0..k of columns j*MC_NR.., zero past n */
void mc_pack(int64_t k, int64_t n, const float *b, int64_t ldb, int64_t trans, float *bp) {
    if (!trans) {   /* 16 rows at a time, panel by panel, two masked vector moves a row (1.4-2.6x faster than a
                       panel at a time by memcpy: b's rows are read while in cache) */
        for (int64_t k0 = 0; k0 < k; k0 += 16) {
            const int64_t k1 = k0 + 16 < k ? k0 + 16 : k;
            for (int64_t j0 = 0; j0 < n; j0 += MC_NR) {
                const int64_t nr = n - j0 < MC_NR ? n - j0 : MC_NR;
                const __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
                const __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
                float *dst = bp + j0 * k;
                for (int64_t kk = k0; kk < k1; kk++) {
                    const float *src = b + kk * ldb + j0;
                    _mm512_storeu_ps(dst + kk * MC_NR, _mm512_maskz_loadu_ps(m0, src));
                    _mm512_storeu_ps(dst + kk * MC_NR + 16, _mm512_maskz_loadu_ps(m1, src + 16));
                }
            }
        }
        return;
    }
    if (ldb <= INT32_MAX / 16) {   /* a panel's row kk: column kk of its 32 stored rows, two 16-lane gathers (rows
                                     past n masked off: zeros, never read); 1.5-2.7x the scalar loop's speed */
        const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int32_t)ldb));
        for (int64_t j0 = 0; j0 < n; j0 += MC_NR) {
            const int64_t nr = n - j0 < MC_NR ? n - j0 : MC_NR;
            const __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
            const __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
            const float *src0 = b + j0 * ldb, *src1 = nr > 16 ? src0 + 16 * ldb : src0;
            float *dst = bp + j0 * k;
            for (int64_t kk = 0; kk < k; kk++) {
                _mm512_storeu_ps(dst + kk * MC_NR, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m0, rows, src0 + kk, 4));
                _mm512_storeu_ps(dst + kk * MC_NR + 16,
                                 _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m1, rows, src1 + kk, 4));
            }
        }
        return;
    }
    for (int64_t j0 = 0; j0 < n; j0 += MC_NR) {
        const int64_t nr = n - j0 < MC_NR ? n - j0 : MC_NR;
        float *dst = bp + j0 * k;
        for (int64_t k0 = 0; k0 < k; k0 += 64) {   /* (tiles: a column of the panel reads a row of b) */
            const int64_t k1 = k0 + 64 < k ? k0 + 64 : k;
            for (int64_t j = 0; j < MC_NR; j++) {
                if (j >= nr) {
                    for (int64_t kk = k0; kk < k1; kk++) dst[kk * MC_NR + j] = 0.0f;
                    continue;
                }
                const float *src = b + (j0 + j) * ldb;
                for (int64_t kk = k0; kk < k1; kk++) dst[kk * MC_NR + j] = src[kk];
            }
        }
    }
}

/* rows (1 to MC_MR) of C by one panel: the register block of that many rows */
static inline void mc_rows(int64_t rows, int64_t k, const float *a, int64_t lda, const float *bp, float *c, int64_t ldc,
                           int64_t cols, const float *bias, int add, const float *pf) {
    switch (rows) {
    case 1: mc_block1(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 2: mc_block2(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 3: mc_block3(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 4: mc_block4(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 5: mc_block5(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 6: mc_block6(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 7: mc_block7(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 8: mc_block8(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 9: mc_block9(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 10: mc_block10(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 11: mc_block11(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 12: mc_block12(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 13: mc_block13(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    case 14: mc_block14(k, a, lda, bp, c, ldc, cols, bias, add, pf); break;
    }
}

/* the rows of the next register block when ``left`` rows remain: MC_MR, except that a tail of 15 to 21 rows is
   split into two blocks of 8 to 11 (16 rows as 14 + 2 ran 6-12% slower than as 8 + 8: a 2-row block loads a
   panel row for 4 FMAs) */
static inline int64_t mc_block_rows(int64_t left) {
    return left <= MC_MR ? left : left < MC_MR + 8 ? (left + 1) / 2 : MC_MR;
}

/* C (m x n, row stride ldc) = A (m x k, row stride lda) times the packed k x n matrix bp, plus bias (n) if given;
   k in chunks of MC_KC (a register block's A rows stay in L1), the chunks after the first added into C. A panel's
   first register block fetches the next panel's chunk into L2: a static larger than L2 (U at H 512) streams from
   L3 on every call, and without it each panel's first block waited on it (2-60 rows by U, cold: 25-60% faster) */
static void mc_gemm_packed(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *bp, float *c,
                           int64_t ldc, const float *bias) {
    for (int64_t i0 = 0; i0 < m; ) {   /* row blocks of at most MC_MBLK, as even as their count allows */
        const int64_t blocks = (m - i0 + MC_MBLK - 1) / MC_MBLK, i1 = i0 + (m - i0 + blocks - 1) / blocks;
        for (int64_t k0 = 0; k0 < k; k0 += MC_KC) {
            const int64_t kc = k - k0 < MC_KC ? k - k0 : MC_KC;
            const int add = k0 > 0;
            for (int64_t j0 = 0; j0 < n; j0 += MC_NR) {
                const int64_t cols = n - j0 < MC_NR ? n - j0 : MC_NR;
                const float *panel = bp + j0 * k + k0 * MC_NR, *bj = bias && !add ? bias + j0 : 0;
                const float *pf = j0 + MC_NR < n ? panel + k * MC_NR : 0;   /* (the next panel, same k rows) */
                for (int64_t i = i0, rows; i < i1; i += rows, pf = 0) {
                    rows = mc_block_rows(i1 - i);
                    mc_rows(rows, kc, a + i * lda + k0, lda, panel, c + i * ldc + j0, ldc, cols, bj, add, pf);
                }
            }
        }
        i0 = i1;
    }
}
#define MC_PACKED 1
#define MC_PACKS(m, n, k) ((m) <= @ROWS@ || (n) * (k) <= @SMALL@)
#else
int64_t mc_packed_nr(void) { return 0; }
void mc_pack(int64_t k, int64_t n, const float *b, int64_t ldb, int64_t trans, float *bp) { }
#define MC_PACKED 0
#define MC_PACKS(m, n, k) 0
#define mc_gemm_packed(...) ((void)0)
#endif
"""

# The packed product serves a GEMM of at most PACKED_ROWS rows, or by a static of at most PACKED_SMALL elements (a
# Tree-LSTM's leaf block at H 128, 1417 x 128 x 384: 193 against OpenBLAS's 180 GFLOP/s); OpenBLAS's own blocking
# wins on many rows by a large static (1417 x 512 x 1536: 156 against 195).
PACKED_ROWS = 512
PACKED_SMALL = 1 << 18

# float64 (the reference path for gradient checks): no packed kernel
PACKED_SOURCE_F64 = r"""
int64_t mc_packed_nr(void) { return 0; }
void mc_pack(int64_t k, int64_t n, const double *b, int64_t ldb, int64_t trans, double *bp) { }
#define MC_PACKED 0
#define MC_PACKS(m, n, k) 0
#define mc_gemm_packed(...) ((void)0)
"""

PACKED_DECLS = {"float": "int64_t mc_packed_nr(void); void mc_pack(int64_t k, int64_t n, const float *b, int64_t ldb,"
                         " int64_t trans, float *bp);",
                "double": "int64_t mc_packed_nr(void); void mc_pack(int64_t k, int64_t n, const double *b, "
                          "int64_t ldb, int64_t trans, double *bp);"}


def packed_source(c_type: str) -> str:
    """The packed product's C source for ``float`` or ``double`` (a stub: no packed kernel)."""
    if c_type != "float":
        return PACKED_SOURCE_F64
    return PACKED_SOURCE_F32.replace("@ROWS@", str(PACKED_ROWS)).replace("@SMALL@", str(PACKED_SMALL))
