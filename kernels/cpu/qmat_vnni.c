/* qmat_vnni.c: the AVX-512 VNNI kernels of the quantized GEMM and of the
 * activation quantizer (qmat.h states the arithmetic; qmat.c is the
 * reference they equal bit for bit).
 *
 * This file alone is compiled for AVX-512 F/BW/VL/VNNI and F16C
 * (CMakeLists.txt), whatever the rest of the build targets; nothing in it
 * runs unless cs__qmat_vnni_usable() said this CPU has them.
 *
 * GEMM: a tile is one 16-row panel (a vector lane per output row) times up
 * to 8 tokens. Per 32-weight block the panel's 16x32 weights become 8
 * vectors of bytes, vector i lane r = u[r][4i .. 4i+3] (Q8: loaded as they
 * are; the others: nibbles split, then the 5th and 6th bits or'ed in from
 * their bit planes), and each token's 32 activation bytes are broadcast 4
 * at a time into vpdpbusd: lane r sums u[r][k] * q[k] in int32, exactly
 * (one chain, or two added at the end when few tokens must hide the
 * latency; Q6_K keeps its two 16-weight halves apart), so the order does
 * not matter. Then the block's epilogue (cvt, fma) in the reference's order;
 * a K-quant's block instead adds sc * s (and mn * xsum) to the token's
 * integer sums (vpmulld), and its super-block's last block runs the one
 * fp32 epilogue.
 *
 * Decode (few tokens) unpacks each block's weights in registers for the
 * tile's tokens: memory-bound, so the unpacking is free. Prefill (16 tokens
 * or more) unpacks a group of blocks once into a buffer on the stack and
 * runs every token tile over the bytes there, so the unpacking (up to 5
 * ops per block and token for Q6_K's bit planes) is paid once per panel
 * and group rather than once per 8 tokens; the accumulators wait in the
 * output rows between groups (an exact fp32 store and load). */
#include <string.h>

#include "qmat.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "qmat_avx512.h"

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

/* Blocks [b0, b1) of one panel for nt tokens into acc[0..nt) (which the
 * caller set). wb: NULL, or those blocks already unpacked (512 bytes each). */
static inline __attribute__((always_inline)) void
tile(const int nt, const int type, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,
     const uint8_t *wb, const int8_t *xq, int64_t cols, const cs_qblock *meta, __m512 *acc) {
    const int qb = cs__qmat_qbytes(type), hb = cs__qmat_hbytes(type);
    const int32_t z = cs__qmat_zero(type);
    const bool q6 = type == CS_QMAT_Q6_K, kq = cs__qmat_is_k(type), min = cs__qmat_has_min(type);
    __m512i S[MAX_NT], M[MAX_NT]; /* K-quants: each token's super-block sums */
    for (int t = 0; t < MAX_NT; t++)
        S[t] = M[t] = _mm512_setzero_si512();
    for (int64_t b = b0; b < b1; b++) {
        __m512i wv[8];
        if (wb) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                wv[j] = _mm512_load_si512((const void *)(wb + (b - b0) * 512 + 64 * j));
        } else {
            if (nt <= 2) { /* decode: memory-bound; ask for the weights 8 blocks ahead */
                const uint8_t *p = P->q + b * qb;
#pragma GCC unroll 8
                for (int j = 0; j < qb / 64; j++)
                    _mm_prefetch((const char *)(p + 8 * qb + 64 * j), _MM_HINT_T0);
#pragma GCC unroll 2
                for (int j = 0; j < hb / 64; j++)
                    _mm_prefetch((const char *)(P->h + (b + 8) * hb + 64 * j), _MM_HINT_T0);
            }
            cs__qmat_unpack(type, P, b, wv);
        }
        if (kq) { /* integer sums over the super-block, one epilogue at its end */
            const cs_qkscales k = cs__qmat_kscales(type, P, b);
            const bool first = b % 8 == 0, last = b % 8 == 7;
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) {
                const a32 *x =
                    (const a32 *)(const void *)(xq + (size_t)t * (size_t)cols + (size_t)b * CS_QK);
                const cs_qblock *mb = meta + (size_t)t * (size_t)nb + (size_t)b;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[i], _mm512_set1_epi32(x[i]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[i + 4], _mm512_set1_epi32(x[i + 4]));
                }
                __m512i ds, dm = _mm512_setzero_si512();
                if (q6) { /* the two halves apart: each has its own scale */
                    s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * mb->xsum_lo));
                    s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * (mb->xsum - mb->xsum_lo)));
                    ds = _mm512_add_epi32(_mm512_mullo_epi32(s0, k.s0),
                                          _mm512_mullo_epi32(s1, k.s1));
                } else {
                    ds = _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), k.s0);
                    dm = _mm512_mullo_epi32(k.s1, _mm512_set1_epi32(mb->xsum));
                }
                S[t] = first ? ds : _mm512_add_epi32(S[t], ds);
                M[t] = first ? dm : _mm512_add_epi32(M[t], dm);
                if (last) acc[t] = cs__qmat_kflush(type, acc[t], &k, mb->dx, S[t], M[t]);
            }
            continue;
        }
        /* the block's scales, for every token */
        const cs_qscales sc = cs__qmat_scales(type, P, b);
        const __m512 d0 = sc.d, m = sc.m;
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            /* 4 activation bytes broadcast straight from memory (a load, not a
             * shuffle competing with vpdpbusd for its ports) */
            const a32 *x =
                (const a32 *)(const void *)(xq + (size_t)t * (size_t)cols + (size_t)b * CS_QK);
            const cs_qblock *mb = meta + (size_t)t * (size_t)nb + (size_t)b;
            const __m512 vdx = _mm512_set1_ps(mb->dx);
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
            if (z) s = _mm512_sub_epi32(s, _mm512_set1_epi32(z * mb->xsum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d0, vdx), _mm512_cvtepi32_ps(s), acc[t]);
            if (min) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(mb->fsum), acc[t]);
        }
    }
}

/* One instance per (type, token count, unpacked or not) so every loop above
 * unrolls. */
typedef void tile_fn(int nt, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,
                     const uint8_t *wb, const int8_t *xq, int64_t cols, const cs_qblock *meta,
                     __m512 *acc);
typedef void unpack_fn(const cs_qpanel *P, int64_t b0, int64_t b1, uint8_t *wb);
#define TILE_CASES(TYPE, WB)                                                                       \
    switch (nt) {                                                                                  \
    case 1: tile(1, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 2: tile(2, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 3: tile(3, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 4: tile(4, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 5: tile(5, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 6: tile(6, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 7: tile(7, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    default: tile(8, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                         \
    }
#define TILE_FN(name, TYPE)                                                                        \
    static void tile_##name(int nt, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,        \
                            const uint8_t *wb, const int8_t *xq, int64_t cols,                     \
                            const cs_qblock *meta, __m512 *acc) {                                  \
        if (wb) {                                                                                  \
            TILE_CASES(TYPE, wb)                                                                   \
        } else {                                                                                   \
            TILE_CASES(TYPE, NULL)                                                                 \
        }                                                                                          \
    }                                                                                              \
    static __attribute__((unused)) void tile_##name##_unpack(const cs_qpanel *P, int64_t b0,       \
                                                             int64_t b1, uint8_t *wb) {            \
        for (int64_t b = b0; b < b1; b++) {                                                        \
            __m512i wv[8];                                                                         \
            cs__qmat_unpack(TYPE, P, b, wv);                                                       \
            for (int j = 0; j < 8; j++)                                                            \
                _mm512_store_si512((void *)(wb + (b - b0) * 512 + 64 * j), wv[j]);                 \
        }                                                                                          \
    }
CS_QMAT_BLOCK_TYPES(TILE_FN)
#define TILE_ENTRY(name, TYPE) [TYPE] = tile_##name,
static tile_fn *const tiles[CS_QMAT_TYPES] = {CS_QMAT_BLOCK_TYPES(TILE_ENTRY)};
static unpack_fn *const unpacks[CS_QMAT_TYPES] = {
    [CS_QMAT_Q4_0] = tile_q4_0_unpack, [CS_QMAT_Q4_1] = tile_q4_1_unpack,
    [CS_QMAT_Q5_0] = tile_q5_0_unpack, [CS_QMAT_Q5_1] = tile_q5_1_unpack,
    [CS_QMAT_Q4_K] = tile_q4_k_unpack, [CS_QMAT_Q5_K] = tile_q5_k_unpack,
    [CS_QMAT_Q6_K] = tile_q6_k_unpack}; /* Q8_0's bytes are used in place */

#define UNPACK_MIN_TOKENS 16 /* prefill: unpack each block once for all tokens */
#define UNPACK_GROUP 32      /* blocks unpacked at a time: 16 KiB on the stack */

void cs__qmat_vnni_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1) {
    const int64_t nb = w->n_blocks;
    uint8_t wbuf[UNPACK_GROUP * 512] __attribute__((aligned(64)));
    int part = 0;
    for (int64_t p = p0; p < p1; p++) {
        part = cs__qmat_part_of(w, p, part);
        const cs_qpart *P = &w->part[part];
        tile_fn *fn = tiles[P->type];
        unpack_fn *un = a->n_tokens >= UNPACK_MIN_TOKENS ? unpacks[P->type] : NULL;
        const int64_t row0 = (p - P->panel0) * CS_QROWS;
        const int64_t left = P->rows - row0;
        const __mmask16 mask = left >= CS_QROWS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const cs_qout *o = &outs[part];
        const __m512 bias =
            o->bias ? _mm512_maskz_loadu_ps(mask, o->bias + row0) : _mm512_setzero_ps();
        const cs_qpanel v = cs__qmat_panel(w, P, p - P->panel0);
        const int64_t group = un ? UNPACK_GROUP : nb;
        for (int64_t b0 = 0; b0 < nb; b0 += group) {
            const int64_t b1 = b0 + group < nb ? b0 + group : nb;
            if (un) un(&v, b0, b1, wbuf);
            for (int t0 = 0; t0 < a->n_tokens; t0 += MAX_NT) {
                int nt = a->n_tokens - t0 < MAX_NT ? a->n_tokens - t0 : MAX_NT;
                __m512 acc[MAX_NT];
                float *out = o->out + (size_t)t0 * (size_t)o->ldo + row0;
                for (int t = 0; t < nt; t++) /* the previous groups' sums wait in out */
                    acc[t] = b0 ? _mm512_maskz_loadu_ps(mask, out + (size_t)t * (size_t)o->ldo)
                                : _mm512_setzero_ps();
                fn(nt, &v, b0, b1, nb, un ? wbuf : NULL, a->q + (size_t)t0 * (size_t)a->cols,
                   a->cols, a->meta + (size_t)t0 * (size_t)nb, acc);
                for (int t = 0; t < nt; t++) {
                    __m512 vv = o->bias && b1 == nb ? _mm512_add_ps(acc[t], bias) : acc[t];
                    _mm512_mask_storeu_ps(out + (size_t)t * (size_t)o->ldo, mask, vv);
                }
            }
        }
    }
}

void cs__quantize_vnni_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    const int64_t G = a->group;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < a->cols; g += G) {
            const float *xg = x + (size_t)t * (size_t)a->cols + (size_t)g;
            __m512 vmax = _mm512_setzero_ps();
            for (int64_t i = 0; i < G; i += 16)
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
            const float amax = _mm512_reduce_max_ps(vmax);
            const __m512 vid = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            for (int64_t b = g / CS_QK; b < (g + G) / CS_QK; b++) {
                const float *xb = x + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), vid));
                __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), vid));
                _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
                int32_t sum_lo = _mm512_reduce_add_epi32(q0);
                int32_t sum = sum_lo + _mm512_reduce_add_epi32(q1);
                cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
                mb->dx = amax / 127.0f;
                mb->xsum = sum;
                mb->fsum = mb->dx * (float)sum;
                mb->xsum_lo = sum_lo;
            }
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
