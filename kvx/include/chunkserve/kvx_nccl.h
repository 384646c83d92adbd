/* chunkserve/kvx_nccl.h: the NCCL backend of the KV transport (GPU peers).
 * Same model as chunkserve/kvx.h (one ordered channel per (prefill, decode)
 * pair, transfers with ids, deadlines, trailers, each done callback exactly
 * once), but the page bytes move GPU to GPU over NCCL while every control
 * frame stays on the channel's TCP connection:
 *
 *   sender (rank 0)                              receiver (rank 1)
 *   TCP connect, HELLO (flag NCCL) ------------> layout + fencing checks
 *   ncclGetUniqueId, NCCL_ID ------------------> ncclCommInitRankConfig(rank 1)
 *   ncclCommInitRankConfig(rank 0)               (both non-blocking, polled)
 *                               <--------------- NCCL_READY (status, slot size)
 *   per chunk: gather pages -> staging (kernel, device checksum)
 *   NCCL_PAGES descriptor ---------------------> queued in order
 *   ncclSend(staging) on the channel's stream    ncclRecv(staging) on its stream,
 *                                                 scatter into the reserved ids
 *   TRAILER -----------------------------------> completes once every chunk landed
 *                               <--------------- DONE
 *
 * One 2-rank communicator per TCP connection, created lazily when the first
 * transfer opens the channel, aborted (ncclCommAbort) when the channel breaks
 * for any reason: TCP EOF or silence, a protocol error, an NCCL async error, an
 * NCCL operation past op_timeout_ms, init past init_timeout_ms. Every transfer
 * on the channel then fails (CS_ECONNRESET / CS_ETIMEDOUT / CS_EBADMSG); the
 * next transfer reconnects and creates a new communicator (peer restart).
 *
 * Pages: the sender and the receiver name pages by id in a device KV pool
 * (cs_kvx_nccl_pool): the CUDA backend's bf16 pool, page p at base + p *
 * layout.page_bytes. Checksums: each chunk carries a 64-bit sum of its bytes
 * computed on the device in the same pass as the gather (and on the receiver
 * in the same pass as the scatter); the trailer carries XXH64 of the chunk
 * sums. Both are on by default (tcp.checksum / tcp.require_checksum).
 *
 * Availability: the library (cs_kvx_nccl) is built only when the build has
 * CUDA and NCCL; it defines CS_HAVE_NCCL for its users. Threads and
 * callbacks: as kvx.h (one I/O thread per object, which also makes every CUDA
 * and NCCL call of the transport). */
#ifndef CHUNKSERVE_KVX_NCCL_H
#define CHUNKSERVE_KVX_NCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kvx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The device KV pool pages are read from (sender) or written into (receiver).
 * layout.page_bytes must be a multiple of 8. The pool must outlive the
 * transport object. */
typedef struct {
    int device;      /* CUDA device ordinal that holds the pool */
    void *base;      /* device pointer: page p at base + p * page_bytes */
    int32_t n_pages; /* page ids are in [0, n_pages) */
} cs_kvx_nccl_pool;

/* ------------------------------------------------------------- sender */

typedef struct cs_kvx_nccl_tx cs_kvx_nccl_tx;

typedef struct {
    /* The control channel, as for TCP: layout, name, incarnation,
     * keepalive_ms, dead_ms. checksum: device sum of each chunk (default
     * true). max_frame_bytes: one chunk = one staging slot = one ncclSend
     * (default 32 MiB; must not exceed the receiver's). max_queued_bytes:
     * backpressure on pages queued and not yet gathered (default 256 MiB). */
    cs_kvx_tx_params tcp;
    cs_kvx_nccl_pool pool;
    int32_t n_slots;         /* staging slots per channel (pipelining); default 2 */
    int32_t init_timeout_ms; /* communicator creation; default 30000 */
    int32_t op_timeout_ms;   /* one chunk's gather or ncclSend; default 10000 */
} cs_kvx_nccl_tx_params;

cs_kvx_nccl_tx_params cs_kvx_nccl_tx_params_default(void);

/* Starts the sender's I/O thread (no CUDA or NCCL work happens before the
 * first transfer). CS_EINVAL (bad params: page_bytes not a multiple of 8, a
 * chunk smaller than a page, no pool), CS_ENOMEM, or a system error. */
int cs_kvx_nccl_tx_init(const cs_kvx_nccl_tx_params *p, cs_kvx_nccl_tx **out);
/* As cs_kvx_tx_free; also aborts every communicator and frees its staging.
 * NULL is a no-op. Do not call from a callback. */
void cs_kvx_nccl_tx_free(cs_kvx_nccl_tx *tx);
/* As cs_kvx_tx_begin. */
int cs_kvx_nccl_tx_begin(cs_kvx_nccl_tx *tx, const char *host, int port, uint64_t xfer_id,
                         int32_t total_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg);
/* Queues pages [first_page, first_page + n_pages) of the transfer, in order:
 * page_ids are ids in the sender's pool (copied). The pages must not be
 * overwritten until release(arg) is called (on the I/O thread once the
 * gather kernels that read them finished, or after the communicator was
 * aborted; inside this call when it fails; release may be NULL). Never
 * blocks. CS_EAGAIN (backpressure, nothing queued), CS_ENOENT (unknown or
 * finished transfer), CS_EINVAL (out of order, past total_pages, an id
 * outside the pool). */
int cs_kvx_nccl_tx_send_pages(cs_kvx_nccl_tx *tx, uint64_t xfer_id, int32_t first_page,
                              int32_t n_pages, const int32_t *page_ids, cs_kvx_release_fn release,
                              void *arg);
/* As cs_kvx_tx_finish / cs_kvx_tx_abort. */
int cs_kvx_nccl_tx_finish(cs_kvx_nccl_tx *tx, uint64_t xfer_id, const cs_kvx_trailer *t);
int cs_kvx_nccl_tx_abort(cs_kvx_nccl_tx *tx, uint64_t xfer_id);
uint64_t cs_kvx_nccl_tx_incarnation(const cs_kvx_nccl_tx *tx);
/* bytes: page bytes handed to ncclSend; frames: control frames written. */
void cs_kvx_nccl_tx_get_stats(cs_kvx_nccl_tx *tx, cs_kvx_stats *s);

/* ----------------------------------------------------------- receiver */

typedef struct cs_kvx_nccl_rx cs_kvx_nccl_rx;

typedef struct {
    /* The control channel, as for TCP: layout, host, port, require_checksum
     * (refuse chunks without a device sum; default true), max_frame_bytes
     * (one staging slot: the largest chunk accepted; default 32 MiB),
     * keepalive_ms, dead_ms, max_conns. import must be NULL: pages land in
     * the pool directly. */
    cs_kvx_rx_params tcp;
    cs_kvx_nccl_pool pool;
    int32_t n_slots;         /* staging slots per channel; default 2 */
    int32_t init_timeout_ms; /* default 30000 */
    int32_t op_timeout_ms;   /* one chunk's ncclRecv + scatter; default 10000 */
} cs_kvx_nccl_rx_params;

cs_kvx_nccl_rx_params cs_kvx_nccl_rx_params_default(void);

/* Binds, listens and starts the I/O thread. CS_EINVAL, CS_ENOMEM or the
 * bind/listen error. Free with cs_kvx_nccl_rx_free (aborts the
 * communicators, fails pending transfers with CS_ECANCELED). */
int cs_kvx_nccl_rx_init(const cs_kvx_nccl_rx_params *p, cs_kvx_nccl_rx **out);
void cs_kvx_nccl_rx_free(cs_kvx_nccl_rx *rx);
int cs_kvx_nccl_rx_port(const cs_kvx_nccl_rx *rx);
uint64_t cs_kvx_nccl_rx_incarnation(const cs_kvx_nccl_rx *rx);
/* As cs_kvx_rx_expect: page_ids are the reserved ids in the receiver's pool
 * (CS_EINVAL outside it). done runs after the last scatter into them
 * finished on the device; on failure it runs only once no kernel of the
 * transport can still write them (after the communicator's abort when the
 * channel broke), so the caller may free them at once. */
int cs_kvx_nccl_rx_expect(cs_kvx_nccl_rx *rx, uint64_t xfer_id, const int32_t *page_ids,
                          int32_t n_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg);
int cs_kvx_nccl_rx_cancel(cs_kvx_nccl_rx *rx, uint64_t xfer_id);
/* bytes: page bytes scattered into the pool. */
void cs_kvx_nccl_rx_get_stats(cs_kvx_nccl_rx *rx, cs_kvx_stats *s);

#ifdef __cplusplus
}
#endif
#endif
