/* backend_cuda.c: the CUDA backend (host side, plain C over the CUDA runtime
 * and cuBLAS; the kernels are in kernels.cu).
 *
 * Weights: converted from the model's fp32 to bf16 on the device at init and
 * carved out of one allocation; q/k/v rows are concatenated into one
 * (q_dim + 2 kv_dim, dim) matrix and gate/up into one (2 hidden, dim) matrix,
 * so a layer is 4 GEMMs. Norm weights, biases and RoPE frequencies stay fp32.
 * GEMMs: cublasGemmEx, bf16 inputs, fp32 compute and fp32 outputs; the
 * residual stream x stays fp32 and the o-proj/down-proj GEMMs add into it
 * (beta = 1).
 * KV pool: bf16, page-major like the CPU backend's,
 *   pool[n_pages][kv_layers][2 (K, V)][page_size][n_kv_heads * head_dim],
 * (layer l at slot kv_slot of its kv_kind's page), so one page is one
 * contiguous block of
 *   page_bytes = kv_layers * 2 * page_size * n_kv_heads * head_dim * 2 bytes,
 * and kv_export/kv_import move pages in exactly that layout (bf16, not the
 * CPU backend's fp32: a transfer between a CUDA and a CPU worker must
 * convert; the engine reports page_bytes per backend).
 * A step: one packed upload of the step's metadata, the layers, the logits of
 * the spans that want them (final norm only on those rows), one download,
 * one stream synchronize. Sampling stays on the host (the engine's sampler
 * works on the logits the vtable returns; for greedy decode the logits
 * download is n_vocab * 4 bytes per sequence, small next to the weights).
 * Every CUDA/cuBLAS call is checked; device allocation failures return
 * CS_ENOMEM, every other error is fatal (cs__cuda_fatal). Not thread-safe:
 * one thread drives a backend (as for the engine). Not here: CUDA graphs,
 * multi-GPU (tensor parallel), device-side sampling. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/backend.h"
#include "backend_cuda.h"
#include "cuda_impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

typedef struct {
    uint16_t *wqkv;                        /* (q_dim + 2 kv_dim, dim) bf16 */
    uint16_t *wo;                          /* (dim, q_dim) */
    uint16_t *wgu;                         /* (2 hidden, dim): gate rows then up rows */
    uint16_t *wdown;                       /* (dim, hidden) */
    float *attn_norm;                      /* (dim) */
    float *ffn_norm;                       /* (dim) */
    float *bqkv;                           /* (q_dim + 2 kv_dim) or NULL */
    float *inv_freq;                       /* (head_dim / 2) this layer's RoPE */
    int32_t window;                        /* sliding window, 0: none */
    int32_t kv_kind, kv_slot;              /* where its K and V sit (backend.h) */
    float *q_norm, *k_norm;                /* (head_dim) each, or NULL */
    float *post_attn_norm, *post_ffn_norm; /* (dim) each, or NULL */
} dev_layer;

typedef struct {
    cs_weights_shape cf;
    cudaStream_t st;
    cublasHandle_t blas;
    uint16_t *w16; /* every bf16 matrix */
    size_t w16_elems;
    float *w32;                    /* norms, biases, inv_freq */
    uint16_t *tok_embd;            /* (n_vocab, dim) */
    uint16_t *output;              /* (n_vocab, dim); == tok_embd when tied */
    float *out_norm;               /* (dim) */
    dev_layer *layers;             /* (n_layers) */
    int32_t n_kinds;               /* pages per block (the page table's rows) */
    int att_rows;                  /* query rows per attention tile */
    cs_cuda_att_scratch att_split; /* split-K parts of the attention (flash-decoding) */
    /* KV pool */
    cs_cuda_kv kv;
    int32_t n_pages;
    size_t page_bytes;
    /* step scratch, grown to the largest step seen */
    int32_t cap_tokens, cap_rows, cap_meta;
    float *x;                 /* (tokens, dim) residual stream */
    float *big;               /* (tokens, max(q_dim + 2 kv_dim, 2 hidden)) GEMM outputs */
    float *q;                 /* (tokens, q_dim) roped queries */
    uint16_t *act;            /* (tokens, max(dim, q_dim, hidden)) bf16 GEMM inputs */
    float *logits;            /* (spans, n_vocab) */
    int32_t *meta_d, *meta_h; /* packed step metadata; meta_h is pinned */
    /* kv_export/import staging */
    void *stage;
    int32_t *stage_pages;
    size_t cap_stage;
    int32_t cap_stage_pages;
} cuda_ctx;

void cs__cuda_fatal(const char *file, int line, const char *call, const char *name,
                    const char *msg) {
    cs__log(CS_LOG_ERROR, file, line,
            "cuda: %s failed: %s: %s (fatal: the worker exits, the router fails over)", call,
            name ? name : "?", msg ? msg : "?");
    abort();
}

void cs__cuda_gemm(cublasHandle_t h, float *out, const uint16_t *x, const uint16_t *w, int n_tokens,
                   int rows, int cols, float beta) {
    /* Row-major out (T, rows) = x (T, cols) W^T is column-major
     * out^T (rows, T) = W (as col-major (cols, rows))^T . x^T (cols, T). */
    const float alpha = 1.0f;
    CS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n_tokens, cols, &alpha, w,
                                 CUDA_R_16BF, cols, x, CUDA_R_16BF, cols, &beta, out, CUDA_R_32F,
                                 rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

int cs_backend_cuda_probe(char *name, size_t name_len, char *why, size_t why_len) {
    int n = 0;
    if (name_len) name[0] = 0;
    if (why_len) why[0] = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(why, why_len, "cudaGetDeviceCount failed with error %d (%s: %s)", (int)e,
                 cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        return 0;
    }
    if (n < 1) {
        snprintf(why, why_len, "cudaGetDeviceCount found no CUDA device");
        return 0;
    }
    struct cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, 0);
    if (e != cudaSuccess) {
        snprintf(why, why_len, "cudaGetDeviceProperties(0) failed with error %d (%s)", (int)e,
                 cudaGetErrorName(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (p.major < 8) {
        snprintf(why, why_len,
                 "device 0 (%s) has compute capability %d.%d; the CUDA backend needs 8.0+ (bf16)",
                 p.name, p.major, p.minor);
        return 0;
    }
    snprintf(name, name_len, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
             (double)p.totalGlobalMem / (double)(1u << 30));
    return n;
}

size_t cs_backend_cuda_page_bytes(const cs_weights_shape *cf, int32_t page_size) {
    return (size_t)cf->kv_layers * 2 * (size_t)page_size * (size_t)cf->n_kv_heads *
           (size_t)cf->head_dim * sizeof(uint16_t);
}

static int dalloc(void *pp, size_t bytes, const char *what) {
    void **p = pp;
    *p = NULL;
    if (!bytes) bytes = 16;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *p = NULL;
        return cs_fail(CS_ENOMEM,
                       "cuda backend: cannot allocate %zu MiB of device memory for %s (%s)",
                       bytes >> 20, what, cudaGetErrorString(e));
    }
    return 0;
}

static void dfree(void *p) {
    if (p) CS_CUDA_CHECK(cudaFree(p));
}

static void cuda_free(void *p) {
    cuda_ctx *c = p;
    if (!c) return;
    if (c->st) CS_CUDA_CHECK(cudaStreamSynchronize(c->st));
    dfree(c->w16), dfree(c->w32), dfree(c->kv.pool);
    dfree(c->x), dfree(c->big), dfree(c->q), dfree(c->act), dfree(c->logits), dfree(c->meta_d);
    dfree(c->stage), dfree(c->stage_pages), dfree(c->att_split.o), dfree(c->att_split.ml);
    if (c->meta_h) CS_CUDA_CHECK(cudaFreeHost(c->meta_h));
    if (c->blas) CS_CUBLAS_CHECK(cublasDestroy(c->blas));
    if (c->st) CS_CUDA_CHECK(cudaStreamDestroy(c->st));
    free(c->layers);
    free(c);
}

static int cuda_kv_init(void *p, int32_t n_pages, int32_t page_size, size_t *page_bytes) {
    cuda_ctx *c = p;
    size_t pb = cs_backend_cuda_page_bytes(&c->cf, page_size), bytes;
    if (__builtin_mul_overflow(pb, (size_t)n_pages, &bytes))
        return cs_fail(CS_ENOMEM, "cuda backend: KV pool of %d pages overflows", n_pages);
    dfree(c->kv.pool);
    c->kv.pool = NULL;
    int r = dalloc(&c->kv.pool, bytes, "the KV pool");
    if (r) return r;
    CS_CUDA_CHECK(cudaMemsetAsync(c->kv.pool, 0, bytes, c->st));
    c->kv.page_elems = pb / sizeof(uint16_t);
    c->kv.page_size = page_size;
    c->kv.kv_dim = c->cf.n_kv_heads * c->cf.head_dim;
    c->n_pages = n_pages;
    c->page_bytes = pb;
    *page_bytes = pb;
    return 0;
}

/* Packed step metadata (int32): ids, pos, page, slot (tokens each), logit
 * rows (n_rows), tiles (4 per tile, at most tokens), page tables. */
static int grow(cuda_ctx *c, int32_t n_tokens, int32_t n_rows, int64_t n_meta) {
    const cs_weights_shape *cf = &c->cf;
    int r = 0;
    if (n_tokens > c->cap_tokens) {
        size_t T = (size_t)n_tokens, qd = (size_t)cf->n_heads * cf->head_dim,
               kvd = (size_t)cf->n_kv_heads * cf->head_dim, hid = (size_t)cf->hidden_dim,
               dim = (size_t)cf->dim;
        size_t wbig = qd + 2 * kvd > 2 * hid ? qd + 2 * kvd : 2 * hid;
        if (dim > wbig) wbig = dim; /* a post norm's input */
        size_t wact = dim > qd ? dim : qd;
        if (hid > wact) wact = hid;
        dfree(c->x), dfree(c->big), dfree(c->q), dfree(c->act);
        c->x = c->big = c->q = NULL, c->act = NULL, c->cap_tokens = 0;
        if ((r = dalloc(&c->x, T * dim * 4, "step activations")) ||
            (r = dalloc(&c->big, T * wbig * 4, "step activations")) ||
            (r = dalloc(&c->q, T * qd * 4, "step activations")) ||
            (r = dalloc(&c->act, T * wact * 2, "step activations")))
            return r;
        c->cap_tokens = n_tokens;
    }
    if (n_rows > c->cap_rows) {
        dfree(c->logits);
        c->logits = NULL, c->cap_rows = 0;
        if ((r = dalloc(&c->logits, (size_t)n_rows * cf->n_vocab * 4, "step logits"))) return r;
        c->cap_rows = n_rows;
    }
    if (n_meta > c->cap_meta) {
        if (n_meta > INT32_MAX) return cs_fail(CS_ENOMEM, "cuda backend: step metadata too large");
        dfree(c->meta_d);
        c->meta_d = NULL;
        if (c->meta_h) CS_CUDA_CHECK(cudaFreeHost(c->meta_h));
        c->meta_h = NULL, c->cap_meta = 0;
        if ((r = dalloc(&c->meta_d, (size_t)n_meta * 4, "step metadata"))) return r;
        if (cudaMallocHost((void **)&c->meta_h, (size_t)n_meta * 4) != cudaSuccess) {
            (void)cudaGetLastError();
            return cs_fail(CS_ENOMEM, "cuda backend: cannot pin %zu bytes of step metadata",
                           (size_t)n_meta * 4);
        }
        c->cap_meta = (int32_t)n_meta;
    }
    return 0;
}

static int cuda_forward(void *p, const cs_backend_span *spans, int32_t n_spans, int32_t n_tokens,
                        float *logits) {
    cuda_ctx *c = p;
    const cs_weights_shape *cf = &c->cf;
    const int dim = cf->dim, nh = cf->n_heads, nkv = cf->n_kv_heads, hd = cf->head_dim;
    const int qd = nh * hd, kvd = nkv * hd, hid = cf->hidden_dim, T = n_tokens;
    int64_t n_page_ents = 0;
    for (int32_t s = 0; s < n_spans; s++)
        n_page_ents += spans[s].n_pages;
    int32_t n_rows = 0;
    for (int32_t s = 0; s < n_spans; s++)
        n_rows += spans[s].n_logits;
    const int32_t K = c->n_kinds; /* a page id per token and a page table per kind */
    int64_t n_meta = (3 + (int64_t)K) * T + n_rows + 4 * (int64_t)T + K * n_page_ents;
    int r = grow(c, n_tokens, n_rows, n_meta);
    if (r) return r;

    int32_t *ids = c->meta_h, *pos = ids + T, *slot = pos + T, *page = slot + T,
            *rows = page + (size_t)K * T;
    cs_cuda_att_tile *tiles = (cs_cuda_att_tile *)(rows + n_rows);
    int32_t *ptab = (int32_t *)(tiles + T);
    int32_t t = 0, n_out = 0, n_tiles = 0, poff = 0, max_ctx = 0;
    for (int32_t s = 0; s < n_spans; s++) {
        const cs_backend_span *sp = &spans[s];
        if (sp->pos + sp->n_tokens > max_ctx) max_ctx = sp->pos + sp->n_tokens;
        for (int32_t i0 = 0; i0 < sp->n_tokens; i0 += c->att_rows) {
            int32_t n = sp->n_tokens - i0 < c->att_rows ? sp->n_tokens - i0 : c->att_rows;
            tiles[n_tiles++] = (cs_cuda_att_tile){t + i0, n, sp->pos + i0, poff};
        }
        for (int32_t i = 0; i < sp->n_tokens; i++, t++) {
            int32_t ps = sp->pos + i;
            ids[t] = sp->tokens[i];
            pos[t] = ps;
            for (int32_t k = 0; k < K; k++)
                page[(size_t)k * T + t] = sp->pages[(size_t)k * sp->stride + ps / c->kv.page_size];
            slot[t] = ps % c->kv.page_size;
        }
        for (int32_t j = sp->n_tokens - sp->n_logits; j < sp->n_tokens; j++)
            rows[n_out++] = t - sp->n_tokens + j;
        for (int32_t k = 0; k < K; k++)
            memcpy(ptab + (size_t)k * n_page_ents + poff, sp->pages + (size_t)k * sp->stride,
                   (size_t)sp->n_pages * sizeof(int32_t));
        poff += sp->n_pages;
    }
    CS_ASSERT(t == n_tokens);
    CS_CUDA_CHECK(
        cudaMemcpyAsync(c->meta_d, c->meta_h, (size_t)n_meta * 4, cudaMemcpyHostToDevice, c->st));
    const int32_t *d_ids = c->meta_d, *d_pos = d_ids + T, *d_slot = d_pos + T, *d_page = d_slot + T,
                  *d_rows = d_page + (size_t)K * T;
    const cs_cuda_att_tile *d_tiles = (const cs_cuda_att_tile *)(d_rows + n_rows);
    const int32_t *d_ptab = (const int32_t *)(d_tiles + T);

    cs__cuda_embed(c->x, c->tok_embd, d_ids, T, dim, cf->embed_scale, c->st);
    for (int l = 0; l < cf->n_layers; l++) {
        const dev_layer *L = &c->layers[l];
        const int32_t *l_page = d_page + (size_t)L->kv_kind * T,
                      *l_ptab = d_ptab + (size_t)L->kv_kind * n_page_ents;
        cs__cuda_rmsnorm(c->act, NULL, c->x, NULL, L->attn_norm, T, dim, cf->norm_eps, c->st);
        cs__cuda_gemm(c->blas, c->big, c->act, L->wqkv, T, qd + 2 * kvd, dim, 0.0f);
        cs__cuda_qkv_rope_store(c->q, c->big, L->bqkv, L->q_norm, L->k_norm, cf->norm_eps, d_pos,
                                L->inv_freq, l_page, d_slot, c->kv, L->kv_slot, T, nh, nkv, hd,
                                c->st);
        cs__cuda_attention(c->act, c->q, d_tiles, n_tiles, max_ctx, l_ptab, c->kv, L->kv_slot, nh,
                           nkv, hd, cf->attn_scale, L->window, &c->att_split, c->st);
        /* the residual add: in the GEMM's epilogue, or after the post norm */
        if (L->post_attn_norm) {
            cs__cuda_gemm(c->blas, c->big, c->act, L->wo, T, dim, qd, 0.0f);
            cs__cuda_add_rmsnorm(c->x, c->big, L->post_attn_norm, T, dim, cf->norm_eps, c->st);
        } else {
            cs__cuda_gemm(c->blas, c->x, c->act, L->wo, T, dim, qd, 1.0f);
        }
        cs__cuda_rmsnorm(c->act, NULL, c->x, NULL, L->ffn_norm, T, dim, cf->norm_eps, c->st);
        cs__cuda_gemm(c->blas, c->big, c->act, L->wgu, T, 2 * hid, dim, 0.0f);
        cs__cuda_glu(c->act, c->big, T, hid, (int)cf->act, c->st);
        if (L->post_ffn_norm) {
            cs__cuda_gemm(c->blas, c->big, c->act, L->wdown, T, dim, hid, 0.0f);
            cs__cuda_add_rmsnorm(c->x, c->big, L->post_ffn_norm, T, dim, cf->norm_eps, c->st);
        } else {
            cs__cuda_gemm(c->blas, c->x, c->act, L->wdown, T, dim, hid, 1.0f);
        }
    }
    if (n_out) {
        cs__cuda_rmsnorm(c->act, NULL, c->x, d_rows, c->out_norm, n_out, dim, cf->norm_eps, c->st);
        cs__cuda_gemm(c->blas, c->logits, c->act, c->output, n_out, cf->n_vocab, dim, 0.0f);
        CS_CUDA_CHECK(cudaMemcpyAsync(logits, c->logits,
                                      (size_t)n_out * cf->n_vocab * sizeof(float),
                                      cudaMemcpyDeviceToHost, c->st));
    }
    CS_CUDA_CHECK(cudaStreamSynchronize(c->st));
    return 0;
}

/* Staging for n pages, in rounds of at most 64 MiB. */
static int32_t stage_pages(cuda_ctx *c, int32_t n) {
    int32_t per = (int32_t)(((size_t)64 << 20) / c->page_bytes);
    if (per < 1) per = 1;
    if (n > per) n = per;
    if ((size_t)n * c->page_bytes > c->cap_stage || n > c->cap_stage_pages) {
        dfree(c->stage), dfree(c->stage_pages);
        c->stage = NULL, c->stage_pages = NULL, c->cap_stage = 0, c->cap_stage_pages = 0;
        size_t want = (size_t)per * c->page_bytes;
        if (dalloc(&c->stage, want, "KV staging") ||
            dalloc(&c->stage_pages, (size_t)per * 4, "KV staging"))
            return -1;
        c->cap_stage = want, c->cap_stage_pages = per;
    }
    return n;
}

static int kv_move(cuda_ctx *c, const int32_t *pages, int32_t n, void *host, int to_pages) {
    for (int32_t done = 0; done < n;) {
        int32_t k = stage_pages(c, n - done);
        if (k < 0) return CS_ENOMEM;
        char *h = (char *)host + (size_t)done * c->page_bytes;
        size_t bytes = (size_t)k * c->page_bytes;
        CS_CUDA_CHECK(cudaMemcpyAsync(c->stage_pages, pages + done, (size_t)k * 4,
                                      cudaMemcpyHostToDevice, c->st));
        if (to_pages)
            CS_CUDA_CHECK(cudaMemcpyAsync(c->stage, h, bytes, cudaMemcpyHostToDevice, c->st));
        if (to_pages)
            cs_cuda_kv_scatter(c->kv.pool, c->page_bytes, c->stage_pages, k, c->stage, NULL, c->st);
        else
            cs_cuda_kv_gather(c->kv.pool, c->page_bytes, c->stage_pages, k, c->stage, NULL, c->st);
        if (!to_pages)
            CS_CUDA_CHECK(cudaMemcpyAsync(h, c->stage, bytes, cudaMemcpyDeviceToHost, c->st));
        CS_CUDA_CHECK(cudaStreamSynchronize(c->st)); /* pageable host memory and reused staging */
        done += k;
    }
    return 0;
}

static int cuda_kv_export(void *p, const int32_t *pages, int32_t n, void *dst) {
    return kv_move(p, pages, n, dst, 0);
}
static int cuda_kv_import(void *p, const int32_t *pages, int32_t n, const void *src) {
    return kv_move(p, pages, n, (void *)src, 1);
}

/* The device pool, for the KV transport's NCCL payload (the one place a
 * device pointer leaves the backend: the transport names pages by id). */
static void *cuda_kv_pool(void *p, int *device) {
    *device = 0; /* the backend runs on device 0 */
    return ((cuda_ctx *)p)->kv.pool;
}

static const struct cs_backend_iface cuda_iface = {
    "cuda",         cuda_free,      cuda_kv_init, cuda_forward,
    cuda_kv_export, cuda_kv_import, cuda_kv_pool, NULL, /* parallel_for: the caller alone */
};

/* Carves the weights; fills them from m (fp32, converted on the device) or
 * with random values when m is NULL. */
static int build(cuda_ctx *c, const cs_weights *m, const float *inv_freq, uint64_t seed) {
    const cs_weights_shape *cf = &c->cf;
    const size_t dim = (size_t)cf->dim, qd = (size_t)cf->n_heads * cf->head_dim,
                 kvd = (size_t)cf->n_kv_heads * cf->head_dim, hid = (size_t)cf->hidden_dim,
                 V = (size_t)cf->n_vocab;
    const size_t per_layer = (qd + 2 * kvd) * dim + dim * qd + 2 * hid * dim + dim * hid;
    const bool tied = m ? m->output == m->tok_embd : cf->tied_embeddings;
    const bool bias = m && (m->layers[0].bq || m->layers[0].bk || m->layers[0].bv);
    const bool qk_norm = m && m->layers[0].q_norm, post = m && m->layers[0].post_attn_norm;
    c->w16_elems = V * dim * (tied ? 1 : 2) + per_layer * (size_t)cf->n_layers;
    size_t w32 = dim + (size_t)cf->n_layers *
                           (2 * dim + (size_t)cf->head_dim / 2 + (bias ? qd + 2 * kvd : 0) +
                            (qk_norm ? 2 * (size_t)cf->head_dim : 0) + (post ? 2 * dim : 0));
    int r;
    if ((r = dalloc(&c->w16, c->w16_elems * 2, "bf16 weights")) ||
        (r = dalloc(&c->w32, w32 * 4, "fp32 weights")))
        return r;
    c->layers = calloc((size_t)cf->n_layers, sizeof *c->layers);
    if (!c->layers) return cs_fail(CS_ENOMEM, "cuda backend: out of memory");
    uint16_t *w = c->w16;
    float *f = c->w32;
    c->tok_embd = w, w += V * dim;
    c->output = tied ? c->tok_embd : w;
    if (!tied) w += V * dim;
    c->out_norm = f, f += dim;
    for (int l = 0; l < cf->n_layers; l++) {
        dev_layer *L = &c->layers[l];
        L->inv_freq = f, f += cf->head_dim / 2;
        L->window = m ? m->layers[l].window : 0;
        L->kv_kind = m ? m->layers[l].kv_kind : 0;
        L->kv_slot = m ? m->layers[l].kv_slot : l;
        if (L->kv_kind + 1 > c->n_kinds) c->n_kinds = L->kv_kind + 1;
        L->wqkv = w, w += (qd + 2 * kvd) * dim;
        L->wo = w, w += dim * qd;
        L->wgu = w, w += 2 * hid * dim;
        L->wdown = w, w += dim * hid;
        L->attn_norm = f, f += dim;
        L->ffn_norm = f, f += dim;
        if (bias) L->bqkv = f, f += qd + 2 * kvd;
        if (qk_norm) L->q_norm = f, f += cf->head_dim, L->k_norm = f, f += cf->head_dim;
        if (post) L->post_attn_norm = f, f += dim, L->post_ffn_norm = f, f += dim;
    }
    CS_ASSERT(w == c->w16 + c->w16_elems && f == c->w32 + w32);

    if (!m) { /* random weights: uniform(-a, a) with a = sqrt(3 / fan_in): unit-variance outputs */
        uint64_t s = seed;
        cs__cuda_fill_bf16(c->tok_embd, V * dim, s++, 1.0f, c->st);
        if (!tied) cs__cuda_fill_bf16(c->output, V * dim, s++, sqrtf(3.0f / (float)dim), c->st);
        cs__cuda_fill_f32(c->w32, w32, 1.0f, c->st);
        for (int l = 0; l < cf->n_layers; l++) {
            dev_layer *L = &c->layers[l];
            cs__cuda_fill_bf16(L->wqkv, (qd + 2 * kvd) * dim, s++, sqrtf(3.0f / (float)dim), c->st);
            cs__cuda_fill_bf16(L->wo, dim * qd, s++, sqrtf(3.0f / (float)qd), c->st);
            cs__cuda_fill_bf16(L->wgu, 2 * hid * dim, s++, sqrtf(3.0f / (float)dim), c->st);
            cs__cuda_fill_bf16(L->wdown, dim * hid, s++, sqrtf(3.0f / (float)hid), c->st);
        }
        for (int l = 0; l < cf->n_layers; l++)
            CS_CUDA_CHECK(cudaMemcpyAsync(c->layers[l].inv_freq, inv_freq,
                                          (size_t)cf->head_dim / 2 * 4, cudaMemcpyHostToDevice,
                                          c->st));
        CS_CUDA_CHECK(cudaStreamSynchronize(c->st));
        return 0;
    }

    /* from the model: fp32 through a device staging buffer, converted there */
    size_t stage_elems = V * dim;
    if ((qd + 2 * kvd) * dim > stage_elems) stage_elems = (qd + 2 * kvd) * dim;
    if (2 * hid * dim > stage_elems) stage_elems = 2 * hid * dim;
    float *stage;
    if ((r = dalloc(&stage, stage_elems * 4, "weight upload staging"))) return r;
#define UP16(dst, src, n)                                                                          \
    do {                                                                                           \
        CS_CUDA_CHECK(cudaMemcpy(stage, (src), (size_t)(n)*4, cudaMemcpyHostToDevice));            \
        cs__cuda_f32_to_bf16((dst), stage, (size_t)(n), c->st);                                    \
        CS_CUDA_CHECK(cudaStreamSynchronize(c->st)); /* stage is reused next */                    \
    } while (0)
#define UP32(dst, src, n)                                                                          \
    CS_CUDA_CHECK(cudaMemcpy((dst), (src), (size_t)(n)*4, cudaMemcpyHostToDevice))
    UP16(c->tok_embd, m->tok_embd, V * dim);
    if (!tied) UP16(c->output, m->output, V * dim);
    UP32(c->out_norm, m->out_norm, dim);
    for (int l = 0; l < cf->n_layers; l++) {
        const cs_layer_weights *S = &m->layers[l];
        dev_layer *L = &c->layers[l];
        UP16(L->wqkv, S->wq, qd * dim);
        UP16(L->wqkv + qd * dim, S->wk, kvd * dim);
        UP16(L->wqkv + (qd + kvd) * dim, S->wv, kvd * dim);
        UP16(L->wo, S->wo, dim * qd);
        UP16(L->wgu, S->w_gate, hid * dim);
        UP16(L->wgu + hid * dim, S->w_up, hid * dim);
        UP16(L->wdown, S->w_down, dim * hid);
        UP32(L->attn_norm, S->attn_norm, dim);
        UP32(L->ffn_norm, S->ffn_norm, dim);
        UP32(L->inv_freq, S->rope_inv_freq, cf->head_dim / 2);
        if (qk_norm) {
            UP32(L->q_norm, S->q_norm, cf->head_dim);
            UP32(L->k_norm, S->k_norm, cf->head_dim);
        }
        if (post) {
            UP32(L->post_attn_norm, S->post_attn_norm, dim);
            UP32(L->post_ffn_norm, S->post_ffn_norm, dim);
        }
        if (bias) {
            CS_CUDA_CHECK(cudaMemset(L->bqkv, 0, (qd + 2 * kvd) * 4));
            if (S->bq) UP32(L->bqkv, S->bq, qd);
            if (S->bk) UP32(L->bqkv + qd, S->bk, kvd);
            if (S->bv) UP32(L->bqkv + qd + kvd, S->bv, kvd);
        }
    }
#undef UP16
#undef UP32
    dfree(stage);
    return 0;
}

static int init(const cs_weights_shape *cf, const cs_weights *m, const float *inv_freq,
                uint64_t seed, cs_backend **out) {
    *out = NULL;
    if (cf->head_dim % 2 || cf->head_dim > 256 || cf->n_kv_heads < 1 ||
        cf->n_heads % cf->n_kv_heads || cf->n_heads / cf->n_kv_heads > 64)
        return cs_fail(CS_ENOTSUP,
                       "cuda backend: head_dim %d with %d/%d heads is not supported (head_dim "
                       "even and <= 256, at most 64 query heads per KV head)",
                       cf->head_dim, cf->n_heads, cf->n_kv_heads);
    /* Optional block parts come in pairs (q_norm with k_norm, post_attn_norm
     * with post_ffn_norm: build() looks at the first of each), on every layer
     * or none, as model.c's weight table makes them; QK-norm's kernel holds
     * at most 256 q + k heads. */
    for (int l = 0; m && l < cf->n_layers; l++) {
        const cs_layer_weights *L = &m->layers[l], *L0 = &m->layers[0];
        if (!L->q_norm != !L0->q_norm || !L->k_norm != !L0->q_norm ||
            !L->post_attn_norm != !L0->post_attn_norm || !L->post_ffn_norm != !L0->post_attn_norm)
            return cs_fail(CS_ENOTSUP,
                           "cuda backend: layer %d's optional norms are not pairs present "
                           "on every layer",
                           l);
    }
    if (m && m->layers[0].q_norm && cf->n_heads + cf->n_kv_heads > 256)
        return cs_fail(CS_ENOTSUP, "cuda backend: QK-norm with %d + %d heads (at most 256)",
                       cf->n_heads, cf->n_kv_heads);
    cs_backend *b = calloc(1, sizeof *b);
    cuda_ctx *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b), free(c);
        return cs_fail(CS_ENOMEM, "cuda backend: out of memory");
    }
    c->cf = *cf;
    c->att_rows = cs__cuda_attention_tile_rows(cf->n_heads, cf->n_kv_heads);
    CS_CUDA_CHECK(cudaSetDevice(0));
    CS_CUDA_CHECK(cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking));
    CS_CUBLAS_CHECK(cublasCreate(&c->blas));
    CS_CUBLAS_CHECK(cublasSetStream(c->blas, c->st));
    /* split-K parts for up to 3 x SMs blocks (the policy aims at 2 x SMs) */
    CS_CUDA_CHECK(cudaDeviceGetAttribute(&c->att_split.n_sm, cudaDevAttrMultiProcessorCount, 0));
    size_t o_floats, ml_floats;
    c->att_split.max_parts = 3 * c->att_split.n_sm;
    cs__cuda_attention_scratch_size(c->att_split.max_parts, cf->head_dim, &o_floats, &ml_floats);
    int r = dalloc(&c->att_split.o, o_floats * 4, "attention split-K parts");
    if (!r) r = dalloc(&c->att_split.ml, ml_floats * 4, "attention split-K parts");
    if (!r) r = build(c, m, inv_freq, seed);
    if (r) {
        free(b);
        cuda_free(c);
        return r;
    }
    b->iface = &cuda_iface;
    b->ctx = c;
    *out = b;
    return 0;
}

int cs_backend_cuda_init(const cs_weights *m, cs_backend **out) {
    return init(&m->shape, m, NULL, 0, out);
}

int cs_backend_cuda_init_random(const cs_weights_shape *cf, const float *rope_inv_freq,
                                uint64_t seed, cs_backend **out) {
    return init(cf, NULL, rope_inv_freq, seed, out);
}

size_t cs_backend_cuda_weight_bytes(const cs_backend *b) {
    const cuda_ctx *c = b->ctx;
    return c->w16_elems * sizeof(uint16_t);
}
