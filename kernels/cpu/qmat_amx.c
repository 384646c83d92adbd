/* qmat_amx.c: the quantized GEMM on AMX tiles (Intel Sapphire Rapids and
 * later: AMX-TILE + AMX-INT8), for GEMMs of 16 tokens or more: prefill
 * chunks and large decode batches. qmat.h states the arithmetic; qmat.c is
 * the reference these kernels equal bit for bit (tests/unit/test_qmat.c, by
 * memcmp).
 *
 * This file alone is compiled for AMX and AVX-512 (CMakeLists.txt), whatever
 * the rest of the build targets; nothing in it runs unless
 * cs__qmat_amx_usable() said this CPU has them and the kernel granted this
 * process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM; some hypervisors
 * mask AMX, and then the VNNI kernels run).
 *
 * Why AMX keeps the bits: TDPBSUD / TDPBSSD sum signed x unsigned (signed)
 * byte products into int32 exactly, like vpdpbusd, so a tile holds exact
 * integer sums and the fp32 epilogue is the reference's, in its order.
 *
 * Types with a scale per 32-weight block (Q4_0 .. Q8_0): a tile product
 * covers one block (K = 32), never two, so every C tile holds the block's
 *   C[token][row] = sum over the block of q[token][k] * u[row][k]
 * A = 16 tokens x 32 activation bytes (read in place, stride cols); B = the
 * panel's block as 8 rows of 64 bytes, row i lane r = u[r][4i..4i+3]: the
 * packed Q8 layout (read in place), and for every other type the VNNI
 * kernels' unpacked bytes (qmat_avx512.h), made once per group of blocks for
 * every token. Per panel, group of blocks and tile of 16 tokens, the tile
 * products of the group go back to back into a buffer, then the AVX-512
 * epilogue walks them, 8 tokens' accumulator chains at a time. What bounds
 * these: the epilogue, not the tiles (cvt + mul + fma per token and block
 * for 512 MACs), ~1.3-1.5x the VNNI kernels (docs/perf.md). Tried and
 * slower: products and epilogue of one block interleaved (tile registers
 * are not renamed, so each block waited on the last), and the next token
 * tile's products issued between the epilogue's steps.
 *
 * The K-quants sum whole 256-weight super-blocks in the tiles (panel_k
 * below: their scales become part of byte planes of the weights), with one
 * epilogue per super-block: ~2x the VNNI kernels.
 *
 * Tokens past the last full tile of 16 go to the VNNI kernels (same bits).
 * Threads split panels, as everywhere. */
#include "qmat.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include "qmat_avx512.h"
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

bool cs__qmat_amx_usable(void) {
    static int usable = -1; /* benign race: every thread computes the same answer */
    if (usable >= 0) return usable;
    unsigned a, b, c, d;
    bool ok = cs__qmat_vnni_usable();
    if (ok) { /* CPUID.7.0:EDX bit 24 AMX-TILE, bit 25 AMX-INT8 */
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        ok = (d >> 24 & 1) && (d >> 25 & 1);
    }
    if (ok) { /* the OS saves the tile state (XCR0 bits 17, 18) */
        __asm__("xgetbv" : "=a"(a), "=d"(d) : "c"(0));
        ok = (a >> 17 & 3) == 3;
    }
    /* Linux hands out the tile data state per process, on request */
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    usable = ok;
    return ok;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tile numbers must be literals in the intrinsics. Consecutive blocks use
 * different tiles (A and B alternate between 0/1 and 2/3, C rotates over
 * 4..7), so a block's loads and product need not wait for the previous
 * block's store: tile registers are not renamed. */
#define BLOCK_TILES(A, B, C, a_ptr, a_stride, b_ptr, c_ptr)                                        \
    do {                                                                                           \
        _tile_loadd(A, a_ptr, a_stride);                                                           \
        _tile_loadd(B, b_ptr, 64);                                                                 \
        _tile_zero(C);                                                                             \
        _tile_dpbsud(C, A, B);                                                                     \
        _tile_stored(C, c_ptr, 64);                                                                \
    } while (0)

#define G 16 /* blocks per group: the products of a group first, then its epilogue */

/* One panel, every whole tile of 16 tokens: out[t][row0 + r] for t < full.
 * The output rows are the fp32 accumulators (each thread owns its panels'
 * columns); blocks in groups of G: per group, the blocks are unpacked into
 * B tiles and their scales read once for every token tile, the tile
 * products of the group go to cbuf, then the epilogue walks each token's
 * blocks in order with its accumulator in a register. */
static inline __attribute__((always_inline)) void panel(const int type, const cs_qpanel *v,
                                                        float *out, int64_t ldo, const float *bias,
                                                        __mmask16 mask, const cs_qact *a,
                                                        int64_t full) {
    const int64_t nb = a->n_blocks, qb = cs__qmat_qbytes(type);
    const int32_t z = cs__qmat_zero(type);
    const bool min = cs__qmat_has_min(type);
    int32_t cbuf[G][16][16] __attribute__((aligned(64)));
    uint8_t wbuf[G][CS_QK / 4][64] __attribute__((aligned(64)));
    float d0q[G][16] __attribute__((aligned(64))), mq[G][16] __attribute__((aligned(64)));
    for (int64_t g0 = 0; g0 < nb; g0 += G) {
        const int gn = nb - g0 < G ? (int)(nb - g0) : G;
        const uint8_t *bsrc[G];
        for (int k = 0; k < gn; k++) {
            const cs_qscales sc = cs__qmat_scales(type, v, g0 + k);
            _mm512_store_ps(d0q[k], sc.d);
            _mm512_store_ps(mq[k], sc.m);
            if (type == CS_QMAT_Q8_0) { /* already the B tile */
                bsrc[k] = v->q + (g0 + k) * qb;
                continue;
            }
            __m512i wv[8];
            cs__qmat_unpack(type, v, g0 + k, wv);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                _mm512_store_si512((void *)wbuf[k][i], wv[i]);
            bsrc[k] = wbuf[k][0];
        }
        for (int64_t t0 = 0; t0 < full; t0 += 16) {
            const int8_t *xq = a->q + (size_t)t0 * (size_t)a->cols + (size_t)g0 * CS_QK;
            const size_t xs = (size_t)a->cols;
            int k = 0;
            for (; k + 4 <= gn; k += 4) {
                BLOCK_TILES(0, 2, 4, xq + k * CS_QK, xs, bsrc[k], cbuf[k]);
                BLOCK_TILES(1, 3, 5, xq + (k + 1) * CS_QK, xs, bsrc[k + 1], cbuf[k + 1]);
                BLOCK_TILES(0, 2, 6, xq + (k + 2) * CS_QK, xs, bsrc[k + 2], cbuf[k + 2]);
                BLOCK_TILES(1, 3, 7, xq + (k + 3) * CS_QK, xs, bsrc[k + 3], cbuf[k + 3]);
            }
            for (; k < gn; k++) {
                if (k & 1)
                    BLOCK_TILES(1, 3, 5, xq + k * CS_QK, xs, bsrc[k], cbuf[k]);
                else
                    BLOCK_TILES(0, 2, 4, xq + k * CS_QK, xs, bsrc[k], cbuf[k]);
            }
            /* 8 tokens at once: 8 independent accumulator chains hide the
             * FMA latency (each token's blocks still add up in order) */
            for (int r0 = 0; r0 < 16; r0 += 8) {
                __m512 acc[8];
                const cs_qblock *mb[8];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    mb[r] = a->meta + (size_t)(t0 + r0 + r) * (size_t)nb + (size_t)g0;
                    acc[r] =
                        g0 ? _mm512_maskz_loadu_ps(mask, out + (size_t)(t0 + r0 + r) * (size_t)ldo)
                           : _mm512_setzero_ps();
                }
                for (k = 0; k < gn; k++) {
                    const __m512 d0 = _mm512_load_ps(d0q[k]), m = _mm512_load_ps(mq[k]);
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        const __m512 vdx = _mm512_set1_ps(mb[r][k].dx);
                        __m512i s = _mm512_load_si512((const void *)cbuf[k][r0 + r]);
                        if (z) s = _mm512_sub_epi32(s, _mm512_set1_epi32(z * mb[r][k].xsum));
                        acc[r] =
                            _mm512_fmadd_ps(_mm512_mul_ps(d0, vdx), _mm512_cvtepi32_ps(s), acc[r]);
                        if (min) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(mb[r][k].fsum), acc[r]);
                    }
                }
                const __m512 bv =
                    bias && g0 + gn == nb ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    if (bias && g0 + gn == nb) acc[r] = _mm512_add_ps(acc[r], bv);
                    _mm512_mask_storeu_ps(out + (size_t)(t0 + r0 + r) * (size_t)ldo, mask, acc[r]);
                }
            }
        }
    }
}

/* ---- K-quants: whole super-blocks in the tiles ----
 *
 * The weight of row r, column k is w' = sc_j * (u - z) (j its block, or its
 * half-block for Q6_K), an integer of 11 (Q4_K) to 13 (Q6_K) bits, so a
 * super-block's S = sum of q * w' (qmat.h) can be summed by the tiles across
 * all 256 columns if w' is split into bytes: w' = 256 * hi + lo, lo 0..255,
 * hi 0..7 (Q4_K, Q5_K) or -16..16 (Q6_K, signed). Two B planes, lo and hi,
 * each 4 tiles of 64 columns; S = C_lo + 256 * C_hi, exact in int32. Q4_K
 * and Q5_K also need M = sum_j mn_j * xsum_j: a third plane holding mn_j for
 * each of block j's columns gives it as one more tile sum (tried instead: M
 * by 4 vpdpwssd per token on xsum pairs the quantizer kept, and two token
 * tiles sharing each B load: within noise, so not kept). Then one epilogue
 * per super-block and token (cvt, fma; twice with M) instead of one per
 * block. Planes are made per panel and group of super-blocks, once for every
 * token tile of the slice. */

#define KSB 2 /* super-blocks per group */

/* 16-bit lanes of x's even / odd bytes times sc (sc in both halves of each
 * 32-bit lane), recombined into the bytes lo and hi of each product. */
static inline __attribute__((always_inline)) void
split_products(const int type, __m512i x, __m512i sc, __m512i *lo, __m512i *hi) {
    const __m512i m8 = _mm512_set1_epi16(0x00ff);
    __m512i e = _mm512_and_si512(x, m8), o = _mm512_srli_epi16(x, 8);
    if (type == CS_QMAT_Q6_K) { /* u - 32, signed */
        e = _mm512_sub_epi16(e, _mm512_set1_epi16(32));
        o = _mm512_sub_epi16(o, _mm512_set1_epi16(32));
    }
    const __m512i pe = _mm512_mullo_epi16(e, sc), po = _mm512_mullo_epi16(o, sc);
    *lo = _mm512_or_si512(_mm512_and_si512(pe, m8), _mm512_slli_epi16(po, 8));
    const __m512i he = type == CS_QMAT_Q6_K ? _mm512_srai_epi16(pe, 8) : _mm512_srli_epi16(pe, 8);
    *hi = _mm512_or_si512(_mm512_and_si512(he, m8),
                          _mm512_and_si512(po, _mm512_set1_epi16((short)0xff00)));
}

/* A lane's byte scale in both 16-bit halves (sign-extended for Q6_K). */
static inline __attribute__((always_inline)) __m512i scale16(const int type, const uint8_t *p) {
    const __m128i b = _mm_load_si128((const __m128i *)(const void *)p);
    const __m512i v = type == CS_QMAT_Q6_K ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xffff)),
                           _mm512_slli_epi32(v, 16));
}

/* Super-block sb of the panel as planes: pl[0] lo, pl[1] hi, pl[2] mn (Q4_K,
 * Q5_K), each 4 B tiles of 16 rows x 64 bytes (tile c = columns 64c ..
 * 64c+63: block 2c in rows 0..7, block 2c+1 in rows 8..15). */
static inline __attribute__((always_inline)) void kplanes(const int type, const cs_qpanel *v,
                                                          int64_t sb, uint8_t (*pl)[4][16][64]) {
    for (int j = 0; j < 8; j++) {
        const int64_t b = sb * 8 + j;
        const uint8_t *sp = v->sc + b * 32;
        __m512i wv[8];
        cs__qmat_unpack(type, v, b, wv);
        const __m512i s0 = scale16(type, sp);
        const __m512i s1 = type == CS_QMAT_Q6_K ? scale16(type, sp + 16) : s0;
        uint8_t(*lo)[64] = pl[0][j / 2] + 8 * (j % 2), (*hi)[64] = pl[1][j / 2] + 8 * (j % 2);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) { /* Q6_K: rows 0..3 the first half, 4..7 the second */
            __m512i l, h;
            split_products(type, wv[i], i < 4 ? s0 : s1, &l, &h);
            _mm512_store_si512((void *)lo[i], l);
            _mm512_store_si512((void *)hi[i], h);
        }
        if (type != CS_QMAT_Q6_K) { /* mn_j in each of the block's 4 bytes per lane */
            __m512i m =
                _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(const void *)(sp + 16)));
            m = _mm512_or_si512(m, _mm512_slli_epi32(m, 8));
            m = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
            uint8_t(*mn)[64] = pl[2][j / 2] + 8 * (j % 2);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                _mm512_store_si512((void *)mn[i], m);
        }
    }
}

/* One chunk of 64 columns: A (tile TA) = 16 tokens' activations, then the
 * planes' products into C 4 (lo), 5 (hi) and 6 (mn). B tiles rotate over 2,
 * 3 and 7, so a load waits only on the product two steps back. */
#define K_CHUNK(TA, a_ptr, a_stride, pl, c, q6, min)                                               \
    do {                                                                                           \
        _tile_loadd(TA, a_ptr, a_stride);                                                          \
        _tile_loadd(2, (pl)[0][c], 64);                                                            \
        _tile_dpbsud(4, TA, 2);                                                                    \
        _tile_loadd(3, (pl)[1][c], 64);                                                            \
        if (q6)                                                                                    \
            _tile_dpbssd(5, TA, 3);                                                                \
        else                                                                                       \
            _tile_dpbsud(5, TA, 3);                                                                \
        if (min) {                                                                                 \
            _tile_loadd(7, (pl)[2][c], 64);                                                        \
            _tile_dpbsud(6, TA, 7);                                                                \
        }                                                                                          \
    } while (0)

static inline __attribute__((always_inline)) void panel_k(const int type, const cs_qpanel *v,
                                                          float *out, int64_t ldo,
                                                          const float *bias, __mmask16 mask,
                                                          const cs_qact *a, int64_t full) {
    const int64_t nb = a->n_blocks, nsb = nb / 8;
    const bool q6 = type == CS_QMAT_Q6_K, min = !q6;
    uint8_t pl[KSB][3][4][16][64] __attribute__((aligned(64)));
    int32_t cbuf[KSB][3][16][16] __attribute__((aligned(64)));
    for (int64_t s0 = 0; s0 < nsb; s0 += KSB) {
        const int sn = nsb - s0 < KSB ? (int)(nsb - s0) : KSB;
        for (int k = 0; k < sn; k++)
            kplanes(type, v, s0 + k, pl[k]);
        for (int64_t t0 = 0; t0 < full; t0 += 16) {
            const size_t xs = (size_t)a->cols;
            for (int k = 0; k < sn; k++) {
                const int8_t *xq = a->q + (size_t)t0 * xs + (size_t)(s0 + k) * CS_QK_K;
                _tile_zero(4);
                _tile_zero(5);
                if (min) _tile_zero(6);
                K_CHUNK(0, xq, xs, pl[k], 0, q6, min);
                K_CHUNK(1, xq + 64, xs, pl[k], 1, q6, min);
                K_CHUNK(0, xq + 128, xs, pl[k], 2, q6, min);
                K_CHUNK(1, xq + 192, xs, pl[k], 3, q6, min);
                _tile_stored(4, cbuf[k][0], 64);
                _tile_stored(5, cbuf[k][1], 64);
                if (min) _tile_stored(6, cbuf[k][2], 64);
            }
            /* 8 tokens at once: 8 independent accumulator chains */
            for (int r0 = 0; r0 < 16; r0 += 8) {
                __m512 acc[8];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++)
                    acc[r] =
                        s0 ? _mm512_maskz_loadu_ps(mask, out + (size_t)(t0 + r0 + r) * (size_t)ldo)
                           : _mm512_setzero_ps();
                for (int k = 0; k < sn; k++) {
                    const int64_t b = (s0 + k) * 8; /* the super-block's first block */
                    const cs_qkscales ks = cs__qmat_kscales(type, v, b);
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        const int t = (int)t0 + r0 + r;
                        const __m512i S = _mm512_add_epi32(
                            _mm512_load_si512((const void *)cbuf[k][0][r0 + r]),
                            _mm512_slli_epi32(_mm512_load_si512((const void *)cbuf[k][1][r0 + r]),
                                              8));
                        const __m512i M = min ? _mm512_load_si512((const void *)cbuf[k][2][r0 + r])
                                              : _mm512_setzero_si512();
                        acc[r] =
                            cs__qmat_kflush(type, acc[r], &ks,
                                            a->meta[(size_t)t * (size_t)nb + (size_t)b].dx, S, M);
                    }
                }
                const bool end = s0 + sn == nsb;
                const __m512 bv =
                    bias && end ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    if (bias && end) acc[r] = _mm512_add_ps(acc[r], bv);
                    _mm512_mask_storeu_ps(out + (size_t)(t0 + r0 + r) * (size_t)ldo, mask, acc[r]);
                }
            }
        }
    }
}

/* One instance per type AMX runs, so every branch on the type folds away. */
typedef void panel_fn(const cs_qpanel *v, float *out, int64_t ldo, const float *bias,
                      __mmask16 mask, const cs_qact *a, int64_t full);
#define PANEL_FN(name, TYPE)                                                                       \
    static void panel_##name(const cs_qpanel *v, float *out, int64_t ldo, const float *bias,       \
                             __mmask16 mask, const cs_qact *a, int64_t full) {                     \
        panel(TYPE, v, out, ldo, bias, mask, a, full);                                             \
    }
CS_QMAT_BLOCK_SCALED_TYPES(PANEL_FN)
#define PANEL_K_FN(name, TYPE)                                                                     \
    static void panel_##name(const cs_qpanel *v, float *out, int64_t ldo, const float *bias,       \
                             __mmask16 mask, const cs_qact *a, int64_t full) {                     \
        panel_k(TYPE, v, out, ldo, bias, mask, a, full);                                           \
    }
CS_QMAT_K_TYPES(PANEL_K_FN)
#define PANEL_ENTRY(name, TYPE) [TYPE] = panel_##name,
static panel_fn *const panels[CS_QMAT_TYPES] = {CS_QMAT_BLOCK_TYPES(PANEL_ENTRY)};

/* The tile shapes, as data (GCC 12 dropped the stores into a config built
 * on the stack before ldtilecfg): A = 16 tokens x 32 activation bytes, B =
 * 8 rows of 64 weight bytes (one block), C = 16 tokens x 16 int32. */
static const tile_config block_config = {.palette = 1,
                                         .colsb = {CS_QK, CS_QK, 64, 64, 64, 64, 64, 64},
                                         .rows = {16, 16, CS_QK / 4, CS_QK / 4, 16, 16, 16, 16}};

/* The K-quants': A = 16 tokens x 64 activation bytes, B = 16 rows of 64
 * plane bytes (64 columns), C = 16 tokens x 16 int32. */
static const tile_config k_config = {.palette = 1,
                                     .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                     .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

/* Whether AMX runs this type's panels (every type the kernels know). */
static bool amx_type(int type) {
    return panels[type] != NULL;
}

void cs__qmat_amx_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1) {
    /* whole tiles of 16 tokens; none where the tile state was not granted
     * (a test forcing these kernels), so every token goes to VNNI */
    const int64_t full = cs__qmat_amx_usable() ? a->n_tokens / 16 * 16 : 0;
    /* the rest (fewer than a tile) on VNNI, each panel right after its
     * tiles, while its weights are still in cache: a second pass over the
     * panels read every weight again (a decode step of 17 tokens cost
     * about two of 16) */
    cs_qact rest;
    cs_qout ro[CS_QMAT_PARTS];
    cs__qmat_token_slice(outs, a, w->n_parts, full, a->n_tokens - full, ro, &rest);
    const tile_config *loaded = NULL;
    int part = 0;
    for (int64_t p = p0; p < p1;) {
        part = cs__qmat_part_of(w, p, part);
        const cs_qpart *P = &w->part[part];
        int64_t e = part + 1 < w->n_parts ? w->part[part + 1].panel0 : w->n_panels;
        if (e > p1) e = p1;
        if (full == 0 || !amx_type(P->type)) { /* this part's panels on VNNI, every token */
            cs__qmat_vnni_panels(outs, a, w, p, e);
            p = e;
            continue;
        }
        const tile_config *cfg = cs__qmat_is_k(P->type) ? &k_config : &block_config;
        if (cfg != loaded) _tile_loadconfig(cfg), loaded = cfg;
        const cs_qout *o = &outs[part];
        for (; p < e; p++) {
            const int64_t row0 = (p - P->panel0) * CS_QROWS;
            const int64_t left = P->rows - row0;
            const cs_qpanel v = cs__qmat_panel(w, P, p - P->panel0);
            panels[P->type](&v, o->out + row0, o->ldo, o->bias ? o->bias + row0 : NULL,
                            left >= CS_QROWS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1), a,
                            full);
            if (rest.n_tokens > 0) cs__qmat_vnni_panels(ro, &rest, w, p, p + 1);
        }
    }
    if (loaded) _tile_release(); /* back to the init state: cheap context switches */
}

/* iters x 16 tile products of 16 x 16 x 64 bytes (16,384 MACs each) on
 * four C tiles; the sum of one C element is returned so nothing is dropped. */
int64_t cs__qmat_amx_peak_loop(int64_t iters) {
    static const int8_t x[16 * 64] __attribute__((aligned(64))) = {1};
    int32_t c[16 * 16] __attribute__((aligned(64)));
    static const tile_config cfg = {.palette = 1,
                                    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                    .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
    _tile_loadd(0, x, 64);
    _tile_loadd(1, x, 64);
    _tile_loadd(2, x, 64);
    _tile_loadd(3, x, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t it = 0; it < iters; it++)
        for (int k = 0; k < 4; k++) {
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 0, 3);
            _tile_dpbsud(6, 1, 2);
            _tile_dpbsud(7, 1, 3);
        }
    _tile_stored(4, c, 64);
    _tile_release();
    return c[0];
}

#else /* not built with AMX: the VNNI kernels run */
bool cs__qmat_amx_usable(void) {
    return false;
}
void cs__qmat_amx_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1) {
    cs__qmat_vnni_panels(outs, a, w, p0, p1);
}
int64_t cs__qmat_amx_peak_loop(int64_t iters) {
    (void)iters;
    return 0;
}
#endif
