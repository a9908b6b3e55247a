"""C source of what the CUDA issuing loop (codegen/issue_source.py) issues through: the types of the function
pointers handed to it at run time (the ``dev`` array), the stand-in's and the no-op launches, and the products
(cblas on the stand-in, cuBLAS by pointer on a GPU). Strings only, compiled with the loop (minicavs/cuda/issue.py).

The function pointers, one per entry of ``dev``:

- ``launch``: ``cuLaunchKernel``'s signature (a function handle, grid, block, shared memory, stream, a pointer
  per kernel argument). On a GPU the driver's own, with the function handles of the modules CuPy compiled; on
  the device stand-in :c:func:`mc_standin_launch`, whose handles are the emulation's ``call_<kernel>``
  wrappers (minicavs/cuda/emulation.py: the same kernel source run on the CPU); for timing the host alone
  :c:func:`mc_noop_launch`.
- ``gemm``: a row-major product ``C = op(A) op(B)``, batched with strides (:c:type:`gemm_fn`): on a GPU
  :c:func:`mc_cublas_gemm_*` (``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` by pointer, ``C^T = B^T A^T``
  in cuBLAS's column-major terms; TF32 when asked); on the stand-in :c:func:`mc_cpu_gemm_*` (the CPU's cblas,
  the inputs rounded to TF32's 10-bit mantissa when asked, to measure its effect without a GPU).
- ``record`` / ``wait``: ``cuEventRecord`` / ``cuStreamWaitEvent`` between the two streams (streaming).
- ``read`` / ``sync``: ``cuMemcpyDtoHAsync_v2`` / ``cuStreamSynchronize`` (a while_loop's condition, one value per
  iteration); on the stand-in :c:func:`mc_standin_read` (a memcpy) and :c:func:`mc_noop_sync`.
- ``write``: ``cuMemcpyHtoDAsync_v2`` (a while_loop's count of steps run, where a loop's body reads it); on the
  stand-in :c:func:`mc_standin_read` too (a memcpy).
"""
from __future__ import annotations

HELPERS = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra);
typedef int (*record_t)(void *event, void *stream);
typedef int (*wait_t)(void *stream, void *event, unsigned flags);
typedef int (*read_t)(void *dst, const void *src, size_t bytes, void *stream);
typedef int (*sync_t)(void *stream);
typedef int (*write_t)(void *dst, const void *src, size_t bytes, void *stream);
typedef union { int64_t i; uint64_t u; double d; float f; const void *p; } arg_t;
typedef int (*gemm_fn)(void *ctx, void *stream, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A,
                       int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc,
                       int64_t sc, int64_t batch, int beta);
enum { K_zero2d, K_sumrows, K_transrows, K_dropout_rows, K_moves, K_rowop, NRK };

/* the device stand-in's launch: the handle is an emulation wrapper call_<kernel>(grid, block, params), whose
   result is 0 or the emulation's fault (a barrier not reached by every thread of a block: cuda/emulation.py) */
int mc_standin_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                      unsigned shmem, void *stream, void **params, void **extra) {
    return ((int (*)(unsigned, unsigned, void **))f)(gx, bx, params);
}
/* a device that does no work: what issuing alone costs the host */
int mc_noop_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void *stream, void **params, void **extra) { return 0; }
int mc_noop_record(void *event, void *stream) { return 0; }
int mc_noop_wait(void *stream, void *event, unsigned flags) { return 0; }
/* a device-to-host copy: the stand-in's memory is the host's; a device that does no work reads zeros */
int mc_standin_read(void *dst, const void *src, size_t bytes, void *stream) { memcpy(dst, src, bytes); return 0; }
int mc_noop_read(void *dst, const void *src, size_t bytes, void *stream) { memset(dst, 0, bytes); return 0; }
int mc_noop_write(void *dst, const void *src, size_t bytes, void *stream) { return 0; }
int mc_noop_sync(void *stream) { return 0; }

/* a product's context: cblas on the CPU (the stand-in) or cuBLAS by pointer. cuBLAS: one handle per stream,
   made by the library whose cublasGemmEx is called (its cublasCreate_v2), bound to its stream and to host
   pointer mode once, so the loop never switches a handle's stream (cublasSetStream resets its workspace: two
   streams' products in flight would share one) */
typedef struct {
    int64_t blas, ilp64, tf32;                  /* the CPU's cblas gemm, whether it takes 64-bit ints, TF32 rounding */
    int64_t gemm_ex, gemm_batched;              /* cublasGemmEx, cublasGemmStridedBatchedEx */
    void *stream[2], *handle[2];                /* the main and the eager stream, and each one's cuBLAS handle */
} mc_gemm_ctx;

/* the loop's own refusals, as a launch's or product's result (the driver's and cuBLAS's codes are >= 0) */
enum { MC_NO_KERNEL = -7, MC_NO_HANDLE = -8, MC_TOO_LARGE = -9, MC_NO_READ = -10 };

/* does a product's size or leading dimension exceed the int cuBLAS's (and a 32-bit cblas's) entry points take? */
static inline int mc_too_large(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch) {
    return m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX
        || batch > INT32_MAX;
}

/* a float rounded to TF32 (10 mantissa bits, to nearest, ties away), as the tensor cores read it */
static inline float mc_tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&x, &u, 4);
    return x;
}
int mc_noop_gemm(void *ctx, void *stream, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A,
                 int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc, int64_t sc,
                 int64_t batch, int beta) { return 0; }
"""

CPU_GEMM = r"""
typedef void (*cblas64_{T}_t)(int, int, int, int64_t, int64_t, int64_t, {T}, const {T} *, int64_t, const {T} *,
                              int64_t, {T}, {T} *, int64_t);
typedef void (*cblas32_{T}_t)(int, int, int, int, int, int, {T}, const {T} *, int, const {T} *, int, {T}, {T} *, int);

/* rows x cols of a (stored row-major with row stride ld) rounded to TF32 into a new contiguous array */
static {T} *mc_rounded_{T}(const {T} *a, int64_t rows, int64_t cols, int64_t ld) {{
    {T} *out = ({T} *)malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof({T}));
    if (!out) return 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) out[r * cols + c] = ({T})mc_tf32((float)a[r * ld + c]);
    return out;
}}

/* the stand-in's product: row-major C = op(A) op(B) (+ C: beta 1), ``batch`` of them ``sa``/``sb``/``sc``
   elements apart */
int mc_cpu_gemm_{T}(void *ctx_, void *stream, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A_,
                    int64_t lda, int64_t sa, const void *B_, int64_t ldb, int64_t sb, void *C_, int64_t ldc,
                    int64_t sc, int64_t batch, int beta) {{
    const mc_gemm_ctx *ctx = (const mc_gemm_ctx *)ctx_;
    const {T} *A = (const {T} *)A_, *B = (const {T} *)B_;
    {T} *C = ({T} *)C_;
    if (!ctx->ilp64 && mc_too_large(m, n, k, lda, ldb, ldc, 1)) return MC_TOO_LARGE;
    for (int64_t b = 0; b < batch; b++) {{
        const {T} *a = A + b * sa, *bb = B + b * sb;
        {T} *ra = 0, *rb = 0;
        int64_t la = lda, lb = ldb;
        if (ctx->tf32 && sizeof({T}) == 4) {{   /* TF32's inputs: each operand rounded, the sum in float */
            const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
            ra = mc_rounded_{T}(a, ar, ac, lda); rb = mc_rounded_{T}(bb, br, bc, ldb);
            if (!ra || !rb) {{ free(ra); free(rb); return 2; }}
            a = ra; bb = rb; la = ac > 0 ? ac : 1; lb = bc > 0 ? bc : 1;
        }}
        if (ctx->ilp64)
            ((cblas64_{T}_t)ctx->blas)(101, ta ? 112 : 111, tb ? 112 : 111, m, n, k, ({T})1, a, la, bb, lb,
                                        ({T})beta, C + b * sc, ldc);
        else
            ((cblas32_{T}_t)ctx->blas)(101, ta ? 112 : 111, tb ? 112 : 111, (int)m, (int)n, (int)k, ({T})1, a,
                                        (int)la, bb, (int)lb, ({T})beta, C + b * sc, (int)ldc);
        free(ra); free(rb);
    }}
    return 0;
}}

typedef int (*cublas_gemm_ex_t)(void *, int, int, int, int, int, const void *, const void *, int, int, const void *,
                                int, int, const void *, void *, int, int, int, int);
typedef int (*cublas_gemm_batched_t)(void *, int, int, int, int, int, const void *, const void *, int, int,
                                     long long, const void *, int, int, long long, const void *, void *, int, int,
                                     long long, int, int, int);

/* the GPU's product through cuBLAS: row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, on the
   handle of ``stream`` (refused without one, and above cuBLAS's int sizes: never a silent wrap) */
int mc_cublas_gemm_{T}(void *ctx_, void *stream, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A,
                       int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc,
                       int64_t sc, int64_t batch, int beta) {{
    const mc_gemm_ctx *ctx = (const mc_gemm_ctx *)ctx_;
    const int dtype = sizeof({T}) == 4 ? 0 : 1;   /* CUDA_R_32F, CUDA_R_64F */
    const int compute = sizeof({T}) == 4 ? (ctx->tf32 ? 77 : 68) : 70;   /* CUBLAS_COMPUTE_32F(_FAST_TF32), _64F */
    const {T} one = 1, zero = beta ? 1 : 0;
    void *handle = ctx->stream[0] == stream ? ctx->handle[0] : ctx->stream[1] == stream ? ctx->handle[1] : 0;
    if (!handle) return MC_NO_HANDLE;
    if (mc_too_large(m, n, k, lda, ldb, ldc, batch)) return MC_TOO_LARGE;
    if (batch == 1)
        return ((cublas_gemm_ex_t)ctx->gemm_ex)(handle, tb, ta, (int)n, (int)m, (int)k, &one, B, dtype, (int)ldb,
                                                A, dtype, (int)lda, &zero, C, dtype, (int)ldc, compute, -1);
    return ((cublas_gemm_batched_t)ctx->gemm_batched)(handle, tb, ta, (int)n, (int)m, (int)k, &one, B, dtype,
                                                      (int)ldb, (long long)sb, A, dtype, (int)lda, (long long)sa,
                                                      &zero, C, dtype, (int)ldc, (long long)sc, (int)batch,
                                                      compute, -1);
}}
"""

GEMM_SIGNATURE = ("int {name}(void *ctx, void *stream, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A,"
                  " int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc, int64_t sc,"
                  " int64_t batch, int beta);")
LAUNCH_SIGNATURE = ("int {name}(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,"
                    " unsigned shmem, void *stream, void **params, void **extra);")


def shim_decls() -> str:
    """cffi declarations of the product context, the product shims and the launches."""
    return "\n".join(
        ["typedef struct { int64_t blas, ilp64, tf32; int64_t gemm_ex, gemm_batched; void *stream[2], *handle[2]; }"
         " mc_gemm_ctx;"]
        + [GEMM_SIGNATURE.format(name=n) for n in ("mc_noop_gemm", "mc_cpu_gemm_float", "mc_cpu_gemm_double",
                                                   "mc_cublas_gemm_float", "mc_cublas_gemm_double")]
        + [LAUNCH_SIGNATURE.format(name=n) for n in ("mc_standin_launch", "mc_noop_launch")]
        + ["int mc_noop_record(void *event, void *stream);",
           "int mc_noop_wait(void *stream, void *event, unsigned flags);",
           "int mc_standin_read(void *dst, const void *src, size_t bytes, void *stream);",
           "int mc_noop_read(void *dst, const void *src, size_t bytes, void *stream);",
           "int mc_noop_write(void *dst, const void *src, size_t bytes, void *stream);",
           "int mc_noop_sync(void *stream);"])
