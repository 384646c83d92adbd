/* backend_cpu.c: the CPU backend. Weights straight from the model (no copy):
 * fp32 matrices through OpenBLAS (cs_op_matmul), or in quant mode packed
 * quantized ones through the integer kernels (cpu/qmat.h: activations
 * quantized per row once per GEMM input, q|k|v and gate|up one GEMM each;
 * the residual add, RMSNorm and quantization of a GEMM's input one pass over
 * the rows, as are the gate activation and quantization). The block's
 * optional parts (QK-norm, post norms, windows) are backend.h's.
 * KV pool in host memory (fp32, or bf16 with kv_bf16) laid out page-major:
 *   pool[n_pages][kv_layers][2 (K, V)][page_size][n_kv_heads * head_dim]
 * (kv_layers: every layer, or with windowed layers the few of one kind a
 * page holds; layer l at slot kv_slot of its kv_kind's page), so one page
 * is one contiguous block: export/import is
 * a memcpy per page and the KV transport can send pages without gathering.
 * A step runs every GEMM over all the step's tokens at once (prompt chunks
 * and decode tokens alike), attention per span over its pages. */
#include <stdlib.h>
#include <string.h>

#include "chunkserve/backend.h"
#include "chunkserve/ops.h"
#include "qmat.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"

typedef struct {
    const cs_weights *m; /* the engine's view of the model's weights */
    cs_threadpool *pool;
    void *kv; /* the page pool: fp32 elements, or bf16 when kv_bf16 */
    bool kv_bf16;
    int32_t n_pages, page_size;
    size_t page_elems; /* elements per page */
    /* step scratch, grown to the largest step seen */
    int32_t cap_tokens, cap_spans, cap_rows;
    float *x, *xn, *q, *k, *v, *att, *proj, *gate, *up; /* (tokens, ...) */
    int32_t *tok, *pos;                                 /* (tokens) */
    cs_attn_span *aspans;                               /* (spans) */
    float *xl;                                          /* (rows, dim) rows wanting logits */
    void *qa;       /* quant mode: quantized activations, cs_qact_bytes(cap_tokens, widest) */
    size_t qa_size; /* bytes of qa */
} cpu_ctx;

static void cpu_free(void *p) {
    cpu_ctx *c = p;
    if (!c) return;
    cs_threadpool_free(c->pool);
    free(c->kv);
    free(c->x), free(c->xn), free(c->q), free(c->k), free(c->v), free(c->att), free(c->proj);
    free(c->gate), free(c->up), free(c->tok), free(c->pos), free(c->aspans), free(c->xl);
    free(c->qa);
    free(c);
}

size_t cs_backend_cpu_page_bytes(const cs_weights_shape *cf, int32_t page_size, bool kv_bf16) {
    return (size_t)cf->kv_layers * 2 * (size_t)page_size * (size_t)cf->n_kv_heads *
           (size_t)cf->head_dim * (kv_bf16 ? sizeof(uint16_t) : sizeof(float));
}

bool cs_backend_cpu_kv_bf16(const cs_backend *b) {
    return ((const cpu_ctx *)b->ctx)->kv_bf16;
}

static size_t elem_bytes(const cpu_ctx *c) {
    return c->kv_bf16 ? sizeof(uint16_t) : sizeof(float);
}

static int cpu_kv_init(void *p, int32_t n_pages, int32_t page_size, size_t *page_bytes) {
    cpu_ctx *c = p;
    c->page_elems = cs_backend_cpu_page_bytes(&c->m->shape, page_size, c->kv_bf16) / elem_bytes(c);
    size_t bytes;
    if (__builtin_mul_overflow(c->page_elems * elem_bytes(c), (size_t)n_pages, &bytes))
        return cs_fail(CS_ENOMEM, "cpu backend: KV pool of %d pages overflows", n_pages);
    free(c->kv);
    /* calloc: untouched pages cost no memory until used */
    c->kv = calloc((size_t)n_pages, c->page_elems * elem_bytes(c));
    if (!c->kv)
        return cs_fail(CS_ENOMEM, "cpu backend: cannot allocate a %zu MiB KV pool", bytes >> 20);
    c->n_pages = n_pages;
    c->page_size = page_size;
    *page_bytes = c->page_elems * elem_bytes(c);
    return 0;
}

static int grow(cpu_ctx *c, int32_t n_tokens, int32_t n_spans, int32_t n_rows) {
    const cs_weights_shape *cf = &c->m->shape;
    if (n_tokens > c->cap_tokens) {
        size_t T = (size_t)n_tokens;
        size_t dim = (size_t)cf->dim, qd = (size_t)cf->n_heads * cf->head_dim;
        size_t kvd = (size_t)cf->n_kv_heads * cf->head_dim, hid = (size_t)cf->hidden_dim;
/* Step scratch, refilled every step (nothing kept): 64-byte aligned, so
 * where a row's width is a multiple of 16 floats (every model's dim, q, kv
 * and hidden widths so far) a GEMM panel's 16 floats of a token's output
 * are one cache line, not parts of two (aligned, the AMX kernels ran a
 * 512-token GEMM 1.14-1.20x faster on 2 threads: docs/perf.md). */
#define RE(ptr, count)                                                                             \
    do {                                                                                           \
        void *np_ = aligned_alloc(64, ((count) * sizeof *(ptr) + 63) / 64 * 64);                   \
        if (!np_)                                                                                  \
            return cs_fail(CS_ENOMEM, "cpu backend: out of memory for a %d-token step", n_tokens); \
        free(ptr);                                                                                 \
        ptr = np_;                                                                                 \
    } while (0)
        RE(c->x, T * dim);
        RE(c->xn, T * dim);
        RE(c->q, T * qd);
        RE(c->k, T * kvd);
        RE(c->v, T * kvd);
        RE(c->att, T * qd);
        RE(c->proj, T * dim);
        RE(c->gate, T * hid);
        RE(c->up, T * hid);
        RE(c->tok, T);
        RE(c->pos, T);
        if (c->m->q_tok_embd) {
            size_t widest = dim > qd ? dim : qd;
            widest = widest > hid ? widest : hid;
            size_t bytes = (cs_qact_bytes(n_tokens, (int64_t)widest) + 63) / 64 * 64;
            void *np = aligned_alloc(64, bytes);
            if (!np)
                return cs_fail(CS_ENOMEM, "cpu backend: out of memory for a %d-token step",
                               n_tokens);
            free(c->qa);
            c->qa = np;
            c->qa_size = bytes;
        }
        c->cap_tokens = n_tokens; /* only once every buffer has its room */
    }
    if (n_spans > c->cap_spans) {
        RE(c->aspans, (size_t)n_spans);
        c->cap_spans = n_spans;
    }
    if (n_rows > c->cap_rows) {
        RE(c->xl, (size_t)n_rows * (size_t)cf->dim);
        c->cap_rows = n_rows;
    }
#undef RE
    return 0;
}

/* A view of the step's quantized-activation scratch for (n_tokens, cols),
 * for the GEMM w (whose parts set the activations' scale groups). */
static cs_qact qact(cpu_ctx *c, int n_tokens, int cols, const cs_qmat *w) {
    cs_qact a;
    CS_ASSERT(cs_qact_bytes(n_tokens, cols) <= c->qa_size);
    cs_qact_init(&a, c->qa, n_tokens, cols, w->act_group);
    return a;
}

/* outs = x (n_tokens, cols) * w^T through the integer kernels: x quantized
 * once into the step's scratch, then one GEMM over every part of w. */
static void qgemm(cpu_ctx *c, const cs_qout *outs, const float *x, int n_tokens, int cols,
                  const cs_qmat *w) {
    cs_qact a = qact(c, n_tokens, cols, w);
    cs_op_quantize(c->pool, &a, x);
    cs_op_qmatmul(c->pool, outs, &a, w);
}

/* xn = rmsnorm(x += proj) for the GEMM w (the residual add, when `pending`,
 * waits for the next norm). In quant mode (w not NULL) one pass over the
 * rows also quantizes xn into the scratch, which it returns for w. */
static cs_qact norm(cpu_ctx *c, bool pending, const float *nw, int T, const cs_qmat *w) {
    const int dim = c->m->shape.dim;
    const float eps = c->m->shape.norm_eps;
    if (w) {
        cs_qact a = qact(c, T, dim, w);
        cs_op_add_rmsnorm_quantize(c->pool, &a, c->xn, c->x, pending ? c->proj : NULL, nw, eps);
        return a;
    }
    if (pending)
        for (size_t i = 0; i < (size_t)T * dim; i++)
            c->x[i] += c->proj[i];
    cs_op_rmsnorm(c->pool, c->xn, c->x, nw, T, dim, eps);
    return (cs_qact){0};
}

static int cpu_forward(void *p, const cs_backend_span *spans, int32_t n_spans, int32_t n_tokens,
                       float *logits) {
    cpu_ctx *c = p;
    const cs_weights *m = c->m;
    const cs_weights_shape *cf = &m->shape;
    int32_t n_rows = 0;
    for (int32_t s = 0; s < n_spans; s++)
        n_rows += spans[s].n_logits;
    int r = grow(c, n_tokens, n_spans, n_rows);
    if (r) return r;
    const int dim = cf->dim, nh = cf->n_heads, nkv = cf->n_kv_heads, hd = cf->head_dim;
    const int qd = nh * hd, kvd = nkv * hd, hid = cf->hidden_dim, T = n_tokens;
    int32_t t = 0;
    for (int32_t s = 0; s < n_spans; s++) {
        c->aspans[s] = (cs_attn_span){t, spans[s].n_tokens, spans[s].pos, spans[s].pages};
        for (int32_t i = 0; i < spans[s].n_tokens; i++, t++) {
            c->tok[t] = spans[s].tokens[i];
            c->pos[t] = spans[s].pos + i;
        }
    }
    CS_ASSERT(t == n_tokens);
    if (m->q_tok_embd)
        cs_qmat_get_rows(m->q_tok_embd, 0, c->tok, T, c->x);
    else
        cs_op_embed(c->x, m->tok_embd, c->tok, T, dim);
    if (cf->embed_scale != 1.0f)
        for (size_t i = 0; i < (size_t)T * dim; i++)
            c->x[i] *= cf->embed_scale;
    bool pending = false; /* x += proj is owed */
    for (int l = 0; l < cf->n_layers; l++) {
        const cs_layer_weights *L = &m->layers[l];
        size_t layer0 = (size_t)L->kv_slot * 2 * (size_t)c->page_size * (size_t)kvd;
        for (int32_t s = 0; s < n_spans; s++) /* this layer's kind of page */
            c->aspans[s].pages = spans[s].pages + (size_t)L->kv_kind * (size_t)spans[s].stride;
        cs_kv_view kv = {c->kv_bf16 ? NULL : (float *)c->kv + layer0, c->page_elems,
                         (size_t)c->page_size * kvd, c->page_size,
                         c->kv_bf16 ? (uint16_t *)c->kv + layer0 : NULL};
        cs_qact a = norm(c, pending, L->attn_norm, T, L->qkv);
        if (L->qkv) {
            cs_qout o[3] = {{c->q, qd, L->bq}, {c->k, kvd, L->bk}, {c->v, kvd, L->bv}};
            cs_op_qmatmul(c->pool, o, &a, L->qkv);
        } else {
            cs_op_matmul(c->pool, c->q, c->xn, L->wq, L->bq, T, qd, dim);
            cs_op_matmul(c->pool, c->k, c->xn, L->wk, L->bk, T, kvd, dim);
            cs_op_matmul(c->pool, c->v, c->xn, L->wv, L->bv, T, kvd, dim);
        }
        if (L->q_norm) cs_op_rmsnorm(c->pool, c->q, c->q, L->q_norm, T * nh, hd, cf->norm_eps);
        if (L->k_norm) cs_op_rmsnorm(c->pool, c->k, c->k, L->k_norm, T * nkv, hd, cf->norm_eps);
        cs_op_rope(c->pool, c->q, T, nh, hd, c->pos, L->rope_inv_freq);
        cs_op_rope(c->pool, c->k, T, nkv, hd, c->pos, L->rope_inv_freq);
        cs_op_kv_store(&kv, c->aspans, n_spans, c->k, c->v, kvd);
        cs_op_attention(c->pool, c->att, c->q, c->aspans, n_spans, &kv, nh, nkv, hd, cf->attn_scale,
                        L->window);
        if (L->o)
            qgemm(c, &(cs_qout){c->proj, dim, NULL}, c->att, T, qd, L->o);
        else
            cs_op_matmul(c->pool, c->proj, c->att, L->wo, NULL, T, dim, qd);
        if (L->post_attn_norm)
            cs_op_rmsnorm(c->pool, c->proj, c->proj, L->post_attn_norm, T, dim, cf->norm_eps);
        a = norm(c, true, L->ffn_norm, T, L->gate_up);
        if (L->gate_up) {
            cs_qout o[2] = {{c->gate, hid, NULL}, {c->up, hid, NULL}};
            cs_op_qmatmul(c->pool, o, &a, L->gate_up);
        } else {
            cs_op_matmul(c->pool, c->gate, c->xn, L->w_gate, NULL, T, hid, dim);
            cs_op_matmul(c->pool, c->up, c->xn, L->w_up, NULL, T, hid, dim);
        }
        if (L->down) {
            a = qact(c, T, hid, L->down);
            cs_op_glu_quantize(c->pool, &a, c->gate, c->gate, c->up, cf->act);
            cs_op_qmatmul(c->pool, &(cs_qout){c->proj, dim, NULL}, &a, L->down);
        } else {
            cs_op_glu(c->pool, c->gate, c->gate, c->up, (size_t)T * hid, cf->act);
            cs_op_matmul(c->pool, c->proj, c->gate, L->w_down, NULL, T, dim, hid);
        }
        if (L->post_ffn_norm)
            cs_op_rmsnorm(c->pool, c->proj, c->proj, L->post_ffn_norm, T, dim, cf->norm_eps);
        pending = true;
    }
    int n_out = 0;
    for (int32_t s = 0; s < n_spans; s++)
        for (int32_t j = spans[s].n_tokens - spans[s].n_logits; j < spans[s].n_tokens; j++) {
            size_t row = (size_t)(c->aspans[s].q_begin + j) * dim;
            float *xl = c->xl + (size_t)n_out * dim;
            for (int i = 0; i < dim; i++) /* the last layer's residual add, for these rows */
                xl[i] = pending ? c->x[row + i] + c->proj[row + i] : c->x[row + i];
            n_out++;
        }
    if (n_out && m->q_output) {
        cs_qact a = qact(c, n_out, dim, m->q_output);
        cs_op_add_rmsnorm_quantize(c->pool, &a, c->xl, c->xl, NULL, m->out_norm, cf->norm_eps);
        cs_op_qmatmul(c->pool, &(cs_qout){logits, cf->n_vocab, NULL}, &a, m->q_output);
    } else if (n_out) {
        cs_op_rmsnorm(c->pool, c->xl, c->xl, m->out_norm, n_out, dim, cf->norm_eps);
        cs_op_matmul(c->pool, logits, c->xl, m->output, NULL, n_out, cf->n_vocab, dim);
    }
    return 0;
}

static int cpu_kv_export(void *p, const int32_t *pages, int32_t n, void *dst) {
    cpu_ctx *c = p;
    size_t bytes = c->page_elems * elem_bytes(c);
    for (int32_t i = 0; i < n; i++)
        memcpy((char *)dst + (size_t)i * bytes, (const char *)c->kv + (size_t)pages[i] * bytes,
               bytes);
    return 0;
}

static int cpu_kv_import(void *p, const int32_t *pages, int32_t n, const void *src) {
    cpu_ctx *c = p;
    size_t bytes = c->page_elems * elem_bytes(c);
    for (int32_t i = 0; i < n; i++)
        memcpy((char *)c->kv + (size_t)pages[i] * bytes, (const char *)src + (size_t)i * bytes,
               bytes);
    return 0;
}

static void *cpu_kv_pool(void *p, int *device) {
    *device = -1;
    return ((cpu_ctx *)p)->kv;
}

static void cpu_parallel_for(void *p, int64_t n, cs_range_fn fn, void *arg) {
    cs_threadpool_for(((cpu_ctx *)p)->pool, n, fn, arg);
}

static const struct cs_backend_iface cpu_iface = {
    "cpu",         cpu_free,      cpu_kv_init, cpu_forward,
    cpu_kv_export, cpu_kv_import, cpu_kv_pool, cpu_parallel_for,
};

int cs_backend_cpu_init(const cs_weights *m, int n_threads, bool kv_bf16, cs_backend **out) {
    *out = NULL;
    cs_backend *b = calloc(1, sizeof *b);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b), free(c);
        return cs_fail(CS_ENOMEM, "cpu backend: out of memory");
    }
    c->m = m;
    c->kv_bf16 = kv_bf16;
    int r = cs_threadpool_init(n_threads, &c->pool);
    if (r) {
        free(b);
        cpu_free(c);
        return r;
    }
    b->iface = &cpu_iface;
    b->ctx = c;
    *out = b;
    return 0;
}
