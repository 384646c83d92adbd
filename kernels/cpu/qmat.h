/* kernels/cpu/qmat.h: quantized weight matrices and the integer GEMM the CPU
 * backend runs on them (the "quant" weight mode). Internal to cs_kernels; the
 * engine sees only the opaque cs_qmat of backend.h.
 *
 * The arithmetic, which every implementation follows to the bit:
 *
 *   Weights stay at the file's bits per weight, as unsigned integers u with a
 *   zero point z per type, in blocks of 32 along K (cols):
 *     Q4_0  u 0..15, z 8      w = d*(u - 8)
 *     Q4_1  u 0..15, z 0      w = d*u + m
 *     Q5_0  u 0..31, z 16     w = d*(u - 16)
 *     Q5_1  u 0..31, z 0      w = d*u + m
 *     Q8_0  u 0..255, z 128   w = d*(u - 128)   (the file's int8 q + 128)
 *     Q4_K  u 0..15, z 0      w = (D*sc)*u - DMIN*mn   sc, mn 0..63 per block
 *     Q5_K  u 0..31, z 0      the same
 *     Q6_K  u 0..63, z 32     w = (D*sc)*(u - 32)      sc int8 per 16 weights
 *   d, m (per block), D, DMIN (per 256-weight super-block of the K-quants)
 *   stay fp16 as in the file, sc and mn integers. Packed once into panels of
 *   16 rows (one vector lane per row), rows padded to a multiple of 16 with
 *   zero weights. A stacked qmat's parts may each have their own type.
 *
 *   Activations: each row (token) in scale groups of G values: amax =
 *   max |x| over the group, dx = amax / 127, q = nearbyint(x * (127 / amax))
 *   (round half to even; all 0 when amax is 0). G is the matrix's: 256 (a
 *   super-block) when one of its parts is a K-quant, else 32 (a block). Per
 *   32-weight block: its group's dx, xsum = sum of q, xsum_lo = sum of its
 *   first 16, fsum = dx * xsum (fp32).
 *
 *   Output (token t, row r), starting from acc = 0, in order:
 *     Q4_0 .. Q8_0, per block b (s = sum over the block of u * q, int32):
 *       acc = fmaf(d * dx, (float)(s - z * xsum), acc)
 *       acc = fmaf(m, fsum, acc)                          (Q4_1, Q5_1)
 *     the K-quants, per super-block (8 blocks j, all of one dx), with
 *     s_j / s_lo,j / s_hi,j = sum of u * q over block j / its halves:
 *       Q4_K, Q5_K: S = sum_j sc_j * s_j,   M = sum_j mn_j * xsum_j
 *                   acc = fmaf(D * dx, (float)S, acc)
 *                   acc = fmaf(-(DMIN * dx), (float)M, acc)
 *       Q6_K:       S = sum_j sc_lo,j * (s_lo,j - 32 * xsum_lo,j)
 *                         + sc_hi,j * (s_hi,j - 32 * (xsum_j - xsum_lo,j))
 *                   acc = fmaf(D * dx, (float)S, acc)
 *   then + bias[r] when there is one. Every integer is exact: a block's sums
 *   are below 2^24 and S, M below 2^31 (|S| <= 256 * 127 * 32 * 128), so
 *   any kernel may add them in any order or split the weights sc * (u - z)
 *   into bytes (the AMX kernels do); a K-quant's S may exceed 2^24, so its
 *   one conversion to float rounds, the same way everywhere. One fp32
 *   epilogue per super-block, not per block, is what the per-256 activation
 *   scale buys (llama.cpp's Q8_K makes the same trade).
 *
 * Every input of the fp32 steps is exact or rounded once in a fixed order, so
 * a result depends only on its own row of x and its own row of w: not on
 * how many tokens share the GEMM, which thread computes it, or the
 * instruction set (the AMX tiles of qmat_amx.c, the AVX-512 VNNI kernels of
 * qmat_vnni.c, the AVX2 ones of qmat_avx2.c and the plain C of qmat.c give
 * the same bits;
 * tests/unit/test_qmat.c compares them with memcmp). Threads split output
 * rows (16-row panels), never K. */
#ifndef CS_KERNELS_CPU_QMAT_H
#define CS_KERNELS_CPU_QMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/backend.h"
#include "chunkserve/ops.h"

#define CS_QK 32        /* weights per block along K */
#define CS_QK_K 256     /* weights per K-quant super-block (8 blocks) */
#define CS_QROWS 16     /* rows per panel (vector lanes) */
#define CS_QMAT_PARTS 4 /* matrices one qmat may stack (q|k|v, gate|up) */

/* One stacked matrix, its arrays indexed by its own panels (0 = its first).
 * Per (panel, block):
 *   q: Q8_0: 8 vectors of 64 bytes, vector j lane r byte i = u[r][4j+i];
 *      the others: u's low 4 bits in 4 vectors of 64 bytes, vector j lane r
 *      byte i = u[r][8j+i] | u[r][8j+4+i] << 4. Either way the k-th group of
 *      4 weights (k = 0..7) unpacks to a vector whose lane r holds
 *      u[r][4k .. 4k+3].
 *   h: the 5th bit (Q5_*; 64 bytes) and the 6th (Q6_K; 64 more): byte
 *      4r+i bit k = that bit of u[r][4k+i].
 *   d: fp16 (16 rows), per block; per super-block (D) for K-quants.
 *   m: fp16 (16 rows), per block (Q4_1, Q5_1); per super-block (DMIN) for
 *      Q4_K and Q5_K; else NULL.
 *   sc: K-quants, 32 bytes: Q4_K/Q5_K sc[16 rows] then mn[16 rows] (uint8);
 *      Q6_K sc_lo[16 rows] then sc_hi[16 rows] (int8). */
typedef struct {
    int type;       /* CS_QMAT_* (never F32) */
    int64_t rows;   /* real rows of this part */
    int64_t panel0; /* its first panel in the qmat */
    uint8_t *q, *h, *sc;
    uint16_t *d, *m;
} cs_qpart;

struct cs_qmat {
    int64_t cols;     /* K, a multiple of CS_QK */
    int act_group;    /* its activations' scale group G: CS_QK_K or CS_QK */
    int64_t n_blocks; /* cols / CS_QK */
    int64_t n_panels; /* panels of CS_QROWS rows, over all parts */
    int n_parts;
    cs_qpart part[CS_QMAT_PARTS];
    void *mem; /* every part's arrays */
    size_t bytes;
};

/* Every type the kernels run, for the per-ISA files' tables:
 * X(lower-case name, CS_QMAT_ type): those with a scale per 32-weight block,
 * then the K-quants (integer sums over a 256-weight super-block). */
#define CS_QMAT_BLOCK_SCALED_TYPES(X)                                                              \
    X(q4_0, CS_QMAT_Q4_0)                                                                          \
    X(q4_1, CS_QMAT_Q4_1)                                                                          \
    X(q8_0, CS_QMAT_Q8_0)                                                                          \
    X(q5_0, CS_QMAT_Q5_0)                                                                          \
    X(q5_1, CS_QMAT_Q5_1)
#define CS_QMAT_K_TYPES(X)                                                                         \
    X(q4_k, CS_QMAT_Q4_K)                                                                          \
    X(q5_k, CS_QMAT_Q5_K)                                                                          \
    X(q6_k, CS_QMAT_Q6_K)
#define CS_QMAT_BLOCK_TYPES(X) CS_QMAT_BLOCK_SCALED_TYPES(X) CS_QMAT_K_TYPES(X)

/* Per-type facts for the kernels. */
static inline bool cs__qmat_is_k(int type) {
    return type == CS_QMAT_Q4_K || type == CS_QMAT_Q5_K || type == CS_QMAT_Q6_K;
}
/* Bytes of packed weights per (panel, block): q, then h. */
static inline int cs__qmat_qbytes(int type) {
    return type == CS_QMAT_Q8_0 ? CS_QROWS * CS_QK : CS_QROWS * CS_QK / 2;
}
static inline int cs__qmat_hbytes(int type) {
    return type == CS_QMAT_Q6_K                                                   ? 128
           : type == CS_QMAT_Q5_0 || type == CS_QMAT_Q5_1 || type == CS_QMAT_Q5_K ? 64
                                                                                  : 0;
}
static inline int32_t cs__qmat_zero(int type) {
    switch (type) {
    case CS_QMAT_Q4_0: return 8;
    case CS_QMAT_Q5_0: return 16;
    case CS_QMAT_Q6_K: return 32;
    case CS_QMAT_Q8_0: return 128;
    }
    return 0;
}
static inline bool cs__qmat_has_min(int type) {
    return type == CS_QMAT_Q4_1 || type == CS_QMAT_Q5_1 || type == CS_QMAT_Q4_K ||
           type == CS_QMAT_Q5_K;
}
/* Blocks that share one d (and m): 8 for K-quants, else 1. */
static inline int cs__qmat_dgroup(int type) {
    return cs__qmat_is_k(type) ? CS_QK_K / CS_QK : 1;
}

/* The arrays of part P's local panel lp (the kernels index blocks from
 * these: q + b * qbytes, h + b * hbytes, d/m + (b / dgroup) * 16,
 * sc + b * 32). */
typedef struct {
    const uint8_t *q, *h, *sc;
    const uint16_t *d, *m;
} cs_qpanel;
static inline cs_qpanel cs__qmat_panel(const cs_qmat *w, const cs_qpart *P, int64_t lp) {
    const int64_t nb = w->n_blocks, nd = nb / cs__qmat_dgroup(P->type);
    cs_qpanel v = {P->q + (size_t)(lp * nb * cs__qmat_qbytes(P->type)),
                   P->h ? P->h + (size_t)(lp * nb * cs__qmat_hbytes(P->type)) : NULL,
                   P->sc ? P->sc + (size_t)(lp * nb * 32) : NULL,
                   P->d + (size_t)(lp * nd * CS_QROWS),
                   P->m ? P->m + (size_t)(lp * nd * CS_QROWS) : NULL};
    return v;
}
/* The part that holds panel p (start the search at *part, panels ascend). */
static inline int cs__qmat_part_of(const cs_qmat *w, int64_t p, int part) {
    while (part + 1 < w->n_parts && p >= w->part[part + 1].panel0)
        part++;
    return part;
}

/* Quantized activations: n_tokens rows of cols values (the layout of the
 * comment above), carved from one buffer of cs_qact_bytes(). */
typedef struct {
    float dx, fsum;
    int32_t xsum, xsum_lo; /* sum of q, and of its first 16 */
} cs_qblock;

typedef struct {
    int n_tokens, group; /* group: G of the comment above */
    int64_t cols, n_blocks;
    int8_t *q;       /* (n_tokens, cols) */
    cs_qblock *meta; /* (n_tokens, n_blocks) */
} cs_qact;

size_t cs_qact_bytes(int n_tokens, int64_t cols);
/* a views buf (cs_qact_bytes(n_tokens, cols) bytes, 64-byte aligned) for
 * a GEMM whose matrix has act_group `group` (cols a multiple of it). */
void cs_qact_init(cs_qact *a, void *buf, int n_tokens, int64_t cols, int group);

/* One output of a stacked qmat: part p's rows go to out (n_tokens, ldo)
 * columns [0, rows), plus bias (rows) when not NULL. */
typedef struct {
    float *out;
    int64_t ldo;
    const float *bias;
} cs_qout;

/* Tokens [t0, t0 + n) of a and of outs (n_parts of them) as their own
 * GEMM: sa views a's rows, so[p] outs[p]'s. */
static inline void cs__qmat_token_slice(const cs_qout *outs, const cs_qact *a, int n_parts,
                                        int64_t t0, int64_t n, cs_qout *so, cs_qact *sa) {
    *sa = *a;
    sa->n_tokens = (int)n;
    sa->q += (size_t)t0 * (size_t)a->cols;
    sa->meta += (size_t)t0 * (size_t)a->n_blocks;
    for (int k = 0; k < n_parts; k++) {
        so[k] = outs[k];
        so[k].out += (size_t)t0 * (size_t)so[k].ldo;
    }
}

/* Quantizes x (n_tokens, a->cols) into a. */
void cs_op_quantize_ref(cs_qact *a, const float *x);
void cs_op_quantize(cs_threadpool *pool, cs_qact *a, const float *x);

/* Fused prologues, one pass over the rows with the same bits as the ops
 * they join (ops.h): x += add (when add is not NULL), xn = rmsnorm(x) * w,
 * then a = quantize(xn); x and xn are (a->n_tokens, a->cols); xn may be x. */
void cs_op_add_rmsnorm_quantize(cs_threadpool *pool, cs_qact *a, float *xn, float *x,
                                const float *add, const float *w, float eps);
/* out = glu(gate, up, act) (may be gate), then a = quantize(out). */
void cs_op_glu_quantize(cs_threadpool *pool, cs_qact *a, float *out, const float *gate,
                        const float *up, cs_act act);

/* outs[p] = a * part p of w ^T (+ bias): one qout per part of w. */
void cs_op_qmatmul_ref(const cs_qout *outs, const cs_qact *a, const cs_qmat *w);
void cs_op_qmatmul(cs_threadpool *pool, const cs_qout *outs, const cs_qact *a, const cs_qmat *w);

/* The fast paths of qmat_vnni.c, when this CPU runs them (AVX-512 F, BW, VL
 * and VNNI, checked at run time) and CHUNKSERVE_CPU_KERNELS is not
 * "generic"; else the plain C of qmat.c runs, with the same bits. */
bool cs__qmat_vnni_usable(void);
/* Panels [p0, p1) for every token of a. */
void cs__qmat_vnni_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1);
void cs__quantize_vnni_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1);
/* Benchmarks: iters x 16 independent vpdpbusd (1024 int8 MACs each
 * iteration) on the calling thread (only where cs__qmat_vnni_usable()). */
int64_t cs__qmat_vnni_peak_loop(int64_t iters);
/* The AMX GEMM of qmat_amx.c (AMX-TILE and AMX-INT8, checked at run time,
 * with the tile state granted to this process; AVX-512 VNNI too): whole
 * tiles of 16 tokens on AMX, the last tokens on the VNNI kernels. */
bool cs__qmat_amx_usable(void);
void cs__qmat_amx_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1);
/* iters x 16 tile products of 16 x 16 x 64 (262,144 int8 MACs each
 * iteration) on the calling thread (only where cs__qmat_amx_usable()). */
int64_t cs__qmat_amx_peak_loop(int64_t iters);
/* The AVX2 GEMM of qmat_avx2.c, for CPUs without VNNI (AVX2, FMA and F16C,
 * checked at run time); the activations are quantized by the reference. */
bool cs__qmat_avx2_usable(void);
void cs__qmat_avx2_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1);
/* Which kernels cs_op_qmatmul runs: the best this CPU has, unless
 * CHUNKSERVE_CPU_KERNELS says "generic" (the reference), "avx2" (no VNNI)
 * or "vnni" (no AMX); tests force one (CS_QMAT_KERNELS_AUTO restores the
 * choice). */
enum {
    CS_QMAT_KERNELS_AUTO = -1,
    CS_QMAT_KERNELS_REF,
    CS_QMAT_KERNELS_AVX2,
    CS_QMAT_KERNELS_VNNI,
    CS_QMAT_KERNELS_AMX
};
int cs__qmat_kernels(void);
void cs__qmat_force_kernels(int which);
/* The plain C versions of the same two. */
void cs__qmat_ref_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1);
void cs__quantize_ref_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1);

#endif
