/* test_qmat.c: the quantized GEMM of kernels/cpu/qmat.h.
 *
 * Bitwise (memcmp): every kernel set this CPU runs (AMX, AVX-512 VNNI,
 * AVX2) == the plain C reference (GEMM and activation quantizer), for every
 * type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32 requantized),
 * token counts 1..70 (every tile shape), rows that do not fill a panel,
 * biases and stacked parts, also of mixed types; a token's output alone == the same token
 * inside a GEMM of many tokens; 1 == 2 == 3 threads. Values: packed rows read back equal the GGUF
 * dequantizer's formula, the GEMM equals sum_k w[k] * xhat[k] of the dequantized weights and
 * activations to fp32 rounding, and is close to the fp32 product (the quantization error of 8-bit
 * activations). The fused prologues (add + RMSNorm + quantize, SwiGLU +
 * quantize) == the ops they join, bit for bit. Bad shapes: CS_EINVAL. */
#include <stdint.h>

#include "chunkserve/backend.h"
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

/* Bytes of one source row of cols weights. */
static size_t row_bytes(int type, int64_t cols) {
    switch (type) {
    case CS_QMAT_Q4_0: return (size_t)(cols / 32 * 18);
    case CS_QMAT_Q4_1: return (size_t)(cols / 32 * 20);
    case CS_QMAT_Q8_0: return (size_t)(cols / 32 * 34);
    case CS_QMAT_Q5_0: return (size_t)(cols / 32 * 22);
    case CS_QMAT_Q5_1: return (size_t)(cols / 32 * 24);
    case CS_QMAT_Q4_K: return (size_t)(cols / 256 * 144);
    case CS_QMAT_Q5_K: return (size_t)(cols / 256 * 176);
    case CS_QMAT_Q6_K: return (size_t)(cols / 256 * 210);
    }
    return (size_t)cols * 4;
}

static void put16(uint8_t *p, uint16_t h) {
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

/* The K-quant 6-bit scale / min packing (GGUF's 12 bytes for 8 pairs). */
static void pack_k4_scales(uint8_t *q, const int *sc, const int *mn) {
    memset(q, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            q[j] |= (uint8_t)(sc[j] & 63);
            q[j + 4] |= (uint8_t)(mn[j] & 63);
        } else {
            q[j + 4] |= (uint8_t)((sc[j] & 15) | (mn[j] & 15) << 4);
            q[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            q[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
}

/* A random matrix in the file's layout, and its fp32 dequantization by
 * GGUF's formulas (each product rounded on its own; Q4_1's is one fmaf, as
 * the packer reads it back). */
static void *make_src(int type, int64_t rows, int64_t cols, float *deq) {
    uint8_t *s = malloc((size_t)rows * row_bytes(type, cols));
    ASSERT_TRUE(s);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = s + (size_t)r * row_bytes(type, cols);
        float *orow = deq + r * cols;
        if (type == CS_QMAT_Q4_K || type == CS_QMAT_Q5_K || type == CS_QMAT_Q6_K) {
            size_t bb = row_bytes(type, 256);
            for (int64_t sb = 0; sb < cols / 256; sb++) {
                uint8_t *p = row + (size_t)sb * bb;
                float *o = orow + sb * 256;
                for (size_t i = 0; i < bb; i++)
                    p[i] = (uint8_t)next();
                float d = 0.0001f + 0.002f * (float)(next() % 1000) / 1000.0f;
                uint16_t dh = f16(d), mh = f16(d * 3);
                float df = f32_of_f16(dh), mf = f32_of_f16(mh);
                if (type == CS_QMAT_Q6_K) {
                    put16(p + 208, dh);
                    const int8_t *sc = (const int8_t *)(p + 192);
                    for (int e = 0; e < 256; e++) {
                        int half = e / 128, f = e % 128;
                        int lo = f < 64 ? p[64 * half + f] & 15 : p[64 * half + f - 64] >> 4;
                        int hi = (p[128 + 32 * half + f % 32] >> (2 * (f / 32))) & 3;
                        o[e] = (df * (float)sc[e / 16]) * (float)((lo | hi << 4) - 32);
                    }
                    continue;
                }
                put16(p, dh), put16(p + 2, mh);
                int sc[8], mn[8];
                for (int j = 0; j < 8; j++)
                    sc[j] = (int)(next() % 64), mn[j] = (int)(next() % 64);
                pack_k4_scales(p + 4, sc, mn);
                bool five = type == CS_QMAT_Q5_K;
                const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 32; l++) {
                        int q = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                        if (five) q |= ((qh[l] >> j) & 1) << 4;
                        o[32 * j + l] = (df * (float)sc[j]) * (float)q - mf * (float)mn[j];
                    }
            }
            continue;
        }
        for (int64_t b = 0; b < cols / 32; b++) {
            uint8_t *p = row + (size_t)b * row_bytes(type, 32);
            float *o = orow + b * 32;
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
            put16(p, dh);
            if (type == CS_QMAT_Q8_0) {
                for (int i = 0; i < 32; i++) {
                    int8_t q = (int8_t)(next() % 255 - 127);
                    p[2 + i] = (uint8_t)q;
                    o[i] = df * (float)q;
                }
                continue;
            }
            bool min = type == CS_QMAT_Q4_1 || type == CS_QMAT_Q5_1;
            bool five = type == CS_QMAT_Q5_0 || type == CS_QMAT_Q5_1;
            if (min) put16(p + 2, mh);
            uint8_t *qh = p + (min ? 4 : 2), *qs = qh + (five ? 4 : 0);
            uint32_t hbits = five ? next() : 0;
            if (five)
                for (int i = 0; i < 4; i++)
                    qh[i] = (uint8_t)(hbits >> (8 * i));
            for (int i = 0; i < 16; i++) {
                qs[i] = (uint8_t)(next() & 0xff);
                int lo = (qs[i] & 15) | (int)((hbits >> i) & 1) << 4;
                int hi = (qs[i] >> 4) | (int)((hbits >> (i + 16)) & 1) << 4;
                if (type == CS_QMAT_Q4_0 || type == CS_QMAT_Q5_0) {
                    int z = five ? 16 : 8;
                    o[i] = df * (float)(lo - z);
                    o[i + 16] = df * (float)(hi - z);
                } else if (type == CS_QMAT_Q4_1) {
                    o[i] = fmaf(df, (float)lo, mf);
                    o[i + 16] = fmaf(df, (float)hi, mf);
                } else {
                    o[i] = df * (float)lo + mf;
                    o[i + 16] = df * (float)hi + mf;
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
static void gemm_parts(const int *types, int n_parts, const int64_t *rows, int64_t cols,
                       int max_tokens, bool bias) {
    cs_qmat_src src[4];
    float *deq[4], *b[4] = {0};
    int64_t total = 0;
    for (int p = 0; p < n_parts; p++) {
        deq[p] = alloc_f((size_t)(rows[p] * cols));
        src[p] = (cs_qmat_src){types[p], make_src(types[p], rows[p], cols, deq[p]), rows[p], NULL};
        if (bias) {
            b[p] = alloc_f((size_t)rows[p]);
            for (int64_t r = 0; r < rows[p]; r++)
                b[p][r] = frand();
        }
        total += rows[p];
    }
    cs_qmat *w;
    ASSERT_EQ_INT(cs_qmat_pack(src, n_parts, cols, &w), 0);
    for (int p = 0; p < n_parts; p++)
        ASSERT_EQ_INT(cs_qmat_type(w, p), types[p] == CS_QMAT_F32 ? CS_QMAT_Q8_0 : types[p]);

    /* rows read back == the dequantizer's formula (F32 sources were requantized) */
    for (int p = 0; p < n_parts; p++) {
        if (types[p] == CS_QMAT_F32) continue;
        float *row = alloc_f((size_t)cols);
        for (int32_t r = 0; r < rows[p]; r += 7) {
            cs_qmat_get_rows(w, p, &r, 1, row);
            ASSERT_TRUE(memcmp(row, deq[p] + r * cols, (size_t)cols * sizeof(float)) == 0);
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
    cs_qact_init(&a, abuf, T, cols, w->act_group);
    cs_qact_init(&a2, abuf2, T, cols, w->act_group);
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
                                types[p], p, nt, k + 1, kind);
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
    /* 8-bit activations: ~0.008 measured in groups of 32; ~0.02 in groups of
     * 256, where nearly every group holds one of x's 8x outliers */
    ASSERT_TRUE(sqrt(err / norm) < (w->act_group == CS_QK ? 0.02 : 0.04));
    for (int p = 0; p < n_parts; p++) {
        free(deq[p]), free(b[p]), free(ref[p]), free(fast[p]);
        free((void *)src[p].data);
    }
    free(x), free(abuf), free(abuf2);
    cs_qmat_free(w);
}

static void gemm_case(int type, int n_parts, const int64_t *rows, int64_t cols, int max_tokens,
                      bool bias) {
    int types[4] = {type, type, type, type};
    gemm_parts(types, n_parts, rows, cols, max_tokens, bias);
}

/* Stacked parts of different types, as Q4_K_M files mix them (q|k in
 * Q4_K, v in Q6_K; gate Q5_0, up Q8_0), in every kernel set. */
static void test_mixed(void) {
    const int64_t qkv[] = {48, 16, 16}, gu[] = {40, 40};
    const int t1[] = {CS_QMAT_Q4_K, CS_QMAT_Q4_K, CS_QMAT_Q6_K};
    const int t2[] = {CS_QMAT_Q5_0, CS_QMAT_Q8_0};
    const int t3[] = {CS_QMAT_Q5_K, CS_QMAT_Q4_1, CS_QMAT_F32};
    gemm_parts(t1, 3, qkv, 512, 40, true);
    gemm_parts(t2, 2, gu, 256, 33, false);
    gemm_parts(t3, 3, qkv, 256, 20, true);
}

static void test_bad_shapes(void) {
    float data[64] = {0};
    cs_qmat *w = (cs_qmat *)1;
    cs_qmat_src s = {CS_QMAT_F32, data, 2, NULL};
    ASSERT_EQ_INT(cs_qmat_pack(&s, 1, 33, &w), CS_EINVAL);
    ASSERT_TRUE(w == NULL);
    ASSERT_EQ_INT(cs_qmat_pack(&s, 0, 32, &w), CS_EINVAL);
    cs_qmat_src kq = {CS_QMAT_Q4_K, data, 1, NULL}; /* K-quants: 256 columns a super-block */
    ASSERT_EQ_INT(cs_qmat_pack(&kq, 1, 128, &w), CS_EINVAL);
    ASSERT_TRUE(w == NULL);
    kq.type = CS_QMAT_TYPES;
    ASSERT_EQ_INT(cs_qmat_pack(&kq, 1, 256, &w), CS_EINVAL);
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

/* The fused prologues == the ops they join, run one after another, with
 * activation scale groups of `group`. */
static void test_fused(int T, int cols, int group) {
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
                cs_qact_init(&a1, b1, T, cols, group);
                cs_qact_init(&a2, b2, T, cols, group);
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
                /* the gate activations in place, as the backend runs them */
                for (int act = CS_ACT_SILU; act <= CS_ACT_GELU_TANH; act++) {
                    cs_op_glu(pools[0], x1, x1, up, n, (cs_act)act);
                    cs_op_quantize(pools[0], &a1, x1);
                    cs_op_glu_quantize(pools[k], &a2, x2, x2, up, (cs_act)act);
                    ASSERT_TRUE(memcmp(x1, x2, n * sizeof(float)) == 0);
                    ASSERT_TRUE(same_qact(&a1, &a2));
                }
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
    test_fused(1, 96, 32);
    test_fused(5, 160, 32);
    test_fused(100, 96, 32); /* enough work for the pool to split the rows */
    test_fused(3, 512, 256); /* a K-quant GEMM's groups */
    test_fused(70, 768, 256);
    const int64_t one[] = {37}, qkv[] = {64, 32, 32}, big[] = {200}, tall[] = {100},
                  ragged[] = {40, 24, 24};
    const int types[] = {CS_QMAT_Q4_0, CS_QMAT_Q4_1, CS_QMAT_Q8_0, CS_QMAT_F32, CS_QMAT_Q5_0,
                         CS_QMAT_Q5_1, CS_QMAT_Q4_K, CS_QMAT_Q5_K, CS_QMAT_Q6_K};
    for (int i = 0; i < (int)(sizeof types / sizeof types[0]); i++) {
        /* K-quants need rows of whole 256-weight super-blocks */
        int64_t k1 = cs__qmat_is_k(types[i]) ? 256 : 64, k3 = cs__qmat_is_k(types[i]) ? 512 : 96;
        gemm_case(types[i], 1, one, k1, 40, false);
        gemm_case(types[i], 3, qkv, k3, 19, true);
        gemm_case(types[i], 1, big, cs__qmat_is_k(types[i]) ? 768 : 320, 9, false);
        /* AMX tiles of 16 tokens: 1-4 tiles and a tail, panel pairs that
         * straddle parts and end in partial panels */
        gemm_case(types[i], 1, tall, k3, 70, true);
        gemm_case(types[i], 3, ragged, k1, 54, true);
        /* prefill's unpacked groups of 32 blocks: sums carried across groups */
        const int64_t two[] = {24, 40};
        gemm_case(types[i], 2, two, cs__qmat_is_k(types[i]) ? 2304 : 1120, 20, true);
    }
    test_mixed();
    /* rows so long that the GEMM runs its tokens in slices (of 64 where L2
     * is at most 2.6 MiB; qmat.c slice_tokens): each slice's outputs in place */
    const int64_t sliced[] = {20, 17};
    const int st[] = {CS_QMAT_Q4_K, CS_QMAT_Q6_K};
    gemm_parts(st, 2, sliced, 11264, 80, true);
    for (int k = 0; k < 3; k++)
        cs_threadpool_free(pools[k]);
    printf("ok\n");
    return 0;
}
