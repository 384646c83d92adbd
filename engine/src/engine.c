/* engine.c: model + backend + KV page pool, and the checks that make a ragged
 * step safe to hand to a backend (backends trust their input). */
#include "chunkserve/engine.h"

#include <stdlib.h>
#include <string.h>

#include "chunkserve/backend.h"
#include "model-impl.h"
#include "chunkserve/ops.h"
#include "util.h"

struct cs_engine {
    const cs_model *m;
    cs_weights w;             /* the backends' view of m's weights */
    cs_layer_weights *layers; /* (n_layers) w.layers */
    cs_backend_span *bspans;  /* (cap_spans) a step's spans as the backend takes them */
    int32_t cap_spans;
    cs_backend *be;
    cs_kv_cache *kv;
    size_t page_bytes;
    int32_t page_size;
};

int cs_engine_default_threads(void) {
    return cs_threadpool_default_size();
}

cs_engine_params cs_engine_params_default(void) {
    cs_engine_params p = {0};
    p.page_size = 16;
    p.kv_bytes = (size_t)256 << 20;
    return p;
}

int cs_engine_init(const cs_model *m, const cs_engine_params *p, cs_engine **out) {
    *out = NULL;
    if (p->page_size < 1 || p->page_size > 4096)
        return cs_fail(CS_EINVAL, "engine: page size %d must be in 1..4096 tokens", p->page_size);
    if (p->n_pages < 0) return cs_fail(CS_EINVAL, "engine: %d pages", p->n_pages);
    if (p->n_threads < 0) return cs_fail(CS_EINVAL, "engine: %d threads", p->n_threads);
    cs_engine *e = calloc(1, sizeof *e);
    if (!e) return cs_fail(CS_ENOMEM, "engine: out of memory");
    e->m = m;
    e->page_size = p->page_size;
    /* the kernels see the model through a view, never its struct:
     * dependencies run engine -> kernels only */
    e->layers = calloc((size_t)m->cfg.n_layers, sizeof *e->layers);
    int r = e->layers ? 0 : cs_fail(CS_ENOMEM, "engine: out of memory");
    if (!r) cs__model_weights(m, &e->w, e->layers);
    if (!r) r = cs_backend_init(&e->w, p->n_threads, p->kv_bf16, &e->be);
    int32_t n_pages = p->n_pages;
    if (!r && n_pages == 0) { /* the page size depends on the backend (fp32 CPU, bf16 CUDA) */
        size_t per_page = cs_backend_page_bytes(e->be, &e->w.shape, p->page_size);
        size_t n = p->kv_bytes / per_page;
        if (n < 1)
            r = cs_fail(CS_EINVAL, "engine: a KV pool of %zu bytes holds no %zu-byte page",
                        p->kv_bytes, per_page);
        n_pages = n > INT32_MAX ? INT32_MAX : (int32_t)n;
    }
    if (!r) r = e->be->iface->kv_init(e->be->ctx, n_pages, p->page_size, &e->page_bytes);
    if (!r) r = cs_kv_cache_init(n_pages, p->page_size, &e->kv);
    if (!r) { /* the layers' kinds of page (model.c's layout) */
        int32_t per_block = 0, n_global = 0, window = 0;
        for (int32_t l = 0; l < m->cfg.n_layers; l++) {
            const cs_layer_weights *L = &e->layers[l];
            if (L->kv_kind + 1 > per_block) per_block = L->kv_kind + 1;
            if (!L->window && L->kv_kind + 1 > n_global) n_global = L->kv_kind + 1;
            if (L->window > window) window = L->window;
        }
        r = cs_kv_cache_set_blocks(e->kv, per_block, n_global, window);
    }
    if (r) {
        cs_engine_free(e);
        return r;
    }
    CS_LOGI("engine: %s backend, %d KV pages of %d tokens (%zu KiB each, %zu MiB pool); a block "
            "takes %d pages (%d for windowed layers, kept for the last %d positions)",
            e->be->iface->name, n_pages, p->page_size, e->page_bytes >> 10,
            (e->page_bytes * (size_t)n_pages) >> 20, cs_kv_cache_per_block(e->kv),
            cs_kv_cache_per_block(e->kv) - cs_kv_cache_n_global(e->kv), cs_kv_cache_window(e->kv));
    *out = e;
    return 0;
}

void cs_engine_free(cs_engine *e) {
    if (!e) return;
    cs_kv_cache_free(e->kv);
    cs_backend_free(e->be);
    free(e->layers);
    free(e->bspans);
    free(e);
}

const cs_model *cs_engine_model(const cs_engine *e) {
    return e->m;
}
cs_kv_cache *cs_engine_kv(cs_engine *e) {
    return e->kv;
}
size_t cs_engine_page_bytes(const cs_engine *e) {
    return e->page_bytes;
}
int32_t cs_engine_kv_layers(const cs_engine *e) {
    return e->w.shape.kv_layers;
}
const char *cs_engine_backend_name(const cs_engine *e) {
    return e->be->iface->name;
}

static int check_pages(const cs_engine *e, const int32_t *pages, int32_t n, const char *what) {
    for (int32_t i = 0; i < n; i++)
        if (cs_kv_cache_refcount(e->kv, pages[i]) <= 0)
            return cs_fail(CS_EINVAL, "%s: page %d (entry %d) is not an allocated page", what,
                           pages[i], i);
    return 0;
}

/* A span's pages: every kind of the blocks it reads or writes (the windowed
 * kinds from its first query's window on). */
static int check_span_pages(const cs_engine *e, const cs_span *sp, int32_t s) {
    const int32_t per_block = cs_kv_cache_per_block(e->kv);
    const int32_t n_global = cs_kv_cache_n_global(e->kv);
    int32_t used = (int32_t)(((int64_t)sp->pos + sp->n_tokens + e->page_size - 1) / e->page_size);
    if (per_block > 1 && sp->stride < sp->n_pages)
        return cs_fail(CS_EINVAL, "step: span %d's page rows are %d apart, under its %d blocks", s,
                       sp->stride, sp->n_pages);
    int32_t wb = cs_kv_cache_window_block(e->kv, sp->pos);
    for (int32_t j = 0; j < per_block; j++) {
        int32_t lo = j < n_global ? 0 : wb;
        int r = check_pages(e, sp->pages + (size_t)j * (size_t)sp->stride + lo, used - lo, "step");
        if (r) return r;
    }
    return 0;
}

void cs_engine_parallel_for(cs_engine *e, int64_t n,
                            void (*fn)(void *arg, int64_t begin, int64_t end, int range),
                            void *arg) {
    if (n <= 0) return;
    if (e->be->iface->parallel_for)
        e->be->iface->parallel_for(e->be->ctx, n, fn, arg);
    else
        fn(arg, 0, n, 0);
}

int cs_engine_step(cs_engine *e, const cs_span *spans, int32_t n_spans, float *logits) {
    const cs_model_config *c = &e->m->cfg;
    if (n_spans < 1) return cs_fail(CS_EINVAL, "step: no spans");
    int64_t n_tokens = 0;
    for (int32_t s = 0; s < n_spans; s++) {
        const cs_span *sp = &spans[s];
        if (sp->n_tokens < 1 || !sp->tokens)
            return cs_fail(CS_EINVAL, "step: span %d has no tokens", s);
        if (sp->n_logits < 0 || sp->n_logits > sp->n_tokens)
            return cs_fail(CS_EINVAL, "step: span %d asks the logits of %d of its %d tokens", s,
                           sp->n_logits, sp->n_tokens);
        if (sp->pos < 0 || (int64_t)sp->pos + sp->n_tokens > c->ctx_len)
            return cs_fail(
                CS_EINVAL,
                "step: span %d covers positions %d..%lld, beyond the model's context of %d", s,
                sp->pos, (long long)sp->pos + sp->n_tokens - 1, c->ctx_len);
        if ((int64_t)sp->n_pages * e->page_size < (int64_t)sp->pos + sp->n_tokens)
            return cs_fail(CS_EINVAL,
                           "step: span %d needs %lld positions but its %d pages hold %lld", s,
                           (long long)sp->pos + sp->n_tokens, sp->n_pages,
                           (long long)sp->n_pages * e->page_size);
        for (int32_t i = 0; i < sp->n_tokens; i++)
            if (sp->tokens[i] < 0 || sp->tokens[i] >= c->n_vocab)
                return cs_fail(CS_EINVAL,
                               "step: span %d token %d is id %d, outside the vocabulary (0..%d)", s,
                               i, sp->tokens[i], c->n_vocab - 1);
        /* only the pages the span reads or writes must be live */
        int r = check_span_pages(e, sp, s);
        if (r) return r;
        n_tokens += sp->n_tokens;
    }
    if (n_tokens > INT32_MAX / 2)
        return cs_fail(CS_EINVAL, "step: %lld tokens in one step", (long long)n_tokens);
    if (n_spans > e->cap_spans) {
        cs_backend_span *b = realloc(e->bspans, (size_t)n_spans * sizeof *b);
        if (!b) return cs_fail(CS_ENOMEM, "step: out of memory for %d spans", n_spans);
        e->bspans = b;
        e->cap_spans = n_spans;
    }
    for (int32_t s = 0; s < n_spans; s++)
        e->bspans[s] =
            (cs_backend_span){spans[s].tokens,  spans[s].n_tokens, spans[s].pos,   spans[s].pages,
                              spans[s].n_pages, spans[s].n_logits, spans[s].stride};
    return e->be->iface->forward(e->be->ctx, e->bspans, n_spans, (int32_t)n_tokens, logits);
}

int cs_engine_kv_export(cs_engine *e, const int32_t *pages, int32_t n, void *dst) {
    int r = n < 0 ? cs_fail(CS_EINVAL, "kv export: %d pages", n)
                  : check_pages(e, pages, n, "kv export");
    return r ? r : e->be->iface->kv_export(e->be->ctx, pages, n, dst);
}

int cs_engine_kv_import(cs_engine *e, const int32_t *pages, int32_t n, const void *src) {
    int r = n < 0 ? cs_fail(CS_EINVAL, "kv import: %d pages", n)
                  : check_pages(e, pages, n, "kv import");
    return r ? r : e->be->iface->kv_import(e->be->ctx, pages, n, src);
}

void cs_engine_kv_pool(cs_engine *e, cs_engine_kv_pool_info *out) {
    out->base = e->be->iface->kv_pool(e->be->ctx, &out->device);
    out->page_bytes = e->page_bytes;
    out->n_pages = cs_kv_cache_n_pages(e->kv);
}

int cs_engine_eval_seq(cs_engine *e, cs_page_table *pt, int32_t pos, const int32_t *tokens,
                       int32_t n, int32_t max_chunk, float *logits) {
    if (n < 1 || pos < 0 || max_chunk < 0)
        return cs_fail(CS_EINVAL, "eval: %d tokens at position %d in chunks of %d", n, pos,
                       max_chunk);
    if ((int64_t)pos + n > e->m->cfg.ctx_len)
        return cs_fail(CS_EINVAL, "eval: %lld positions exceed the model's context of %d",
                       (long long)pos + n, e->m->cfg.ctx_len);
    int32_t chunk = max_chunk ? max_chunk : n;
    for (int32_t done = 0; done < n; done += chunk) {
        int32_t k = n - done < chunk ? n - done : chunk;
        int r = cs_page_table_reserve(pt, e->kv, pos + done, pos + done + k);
        if (r) return r;
        cs_span sp = {tokens + done, k, pos + done, pt->pages, pt->n_pages, done + k == n, pt->cap};
        if ((r = cs_engine_step(e, &sp, 1, logits))) return r;
        cs_page_table_trim(pt, e->kv, pos + done + k);
    }
    return 0;
}
