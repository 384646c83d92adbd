/* kernels/backend.h: the kernels library's interface (cs_kernels): the one
 * interface every compute backend implements (ggml-backend style: a vtable
 * plus a context), cut where the engine needs it: KV pool storage, a whole
 * ragged forward step, KV page export/import. Device pointers never leave a
 * backend. The registry (backend.c) is the only place that knows which
 * backends exist.
 *
 * Dependencies run one way: the engine includes this header and hands the
 * backends a view of its weights (cs_weights) and its steps (cs_backend_span);
 * nothing in kernels/ includes an engine header. */
#ifndef CS_KERNELS_BACKEND_H
#define CS_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The model's shape, as the kernels need it. */
typedef struct {
    int32_t n_vocab;
    int32_t dim; /* hidden size */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t hidden_dim; /* FFN inner size */
    float norm_eps;
    bool tied_embeddings; /* output == tok_embd */
} cs_weights_shape;

/* One layer's fp32 weights, row-major, PyTorch [out, in] order; q and k rows
 * in Hugging Face ("rotate_half") order. */
typedef struct {
    const float *attn_norm; /* (dim) */
    const float *wq;        /* (n_heads * head_dim, dim) */
    const float *wk;        /* (n_kv_heads * head_dim, dim) */
    const float *wv;        /* (n_kv_heads * head_dim, dim) */
    const float *bq;        /* (n_heads * head_dim) or NULL */
    const float *bk;        /* (n_kv_heads * head_dim) or NULL */
    const float *bv;        /* (n_kv_heads * head_dim) or NULL */
    const float *wo;        /* (dim, n_heads * head_dim) */
    const float *ffn_norm;  /* (dim) */
    const float *w_gate;    /* (hidden_dim, dim) */
    const float *w_up;      /* (hidden_dim, dim) */
    const float *w_down;    /* (dim, hidden_dim) */
} cs_layer_weights;

/* A view of a model's weights (the engine builds it; the model owns the
 * memory, which must outlive every backend made from the view). */
typedef struct {
    cs_weights_shape shape;
    const float *tok_embd;          /* (n_vocab, dim) */
    const float *out_norm;          /* (dim) */
    const float *output;            /* (n_vocab, dim); == tok_embd when tied */
    const float *rope_inv_freq;     /* (head_dim / 2) angle per position, scaling applied */
    const cs_layer_weights *layers; /* (n_layers) */
} cs_weights;

/* One sequence's part of a ragged step (the engine's cs_span, validated). */
typedef struct {
    const int32_t *tokens; /* (n_tokens) the span's new tokens */
    int32_t n_tokens;      /* >= 1 */
    int32_t pos;           /* position of tokens[0] = tokens already cached */
    const int32_t *pages;  /* page table covering positions [0, pos + n_tokens) */
    int32_t n_pages;
    bool want_logits; /* logits of the span's last token */
} cs_backend_span;

typedef struct cs_backend cs_backend;

struct cs_backend_iface {
    const char *name;
    void (*free)(void *ctx);
    /* Allocates the KV pool: n_pages pages of page_size tokens; sets the
     * bytes one page takes (all layers, K and V) in the backend's format. */
    int (*kv_init)(void *ctx, int32_t n_pages, int32_t page_size, size_t *page_bytes);
    /* A validated ragged step (see cs_engine_step); n_tokens = sum of spans. */
    int (*forward)(void *ctx, const cs_backend_span *spans, int32_t n_spans, int32_t n_tokens,
                   float *logits);
    int (*kv_export)(void *ctx, const int32_t *pages, int32_t n, void *dst);
    int (*kv_import)(void *ctx, const int32_t *pages, int32_t n, const void *src);
    /* The pool's memory (page p at base + p * page_bytes) and where it is:
     * *device = -1 for host memory, else the CUDA device ordinal. */
    void *(*kv_pool)(void *ctx, int *device);
};

struct cs_backend {
    const struct cs_backend_iface *iface;
    void *ctx;
};

/* Bytes of one KV page in the CPU backend's format (fp32). */
size_t cs_backend_cpu_page_bytes(const cs_weights_shape *shape, int32_t page_size);
/* The CPU backend (fp32, OpenBLAS GEMMs, threaded kernels): reads w in place
 * (w must outlive it). n_threads <= 0: cs_threadpool_default_size(). */
int cs_backend_cpu_init(const cs_weights *w, int n_threads, cs_backend **out);
/* The backend for this machine: CUDA when the build has it and a usable GPU
 * exists, the CPU otherwise; CHUNKSERVE_BACKEND=cpu|cuda|auto overrides
 * (cuda without a GPU: CS_ENOSYS). Logs the choice and why. */
int cs_backend_init(const cs_weights *w, int n_threads, cs_backend **out);
/* Bytes of one KV page (all layers, K and V) in b's format: fp32 on the CPU,
 * bf16 on CUDA. What kv_init will report, known before the pool exists. */
size_t cs_backend_page_bytes(const cs_backend *b, const cs_weights_shape *shape, int32_t page_size);
void cs_backend_free(cs_backend *b); /* NULL is a no-op */

#endif
