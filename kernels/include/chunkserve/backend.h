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

/* The gated FFN's activation (ops.h cs_op_glu): SwiGLU or GeGLU (GELU's
 * tanh form). */
typedef enum { CS_ACT_SILU = 0, CS_ACT_GELU_TANH } cs_act;

/* The model's shape, as the kernels need it. The kernels run one decoder
 * block shape whose optional parts an architecture switches on (engine:
 * engine/src/arch_*.c); nothing here names an architecture. */
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
    cs_act act;           /* gate activation */
    float embed_scale;    /* the embedding rows are multiplied by it (1: none) */
    float attn_scale;     /* q . k multiplier, usually 1 / sqrt(head_dim) */
    int32_t kv_layers;    /* layers whose K and V one KV page holds: n_layers, or with
                             windowed layers fewer (chunkserve/kv_cache.h's blocks) */
} cs_weights_shape;

/* One layer's fp32 weights, row-major, PyTorch [out, in] order; q and k rows
 * in Hugging Face ("rotate_half") order. The block:
 *   h = x + post_attn_norm?(attn(attn_norm(x)))
 *   out = h + post_ffn_norm?(ffn(ffn_norm(h)))
 * with q, k each RMSNormed per head by q_norm, k_norm (when set) before
 * RoPE, and attention over the last `window` positions when window > 0. */
typedef struct {
    int32_t window;              /* sliding window in positions, 0 = every position */
    int32_t kv_kind;             /* which of a block's pages holds its K and V (the page
                                    table's row: span pages + kv_kind * stride) */
    int32_t kv_slot;             /* its place in that page: 0 .. kv_layers - 1 */
    const float *rope_inv_freq;  /* (head_dim / 2) angle per position, scaling applied */
    const float *q_norm;         /* (head_dim) or NULL */
    const float *k_norm;         /* (head_dim) or NULL */
    const float *post_attn_norm; /* (dim) or NULL */
    const float *post_ffn_norm;  /* (dim) or NULL */
    const float *attn_norm;      /* (dim) */
    const float *wq;             /* (n_heads * head_dim, dim) */
    const float *wk;             /* (n_kv_heads * head_dim, dim) */
    const float *wv;             /* (n_kv_heads * head_dim, dim) */
    const float *bq;             /* (n_heads * head_dim) or NULL */
    const float *bk;             /* (n_kv_heads * head_dim) or NULL */
    const float *bv;             /* (n_kv_heads * head_dim) or NULL */
    const float *wo;             /* (dim, n_heads * head_dim) */
    const float *ffn_norm;       /* (dim) */
    const float *w_gate;         /* (hidden_dim, dim) */
    const float *w_up;           /* (hidden_dim, dim) */
    const float *w_down;         /* (dim, hidden_dim) */
    /* Quant mode (the matrices above are NULL): packed for the CPU backend's
     * integer kernels, declared below */
    const struct cs_qmat *qkv;     /* parts wq, wk, wv */
    const struct cs_qmat *o;       /* wo */
    const struct cs_qmat *gate_up; /* parts w_gate, w_up */
    const struct cs_qmat *down;    /* w_down */
} cs_layer_weights;

/* A view of a model's weights (the engine builds it; the model owns the
 * memory, which must outlive every backend made from the view). */
typedef struct {
    cs_weights_shape shape;
    const float *tok_embd;          /* (n_vocab, dim) */
    const float *out_norm;          /* (dim) */
    const float *output;            /* (n_vocab, dim); == tok_embd when tied */
    const cs_layer_weights *layers; /* (n_layers) */
    /* Quant mode: tok_embd and output are NULL and these are set; only the
     * CPU backend runs such weights (the registry refuses the others). */
    const struct cs_qmat *q_tok_embd; /* (n_vocab, dim) */
    const struct cs_qmat *q_output;   /* (n_vocab, dim); == q_tok_embd when tied */
} cs_weights;

/* ---- quantized weights (the CPU backend's quant mode; kernels/cpu/qmat.h
 * says the arithmetic) ---- */
enum {
    CS_QMAT_Q4_0 = 0,
    CS_QMAT_Q4_1,
    CS_QMAT_Q8_0,
    CS_QMAT_F32,
    CS_QMAT_Q5_0,
    CS_QMAT_Q5_1,
    CS_QMAT_Q4_K,
    CS_QMAT_Q5_K,
    CS_QMAT_Q6_K,
    CS_QMAT_TYPES
};
typedef struct cs_qmat cs_qmat;
/* One matrix of a pack: rows x cols, row-major. type CS_QMAT_Q4_0 ... Q6_K
 * (not F32): data is the file's blocks (GGUF layout: 32 weights a block along
 * a row, 256 for the K-quants);
 * CS_QMAT_F32: data is floats, quantized here to Q8_0 (d = amax / 127 as
 * fp16, q = round-half-even(x / d)). perm NULL, or (rows): packed row r is
 * the source's row perm[r] (GGUF q/k rows back in Hugging Face order). */
typedef struct {
    int type;
    const void *data;
    int64_t rows;
    const int32_t *perm;
} cs_qmat_src;
/* Packs 1..4 matrices of cols columns stacked on their rows, each part
 * starting a new 16-row panel and keeping its own type (F32 sources become
 * Q8_0), so one GEMM computes them all (q|k|v, gate|up). cols must be a
 * positive multiple of 32 (of 256 for a K-quant part). CS_EINVAL (nothing
 * allocated) or CS_ENOMEM. Free with cs_qmat_free. */
int cs_qmat_pack(const cs_qmat_src *parts, int n_parts, int64_t cols, cs_qmat **out);
void cs_qmat_free(cs_qmat *w); /* NULL is a no-op */
size_t cs_qmat_bytes(const cs_qmat *w);
int cs_qmat_type(const cs_qmat *w, int part); /* CS_QMAT_Q4_0 ... Q6_K (never F32) */
int cs_qmat_n_parts(const cs_qmat *w);
const char *cs_qmat_type_name(int type); /* "q4_0", ... */
/* Rows ids[0..n) of part `part` as fp32 (w = d*(q-z), d*q + m for Q4_1 in
 * one fused step, and for the other types exactly as the GGUF dequantizer:
 * cs__dtype_to_f32) into out (n, cols); ids in range. */
void cs_qmat_get_rows(const cs_qmat *w, int part, const int32_t *ids, int n, float *out);

/* One sequence's part of a ragged step (the engine's cs_span, validated). */
typedef struct {
    const int32_t *tokens; /* (n_tokens) the span's new tokens */
    int32_t n_tokens;      /* >= 1 */
    int32_t pos;           /* position of tokens[0] = tokens already cached */
    const int32_t *pages;  /* page table covering positions [0, pos + n_tokens): kind j's
                              page of block i at pages[j * stride + i] */
    int32_t n_pages;       /* blocks */
    int32_t n_logits;      /* logits of the span's last n_logits tokens */
    int32_t stride;        /* entries between one kind's row and the next */
} cs_backend_span;

typedef struct cs_backend cs_backend;

struct cs_backend_iface {
    const char *name;
    void (*free)(void *ctx);
    /* Allocates the KV pool: n_pages pages of page_size tokens; sets the
     * bytes one page takes (kv_layers layers' K and V) in the backend's format. */
    int (*kv_init)(void *ctx, int32_t n_pages, int32_t page_size, size_t *page_bytes);
    /* A validated ragged step (see cs_engine_step); n_tokens = sum of spans. */
    int (*forward)(void *ctx, const cs_backend_span *spans, int32_t n_spans, int32_t n_tokens,
                   float *logits);
    int (*kv_export)(void *ctx, const int32_t *pages, int32_t n, void *dst);
    int (*kv_import)(void *ctx, const int32_t *pages, int32_t n, const void *src);
    /* The pool's memory (page p at base + p * page_bytes) and where it is:
     * *device = -1 for host memory, else the CUDA device ordinal. */
    void *(*kv_pool)(void *ctx, int *device);
    /* Runs fn over [0, n) split on the backend's host threads, between steps
     * (cs_threadpool_for's contract); NULL: the caller runs it alone. */
    void (*parallel_for)(void *ctx, int64_t n,
                         void (*fn)(void *arg, int64_t begin, int64_t end, int range), void *arg);
};

struct cs_backend {
    const struct cs_backend_iface *iface;
    void *ctx;
};

/* Bytes of one KV page in the CPU backend's format (fp32, or bf16). */
size_t cs_backend_cpu_page_bytes(const cs_weights_shape *shape, int32_t page_size, bool kv_bf16);
/* The CPU backend (threaded kernels; fp32 weights through OpenBLAS GEMMs, or
 * packed quantized ones through the integer kernels of cpu/qmat.h): reads w
 * in place (w must outlive it). n_threads <= 0: cs_threadpool_default_size(). */
int cs_backend_cpu_init(const cs_weights *w, int n_threads, bool kv_bf16, cs_backend **out);
/* Whether a CPU backend holds its KV pages in bf16. */
bool cs_backend_cpu_kv_bf16(const cs_backend *b);
/* Whether cs_backend_init will pick the CUDA backend (CHUNKSERVE_BACKEND=cuda,
 * or auto with a usable GPU): the engine then loads fp32 weights. */
bool cs_backend_will_use_cuda(void);
/* The backend for this machine: CUDA when the build has it and a usable GPU
 * exists, the CPU otherwise; CHUNKSERVE_BACKEND=cpu|cuda|auto overrides
 * (cuda without a GPU: CS_ENOSYS). Logs the choice and why. kv_bf16: the CPU
 * backend's KV pages in bf16 (CUDA's are bf16 whatever it says). */
int cs_backend_init(const cs_weights *w, int n_threads, bool kv_bf16, cs_backend **out);
/* Bytes of one KV page (kv_layers layers, K and V) in b's format: fp32 on the CPU
 * (bf16 with kv_bf16), bf16 on CUDA. What kv_init will report, known before
 * the pool exists. */
size_t cs_backend_page_bytes(const cs_backend *b, const cs_weights_shape *shape, int32_t page_size);
void cs_backend_free(cs_backend *b); /* NULL is a no-op */

#endif
