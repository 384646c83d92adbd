/* kernels/cpu/qmat.h: quantized weight matrices and the integer GEMM the CPU
 * backend runs on them (the "quant" weight mode). Internal to cs_kernels; the
 * engine sees only the opaque cs_qmat of backend.h.
 *
 * The arithmetic, which every implementation follows to the bit:
 *
 *   Weights stay in the file's blocks of 32 along K (cols): Q4_0 (d, q 0..15,
 *   w = d*(q-8)), Q4_1 (d, m, q 0..15, w = d*q + m) or Q8_0 (d, q -128..127,
 *   stored as q+128 so every weight is an unsigned byte u with a zero point
 *   z = 8, 0 or 128: w = d*(u - z) (+ m)). d and m stay fp16 as in the file.
 *   Packed once into panels of 16 rows (one vector lane per row), rows padded
 *   to a multiple of 16 with zero weights.
 *
 *   Activations: each row (token) in blocks of 32: amax = max |x|, dx =
 *   amax / 127, q = nearbyint(x * (127 / amax)) (round half to even; all 0
 *   when amax is 0), xsum = sum of q, fsum = dx * xsum (fp32).
 *
 *   Output (token t, row r) = for blocks b = 0, 1, ... in order:
 *     isum = sum over the block of u * q                  (int32: exact)
 *     acc  = fmaf(d * dx, (float)(isum - z * xsum), acc)  (fp32)
 *     acc  = fmaf(m, fsum, acc)                           (Q4_1 only)
 *   starting from acc = 0, then + bias[r] when there is one.
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

#include "backend.h"
#include "ops.h"

#define CS_QK 32        /* weights per block along K */
#define CS_QROWS 16     /* rows per panel (vector lanes) */
#define CS_QMAT_PARTS 4 /* matrices one qmat may stack (q|k|v, gate|up) */

struct cs_qmat {
    int type;         /* CS_QMAT_Q4_0 / Q4_1 / Q8_0 */
    int64_t cols;     /* K, a multiple of CS_QK */
    int64_t n_blocks; /* cols / CS_QK */
    int64_t n_panels; /* panels of CS_QROWS rows, over all parts */
    int n_parts;
    struct {
        int64_t rows;   /* real rows of this part */
        int64_t panel0; /* its first panel */
    } part[CS_QMAT_PARTS];
    /* q: (n_panels, n_blocks, qbytes): Q4: 4 vectors of 64 bytes, vector j
     * lane r byte i = u[r][8j+i] | u[r][8j+4+i] << 4; Q8: 8 vectors, vector j
     * lane r byte i = u[r][4j+i]. */
    uint8_t *q;
    uint16_t *d; /* (n_panels, n_blocks, CS_QROWS) fp16 scales */
    uint16_t *m; /* (n_panels, n_blocks, CS_QROWS) fp16 mins (Q4_1), else NULL */
    size_t bytes;
};

/* Bytes of packed weights per (panel, block). */
static inline int cs__qmat_qbytes(int type) {
    return type == CS_QMAT_Q8_0 ? CS_QROWS * CS_QK : CS_QROWS * CS_QK / 2;
}
static inline int32_t cs__qmat_zero(int type) {
    return type == CS_QMAT_Q4_0 ? 8 : type == CS_QMAT_Q8_0 ? 128 : 0;
}

/* Quantized activations: n_tokens rows of cols values (the layout of the
 * comment above), carved from one buffer of cs_qact_bytes(). */
typedef struct {
    float dx, fsum;
    int32_t xsum, pad;
} cs_qblock;

typedef struct {
    int n_tokens;
    int64_t cols, n_blocks;
    int8_t *q;       /* (n_tokens, cols) */
    cs_qblock *meta; /* (n_tokens, n_blocks) */
} cs_qact;

size_t cs_qact_bytes(int n_tokens, int64_t cols);
/* a views buf (cs_qact_bytes(n_tokens, cols) bytes, 64-byte aligned). */
void cs_qact_init(cs_qact *a, void *buf, int n_tokens, int64_t cols);

/* One output of a stacked qmat: part p's rows go to out (n_tokens, ldo)
 * columns [0, rows), plus bias (rows) when not NULL. */
typedef struct {
    float *out;
    int64_t ldo;
    const float *bias;
} cs_qout;

/* Quantizes x (n_tokens, a->cols) into a. */
void cs_op_quantize_ref(cs_qact *a, const float *x);
void cs_op_quantize(cs_threadpool *pool, cs_qact *a, const float *x);

/* Fused prologues, one pass over the rows with the same bits as the ops
 * they join (ops.h): x += add (when add is not NULL), xn = rmsnorm(x) * w,
 * then a = quantize(xn); x and xn are (a->n_tokens, a->cols); xn may be x. */
void cs_op_add_rmsnorm_quantize(cs_threadpool *pool, cs_qact *a, float *xn, float *x,
                                const float *add, const float *w, float eps);
/* out = swiglu(gate, up) (may be gate), then a = quantize(out). */
void cs_op_swiglu_quantize(cs_threadpool *pool, cs_qact *a, float *out, const float *gate,
                           const float *up);

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
/* int8 multiply-accumulates per second of the whole pool, every thread in
 * the vpdpbusd loop (amx false) or the tile loop (amx true) for about
 * `seconds`; 0 where those kernels do not run. */
double cs_qmat_peak_macs(cs_threadpool *pool, double seconds, bool amx);
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
/* "generic", "avx2", "avx-512 vnni" or "amx" */
const char *cs_qmat_kernels_name(void);
/* The plain C versions of the same two. */
void cs__qmat_ref_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1);
void cs__quantize_ref_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1);

#endif
