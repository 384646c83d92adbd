/* kvx_wire.h: the KV transport's frame format (internal). Encoding and
 * validation only: no sockets, no allocation, no engine, so that the fuzzer
 * links it alone. Every multi-byte field is little-endian.
 *
 * Header (64 bytes):
 *   0 magic u32 "CSKV"   4 version u16   6 type u16   8 flags u32
 *  12 hdr_xxh32 u32 (XXH32 of the header with this field zero)
 *  16 epoch u64 (incarnation of the frame's writer)
 *  24 xfer_id u64   32 first_page u32   36 n_pages u32
 *  40 fingerprint u64 (cs_kvx_layout_fingerprint)
 *  48 payload_len u64   56 payload_xxh64 u64 (XXH3-64 of the payload, when
 *  flags & CHECKSUM)
 * then payload_len bytes. Control payloads have fixed sizes (below).
 *
 * The channel's payload (kvx.h, kvx-impl.h) decides which data frames it
 * carries: an inline payload (TCP) PAGES (the page bytes follow the
 * header); a payload with a link of its own (NCCL) LINK_ID / LINK_READY /
 * LINK_PAGES (descriptors; the bytes go over the link). A reader decodes
 * with its own payload's kind (cs_kvx_limits.inline_pages) and refuses the
 * other kind's data frames. HELLO names the sender's payload (its payload
 * byte, enum cs_kvx_payload); the receiver refuses one it does not speak,
 * naming both.
 * Version 2: XXH3 payload checksums, trailer = fold of the chunk checksums.
 * Version 3: the trailer carries the first token's log-probabilities.
 * Version 4: the HELLO is authenticated by challenge-response over the
 * cluster secret (HELLO carries the sender's nonce; CHALLENGE the
 * receiver's nonce and proof; AUTH the sender's proof, see kvx-impl.h), and
 * the trailer carries a MAC under the session key over the transfer id and
 * the trailer (which holds the fold of every chunk's checksum). Before AUTH
 * is accepted a receiver reads nothing but HELLO and AUTH; before CHALLENGE
 * a sender writes nothing but HELLO.
 * Version 5: HELLO names the sender's payload in a byte of its own (was a
 * header flag for NCCL), the transcript binds it, and the frames of a
 * payload's own link are LINK_* (were NCCL_*; same numbers). */
#ifndef CS_KVX_WIRE_H
#define CS_KVX_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kvx.h"

#define CS_KVX_MAGIC 0x564b5343u /* "CSKV" */
#define CS_KVX_VERSION 5
#define CS_KVX_HDR_BYTES 64
#define CS_KVX_FLAG_CHECKSUM 1u
#define CS_KVX_NAME_MAX 64

enum cs_kvx_frame_type {
    CS_KVX_HELLO = 1,     /* tx -> rx: layout, name; epoch = tx incarnation */
    CS_KVX_HELLO_ACK = 2, /* rx -> tx: status, message; epoch = rx incarnation */
    CS_KVX_PAGES = 3,     /* tx -> rx: n_pages pages from first_page */
    CS_KVX_TRAILER = 4,   /* tx -> rx */
    CS_KVX_ABORT = 5,     /* either way: status */
    CS_KVX_DONE = 6,      /* rx -> tx: the transfer's final status */
    CS_KVX_PING = 7,      /* either way, empty */
    CS_KVX_TYPE_MAX = 7,  /* the last type of a TCP channel */
    /* channels whose payload has a link of its own (NCCL) only: */
    CS_KVX_LINK_ID = 8,    /* tx -> rx: the link's id (NCCL: the communicator's ncclUniqueId) */
    CS_KVX_LINK_READY = 9, /* rx -> tx: ACK payload: link ready (0) or why not; n_pages =
                              receiver's chunk limit in pages */
    CS_KVX_LINK_PAGES =
        10, /* tx -> rx: chunk descriptor: pages first_page + n_pages follow over the link */
    CS_KVX_LINK_TYPE_MAX = 10,
    /* both payloads: the handshake */
    CS_KVX_CHALLENGE = 11, /* rx -> tx: rx nonce, rx proof; epoch = rx incarnation */
    CS_KVX_AUTH = 12,      /* tx -> rx: tx proof */
    CS_KVX_LAST_TYPE = 12
};

#define CS_KVX_NONCE_BYTES 16
#define CS_KVX_PROOF_BYTES 32
#define CS_KVX_MAC_BYTES 16
/* layout (32) + name (64) + sender nonce (16) + payload (1) + zero (7) */
#define CS_KVX_HELLO_BYTES 120
#define CS_KVX_CHALLENGE_BYTES (CS_KVX_NONCE_BYTES + CS_KVX_PROOF_BYTES)
#define CS_KVX_AUTH_BYTES CS_KVX_PROOF_BYTES
#define CS_KVX_ACK_BYTES 128 /* status i32, pad, message (120) */
/* TRAILER: 0 first_token, 4 prompt_len, 8 total_pages, 12 n_top (<= 20),
 * 16 fold of the chunk checksums u64, 24 first_logprob f32, 28 n_cached, 32 n_top
 * pairs (id i32, logprob f32), the rest zero; then the MAC (16) over the
 * bytes before it (CS_KVX_TRAILER_MAC_AT) */
#define CS_KVX_TRAILER_MAC_AT (32 + 8 * CS_KVX_MAX_TOP)
#define CS_KVX_TRAILER_BYTES (CS_KVX_TRAILER_MAC_AT + CS_KVX_MAC_BYTES)
#define CS_KVX_CTRL_MAX_BYTES CS_KVX_TRAILER_BYTES /* the largest control payload */
#define CS_KVX_STATUS_BYTES 8                      /* status i32, pad (ABORT, DONE) */
#define CS_KVX_LINK_ID_BYTES 128                   /* ncclUniqueId, opaque */
#define CS_KVX_LINK_DESC_BYTES 24                  /* bytes u64, sum u64, flags u32, pad */
#define CS_KVX_DESC_SUM 1u /* descriptor flag: sum holds the device sum of the chunk */

typedef struct {
    uint16_t version, type;
    uint32_t flags;
    uint64_t epoch, xfer_id;
    uint32_t first_page, n_pages;
    uint64_t fingerprint, payload_len, payload_xxh64;
} cs_kvx_hdr;

typedef struct {
    cs_kvx_layout layout;
    char name[CS_KVX_NAME_MAX]; /* NUL-terminated on decode */
    uint8_t nonce[CS_KVX_NONCE_BYTES];
    uint8_t payload; /* enum cs_kvx_payload: how the sender moves page bytes */
} cs_kvx_hello;

typedef struct {
    uint8_t nonce[CS_KVX_NONCE_BYTES];
    uint8_t proof[CS_KVX_PROOF_BYTES];
} cs_kvx_challenge;

typedef struct {
    cs_kvx_trailer t;
    uint64_t xxh64; /* cs__kvx_fold of every chunk's checksum, in order */
    uint8_t mac[CS_KVX_MAC_BYTES];
} cs_kvx_trailer_wire;

/* A LINK_PAGES payload: what the link's send that follows carries. */
typedef struct {
    uint64_t bytes; /* n_pages * page_bytes */
    uint64_t sum;   /* KV sum of those bytes (kvx-impl.h), when flags & CS_KVX_DESC_SUM */
    uint32_t flags;
} cs_kvx_link_desc;

/* What the reader accepts: page_bytes of its layout, its largest payload
 * (link channels: the largest chunk of pages, in bytes), its payload's
 * kind. */
typedef struct {
    uint64_t page_bytes;
    uint64_t max_payload;
    bool inline_pages; /* PAGES frames carry the bytes (TCP); else LINK_* frames */
} cs_kvx_limits;

void cs_kvx_hdr_encode(const cs_kvx_hdr *h, uint8_t out[CS_KVX_HDR_BYTES]);
/* 0, or CS_EBADMSG / CS_EPROTO with a message in err: bad magic, version,
 * header checksum, flags, a type the channel's payload does not carry
 * (PAGES on link channels, LINK_* on inline ones), or a payload length that does
 * not fit the type (PAGES: n_pages >= 1 and payload_len == n_pages *
 * page_bytes <= max_payload; LINK_PAGES: n_pages >= 1 and n_pages *
 * page_bytes <= max_payload). */
int cs_kvx_hdr_decode(const uint8_t in[CS_KVX_HDR_BYTES], const cs_kvx_limits *lim, cs_kvx_hdr *h,
                      char *err, size_t errlen);
/* Payload checksum check (when flagged); CS_EBADMSG on mismatch. */
int cs_kvx_payload_check(const cs_kvx_hdr *h, const void *payload, bool require_checksum, char *err,
                         size_t errlen);

void cs_kvx_hello_encode(const cs_kvx_hello *m, uint8_t out[CS_KVX_HELLO_BYTES]);
int cs_kvx_hello_decode(const uint8_t *in, size_t len, cs_kvx_hello *m, char *err, size_t errlen);
void cs_kvx_challenge_encode(const cs_kvx_challenge *m, uint8_t out[CS_KVX_CHALLENGE_BYTES]);
int cs_kvx_challenge_decode(const uint8_t *in, size_t len, cs_kvx_challenge *m, char *err,
                            size_t errlen);
void cs_kvx_ack_encode(int32_t status, const char *msg, uint8_t out[CS_KVX_ACK_BYTES]);
int cs_kvx_ack_decode(const uint8_t *in, size_t len, int32_t *status, char *msg, size_t msglen);
void cs_kvx_trailer_encode(const cs_kvx_trailer_wire *t, uint8_t out[CS_KVX_TRAILER_BYTES]);
int cs_kvx_trailer_decode(const uint8_t *in, size_t len, cs_kvx_trailer_wire *t, char *err,
                          size_t errlen);
void cs_kvx_status_encode(int32_t status, uint8_t out[CS_KVX_STATUS_BYTES]);
int cs_kvx_status_decode(const uint8_t *in, size_t len, int32_t *status, char *err, size_t errlen);
void cs_kvx_link_desc_encode(const cs_kvx_link_desc *d, uint8_t out[CS_KVX_LINK_DESC_BYTES]);
/* Checks bytes == h->n_pages * page_bytes and the flags. CS_EBADMSG. */
int cs_kvx_link_desc_decode(const uint8_t *in, size_t len, const cs_kvx_hdr *h, uint64_t page_bytes,
                            cs_kvx_link_desc *d, char *err, size_t errlen);

/* XXH3-64 of a payload (the header's payload_xxh64). */
uint64_t cs_kvx_payload_sum(const void *payload, size_t len);

/* Decodes a whole byte stream of frames as a reader of lim->payload would,
 * stopping at the first error (for the fuzzer and the malformed-frame tests).
 * Returns the number of frames decoded, or a negative status. */
int cs_kvx_decode_stream(const uint8_t *buf, size_t len, const cs_kvx_limits *lim, char *err,
                         size_t errlen);

const char *cs_kvx_frame_type_name(int type);

#endif
