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
#include <unistd.h>
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
    case CS_QMAT_Q5_0: return "q5_0";
    case CS_QMAT_Q5_1: return "q5_1";
    case CS_QMAT_Q4_K: return "q4_K";
    case CS_QMAT_Q5_K: return "q5_K";
    case CS_QMAT_Q6_K: return "q6_K";
    }
    return "?";
}

/* Bytes of one source block (GGUF layout) and the weights it holds. */
static int64_t src_block_bytes(int type) {
    switch (type) {
    case CS_QMAT_Q4_0: return 18;
    case CS_QMAT_Q4_1: return 20;
    case CS_QMAT_Q8_0: return 34;
    case CS_QMAT_Q5_0: return 22;
    case CS_QMAT_Q5_1: return 24;
    case CS_QMAT_Q4_K: return 144;
    case CS_QMAT_Q5_K: return 176;
    case CS_QMAT_Q6_K: return 210;
    }
    return CS_QK * (int64_t)sizeof(float);
}
static int64_t src_block_size(int type) {
    return cs__qmat_is_k(type) ? CS_QK_K : CS_QK;
}

static uint16_t rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static void k4_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4);
        *mn = (uint8_t)((q[j + 4] >> 4) | (q[j] >> 6) << 4);
    }
}

/* One 32-weight block b of a source row, decoded: u[32], and d (and m) in
 * fp16 for the legacy types; D, DMIN (of its super-block) and the two scale
 * bytes s0, s1 (sc, mn or sc_lo, sc_hi) for the K-quants. */
typedef struct {
    uint8_t u[CS_QK];
    uint16_t d, m;
    uint8_t s0, s1;
} src_blk;

static void src_block(int type, const uint8_t *row, int64_t b, src_blk *o) {
    const int64_t sb = b / 8, j = b % 8; /* K-quants: super-block, block in it */
    o->d = o->m = 0;
    o->s0 = o->s1 = 0;
    switch (type) {
    case CS_QMAT_Q4_0:
    case CS_QMAT_Q4_1:
    case CS_QMAT_Q5_0:
    case CS_QMAT_Q5_1: {
        const uint8_t *s = row + b * src_block_bytes(type);
        bool min = type == CS_QMAT_Q4_1 || type == CS_QMAT_Q5_1;
        bool five = type == CS_QMAT_Q5_0 || type == CS_QMAT_Q5_1;
        o->d = rd16(s);
        o->m = min ? rd16(s + 2) : 0;
        const uint8_t *p = s + (min ? 4 : 2);
        uint32_t qh = five ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                                 (uint32_t)p[3] << 24
                           : 0;
        const uint8_t *qs = p + (five ? 4 : 0);
        for (int i = 0; i < 16; i++) {
            o->u[i] = (uint8_t)((qs[i] & 0x0f) | ((qh >> i) & 1) << 4);
            o->u[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        }
        break;
    }
    case CS_QMAT_Q8_0: {
        const uint8_t *s = row + b * 34;
        o->d = rd16(s);
        for (int i = 0; i < CS_QK; i++)
            o->u[i] = (uint8_t)((int8_t)s[2 + i] + 128);
        break;
    }
    case CS_QMAT_Q4_K:
    case CS_QMAT_Q5_K: {
        const uint8_t *s = row + sb * src_block_bytes(type);
        o->d = rd16(s);
        o->m = rd16(s + 2);
        k4_scale_min(s + 4, (int)j, &o->s0, &o->s1);
        const uint8_t *qh = s + 16, *qs = s + (type == CS_QMAT_Q5_K ? 48 : 16) + 32 * (j / 2);
        for (int l = 0; l < CS_QK; l++) {
            int lo = (qs[l] >> (4 * (j & 1))) & 0x0f;
            int hi = type == CS_QMAT_Q5_K ? (qh[l] >> j) & 1 : 0;
            o->u[l] = (uint8_t)(lo | hi << 4);
        }
        break;
    }
    case CS_QMAT_Q6_K: {
        const uint8_t *s = row + sb * 210, *ql = s, *qh = s + 128;
        const int8_t *sc = (const int8_t *)(s + 192);
        o->d = rd16(s + 208);
        o->s0 = (uint8_t)sc[2 * j];
        o->s1 = (uint8_t)sc[2 * j + 1];
        for (int l = 0; l < CS_QK; l++) {
            int e = (int)(32 * j) + l, half = e / 128, f = e % 128;
            int lo = f < 64 ? ql[64 * half + f] & 0x0f : ql[64 * half + f - 64] >> 4;
            int hi = (qh[32 * half + f % 32] >> (2 * (f / 32))) & 3;
            o->u[l] = (uint8_t)(lo | hi << 4);
        }
        break;
    }
    default: { /* fp32 -> Q8_0 */
        const float *x = (const float *)(const void *)row + b * CS_QK;
        float amax = 0;
        for (int i = 0; i < CS_QK; i++)
            amax = fmaxf(amax, fabsf(x[i]));
        o->d = cs_f32_to_f16(amax / 127.0f);
        float dd = cs_f16_to_f32(o->d);
        for (int i = 0; i < CS_QK; i++) {
            float q = dd > 0 ? nearbyintf(x[i] / dd) : 0.0f;
            q = fminf(fmaxf(q, -127.0f), 127.0f);
            o->u[i] = (uint8_t)((int)q + 128);
        }
        break;
    }
    }
}

/* Places block o of one row in lane r of its panel block (q, h, sc). */
static void put_block(int type, uint8_t *pq, uint8_t *ph, uint8_t *psc, int r, const src_blk *o) {
    const uint8_t *u = o->u;
    if (type == CS_QMAT_Q8_0) {
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++)
                pq[64 * j + 4 * r + i] = u[4 * j + i];
    } else {
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++)
                pq[64 * j + 4 * r + i] =
                    (uint8_t)((u[8 * j + i] & 0x0f) | (u[8 * j + 4 + i] & 0x0f) << 4);
    }
    for (int plane = 0; plane < cs__qmat_hbytes(type) / 64; plane++)
        for (int i = 0; i < 4; i++) {
            uint8_t v = 0;
            for (int k = 0; k < 8; k++)
                v |= (uint8_t)(((u[4 * k + i] >> (4 + plane)) & 1) << k);
            ph[64 * plane + 4 * r + i] = v;
        }
    if (psc) psc[r] = o->s0, psc[16 + r] = o->s1;
}

/* u of (panel view v, block b, lane r, weight k). */
static inline int32_t get_u(int type, const cs_qpanel *v, int64_t b, int r, int k) {
    const uint8_t *pq = v->q + (size_t)b * (size_t)cs__qmat_qbytes(type);
    if (type == CS_QMAT_Q8_0) return pq[64 * (k / 4) + 4 * r + k % 4];
    int j = k / 8, i = k % 8;
    int32_t u = i < 4 ? pq[64 * j + 4 * r + i] & 0x0f : pq[64 * j + 4 * r + i - 4] >> 4;
    const uint8_t *ph = v->h ? v->h + (size_t)b * (size_t)cs__qmat_hbytes(type) : NULL;
    for (int plane = 0; plane < cs__qmat_hbytes(type) / 64; plane++)
        u |= ((ph[64 * plane + 4 * r + k % 4] >> (k / 4)) & 1) << (4 + plane);
    return u;
}

static size_t al64(size_t n) {
    return (n + 63) / 64 * 64;
}

int cs_qmat_pack(const cs_qmat_src *parts, int n_parts, int64_t cols, cs_qmat **out) {
    *out = NULL;
    if (n_parts < 1 || n_parts > CS_QMAT_PARTS || cols <= 0 || cols % CS_QK)
        return cs_fail(CS_EINVAL,
                       "qmat: %d parts of %lld columns (1..%d parts, columns a "
                       "positive multiple of %d)",
                       n_parts, (long long)cols, CS_QMAT_PARTS, CS_QK);
    for (int p = 0; p < n_parts; p++) {
        int t = parts[p].type;
        if (t < 0 || t >= CS_QMAT_TYPES)
            return cs_fail(CS_EINVAL, "qmat: part %d has unknown type %d", p, t);
        if (cs__qmat_is_k(t) && cols % CS_QK_K)
            return cs_fail(CS_EINVAL,
                           "qmat: part %d is %s, whose rows need a multiple of %d "
                           "columns, not %lld",
                           p, cs_qmat_type_name(t), CS_QK_K, (long long)cols);
        if (parts[p].rows <= 0 || !parts[p].data)
            return cs_fail(CS_EINVAL, "qmat: part %d has no rows", p);
    }
    cs_qmat *w = calloc(1, sizeof *w);
    if (!w) return cs_fail(CS_ENOMEM, "qmat: out of memory");
    w->cols = cols;
    w->n_blocks = cols / CS_QK;
    w->n_parts = n_parts;
    w->act_group = CS_QK;
    for (int p = 0; p < n_parts; p++)
        if (cs__qmat_is_k(parts[p].type)) w->act_group = CS_QK_K;
    const size_t nb = (size_t)w->n_blocks;
    size_t off[CS_QMAT_PARTS][5], total = 0; /* q, h, sc, d, m */
    for (int p = 0; p < n_parts; p++) {
        cs_qpart *P = &w->part[p];
        P->type = parts[p].type == CS_QMAT_F32 ? CS_QMAT_Q8_0 : parts[p].type;
        P->rows = parts[p].rows;
        P->panel0 = w->n_panels;
        size_t np = (size_t)((P->rows + CS_QROWS - 1) / CS_QROWS);
        w->n_panels += (int64_t)np;
        size_t nd = nb / (size_t)cs__qmat_dgroup(P->type);
        size_t sz[5] = {np * nb * (size_t)cs__qmat_qbytes(P->type),
                        np * nb * (size_t)cs__qmat_hbytes(P->type),
                        cs__qmat_is_k(P->type) ? np * nb * 32 : 0, np * nd * CS_QROWS * 2,
                        cs__qmat_has_min(P->type) ? np * nd * CS_QROWS * 2 : 0};
        for (int k = 0; k < 5; k++)
            off[p][k] = total, total += al64(sz[k]);
    }
    w->mem = aligned_alloc(64, total);
    if (!w->mem) {
        free(w);
        return cs_fail(CS_ENOMEM, "qmat: out of memory for %zu MiB of weights", total >> 20);
    }
    /* padding rows: zero weights (d = m = 0) */
    memset(w->mem, 0, total);
    w->bytes = total;
    uint8_t *base = w->mem;
    for (int p = 0; p < n_parts; p++) {
        cs_qpart *P = &w->part[p];
        P->q = base + off[p][0];
        P->h = cs__qmat_hbytes(P->type) ? base + off[p][1] : NULL;
        P->sc = cs__qmat_is_k(P->type) ? base + off[p][2] : NULL;
        P->d = (uint16_t *)(void *)(base + off[p][3]);
        P->m = cs__qmat_has_min(P->type) ? (uint16_t *)(void *)(base + off[p][4]) : NULL;
        const int in = parts[p].type, g = cs__qmat_dgroup(P->type);
        const size_t row_bytes = (size_t)(cols / src_block_size(in)) * (size_t)src_block_bytes(in);
        const size_t qb = (size_t)cs__qmat_qbytes(P->type), hb = (size_t)cs__qmat_hbytes(P->type);
        for (int64_t r = 0; r < P->rows; r++) {
            int64_t sr = parts[p].perm ? parts[p].perm[r] : r;
            const uint8_t *row = (const uint8_t *)parts[p].data + (size_t)sr * row_bytes;
            int64_t lp = r / CS_QROWS;
            int lane = (int)(r % CS_QROWS);
            for (int64_t b = 0; b < w->n_blocks; b++) {
                src_blk o;
                src_block(in, row, b, &o);
                size_t pb = (size_t)lp * nb + (size_t)b;
                size_t pd = ((size_t)lp * (nb / (size_t)g) + (size_t)b / (size_t)g) * CS_QROWS;
                put_block(P->type, P->q + pb * qb, P->h ? P->h + pb * hb : NULL,
                          P->sc ? P->sc + pb * 32 : NULL, lane, &o);
                P->d[pd + (size_t)lane] = o.d;
                if (P->m) P->m[pd + (size_t)lane] = o.m;
            }
        }
    }
    *out = w;
    return 0;
}

void cs_qmat_free(cs_qmat *w) {
    if (!w) return;
    free(w->mem);
    free(w);
}

size_t cs_qmat_bytes(const cs_qmat *w) {
    return w->bytes;
}
int cs_qmat_n_parts(const cs_qmat *w) {
    return w->n_parts;
}
int cs_qmat_type(const cs_qmat *w, int part) {
    CS_ASSERT(part >= 0 && part < w->n_parts);
    return w->part[part].type;
}

void cs_qmat_get_rows(const cs_qmat *w, int part, const int32_t *ids, int n, float *out) {
    CS_ASSERT(part >= 0 && part < w->n_parts);
    const cs_qpart *P = &w->part[part];
    const int type = P->type, g = cs__qmat_dgroup(type);
    const int32_t z = cs__qmat_zero(type);
    for (int t = 0; t < n; t++) {
        CS_ASSERT(ids[t] >= 0 && ids[t] < P->rows);
        const cs_qpanel v = cs__qmat_panel(w, P, ids[t] / CS_QROWS);
        int r = ids[t] % CS_QROWS;
        float *o = out + (size_t)t * (size_t)w->cols;
        for (int64_t b = 0; b < w->n_blocks; b++) {
            size_t s = (size_t)(b / g) * CS_QROWS + (size_t)r;
            float d = cs_f16_to_f32(v.d[s]), m = v.m ? cs_f16_to_f32(v.m[s]) : 0.0f;
            const uint8_t *sc = v.sc ? v.sc + b * 32 : NULL;
            for (int k = 0; k < CS_QK; k++) {
                float q = (float)(get_u(type, &v, b, r, k) - z);
                float y;
                switch (type) { /* each as GGUF dequantizes it (dtype.c) */
                case CS_QMAT_Q4_1: y = fmaf(d, q, m); break;
                case CS_QMAT_Q5_1: y = d * q + m; break;
                case CS_QMAT_Q4_K:
                case CS_QMAT_Q5_K: y = d * (float)sc[r] * q - m * (float)sc[16 + r]; break;
                case CS_QMAT_Q6_K: y = d * (float)(int8_t)sc[k < 16 ? r : 16 + r] * q; break;
                default: y = d * q;
                }
                o[b * CS_QK + k] = y;
            }
        }
    }
}

/* ---- activations ---- */

size_t cs_qact_bytes(int n_tokens, int64_t cols) {
    size_t q = ((size_t)n_tokens * (size_t)cols + 63) / 64 * 64;
    return q + (size_t)n_tokens * (size_t)(cols / CS_QK) * sizeof(cs_qblock);
}

void cs_qact_init(cs_qact *a, void *buf, int n_tokens, int64_t cols, int group) {
    CS_ASSERT((group == CS_QK || group == CS_QK_K) && cols % group == 0 &&
              ((uintptr_t)buf & 63) == 0);
    a->n_tokens = n_tokens;
    a->group = group;
    a->cols = cols;
    a->n_blocks = cols / CS_QK;
    a->q = buf;
    a->meta = (cs_qblock *)((char *)buf + ((size_t)n_tokens * (size_t)cols + 63) / 64 * 64);
}

void cs__quantize_ref_rows(cs_qact *a, const float *x, int64_t t0, int64_t t1) {
    const int64_t G = a->group;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < a->cols; g += G) {
            const float *xg = x + (size_t)t * (size_t)a->cols + (size_t)g;
            float amax = 0;
            for (int64_t i = 0; i < G; i++)
                amax = fmaxf(amax, fabsf(xg[i]));
            const float id = amax > 0 ? 127.0f / amax : 0.0f;
            for (int64_t b = g / CS_QK; b < (g + G) / CS_QK; b++) {
                const float *xb = x + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                int32_t sum = 0, sum_lo = 0;
                for (int i = 0; i < CS_QK; i++) {
                    q[i] = (int8_t)nearbyintf(xb[i] * id);
                    sum += q[i];
                    if (i == 15) sum_lo = sum;
                }
                cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
                mb->dx = amax / 127.0f;
                mb->xsum = sum;
                mb->fsum = mb->dx * (float)sum;
                mb->xsum_lo = sum_lo;
            }
        }
}

void cs_op_quantize_ref(cs_qact *a, const float *x) {
    cs__quantize_ref_rows(a, x, 0, a->n_tokens);
}

/* ---- GEMM ---- */

/* One block's exact integer sums s_lo, s_hi for (token block q) and lane r. */
static void block_sums(int type, const cs_qpanel *v, int64_t b, int r, const int8_t *q,
                       int32_t *s_lo, int32_t *s_hi) {
    *s_lo = *s_hi = 0;
    for (int k = 0; k < CS_QK; k++)
        *(k < 16 ? s_lo : s_hi) += get_u(type, v, b, r, k) * q[k];
}

void cs__qmat_ref_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                         int64_t p1) {
    CS_ASSERT(a->group == w->act_group);
    int part = 0;
    for (int64_t p = p0; p < p1; p++) {
        part = cs__qmat_part_of(w, p, part);
        const cs_qpart *P = &w->part[part];
        const int type = P->type, g = cs__qmat_dgroup(type);
        const int64_t row0 = (p - P->panel0) * CS_QROWS;
        const cs_qpanel v = cs__qmat_panel(w, P, p - P->panel0);
        const cs_qout *o = &outs[part];
        for (int r = 0; r < CS_QROWS && row0 + r < P->rows; r++)
            for (int t = 0; t < a->n_tokens; t++) {
                float acc = 0.0f;
                int32_t S = 0, M = 0; /* K-quants: the super-block's integer sums */
                for (int64_t b = 0; b < w->n_blocks; b++) {
                    const int8_t *q = a->q + (size_t)t * (size_t)a->cols + (size_t)b * CS_QK;
                    const cs_qblock *mb = &a->meta[(size_t)t * (size_t)a->n_blocks + (size_t)b];
                    int32_t s_lo, s_hi;
                    block_sums(type, &v, b, r, q, &s_lo, &s_hi);
                    size_t s = (size_t)(b / g) * CS_QROWS + (size_t)r;
                    float d = cs_f16_to_f32(v.d[s]);
                    const uint8_t *sc = v.sc ? v.sc + b * 32 : NULL;
                    switch (type) {
                    case CS_QMAT_Q4_K:
                    case CS_QMAT_Q5_K:
                        S += (int32_t)sc[r] * (s_lo + s_hi);
                        M += (int32_t)sc[16 + r] * mb->xsum;
                        break;
                    case CS_QMAT_Q6_K:
                        S += (int32_t)(int8_t)sc[r] * (s_lo - 32 * mb->xsum_lo) +
                             (int32_t)(int8_t)sc[16 + r] * (s_hi - 32 * (mb->xsum - mb->xsum_lo));
                        break;
                    default:
                        acc = fmaf(d * mb->dx,
                                   (float)(s_lo + s_hi - cs__qmat_zero(type) * mb->xsum), acc);
                        if (v.m) acc = fmaf(cs_f16_to_f32(v.m[s]), mb->fsum, acc);
                    }
                    if (cs__qmat_is_k(type) && b % g == g - 1) { /* the super-block's end */
                        acc = fmaf(d * mb->dx, (float)S, acc);
                        if (v.m) acc = fmaf(-(cs_f16_to_f32(v.m[s]) * mb->dx), (float)M, acc);
                        S = M = 0;
                    }
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

static void kernel_panels(const cs_qout *outs, const cs_qact *a, const cs_qmat *w, int64_t p0,
                          int64_t p1) {
    switch (cs__qmat_kernels()) {
    case CS_QMAT_KERNELS_AMX: cs__qmat_amx_panels(outs, a, w, p0, p1); break;
    case CS_QMAT_KERNELS_VNNI: cs__qmat_vnni_panels(outs, a, w, p0, p1); break;
    case CS_QMAT_KERNELS_AVX2: cs__qmat_avx2_panels(outs, a, w, p0, p1); break;
    default: cs__qmat_ref_panels(outs, a, w, p0, p1);
    }
}

/* Tokens per pass over the weights: each thread runs its panels over one
 * slice of tokens at a time, so the slice's activations (the bytes every
 * panel reads again) stay in the core's L2 rather than stream from L3 for
 * each panel: about a third of L2, in tiles of 16 tokens, at least 64
 * (Sapphire Rapids, Q4_K 1536 x 8960 at 512 tokens: 64-token slices run the
 * AMX GEMM 1.6x faster than one pass; chunkserve-bench-qmat). The slices
 * change no result: each token's outputs depend on its own row alone. */
static int64_t slice_tokens(int64_t cols) {
    static int64_t l2 = -1; /* benign race: every thread computes the same */
    if (l2 < 0) {
        long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = v > 0 ? v : 1 << 20;
    }
    int64_t n = l2 / 3 / cols / 16 * 16;
    return n < 64 ? 64 : n;
}

static void panels_fn(void *arg, int64_t begin, int64_t end, int thread) {
    const qjob *j = arg;
    (void)thread;
    const cs_qact *a = j->a;
    const int64_t n = slice_tokens(a->cols);
    if (a->n_tokens <= n) {
        kernel_panels(j->outs, a, j->w, begin, end);
        return;
    }
    for (int64_t t0 = 0; t0 < a->n_tokens; t0 += n) {
        cs_qact sa;
        cs_qout so[CS_QMAT_PARTS];
        cs__qmat_token_slice(j->outs, a, j->w->n_parts, t0,
                             a->n_tokens - t0 < n ? a->n_tokens - t0 : n, so, &sa);
        kernel_panels(so, &sa, j->w, begin, end);
    }
}

void cs_op_qmatmul(cs_threadpool *pool, const cs_qout *outs, const cs_qact *a, const cs_qmat *w) {
    CS_ASSERT(a->cols == w->cols && a->group == w->act_group); /* a was quantized for w */
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
    const float *gate, *up; /* glu_quantize */
    cs_act act;             /* glu_quantize */
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

static void glu_quantize_fn(void *arg, int64_t t0, int64_t t1, int thread) {
    const fused_job *j = arg;
    (void)thread;
    size_t o = (size_t)t0 * (size_t)j->a->cols, n = (size_t)(t1 - t0) * (size_t)j->a->cols;
    cs_op_glu(NULL, j->out + o, j->gate + o, j->up + o, n, j->act);
    quantize_rows(j->a, j->out, t0, t1);
}

void cs_op_glu_quantize(cs_threadpool *pool, cs_qact *a, float *out, const float *gate,
                        const float *up, cs_act act) {
    fused_job j = {.a = a, .out = out, .gate = gate, .up = up, .act = act};
    quantize_over(pool, a->n_tokens, 8.0 * a->n_tokens * (double)a->cols, glu_quantize_fn, &j);
}
