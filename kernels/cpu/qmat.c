/* qmat.c: quantized weight matrices: packing the file's blocks into 16-row
 * panels, reading rows back as fp32 (embeddings), and the plain C reference
 * of the integer GEMM and the activation quantizer, which is the
 * specification (qmat.h states the arithmetic). The AVX-512 VNNI kernels
 * (qmat_vnni.c) must give the same bits; this file also picks which runs.
 *
 * Built with -ffp-contract=off (CMakeLists.txt): every fused multiply-add
 * here is an explicit fmaf, so no compiler can round differently. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qmat.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/half.h"

/* ---- packing ---- */

const char *cs_qmat_type_name(int type) {
    switch (type) {
    case CS_QMAT_Q4_0: return "q4_0";
    case CS_QMAT_Q4_1: return "q4_1";
    case CS_QMAT_Q8_0: return "q8_0";
    case CS_QMAT_F32: return "f32";
    }
    return "?";
}

static size_t src_row_bytes(int type, int64_t cols) {
    int64_t nb = cols / CS_QK;
    switch (type) {
    case CS_QMAT_Q4_0: return (size_t)nb * 18;
    case CS_QMAT_Q4_1: return (size_t)nb * 20;
    case CS_QMAT_Q8_0: return (size_t)nb * 34;
    default: return (size_t)cols * sizeof(float);
    }
}

static uint16_t rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}

/* One source block as unsigned bytes u[32] plus its d (and m) in fp16. */
static void src_block(int type, const uint8_t *row, int64_t b, uint8_t u[CS_QK], uint16_t *d,
                      uint16_t *m) {
    switch (type) {
    case CS_QMAT_Q4_0:
    case CS_QMAT_Q4_1: {
        const uint8_t *s = row + b * (type == CS_QMAT_Q4_0 ? 18 : 20);
        *d = rd16(s);
        *m = type == CS_QMAT_Q4_1 ? rd16(s + 2) : 0;
        const uint8_t *qs = s + (type == CS_QMAT_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            u[i] = qs[i] & 0x0f;
            u[i + 16] = qs[i] >> 4;
        }
        break;
    }
    case CS_QMAT_Q8_0: {
        const uint8_t *s = row + b * 34;
        *d = rd16(s);
        *m = 0;
        for (int i = 0; i < CS_QK; i++)
            u[i] = (uint8_t)((int8_t)s[2 + i] + 128);
        break;
    }
    default: { /* fp32 -> Q8_0 */
        const float *x = (const float *)(const void *)row + b * CS_QK;
        float amax = 0;
        for (int i = 0; i < CS_QK; i++)
            amax = fmaxf(amax, fabsf(x[i]));
        *d = cs_f32_to_f16(amax / 127.0f);
        *m = 0;
        float dd = cs_f16_to_f32(*d);
        for (int i = 0; i < CS_QK; i++) {
            float q = dd > 0 ? nearbyintf(x[i] / dd) : 0.0f;
            q = fminf(fmaxf(q, -127.0f), 127.0f);
            u[i] = (uint8_t)((int)q + 128);
        }
        break;
    }
    }
}

/* Places u (one row's block) in lane r of its panel block. */
static void put_block(int type, uint8_t *pq, int r, const uint8_t u[CS_QK]) {
    if (type == CS_QMAT_Q8_0) {
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++)
                pq[64 * j + 4 * r + i] = u[4 * j + i];
    } else {
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++)
                pq[64 * j + 4 * r + i] = (uint8_t)(u[8 * j + i] | u[8 * j + 4 + i] << 4);
    }
}

/* u of (panel p, block b, lane r, k) back from the panel. */
static inline int32_t get_u(const cs_qmat *w, int64_t p, int64_t b, int r, int k) {
    const uint8_t *pq = w->q + (size_t)(p * w->n_blocks + b) * (size_t)cs__qmat_qbytes(w->type);
    if (w->type == CS_QMAT_Q8_0) return pq[64 * (k / 4) + 4 * r + k % 4];
    int j = k / 8, i = k % 8;
    return i < 4 ? pq[64 * j + 4 * r + i] & 0x0f : pq[64 * j + 4 * r + i - 4] >> 4;
}

int cs_qmat_pack(const cs_qmat_src *parts, int n_parts, int64_t cols, cs_qmat **out) {
    *out = NULL;
    if (n_parts < 1 || n_parts > CS_QMAT_PARTS || cols <= 0 || cols % CS_QK)
        return cs_fail(CS_EINVAL,
                       "qmat: %d parts of %lld columns (1..%d parts, columns a "
                       "positive multiple of %d)",
                       n_parts, (long long)cols, CS_QMAT_PARTS, CS_QK);
    int in_type = parts[0].type;
    for (int p = 0; p < n_parts; p++) {
        if (parts[p].type != in_type || in_type < CS_QMAT_Q4_0 || in_type > CS_QMAT_F32)
            return cs_fail(CS_EINVAL, "qmat: part %d has type %s, part 0 %s", p,
                           cs_qmat_type_name(parts[p].type), cs_qmat_type_name(in_type));
        if (parts[p].rows <= 0 || !parts[p].data)
            return cs_fail(CS_EINVAL, "qmat: part %d has no rows", p);
    }
    cs_qmat *w = calloc(1, sizeof *w);
    if (!w) return cs_fail(CS_ENOMEM, "qmat: out of memory");
    w->type = in_type == CS_QMAT_F32 ? CS_QMAT_Q8_0 : in_type;
    w->cols = cols;
    w->n_blocks = cols / CS_QK;
    w->n_parts = n_parts;
    for (int p = 0; p < n_parts; p++) {
        w->part[p].rows = parts[p].rows;
        w->part[p].panel0 = w->n_panels;
        w->n_panels += (parts[p].rows + CS_QROWS - 1) / CS_QROWS;
    }
    size_t n_pb = (size_t)(w->n_panels * w->n_blocks), qb = (size_t)cs__qmat_qbytes(w->type);
    size_t qbytes = (n_pb * qb + 63) / 64 * 64, sbytes = (n_pb * CS_QROWS * 2 + 63) / 64 * 64;
    w->q = aligned_alloc(64, qbytes);
    w->d = aligned_alloc(64, sbytes);
    w->m = w->type == CS_QMAT_Q4_1 ? aligned_alloc(64, sbytes) : NULL;
    if (!w->q || !w->d || (w->type == CS_QMAT_Q4_1 && !w->m)) {
        cs_qmat_free(w);
        return cs_fail(CS_ENOMEM, "qmat: out of memory for %zu MiB of weights", qbytes >> 20);
    }
    w->bytes = qbytes + sbytes * (w->m ? 2 : 1);
    /* padding rows: zero weights (u = z, d = m = 0) */
    memset(w->q, w->type == CS_QMAT_Q8_0 ? 0x80 : w->type == CS_QMAT_Q4_0 ? 0x88 : 0, qbytes);
    memset(w->d, 0, sbytes);
    if (w->m) memset(w->m, 0, sbytes);
    size_t row_bytes = src_row_bytes(in_type, cols);
    for (int p = 0; p < n_parts; p++) {
        for (int64_t r = 0; r < parts[p].rows; r++) {
            int64_t sr = parts[p].perm ? parts[p].perm[r] : r;
            const uint8_t *row = (const uint8_t *)parts[p].data + (size_t)sr * row_bytes;
            int64_t panel = w->part[p].panel0 + r / CS_QROWS;
            int lane = (int)(r % CS_QROWS);
            for (int64_t b = 0; b < w->n_blocks; b++) {
                uint8_t u[CS_QK];
                uint16_t d, m;
                src_block(in_type, row, b, u, &d, &m);
                size_t pb = (size_t)(panel * w->n_blocks + b);
                put_block(w->type, w->q + pb * qb, lane, u);
                w->d[pb * CS_QROWS + (size_t)lane] = d;
                if (w->m) w->m[pb * CS_QROWS + (size_t)lane] = m;
            }
        }
    }
    *out = w;
    return 0;
}

void cs_qmat_free(cs_qmat *w) {
    if (!w) return;
    free(w->q);
    free(w->d);
    free(w->m);
    free(w);
}

size_t cs_qmat_bytes(const cs_qmat *w) {
    return w->bytes;
}
int cs_qmat_type(const cs_qmat *w) {
    return w->type;
}

void cs_qmat_get_rows(const cs_qmat *w, int part, const int32_t *ids, int n, float *out) {
    int32_t z = cs__qmat_zero(w->type);
    CS_ASSERT(part >= 0 && part < w->n_parts);
    for (int t = 0; t < n; t++) {
        CS_ASSERT(ids[t] >= 0 && ids[t] < w->part[part].rows);
        int64_t p = w->part[part].panel0 + ids[t] / CS_QROWS;
        int r = ids[t] % CS_QROWS;
        float *o = out + (size_t)t * (size_t)w->cols;
        for (int64_t b = 0; b < w->n_blocks; b++) {
            size_t s = (size_t)(p * w->n_blocks + b) * CS_QROWS + (size_t)r;
            float d = cs_f16_to_f32(w->d[s]), m = w->m ? cs_f16_to_f32(w->m[s]) : 0.0f;
            for (int k = 0; k < CS_QK; k++) {
                float q = (float)(get_u(w, p, b, r, k) - z);
                o[b * CS_QK + k] = w->m ? fmaf(d, q, m) : d * q;
            }
        }
    }
}

/* ---- activations ---- */

size_t cs_qact_bytes(int n_tokens, int64_t cols) {
    size_t q = ((size_t)n_tokens * (size_t)cols + 63) / 64 * 64;
    return q + (size_t)n_tokens * (size_t)(cols / CS_QK) * sizeof(cs_qblock);
}

void cs_qact_init(cs_qact *a, void *buf, int n_tokens, int64_t cols) {
    CS_ASSERT(cols % CS_QK == 0 && ((uintptr_t)buf & 63) == 0);
    a->n_tokens = n_tokens;
    a->cols = cols;
    a->n_blocks = cols / CS_QK;
    a->q = buf;
    a->meta = (cs_qblock *)((char *)buf + ((size_t)n_tokens * (size_t)cols + 63) / 64 * 64);
}

void cs__quantize_ref_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < a->n_blocks; b++) {
            const float *xb = x + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
            int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
            float amax = 0;
            for (int i = 0; i < CS_QK; i++)
                amax = fmaxf(amax, fabsf(xb[i]));
            float id = amax > 0 ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < CS_QK; i++) {
                q[i] = (int8_t)nearbyintf(xb[i] * id);
                sum += q[i];
            }
            cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
            mb->dx = amax / 127.0f;
            mb->xsum = sum;
            mb->fsum = mb->dx * (float)sum;
            mb->pad = 0;
        }
}

void cs_op_quantize_ref(cs_qact *a, const float *x) {
    cs__quantize_ref_rows(a, x, 0, a->n_tokens);
}

/* ---- GEMM ---- */

static int part_of(const cs_qmat *w, int64_t panel) {
    int p = 0;
    while (p + 1 < w->n_parts && panel >= w->part[p + 1].panel0)
        p++;
    return p;
}

void cs__qmat_ref_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1) {
    const int32_t z = cs__qmat_zero(w->type);
    for (int64_t p = p0; p < p1; p++) {
        int part = part_of(w, p);
        int64_t row0 = (p - w->part[part].panel0) * CS_QROWS;
        const cs_qout *o = &outs[part];
        for (int r = 0; r < CS_QROWS && row0 + r < w->part[part].rows; r++)
            for (int t = 0; t < a->n_tokens; t++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < w->n_blocks; b++) {
                    const int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                    const cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
                    int32_t isum = 0;
                    for (int k = 0; k < CS_QK; k++)
                        isum += get_u(w, p, b, r, k) * q[k];
                    size_t s = (size_t)(p * w->n_blocks + b) * CS_QROWS + (size_t)r;
                    float d = cs_f16_to_f32(w->d[s]);
                    acc = fmaf(d * mb->dx, (float)(isum - z * mb->xsum), acc);
                    if (w->m) acc = fmaf(cs_f16_to_f32(w->m[s]), mb->fsum, acc);
                }
                if (o->bias) acc += o->bias[row0 + r];
                o->out[(size_t)t * (size_t)o->ldo + (size_t)(row0 + r)] = acc;
            }
    }
}

void cs_op_qmatmul_ref(const cs_qout *outs, const cs_qact *a, const cs_qmat *w) {
    CS_ASSERT(a->cols == w->cols);
    cs__qmat_ref_panels(outs, a, w, 0, w->n_panels);
}

/* ---- dispatch ---- */

static int forced = CS_QMAT_KERNELS_AUTO;

void cs__qmat_force_kernels(int which) {
    forced = which;
}

int cs__qmat_kernels(void) {
    if (forced != CS_QMAT_KERNELS_AUTO) return forced;
    static int state = -1; /* benign race: every thread computes the same answer */
    if (state < 0) {
        const char *k = getenv("CHUNKSERVE_CPU_KERNELS");
        bool generic = k && strcmp(k, "generic") == 0, no_vnni = k && strcmp(k, "avx2") == 0,
             no_amx = no_vnni || (k && strcmp(k, "vnni") == 0);
        state = generic                              ? CS_QMAT_KERNELS_REF
                : !no_amx && cs__qmat_amx_usable()   ? CS_QMAT_KERNELS_AMX
                : !no_vnni && cs__qmat_vnni_usable() ? CS_QMAT_KERNELS_VNNI
                : cs__qmat_avx2_usable()             ? CS_QMAT_KERNELS_AVX2
                                                     : CS_QMAT_KERNELS_REF;
    }
    return state;
}

static bool use_vnni(void) { /* the AMX kernels quantize with the VNNI ones */
    return cs__qmat_kernels() >= CS_QMAT_KERNELS_VNNI;
}

const char *cs_qmat_kernels_name(void) {
    switch (cs__qmat_kernels()) {
    case CS_QMAT_KERNELS_AMX: return "amx";
    case CS_QMAT_KERNELS_VNNI: return "avx-512 vnni";
    case CS_QMAT_KERNELS_AVX2: return "avx2";
    }
    return "generic";
}

typedef struct {
    const cs_qout *outs;
    cs_qact *a;
    const cs_qmat *w;
    const float *x;
} qjob;

static void panels_fn(void *arg, int64_t begin, int64_t end, int thread) {
    const qjob *j = arg;
    (void)thread;
    switch (cs__qmat_kernels()) {
    case CS_QMAT_KERNELS_AMX: cs__qmat_amx_panels(j->outs, j->a, j->w, begin, end); break;
    case CS_QMAT_KERNELS_VNNI: cs__qmat_vnni_panels(j->outs, j->a, j->w, begin, end); break;
    case CS_QMAT_KERNELS_AVX2: cs__qmat_avx2_panels(j->outs, j->a, j->w, begin, end); break;
    default: cs__qmat_ref_panels(j->outs, j->a, j->w, begin, end);
    }
}

void cs_op_qmatmul(cs_threadpool *pool, const cs_qout *outs, const cs_qact *a, const cs_qmat *w) {
    CS_ASSERT(a->cols == w->cols);
    qjob j = {outs, (cs_qact *)a, w, NULL};
    double work = (double)w->n_panels * CS_QROWS * (double)w->cols * a->n_tokens;
    if (cs_threadpool_size(pool) > 1 && work >= 65536.0 && w->n_panels > 1)
        cs_threadpool_for(pool, w->n_panels, panels_fn, &j);
    else
        panels_fn(&j, 0, w->n_panels, 0);
}

static void quantize_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    if (use_vnni())
        cs__quantize_vnni_rows(a, x, t0, t1);
    else
        cs__quantize_ref_rows(a, x, t0, t1);
}

static void quantize_fn(void *arg, int64_t begin, int64_t end, int thread) {
    const qjob *j = arg;
    (void)thread;
    quantize_rows(j->a, j->x, begin, end);
}

typedef struct {
    int64_t iters;
    bool amx;
} peak_job;

static void peak_fn(void *arg, int64_t begin, int64_t end, int thread) {
    const peak_job *j = arg;
    (void)thread;
    volatile int64_t sink = 0;
    for (int64_t i = begin; i < end; i++)
        sink += j->amx ? cs__qmat_amx_peak_loop(j->iters) : cs__qmat_vnni_peak_loop(j->iters);
    (void)sink;
}

double cs_qmat_peak_macs(cs_threadpool *pool, double seconds, bool amx) {
    if (amx ? !cs__qmat_amx_usable() : !cs__qmat_vnni_usable()) return 0;
    const double macs_per_iter = amx ? 16.0 * 16 * 16 * 64 : 1024.0;
    int n = cs_threadpool_size(pool);
    peak_job j = {amx ? 1 << 8 : 1 << 16, amx};
    for (;;) { /* grow until a run takes `seconds` */
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        cs_threadpool_for(pool, n, peak_fn, &j);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        if (t >= seconds || j.iters > ((int64_t)1 << 40))
            return (double)n * (double)j.iters * macs_per_iter / t;
        j.iters *= 2;
    }
}

static void quantize_over(cs_threadpool *pool, int64_t n_tokens, double work, cs_range_fn fn,
                          void *arg) {
    if (cs_threadpool_size(pool) > 1 && work >= 32768.0)
        cs_threadpool_for(pool, n_tokens, fn, arg);
    else if (n_tokens > 0)
        fn(arg, 0, n_tokens, 0);
}

void cs_op_quantize(cs_threadpool *pool, cs_qact *a, const float *x) {
    qjob j = {NULL, a, NULL, x};
    quantize_over(pool, a->n_tokens, (double)a->n_tokens * (double)a->cols, quantize_fn, &j);
}

/* ---- fused prologues: the ops before a GEMM in one pass over the rows ---- */

typedef struct {
    cs_qact *a;
    float *out;             /* xn, or SwiGLU's output */
    float *x;               /* add_rmsnorm_quantize: the residual stream */
    const float *add, *w;   /* add_rmsnorm_quantize */
    const float *gate, *up; /* swiglu_quantize */
    float eps;
} fused_job;

/* Each op runs on this thread's rows through the same function as the
 * unfused op (a NULL pool runs it on the caller), so the bits cannot differ;
 * the rows stay in cache between the ops. */
static void add_rmsnorm_quantize_fn(void *arg, int64_t t0, int64_t t1, int thread) {
    const fused_job *j = arg;
    (void)thread;
    size_t dim = (size_t)j->a->cols, o = (size_t)t0 * dim, n = (size_t)(t1 - t0) * dim;
    if (j->add)
        for (size_t i = o; i < o + n; i++)
            j->x[i] += j->add[i];
    cs_op_rmsnorm(NULL, j->out + o, j->x + o, j->w, (int)(t1 - t0), (int)dim, j->eps);
    quantize_rows(j->a, j->out, t0, t1);
}

void cs_op_add_rmsnorm_quantize(cs_threadpool *pool, cs_qact *a, float *xn, float *x,
                                const float *add, const float *w, float eps) {
    fused_job j = {.a = a, .out = xn, .x = x, .add = add, .w = w, .eps = eps};
    quantize_over(pool, a->n_tokens, 4.0 * a->n_tokens * (double)a->cols, add_rmsnorm_quantize_fn,
                  &j);
}

static void swiglu_quantize_fn(void *arg, int64_t t0, int64_t t1, int thread) {
    const fused_job *j = arg;
    (void)thread;
    size_t o = (size_t)t0 * (size_t)j->a->cols, n = (size_t)(t1 - t0) * (size_t)j->a->cols;
    cs_op_swiglu(NULL, j->out + o, j->gate + o, j->up + o, n);
    quantize_rows(j->a, j->out, t0, t1);
}

void cs_op_swiglu_quantize(cs_threadpool *pool, cs_qact *a, float *out, const float *gate,
                           const float *up) {
    fused_job j = {.a = a, .out = out, .gate = gate, .up = up};
    quantize_over(pool, a->n_tokens, 8.0 * a->n_tokens * (double)a->cols, swiglu_quantize_fn, &j);
}
