/* chunkserve/engine.h: one model on one backend with a paged KV pool, and the
 * ragged forward step the schedulers drive.
 *
 * A step takes any mix of spans: a prompt chunk of any length for one
 * sequence, a single decode token for another, ... Each span says where its
 * new tokens sit (pos) and which pages hold the sequence's cache. Chunked
 * prefill is exact: evaluating a prompt over any number of steps gives the
 * logits and KV pages one pass gives, up to fp32 rounding of the GEMMs.
 * Not thread-safe: one thread drives an engine. */
#ifndef CHUNKSERVE_ENGINE_H
#define CHUNKSERVE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kv_cache.h"
#include "chunkserve/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_engine cs_engine;

typedef struct {
    int32_t page_size; /* tokens per KV page; default 16 */
    int32_t n_pages;   /* KV pool size in pages; 0 = derive from kv_bytes */
    size_t kv_bytes;   /* KV pool size when n_pages is 0; default 256 MiB */
    int32_t n_threads; /* CPU threads; 0 = cs_engine_default_threads() */
    bool kv_bf16;      /* CPU backend: KV pages in bf16 (half the bytes to hold, attend and
                          send; each K/V value rounded to nearest even as it is stored, so
                          chunking and batching stay exact); CUDA pools are bf16 anyway */
} cs_engine_params;

cs_engine_params cs_engine_params_default(void);

/* The CPUs this process may use: its affinity mask, capped by a cgroup CPU
 * quota (a container's CPU limit) rounded up. */
int cs_engine_default_threads(void);

/* The model must outlive the engine. Failure: CS_EINVAL (bad params),
 * CS_ENOMEM (pool does not fit). */
int cs_engine_init(const cs_model *m, const cs_engine_params *p, cs_engine **out);
void cs_engine_free(cs_engine *e); /* NULL is a no-op */

const cs_model *cs_engine_model(const cs_engine *e);
/* The page allocator for this engine's pool (owned by the engine). */
cs_kv_cache *cs_engine_kv(cs_engine *e);
/* Bytes of one page: K and V for page_size tokens of the layers one page
 * holds (every layer, or with windowed layers one kind's: kv_cache.h). */
size_t cs_engine_page_bytes(const cs_engine *e);
/* Layers whose K and V one page holds: n_layers, or with windowed layers
 * fewer (kv_cache.h's blocks). */
int32_t cs_engine_kv_layers(const cs_engine *e);
const char *cs_engine_backend_name(const cs_engine *e);

typedef struct {
    const int32_t *tokens; /* (n_tokens) the span's new tokens */
    int32_t n_tokens;      /* >= 1 */
    int32_t pos;           /* position of tokens[0] = tokens already cached */
    const int32_t *pages;  /* page table covering positions [0, pos + n_tokens): a
                              cs_page_table's pages (kind j's row at pages + j * stride) */
    int32_t n_pages;       /* blocks */
    int32_t n_logits;      /* logits of the span's last n_logits tokens (0..n_tokens): 1 to
                              sample the next token, more for the prompt's log-probabilities */
    int32_t stride;        /* the table's cap: read only when a block takes several pages */
} cs_span;

/* One ragged forward step over n_spans spans (at most one span per sequence).
 * Writes the new tokens' K and V into their pages and, for each span, the
 * n_vocab logits of its last n_logits tokens into logits: row after row, in
 * token order, spans in order.
 * Checks everything first (token ids, positions within the model's context,
 * page ids allocated and covering each span); on CS_EINVAL nothing is written. */
int cs_engine_step(cs_engine *e, const cs_span *spans, int32_t n_spans, float *logits);

/* Runs fn(arg, begin, end, range) over [0, n), split on the engine's host
 * threads when the backend has them (the CPU backend's pool), between
 * steps only (one job at a time, the caller's thread among them); the
 * split depends only on n and the thread count. */
void cs_engine_parallel_for(cs_engine *e, int64_t n,
                            void (*fn)(void *arg, int64_t begin, int64_t end, int range),
                            void *arg);

/* Convenience for driving one sequence (tools, tests; the scheduler does this
 * for many): evaluates n tokens at positions pos.. in chunks of at most
 * max_chunk tokens (0 = all at once), growing pt to cover each chunk and
 * trimming its windowed pages after it (cs_page_table_trim), and writes the
 * last token's n_vocab logits. On failure pt keeps any pages it gained. */
int cs_engine_eval_seq(cs_engine *e, cs_page_table *pt, int32_t pos, const int32_t *tokens,
                       int32_t n, int32_t max_chunk, float *logits);

/* Copies n pages (page-major, cs_engine_page_bytes() each) to a flat host
 * buffer, or back. For the KV transport and for tests. */
int cs_engine_kv_export(cs_engine *e, const int32_t *pages, int32_t n, void *dst);
int cs_engine_kv_import(cs_engine *e, const int32_t *pages, int32_t n, const void *src);

/* The KV pool's memory, for a transport that moves pages by id (the KV
 * transport, chunkserve/kvx_engine.h): page p is page_bytes bytes (all
 * layers' K and V, in the backend's format: what kv_export writes) at
 * base + p * page_bytes, for p < n_pages. device is -1 when base is host
 * memory (CPU backend), else the CUDA device ordinal whose memory it points
 * into (CUDA backend). Valid while the engine lives. Who may read or write
 * which pages from another thread, and when, is serve.h's contract. */
typedef struct {
    void *base;
    int device;
    size_t page_bytes;
    int32_t n_pages;
} cs_engine_kv_pool_info;

void cs_engine_kv_pool(cs_engine *e, cs_engine_kv_pool_info *out);

#ifdef __cplusplus
}
#endif
#endif
