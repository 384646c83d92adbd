/* chunkserve/kvx.h: the KV transport. Streams finished KV pages from a
 * prefill worker (sender, cs_kvx_tx) to the decode worker that reserved room
 * for them (receiver, cs_kvx_rx) over one ordered channel per (prefill,
 * decode) pair. Both ends name pages by id in a KV pool (cs_kvx_pool: page p
 * at base + p * layout.page_bytes); the bytes never pass through the caller.
 *
 * Channel: a TCP connection opened lazily by the sender on the first transfer
 * to an endpoint, reopened on the next transfer after it broke (peer restart).
 * It starts with a HELLO carrying the sender's name, its incarnation id (64
 * random bits per process), the model/layout fingerprint, its payload and a
 * nonce; the receiver refuses a layout that is not its own and a payload it
 * does not speak (the message names both), else answers with a CHALLENGE (its
 * nonce and its proof of the cluster secret); the sender checks that proof and
 * answers with its own (AUTH). Only an authenticated HELLO counts: then a new
 * incarnation of a known sender closes (fences) the old one's connection, and
 * an incarnation once replaced is refused from then on. Before AUTH the
 * receiver reads nothing but HELLO and AUTH headers (checked before any
 * payload is read), within hello_timeout_ms. Every frame carries the
 * incarnation of its writer (frames of another are refused); every trailer
 * carries a MAC under the session key the handshake derived.
 *
 * Payload: how page bytes move, chosen by the pool's kind. A host pool sends
 * them inline on the channel's TCP connection (gathered from the pool with
 * writev, read straight into the reserved pages: no copy in the transport);
 * a CUDA pool sends them GPU to GPU over a 2-rank NCCL communicator per
 * channel (device staging slots, ncclSend/ncclRecv; built only with CUDA and
 * NCCL), while every control frame stays on TCP. Checksums: each chunk of
 * pages carries a 64-bit checksum (XXH3 of the bytes for TCP, a device sum
 * computed in the gather/scatter pass for NCCL); the trailer carries a hash
 * of all chunk checksums in order.
 *
 * Transfer: identified by a 64-bit id chosen by the router, unique per
 * receiver. The receiver first expects it (cs_kvx_rx_expect: the reserved page
 * ids and a deadline); the sender begins it, queues page ranges by id in order
 * as chunks complete, then a trailer (first token, prompt length, total
 * pages). The receiver completes on the trailer once every page landed and
 * acknowledges it. Abort frames, deadlines (on both sides), dead peers (EOF,
 * read error, no traffic for dead_ms despite keepalive pings) fail transfers,
 * each reporting exactly once through its done callback.
 *
 * Threads: each tx and each rx owns one I/O thread; every callback runs on
 * that thread, never inside an API call (callbacks may call the API). API
 * functions are thread-safe and never block on the network. If a function
 * that takes a callback fails, that callback is never called. */
#ifndef CHUNKSERVE_KVX_H
#define CHUNKSERVE_KVX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/secret.h"

#ifdef __cplusplus
extern "C" {
#endif

enum cs_kvx_dtype { CS_KVX_DTYPE_F32 = 0, CS_KVX_DTYPE_F16 = 1, CS_KVX_DTYPE_BF16 = 2 };

/* What a page is: both peers must agree on every field (checked at connect). */
typedef struct {
    int32_t n_layers;    /* layers whose K and V one page holds (all, or one kind's share
                            with windowed layers: chunkserve/kv_cache.h) */
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t dtype;       /* enum cs_kvx_dtype of the KV pool */
    int32_t page_size;   /* tokens per page */
    uint64_t page_bytes; /* bytes of one page: K and V of its n_layers layers */
    int32_t weights;     /* enum cs_kvx_weights: what computed the pages (the two modes'
                            pages differ, so a pair must match) */
    uint64_t model;      /* cs_model_fingerprint of the weights that computed them (0 where
                            unknown); only in the fingerprint, not in a HELLO's fields */
} cs_kvx_layout;
enum cs_kvx_weights { CS_KVX_WEIGHTS_FP32 = 0, CS_KVX_WEIGHTS_QUANT = 1 };

/* 64-bit fingerprint of a layout (XXH64 of its fields, little-endian, and
 * the model's fingerprint): every frame carries it, so pages of another model
 * are refused at HELLO and after. */
uint64_t cs_kvx_layout_fingerprint(const cs_kvx_layout *l);

/* Where the pages are. kind picks the payload (the registry in kvx_io.c):
 * HOST -> TCP, CUDA -> NCCL. */
enum cs_kvx_pool_kind { CS_KVX_POOL_HOST = 0, CS_KVX_POOL_CUDA = 1 };
/* How page bytes move; the value is the HELLO's payload byte. */
enum cs_kvx_payload { CS_KVX_PAYLOAD_TCP = 0, CS_KVX_PAYLOAD_NCCL = 1 };

typedef struct {
    int kind;        /* enum cs_kvx_pool_kind */
    int device;      /* CUDA device ordinal that holds the pool (kind CUDA) */
    void *base;      /* host or device pointer: page p at base + p * page_bytes */
    int32_t n_pages; /* page ids are in [0, n_pages) */
} cs_kvx_pool;

/* "tcp", "nccl" ("?" otherwise). */
const char *cs_kvx_payload_name(int payload);
/* The payload a pool of kind uses (enum cs_kvx_payload), -1 for none. */
int cs_kvx_payload_of_pool(int kind);
/* Whether this build can move pages of that payload (NCCL: CUDA + NCCL). */
bool cs_kvx_payload_available(int payload);

/* What the sender appends after the last page. */
#define CS_KVX_MAX_TOP 20 /* alternatives of the first token (the engine's CS_MAX_TOP_LOGPROBS) */
typedef struct {
    int32_t first_token; /* sampled after the last prompt chunk */
    int32_t prompt_len;  /* tokens whose KV the pages hold */
    int32_t total_pages; /* must equal the pages sent and the pages reserved */
    int32_t n_cached;    /* of prompt_len, tokens the sender took from its prefix cache (the
                            client's usage.cached_prompt_tokens); 0..prompt_len */
    /* the first token's log-probability and n_top alternatives (most likely
     * first) when the request asked for logprobs; 0 otherwise */
    float first_logprob;
    int32_t n_top;
    int32_t top_ids[CS_KVX_MAX_TOP];
    float top_logprobs[CS_KVX_MAX_TOP];
} cs_kvx_trailer;

/* Counters (monotonic except the gauges marked). */
typedef struct {
    uint64_t transfers_started, transfers_completed, transfers_failed;
    uint64_t bytes; /* page bytes sent (tx: handed to the socket or NCCL) or landed (rx) */
    uint64_t frames;
    uint64_t conns_opened, conns_closed;
    uint64_t protocol_errors; /* connections closed for bad input */
    uint64_t room_waits;      /* tx: sends refused with CS_EAGAIN (channel full) */
    uint64_t pending_evicted; /* rx: connections closed before HELLO to make room */
    uint64_t stale_frames;    /* rx: frames for a transfer not live here (ended or never
                                 expected): dropped and answered with ABORT, channel kept */
    uint64_t renewals;        /* rx: deadlines extended by the transfer's sender */
    int64_t transfers_active; /* gauge */
} cs_kvx_stats;

/* Called once per transfer, on the I/O thread. status 0: complete (rx: all
 * pages landed and the trailer checked; tx: the receiver acknowledged the
 * trailer). Negative: CS_ETIMEDOUT (deadline), CS_ECANCELED (aborted by this
 * side or the peer), CS_ECONNRESET (peer died / channel broke), CS_EBADMSG or
 * CS_EPROTO (bad frame; the message names it), CS_ECONNREFUSED, ...
 * trailer is non-NULL only for rx success. After this call the transport
 * never writes the transfer's reserved pages again (rx: on failure they are
 * the callee's to free); a tx transfer's pages are handed back through their
 * release callbacks, which may come later. */
typedef void (*cs_kvx_done_fn)(void *arg, uint64_t xfer_id, int status, const char *msg,
                               const cs_kvx_trailer *trailer);

/* ------------------------------------------------------------- sender */

typedef struct cs_kvx_tx cs_kvx_tx;

/* Called with the arg of cs_kvx_tx_begin, once after a cs_kvx_tx_send_pages
 * of that transfer returned CS_EAGAIN, when its channel has room again (or
 * the channel closed: the next send then says why). Never after the
 * transfer's done callback. */
typedef void (*cs_kvx_room_fn)(void *arg, uint64_t xfer_id);

typedef struct {
    cs_kvx_layout layout;
    cs_kvx_pool pool;        /* pages are read from here; must outlive the sender */
    const char *name;        /* this sender's name, e.g. "prefill-0" (<= 63 printable bytes) */
    const cs_secret *secret; /* the cluster secret (copied): the receiver's proof is
                                checked against each of its keys, HELLO proved by the
                                key it matched and each trailer MAC'd with the
                                session's; NULL or unset = an empty key (authenticates
                                nothing) */
    uint64_t incarnation;    /* 0 = 64 random bits drawn at init */
    bool checksum;           /* a checksum per chunk and in the trailer; default true */
    size_t max_frame_bytes;  /* one chunk (TCP frame / NCCL staging slot); default 4 MiB
                                (TCP), 32 MiB (NCCL); at least one page */
    size_t max_queued_bytes; /* backpressure: page bytes per channel not yet handed to
                                the socket or NCCL; default 256 MiB */
    int32_t keepalive_ms;    /* ping when idle; default 1000 */
    int32_t dead_ms;         /* peer dead after this long silent; default 5000 */
    int32_t renew_ms;        /* every transfer not yet finished sends a PING naming it this
                                often once its channel is open: the receiver extends its
                                deadline (the decode worker's lease) while the sender lives,
                                however long the prompt waits; default 1000, 0 = never */
    cs_kvx_room_fn room;     /* optional: see cs_kvx_room_fn */
    /* NCCL payload only */
    int32_t n_slots;         /* staging slots per channel (pipelining); default 2 */
    int32_t init_timeout_ms; /* communicator creation; default 30000 */
    int32_t op_timeout_ms;   /* one chunk's gather or ncclSend; default 10000 */
} cs_kvx_tx_params;

cs_kvx_tx_params cs_kvx_tx_params_default(void);

/* Starts the sender's I/O thread (no network, CUDA or NCCL work happens
 * before the first transfer). CS_EINVAL (bad params: no pool, a chunk smaller
 * than a page, NCCL page_bytes not a multiple of 8), CS_ENOTSUP (a CUDA pool
 * in a build without NCCL), CS_ENOMEM, or a system error. Free with
 * cs_kvx_tx_free. */
int cs_kvx_tx_init(const cs_kvx_tx_params *p, cs_kvx_tx **out);
/* Fails every open transfer (CS_ECANCELED), releases every queued page (all
 * callbacks run before it returns), closes channels, joins the thread. NULL
 * is a no-op. Do not call from a callback. */
void cs_kvx_tx_free(cs_kvx_tx *tx);

/* Begins transfer xfer_id of total_pages pages to the receiver at host:port
 * (a numeric IPv4/IPv6 address: names are not resolved, so the I/O thread
 * never waits on DNS; a name fails the transfer with CS_ENOENT), opening
 * that channel if it is not open.
 * deadline_ms: relative, > 0, covers everything up to the receiver's
 * acknowledgement. done is called exactly once unless this returns an error:
 * CS_EINVAL, CS_EEXIST (id in use), CS_ENOMEM. */
int cs_kvx_tx_begin(cs_kvx_tx *tx, const char *host, int port, uint64_t xfer_id,
                    int32_t total_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg);

/* Hands pages back: page_ids/n_pages are those of one successful send. */
typedef void (*cs_kvx_release_fn)(void *arg, const int32_t *page_ids, int32_t n_pages);

/* Queues pages [first_page, first_page + n_pages) of the transfer, in order
 * (first_page == pages queued so far): page_ids are ids in the sender's pool
 * (copied). The pages must stay untouched until release(arg, ...) is called
 * once, on the I/O thread (TCP: once written to the socket; NCCL: once
 * gathered into staging; or when the transfer or channel ended). release may
 * be NULL. Errors (nothing queued, release never called): CS_EAGAIN (the
 * channel already holds max_queued_bytes: the room callback follows),
 * CS_ENOENT (unknown or finished transfer), CS_EINVAL (out of order, past
 * total_pages, an id outside the pool), CS_ENOMEM. */
int cs_kvx_tx_send_pages(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages,
                         const int32_t *page_ids, cs_kvx_release_fn release, void *arg);
/* Queues the trailer (after all pages). The transfer completes when the
 * receiver acknowledges it. CS_ENOENT, CS_EINVAL (pages missing). */
int cs_kvx_tx_finish(cs_kvx_tx *tx, uint64_t xfer_id, const cs_kvx_trailer *t);
/* Drops the transfer's queued pages, sends an abort frame and reports
 * CS_ECANCELED through done. CS_ENOENT when it is not open. */
int cs_kvx_tx_abort(cs_kvx_tx *tx, uint64_t xfer_id);
/* Page bytes queued and not yet handed on, on the channel to host:port. */
size_t cs_kvx_tx_queued_bytes(cs_kvx_tx *tx, const char *host, int port);
uint64_t cs_kvx_tx_incarnation(const cs_kvx_tx *tx);
int cs_kvx_tx_payload(const cs_kvx_tx *tx); /* enum cs_kvx_payload */
/* A rotated cluster secret (copied; any thread): handshakes from now on use
 * it; open channels keep their session. */
void cs_kvx_tx_set_secret(cs_kvx_tx *tx, const cs_secret *s);
void cs_kvx_tx_get_stats(cs_kvx_tx *tx, cs_kvx_stats *s);

/* ----------------------------------------------------------- receiver */

typedef struct cs_kvx_rx cs_kvx_rx;

typedef struct {
    cs_kvx_layout layout;
    cs_kvx_pool pool;        /* pages land here; must outlive the receiver */
    const char *host;        /* bind address; default "127.0.0.1" */
    const cs_secret *secret; /* the cluster secret (copied): this receiver proves its
                                first key; senders must prove the same */
    int port;                /* 0 = any free port (see cs_kvx_rx_port) */
    bool require_checksum;   /* refuse chunks without one; default true */
    size_t max_frame_bytes;  /* largest chunk accepted; default 64 MiB (TCP), 32 MiB (NCCL) */
    int32_t keepalive_ms;    /* default 1000 */
    int32_t dead_ms;         /* default 5000 */
    int32_t max_conns;       /* default 256 */
    /* Before HELLO a connection may send only a HELLO header (checked before
     * its payload is read) and must finish it within hello_timeout_ms; such
     * connections are capped in all and per peer address, the oldest closed
     * first when a newcomer needs room. */
    int32_t hello_timeout_ms;     /* default 3000 */
    int32_t max_pending;          /* default 64 */
    int32_t max_pending_per_addr; /* default 16 */
    /* NCCL payload only */
    int32_t n_slots;         /* staging slots per channel; default 2 */
    int32_t init_timeout_ms; /* default 30000 */
    int32_t op_timeout_ms;   /* one chunk's ncclRecv + scatter; default 10000 */
} cs_kvx_rx_params;

cs_kvx_rx_params cs_kvx_rx_params_default(void);

/* Binds, listens and starts the I/O thread. CS_EINVAL, CS_ENOTSUP (a CUDA
 * pool without NCCL), CS_ENOMEM or the bind/listen error (e.g.
 * -EADDRINUSE). Free with cs_kvx_rx_free. */
int cs_kvx_rx_init(const cs_kvx_rx_params *p, cs_kvx_rx **out);
/* Fails every pending transfer (CS_ECANCELED; callbacks run before it
 * returns), closes everything, joins the thread. NULL is a no-op. */
void cs_kvx_rx_free(cs_kvx_rx *rx);
int cs_kvx_rx_port(const cs_kvx_rx *rx);
uint64_t cs_kvx_rx_incarnation(const cs_kvx_rx *rx);
int cs_kvx_rx_payload(const cs_kvx_rx *rx); /* enum cs_kvx_payload */
/* As cs_kvx_tx_set_secret: handshakes from now on prove and check s. */
void cs_kvx_rx_set_secret(cs_kvx_rx *rx, const cs_secret *s);

/* Expects transfer xfer_id into the n_pages reserved page ids of the pool
 * (copied), from the authenticated sender named sender (NULL or "": any
 * authenticated sender; a frame of it from another is a protocol error that
 * closes that channel and leaves the transfer waiting). Pages are written only between this call
 * and done: done runs after the last write into them finished (NCCL: on the device), also on
 * failure, so the caller may free them at once. deadline_ms: relative, > 0:
 * past it the transfer fails with CS_ETIMEDOUT; a renewal from its sender
 * (a PING naming the transfer, cs_kvx_tx_params.renew_ms) moves it to
 * deadline_ms after that renewal. done is called exactly once
 * unless this returns an error: CS_EINVAL (an id outside the pool),
 * CS_EEXIST, CS_ENOMEM. */
int cs_kvx_rx_expect(cs_kvx_rx *rx, uint64_t xfer_id, const char *sender, const int32_t *page_ids,
                     int32_t n_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg);
/* Fails the transfer with CS_ECANCELED (done runs on the I/O thread soon
 * after) and tells the sender. CS_ENOENT when it is not pending. */
int cs_kvx_rx_cancel(cs_kvx_rx *rx, uint64_t xfer_id);
void cs_kvx_rx_get_stats(cs_kvx_rx *rx, cs_kvx_stats *s);

#ifdef __cplusplus
}
#endif
#endif
