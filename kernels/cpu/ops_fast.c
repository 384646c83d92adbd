/* ops_fast.c: the fast CPU ops: threaded on a cs_threadpool, vectorized with
 * AVX-512 intrinsics when the compiler targets AVX-512 (GCC vector
 * extensions, 8 lanes, with the same algorithms otherwise), GEMM through
 * OpenBLAS.
 *
 * Every result is independent of the pool size: work is cut into pieces
 * chosen from the shapes alone, and each piece is computed the same way
 * whichever thread runs it. That is also why OpenBLAS runs single-threaded
 * inside our tiles instead of on its own threads: its threaded GEMM cuts the
 * matrices by thread count and its edge kernels round differently, so the
 * output bits would change with the number of threads (measured on 0.3.21).
 *
 * Nor does it depend on the instruction set (OpenBLAS's GEMM aside): each
 * lane computes the same sequence of correctly rounded operations in both
 * vector flavours (fused multiply-adds only where v_fma says so: the file is
 * built with -ffp-contract=off; the one horizontal sum runs over 16 lanes in
 * a fixed tree; the same e^x), so a build without AVX-512, or without FMA,
 * gives the same bits (tests/unit/test_ops_isa.c).
 *
 * Not the specification (ops_ref.c is); tested against it by normalized error
 * in tests/unit/test_cpu_ops.c. */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunkserve/ops.h"
#include "chunkserve/assert.h"
#include "chunkserve/log.h"

#if defined(__AVX512F__) || (defined(__FMA__) && defined(__AVX__))
#include <immintrin.h>
#endif

/* ---- VL-lane fp32 vectors: AVX-512, or generic vectors with the same API ---- */

#ifdef __AVX512F__
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
static inline vf v_set1(float a) {
    return _mm512_set1_ps(a);
}
static inline vf v_load(const float *p) {
    return _mm512_loadu_ps(p);
}
static inline void v_store(float *p, vf a) {
    _mm512_storeu_ps(p, a);
}
/* The first n (0..VL) lanes; the rest read as 0 and are not written. */
static inline vf v_load_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline void v_store_n(float *p, vf a, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a);
}
static inline vf v_add(vf a, vf b) {
    return _mm512_add_ps(a, b);
}
static inline vf v_sub(vf a, vf b) {
    return _mm512_sub_ps(a, b);
}
static inline vf v_mul(vf a, vf b) {
    return _mm512_mul_ps(a, b);
}
static inline vf v_div(vf a, vf b) {
    return _mm512_div_ps(a, b);
}
static inline vf v_max(vf a, vf b) {
    return _mm512_max_ps(a, b);
}
static inline vf v_fma(vf a, vf b, vf c) { /* a * b + c */
    return _mm512_fmadd_ps(a, b, c);
}
static inline vi vi_load(const int32_t *p) {
    return _mm512_loadu_si512(p);
}
/* -inf in the lanes whose position is before key j (causal mask). */
static inline vf v_mask_causal(vf s, vi pos, int32_t j) {
    __mmask16 m = _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(j));
    return _mm512_mask_mov_ps(s, m, _mm512_set1_ps(-INFINITY));
}
/* -inf in the lanes whose position is at least end: key end - window has
 * left their window (sliding-window mask). */
static inline vf v_mask_window(vf s, vi pos, int32_t end) {
    __mmask16 m = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(end));
    return _mm512_mask_mov_ps(s, m, _mm512_set1_ps(-INFINITY));
}
/* e^x, Cephes expf: 2^n * e^r with n = round(x / ln 2) and a degree-5
 * polynomial for e^r on |r| <= ln(2)/2; about 1 ulp. The clamp makes -inf
 * (masked scores) exactly 0 and keeps large x finite. */
static inline vf v_exp(vf x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#else
/* GCC/Clang vector extensions, lowered to whatever SIMD the target has (one
 * AVX2 register, two SSE or NEON ones). 8 lanes, not 16: the kernels keep
 * ~16 accumulators live, which must fit AVX2's 16 registers. */
#define VL 8
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
static inline vf v_set1(float a) {
    return (vf){a, a, a, a, a, a, a, a};
}
static inline vf v_load(const float *p) {
    vf r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void v_store(float *p, vf a) {
    memcpy(p, &a, sizeof a);
}
static inline vf v_load_n(const float *p, int n) {
    vf r = {0};
    memcpy(&r, p, (size_t)n * sizeof(float));
    return r;
}
static inline void v_store_n(float *p, vf a, int n) {
    memcpy(p, &a, (size_t)n * sizeof(float));
}
static inline vf v_add(vf a, vf b) {
    return a + b;
}
static inline vf v_sub(vf a, vf b) {
    return a - b;
}
static inline vf v_mul(vf a, vf b) {
    return a * b;
}
static inline vf v_div(vf a, vf b) {
    return a / b;
}
static inline vf v_select(vi mask, vf a, vf b) { /* mask ? a : b, lane-wise */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}
static inline vf v_max(vf a, vf b) {
    return v_select(a > b, a, b);
}
static inline vf v_min(vf a, vf b) { /* as _mm512_min_ps: b unless a < b */
    return v_select(a < b, a, b);
}
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { /* rounded once */
#if defined(__FMA__) && defined(__AVX__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int l = 0; l < VL; l++)
        r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#endif
}
static inline vi vi_load(const int32_t *p) {
    vi r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline vf v_mask_causal(vf s, vi pos, int32_t j) {
    return v_select(pos < (vi){0} + j, v_set1(-INFINITY), s);
}
static inline vf v_mask_window(vf s, vi pos, int32_t end) {
    return v_select(pos >= (vi){0} + end, v_set1(-INFINITY), s);
}
/* The same e^x as above, step for step: the same clamp, rounding (the
 * 1.5 * 2^23 trick rounds half to even like roundscale) and fused steps;
 * 2^n goes in through the exponent bits, in two factors when 2^n is below
 * the normal range, so that only the last product rounds, as scalef does. */
static inline __attribute__((always_inline)) vf v_exp(vf x) {
    x = v_min(v_max(x, v_set1(-127.0f)), v_set1(88.0f));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = v_fma(-n, v_set1(0.693359375f), x);
    r = v_fma(-n, v_set1(-2.12194440e-4f), r);
    vf p = v_fma(v_set1(1.9875691500e-4f), r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_fma(p, r * r, r + 1.0f);
    vi e = __builtin_convertvector(n, vi), sub = e < -126; /* -183 <= e <= 127 */
    vi e1 = e + (sub & 64), e2 = sub & -64;
    return (p * (vf)((e1 + 127) << 23)) * (vf)((e2 + 127) << 23);
}
#endif

/* A portable x86-64 build (no AVX-512, no FMA in its target: the CPU
 * Docker image) would take v_fma's fmaf per lane: a libm call each. Its hot
 * loops are therefore cloned for x86-64-v3 (AVX2 + FMA), which GCC picks at
 * load time where the CPU has it (ifunc); there the same fused operations
 * are single instructions, so the bits do not change. CS_OPS_NO_CLONES
 * keeps one plain copy (tests/unit/ops_fast_copy.c). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX512F__) &&    \
    !defined(__FMA__) && !defined(CS_OPS_NO_CLONES)
#define CS_OPS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CS_OPS_CLONES
#endif

/* Runs fn over [0, n) on the pool when there is enough work (in rough
 * flops) to pay for waking it, a few microseconds, else on the caller. */
static void run(cs_threadpool *pool, int64_t n, double work, cs_range_fn fn, void *arg) {
    if (cs_threadpool_size(pool) > 1 && work >= 65536.0)
        cs_threadpool_for(pool, n, fn, arg);
    else if (n > 0)
        fn(arg, 0, n, 0);
}

/* ---- matmul: OpenBLAS on fixed tiles ---- */

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

static void blas_init(void) {
    openblas_set_num_threads(1);
    /* OpenBLAS 0.3.21 does not know the newest Xeons and falls back to its
     * SSE3 kernels, 4-5x slower here than the AVX-512 ones. */
#if defined(__x86_64__) && defined(__GNUC__)
    const char *core = openblas_get_corename();
    if (core && !strcmp(core, "Prescott") && !getenv("OPENBLAS_CORETYPE") &&
        __builtin_cpu_supports("avx2"))
        CS_LOGW("OpenBLAS picked its %s kernels on this CPU; export OPENBLAS_CORETYPE=%s for "
                "faster GEMM",
                core, __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell");
#endif
}

void cs_op_blas_fix_coretype(char **argv) {
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename();
    if (!core || strcmp(core, "Prescott") != 0) return;
    const char *want = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                       : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                         : NULL;
    if (!want || setenv("OPENBLAS_CORETYPE", want, 1) != 0) return;
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); /* exec failed: keep the slow kernels, blas_init warns */
}

#define CS_MATMUL_MIN_TILES 8

/* Block size near target that cuts n into equal parts, rounded up to align. */
static int even_block(int n, int target, int align) {
    int parts = (n + target - 1) / target;
    int b = (n + parts - 1) / parts;
    b = (b + align - 1) / align * align;
    return b < n ? b : n;
}

typedef struct {
    float *out;
    const float *x, *w, *bias;
    int n_tokens, rows, cols;
    int tb, rb, n_rblocks; /* tile: tb tokens x rb rows; row blocks per token block */
} matmul_job;

static void matmul_tiles(void *arg, int64_t begin, int64_t end, int thread) {
    const matmul_job *j = arg;
    for (int64_t i = begin; i < end; i++) {
        int t0 = (int)(i / j->n_rblocks) * j->tb, r0 = (int)(i % j->n_rblocks) * j->rb;
        int tn = j->n_tokens - t0 < j->tb ? j->n_tokens - t0 : j->tb;
        int rn = j->rows - r0 < j->rb ? j->rows - r0 : j->rb;
        float *o = j->out + (size_t)t0 * j->rows + r0;
        const float *w = j->w + (size_t)r0 * j->cols, *x = j->x + (size_t)t0 * j->cols;
        float beta = 0.0f;
        if (j->bias) {
            for (int t = 0; t < tn; t++)
                memcpy(o + (size_t)t * j->rows, j->bias + r0, (size_t)rn * sizeof(float));
            beta = 1.0f;
        }
        if (tn == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, rn, j->cols, 1.0f, w, j->cols, x, 1, beta, o,
                        1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tn, rn, j->cols, 1.0f, x, j->cols,
                        w, j->cols, beta, o, j->rows);
    }
}

void cs_op_matmul(cs_threadpool *pool, float *out, const float *x, const float *w,
                  const float *bias, int n_tokens, int rows, int cols) {
    pthread_once(&blas_once, blas_init);
    if (n_tokens <= 0 || rows <= 0) return;
    if (cols <= 0) { /* BLAS rejects a zero leading dimension */
        for (int t = 0; t < n_tokens; t++)
            for (int r = 0; r < rows; r++)
                out[(size_t)t * rows + r] = bias ? bias[r] : 0.0f;
        return;
    }
    /* Tiles from the shape alone (see the file comment): up to 256 x 256,
     * where OpenBLAS runs near its single-core peak, halved (down to 64) on
     * the longer side until there are enough tiles to keep a pool busy:
     * small tiles lose to packing overhead, few tiles to load imbalance. */
    matmul_job j = {out, x, w, bias, n_tokens, rows, cols, 0, 0, 0};
    j.tb = even_block(n_tokens, 256, 1);
    j.rb = even_block(rows, 256, 16);
    for (;;) {
        int64_t tiles = (int64_t)((n_tokens + j.tb - 1) / j.tb) * ((rows + j.rb - 1) / j.rb);
        if (tiles >= CS_MATMUL_MIN_TILES) break;
        if (j.rb >= j.tb && j.rb >= 128)
            j.rb = even_block(rows, j.rb / 2, 16);
        else if (j.tb >= 128)
            j.tb = even_block(n_tokens, j.tb / 2, 1);
        else if (j.rb >= 128)
            j.rb = even_block(rows, j.rb / 2, 16);
        else
            break;
    }
    j.n_rblocks = (rows + j.rb - 1) / j.rb;
    int64_t n_tiles = (int64_t)((n_tokens + j.tb - 1) / j.tb) * j.n_rblocks;
    run(pool, n_tiles, 2.0 * n_tokens * rows * cols, matmul_tiles, &j);
}

/* ---- rmsnorm, rope, swiglu ---- */

typedef struct {
    float *out;
    const float *x, *w;
    int dim;
    float eps;
} rmsnorm_job;

/* Sum of x[i]^2: element i into lane i % 16 (one AVX-512 vector, or two
 * generic ones), the 16 lanes added in one fixed tree, so the bits do not
 * depend on VL. */
static inline __attribute__((always_inline)) float sum_squares(const float *x, int dim) {
    enum { NV = 16 / VL };
    vf acc[NV];
    for (int k = 0; k < NV; k++)
        acc[k] = v_set1(0.0f);
    for (int i = 0; i < dim; i += 16)
        for (int k = 0; k < NV; k++) {
            int n = dim - i - k * VL;
            if (n <= 0) continue;
            vf v = n >= VL ? v_load(x + i + k * VL) : v_load_n(x + i + k * VL, n);
            acc[k] = v_fma(v, v, acc[k]);
        }
    _Alignas(64) float lane[16];
    for (int k = 0; k < NV; k++)
        v_store(lane + k * VL, acc[k]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    return lane[0];
}

CS_OPS_CLONES static void rmsnorm_rows(void *arg, int64_t begin, int64_t end, int thread) {
    const rmsnorm_job *j = arg;
    const int dim = j->dim;
    for (int64_t t = begin; t < end; t++) {
        const float *x = j->x + (size_t)t * dim;
        float *o = j->out + (size_t)t * dim;
        vf scale = v_set1(1.0f / sqrtf(sum_squares(x, dim) / (float)dim + j->eps));
        int i;
        for (i = 0; i + VL <= dim; i += VL)
            v_store(o + i, v_mul(v_load(j->w + i), v_mul(v_load(x + i), scale)));
        if (i < dim)
            v_store_n(o + i,
                      v_mul(v_load_n(j->w + i, dim - i), v_mul(v_load_n(x + i, dim - i), scale)),
                      dim - i);
    }
}

void cs_op_rmsnorm(cs_threadpool *pool, float *out, const float *x, const float *w, int n_tokens,
                   int dim, float eps) {
    rmsnorm_job j = {out, x, w, dim, eps};
    run(pool, n_tokens, 3.0 * n_tokens * dim, rmsnorm_rows, &j);
}

#define CS_ROPE_MAX_HALF 256

typedef struct {
    float *x;
    int n_heads, head_dim;
    const int32_t *pos;
    const float *inv_freq;
} rope_job;

/* Same operations in the same order as cs_op_rope_ref (no fused
 * multiply-add), so the result is bit-identical to the reference. */
CS_OPS_CLONES static void rope_tokens(void *arg, int64_t begin, int64_t end, int thread) {
    const rope_job *j = arg;
    const int half = j->head_dim / 2;
    float cs[CS_ROPE_MAX_HALF], sn[CS_ROPE_MAX_HALF];
    for (int64_t t = begin; t < end; t++) {
        for (int i = 0; i < half; i++) {
            float angle = (float)j->pos[t] * j->inv_freq[i];
            cs[i] = cosf(angle);
            sn[i] = sinf(angle);
        }
        for (int h = 0; h < j->n_heads; h++) {
            float *v = j->x + ((size_t)t * j->n_heads + h) * j->head_dim;
            for (int i = 0; i < half; i += VL) {
                int n = half - i < VL ? half - i : VL;
                vf x0 = v_load_n(v + i, n), x1 = v_load_n(v + i + half, n);
                vf c = v_load_n(cs + i, n), s = v_load_n(sn + i, n);
                v_store_n(v + i, v_sub(v_mul(x0, c), v_mul(x1, s)), n);
                v_store_n(v + i + half, v_add(v_mul(x1, c), v_mul(x0, s)), n);
            }
        }
    }
}

void cs_op_rope(cs_threadpool *pool, float *x, int n_tokens, int n_heads, int head_dim,
                const int32_t *pos, const float *inv_freq) {
    CS_ASSERT(head_dim <= 2 * CS_ROPE_MAX_HALF);
    rope_job j = {x, n_heads, head_dim, pos, inv_freq};
    run(pool, n_tokens, 3.0 * n_tokens * n_heads * head_dim + 40.0 * n_tokens * head_dim,
        rope_tokens, &j);
}

typedef struct {
    float *out;
    const float *gate, *up;
    size_t n;
    cs_act act;
} glu_job;

/* Over blocks of VL elements, the last one masked, so every element takes
 * the same path whatever the split. GELU's tanh form as x / (1 + e^-2u),
 * the reference's arithmetic step for step. */
CS_OPS_CLONES static void glu_blocks(void *arg, int64_t begin, int64_t end, int thread) {
    const glu_job *j = arg;
    const vf one = v_set1(1.0f), zero = v_set1(0.0f);
    const vf k = v_set1(-1.5957691216057308f), c = v_set1(0.044715f);
    for (int64_t b = begin; b < end; b++) {
        size_t i = (size_t)b * VL;
        int n = j->n - i < VL ? (int)(j->n - i) : VL;
        vf g = v_load_n(j->gate + i, n), u = v_load_n(j->up + i, n);
        vf e = j->act == CS_ACT_SILU ? v_sub(zero, g)
                                     : v_mul(k, v_add(g, v_mul(v_mul(v_mul(c, g), g), g)));
        vf a = v_div(g, v_add(one, v_exp(e)));
        v_store_n(j->out + i, v_mul(a, u), n);
    }
}

void cs_op_glu(cs_threadpool *pool, float *out, const float *gate, const float *up, size_t n,
               cs_act act) {
    glu_job j = {out, gate, up, n, act};
    run(pool, (int64_t)((n + VL - 1) / VL), (act == CS_ACT_SILU ? 20.0 : 26.0) * (double)n,
        glu_blocks, &j);
}

/* ---- attention ---- */

/* A tile is VL query rows, one per vector lane, that share a kv head: the
 * (token, head) pairs of one span and kv head in token-major order, so GQA
 * heads of a token and consecutive tokens fill the lanes alike (a decode
 * token with 3 heads per kv head uses 3 lanes). Tiles go through the keys in
 * pairs, so each K or V value loaded feeds 2 * VL rows: with one tile the
 * loops are bound by loads, not FMAs. Keys go in blocks of up to CS_ATTN_KB with
 * an online (running-max) softmax, so scratch stays on the stack whatever
 * the context length. Scores are kept transposed, one vector of VL rows per
 * key, so the softmax needs no horizontal operations. */
#define CS_ATTN_ROWS VL
#define CS_ATTN_KB 32
#define CS_ATTN_MAX_HEAD_DIM 256
#define PAIR (2 * CS_ATTN_ROWS) /* scratch row stride: two tiles side by side */

typedef struct {
    float *out;
    const float *q;
    const cs_attn_span *spans;
    int n_spans;
    const cs_kv_view *kv;
    int n_heads, n_kv_heads, head_dim, group;
    float scale;
    int32_t window; /* 0: none */
    int n_parts;
    int64_t total_cost;
} attn_job;

static int64_t span_pairs(const cs_attn_span *sp, int group) {
    int64_t tiles = ((int64_t)sp->n_q * group + CS_ATTN_ROWS - 1) / CS_ATTN_ROWS;
    return (tiles + 1) / 2;
}

/* Work estimate of a tile pair, for the split: the keys it reads (up to its
 * last row's position, from its first row's window; rows are sorted by
 * position) plus a fixed cost. */
static int64_t pair_cost(const cs_attn_span *sp, int group, int32_t window, int64_t pair) {
    int64_t first = pair * PAIR, last = (pair + 1) * PAIR - 1, rows = (int64_t)sp->n_q * group;
    if (last >= rows) last = rows - 1;
    int64_t keys = sp->pos + last / group + 1, lo = sp->pos + first / group + 1 - window;
    return (window > 0 && lo > 0 ? keys - lo : keys) + 64;
}

/* Rows r0 .. r0+n_rows-1 (n_rows <= 32) of span sp and kv head g, in nt
 * tiles; nt is a constant in each inlined copy, so the second tile's code
 * disappears when nt == 1. */
/* Element i of a K/V row at p: fp32, or bf16 widened (bf is a constant in
 * each inlined copy). */
static inline __attribute__((always_inline)) float kv_elem(const char *p, size_t i) {
    return ((const float *)(const void *)p)[i];
}

/* n bf16 values widened to fp32 (exactly: the bits move up 16 places). */
static inline void widen_bf16(float *dst, const uint16_t *src, int n) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(
            dst + i,
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))),
                              16));
#endif
    for (; i < n; i++)
        dst[i] = cs_bf16_to_f32(src[i]);
}

static inline __attribute__((always_inline)) void attn_rows(const attn_job *j,
                                                            const cs_attn_span *sp, int g,
                                                            int64_t r0, int n_rows, const int nt,
                                                            const int bf) {
    const int hd = j->head_dim, group = j->group, q_dim = j->n_heads * hd,
              kv_dim = j->n_kv_heads * hd;
    const cs_kv_view *kv = j->kv;
    const float scale = j->scale;
    const int32_t window = j->window;

    _Alignas(64) float qt[CS_ATTN_MAX_HEAD_DIM * PAIR]; /* (head_dim, 32): scaled q, transposed */
    _Alignas(64) float ot[CS_ATTN_MAX_HEAD_DIM * PAIR]; /* (head_dim, 32): output accumulator */
    _Alignas(64) float st[CS_ATTN_KB * PAIR];           /* (keys, 32): scores, then weights */
    int32_t pos[PAIR];
    const char *kp[CS_ATTN_KB]; /* K rows of the block's keys (V: + v_offset elements) */
    /* bf16 pools: each block's K and V rows are widened once into kvw, (keys,
     * K|V, head_dim), and read from there like an fp32 pool's */
    const size_t es = bf ? sizeof(uint16_t) : sizeof(float);
    const char *base = bf ? (const char *)kv->k16 : (const char *)kv->k;
    _Alignas(64) float kvw[bf ? CS_ATTN_KB * 2 * CS_ATTN_MAX_HEAD_DIM : 1];
    const size_t vo = bf ? (size_t)hd : kv->v_offset; /* V after K, in elements */

    /* Unused lanes repeat the last row: finite, and never stored. */
    for (int l = 0; l < nt * CS_ATTN_ROWS; l++) {
        int64_t r = r0 + (l < n_rows ? l : n_rows - 1);
        int32_t t = (int32_t)(r / group);
        int h = g * group + (int)(r % group);
        pos[l] = sp->pos + t;
        const float *qr = j->q + (size_t)(sp->q_begin + t) * q_dim + (size_t)h * hd;
        for (int d = 0; d < hd; d++)
            qt[d * PAIR + l] = qr[d] * scale;
    }
    for (int d = 0; d < hd; d++) {
        v_store(ot + d * PAIR, v_set1(0.0f));
        if (nt > 1) v_store(ot + d * PAIR + CS_ATTN_ROWS, v_set1(0.0f));
    }
    const vi pos_a = vi_load(pos), pos_b = vi_load(nt > 1 ? pos + CS_ATTN_ROWS : pos);
    /* The running max starts at -FLT_MAX, not -inf: a row whose window
     * starts after a block sees only masked keys there, and stays at m =
     * -FLT_MAX, l = 0, o = 0 exactly, as if it had started at its own first
     * block; so a row's bits depend only on its keys and the block grid
     * (multiples of CS_ATTN_KB), never on the rows it shares a tile with. */
    vf m_a = v_set1(-FLT_MAX), m_b = m_a, l_a = v_set1(0.0f), l_b = l_a;

    const int32_t n_keys = pos[n_rows - 1] + 1;
    /* With a window, the tile's first key is its first row's; keys before
     * it in the first block are masked for every row and read nothing (they
     * point at key lo: their pages may have been released). */
    const int32_t lo = window > 0 && pos[0] + 1 > window ? pos[0] + 1 - window : 0;
    const int32_t lo_max = window > 0 && n_keys > window ? n_keys - window : 0;
    int32_t page = lo / kv->page_size, off = lo % kv->page_size; /* cursor of key lo */
    for (int32_t j0 = lo / CS_ATTN_KB * CS_ATTN_KB; j0 < n_keys; j0 += CS_ATTN_KB) {
        const int kb = n_keys - j0 < CS_ATTN_KB ? n_keys - j0 : CS_ATTN_KB;
        const int skip = lo > j0 ? lo - j0 : 0; /* keys of the block before lo */
        for (int jj = skip; jj < kb; jj++) {
            kp[jj] = base + ((size_t)sp->pages[page] * kv->page_stride + (size_t)off * kv_dim +
                             (size_t)g * hd) *
                                es;
            if (++off == kv->page_size) off = 0, page++;
        }
        for (int jj = 0; jj < skip; jj++)
            kp[jj] = kp[skip];
        if (bf)
            for (int jj = skip; jj < kb; jj++) {
                const uint16_t *k16 = (const uint16_t *)(const void *)kp[jj];
                float *w = kvw + (size_t)jj * 2 * hd;
                widen_bf16(w, k16, hd);
                widen_bf16(w + hd, k16 + kv->v_offset, hd);
                kp[jj] = (const char *)w;
            }
        if (bf)
            for (int jj = 0; jj < skip; jj++)
                kp[jj] = kp[skip];
        /* Scores, 8 keys at a time (8 independent FMA chains per tile); the
         * padding keys of the last group repeat a real key and are ignored. */
        for (int jj = kb; jj < (kb + 7) / 8 * 8; jj++)
            kp[jj] = kp[kb - 1];
        for (int j8 = 0; j8 < kb; j8 += 8) {
            const vf z = v_set1(0.0f);
            vf a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
            vf b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z, b6 = z, b7 = z;
            const char *k0 = kp[j8], *k1 = kp[j8 + 1], *k2 = kp[j8 + 2], *k3 = kp[j8 + 3];
            const char *k4 = kp[j8 + 4], *k5 = kp[j8 + 5], *k6 = kp[j8 + 6], *k7 = kp[j8 + 7];
            for (int d = 0; d < hd; d++) {
                const vf qa = v_load(qt + d * PAIR);
                vf k;
#define QK(i)                                                                                      \
    k = v_set1(kv_elem(k##i, (size_t)d));                                                          \
    a##i = v_fma(k, qa, a##i);                                                                     \
    if (nt > 1) b##i = v_fma(k, v_load(qt + d * PAIR + CS_ATTN_ROWS), b##i)
                QK(0);
                QK(1);
                QK(2);
                QK(3);
                QK(4);
                QK(5);
                QK(6);
                QK(7);
#undef QK
            }
            float *s = st + j8 * PAIR;
            v_store(s, a0), v_store(s + PAIR, a1), v_store(s + 2 * PAIR, a2),
                v_store(s + 3 * PAIR, a3);
            v_store(s + 4 * PAIR, a4), v_store(s + 5 * PAIR, a5), v_store(s + 6 * PAIR, a6);
            v_store(s + 7 * PAIR, a7);
            if (nt > 1) {
                s += CS_ATTN_ROWS;
                v_store(s, b0), v_store(s + PAIR, b1), v_store(s + 2 * PAIR, b2),
                    v_store(s + 3 * PAIR, b3);
                v_store(s + 4 * PAIR, b4), v_store(s + 5 * PAIR, b5), v_store(s + 6 * PAIR, b6);
                v_store(s + 7 * PAIR, b7);
            }
        }
        /* Window mask, only where some row's window starts after a key of
         * the block; causal mask, only where some row ends inside it. */
        if (j0 < lo_max)
            for (int jj = 0; jj < kb; jj++) {
                float *s = st + jj * PAIR;
                v_store(s, v_mask_window(v_load(s), pos_a, j0 + jj + window));
                if (nt > 1)
                    v_store(s + CS_ATTN_ROWS,
                            v_mask_window(v_load(s + CS_ATTN_ROWS), pos_b, j0 + jj + window));
            }
        if (j0 + kb - 1 > pos[0])
            for (int jj = 0; jj < kb; jj++) {
                float *s = st + jj * PAIR;
                v_store(s, v_mask_causal(v_load(s), pos_a, j0 + jj));
                if (nt > 1)
                    v_store(s + CS_ATTN_ROWS,
                            v_mask_causal(v_load(s + CS_ATTN_ROWS), pos_b, j0 + jj));
            }
        /* Online softmax: what was accumulated is rescaled by
         * e^(m_old - m_new); m is never -inf, so m_old - m_new is never
         * -inf - -inf. */
        vf mn_a = m_a, mn_b = m_b, s_a = v_set1(0.0f), s_b = s_a;
        for (int jj = 0; jj < kb; jj++) {
            mn_a = v_max(mn_a, v_load(st + jj * PAIR));
            if (nt > 1) mn_b = v_max(mn_b, v_load(st + jj * PAIR + CS_ATTN_ROWS));
        }
        const vf al_a = v_exp(v_sub(m_a, mn_a)), al_b = nt > 1 ? v_exp(v_sub(m_b, mn_b)) : al_a;
        m_a = mn_a, m_b = mn_b;
        for (int jj = 0; jj < kb; jj++) {
            float *s = st + jj * PAIR;
            vf p = v_exp(v_sub(v_load(s), mn_a));
            v_store(s, p);
            s_a = v_add(s_a, p);
            if (nt > 1) {
                p = v_exp(v_sub(v_load(s + CS_ATTN_ROWS), mn_b));
                v_store(s + CS_ATTN_ROWS, p);
                s_b = v_add(s_b, p);
            }
        }
        l_a = v_fma(l_a, al_a, s_a);
        if (nt > 1) l_b = v_fma(l_b, al_b, s_b);
        /* ot[d] = alpha * ot[d] + sum_j V[j][d] * p[j], 8 dims at a time. */
        int d = 0;
        for (; d + 8 <= hd; d += 8) {
            float *o = ot + d * PAIR;
            vf a0 = v_mul(v_load(o), al_a), a1 = v_mul(v_load(o + PAIR), al_a);
            vf a2 = v_mul(v_load(o + 2 * PAIR), al_a), a3 = v_mul(v_load(o + 3 * PAIR), al_a);
            vf a4 = v_mul(v_load(o + 4 * PAIR), al_a), a5 = v_mul(v_load(o + 5 * PAIR), al_a);
            vf a6 = v_mul(v_load(o + 6 * PAIR), al_a), a7 = v_mul(v_load(o + 7 * PAIR), al_a);
            vf b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
            if (nt > 1) {
                b0 = v_mul(v_load(o + CS_ATTN_ROWS), al_b),
                b1 = v_mul(v_load(o + PAIR + CS_ATTN_ROWS), al_b);
                b2 = v_mul(v_load(o + 2 * PAIR + CS_ATTN_ROWS), al_b),
                b3 = v_mul(v_load(o + 3 * PAIR + CS_ATTN_ROWS), al_b);
                b4 = v_mul(v_load(o + 4 * PAIR + CS_ATTN_ROWS), al_b),
                b5 = v_mul(v_load(o + 5 * PAIR + CS_ATTN_ROWS), al_b);
                b6 = v_mul(v_load(o + 6 * PAIR + CS_ATTN_ROWS), al_b),
                b7 = v_mul(v_load(o + 7 * PAIR + CS_ATTN_ROWS), al_b);
            }
            for (int jj = 0; jj < kb; jj++) {
                const char *vr = kp[jj] + (vo + (size_t)d) * sizeof(float);
                const vf pa = v_load(st + jj * PAIR);
                vf v;
#define PV(i)                                                                                      \
    v = v_set1(kv_elem(vr, i));                                                                    \
    a##i = v_fma(v, pa, a##i);                                                                     \
    if (nt > 1) b##i = v_fma(v, v_load(st + jj * PAIR + CS_ATTN_ROWS), b##i)
                PV(0);
                PV(1);
                PV(2);
                PV(3);
                PV(4);
                PV(5);
                PV(6);
                PV(7);
#undef PV
            }
            v_store(o, a0), v_store(o + PAIR, a1), v_store(o + 2 * PAIR, a2),
                v_store(o + 3 * PAIR, a3);
            v_store(o + 4 * PAIR, a4), v_store(o + 5 * PAIR, a5), v_store(o + 6 * PAIR, a6);
            v_store(o + 7 * PAIR, a7);
            if (nt > 1) {
                o += CS_ATTN_ROWS;
                v_store(o, b0), v_store(o + PAIR, b1), v_store(o + 2 * PAIR, b2),
                    v_store(o + 3 * PAIR, b3);
                v_store(o + 4 * PAIR, b4), v_store(o + 5 * PAIR, b5), v_store(o + 6 * PAIR, b6);
                v_store(o + 7 * PAIR, b7);
            }
        }
        for (; d < hd; d++) {
            float *o = ot + d * PAIR;
            vf a = v_mul(v_load(o), al_a), b = nt > 1 ? v_mul(v_load(o + CS_ATTN_ROWS), al_b) : a;
            for (int jj = 0; jj < kb; jj++) {
                vf v = v_set1(kv_elem(kp[jj], vo + (size_t)d));
                a = v_fma(v, v_load(st + jj * PAIR), a);
                if (nt > 1) b = v_fma(v, v_load(st + jj * PAIR + CS_ATTN_ROWS), b);
            }
            v_store(o, a);
            if (nt > 1) v_store(o + CS_ATTN_ROWS, b);
        }
    }
    const vf inv_a = v_div(v_set1(1.0f), l_a), inv_b = v_div(v_set1(1.0f), l_b);
    for (int d = 0; d < hd; d++) {
        v_store(ot + d * PAIR, v_mul(v_load(ot + d * PAIR), inv_a));
        if (nt > 1)
            v_store(ot + d * PAIR + CS_ATTN_ROWS,
                    v_mul(v_load(ot + d * PAIR + CS_ATTN_ROWS), inv_b));
    }
    for (int l = 0; l < n_rows; l++) {
        int64_t r = r0 + l;
        int32_t t = (int32_t)(r / group);
        int h = g * group + (int)(r % group);
        float *o = j->out + (size_t)(sp->q_begin + t) * q_dim + (size_t)h * hd;
        for (int d = 0; d < hd; d++)
            o[d] = ot[d * PAIR + l];
    }
}

CS_OPS_CLONES static void attn_pair(const attn_job *j, const cs_attn_span *sp, int g,
                                    int64_t pair) {
    int64_t r0 = pair * PAIR, rows = (int64_t)sp->n_q * j->group;
    int n_rows = rows - r0 < PAIR ? (int)(rows - r0) : PAIR;
    const int bf = j->kv->k16 != NULL;
    if (n_rows > CS_ATTN_ROWS && bf)
        attn_rows(j, sp, g, r0, n_rows, 2, 1);
    else if (n_rows > CS_ATTN_ROWS)
        attn_rows(j, sp, g, r0, n_rows, 2, 0);
    else if (bf)
        attn_rows(j, sp, g, r0, n_rows, 1, 1);
    else
        attn_rows(j, sp, g, r0, n_rows, 1, 0);
}

/* Part p of n_parts takes the tile pairs whose cost midpoint falls in its
 * share of the total: a split by estimated work, not count, since causal
 * tiles late in a prompt cost far more than early ones. */
static void attn_parts(void *arg, int64_t begin, int64_t end, int thread) {
    const attn_job *j = arg;
    int64_t cum = 0;
    for (int s = 0; s < j->n_spans; s++) {
        const cs_attn_span *sp = &j->spans[s];
        const int64_t n_pairs = span_pairs(sp, j->group);
        for (int g = 0; g < j->n_kv_heads; g++)
            for (int64_t t = 0; t < n_pairs; t++) {
                int64_t c = pair_cost(sp, j->group, j->window, t);
                int64_t part = (2 * cum + c) * j->n_parts / (2 * j->total_cost);
                cum += c;
                if (part >= end) return;
                if (part >= begin) attn_pair(j, sp, g, t);
            }
    }
}

void cs_op_attention(cs_threadpool *pool, float *out, const float *q, const cs_attn_span *spans,
                     int n_spans, const cs_kv_view *kv, int n_heads, int n_kv_heads, int head_dim,
                     float scale, int32_t window) {
    CS_ASSERT(head_dim >= 1 && head_dim <= CS_ATTN_MAX_HEAD_DIM);
    CS_ASSERT(n_kv_heads >= 1 && n_heads % n_kv_heads == 0 && window >= 0);
    attn_job j = {
        out,   q,      spans, n_spans, kv, n_heads, n_kv_heads, head_dim, n_heads / n_kv_heads,
        scale, window, 1,     0};
    for (int s = 0; s < n_spans; s++) {
        const int64_t n_pairs = span_pairs(&spans[s], j.group);
        for (int64_t t = 0; t < n_pairs; t++)
            j.total_cost += pair_cost(&spans[s], j.group, window, t);
    }
    if (j.total_cost == 0) return;
    j.total_cost *= n_kv_heads;
    j.n_parts = cs_threadpool_size(pool);
    run(pool, j.n_parts, 4.0 * PAIR * head_dim * (double)j.total_cost, attn_parts, &j);
}
