/* test_qmat.c: the quantized GEMM of kernels/cpu/qmat.h.
 *
 * Bitwise (memcmp): every kernel set this CPU runs (AMX, AVX-512 VNNI,
 * AVX2) == the plain C reference (GEMM and activation quantizer), for every
 * type, token counts 1..70 (every tile shape), rows that do not fill a
 * panel, biases and stacked parts; a token's output alone == the same token
 * inside a GEMM of many tokens; 1 == 2 == 3 threads. Values: packed rows read back equal the GGUF
 * dequantizer's formula, the GEMM equals sum_k w[k] * xhat[k] of the dequantized weights and
 * activations to fp32 rounding, and is close to the fp32 product (the quantization error of 8-bit
 * activations). The fused prologues (add + RMSNorm + quantize, SwiGLU +
 * quantize) == the ops they join, bit for bit. Bad shapes: CS_EINVAL. */
#include <stdint.h>

#include "backend.h"
#include "qmat.h"
#include "test.h"

static cs_threadpool *pools[3];

static uint64_t rng = 0x2545f4914f6cdd1du;
static uint32_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float frand(void) { /* [-1, 1) */
    return (float)(next() >> 8) / (float)(1 << 23) - 1.0f;
}

static uint16_t f16(float f) { /* for test data: positive normal scales only */
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    int e = (int)((x >> 23) & 0xff) - 127 + 15;
    ASSERT_TRUE(e > 0 && e < 31);
    return (uint16_t)((x >> 16 & 0x8000) | (uint32_t)e << 10 | ((x >> 13) & 0x3ff));
}
static float f32_of_f16(uint16_t h) {
    uint32_t bits = (uint32_t)(h & 0x8000) << 16 | (((h >> 10) & 0x1f) + 127 - 15) << 23 |
                    (uint32_t)(h & 0x3ff) << 13;
    if (!(h & 0x7fff)) bits = (uint32_t)(h & 0x8000) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static size_t block_bytes(int type) {
    return type == CS_QMAT_Q4_0 ? 18 : type == CS_QMAT_Q4_1 ? 20 : type == CS_QMAT_Q8_0 ? 34 : 128;
}

/* A random matrix in the file's layout, and its fp32 dequantization. */
static void *make_src(int type, int64_t rows, int64_t cols, float *deq) {
    int64_t nb = cols / 32;
    uint8_t *s = malloc((size_t)(rows * nb) * block_bytes(type));
    ASSERT_TRUE(s);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = s + (size_t)(r * nb + b) * block_bytes(type);
            float *o = deq + r * cols + b * 32;
            float d = 0.001f + 0.02f * (float)(next() % 1000) / 1000.0f;
            float m = -0.001f - 0.1f * (float)(next() % 1000) / 1000.0f;
            uint16_t dh = f16(d), mh = f16(-m);
            mh |= 0x8000; /* negative min, as real Q4_1 files have */
            float df = f32_of_f16(dh), mf = f32_of_f16(mh);
            if (type == CS_QMAT_F32) {
                float *x = (float *)(void *)p;
                for (int i = 0; i < 32; i++)
                    o[i] = x[i] = frand() * 0.5f;
                continue;
            }
            p[0] = (uint8_t)dh, p[1] = (uint8_t)(dh >> 8);
            if (type == CS_QMAT_Q8_0) {
                for (int i = 0; i < 32; i++) {
                    int8_t q = (int8_t)(next() % 255 - 127);
                    p[2 + i] = (uint8_t)q;
                    o[i] = df * (float)q;
                }
            } else {
                uint8_t *qs = p + (type == CS_QMAT_Q4_1 ? 4 : 2);
                if (type == CS_QMAT_Q4_1) p[2] = (uint8_t)mh, p[3] = (uint8_t)(mh >> 8);
                for (int i = 0; i < 16; i++) {
                    qs[i] = (uint8_t)(next() & 0xff);
                    int lo = qs[i] & 15, hi = qs[i] >> 4;
                    if (type == CS_QMAT_Q4_0) {
                        o[i] = df * (float)(lo - 8);
                        o[i + 16] = df * (float)(hi - 8);
                    } else {
                        o[i] = fmaf(df, (float)lo, mf);
                        o[i + 16] = fmaf(df, (float)hi, mf);
                    }
                }
            }
        }
    return s;
}

static float *alloc_f(size_t n) {
    float *p = calloc(n, sizeof(float));
    ASSERT_TRUE(p);
    return p;
}

/* GEMM through the dispatcher (VNNI where usable) vs the reference. */
static void gemm_case(int type, int n_parts, const int64_t *rows, int64_t cols, int max_tokens,
                      bool bias) {
    cs_qmat_src src[4];
    float *deq[4], *b[4] = {0};
    int64_t total = 0;
    for (int p = 0; p < n_parts; p++) {
        deq[p] = alloc_f((size_t)(rows[p] * cols));
        src[p] = (cs_qmat_src){type, make_src(type, rows[p], cols, deq[p]), rows[p], NULL};
        if (bias) {
            b[p] = alloc_f((size_t)rows[p]);
            for (int64_t r = 0; r < rows[p]; r++)
                b[p][r] = frand();
        }
        total += rows[p];
    }
    cs_qmat *w;
    ASSERT_EQ_INT(cs_qmat_pack(src, n_parts, cols, &w), 0);
    ASSERT_EQ_INT(cs_qmat_type(w), type == CS_QMAT_F32 ? CS_QMAT_Q8_0 : type);

    /* rows read back == the dequantizer's formula (F32 sources were requantized) */
    if (type != CS_QMAT_F32) {
        float *row = alloc_f((size_t)cols);
        for (int32_t r = 0; r < rows[0]; r += 7) {
            cs_qmat_get_rows(w, 0, &r, 1, row);
            ASSERT_TRUE(memcmp(row, deq[0] + r * cols, (size_t)cols * sizeof(float)) == 0);
        }
        free(row);
    }

    int T = max_tokens;
    float *x = alloc_f((size_t)(T * cols));
    for (int64_t i = 0; i < T * cols; i++)
        x[i] = frand() * (i % 97 == 0 ? 8.0f : 1.0f); /* some outliers */
    for (int64_t k = 0; k < cols; k++)
        x[k] = 0.0f; /* token 0 block 0.. all zero: amax 0 */
    void *abuf = aligned_alloc(64, (cs_qact_bytes(T, cols) + 63) / 64 * 64);
    void *abuf2 = aligned_alloc(64, (cs_qact_bytes(T, cols) + 63) / 64 * 64);
    ASSERT_TRUE(abuf && abuf2);
    cs_qact a, a2;
    cs_qact_init(&a, abuf, T, cols);
    cs_qact_init(&a2, abuf2, T, cols);
    cs_op_quantize_ref(&a, x);
    cs_op_quantize(pools[1], &a2, x); /* the VNNI rows where this CPU has them */
    ASSERT_TRUE(memcmp(a.q, a2.q, (size_t)(T * cols)) == 0);
    ASSERT_TRUE(memcmp(a.meta, a2.meta, sizeof(cs_qblock) * (size_t)(T * (cols / 32))) == 0);

    float *ref[4], *fast[4];
    cs_qout oref[4], ofast[4];
    for (int p = 0; p < n_parts; p++) {
        ref[p] = alloc_f((size_t)(T * rows[p] + 1));
        fast[p] = alloc_f((size_t)(T * rows[p] + 1));
        ref[p][T * rows[p]] = fast[p][T * rows[p]] = 12345.0f; /* guard */
        oref[p] = (cs_qout){ref[p], rows[p], b[p]};
        ofast[p] = (cs_qout){fast[p], rows[p], b[p]};
    }
    cs_op_qmatmul_ref(oref, &a, w);
    /* every kernel set this CPU runs, every token count, every pool: the same
     * bits as the reference's rows */
    for (int kind = CS_QMAT_KERNELS_REF; kind <= CS_QMAT_KERNELS_AMX; kind++) {
        if (kind == CS_QMAT_KERNELS_AVX2 && !cs__qmat_avx2_usable()) continue;
        if (kind == CS_QMAT_KERNELS_VNNI && !cs__qmat_vnni_usable()) continue;
        if (kind == CS_QMAT_KERNELS_AMX && !cs__qmat_amx_usable()) continue;
        cs__qmat_force_kernels(kind);
        for (int nt = 1; nt <= T; nt += (nt < 12 ? 1 : 7)) {
            cs_qact sub = a; /* the first nt tokens of a */
            sub.n_tokens = nt;
            for (int k = 0; k < 3; k++) {
                for (int p = 0; p < n_parts; p++)
                    memset(fast[p], 0xff, (size_t)(nt * rows[p]) * sizeof(float));
                cs_op_qmatmul(pools[k], ofast, &sub, w);
                for (int p = 0; p < n_parts; p++) {
                    if (memcmp(fast[p], ref[p], (size_t)(nt * rows[p]) * sizeof(float)) != 0) {
                        fprintf(stderr,
                                "type %d part %d: %d tokens on %d threads, kernels %d differ\n",
                                type, p, nt, k + 1, kind);
                        for (int64_t i = 0; i < nt * rows[p]; i++)
                            if (memcmp(&fast[p][i], &ref[p][i], sizeof(float)))
                                fprintf(stderr, "  [%lld] %.9g != %.9g\n", (long long)i, fast[p][i],
                                        ref[p][i]);
                        exit(1);
                    }
                    ASSERT_TRUE(fast[p][T * rows[p]] == 12345.0f);
                }
            }
        }
    }
    cs__qmat_force_kernels(CS_QMAT_KERNELS_AUTO);
    /* values: the formula in double against the dequantized operands */
    double err = 0, norm = 0;
    for (int p = 0; p < n_parts; p++) {
        float *wd = alloc_f((size_t)(rows[p] * cols));
        for (int32_t r = 0; r < rows[p]; r++)
            cs_qmat_get_rows(w, p, &r, 1, wd + (size_t)r * cols);
        for (int t = 0; t < T; t++)
            for (int64_t r = 0; r < rows[p]; r++) {
                double exact = b[p] ? b[p][r] : 0, quant = exact;
                for (int64_t k = 0; k < cols; k++) {
                    const cs_qblock *mb = &a.meta[t * (cols / 32) + k / 32];
                    exact += (double)wd[r * cols + k] * x[t * cols + k];
                    quant += (double)wd[r * cols + k] * (double)mb->dx * a.q[t * cols + k];
                }
                double got = ref[p][t * rows[p] + r];
                ASSERT_NEAR(got, quant, 1e-4 * (1 + fabs(quant)));
                err += (got - exact) * (got - exact);
                norm += exact * exact;
            }
        free(wd);
    }
    ASSERT_TRUE(sqrt(err / norm) < 0.02); /* 8-bit activations */
    for (int p = 0; p < n_parts; p++) {
        free(deq[p]), free(b[p]), free(ref[p]), free(fast[p]);
        free((void *)src[p].data);
    }
    free(x), free(abuf), free(abuf2);
    cs_qmat_free(w);
}

static void test_bad_shapes(void) {
    float data[64] = {0};
    cs_qmat *w = (cs_qmat *)1;
    cs_qmat_src s = {CS_QMAT_F32, data, 2, NULL};
    ASSERT_EQ_INT(cs_qmat_pack(&s, 1, 33, &w), CS_EINVAL);
    ASSERT_TRUE(w == NULL);
    ASSERT_EQ_INT(cs_qmat_pack(&s, 0, 32, &w), CS_EINVAL);
    cs_qmat_src mixed[2] = {s, {CS_QMAT_Q8_0, data, 1, NULL}};
    ASSERT_EQ_INT(cs_qmat_pack(mixed, 2, 32, &w), CS_EINVAL);
    s.rows = 0;
    ASSERT_EQ_INT(cs_qmat_pack(&s, 1, 32, &w), CS_EINVAL);
}

/* perm: packed row r is source row perm[r]. */
static void test_perm(void) {
    int64_t rows = 20, cols = 64;
    float *deq = alloc_f((size_t)(rows * cols));
    void *s = make_src(CS_QMAT_Q8_0, rows, cols, deq);
    int32_t perm[20];
    for (int r = 0; r < 20; r++)
        perm[r] = (r * 7) % 20;
    cs_qmat_src src = {CS_QMAT_Q8_0, s, rows, perm};
    cs_qmat *w;
    ASSERT_EQ_INT(cs_qmat_pack(&src, 1, cols, &w), 0);
    float row[64];
    for (int32_t r = 0; r < 20; r++) {
        cs_qmat_get_rows(w, 0, &r, 1, row);
        ASSERT_TRUE(memcmp(row, deq + perm[r] * cols, sizeof row) == 0);
    }
    cs_qmat_free(w);
    free(s), free(deq);
}

static bool same_qact(const cs_qact *a, const cs_qact *b) {
    return memcmp(a->q, b->q, (size_t)a->n_tokens * (size_t)a->cols) == 0 &&
           memcmp(a->meta, b->meta, (size_t)a->n_tokens * (size_t)a->n_blocks * sizeof *a->meta) ==
               0;
}

/* The fused prologues == the ops they join, run one after another. */
static void test_fused(int T, int cols) {
    size_t n = (size_t)T * (size_t)cols, ab = (cs_qact_bytes(T, cols) + 63) / 64 * 64;
    float *x0 = alloc_f(n), *add = alloc_f(n), *w = alloc_f((size_t)cols), *up = alloc_f(n);
    float *x1 = alloc_f(n), *xn1 = alloc_f(n), *x2 = alloc_f(n), *xn2 = alloc_f(n);
    void *b1 = aligned_alloc(64, ab), *b2 = aligned_alloc(64, ab);
    for (size_t i = 0; i < n; i++)
        x0[i] = 3 * frand(), add[i] = frand(), up[i] = frand();
    for (int i = 0; i < cols; i++)
        w[i] = 1 + frand() / 4;
    for (int kind = CS_QMAT_KERNELS_REF; kind <= CS_QMAT_KERNELS_AMX; kind++) {
        if (kind == CS_QMAT_KERNELS_AVX2 && !cs__qmat_avx2_usable()) continue;
        if (kind == CS_QMAT_KERNELS_VNNI && !cs__qmat_vnni_usable()) continue;
        if (kind == CS_QMAT_KERNELS_AMX && !cs__qmat_amx_usable()) continue;
        cs__qmat_force_kernels(kind);
        for (int k = 0; k < 3; k++)
            for (int with_add = 0; with_add < 2; with_add++) {
                cs_qact a1, a2;
                cs_qact_init(&a1, b1, T, cols);
                cs_qact_init(&a2, b2, T, cols);
                memcpy(x1, x0, n * sizeof(float));
                memcpy(x2, x0, n * sizeof(float));
                if (with_add)
                    for (size_t i = 0; i < n; i++)
                        x1[i] += add[i];
                cs_op_rmsnorm(pools[0], xn1, x1, w, T, cols, 1e-5f);
                cs_op_quantize(pools[0], &a1, xn1);
                cs_op_add_rmsnorm_quantize(pools[k], &a2, xn2, x2, with_add ? add : NULL, w, 1e-5f);
                ASSERT_TRUE(memcmp(x1, x2, n * sizeof(float)) == 0);
                ASSERT_TRUE(memcmp(xn1, xn2, n * sizeof(float)) == 0);
                ASSERT_TRUE(same_qact(&a1, &a2));
                /* norm in place (xn == x), as the backend's logits rows */
                memcpy(x1, x0, n * sizeof(float));
                memcpy(x2, x0, n * sizeof(float));
                cs_op_rmsnorm(pools[0], x1, x1, w, T, cols, 1e-5f);
                cs_op_quantize(pools[0], &a1, x1);
                cs_op_add_rmsnorm_quantize(pools[k], &a2, x2, x2, NULL, w, 1e-5f);
                ASSERT_TRUE(memcmp(x1, x2, n * sizeof(float)) == 0);
                ASSERT_TRUE(same_qact(&a1, &a2));
                /* swiglu in place, as the backend runs it */
                cs_op_swiglu(pools[0], x1, x1, up, n);
                cs_op_quantize(pools[0], &a1, x1);
                cs_op_swiglu_quantize(pools[k], &a2, x2, x2, up);
                ASSERT_TRUE(memcmp(x1, x2, n * sizeof(float)) == 0);
                ASSERT_TRUE(same_qact(&a1, &a2));
            }
    }
    cs__qmat_force_kernels(CS_QMAT_KERNELS_AUTO);
    free(x0), free(add), free(w), free(up), free(x1), free(xn1), free(x2), free(xn2);
    free(b1), free(b2);
}

int main(void) {
    for (int k = 0; k < 3; k++)
        ASSERT_EQ_INT(cs_threadpool_init(k + 1, &pools[k]), 0);
    printf("kernels: reference%s%s%s\n", cs__qmat_avx2_usable() ? ", avx2" : "",
           cs__qmat_vnni_usable() ? ", avx-512 vnni" : "", cs__qmat_amx_usable() ? ", amx" : "");
    test_bad_shapes();
    test_perm();
    test_fused(1, 96);
    test_fused(5, 160);
    test_fused(100, 96); /* enough work for the pool to split the rows */
    const int64_t one[] = {37}, qkv[] = {64, 32, 32}, big[] = {200}, tall[] = {100},
                  ragged[] = {40, 24, 24};
    const int types[] = {CS_QMAT_Q4_0, CS_QMAT_Q4_1, CS_QMAT_Q8_0, CS_QMAT_F32};
    for (int i = 0; i < 4; i++) {
        gemm_case(types[i], 1, one, 64, 40, false);
        gemm_case(types[i], 3, qkv, 96, 19, true);
        gemm_case(types[i], 1, big, 320, 9, false);
        /* AMX tiles of 16 tokens: 1-4 tiles and a tail, panel pairs that
         * straddle parts and end in partial panels */
        gemm_case(types[i], 1, tall, 96, 70, true);
        gemm_case(types[i], 3, ragged, 64, 54, true);
    }
    for (int k = 0; k < 3; k++)
        cs_threadpool_free(pools[k]);
    printf("ok\n");
    return 0;
}
