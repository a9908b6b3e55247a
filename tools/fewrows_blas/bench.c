// Few-row GEMM microbenchmark (issue 17): numpy's OpenBLAS vs Intel MKL (plain sgemm, packed B) at 1/2 threads.
// usage: bench OPENBLAS_PATH MKL_RT_PATH THREADS LAYER(seq|gnu) [MASK]
// Columns (MASK picks them, "1" = run): OpenBLAS C = A.B; OpenBLAS C^T = B^T.A^T on a transposed copy of B, then
// transposed into C (the C runner's route for 2..32 rows by a wide static); OpenBLAS gemv (1 row); MKL
// sgemm; MKL packed compute (B packed once); MKL packed split over two threads of ours (THREADS=2, seq layer).
// Env: CPU=1 times process CPU time (1 thread only), MS=4,16,... the row counts, NS=n the first n shapes.
// With two libraries' threads in one process they fight for 2 cores: measure one library per process.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*ob_gemm_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                          int64_t, float, float *, int64_t);
typedef void (*ob_gemv_t)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t, float,
                          float *, int64_t);
typedef void (*mk_gemm_t)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                          float *, int);
typedef size_t (*mk_getsize_t)(int, int, int, int);
typedef void (*mk_pack_t)(int, int, int, int, int, int, float, const float *, int, float *);
typedef void (*mk_compute_t)(int, int, int, int, int, int, const float *, int, const float *, int, float, float *,
                             int);

static ob_gemm_t ob_gemm; static ob_gemv_t ob_gemv;
static mk_gemm_t mk_gemm; static mk_getsize_t mk_getsize; static mk_pack_t mk_pack; static mk_compute_t mk_compute;

static int use_cpu; static double now(void) { struct timespec t; clock_gettime(use_cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* one spinning helper thread for the "own 2 threads" split */
static atomic_int go, done;
static int w_m, w_n, w_k; static const float *w_a; static float *w_bp, *w_c; static int w_lda, w_ldc;
static void *worker(void *arg) {
    (void)arg;
    int seen = 0;
    for (;;) {
        int g;
        while ((g = atomic_load_explicit(&go, memory_order_acquire)) == seen) __builtin_ia32_pause();
        if (g < 0) return 0;
        seen = g;
        mk_compute(101, 111, 151, w_m, w_n, w_k, w_a, w_lda, w_bp, 0, 0.0f, w_c, w_ldc);
        atomic_store_explicit(&done, g, memory_order_release);
    }
}

static int cmpd(const void *x, const void *y) { double a = *(double *)x, b = *(double *)y; return a < b ? -1 : a > b; }

int main(int argc, char **argv) {
    int threads = atoi(argv[3]); use_cpu = getenv("CPU") != 0;
    const char *mask = argc > 5 ? argv[5] : "111111";
    void *ob = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!ob) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    ob_gemm = (ob_gemm_t)dlsym(ob, "scipy_cblas_sgemm64_");
    ob_gemv = (ob_gemv_t)dlsym(ob, "scipy_cblas_sgemv64_");
    void (*ob_set)(int) = (void (*)(int))dlsym(ob, "scipy_openblas_set_num_threads64_");
    ob_set(mask[0] == '1' || mask[1] == '1' || mask[2] == '1' ? threads : 1);
    void *mk = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!mk) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    int (*set_layer)(int) = (int (*)(int))dlsym(mk, "MKL_Set_Threading_Layer");
    int gnu = !strcmp(argv[4], "gnu");
    set_layer(gnu ? 3 : 1);
    void (*mk_set_threads)(int) = (void (*)(int))dlsym(mk, "MKL_Set_Num_Threads");
    mk_set_threads(gnu ? threads : 1);
    mk_gemm = (mk_gemm_t)dlsym(mk, "cblas_sgemm");
    mk_getsize = (mk_getsize_t)dlsym(mk, "cblas_sgemm_pack_get_size");
    mk_pack = (mk_pack_t)dlsym(mk, "cblas_sgemm_pack");
    mk_compute = (mk_compute_t)dlsym(mk, "cblas_sgemm_compute");
    int (*ver)(char *, int) = (int (*)(char *, int))dlsym(mk, "MKL_Get_Version_String");
    char vs[256]; ver(vs, 255); vs[255] = 0;
    fprintf(stderr, "%s\n", vs);
    pthread_t th;
    int split = !gnu && threads == 2;
    if (split) pthread_create(&th, 0, worker, 0);

    int shapes[][2] = {{512, 2048}, {2048, 512}, {128, 512}, {512, 512}, {1024, 1536}, {1536, 1024}};
    int nshapes = getenv("NS") ? atoi(getenv("NS")) : 6;
    int ms[16], nm = 0;
    for (char *p = getenv("MS") ? getenv("MS") : "1,4,16,64"; *p; ) { ms[nm++] = (int)strtol(p, &p, 10); if (*p == ',') p++; }
    printf("# threads=%d layer=%s   GFLOP/s (median of rounds); pack_us = time to pack B once\n", threads, argv[4]);
    printf("%5s %5s %3s | %8s %8s %8s %8s %8s %8s | %8s\n", "K", "N", "M", "ob", "ob_twin", "ob_gemv", "mkl",
           "mklpack", "mkpk2thr", "pack_us");
    for (int s = 0; s < nshapes; s++) {
        int K = shapes[s][0], N = shapes[s][1];
        float *B = malloc(sizeof(float) * K * N), *BT = malloc(sizeof(float) * K * N);
        for (int i = 0; i < K * N; i++) B[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
        for (int i = 0; i < K; i++) for (int j = 0; j < N; j++) BT[j * K + i] = B[i * N + j];
        size_t psz = mk_getsize(162, 64, N, K);
        float *BP = malloc(psz);
        int N0 = N / 2, N1 = N - N0;
        float *BP0 = malloc(mk_getsize(162, 64, N0, K)), *BP1 = malloc(mk_getsize(162, 64, N1, K));
        mk_pack(101, 162, 111, 64, N, K, 1.0f, B, N, BP);
        double tp = now();
        for (int r = 0; r < 20; r++) mk_pack(101, 162, 111, 64, N, K, 1.0f, B, N, BP);
        double pack_us = (now() - tp) / 20 * 1e6;
        mk_pack(101, 162, 111, 64, N0, K, 1.0f, B, N, BP0);
        mk_pack(101, 162, 111, 64, N1, K, 1.0f, B + N0, N, BP1);
        for (int mi = 0; mi < nm; mi++) {
            int M = ms[mi];
            float *A = malloc(sizeof(float) * M * K), *C = malloc(sizeof(float) * M * N),
                  *T = malloc(sizeof(float) * M * N);
            for (int i = 0; i < M * K; i++) A[i] = (float)((i * 31) % 100) / 100.0f;
            double flops = 2.0 * M * N * K;
            int reps = (int)(2e8 / flops) + 3;
            enum { NC = 6, R = 9 };
            double t[NC][R];
            for (int r = 0; r < R; r++) {
                for (int c = 0; c < NC; c++) {
                    if ((c == 2 && M != 1) || mask[c] != '1') { t[c][r] = 0; continue; }
                    if (c == 5 && !split) { t[c][r] = 0; continue; }
                    double t0 = now();
                    for (int i = 0; i < reps; i++) {
                        switch (c) {
                        case 0: ob_gemm(101, 111, 111, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N); break;
                        case 1:
                            ob_gemm(101, 111, 112, N, M, K, 1.0f, BT, K, A, K, 0.0f, T, M);
                            for (int j0 = 0; j0 < N; j0 += 64) {
                                int j1 = j0 + 64 < N ? j0 + 64 : N;
                                for (int rr = 0; rr < M; rr++)
                                    for (int j = j0; j < j1; j++) C[rr * N + j] = T[j * M + rr];
                            }
                            break;
                        case 2: ob_gemv(101, 112, K, N, 1.0f, B, N, A, 1, 0.0f, C, 1); break;
                        case 3: mk_gemm(101, 111, 111, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N); break;
                        case 4: mk_compute(101, 111, 151, M, N, K, A, K, BP, 0, 0.0f, C, N); break;
                        case 5: {
                            w_m = M; w_n = N1; w_k = K; w_a = A; w_lda = K; w_bp = BP1; w_c = C + N0; w_ldc = N;
                            int g = atomic_load(&go) + 1;
                            atomic_store_explicit(&go, g, memory_order_release);
                            mk_compute(101, 111, 151, M, N0, K, A, K, BP0, 0, 0.0f, C, N);
                            while (atomic_load_explicit(&done, memory_order_acquire) != g) __builtin_ia32_pause();
                            break;
                        }
                        }
                    }
                    t[c][r] = (now() - t0) / reps;
                }
            }
            printf("%5d %5d %3d |", K, N, M);
            for (int c = 0; c < NC; c++) {
                qsort(t[c], R, sizeof(double), cmpd);
                double med = t[c][R / 2];
                if (med == 0) printf(" %8s", "-"); else printf(" %8.1f", flops / med * 1e-9);
            }
            printf(" | %8.0f\n", mi == 0 ? pack_us : 0.0);
            fflush(stdout);
            free(A); free(C); free(T);
        }
        free(B); free(BT); free(BP); free(BP0); free(BP1);
    }
    if (split) { atomic_store(&go, -1); pthread_join(th, 0); }
    return 0;
}
