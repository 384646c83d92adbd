/* qmat_avx2.c: the AVX2 kernels of the quantized GEMM, for x86-64 CPUs
 * without AVX-512 VNNI (most of those in clouds: AMD Zen 2/3, Intel before
 * Ice Lake). qmat.h states the arithmetic; qmat.c is the reference they
 * equal bit for bit (tests/unit/test_qmat.c, by memcmp).
 *
 * This file alone is compiled for AVX2, FMA and F16C (CMakeLists.txt),
 * whatever the rest of the build targets; nothing in it runs unless
 * cs__qmat_avx2_usable() said this CPU has them.
 *
 * A panel's 16 rows are two vectors of 8 int32 lanes. Without vpdpbusd the
 * exact block sums come from vpmaddubsw (unsigned x signed bytes, adjacent
 * pairs summed into int16) and vpmaddwd against ones (int16 pairs into
 * int32), which must never saturate:
 *   Q4 (u 0..15): a pair is at most 2 * 15 * 127 = 3,810, so the 8 groups of
 *     a block add up in int16 (at most 30,480) before one vpmaddwd: the sum
 *     of u * q, exact; the zero point comes off in int32 as in the reference.
 *   Q8 (u 0..255): u * q pairs reach 64,770, so the kernel uses s = u - 128
 *     (-128..127) and vpmaddubsw(|s|, q signed by s): pairs of at most
 *     2 * 128 * 127 = 32,512, widened per group; sum of s * q is exactly the
 *     reference's isum - 128 * xsum.
 * The epilogue is the reference's: one fmaf per block, d * dx first; for
 * the K-quants, integer sums over the super-block (vpmulld by the block's
 * scales) and one fmaf (two with the mins) at its end. */
#include <string.h>

#include "qmat.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

bool cs__qmat_avx2_usable(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

#define MAX_NT 4
typedef int32_t a32 __attribute__((may_alias)); /* int8 data read 4 bytes at a time */

/* Plane v's bit (byte 4r+c bit i) moved to bit `bit` of its byte. */
static inline __attribute__((always_inline)) __m256i hbits(__m256i v, int i, int bit) {
    return bit > i ? _mm256_slli_epi16(v, bit - i) : bit < i ? _mm256_srli_epi16(v, i - bit) : v;
}

/* Block b's weights for rows 8h .. 8h+7: w[i] lane r = u[8h + r][4i .. 4i+3]
 * (before the Q8 / Q6_K sign shift). */
static inline __attribute__((always_inline)) void unpack(const int type, const cs_qpanel *P,
                                                         int64_t b, int h, __m256i *w) {
    const int qb = cs__qmat_qbytes(type), hb = cs__qmat_hbytes(type);
    const uint8_t *p = P->q + b * qb;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == CS_QMAT_Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            w[j] = _mm256_load_si256((const __m256i *)(const void *)(p + 64 * j + 32 * h));
        return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_load_si256((const __m256i *)(const void *)(p + 64 * j + 32 * h));
        w[2 * j] = _mm256_and_si256(v, m4);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int plane = 0; plane < hb / 64; plane++) {
        const __m256i v =
            _mm256_load_si256((const __m256i *)(const void *)(P->h + b * hb + 64 * plane + 32 * h));
        const __m256i bit = _mm256_set1_epi8((char)(0x10 << plane));
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            w[i] = _mm256_or_si256(w[i], _mm256_and_si256(hbits(v, i, 4 + plane), bit));
    }
}

/* Blocks [b0, b1) of the panel for nt tokens into acc (lanes h*8 .. h*8+7
 * of token t in acc[2t + h]; the caller set them). wb: NULL, or those
 * blocks already unpacked (512 bytes each, the Q8 layout). */
static inline __attribute__((always_inline)) void
tile(const int nt, const int type, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,
     const uint8_t *wb, const int8_t *xq, int64_t cols, const cs_qblock *meta, __m256 *out) {
    __m256 acc[2][MAX_NT];
    __m256i S[2][MAX_NT], M[2][MAX_NT]; /* K-quants: each token's super-block sums */
    for (int t = 0; t < MAX_NT; t++)
        S[0][t] = S[1][t] = M[0][t] = M[1][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
        acc[0][t] = out[2 * t], acc[1][t] = out[2 * t + 1];
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i k128 = _mm256_set1_epi8((char)0x80), k32 = _mm256_set1_epi8(32);
    const int hb = cs__qmat_hbytes(type), g = cs__qmat_dgroup(type);
    const int32_t z = cs__qmat_zero(type);
    const bool kq = cs__qmat_is_k(type), q6 = type == CS_QMAT_Q6_K, q8 = type == CS_QMAT_Q8_0;
    const bool min1 = type == CS_QMAT_Q4_1 || type == CS_QMAT_Q5_1, mink = kq && !q6;
    (void)hb;
    for (int64_t b = b0; b < b1; b++) {
        const cs_qblock *mb0 = meta + (size_t)b;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h+7: 8 weight vectors live at a time */
            /* w[i] lane r: the 4 weight bytes u[8h + r][4i .. 4i+3] (Q8: s = u - 128;
             * Q6_K: s = u - 32) */
            __m256i w[8];
            if (wb) {
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    w[j] = _mm256_load_si256(
                        (const __m256i *)(const void *)(wb + (b - b0) * 512 + 64 * j + 32 * h));
            } else {
                unpack(type, P, b, h, w);
            }
            if (q8)
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    w[i] = _mm256_xor_si256(w[i], k128);
            if (q6)
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    w[i] = _mm256_sub_epi8(w[i], k32);
            const __m256 d = _mm256_cvtph_ps(
                _mm_load_si128((const __m128i *)(const void *)(P->d + (b / g) * CS_QROWS + 8 * h)));
            __m256 m = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
            __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0; /* K-quants: integer scales */
            if (min1)
                m = _mm256_cvtph_ps(
                    _mm_load_si128((const __m128i *)(const void *)(P->m + b * CS_QROWS + 8 * h)));
            if (kq) {
                const uint8_t *s = P->sc + b * 32 + 8 * h;
                const __m128i s0 = _mm_loadl_epi64((const __m128i *)(const void *)s);
                const __m128i s1 = _mm_loadl_epi64((const __m128i *)(const void *)(s + 16));
                sc0 = q6 ? _mm256_cvtepi8_epi32(s0) : _mm256_cvtepu8_epi32(s0);
                sc1 = q6 ? _mm256_cvtepi8_epi32(s1) : _mm256_cvtepu8_epi32(s1);
                if (mink)
                    dmin = _mm256_cvtph_ps(_mm_load_si128(
                        (const __m128i *)(const void *)(P->m + (b / g) * CS_QROWS + 8 * h)));
            }
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const a32 *x =
                    (const a32 *)(const void *)(xq + (size_t)t * (size_t)cols + (size_t)b * CS_QK);
                const cs_qblock *mb = mb0 + (size_t)t * (size_t)nb;
                __m256i s;
                const __m256 vdx = _mm256_set1_ps(mb->dx);
                if (q8 || q6) { /* signed weights: |s| x (q signed by s) */
                    __m256i half[2];
#pragma GCC unroll 2
                    for (int hh = 0; hh < 2; hh++) {
                        half[hh] = _mm256_setzero_si256();
#pragma GCC unroll 4
                        for (int i = 4 * hh; i < 4 * hh + 4; i++) {
                            __m256i xv = _mm256_set1_epi32(x[i]);
                            __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w[i], w[i]),
                                                               _mm256_sign_epi8(xv, w[i]));
                            half[hh] = q8 ? _mm256_add_epi32(half[hh], _mm256_madd_epi16(p16, ones))
                                          : _mm256_add_epi16(half[hh], p16);
                        }
                        if (q6) half[hh] = _mm256_madd_epi16(half[hh], ones);
                    }
                    if (q6) { /* each half with its own scale */
                        __m256i ds = _mm256_add_epi32(_mm256_mullo_epi32(half[0], sc0),
                                                      _mm256_mullo_epi32(half[1], sc1));
                        S[h][t] = b % 8 == 0 ? ds : _mm256_add_epi32(S[h][t], ds);
                        if (b % 8 == 7)
                            acc[h][t] = _mm256_fmadd_ps(_mm256_mul_ps(d, vdx),
                                                        _mm256_cvtepi32_ps(S[h][t]), acc[h][t]);
                        continue;
                    }
                    s = _mm256_add_epi32(half[0], half[1]);
                } else if (hb) { /* 5-bit: a pair reaches 7,874, so int16 holds 4 groups */
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        s0 = _mm256_add_epi16(s0,
                                              _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(x[i])));
                        s1 = _mm256_add_epi16(
                            s1, _mm256_maddubs_epi16(w[i + 4], _mm256_set1_epi32(x[i + 4])));
                    }
                    s = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
                } else {
                    __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++)
                        s16 = _mm256_add_epi16(s16,
                                               _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(x[i])));
                    s = _mm256_madd_epi16(s16, ones);
                }
                if (mink) { /* Q4_K, Q5_K: integer sums, one epilogue a super-block */
                    __m256i ds = _mm256_mullo_epi32(s, sc0);
                    __m256i dm = _mm256_mullo_epi32(sc1, _mm256_set1_epi32(mb->xsum));
                    S[h][t] = b % 8 == 0 ? ds : _mm256_add_epi32(S[h][t], ds);
                    M[h][t] = b % 8 == 0 ? dm : _mm256_add_epi32(M[h][t], dm);
                    if (b % 8 == 7) {
                        acc[h][t] = _mm256_fmadd_ps(_mm256_mul_ps(d, vdx),
                                                    _mm256_cvtepi32_ps(S[h][t]), acc[h][t]);
                        __m256 nm = _mm256_xor_ps(_mm256_mul_ps(dmin, vdx), _mm256_set1_ps(-0.0f));
                        acc[h][t] = _mm256_fmadd_ps(nm, _mm256_cvtepi32_ps(M[h][t]), acc[h][t]);
                    }
                    continue;
                }
                if (!q8 && z) s = _mm256_sub_epi32(s, _mm256_set1_epi32(z * mb->xsum));
                acc[h][t] =
                    _mm256_fmadd_ps(_mm256_mul_ps(d, vdx), _mm256_cvtepi32_ps(s), acc[h][t]);
                if (min1) acc[h][t] = _mm256_fmadd_ps(m, _mm256_set1_ps(mb->fsum), acc[h][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
        out[2 * t] = acc[0][t], out[2 * t + 1] = acc[1][t];
}

/* One instance per (type, token count, unpacked or not) so every loop above
 * unrolls. */
typedef void tile_fn(int nt, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,
                     const uint8_t *wb, const int8_t *xq, int64_t cols, const cs_qblock *meta,
                     __m256 *acc);
typedef void unpack_fn(const cs_qpanel *P, int64_t b0, int64_t b1, uint8_t *wb);
#define TILE_CASES(TYPE, WB)                                                                       \
    switch (nt) {                                                                                  \
    case 1: tile(1, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 2: tile(2, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    case 3: tile(3, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                          \
    default: tile(4, TYPE, P, b0, b1, nb, WB, xq, cols, meta, acc); break;                         \
    }
#define TILE_FN(name, TYPE)                                                                        \
    static void tile_##name(int nt, const cs_qpanel *P, int64_t b0, int64_t b1, int64_t nb,        \
                            const uint8_t *wb, const int8_t *xq, int64_t cols,                     \
                            const cs_qblock *meta, __m256 *acc) {                                  \
        if (wb) {                                                                                  \
            TILE_CASES(TYPE, wb)                                                                   \
        } else {                                                                                   \
            TILE_CASES(TYPE, NULL)                                                                 \
        }                                                                                          \
    }                                                                                              \
    static __attribute__((unused)) void tile_##name##_unpack(const cs_qpanel *P, int64_t b0,       \
                                                             int64_t b1, uint8_t *wb) {            \
        for (int64_t b = b0; b < b1; b++)                                                          \
            for (int h = 0; h < 2; h++) {                                                          \
                __m256i w[8];                                                                      \
                unpack(TYPE, P, b, h, w);                                                          \
                for (int j = 0; j < 8; j++)                                                        \
                    _mm256_store_si256((__m256i *)(void *)(wb + (b - b0) * 512 + 64 * j + 32 * h), \
                                       w[j]);                                                      \
            }                                                                                      \
    }
CS_QMAT_BLOCK_TYPES(TILE_FN)
#define TILE_ENTRY(name, TYPE) [TYPE] = tile_##name,
static tile_fn *const tiles[CS_QMAT_TYPES] = {CS_QMAT_BLOCK_TYPES(TILE_ENTRY)};
/* Types with bit planes to merge: unpacked once per group in prefill. */
static unpack_fn *const unpacks[CS_QMAT_TYPES] = {[CS_QMAT_Q5_0] = tile_q5_0_unpack,
                                                  [CS_QMAT_Q5_1] = tile_q5_1_unpack,
                                                  [CS_QMAT_Q5_K] = tile_q5_k_unpack,
                                                  [CS_QMAT_Q6_K] = tile_q6_k_unpack};

#define UNPACK_MIN_TOKENS 8 /* prefill: unpack each block once for all tokens */
#define UNPACK_GROUP 32     /* blocks unpacked at a time: 16 KiB on the stack */

void cs__qmat_avx2_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
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
        const int n_rows = left >= CS_QROWS ? CS_QROWS : (int)left;
        const cs_qout *o = &outs[part];
        const cs_qpanel v = cs__qmat_panel(w, P, p - P->panel0);
        const int64_t group = un ? UNPACK_GROUP : nb;
        for (int64_t b0 = 0; b0 < nb; b0 += group) {
            const int64_t b1 = b0 + group < nb ? b0 + group : nb;
            if (un) un(&v, b0, b1, wbuf);
            for (int t0 = 0; t0 < a->n_tokens; t0 += MAX_NT) {
                int nt = a->n_tokens - t0 < MAX_NT ? a->n_tokens - t0 : MAX_NT;
                __m256 acc[2 * MAX_NT];
                for (int t = 0; t < nt; t++) { /* the previous groups' sums wait in out */
                    _Alignas(32) float vv[CS_QROWS] = {0};
                    const float *src = o->out + (size_t)(t0 + t) * (size_t)o->ldo + row0;
                    for (int r = 0; b0 && r < n_rows; r++)
                        vv[r] = src[r];
                    acc[2 * t] = _mm256_load_ps(vv), acc[2 * t + 1] = _mm256_load_ps(vv + 8);
                }
                fn(nt, &v, b0, b1, nb, un ? wbuf : NULL, a->q + (size_t)t0 * (size_t)a->cols,
                   a->cols, a->meta + (size_t)t0 * (size_t)nb, acc);
                for (int t = 0; t < nt; t++) {
                    _Alignas(32) float vv[CS_QROWS];
                    _mm256_store_ps(vv, acc[2 * t]);
                    _mm256_store_ps(vv + 8, acc[2 * t + 1]);
                    float *dst = o->out + (size_t)(t0 + t) * (size_t)o->ldo + row0;
                    for (int r = 0; r < n_rows; r++) /* + bias, as the reference: one add */
                        dst[r] = o->bias && b1 == nb ? vv[r] + o->bias[row0 + r] : vv[r];
                }
            }
        }
    }
}

#else /* not built for x86-64: the reference runs */
bool cs__qmat_avx2_usable(void) {
    return false;
}
void cs__qmat_avx2_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1) {
    cs__qmat_ref_panels(outs, a, w, p0, p1);
}
#endif
