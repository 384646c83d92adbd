/* kernels/backend.h: the one interface every compute backend implements
 * (ggml-backend style: a vtable plus a context), cut where the engine needs
 * it: KV pool storage, a whole ragged forward step, KV page export/import.
 * Device pointers never leave a backend. The registry (backend.c) is the only
 * place that knows which backends exist. */
#ifndef CS_KERNELS_BACKEND_H
#define CS_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "chunkserve/engine.h"
#include "chunkserve/model.h"

typedef struct cs_backend cs_backend;

struct cs_backend_iface {
    const char *name;
    void (*free)(void *ctx);
    /* Allocates the KV pool: n_pages pages of page_size tokens; sets the
     * bytes one page takes (all layers, K and V) in the backend's format. */
    int (*kv_init)(void *ctx, int32_t n_pages, int32_t page_size, size_t *page_bytes);
    /* A validated ragged step (see cs_engine_step); n_tokens = sum of spans. */
    int (*forward)(void *ctx, const cs_span *spans, int32_t n_spans, int32_t n_tokens, float *logits);
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
size_t cs_backend_cpu_page_bytes(const cs_model *m, int32_t page_size);
/* The CPU backend (fp32, OpenBLAS GEMMs, threaded kernels). */
int cs_backend_cpu_init(const cs_model *m, int n_threads, cs_backend **out);
/* The backend for this machine: CUDA when the build has it and a usable GPU
 * exists, the CPU otherwise; CHUNKSERVE_BACKEND=cpu|cuda|auto overrides
 * (cuda without a GPU: CS_ENOSYS). Logs the choice and why. */
int cs_backend_init(const cs_model *m, int n_threads, cs_backend **out);
/* Bytes of one KV page (all layers, K and V) in b's format: fp32 on the CPU,
 * bf16 on CUDA. What kv_init will report, known before the pool exists. */
size_t cs_backend_page_bytes(const cs_backend *b, const cs_model *m, int32_t page_size);
void cs_backend_free(cs_backend *b); /* NULL is a no-op */

#endif
