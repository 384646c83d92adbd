/* kvx_tx-impl.h: inside the KV transport's sender (internal), shared by
 * its two files:
 *  - kvx_tx_chan.c: a channel, one TCP connection to a receiver and its
 *    payload link: connect (HELLO, LINK_ID), the sender's handshake step
 *    (CHALLENGE -> AUTH, kvx_handshake.c), the queue of frames and its
 *    writes, the frames read back (HELLO_ACK, LINK_READY, PING, DONE,
 *    ABORT), close and the teardown of closed links;
 *  - kvx_tx.c: the transfers: the public API, chunks and trailers queued
 *    per channel, staging slots (pack -> frame -> send), deadlines,
 *    renewals, backpressure, the events reported after unlocking, and the
 *    I/O thread that drives channels and transfers.
 * Everything here runs under cs_kvx_tx.mu, on the I/O thread unless a
 * comment says otherwise. */
#ifndef CS_KVX_TX_IMPL_H
#define CS_KVX_TX_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kvx.h"
#include "kvx-impl.h"

enum chan_state { CH_IDLE, CH_CONNECTING, CH_OPEN };
/* PACKING -> PACKED -> QUEUED (its frame in the out queue) -> SENDING -> FREE */
enum slot_state { SL_FREE, SL_PACKING, SL_PACKED, SL_QUEUED, SL_SENDING };
enum item_kind { IT_CHUNK, IT_TRAILER };

/* One successful cs_kvx_tx_send_pages: its ids, referenced by its chunks. */
typedef struct tx_send {
    int refs;
    struct tx_event *ev; /* its release, allocated with it: a release is never lost */
    cs_kvx_release_fn release;
    void *arg;
    int32_t n;
    int32_t ids[]; /* (n) owned copy of the page ids */
} tx_send;

struct tx_xfer;

typedef struct tx_item {
    struct tx_item *next;
    int kind;
    struct tx_xfer *x; /* NULL once the transfer ended */
    int32_t first_page, n_pages;
    const int32_t *ids; /* into send->ids */
    tx_send *send;      /* reference, handed to the slot when packed */
    cs_kvx_trailer t;
    int slot; /* -1 until packed into a slot */
} tx_item;

typedef struct {
    int state;
    tx_item *item; /* PACKING, PACKED: the chunk (still in the FIFO) */
    tx_send *send; /* reference while the pages may still be read */
    const int32_t *ids;
    int32_t first_page, n_pages;
    size_t bytes;
    uint64_t sum;
    int64_t since; /* start of the running operation (op timeout) */
} tx_slot;

typedef struct tx_chan {
    struct tx_chan *next;
    char host[256];
    int port;
    int fd;
    enum chan_state state;
    bool acked;                        /* HELLO_ACK received */
    bool authed;                       /* CHALLENGE checked, AUTH queued: the session key is set */
    uint64_t peer_inc;                 /* receiver incarnation from the CHALLENGE */
    uint8_t nonce[CS_KVX_NONCE_BYTES]; /* this channel's HELLO nonce */
    uint8_t session[32];
    kvx_key key;  /* the one the session came from (authed) */
    bool retired; /* that key was rotated out: no new transfer; closed and freed
                     once its last one ended (cs_kvx_tx_set_secret) */
    kvx_out *qhead, *qtail;
    int64_t last_rx, last_tx;
    uint8_t in[CS_KVX_HDR_BYTES + CS_KVX_ACK_BYTES]; /* incoming control frame */
    size_t in_len;
    int n_xfers;
    size_t queued_bytes; /* page bytes accepted and not yet handed on (backpressure) */
    /* payload link: one per TCP connection */
    cs__kvx_link *link;
    struct tx_grave *grave; /* made with link: closing it needs no memory */
    bool oom;               /* a frame could not be allocated: close at the next look */
    bool local_ready, peer_ready;
    int64_t init_deadline;
    tx_item *ihead, *itail;
    tx_slot *slots;
} tx_chan;

typedef struct tx_xfer {
    struct tx_xfer *next;
    uint64_t id;
    tx_chan *ch;
    int32_t total_pages, queued_pages;
    bool trailer_queued, want_room;
    int64_t deadline;
    int64_t renewed; /* when its last renewal (PING naming it) was queued */
    int fail;        /* pending failure set by an API call (abort) */
    cs_kvx_done_fn done;
    void *arg;
    uint64_t digest;     /* fold of the chunk checksums, in order */
    struct tx_event *ev; /* its end, allocated with it: a completion is never lost */
} tx_xfer;

/* A finished transfer, a released send or room, reported after unlocking. */
typedef struct tx_event {
    struct tx_event *next;
    cs_kvx_done_fn done;
    cs_kvx_room_fn room;
    void *arg;
    uint64_t id;
    int status;
    char msg[200];
    tx_send *send; /* release, then free */
} tx_event;

/* A closed link waiting to be torn down without the mutex, with the sends
 * whose pages its operations may still read. */
typedef struct tx_grave {
    struct tx_grave *next;
    cs__kvx_link *link;
    tx_send **sends;
    int n_sends;
} tx_grave;

struct cs_kvx_tx {
    cs_kvx_tx_params p;
    kvx_keys keys; /* the cluster secret (under mu: cs_kvx_tx_set_secret) */
    const cs__kvx_payload *pl;
    char name[CS_KVX_NAME_MAX];
    uint64_t fingerprint;
    int32_t slot_pages;
    pthread_mutex_t mu;
    pthread_t thread;
    int wake[2];
    bool stop;
    tx_chan *chans;
    tx_xfer *xfers;
    tx_event *ev_head, *ev_tail;
    tx_grave *grave;
    cs_kvx_stats st;
};

/* ------------------------------------------------- kvx_tx_chan.c */

/* A frame for ch, or NULL with ch marked to close (ENOMEM) at the I/O
 * thread's next look at it: a frame is never silently lost. */
kvx_out *cs__tx_new_out(tx_chan *ch);
void cs__tx_enqueue(tx_chan *ch, kvx_out *o); /* at the tail of ch's frames */
/* A control frame at the tail of ch's frames (none when out of memory: ch
 * then closes). */
void cs__tx_queue_ctl(cs_kvx_tx *tx, tx_chan *ch, int type, uint64_t xfer, const void *pl,
                      size_t len);
tx_chan *cs__tx_find_chan(cs_kvx_tx *tx, const char *host, int port);
/* Connects (non-blocking), opens the link and queues HELLO (and LINK_ID).
 * Drops the mutex around the address lookup and the link's allocation. */
int cs__tx_chan_connect(cs_kvx_tx *tx, tx_chan *ch);
/* Closes the connection and the link (torn down later by cs__tx_bury,
 * without the mutex), fails every transfer of the channel, releases its
 * slots and items. */
void cs__tx_chan_close(cs_kvx_tx *tx, tx_chan *ch, int status, const char *msg);
void cs__tx_bury(cs_kvx_tx *tx); /* tears closed links down, dropping the mutex */
/* Link open on both ends and the receiver authenticated: data may go. */
bool cs__tx_link_ready(const tx_chan *ch);
/* Whether the head frame may go out (before the CHALLENGE: HELLO only). */
bool cs__tx_head_writable(const tx_chan *ch);
void cs__tx_chan_write(cs_kvx_tx *tx, tx_chan *ch); /* the frames, while the socket takes them */
void cs__tx_chan_read(cs_kvx_tx *tx, tx_chan *ch);  /* the receiver's frames, acted on */

/* ------------------------------------------------------ kvx_tx.c */

tx_xfer *cs__tx_find_xfer(cs_kvx_tx *tx, uint64_t id);
/* Ends x (reported after unlocking) and drops its frames not yet begun. */
void cs__tx_xfer_end(cs_kvx_tx *tx, tx_xfer *x, int status, const char *msg);
void cs__tx_send_unref(cs_kvx_tx *tx, tx_send *s); /* the last one releases the pages */
void cs__tx_item_pop(tx_chan *ch);                 /* unlinks the head item */
/* Frees an item that never became a frame: its pages leave the queue. */
void cs__tx_item_drop(cs_kvx_tx *tx, tx_chan *ch, tx_item *it);
/* A data frame was fully written: the link sends its chunk (without the
 * mutex when the link does the sending). */
void cs__tx_post_send(cs_kvx_tx *tx, tx_chan *ch, tx_slot *sl);

#endif
