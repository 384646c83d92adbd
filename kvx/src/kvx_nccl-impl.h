/* kvx_nccl-impl.h: inside the NCCL backend of the KV transport (internal).
 *
 * The backend is cut in two on purpose:
 *  - the control plane (kvx_nccl_tx.c, kvx_nccl_rx.c): TCP channel, frames,
 *    fencing, ordering, deadlines, failure fan-out. Plain C: no CUDA or NCCL
 *    header, so that the CPU tests drive it with a loopback link
 *    (tests/kvx/test_kvx_nccl_ctl.c);
 *  - the payload link (cs__kvx_link_ops): one communicator, two streams and
 *    n_slots staging buffers per channel. kvx_nccl_link.c implements it with
 *    NCCL + the kv_pack.cu kernels (library cs_kvx_nccl, CUDA builds only).
 *
 * Every link function is called on the owning I/O thread only. A slot carries
 * one chunk at a time; the control plane never reuses a slot before query()
 * reported its last operation finished (or the link was closed). */
#ifndef CS_KVX_NCCL_IMPL_H
#define CS_KVX_NCCL_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kvx_nccl.h"
#include "kvx_wire.h"

typedef struct cs__kvx_link cs__kvx_link;

typedef struct {
    int rank;              /* 0: sender, 1: receiver */
    cs_kvx_nccl_pool pool; /* base may be a host pointer for the loopback link */
    size_t page_bytes;
    int32_t n_slots;
    int32_t slot_pages;    /* pages per staging slot */
    int32_t op_timeout_ms; /* bound on a wait inside the link (ncclInProgress) */
    char name[80];         /* for logs and the communicator's name */
} cs__kvx_link_cfg;

typedef struct {
    const char *name;
    /* A fresh communicator id (sender). 0 or negative with err. */
    int (*unique_id)(const cs__kvx_link_cfg *cfg, uint8_t id[CS_KVX_NCCL_ID_BYTES], char *err,
                     size_t errlen);
    /* Allocates the staging slots and streams and starts a non-blocking
     * communicator init of rank cfg->rank. CS_ENOMEM, or another negative
     * status with err. */
    int (*open)(const cs__kvx_link_cfg *cfg, const uint8_t id[CS_KVX_NCCL_ID_BYTES],
                cs__kvx_link **out, char *err, size_t errlen);
    /* 1: init in progress, 0: ready, negative: the communicator failed
     * (ncclCommGetAsyncError), with err. Polled on every I/O loop turn. */
    int (*state)(cs__kvx_link *l, char *err, size_t errlen);
    /* Sender: gathers pages ids[0..n) into slot's staging (and its sum when
     * sum). Enqueued, not waited for. */
    int (*pack)(cs__kvx_link *l, int slot, const int32_t *ids, int32_t n, bool sum, char *err,
                size_t errlen);
    /* Sender: sends the first bytes of slot's staging to the peer. */
    int (*send)(cs__kvx_link *l, int slot, size_t bytes, char *err, size_t errlen);
    /* Receiver: receives bytes into slot's staging, then scatters them into
     * ids[0..n) (ids NULL: discard) and sums them when sum. */
    int (*recv)(cs__kvx_link *l, int slot, size_t bytes, const int32_t *ids, int32_t n, bool sum,
                char *err, size_t errlen);
    /* 0: slot's last operation finished (*sum set when it summed),
     * 1: still running, negative: failed, with err. */
    int (*query)(cs__kvx_link *l, int slot, uint64_t *sum, char *err, size_t errlen);
    /* Aborts the communicator, waits (bounded) until no kernel of this link
     * runs any more, frees everything. Returns false when the streams did not
     * drain in time (their memory is then leaked rather than freed under a
     * running kernel). */
    bool (*close)(cs__kvx_link *l);
} cs__kvx_link_ops;

/* The NCCL + CUDA link (kvx_nccl_link.c; only in cs_kvx_nccl). */
extern const cs__kvx_link_ops cs__kvx_link_nccl;

/* Objects over an explicit link (the public init functions pass
 * &cs__kvx_link_nccl; the CPU tests pass a loopback link). */
int cs__kvx_nccl_tx_init_ops(const cs_kvx_nccl_tx_params *p, const cs__kvx_link_ops *ops,
                             cs_kvx_nccl_tx **out);
int cs__kvx_nccl_rx_init_ops(const cs_kvx_nccl_rx_params *p, const cs__kvx_link_ops *ops,
                             cs_kvx_nccl_rx **out);

/* The KV sum of a chunk, as kv_pack.cu computes it on the device in the
 * gather/scatter pass: the bytes as little-endian 64-bit words w_i (a short
 * tail zero-padded), sum over i of mix(w_i + (i + 1) * golden) mod 2^64, with
 * mix the splitmix64 finalizer (a bijection, so every single-word change and
 * every word moved to another index changes its term). Order-independent to
 * compute, hence one pass with atomics on the device; not cryptographic. */
static inline uint64_t cs__kvx_sum_mix(uint64_t w, uint64_t i) {
    uint64_t z = w + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t cs__kvx_sum_ref(const void *buf, size_t bytes) {
    const uint8_t *b = (const uint8_t *)buf;
    uint64_t s = 0;
    for (size_t i = 0; i * 8 < bytes; i++) {
        uint64_t w = 0;
        for (size_t k = 0; k < 8 && i * 8 + k < bytes; k++)
            w |= (uint64_t)b[i * 8 + k] << (8 * k);
        s += cs__kvx_sum_mix(w, i);
    }
    return s;
}

#endif
