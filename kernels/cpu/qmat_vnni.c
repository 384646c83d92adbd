/* qmat_vnni.c: the AVX-512 VNNI kernels of the quantized GEMM and of the
 * activation quantizer (qmat.h states the arithmetic; qmat.c is the
 * reference they equal bit for bit).
 *
 * This file alone is compiled for AVX-512 F/BW/VL/VNNI and F16C
 * (CMakeLists.txt), whatever the rest of the build targets; nothing in it
 * runs unless cs__qmat_vnni_usable() said this CPU has them.
 *
 * GEMM: a tile is one 16-row panel (a vector lane per output row) times up
 * to 8 tokens. Per 32-weight block the panel's 16x32 weights are loaded
 * once (4 vectors of nibbles for Q4, split into 8 of bytes, or 8 of bytes
 * for Q8) and each token's 32 activation bytes are broadcast 4 at a time
 * into vpdpbusd: lane r sums u[r][k] * q[k] in int32, exactly (one chain,
 * or two added at the end when few tokens must hide the latency), so the
 * order does not matter. Then the block's epilogue (cvt, fma) in the reference's order. */
#include <string.h>

#include "qmat.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

bool cs__qmat_vnni_usable(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

#define MAX_NT 8
typedef int32_t a32 __attribute__((may_alias)); /* int8 data read 4 bytes at a time */

static inline __attribute__((always_inline)) void
tile(const int nt, const int type, const uint8_t *pq, const uint16_t *pd, const uint16_t *pm,
     int64_t nb, const int8_t *xq, int64_t cols, const cs_qblock *meta, int32_t z, __m512 *out) {
    __m512 acc[MAX_NT];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const int qb = type == CS_QMAT_Q8_0 ? 512 : 256;
    for (int64_t b = 0; b < nb; b++) {
        __m512i wv[8];
        const uint8_t *p = pq + b * qb;
        if (nt <= 2) { /* decode: memory-bound; ask for the weights 8 blocks ahead */
            _mm_prefetch((const char *)(p + 8 * qb), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 8 * qb + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 8 * qb + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 8 * qb + 192), _MM_HINT_T0);
            if (type == CS_QMAT_Q8_0)
                for (int j = 4; j < 8; j++)
                    _mm_prefetch((const char *)(p + 8 * qb + 64 * j), _MM_HINT_T0);
        }
        if (type == CS_QMAT_Q8_0) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                wv[j] = _mm512_load_si512((const void *)(p + 64 * j));
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_load_si512((const void *)(p + 64 * j));
                wv[2 * j] = _mm512_and_si512(v, m4);
                wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
        }
        /* wv[i] lane r holds u[r][4i .. 4i+3] in both layouts */
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(pd + b * CS_QROWS)));
        __m512 m = _mm512_setzero_ps();
        if (type == CS_QMAT_Q4_1)
            m = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(pm + b * CS_QROWS)));
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            /* 4 activation bytes broadcast straight from memory (a load, not a
             * shuffle competing with vpdpbusd for its ports) */
            const a32 *x =
                (const a32 *)(const void *)(xq + (size_t)t * (size_t)cols + (size_t)b * CS_QK);
            __m512i s;
            if (nt >= 4) { /* enough independent tokens to hide the latency: one chain */
                s = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    s = _mm512_dpbusd_epi32(s, wv[i], _mm512_set1_epi32(x[i]));
            } else { /* two chains, added at the end */
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int i = 0; i < 8; i += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[i], _mm512_set1_epi32(x[i]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[i + 1], _mm512_set1_epi32(x[i + 1]));
                }
                s = _mm512_add_epi32(s0, s1);
            }
            const cs_qblock *mb = meta + (size_t)t * (size_t)nb + (size_t)b;
            if (z) s = _mm512_sub_epi32(s, _mm512_set1_epi32(z * mb->xsum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(mb->dx)),
                                     _mm512_cvtepi32_ps(s), acc[t]);
            if (type == CS_QMAT_Q4_1) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(mb->fsum), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++)
        out[t] = acc[t];
}

/* One instance per (type, token count) so every loop above unrolls. */
#define TILE_FN(name, TYPE)                                                                        \
    static void name(int nt, const uint8_t *pq, const uint16_t *pd, const uint16_t *pm,            \
                     int64_t nb, const int8_t *xq, int64_t cols, const cs_qblock *meta, int32_t z, \
                     __m512 *out) {                                                                \
        switch (nt) {                                                                              \
        case 1: tile(1, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 2: tile(2, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 3: tile(3, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 4: tile(4, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 5: tile(5, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 6: tile(6, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        case 7: tile(7, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                      \
        default: tile(8, TYPE, pq, pd, pm, nb, xq, cols, meta, z, out); break;                     \
        }                                                                                          \
    }
TILE_FN(tile_q4_0, CS_QMAT_Q4_0)
TILE_FN(tile_q4_1, CS_QMAT_Q4_1)
TILE_FN(tile_q8_0, CS_QMAT_Q8_0)

void cs__qmat_vnni_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1) {
    const int32_t z = cs__qmat_zero(w->type);
    const int64_t nb = w->n_blocks, qb = cs__qmat_qbytes(w->type);
    void (*fn)(int, const uint8_t *, const uint16_t *, const uint16_t *, int64_t, const int8_t *,
               int64_t, const cs_qblock *, int32_t, __m512 *) = w->type == CS_QMAT_Q4_0 ? tile_q4_0
                                                                : w->type == CS_QMAT_Q4_1
                                                                    ? tile_q4_1
                                                                    : tile_q8_0;
    int part = 0;
    for (int64_t p = p0; p < p1; p++) {
        while (part + 1 < w->n_parts && p >= w->part[part + 1].panel0)
            part++;
        const int64_t row0 = (p - w->part[part].panel0) * CS_QROWS;
        const int64_t left = w->part[part].rows - row0;
        const __mmask16 mask = left >= CS_QROWS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const cs_qout *o = &outs[part];
        const __m512 bias =
            o->bias ? _mm512_maskz_loadu_ps(mask, o->bias + row0) : _mm512_setzero_ps();
        const uint8_t *pq = w->q + (size_t)(p * nb * qb);
        const uint16_t *pd = w->d + (size_t)(p * nb * CS_QROWS);
        const uint16_t *pm = w->m ? w->m + (size_t)(p * nb * CS_QROWS) : NULL;
        for (int t0 = 0; t0 < a->n_tokens; t0 += MAX_NT) {
            int nt = a->n_tokens - t0 < MAX_NT ? a->n_tokens - t0 : MAX_NT;
            __m512 acc[MAX_NT];
            fn(nt, pq, pd, pm, nb, a->q + (size_t)t0 * (size_t)a->cols, a->cols,
               a->meta + (size_t)t0 * (size_t)nb, z, acc);
            for (int t = 0; t < nt; t++) {
                __m512 v = o->bias ? _mm512_add_ps(acc[t], bias) : acc[t];
                _mm512_mask_storeu_ps(o->out + (size_t)(t0 + t) * (size_t)o->ldo + row0, mask, v);
            }
        }
    }
}

void cs__quantize_vnni_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < a->n_blocks; b++) {
            const float *xb = x + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
            int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            float id = amax > 0 ? 127.0f / amax : 0.0f;
            __m512 vid = _mm512_set1_ps(id);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
            int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
            mb->dx = amax / 127.0f;
            mb->xsum = sum;
            mb->fsum = mb->dx * (float)sum;
            mb->pad = 0;
        }
}

/* 16 independent vpdpbusd chains, iters times: 1024 MACs an iteration. The
 * sum is returned so the loop cannot be dropped. */
int64_t cs__qmat_vnni_peak_loop(int64_t iters) {
    __m512i a[16], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_set1_epi32(i);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            a[i] = _mm512_dpbusd_epi32(a[i], w, x);
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[5]), "+v"(a[10]), "+v"(a[15]));
    }
    __m512i s = a[0];
    for (int i = 1; i < 16; i++)
        s = _mm512_add_epi32(s, a[i]);
    return _mm512_reduce_add_epi32(s);
}

#else /* not built for x86-64: the reference runs */
bool cs__qmat_vnni_usable(void) {
    return false;
}
void cs__qmat_vnni_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1) {
    cs__qmat_ref_panels(outs, a, w, p0, p1);
}
void cs__quantize_vnni_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    cs__quantize_ref_rows(a, x, t0, t1);
}
int64_t cs__qmat_vnni_peak_loop(int64_t iters) {
    (void)iters;
    return 0;
}
#endif
