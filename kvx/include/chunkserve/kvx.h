/* chunkserve/kvx.h: the KV transport. Streams finished KV pages from a
 * prefill worker (sender, cs_kvx_tx) to the decode worker that reserved room
 * for them (receiver, cs_kvx_rx) over one ordered channel per (prefill,
 * decode) pair. This header is the TCP backend (the default, CPU hosts).
 *
 * Channel: a TCP connection opened lazily by the sender on the first transfer
 * to an endpoint, reopened on the next transfer after it broke (peer restart).
 * It starts with a HELLO carrying the sender's name, its incarnation id and
 * the model/layout fingerprint; the receiver refuses a fingerprint that is not
 * its own, and a new incarnation of a known sender closes (fences) the old
 * one's connection. Every frame carries the incarnation of its writer: frames
 * of another incarnation are refused.
 *
 * Transfer: identified by a 64-bit id chosen by the router, unique per
 * receiver. The receiver first expects it (cs_kvx_rx_expect: the reserved page
 * ids and a deadline); the sender begins it, queues page ranges in order as
 * chunks complete (each range is split into frames with an xxHash64 payload
 * checksum), then a trailer (first token, prompt length, total pages, checksum
 * of all pages). The receiver imports each frame's pages into the reserved ids
 * through its import callback and completes on the trailer, acknowledging it
 * to the sender. Abort frames, deadlines (on both sides), dead peers (EOF,
 * read error, no traffic for dead_ms despite keepalive pings) fail transfers,
 * each reporting exactly once through its done callback.
 *
 * Threads: each tx and each rx owns one I/O thread (poll()); every callback
 * runs on that thread, never inside an API call. API functions are
 * thread-safe. The NCCL payload backend (GPU peers) is chunkserve/kvx_nccl.h. */
#ifndef CHUNKSERVE_KVX_H
#define CHUNKSERVE_KVX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum cs_kvx_dtype { CS_KVX_DTYPE_F32 = 0, CS_KVX_DTYPE_F16 = 1, CS_KVX_DTYPE_BF16 = 2 };

/* What a page is: both peers must agree on every field (checked at connect). */
typedef struct {
    int32_t n_layers;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t dtype;      /* enum cs_kvx_dtype of the KV pool */
    int32_t page_size;  /* tokens per page */
    uint64_t page_bytes; /* bytes of one page: all layers' K and V */
} cs_kvx_layout;

/* 64-bit fingerprint of a layout (XXH64 of its fields, little-endian). */
uint64_t cs_kvx_layout_fingerprint(const cs_kvx_layout *l);

/* What the sender appends after the last page. */
typedef struct {
    int32_t first_token; /* sampled after the last prompt chunk */
    int32_t prompt_len;  /* tokens whose KV the pages hold */
    int32_t total_pages; /* must equal the pages sent and the pages reserved */
} cs_kvx_trailer;

/* Counters (monotonic except the gauges marked). */
typedef struct {
    uint64_t transfers_started, transfers_completed, transfers_failed;
    uint64_t bytes;        /* payload bytes sent (tx) or imported (rx) */
    uint64_t frames;
    uint64_t conns_opened, conns_closed;
    uint64_t protocol_errors; /* connections closed for bad input */
    int64_t transfers_active; /* gauge */
} cs_kvx_stats;

/* Called once per transfer, on the I/O thread. status 0: complete (rx: all
 * pages imported and the trailer checked; tx: the receiver acknowledged the
 * trailer). Negative: CS_ETIMEDOUT (deadline), CS_ECANCELED (aborted by this
 * side or the peer), CS_ECONNRESET (peer died / channel broke), CS_EBADMSG or
 * CS_EPROTO (bad frame; the message names it), CS_ECONNREFUSED, ...
 * trailer is non-NULL only for rx success. After this call the transport
 * never touches the transfer's pages again: on the receiver, a failure means
 * the reservation is the callee's to free. */
typedef void (*cs_kvx_done_fn)(void *arg, uint64_t xfer_id, int status, const char *msg,
                               const cs_kvx_trailer *trailer);

/* ------------------------------------------------------------- sender */

typedef struct cs_kvx_tx cs_kvx_tx;

typedef struct {
    cs_kvx_layout layout;
    const char *name;          /* this sender's name, e.g. "prefill-0" (<= 63 bytes) */
    uint64_t incarnation;      /* 0 = derived from the clock and pid at init */
    bool checksum;             /* xxHash64 of each payload; default true */
    size_t max_frame_bytes;    /* payload split; default 4 MiB (at least one page) */
    size_t max_queued_bytes;   /* backpressure: per channel; default 256 MiB */
    int32_t keepalive_ms;      /* ping when idle; default 1000 */
    int32_t dead_ms;           /* peer dead after this long silent; default 5000 */
} cs_kvx_tx_params;

cs_kvx_tx_params cs_kvx_tx_params_default(void);

/* Starts the sender's I/O thread. CS_EINVAL (bad params), CS_ENOMEM, or a
 * system error. Free with cs_kvx_tx_free. */
int cs_kvx_tx_init(const cs_kvx_tx_params *p, cs_kvx_tx **out);
/* Fails every open transfer (CS_ECANCELED, callbacks run before it returns),
 * releases queued pages, closes channels, joins the thread. NULL is a no-op.
 * Do not call from a callback. */
void cs_kvx_tx_free(cs_kvx_tx *tx);

/* Begins transfer xfer_id of total_pages pages to the receiver at host:port
 * (numeric IPv4/IPv6 or a name), opening that channel if it is not open.
 * deadline_ms: relative, > 0, covers everything up to the receiver's
 * acknowledgement. done is called exactly once unless this returns an error:
 * CS_EINVAL, CS_EEXIST (id in use), CS_ENOMEM. Never blocks on the network. */
int cs_kvx_tx_begin(cs_kvx_tx *tx, const char *host, int port, uint64_t xfer_id, int32_t total_pages,
                    int32_t deadline_ms, cs_kvx_done_fn done, void *arg);

/* Called when the transport no longer needs the page memory of one send. */
typedef void (*cs_kvx_release_fn)(void *arg);

/* Queues pages [first_page, first_page + n_pages) of the transfer, in order
 * (first_page == pages queued so far). data: n_pages * page_bytes contiguous
 * bytes (e.g. from cs_engine_kv_export); pagev variant: one pointer per page
 * (written straight from page memory with writev). The memory is borrowed
 * until release(arg) is called (on the I/O thread, or inside this call when it
 * fails; release may be NULL). Never blocks. CS_EAGAIN: the channel already
 * holds max_queued_bytes (backpressure: retry later, nothing queued).
 * CS_ENOENT: unknown or finished transfer; CS_EINVAL: out of order or past
 * total_pages. */
int cs_kvx_tx_send_pages(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages,
                         const void *data, cs_kvx_release_fn release, void *arg);
int cs_kvx_tx_send_pagev(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages,
                         const void *const *pages, cs_kvx_release_fn release, void *arg);
/* Queues the trailer (after all pages). The transfer completes when the
 * receiver acknowledges it. CS_ENOENT, CS_EINVAL (pages missing). */
int cs_kvx_tx_finish(cs_kvx_tx *tx, uint64_t xfer_id, const cs_kvx_trailer *t);
/* Drops the transfer's queued pages, sends an abort frame and reports
 * CS_ECANCELED through done. CS_ENOENT when it is not open. */
int cs_kvx_tx_abort(cs_kvx_tx *tx, uint64_t xfer_id);
/* Bytes queued and not yet written on the channel to host:port (0 if none). */
size_t cs_kvx_tx_queued_bytes(cs_kvx_tx *tx, const char *host, int port);
uint64_t cs_kvx_tx_incarnation(const cs_kvx_tx *tx);
void cs_kvx_tx_get_stats(cs_kvx_tx *tx, cs_kvx_stats *s);

/* ----------------------------------------------------------- receiver */

typedef struct cs_kvx_rx cs_kvx_rx;

/* Places n pages (n * page_bytes bytes at data) into page ids (the decode
 * worker passes a wrapper of cs_engine_kv_import). Called on the I/O thread,
 * only for pages reserved by cs_kvx_rx_expect. Non-zero fails the transfer. */
typedef int (*cs_kvx_import_fn)(void *arg, const int32_t *ids, int32_t n, const void *data);

typedef struct {
    cs_kvx_layout layout;
    const char *host;          /* bind address; default "127.0.0.1" */
    int port;                  /* 0 = any free port (see cs_kvx_rx_port) */
    cs_kvx_import_fn import;
    void *import_arg;
    bool require_checksum;     /* refuse frames without one; default true */
    size_t max_frame_bytes;    /* largest payload accepted; default 64 MiB */
    int32_t keepalive_ms;      /* default 1000 */
    int32_t dead_ms;           /* default 5000 */
    int32_t max_conns;         /* default 256 */
} cs_kvx_rx_params;

cs_kvx_rx_params cs_kvx_rx_params_default(void);

/* Binds, listens and starts the I/O thread. CS_EINVAL, CS_ENOMEM or the
 * bind/listen error (e.g. -EADDRINUSE). Free with cs_kvx_rx_free. */
int cs_kvx_rx_init(const cs_kvx_rx_params *p, cs_kvx_rx **out);
/* Fails every pending transfer (CS_ECANCELED; callbacks run before it
 * returns), closes everything, joins the thread. NULL is a no-op. */
void cs_kvx_rx_free(cs_kvx_rx *rx);
int cs_kvx_rx_port(const cs_kvx_rx *rx);
uint64_t cs_kvx_rx_incarnation(const cs_kvx_rx *rx);

/* Expects transfer xfer_id into the n_pages reserved page ids (copied).
 * deadline_ms: relative, > 0: past it the transfer fails with CS_ETIMEDOUT
 * (and its pages are the caller's to free). done is called exactly once
 * unless this returns an error: CS_EINVAL, CS_EEXIST, CS_ENOMEM. */
int cs_kvx_rx_expect(cs_kvx_rx *rx, uint64_t xfer_id, const int32_t *page_ids, int32_t n_pages,
                     int32_t deadline_ms, cs_kvx_done_fn done, void *arg);
/* Fails the transfer with CS_ECANCELED (done runs on the I/O thread soon
 * after) and tells the sender. CS_ENOENT when it is not pending. */
int cs_kvx_rx_cancel(cs_kvx_rx *rx, uint64_t xfer_id);
void cs_kvx_rx_get_stats(cs_kvx_rx *rx, cs_kvx_stats *s);

#ifdef __cplusplus
}
#endif
#endif
