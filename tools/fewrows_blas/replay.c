// Replay the recurrent products of Var-LSTM h512 b64 training steps (16 batches, row counts per timestep from
// varlstm_rows.txt): forward h.W_h (m x 512 . 512 x 2048), backward dg.W_h^T (m x 2048 . 2048 x 512), as the
// C runner routes them today (OpenBLAS: gemv at 1 row, C^T = B^T A^T on a transposed twin at 2..32 rows,
// plain sgemm above; one transposed copy of W_h per pass) vs MKL packed (one pack per pass, packed compute at
// 2+ rows, OpenBLAS gemv at 1 row). CPU time of the whole replay, medians of alternating rounds.
// The first-step rows skipped: what skipping the product of a known all-zero h0 would save.
// TWO=ob: the OpenBLAS route on OpenBLAS's 2 threads; TWO=split: MKL sequential, each product's columns split over
// this process's 2 threads (a spinning helper thread); both wall clock, so only meaningful on a quiet machine.
// usage: replay OPENBLAS MKL_RT ROWSFILE [rounds]
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <stdatomic.h>

typedef void (*ob_gemm_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                          int64_t, float, float *, int64_t);
typedef void (*ob_gemv_t)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t, float,
                          float *, int64_t);
typedef size_t (*mk_getsize_t)(int, int, int, int);
typedef void (*mk_pack_t)(int, int, int, int, int, int, float, const float *, int, float *);
typedef void (*mk_compute_t)(int, int, int, int, int, int, const float *, int, const float *, int, float, float *,
                             int);
static ob_gemm_t ob_gemm; static ob_gemv_t ob_gemv;
static mk_getsize_t mk_getsize; static mk_pack_t mk_pack; static mk_compute_t mk_compute;

static int wall; static double cpu(void) { struct timespec t; clock_gettime(wall ? CLOCK_MONOTONIC : CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static int rows[16][128], nrows[16];
static float *W, *WT, *BP, *A, *C, *T, *BP0, *BP1;
static atomic_int go, done;
static int w_m, w_n, w_k; static const float *w_bp; static float *w_c; static int w_ldc;
static void *worker(void *arg) {
    (void)arg; int seen = 0;
    for (;;) {
        int g;
        while ((g = atomic_load_explicit(&go, memory_order_acquire)) == seen) __builtin_ia32_pause();
        if (g < 0) return 0;
        seen = g;
        mk_compute(101, 111, 151, w_m, w_n, w_k, A, w_k, w_bp, 0, 0.0f, w_c, w_ldc);
        atomic_store_explicit(&done, g, memory_order_release);
    }
}
static void split_pass(int b, int k, int n, const float *Bc, int skip_first) {
    int n0 = n / 2;
    mk_pack(101, 162, 111, 64, n0, k, 1.0f, Bc, n, BP0);
    mk_pack(101, 162, 111, 64, n - n0, k, 1.0f, Bc + n0, n, BP1);
    for (int s = skip_first; s < nrows[b]; s++) {
        int m = rows[b][s];
        w_m = m; w_n = n - n0; w_k = k; w_bp = BP1; w_c = C + n0; w_ldc = n;
        int g = atomic_load(&go) + 1;
        atomic_store_explicit(&go, g, memory_order_release);
        mk_compute(101, 111, 151, m, n0, k, A, k, BP0, 0, 0.0f, C, n);
        while (atomic_load_explicit(&done, memory_order_acquire) != g) __builtin_ia32_pause();
    }
}

static void transpose(const float *src, int r, int c, float *dst) {   /* dst (c x r) = src^T, 16-col panels */
    for (int j0 = 0; j0 < c; j0 += 16)
        for (int i = 0; i < r; i++)
            for (int j = j0; j < j0 + 16 && j < c; j++) dst[j * r + i] = src[i * c + j];
}

/* one pass: B is k x n (contiguous in Bc), its transpose n x k in Bt; mode 0 OpenBLAS route, 1 MKL packed */
static void pass(int mode, int b, int k, int n, const float *Bc, float *Bt, int skip_first) {
    if (mode == 0) transpose(Bc, k, n, Bt);
    else mk_pack(101, 162, 111, 64, n, k, 1.0f, Bc, n, BP);
    for (int s = skip_first; s < nrows[b]; s++) {
        int m = rows[b][s];
        if (m == 1) ob_gemv(101, 112, k, n, 1.0f, Bc, n, A, 1, 0.0f, C, 1);
        else if (mode == 1) mk_compute(101, 111, 151, m, n, k, A, k, BP, 0, 0.0f, C, n);
        else if (m <= 32) {
            ob_gemm(101, 111, 112, n, m, k, 1.0f, Bt, k, A, k, 0.0f, T, m);
            for (int j0 = 0; j0 < n; j0 += 64) {
                int j1 = j0 + 64 < n ? j0 + 64 : n;
                for (int r = 0; r < m; r++)
                    for (int j = j0; j < j1; j++) C[r * n + j] = T[j * m + r];
            }
        } else ob_gemm(101, 111, 111, m, n, k, 1.0f, A, k, Bc, n, 0.0f, C, n);
    }
}

static double replay(int mode, int skip_first) {
    double t0 = cpu();
    if (mode == 2) {
        for (int b = 0; b < 16; b++) { split_pass(b, 512, 2048, W, skip_first); split_pass(b, 2048, 512, WT, 0); }
        return cpu() - t0;
    }
    for (int b = 0; b < 16; b++) {
        pass(mode, b, 512, 2048, W, WT, skip_first);    /* forward: h . W_h */
        pass(mode, b, 2048, 512, WT, W, 0);             /* backward: dg . W_h^T (W_h^T made contiguous) */
    }
    return cpu() - t0;
}

static int cmpd(const void *x, const void *y) { double a = *(double *)x, b = *(double *)y; return a < b ? -1 : a > b; }

int main(int argc, char **argv) {
    void *ob = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    ob_gemm = (ob_gemm_t)dlsym(ob, "scipy_cblas_sgemm64_");
    ob_gemv = (ob_gemv_t)dlsym(ob, "scipy_cblas_sgemv64_");
    wall = getenv("TWO") != 0;
    ((void (*)(int))dlsym(ob, "scipy_openblas_set_num_threads64_"))(wall ? 2 : 1);
    void *mk = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    ((int (*)(int))dlsym(mk, "MKL_Set_Threading_Layer"))(1);
    mk_getsize = (mk_getsize_t)dlsym(mk, "cblas_sgemm_pack_get_size");
    mk_pack = (mk_pack_t)dlsym(mk, "cblas_sgemm_pack");
    mk_compute = (mk_compute_t)dlsym(mk, "cblas_sgemm_compute");
    FILE *f = fopen(argv[3], "r");
    for (int b = 0; b < 16; b++) {
        nrows[b] = 0;
        int c;
        while (fscanf(f, "%d", &rows[b][nrows[b]]) == 1) {
            nrows[b]++;
            while ((c = fgetc(f)) == ' ') {}
            if (c == '\n' || c == EOF) break;
            ungetc(c, f);
        }
    }
    int rounds = argc > 4 ? atoi(argv[4]) : 7;
    W = malloc(4 << 22); WT = malloc(4 << 22); T = malloc(4 << 20); A = malloc(4 << 20); C = malloc(4 << 20);
    size_t ps = mk_getsize(162, 64, 2048, 2048);
    BP = malloc(ps);
    for (long i = 0; i < 512 * 2048; i++) W[i] = (float)((i * 7919L) % 1000) / 1000.0f - 0.5f;
    for (int i = 0; i < 64 * 2048; i++) A[i] = (float)((i * 31) % 100) / 100.0f;
    transpose(W, 512, 2048, WT);
    {   /* the packed product equals OpenBLAS's to rounding */
        float *C2 = malloc(4 << 20);
        mk_pack(101, 162, 111, 64, 2048, 512, 1.0f, W, 2048, BP);
        for (int m = 2; m <= 64; m += 31) {
            mk_compute(101, 111, 151, m, 2048, 512, A, 512, BP, 0, 0.0f, C, 2048);
            ob_gemm(101, 111, 111, m, 2048, 512, 1.0f, A, 512, W, 2048, 0.0f, C2, 2048);
            double d = 0; for (int i = 0; i < m * 2048; i++) { double e = C[i] - C2[i]; if (e < 0) e = -e; if (e > d) d = e; }
            printf("m=%d max |mkl - openblas| = %.2e\n", m, d);
        }
        free(C2);
    }
    double t[4][64];
    BP0 = malloc(ps); BP1 = malloc(ps);
    if (wall) {   /* 2 threads: OpenBLAS route on its 2 threads (alone in this process) or MKL split over ours */
        int split = !strcmp(getenv("TWO"), "split");
        pthread_t th;
        if (split) pthread_create(&th, 0, worker, 0);
        for (int r = 0; r < rounds; r++) t[0][r] = replay(split ? 2 : 0, 0);
        qsort(t[0], rounds, sizeof(double), cmpd);
        printf("2 threads, %-10s median %.1f ms per step (min %.1f, max %.1f)\n", split ? "mkl split" : "openblas",
               t[0][rounds / 2] / 16 * 1e3, t[0][0] / 16 * 1e3, t[0][rounds - 1] / 16 * 1e3);
        if (split) { atomic_store(&go, -1); pthread_join(th, 0); }
        return 0;
    }
    replay(0, 0); replay(1, 0);
    for (int r = 0; r < rounds; r++)
        for (int c = 0; c < 4; c++) t[c][r] = replay(c & 1, c >> 1);
    const char *names[4] = {"openblas route", "mkl packed", "openblas, first step skipped", "mkl, first skipped"};
    for (int c = 0; c < 4; c++) {
        qsort(t[c], rounds, sizeof(double), cmpd);
        printf("%-30s median %.1f ms per step (min %.1f, max %.1f)\n", names[c], t[c][rounds / 2] / 16 * 1e3,
               t[c][0] / 16 * 1e3, t[c][rounds - 1] / 16 * 1e3);
    }
    /* pack and transpose cost per pass */
    double t0 = cpu(); for (int i = 0; i < 20; i++) mk_pack(101, 162, 111, 64, 2048, 512, 1.0f, W, 2048, BP);
    double tp = (cpu() - t0) / 20;
    t0 = cpu(); for (int i = 0; i < 20; i++) transpose(W, 512, 2048, WT);
    double tt = (cpu() - t0) / 20;
    printf("pack W_h %.0f us, transpose W_h %.0f us\n", tp * 1e6, tt * 1e6);
    return 0;
}
