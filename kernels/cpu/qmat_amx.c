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
 * Why AMX keeps the bits: TDPBSUD sums signed x unsigned byte products into
 * int32 exactly, like vpdpbusd. A tile product covers one 32-weight block
 * (K = 32), never two, so every C tile holds exact per-block sums
 *   C[token][row] = sum over the block of q[token][k] * u[row][k]
 * and the fp32 epilogue is the reference's, block by block, in order:
 *   acc = fma(d * dx, (float)(isum - z * xsum), acc)   (+ fma(m, fsum, acc))
 *
 * Tiles: A = 16 tokens x 32 activation bytes (read in place, stride cols);
 * B = the panel's block as 8 rows of 64 bytes, row i lane r = u[r][4i..4i+3]:
 * exactly the packed Q8 layout (read in place), and Q4's nibbles split into
 * it (4 ands and shifts a block, once per group of blocks for every
 * token). Per panel, group of blocks and tile of 16 tokens, the tile
 * products of the whole group are issued back to back into a buffer, then
 * the AVX-512 epilogue walks them, 8 tokens' accumulator chains at a time.
 *
 * What bounds it: the epilogue, not the tiles. Each (token, 16 rows, block)
 * needs cvt + mul + fma (+ fma for Q4_1) on the vector units for 512 MACs
 * that the tile unit does in a fraction of the time, so the kernel runs at
 * ~1.5x the VNNI one (docs/perf.md), a few % of the tile peak. Tried and
 * slower: the products and the epilogue of one block interleaved (1.1x
 * VNNI; tile registers are not renamed, so each block waited on the last),
 * and the next token tile's products issued between the epilogue's steps
 * (1.25x). Tokens past the last full tile of 16 go to the VNNI kernels
 * (same bits). Threads split panels, as everywhere. */
#include <string.h>

#include "qmat.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>
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
 * columns); blocks in groups of G: per group, Q4's nibbles are split once
 * for every token tile, the tile products of the group go to cbuf, then the
 * epilogue walks each token's blocks in order with its accumulator in a
 * register. */
static inline __attribute__((always_inline)) void
panel(const int type, const uint8_t *pq, const uint16_t *pd, const uint16_t *pm, float *out,
      int64_t ldo, const float *bias, __mmask16 mask, const cs_qact *a, int64_t full, int32_t z) {
    const int64_t nb = a->n_blocks, qb = cs__qmat_qbytes(type);
    int32_t cbuf[G][16][16] __attribute__((aligned(64)));
    uint8_t wbuf[G][CS_QK / 4][64] __attribute__((aligned(64)));
    float dq[G][16] __attribute__((aligned(64))), mq[G][16] __attribute__((aligned(64)));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t g0 = 0; g0 < nb; g0 += G) {
        const int gn = nb - g0 < G ? (int)(nb - g0) : G;
        const uint8_t *bsrc[G];
        for (int k = 0; k < gn; k++) {
            const uint8_t *p = pq + (g0 + k) * qb;
            _mm512_store_ps(
                dq[k], _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(pd + (g0 + k) * 16))));
            _mm512_store_ps(mq[k], type == CS_QMAT_Q4_1 ? _mm512_cvtph_ps(_mm256_load_si256((
                                                              const __m256i *)(pm + (g0 + k) * 16)))
                                                        : _mm512_setzero_ps());
            if (type == CS_QMAT_Q8_0) {
                bsrc[k] = p;
                continue;
            }
            /* nibbles -> bytes: row 2i = the low halves of vector i, 2i+1 the high */
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_load_si512((const void *)(p + 64 * i));
                _mm512_store_si512((void *)wbuf[k][2 * i], _mm512_and_si512(v, m4));
                _mm512_store_si512((void *)wbuf[k][2 * i + 1],
                                   _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
            bsrc[k] = wbuf[k][0];
        }
        for (int64_t t0 = 0; t0 < full; t0 += 16) {
            const int8_t *xq = a->q + (size_t)t0 * (size_t)a->cols + (size_t)g0 * CS_QK;
            const size_t xs = (size_t)a->cols;
            int k;
            for (k = 0; k + 4 <= gn; k += 4) {
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
                    const __m512 d = _mm512_load_ps(dq[k]), m = _mm512_load_ps(mq[k]);
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        __m512i s = _mm512_load_si512((const void *)cbuf[k][r0 + r]);
                        if (z) s = _mm512_sub_epi32(s, _mm512_set1_epi32(z * mb[r][k].xsum));
                        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(mb[r][k].dx)),
                                                 _mm512_cvtepi32_ps(s), acc[r]);
                        if (type == CS_QMAT_Q4_1)
                            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(mb[r][k].fsum), acc[r]);
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

#define PANEL_FN(name, TYPE)                                                                       \
    static void name(const uint8_t *pq, const uint16_t *pd, const uint16_t *pm, float *out,        \
                     int64_t ldo, const float *bias, __mmask16 mask, const cs_qact *a,             \
                     int64_t full, int32_t z) {                                                    \
        panel(TYPE, pq, pd, pm, out, ldo, bias, mask, a, full, z);                                 \
    }
PANEL_FN(panel_q4_0, CS_QMAT_Q4_0)
PANEL_FN(panel_q4_1, CS_QMAT_Q4_1)
PANEL_FN(panel_q8_0, CS_QMAT_Q8_0)

static void load_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 2; i++) {
        cfg.rows[i] = 16, cfg.colsb[i] = CS_QK;             /* A: 16 tokens x 32 bytes */
        cfg.rows[2 + i] = CS_QK / 4, cfg.colsb[2 + i] = 64; /* B: 8 x 64 bytes */
    }
    for (int i = 4; i < 8; i++)
        cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C: 16 tokens x 16 int32 */
    _tile_loadconfig(&cfg);
}

/* Whether AMX runs this part type's panels; the others (5- and 6-bit and
 * K-quant parts) go to the VNNI kernels, with the same bits. */
static bool amx_type(int type) {
    return type == CS_QMAT_Q4_0 || type == CS_QMAT_Q4_1 || type == CS_QMAT_Q8_0;
}

void cs__qmat_amx_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1) {
    /* whole tiles of 16 tokens; none where the tile state was not granted
     * (a test forcing these kernels), so every token goes to VNNI */
    const int64_t full = cs__qmat_amx_usable() ? a->n_tokens / 16 * 16 : 0;
    int part = 0;
    if (full > 0) {
        load_config();
        for (int64_t p = p0; p < p1; p++) {
            part = cs__qmat_part_of(w, p, part);
            const cs_qpart *P = &w->part[part];
            if (!amx_type(P->type)) continue;
            void (*fn)(const uint8_t *, const uint16_t *, const uint16_t *, float *, int64_t,
                       const float *, __mmask16, const cs_qact *, int64_t, int32_t) =
                P->type == CS_QMAT_Q4_0   ? panel_q4_0
                : P->type == CS_QMAT_Q4_1 ? panel_q4_1
                                          : panel_q8_0;
            const int64_t row0 = (p - P->panel0) * CS_QROWS;
            const int64_t left = P->rows - row0;
            const cs_qout *o = &outs[part];
            const cs_qpanel v = cs__qmat_panel(w, P, p - P->panel0);
            fn(v.q, v.d, v.m, o->out + row0, o->ldo, o->bias ? o->bias + row0 : NULL,
               left >= CS_QROWS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1), a, full,
               cs__qmat_zero(P->type));
        }
        _tile_release(); /* back to the init state: cheap context switches */
    }
    /* the rest on VNNI: other types' panels whole, and the last tokens
     * (fewer than a tile) of AMX's */
    cs_qact rest = *a;
    rest.n_tokens = a->n_tokens - (int)full;
    rest.q += (size_t)full * (size_t)a->cols;
    rest.meta += (size_t)full * (size_t)a->n_blocks;
    cs_qout ro[CS_QMAT_PARTS];
    for (int k = 0; k < w->n_parts; k++) {
        ro[k] = outs[k];
        ro[k].out += (size_t)full * (size_t)ro[k].ldo;
    }
    part = 0;
    for (int64_t p = p0; p < p1;) { /* runs of panels of one kind */
        part = cs__qmat_part_of(w, p, part);
        bool amx = full > 0 && amx_type(w->part[part].type);
        int64_t e = part + 1 < w->n_parts ? w->part[part + 1].panel0 : w->n_panels;
        if (e > p1) e = p1;
        if (!amx)
            cs__qmat_vnni_panels(outs, a, w, p, e);
        else if (rest.n_tokens > 0)
            cs__qmat_vnni_panels(ro, &rest, w, p, e);
        p = e;
    }
}

/* iters x 16 tile products of 16 x 16 x 64 bytes (16,384 MACs each) on
 * four C tiles; the sum of one C element is returned so nothing is dropped. */
int64_t cs__qmat_amx_peak_loop(int64_t iters) {
    static const int8_t x[16 * 64] __attribute__((aligned(64))) = {1};
    int32_t c[16 * 16] __attribute__((aligned(64)));
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++)
        cfg.rows[i] = 16, cfg.colsb[i] = 64;
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
