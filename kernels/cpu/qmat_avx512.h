/* kernels/cpu/qmat_avx512.h: the two steps the AVX-512 VNNI kernels
 * (qmat_vnni.c) and the AMX ones (qmat_amx.c) share, so both read a block
 * the same way: its weights as bytes and its scales as vectors (one lane per
 * panel row). Included only by files compiled for AVX-512 F/BW and F16C;
 * qmat.h states the arithmetic. */
#ifndef CS_KERNELS_CPU_QMAT_AVX512_H
#define CS_KERNELS_CPU_QMAT_AVX512_H

#include <immintrin.h>

#include "qmat.h"

/* Lane r of the result: u[r][4i .. 4i+3]'s bit `bit` (4 or 5) from plane
 * h (byte 4r+c bit i), in place: that byte's bit `bit`, the others 0. */
static inline __attribute__((always_inline)) __m512i cs__qmat_hbits(__m512i h, int i, int bit) {
    return bit > i   ? _mm512_slli_epi16(h, (unsigned)(bit - i))
           : bit < i ? _mm512_srli_epi16(h, (unsigned)(i - bit))
                     : h;
}

/* Block b of panel P as 8 vectors of bytes: wv[i] lane r = u[r][4i .. 4i+3]
 * (stored one after the other, also the AMX B tile of the block: 8 rows of
 * 64 bytes). */
static inline __attribute__((always_inline)) void
cs__qmat_unpack(const int type, const cs_qpanel *P, int64_t b, __m512i *wv) {
    const int qb = cs__qmat_qbytes(type), hb = cs__qmat_hbytes(type);
    const uint8_t *p = P->q + b * qb;
    if (type == CS_QMAT_Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            wv[j] = _mm512_load_si512((const void *)(p + 64 * j));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_load_si512((const void *)(p + 64 * j));
        wv[2 * j] = _mm512_and_si512(v, m4);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if (hb) { /* the 5th (and 6th) bits: wv |= (shifted plane & bit) */
        const __m512i h4 = _mm512_load_si512((const void *)(P->h + b * hb));
        const __m512i b4 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            wv[i] = _mm512_ternarylogic_epi32(wv[i], cs__qmat_hbits(h4, i, 4), b4, 0xf8);
        if (hb == 128) {
            const __m512i h5 = _mm512_load_si512((const void *)(P->h + b * hb + 64));
            const __m512i b5 = _mm512_set1_epi8(0x20);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                wv[i] = _mm512_ternarylogic_epi32(wv[i], cs__qmat_hbits(h5, i, 5), b5, 0xf8);
        }
    }
}

/* Block b's weight scales for the per-block types, per row: d multiplies
 * the block's sum, m fsum (Q4_1, Q5_1: m; else 0). */
typedef struct {
    __m512 d, m;
} cs_qscales;

static inline __attribute__((always_inline)) cs_qscales
cs__qmat_scales(const int type, const cs_qpanel *P, int64_t b) {
    cs_qscales s = {_mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(P->d + b * CS_QROWS))),
                    _mm512_setzero_ps()};
    if (type == CS_QMAT_Q4_1 || type == CS_QMAT_Q5_1)
        s.m = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(P->m + b * CS_QROWS)));
    return s;
}

/* A K-quant's block b, per row: its integer scales (Q4_K, Q5_K: sc and mn;
 * Q6_K: sc_lo and sc_hi) and its super-block's D and DMIN (0 for Q6_K). */
typedef struct {
    __m512i s0, s1;
    __m512 d, dmin;
} cs_qkscales;

static inline __attribute__((always_inline)) cs_qkscales
cs__qmat_kscales(const int type, const cs_qpanel *P, int64_t b) {
    const __m128i *sp = (const __m128i *)(const void *)(P->sc + b * 32);
    const int64_t sb = b / (CS_QK_K / CS_QK);
    cs_qkscales s;
    s.d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(P->d + sb * CS_QROWS)));
    if (type == CS_QMAT_Q6_K) {
        s.s0 = _mm512_cvtepi8_epi32(_mm_load_si128(sp));
        s.s1 = _mm512_cvtepi8_epi32(_mm_load_si128(sp + 1));
        s.dmin = _mm512_setzero_ps();
    } else {
        s.s0 = _mm512_cvtepu8_epi32(_mm_load_si128(sp));
        s.s1 = _mm512_cvtepu8_epi32(_mm_load_si128(sp + 1));
        s.dmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(P->m + sb * CS_QROWS)));
    }
    return s;
}

/* A K-quant super-block's epilogue for one token (qmat.h): acc +=
 * (D * dx) * S, then += -(DMIN * dx) * M for Q4_K / Q5_K. */
static inline __attribute__((always_inline)) __m512
cs__qmat_kflush(const int type, __m512 acc, const cs_qkscales *k, float dx, __m512i S, __m512i M) {
    const __m512 vdx = _mm512_set1_ps(dx);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(k->d, vdx), _mm512_cvtepi32_ps(S), acc);
    if (type != CS_QMAT_Q6_K) /* acc - (DMIN * dx) * M, one rounding: fma(-(DMIN * dx), M, acc) */
        acc = _mm512_fnmadd_ps(_mm512_mul_ps(k->dmin, vdx), _mm512_cvtepi32_ps(M), acc);
    return acc;
}

#endif
