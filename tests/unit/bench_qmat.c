/* bench_qmat.c: the quantized GEMM alone (kernels/cpu/qmat.h), not a test.
 *
 *   chunkserve-bench-qmat [TYPE ROWS COLS TOKENS THREADS ROUNDS]
 *   (defaults: q4_k 8960 1536 512 2 7; TYPE q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k)
 *
 * One matrix of random blocks in the file's layout, one random activation
 * matrix; per round, every kernel set this CPU runs (AMX, AVX-512 VNNI,
 * AVX2, the reference only for small shapes) computes the same GEMM in turn,
 * so the sets see the same machine noise. Prints each set's median, min and
 * max over the rounds in int8 GMAC/s (rows x cols x tokens per second) and
 * its median ratio to the first set. Also checks the sets agree to the bit,
 * as test_qmat does, so a fast wrong kernel cannot report a figure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chunkserve/backend.h"
#include "qmat.h"

static uint64_t rng = 0x9e3779b97f4a7c15u;
static uint32_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Block bytes, and where its fp16 scales sit (offsets; -1 none). */
static const struct {
    const char *name;
    int type, weights, bytes, s0, s1;
} types[] = {
    {"q4_0", CS_QMAT_Q4_0, 32, 18, 0, -1},  {"q4_1", CS_QMAT_Q4_1, 32, 20, 0, 2},
    {"q5_0", CS_QMAT_Q5_0, 32, 22, 0, -1},  {"q5_1", CS_QMAT_Q5_1, 32, 24, 0, 2},
    {"q8_0", CS_QMAT_Q8_0, 32, 34, 0, -1},  {"q4_k", CS_QMAT_Q4_K, 256, 144, 0, 2},
    {"q5_k", CS_QMAT_Q5_K, 256, 176, 0, 2}, {"q6_k", CS_QMAT_Q6_K, 256, 210, 208, -1},
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const char *tname = argc > 1 ? argv[1] : "q4_k";
    int64_t rows = argc > 2 ? atoll(argv[2]) : 8960, cols = argc > 3 ? atoll(argv[3]) : 1536;
    int tokens = argc > 4 ? atoi(argv[4]) : 512, threads = argc > 5 ? atoi(argv[5]) : 2;
    int rounds = argc > 6 ? atoi(argv[6]) : 7;
    int ti = -1;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(types[i].name, tname)) ti = (int)i;
    if (ti < 0 || rows < 1 || cols < 1 || cols % types[ti].weights || tokens < 1 || threads < 1 ||
        rounds < 1 || rounds > 101) {
        fprintf(stderr, "usage: chunkserve-bench-qmat [TYPE ROWS COLS TOKENS THREADS ROUNDS]\n"
                        "  TYPE q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k; COLS a multiple of its "
                        "block (32, 256 for K-quants); ROUNDS 1..101\n");
        return 2;
    }
    const size_t nblk = (size_t)(rows * cols / types[ti].weights);
    uint8_t *src = malloc(nblk * (size_t)types[ti].bytes);
    float *x = malloc((size_t)tokens * (size_t)cols * sizeof(float));
    float *out[4];
    if (!src || !x) return 1;
    for (size_t i = 0; i < nblk * (size_t)types[ti].bytes; i++)
        src[i] = (uint8_t)next();
    for (size_t b = 0; b < nblk; b++) { /* finite scales: fp16 0.004 .. 0.008 */
        uint8_t *p = src + b * (size_t)types[ti].bytes;
        uint16_t h = (uint16_t)(0x1c00 | (next() & 0x3ff));
        p[types[ti].s0] = (uint8_t)h, p[types[ti].s0 + 1] = (uint8_t)(h >> 8);
        if (types[ti].s1 >= 0)
            p[types[ti].s1] = (uint8_t)h, p[types[ti].s1 + 1] = (uint8_t)(h >> 8);
    }
    for (size_t i = 0; i < (size_t)tokens * (size_t)cols; i++)
        x[i] = (float)(int32_t)next() / 2147483648.0f;
    cs_qmat_src s = {types[ti].type, src, rows, NULL};
    cs_qmat *w;
    cs_threadpool *pool;
    if (cs_qmat_pack(&s, 1, cols, &w) || cs_threadpool_init(threads, &pool)) return 1;
    cs_qact a;
    void *abuf = aligned_alloc(64, (cs_qact_bytes(tokens, cols) + 63) / 64 * 64);
    if (!abuf) return 1;
    cs_qact_init(&a, abuf, tokens, cols, w->act_group);
    cs_op_quantize(pool, &a, x);

    int sets[4], n_sets = 0;
    const double work = (double)rows * (double)cols * tokens;
    if (cs__qmat_amx_usable()) sets[n_sets++] = CS_QMAT_KERNELS_AMX;
    if (cs__qmat_vnni_usable()) sets[n_sets++] = CS_QMAT_KERNELS_VNNI;
    if (cs__qmat_avx2_usable()) sets[n_sets++] = CS_QMAT_KERNELS_AVX2;
    if (work <= 1e9 || n_sets == 0) sets[n_sets++] = CS_QMAT_KERNELS_REF;
    double t[4][101];
    /* 64-byte aligned, as the engine's step buffers are (backend_cpu.c) */
    const size_t out_bytes = ((size_t)tokens * (size_t)rows * sizeof(float) + 63) / 64 * 64;
    for (int k = 0; k < n_sets; k++)
        if (!(out[k] = aligned_alloc(64, out_bytes))) return 1;
    int bad = 0;
    for (int r = -1; r < rounds; r++) /* round -1 warms up (and faults the pages in) */
        for (int k = 0; k < n_sets; k++) {
            cs__qmat_force_kernels(sets[k]);
            cs_qout o = {out[k], rows, NULL};
            double t0 = now();
            cs_op_qmatmul(pool, &o, &a, w);
            if (r >= 0) t[k][r] = now() - t0;
            if (r < 0 && k > 0 &&
                memcmp(out[k], out[0], (size_t)tokens * (size_t)rows * sizeof(float)))
                bad = 1;
        }
    cs__qmat_force_kernels(CS_QMAT_KERNELS_AUTO);
    printf("%s %lld x %lld, %d tokens, %d threads, %d rounds (int8 GMAC/s; median min max)\n",
           tname, (long long)rows, (long long)cols, tokens, threads, rounds);
    double base = 0;
    for (int k = 0; k < n_sets; k++) {
        qsort(t[k], (size_t)rounds, sizeof(double), cmp_double);
        double med = work / t[k][rounds / 2] / 1e9;
        if (k == 0) base = med;
        cs__qmat_force_kernels(sets[k]);
        printf("  %-13s %8.1f %8.1f %8.1f   x%.2f\n", cs_qmat_kernels_name(), med,
               work / t[k][rounds - 1] / 1e9, work / t[k][0] / 1e9, med / base);
    }
    cs__qmat_force_kernels(CS_QMAT_KERNELS_AUTO);
    if (bad) fprintf(stderr, "kernel sets disagree: a kernel is wrong (run test_qmat)\n");
    for (int k = 0; k < n_sets; k++)
        free(out[k]);
    free(abuf), free(src), free(x);
    cs_qmat_free(w);
    cs_threadpool_free(pool);
    return bad;
}
