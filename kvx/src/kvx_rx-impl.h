/* kvx_rx-impl.h: inside the KV transport's receiver (internal), shared by
 * its two files:
 *  - kvx_rx_chan.c: a sender's channel: accept, the receiver's handshake
 *    steps (HELLO -> CHALLENGE, AUTH checked: kvx_handshake.c), the payload
 *    link opened on LINK_ID, the frames written back (HELLO_ACK,
 *    LINK_READY, PING, DONE, ABORT), failure and teardown;
 *  - kvx_rx.c: the transfers: the public API (expect, cancel), the frames
 *    that carry them (read, checked and dispatched there; pages landed
 *    inline or through the link's slots), completion, deadlines, the events
 *    reported after unlocking, and the I/O thread.
 * Everything here runs under cs_kvx_rx.mu, on the I/O thread unless a
 * comment says otherwise. */
#ifndef CS_KVX_RX_IMPL_H
#define CS_KVX_RX_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define XXH_INLINE_ALL /* XXH3 compiled in each file, with this build's vector unit */
#include <xxhash.h>

#include "chunkserve/kvx.h"
#include "kvx-impl.h"

#define N_PEERS 1024
#define N_OLD 4             /* replaced incarnations remembered per sender */
#define SCRATCH (64u << 10) /* discarded inline bytes land here */

enum comm_state { COMM_NONE, COMM_OPENING, COMM_INIT, COMM_READY };

struct rx_xfer;

/* A descriptor waiting for a free slot (NCCL). */
typedef struct rx_item {
    struct rx_item *next;
    uint64_t xfer_id; /* 0: the transfer already ended here: receive and drop */
    uint32_t first_page, n_pages;
    cs_kvx_link_desc d;
} rx_item;

typedef struct {
    bool busy;
    struct rx_xfer *x; /* the transfer whose pages the scatter writes, or NULL */
    uint32_t first_page, n_pages;
    cs_kvx_link_desc d;
    int64_t since;
} rx_slot;

typedef struct rx_conn {
    struct rx_conn *next;
    int fd;
    bool hello;        /* authenticated (AUTH checked): the channel is open */
    bool challenged;   /* HELLO checked, CHALLENGE sent: only AUTH may follow */
    kvx_transcript tr; /* the handshake's (set by HELLO) */
    kvx_key key;       /* the key CHALLENGE proved: AUTH must prove the same (a
                          rotation between the two keeps that key while the set
                          still holds it; else the channel is retired) */
    bool retired;      /* that key was rotated out (cs_kvx_rx_set_secret): closed once
                          no transfer may still come over it (kvx_rx.c retired_busy) */
    int64_t retired_at;
    uint8_t session[32];
    bool closing; /* closed at the next safe point */
    bool oom;     /* a control frame could not be allocated: fail it at the next look */
    char name[CS_KVX_NAME_MAX];
    char addr[64];
    uint64_t peer_inc;
    uint8_t hdr[CS_KVX_HDR_BYTES];
    size_t hdr_len;
    cs_kvx_hdr h; /* header of the frame being read, valid once hdr_len == 64 */
    uint8_t buf[CS_KVX_CTRL_MAX_BYTES]; /* control payloads: every one fits */
    size_t pl_len;                      /* payload bytes read of the current frame */
    /* inline PAGES being read: into x's pages (x NULL: into scratch) */
    struct rx_xfer *px;
    bool pages;
    XXH3_state_t hs;
    kvx_out *qhead, *qtail;
    int64_t last_rx, last_tx;
    int64_t opened; /* accepted at (ms): HELLO must come by opened + hello_timeout_ms */
    /* payload link (NCCL) */
    int comm;
    uint8_t id[CS_KVX_LINK_ID_BYTES];
    int64_t init_deadline;
    cs__kvx_link *link;
    struct rx_grave *grave; /* made with link: closing it needs no memory */
    rx_item *ihead, *itail;
    rx_slot *slots;
    int *order; /* busy slots in posting order (ring) */
    int ord_head, ord_n;
} rx_conn;

typedef struct rx_xfer {
    struct rx_xfer *next;
    uint64_t id;
    int32_t *ids;
    int32_t n_pages, described, landed, inflight;
    int64_t deadline;
    int32_t lease_ms;             /* deadline_ms of the expectation: what a renewal grants */
    rx_conn *conn;                /* bound on the first frame */
    char sender[CS_KVX_NAME_MAX]; /* "" = any authenticated sender */
    int fail;                     /* set by cs_kvx_rx_cancel */
    cs_kvx_done_fn done;
    void *arg;
    uint64_t digest; /* fold of the chunk checksums, in order */
    bool all_sums, trailer_seen;
    cs_kvx_trailer_wire tw;
    /* ended while a write into its pages was in flight */
    bool ended;
    int end_status;
    char end_msg[200];
    struct rx_event *ev; /* its end, allocated with it: a completion is never lost */
} rx_xfer;

typedef struct rx_event {
    struct rx_event *next;
    cs_kvx_done_fn done;
    void *arg;
    uint64_t id;
    int status;
    bool has_trailer;
    cs_kvx_trailer t;
    char msg[200];
} rx_event;

typedef struct rx_grave {
    struct rx_grave *next;
    cs__kvx_link *link;
    rx_slot *slots;
} rx_grave;

struct cs_kvx_rx {
    cs_kvx_rx_params p;
    kvx_keys keys; /* the cluster secret (under mu: cs_kvx_rx_set_secret) */
    const cs__kvx_payload *pl;
    char host[64];
    uint64_t fingerprint, inc;
    int32_t slot_pages;
    int lfd, port;
    pthread_mutex_t mu;
    pthread_t thread;
    int wake[2];
    bool stop;
    uint8_t *scratch;
    rx_conn *conns;
    int n_conns;
    rx_xfer *xfers;
    rx_xfer *zombies; /* ended, waiting for their in-flight writes */
    rx_event *ev_head, *ev_tail;
    rx_grave *grave;
    struct {
        char name[CS_KVX_NAME_MAX];
        uint64_t inc;             /* the current incarnation of that sender */
        uint64_t replaced[N_OLD]; /* incarnations a newer one replaced: refused */
        int n_replaced;
    } peers[N_PEERS];
    int n_peers;
    cs_kvx_stats st;
};

/* ------------------------------------------------- kvx_rx_chan.c */

/* A control frame at the tail of c's frames (none on a closing channel;
 * out of memory: c fails at the next look). */
void cs__rx_queue_ctl(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, uint32_t n_pages,
                      const void *pl, size_t len);
/* A DONE or ABORT for transfer xfer with its status. */
void cs__rx_queue_status(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, int status);
/* Best effort: a refusal's reason reaches the sender before the close,
 * behind the frames already queued (the HELLO_ACK must come first). */
void cs__rx_send_now(cs_kvx_rx *rx, rx_conn *c, int type, int32_t status, const char *msg);
void cs__rx_conn_write(cs_kvx_rx *rx, rx_conn *c); /* the frames, while the socket takes them */
/* Marks c for closing and fails the transfers bound to it (protocol: a
 * protocol error, counted). */
void cs__rx_conn_fail(cs_kvx_rx *rx, rx_conn *c, int status, const char *msg, bool protocol);
/* At the safe point: the link goes to the graveyard with its slots (their
 * transfers are reported once it is torn down). */
void cs__rx_conn_free(cs_kvx_rx *rx, rx_conn *c);
void cs__rx_bury(cs_kvx_rx *rx); /* tears closed links down, dropping the mutex */
/* The handshake's two frames: HELLO (admitted, answered with CHALLENGE) and
 * AUTH (verified; only then the channel opens and HELLO_ACK goes). */
void cs__rx_on_hello(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl);
void cs__rx_on_auth(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl);
/* Opens the link of a channel whose LINK_ID arrived (without the mutex:
 * staging allocation), then LINK_READY. */
void cs__rx_link_open(cs_kvx_rx *rx, rx_conn *c);
void cs__rx_do_accept(cs_kvx_rx *rx); /* the listening socket's newcomers */

/* ------------------------------------------------------ kvx_rx.c */

/* Ends x (removing it from the table); tells the bound sender when the end
 * is ours. Reports now, or once its in-flight writes finished. */
void cs__rx_xfer_end(cs_kvx_rx *rx, rx_xfer *x, int status, const char *msg,
                     const cs_kvx_trailer *t, bool tell_peer);
/* One in-flight write into a zombie's pages (it ended meanwhile) finished,
 * or its link was torn down; the last one reports the transfer. */
void cs__rx_zombie_release(cs_kvx_rx *rx, rx_xfer *x);

#endif
