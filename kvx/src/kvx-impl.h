/* kvx-impl.h: inside the KV transport (internal): the I/O helpers its two
 * I/O threads share (clock, sockets, the output queue of frames written with
 * writev) and the payload interface.
 *
 * The transport is cut in two:
 *  - the control plane (kvx_tx*.c, kvx_rx*.c): TCP channel, HELLO, fencing,
 *    keepalive, frames, ordering, deadlines, failure fan-out, stats. One copy,
 *    plain C, whatever moves the bytes;
 *  - the payload (cs__kvx_payload, an iface with a per-channel context
 *    cs__kvx_link, ggml-backend / redis ConnectionType style): how the bytes
 *    of a chunk of pages move. kvx_payload_tcp.c: inline on the channel's TCP
 *    connection (host pool); kvx_payload_nccl.c: NCCL + the kv_pack.cu
 *    kernels (device pool; library cs_kvx_nccl, CUDA builds only). The CPU
 *    tests pass a loopback stand-in for NCCL (tests/kvx/kvx_nccl_loop.h).
 *
 * A chunk moves through one staging slot of its channel's link:
 *   sender:   pack(slot, ids) -> query() == 0 -> its frame is written on TCP
 *             (PAGES with the bytes when inline, else a LINK_PAGES
 *             descriptor) -> send(slot) -> query() == 0 -> slot free;
 *   receiver: inline: the PAGES payload is read straight into the pages;
 *             otherwise recv(slot, ids) per descriptor, in arrival order ->
 *             query() == 0 (scattered and summed).
 * Every link function is called on the owning I/O thread only; a slot
 * carries one chunk at a time and is never reused before query() reported
 * its last operation finished (or the link was closed). */
#ifndef CS_KVX_IMPL_H
#define CS_KVX_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/secret.h"
#include "kvx_wire.h"

int64_t cs__kvx_now_ms(void);
int cs__kvx_set_socket_opts(int fd); /* non-blocking, TCP_NODELAY, keepalive */
int cs__kvx_wake_init(int fds[2]);
void cs__kvx_wake(int fd);
void cs__kvx_drain(int fd);
uint64_t cs__kvx_incarnation(void); /* 64 random bits, never 0 */

/* One frame waiting to be written: a sealed header, then a control payload
 * (ctl) or n_pages pages straight from pool memory (pages: one pointer each). */
typedef struct kvx_out {
    struct kvx_out *next;
    int type;
    uint64_t xfer_id;
    cs_kvx_hdr h;
    uint8_t hdr[CS_KVX_HDR_BYTES];
    uint8_t ctl[CS_KVX_CTRL_MAX_BYTES];
    const uint8_t *base; /* PAGES: pool base; page ids[i] at base + ids[i] * page_bytes */
    const int32_t *ids;
    int32_t n_pages;
    size_t page_bytes;
    void *owner; /* sender: the chunk's slot (data frames) */
    void *xfer;  /* sender: the transfer (NULL once it ended) */
    size_t total, off;
} kvx_out;

/* Writes as much of o as the socket takes. 1 when o is fully written,
 * 0 when the socket is full, negative on error. */
int cs__kvx_out_write(int fd, kvx_out *o);
/* Fills the header and control payload of a control frame (sealed). */
void cs__kvx_out_ctl(kvx_out *o, int type, uint64_t epoch, uint64_t xfer_id, uint64_t fingerprint,
                     const void *payload, size_t len);

/* ---------------------------------------------------------- handshake */

/* One key of the cluster secret (len 0: the empty key of a transport
 * without a secret; the handshake then runs and proves nothing). */
typedef struct {
    uint8_t key[CS_SECRET_MAX];
    size_t len;
} kvx_key;
/* The cluster secret as the transport holds it (chunkserve/secret.h): k[0]
 * is the one a receiver proves; a sender accepts a receiver's proof by any
 * of them. n is at least 1 (the empty key when no secret is set). */
typedef struct {
    int n;
    kvx_key k[CS_SECRET_KEYS];
} kvx_keys;
/* Copies s (NULL or unset: the empty key). */
void cs__kvx_keys_set(kvx_keys *ks, const cs_secret *s);
/* Whether k is one of ks (a channel's session key still accepted after a
 * rotation: a retired one is closed once its transfers are over). */
bool cs__kvx_keys_have(const kvx_keys *ks, const kvx_key *k);

/* What both ends of a channel's handshake hash (kvx_wire.h version 5). */
typedef struct {
    uint8_t tx_nonce[CS_KVX_NONCE_BYTES], rx_nonce[CS_KVX_NONCE_BYTES];
    uint64_t tx_inc, rx_inc, fingerprint;
    uint8_t payload; /* enum cs_kvx_payload, as HELLO named it */
    char name[CS_KVX_NAME_MAX];
} kvx_transcript;
enum kvx_derive { KVX_PROOF_RX, KVX_PROOF_TX, KVX_SESSION };
/* HMAC-SHA256(secret, label of what || transcript): the receiver's proof
 * (CHALLENGE), the sender's proof (AUTH) or the channel's session key. */
void cs__kvx_derive(const kvx_key *k, enum kvx_derive what, const kvx_transcript *t,
                    uint8_t out[32]);
/* The TRAILER's MAC: HMAC-SHA256(session, xfer_id || trailer bytes before
 * the MAC), truncated. */
void cs__kvx_trailer_mac(const uint8_t session[32], uint64_t xfer_id,
                         const uint8_t trailer[CS_KVX_TRAILER_BYTES],
                         uint8_t mac[CS_KVX_MAC_BYTES]);

/* The handshake's steps (kvx_handshake.c, which draws the exchange). */
typedef struct {                       /* what the sender's side of a channel knows */
    uint8_t nonce[CS_KVX_NONCE_BYTES]; /* its HELLO's */
    uint64_t incarnation, fingerprint;
    int payload;      /* its payload (CS_KVX_PAYLOAD_*), as its HELLO named it */
    const char *name; /* the sender's */
    const char *peer; /* "host:port", for messages */
} cs__kvx_hs_sender;
typedef struct { /* what the receiver checks a HELLO against */
    int payload; /* the payload it takes (CS_KVX_PAYLOAD_*) */
    const cs_kvx_layout *layout;
    uint64_t incarnation, fingerprint;
} cs__kvx_hs_receiver;
/* Sender: HELLO's payload (naming its payload kind), with a fresh nonce
 * (kept for the transcript). */
void cs__kvx_hs_hello(const cs_kvx_layout *layout, int payload, const char *name,
                      uint8_t nonce[CS_KVX_NONCE_BYTES], uint8_t pl[CS_KVX_HELLO_BYTES]);
/* Sender, on CHALLENGE: checks the receiver's proof (by any of keys), then
 * gives AUTH's proof and the session key under the key that matched (a
 * copy in *matched). CS_EPROTO (a bad frame) or
 * CS_ECONNREFUSED (the receiver does not hold the secret) with err set. */
int cs__kvx_hs_answer(const kvx_keys *keys, const cs__kvx_hs_sender *me, const cs_kvx_hdr *h,
                      const uint8_t *pl, uint8_t proof[CS_KVX_AUTH_BYTES], uint8_t session[32],
                      kvx_key *matched, char *err, size_t cap);
/* Receiver, on HELLO: whether the sender's payload, model and layout are
 * this receiver's. CS_ECONNREFUSED with err naming the mismatch. */
int cs__kvx_hs_admit(const cs__kvx_hs_receiver *me, const cs_kvx_hdr *h, const cs_kvx_hello *m,
                     char *err, size_t cap);
/* Receiver, on an admitted HELLO: the transcript and CHALLENGE's payload. */
void cs__kvx_hs_challenge(const kvx_key *key, const cs__kvx_hs_receiver *me, const cs_kvx_hdr *h,
                          const cs_kvx_hello *m, kvx_transcript *t,
                          uint8_t pl[CS_KVX_CHALLENGE_BYTES]);
/* Receiver, on AUTH: whether it proves the secret over t (and comes from
 * the HELLO's incarnation); then the session key. */
bool cs__kvx_hs_verify(const kvx_key *key, const kvx_transcript *t, const cs_kvx_hdr *h,
                       const uint8_t *pl, uint8_t session[32]);

/* Folds a chunk checksum into a transfer's running digest (the trailer's). */
void cs__kvx_fold(uint64_t *digest, uint64_t chunk_sum);

/* ------------------------------------------------------------ payload */

typedef struct cs__kvx_link cs__kvx_link;

typedef struct {
    int rank;         /* 0: sender, 1: receiver */
    cs_kvx_pool pool; /* host memory for the TCP payload and the loopback link */
    size_t page_bytes;
    int32_t n_slots;
    int32_t slot_pages;    /* pages per staging slot (one chunk) */
    int32_t op_timeout_ms; /* bound on a wait inside the link (ncclInProgress) */
    char name[80];         /* for logs and the communicator's name */
} cs__kvx_link_cfg;

typedef struct cs__kvx_payload {
    const char *name;
    int kind;      /* enum cs_kvx_payload: announced in HELLO */
    int pool_kind; /* enum cs_kvx_pool_kind it moves pages of */
    /* Page bytes follow their PAGES header on the channel (the receiver
     * reads them into the reserved pages; recv is NULL), and the sender's
     * pages are needed until that frame is written. Otherwise the link moves
     * them and the pages are released once pack finished. */
    bool inline_pages;
    /* A fresh link id (sender), sent in LINK_ID; the receiver opens its link
     * with it and answers LINK_READY. NULL: no handshake, the sender's link
     * opens at connect and is ready at once. 0 or negative with err. */
    int (*unique_id)(const cs__kvx_link_cfg *cfg, uint8_t id[CS_KVX_LINK_ID_BYTES], char *err,
                     size_t errlen);
    /* Allocates the slots (and streams) and starts a non-blocking init of
     * rank cfg->rank (id NULL without a handshake). CS_ENOMEM, or another
     * negative status with err. */
    int (*open)(const cs__kvx_link_cfg *cfg, const uint8_t *id, cs__kvx_link **out, char *err,
                size_t errlen);
    /* 1: init in progress, 0: ready, negative: failed (async error), with
     * err. Polled on every I/O loop turn. */
    int (*state)(cs__kvx_link *l, char *err, size_t errlen);
    /* Sender: stages pages ids[0..n) into slot (and sums them when sum).
     * May run asynchronously. */
    int (*pack)(cs__kvx_link *l, int slot, const int32_t *ids, int32_t n, bool sum, char *err,
                size_t errlen);
    /* Sender: after the chunk's frame was written, sends the first bytes of
     * slot's staging to the peer (inline: nothing left to send). */
    int (*send)(cs__kvx_link *l, int slot, size_t bytes, char *err, size_t errlen);
    /* Receiver (not inline): receives bytes into slot's staging, then
     * scatters them into ids[0..n) (ids NULL: discard) and sums them when sum. */
    int (*recv)(cs__kvx_link *l, int slot, size_t bytes, const int32_t *ids, int32_t n, bool sum,
                char *err, size_t errlen);
    /* 0: slot's last operation finished (*sum set when it summed),
     * 1: still running, negative: failed, with err. */
    int (*query)(cs__kvx_link *l, int slot, uint64_t *sum, char *err, size_t errlen);
    /* Aborts the link, waits (bounded) until none of its operations runs any
     * more, frees everything. false when they did not drain in time (their
     * memory is then leaked rather than freed under a running kernel). */
    bool (*close)(cs__kvx_link *l);
} cs__kvx_payload;

extern const cs__kvx_payload cs__kvx_payload_tcp;
/* cs__kvx_payload_nccl is defined in kvx_payload_nccl.c (library
 * cs_kvx_nccl, CUDA + NCCL builds) and referenced weakly by the selection
 * below, so that builds without it link (CUDA pools are then refused). */

/* The payload registry (kvx_io.c): the payload for a pool of this kind,
 * and the one of a kind (enum cs_kvx_payload), in this build, or NULL. */
const cs__kvx_payload *cs__kvx_payload_for_pool(int pool_kind);
const cs__kvx_payload *cs__kvx_payload_of_kind(int payload);

/* Objects over an explicit payload (the public init functions pass the one
 * of the pool's kind; the CPU tests pass the loopback NCCL stand-in). */
int cs__kvx_tx_init_payload(const cs_kvx_tx_params *p, const cs__kvx_payload *pl, cs_kvx_tx **out);
int cs__kvx_rx_init_payload(const cs_kvx_rx_params *p, const cs__kvx_payload *pl, cs_kvx_rx **out);

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
