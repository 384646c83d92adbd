/* kvx_rx.c: the KV transport's receiver: the control plane for every
 * payload. One I/O thread accepts senders' channels, validates every frame,
 * lands pages in the reserved page ids and reports each expected transfer
 * exactly once. A bad frame closes only its own channel (failing the
 * transfers bound to it); a transfer is bound to the channel of its first
 * frame. A well-formed frame for a transfer that is not live here (it
 * ended: deadline, cancel; or it was never expected) is no reason to close
 * a channel that carries others: its bytes are dropped, the sender gets an
 * ABORT for that id, and stats.stale_frames counts it.
 *
 * Page bytes land by the receiver's payload (kvx-impl.h):
 *  - TCP (inline): a PAGES header is checked first (transfer, order), then
 *    its payload is read straight into the reserved pages with readv and
 *    hashed as it arrives (XXH3, while the bytes are still in the cache);
 *    the checksum is compared at the frame's end. Bytes of a transfer that
 *    ended here are read into scratch and dropped.
 *  - NCCL: the link is created when LINK_ID arrives (rank 1, non-blocking
 *    init polled by this thread, bounded by init_timeout_ms) and LINK_READY
 *    tells the sender the outcome. Every LINK_PAGES descriptor, in arrival
 *    order, gets exactly one receive posted into a free staging slot, also
 *    for a transfer that already ended here (the bytes are then dropped), so
 *    the two ranks' operations stay matched; a received chunk is scattered
 *    into the reserved ids and summed on the device; chunks complete in
 *    posting order.
 * A transfer completes when its trailer came and its last chunk landed. One
 * that ends while a write into its pages may still run (cancel, deadline,
 * broken channel) reports only once that write finished or its link was
 * torn down, so its pages are free to reuse when done runs. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* XXH3 compiled here, with this build's vector unit */
#include <xxhash.h>

#include "chunkserve/kvx.h"
#include "kvx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/secret.h"

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
    kvx_key key; /* the cluster secret */
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

cs_kvx_rx_params cs_kvx_rx_params_default(void) {
    cs_kvx_rx_params p;
    memset(&p, 0, sizeof p);
    p.host = "127.0.0.1";
    p.require_checksum = true;
    p.keepalive_ms = 1000;
    p.dead_ms = 5000;
    p.max_conns = 256;
    p.hello_timeout_ms = 3000;
    p.max_pending = 64;
    p.max_pending_per_addr = 16;
    p.n_slots = 2;
    p.init_timeout_ms = 30000;
    p.op_timeout_ms = 10000;
    return p; /* max_frame_bytes 0: the payload's default */
}

static void queue_ctl(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, uint32_t n_pages,
                      const void *pl, size_t len) {
    if (c->fd < 0 || c->closing) return;
    kvx_out *o = calloc(1, sizeof *o);
    if (!o) { /* never silently lost: the channel fails at the I/O thread's next look */
        c->oom = true;
        return;
    }
    cs__kvx_out_ctl(o, type, rx->inc, xfer, rx->fingerprint, pl, len);
    if (n_pages) {
        o->h.n_pages = n_pages;
        cs_kvx_hdr_encode(&o->h, o->hdr);
    }
    if (c->qtail)
        c->qtail->next = o;
    else
        c->qhead = o;
    c->qtail = o;
}

static void queue_status(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, int status) {
    uint8_t pl[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(status, pl);
    queue_ctl(rx, c, type, xfer, 0, pl, sizeof pl);
}

static rx_xfer *find_xfer(cs_kvx_rx *rx, uint64_t id) {
    for (rx_xfer *x = rx->xfers; x; x = x->next)
        if (x->id == id) return x;
    return NULL;
}

static void report(cs_kvx_rx *rx, rx_xfer *x, int status, const char *msg,
                   const cs_kvx_trailer *t) {
    rx_event *e = x->ev;
    e->done = x->done;
    e->arg = x->arg;
    e->id = x->id;
    e->status = status;
    if (t) e->has_trailer = true, e->t = *t;
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "");
    if (rx->ev_tail)
        rx->ev_tail->next = e;
    else
        rx->ev_head = e;
    rx->ev_tail = e;
    free(x->ids);
    free(x);
}

/* Ends x (removing it from the table); tells the bound sender when the end
 * is ours. Reports now, or once its in-flight writes finished. */
static void xfer_end(cs_kvx_rx *rx, rx_xfer *x, int status, const char *msg,
                     const cs_kvx_trailer *t, bool tell_peer) {
    for (rx_xfer **pp = &rx->xfers; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    for (rx_conn *c = rx->conns; c; c = c->next)
        if (c->px == x) c->px = NULL; /* the rest of its frame goes to scratch */
    if (tell_peer && x->conn)
        queue_status(rx, x->conn, status == 0 ? CS_KVX_DONE : CS_KVX_ABORT, x->id, status);
    rx->st.transfers_active--;
    if (status == 0)
        rx->st.transfers_completed++;
    else
        rx->st.transfers_failed++;
    if (status)
        CS_LOGW("kvx rx: transfer %llu failed: %s (%s)", (unsigned long long)x->id,
                cs_strerror(status), msg ? msg : "");
    if (x->inflight > 0) {
        x->ended = true;
        x->end_status = status;
        snprintf(x->end_msg, sizeof x->end_msg, "%s", msg ? msg : "");
        x->next = rx->zombies;
        rx->zombies = x;
        return;
    }
    report(rx, x, status, msg, t);
}

static void zombie_release(cs_kvx_rx *rx, rx_xfer *x) {
    if (--x->inflight > 0) return;
    for (rx_xfer **pp = &rx->zombies; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    report(rx, x, x->end_status, x->end_msg, NULL);
}

/* Marks c for closing and fails the transfers bound to it. */
static void conn_fail(cs_kvx_rx *rx, rx_conn *c, int status, const char *msg, bool protocol) {
    if (c->closing) return;
    if (protocol) {
        rx->st.protocol_errors++;
        CS_LOGW("kvx rx: closing channel from %s (%s): %s", c->name[0] ? c->name : "?", c->addr,
                msg);
    }
    c->closing = true;
    for (rx_xfer *x = rx->xfers, *nx; x; x = nx) {
        nx = x->next;
        if (x->conn == c) xfer_end(rx, x, status, msg, NULL, false);
    }
}

/* At the safe point: the link goes to the graveyard with its slots (their
 * transfers are reported once it is torn down). */
static void conn_free(cs_kvx_rx *rx, rx_conn *c) {
    if (c->fd >= 0) close(c->fd);
    rx->st.conns_closed++;
    while (c->qhead) {
        kvx_out *o = c->qhead;
        c->qhead = o->next;
        free(o);
    }
    while (c->ihead) {
        rx_item *it = c->ihead;
        c->ihead = it->next;
        free(it);
    }
    if (!c->link) free(c->grave);
    if (c->link) {
        rx_grave *g = c->grave;
        g->link = c->link;
        g->slots = c->slots;
        c->slots = NULL;
        g->next = rx->grave;
        rx->grave = g;
    }
    free(c->slots);
    free(c->order);
    free(c);
    rx->n_conns--;
}

static void bury(cs_kvx_rx *rx) {
    while (rx->grave) {
        rx_grave *g = rx->grave;
        rx->grave = g->next;
        pthread_mutex_unlock(&rx->mu);
        bool drained = rx->pl->close(g->link);
        pthread_mutex_lock(&rx->mu);
        if (!drained)
            CS_LOGE("kvx rx: a closed %s link did not drain: its staging is leaked", rx->pl->name);
        for (int i = 0; i < rx->p.n_slots; i++)
            if (g->slots[i].busy && g->slots[i].x) zombie_release(rx, g->slots[i].x);
        free(g->slots);
        free(g);
    }
}

static void conn_write(cs_kvx_rx *rx, rx_conn *c) {
    while (c->qhead && !c->closing) {
        int r = cs__kvx_out_write(c->fd, c->qhead);
        if (r < 0) {
            conn_fail(rx, c, CS_ECONNRESET, "write to the sender failed", false);
            return;
        }
        if (r == 0) return;
        c->last_tx = cs__kvx_now_ms();
        kvx_out *o = c->qhead;
        c->qhead = o->next;
        if (!c->qhead) c->qtail = NULL;
        free(o);
    }
}

/* Best effort: a refusal's reason reaches the sender before the close,
 * behind the frames already queued (the HELLO_ACK must come first). */
static void send_now(cs_kvx_rx *rx, rx_conn *c, int type, int32_t status, const char *msg) {
    if (c->fd < 0 || c->closing) return;
    while (c->qhead && cs__kvx_out_write(c->fd, c->qhead) == 1) {
        kvx_out *o = c->qhead;
        c->qhead = o->next;
        if (!c->qhead) c->qtail = NULL;
        free(o);
    }
    if (c->qhead) return;
    uint8_t ack[CS_KVX_ACK_BYTES];
    cs_kvx_ack_encode(status, msg, ack);
    kvx_out o;
    memset(&o, 0, sizeof o);
    cs__kvx_out_ctl(&o, type, rx->inc, 0, rx->fingerprint, ack, sizeof ack);
    (void)cs__kvx_out_write(c->fd, &o);
}

static void refuse(cs_kvx_rx *rx, rx_conn *c, const char *err) {
    send_now(rx, c, CS_KVX_HELLO_ACK, CS_ECONNREFUSED, err);
    conn_fail(rx, c, CS_ECONNREFUSED, err, true);
}

static void on_hello(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[256];
    cs_kvx_hello m;
    int r = cs_kvx_hello_decode(pl, (size_t)h->payload_len, &m, err, sizeof err);
    if (r) {
        conn_fail(rx, c, r, err, true);
        return;
    }
    const cs__kvx_hs_receiver me = {rx->pl->kind, &rx->p.layout, rx->inc, rx->fingerprint};
    if (cs__kvx_hs_admit(&me, h, &m, err, sizeof err)) {
        refuse(rx, c, err);
        return;
    }
    /* Challenge: the sender must prove the secret over both nonces before
     * anything about the channel changes (fencing comes after its AUTH). */
    uint8_t pl2[CS_KVX_CHALLENGE_BYTES];
    cs__kvx_hs_challenge(&rx->key, &me, h, &m, &c->tr, pl2);
    c->challenged = true;
    queue_ctl(rx, c, CS_KVX_CHALLENGE, 0, 0, pl2, sizeof pl2);
}

/* The sender's AUTH: its proof of the secret over the transcript. Only then
 * does its HELLO count: fencing, the channel's name, the ACK. */
static void on_auth(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[256];
    if (!cs__kvx_hs_verify(&rx->key, &c->tr, h, pl, c->session)) {
        snprintf(err, sizeof err,
                 "authentication failed: the sender at %s (named %s) does not hold this "
                 "cluster's secret",
                 c->addr, c->tr.name);
        CS_LOGW("kvx rx: %s", err);
        send_now(rx, c, CS_KVX_HELLO_ACK, CS_ECONNREFUSED, "authentication failed");
        conn_fail(rx, c, CS_ECONNREFUSED, err, true);
        return;
    }
    const char *name = c->tr.name;
    /* Fencing: a new incarnation of a sender replaces its current channel
     * (its half-open connection may not have seen EOF yet); an incarnation
     * that was replaced is refused. Incarnations are random (no order):
     * "replaced" is what makes one stale. */
    int slot = -1;
    for (int i = 0; i < rx->n_peers; i++)
        if (strcmp(rx->peers[i].name, name) == 0) slot = i;
    for (int i = 0; slot >= 0 && i < rx->peers[slot].n_replaced; i++)
        if (rx->peers[slot].replaced[i] == h->epoch) {
            snprintf(err, sizeof err, "stale incarnation %llx of sender %s (replaced by %llx)",
                     (unsigned long long)h->epoch, name, (unsigned long long)rx->peers[slot].inc);
            refuse(rx, c, err);
            return;
        }
    for (rx_conn *o = rx->conns; o; o = o->next)
        if (o != c && o->hello && !o->closing && strcmp(o->name, name) == 0 &&
            o->peer_inc != h->epoch) {
            snprintf(err, sizeof err, "sender %s reconnected (incarnation %llx replaces %llx)",
                     name, (unsigned long long)h->epoch, (unsigned long long)o->peer_inc);
            conn_fail(rx, o, CS_ECONNRESET, err, false);
        }
    if (slot < 0 && rx->n_peers < N_PEERS) slot = rx->n_peers++;
    if (slot < 0) slot = (int)(h->epoch % N_PEERS);
    if (strcmp(rx->peers[slot].name, name)) { /* a new name (or a reused slot) */
        memset(&rx->peers[slot], 0, sizeof rx->peers[slot]);
        snprintf(rx->peers[slot].name, sizeof rx->peers[slot].name, "%s", name);
    } else if (rx->peers[slot].inc != h->epoch) {
        int k = rx->peers[slot].n_replaced;
        if (k == N_OLD) {
            memmove(rx->peers[slot].replaced, rx->peers[slot].replaced + 1,
                    (N_OLD - 1) * sizeof rx->peers[slot].replaced[0]);
            k--;
        }
        rx->peers[slot].replaced[k] = rx->peers[slot].inc;
        rx->peers[slot].n_replaced = k + 1;
    }
    rx->peers[slot].inc = h->epoch;
    snprintf(c->name, sizeof c->name, "%s", name);
    c->peer_inc = h->epoch;
    c->hello = true;
    CS_LOGI("kvx rx: channel from %s (%s) open, %s payload", c->name, c->addr, rx->pl->name);
    uint8_t ack[CS_KVX_ACK_BYTES];
    cs_kvx_ack_encode(0, "ok", ack);
    queue_ctl(rx, c, CS_KVX_HELLO_ACK, 0, 0, ack, sizeof ack);
}

/* Checks every frame of an accepted channel shares: HELLO first, the
 * channel's incarnation, the layout. false when c is closing. */
static bool frame_admissible(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h) {
    char err[256];
    if (!c->hello) {
        if (h->type == (c->challenged ? CS_KVX_AUTH : CS_KVX_HELLO)) return true;
        snprintf(err, sizeof err, "%s frame before %s", cs_kvx_frame_type_name(h->type),
                 c->challenged ? "AUTH" : "HELLO");
        conn_fail(rx, c, CS_EPROTO, err, true);
        return false;
    }
    if (h->epoch != c->peer_inc) {
        snprintf(err, sizeof err, "%s frame from incarnation %llx on a channel of incarnation %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->epoch,
                 (unsigned long long)c->peer_inc);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return false;
    }
    if (h->fingerprint != rx->fingerprint) {
        snprintf(err, sizeof err, "%s frame with layout fingerprint %llx, expected %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->fingerprint,
                 (unsigned long long)rx->fingerprint);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return false;
    }
    return true;
}

/* The transfer a data frame or trailer of c is for: bound to c, NULL with
 * *dropped when it is not live here (ended, or never expected: dropped,
 * answered with ABORT, counted), NULL with c closing otherwise (another
 * sender's or another channel's transfer). */
static rx_xfer *frame_xfer(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, bool *dropped) {
    *dropped = false;
    rx_xfer *x = find_xfer(rx, h->xfer_id);
    char err[256];
    if (x && !x->conn && x->sender[0] && strcmp(x->sender, c->name) != 0) {
        snprintf(err, sizeof err, "%s frame for transfer %llu from %s; it is expected from %s",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->xfer_id, c->name,
                 x->sender);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return NULL;
    }
    if (x && (!x->conn || x->conn == c)) {
        x->conn = c;
        return x;
    }
    if (!x) { /* ended here (deadline, cancel) while frames were in flight, or never expected */
        if (h->type != CS_KVX_ABORT) queue_status(rx, c, CS_KVX_ABORT, h->xfer_id, CS_ECANCELED);
        rx->st.stale_frames++;
        *dropped = true;
        return NULL;
    }
    snprintf(err, sizeof err, "%s frame for another channel's transfer %llu",
             cs_kvx_frame_type_name(h->type), (unsigned long long)h->xfer_id);
    conn_fail(rx, c, CS_EPROTO, err, true);
    return NULL;
}

/* A data chunk (either payload) of pages first+n of x is announced: in order? */
static bool chunk_in_order(cs_kvx_rx *rx, rx_conn *c, rx_xfer *x, const cs_kvx_hdr *h) {
    if (h->first_page == (uint32_t)x->described &&
        h->n_pages <= (uint32_t)(x->n_pages - x->described))
        return true;
    char err[256];
    snprintf(err, sizeof err, "transfer %llu: pages %u+%u, expected from %d of %d reserved",
             (unsigned long long)x->id, h->first_page, h->n_pages, x->described, x->n_pages);
    conn_fail(rx, c, CS_EPROTO, err, true);
    return false;
}

static void try_complete(cs_kvx_rx *rx, rx_xfer *x) {
    if (!x->trailer_seen || x->landed != x->n_pages) return;
    if (x->all_sums && x->tw.xxh64 != x->digest) {
        char err[200];
        snprintf(err, sizeof err, "transfer %llu: checksum of all chunks mismatch",
                 (unsigned long long)x->id);
        conn_fail(rx, x->conn, CS_EBADMSG, err, true);
        return;
    }
    cs_kvx_trailer t = x->tw.t;
    xfer_end(rx, x, 0, NULL, &t, true);
}

/* A chunk of x landed in its pages with checksum sum (when summed). */
static void chunk_landed(cs_kvx_rx *rx, rx_xfer *x, uint32_t n_pages, uint64_t bytes, bool summed,
                         uint64_t sum) {
    if (summed)
        cs__kvx_fold(&x->digest, sum);
    else
        x->all_sums = false;
    x->landed += (int32_t)n_pages;
    rx->st.bytes += bytes;
    try_complete(rx, x);
}

/* ------------------------------------------------------ inline (TCP) pages */

/* A PAGES header: where its payload goes (x's pages, or scratch). */
static void on_pages_header(cs_kvx_rx *rx, rx_conn *c) {
    const cs_kvx_hdr *h = &c->h;
    if (!frame_admissible(rx, c, h)) return;
    bool dropped;
    rx_xfer *x = frame_xfer(rx, c, h, &dropped);
    if (!x && !dropped) return;
    if (x && !chunk_in_order(rx, c, x, h)) return;
    if (x) x->described += (int32_t)h->n_pages;
    c->pages = true;
    c->px = x;
    XXH3_64bits_reset(&c->hs);
}

/* Reads what the socket has of the current PAGES payload into its pages. */
static ssize_t read_pages(cs_kvx_rx *rx, rx_conn *c) {
    enum { MAXV = 64 };
    struct iovec iov[MAXV];
    int n = 0;
    size_t left = (size_t)c->h.payload_len - c->pl_len;
    if (!c->px) {
        iov[0].iov_base = rx->scratch;
        iov[0].iov_len = left < SCRATCH ? left : SCRATCH;
        n = 1;
    } else {
        size_t pb = (size_t)rx->p.layout.page_bytes, off = c->pl_len;
        const int32_t *ids = c->px->ids + c->h.first_page;
        for (uint32_t i = (uint32_t)(off / pb); i < c->h.n_pages && n < MAXV; i++) {
            size_t skip = i == off / pb ? off % pb : 0;
            iov[n].iov_base = (uint8_t *)rx->p.pool.base + (size_t)ids[i] * pb + skip;
            iov[n].iov_len = pb - skip;
            n++;
        }
    }
    ssize_t r = readv(c->fd, iov, n);
    if (r > 0 && (c->h.flags & CS_KVX_FLAG_CHECKSUM)) { /* hash while the bytes are in the cache */
        size_t k = (size_t)r;
        for (int i = 0; i < n && k; i++) {
            size_t len = iov[i].iov_len < k ? iov[i].iov_len : k;
            XXH3_64bits_update(&c->hs, iov[i].iov_base, len);
            k -= len;
        }
    }
    return r;
}

/* The whole PAGES payload was read. */
static void on_pages_end(cs_kvx_rx *rx, rx_conn *c) {
    const cs_kvx_hdr *h = &c->h;
    rx->st.frames++;
    rx_xfer *x = c->px;
    c->px = NULL;
    c->pages = false;
    bool summed = h->flags & CS_KVX_FLAG_CHECKSUM;
    if (!summed && rx->p.require_checksum) {
        conn_fail(rx, c, CS_EBADMSG, "kvx: PAGES frame without the required checksum", true);
        return;
    }
    uint64_t sum = summed ? XXH3_64bits_digest(&c->hs) : 0;
    if (summed && sum != h->payload_xxh64) {
        char err[256];
        snprintf(err, sizeof err,
                 "kvx: PAGES frame payload checksum mismatch (transfer %llu, pages %u+%u)",
                 (unsigned long long)h->xfer_id, h->first_page, h->n_pages);
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    if (x) chunk_landed(rx, x, h->n_pages, h->payload_len, summed, sum);
}

/* -------------------------------------------------- linked (NCCL) pages */

static void on_desc(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h) {
    char err[256];
    if (c->comm == COMM_NONE) {
        conn_fail(rx, c, CS_EPROTO, "LINK_PAGES before LINK_ID", true);
        return;
    }
    rx_item *it = calloc(1, sizeof *it);
    if (!it) {
        conn_fail(rx, c, CS_ENOMEM, "the receiver ran out of memory", false);
        return;
    }
    int r = cs_kvx_link_desc_decode(c->buf, (size_t)h->payload_len, h, rx->p.layout.page_bytes,
                                    &it->d, err, sizeof err);
    if (!r && rx->p.require_checksum && !(it->d.flags & CS_KVX_DESC_SUM)) {
        r = CS_EBADMSG;
        snprintf(err, sizeof err, "kvx: LINK_PAGES without the required checksum");
    }
    if (r) {
        free(it);
        conn_fail(rx, c, r, err, true);
        return;
    }
    it->first_page = h->first_page;
    it->n_pages = h->n_pages;
    bool dropped;
    rx_xfer *x = frame_xfer(rx, c, h, &dropped);
    if (!x && !dropped) {
        free(it);
        return;
    }
    if (x && !chunk_in_order(rx, c, x, h)) {
        free(it);
        return;
    }
    if (x) x->described += (int32_t)h->n_pages;
    it->xfer_id = x ? x->id : 0; /* 0: its bytes still come over the link, to be dropped */
    if (c->itail)
        c->itail->next = it;
    else
        c->ihead = it;
    c->itail = it;
}

/* Opens the link of a channel whose LINK_ID arrived (without the mutex:
 * staging allocation). */
static void link_open(cs_kvx_rx *rx, rx_conn *c) {
    cs__kvx_link_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = 1;
    cfg.pool = rx->p.pool;
    cfg.page_bytes = (size_t)rx->p.layout.page_bytes;
    cfg.n_slots = rx->p.n_slots;
    cfg.slot_pages = rx->slot_pages;
    cfg.op_timeout_ms = rx->p.op_timeout_ms;
    snprintf(cfg.name, sizeof cfg.name, "kvx %s->%s:%d", c->name, rx->host, rx->port);
    uint8_t id[CS_KVX_LINK_ID_BYTES];
    memcpy(id, c->id, sizeof id);
    char err[200] = "";
    cs__kvx_link *link = NULL;
    pthread_mutex_unlock(&rx->mu);
    int r = rx->pl->open(&cfg, id, &link, err, sizeof err);
    rx_grave *g = r ? NULL : calloc(1, sizeof *g); /* closing it will need no memory */
    if (!r && !g) {
        rx->pl->close(link);
        r = CS_ENOMEM;
        snprintf(err, sizeof err, "out of memory");
    }
    pthread_mutex_lock(&rx->mu);
    if (r) {
        char m[300];
        snprintf(m, sizeof m, "cannot open the %s link: %s", rx->pl->name, err);
        send_now(rx, c, CS_KVX_LINK_READY, r, m);
        conn_fail(rx, c, r, m, false);
        return;
    }
    c->link = link;
    c->grave = g;
    c->comm = COMM_INIT;
    c->init_deadline = cs__kvx_now_ms() + rx->p.init_timeout_ms;
}

static void slot_done(cs_kvx_rx *rx, rx_conn *c, rx_slot *sl, uint64_t sum) {
    rx_xfer *x = sl->x;
    sl->busy = false;
    sl->x = NULL;
    if (!x) return; /* dropped bytes of an ended transfer */
    if (x->ended) {
        zombie_release(rx, x);
        return;
    }
    x->inflight--;
    bool summed = sl->d.flags & CS_KVX_DESC_SUM;
    if (summed && sum != sl->d.sum) {
        char err[200];
        snprintf(
            err, sizeof err,
            "transfer %llu: %s chunk of pages %u+%u: checksum mismatch (%016llx, sent %016llx)",
            (unsigned long long)x->id, rx->pl->name, sl->first_page, sl->n_pages,
            (unsigned long long)sum, (unsigned long long)sl->d.sum);
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    chunk_landed(rx, x, sl->n_pages, sl->d.bytes, summed, sum);
}

/* Init progress, async errors, posting queued descriptors into free slots,
 * finished chunks (in posting order), operations past op_timeout_ms. */
static void link_poll(cs_kvx_rx *rx, rx_conn *c, int64_t now) {
    char err[200] = "", m[300];
    int r = rx->pl->state(c->link, err, sizeof err);
    if (r < 0) {
        snprintf(m, sizeof m, "%s link with %s failed: %s", rx->pl->name, c->name, err);
        if (c->comm != COMM_READY) send_now(rx, c, CS_KVX_LINK_READY, CS_ECONNRESET, m);
        conn_fail(rx, c, CS_ECONNRESET, m, false);
        return;
    }
    if (c->comm == COMM_INIT) {
        if (r == 0) {
            uint8_t ack[CS_KVX_ACK_BYTES];
            cs_kvx_ack_encode(0, "ok", ack);
            queue_ctl(rx, c, CS_KVX_LINK_READY, 0, (uint32_t)rx->slot_pages, ack, sizeof ack);
            c->comm = COMM_READY;
        } else if (now > c->init_deadline) {
            snprintf(m, sizeof m, "%s link with %s not ready after %d ms", rx->pl->name, c->name,
                     rx->p.init_timeout_ms);
            send_now(rx, c, CS_KVX_LINK_READY, CS_ETIMEDOUT, m);
            conn_fail(rx, c, CS_ETIMEDOUT, m, false);
            return;
        }
    }
    if (c->comm != COMM_READY) return;
    /* completions first: they free slots */
    while (c->ord_n > 0 && !c->closing) {
        int s = c->order[c->ord_head];
        rx_slot *sl = &c->slots[s];
        uint64_t sum = 0;
        r = rx->pl->query(c->link, s, &sum, err, sizeof err);
        if (r < 0) {
            snprintf(m, sizeof m, "%s receive from %s failed: %s", rx->pl->name, c->name, err);
            conn_fail(rx, c, CS_EIO, m, false);
            return;
        }
        if (r == 1) {
            if (now - sl->since > rx->p.op_timeout_ms) {
                snprintf(
                    m, sizeof m, "%s receive of a %llu-byte chunk from %s not complete after %d ms",
                    rx->pl->name, (unsigned long long)sl->d.bytes, c->name, rx->p.op_timeout_ms);
                conn_fail(rx, c, CS_ETIMEDOUT, m, false);
                return;
            }
            break;
        }
        c->ord_head = (c->ord_head + 1) % rx->p.n_slots;
        c->ord_n--;
        slot_done(rx, c, sl, sum);
    }
    while (c->ihead && !c->closing && c->ord_n < rx->p.n_slots) {
        int s = -1;
        for (int i = 0; i < rx->p.n_slots && s < 0; i++)
            if (!c->slots[i].busy) s = i;
        CS_ASSERT(s >= 0);
        rx_item *it = c->ihead;
        rx_xfer *x = it->xfer_id ? find_xfer(rx, it->xfer_id) : NULL;
        if (x && x->conn != c) x = NULL;
        bool sum = x && (it->d.flags & CS_KVX_DESC_SUM);
        /* without the mutex (ncclInProgress may be waited for): only this
         * thread touches the link, the items, and frees transfers */
        pthread_mutex_unlock(&rx->mu);
        r = rx->pl->recv(c->link, s, (size_t)it->d.bytes, x ? x->ids + it->first_page : NULL,
                         (int32_t)it->n_pages, sum, err, sizeof err);
        pthread_mutex_lock(&rx->mu);
        if (r) {
            snprintf(m, sizeof m, "%s receive from %s failed: %s", rx->pl->name, c->name, err);
            conn_fail(rx, c, r == CS_ETIMEDOUT ? r : CS_ECONNRESET, m, false);
            return;
        }
        c->ihead = it->next;
        if (!c->ihead) c->itail = NULL;
        c->slots[s] = (rx_slot){true, x, it->first_page, it->n_pages, it->d, now};
        if (!sum) c->slots[s].d.flags &= ~CS_KVX_DESC_SUM;
        if (x) x->inflight++;
        c->order[(c->ord_head + c->ord_n) % rx->p.n_slots] = s;
        c->ord_n++;
        free(it);
    }
}

/* ------------------------------------------------------------- frames */

/* A complete control frame (header c->h, payload c->buf). */
static void on_frame(cs_kvx_rx *rx, rx_conn *c) {
    const cs_kvx_hdr *h = &c->h;
    char err[256];
    int r = cs_kvx_payload_check(h, c->buf, false, err, sizeof err);
    if (r) {
        conn_fail(rx, c, r, err, true);
        return;
    }
    rx->st.frames++;
    if (!frame_admissible(rx, c, h)) return;
    if (!c->hello) {
        if (h->type == CS_KVX_HELLO)
            on_hello(rx, c, h, c->buf);
        else
            on_auth(rx, c, h, c->buf);
        return;
    }
    switch (h->type) {
    case CS_KVX_PING: { /* naming a transfer: its sender renews it */
        rx_xfer *x = h->xfer_id ? find_xfer(rx, h->xfer_id) : NULL;
        if (x && !x->fail &&
            (x->conn == c || (!x->conn && (!x->sender[0] || !strcmp(x->sender, c->name))))) {
            x->deadline = cs__kvx_now_ms() + x->lease_ms;
            rx->st.renewals++;
        }
        return;
    }
    case CS_KVX_LINK_ID:
        if (c->comm != COMM_NONE || !rx->pl->unique_id) {
            conn_fail(rx, c, CS_EPROTO, "unexpected LINK_ID on a channel", true);
            return;
        }
        memcpy(c->id, c->buf, sizeof c->id);
        c->comm = COMM_OPENING; /* opened by the loop, without the mutex */
        return;
    case CS_KVX_LINK_PAGES: on_desc(rx, c, h); return;
    case CS_KVX_ABORT:
    case CS_KVX_TRAILER: break;
    default:
        snprintf(err, sizeof err, "unexpected %s frame", cs_kvx_frame_type_name(h->type));
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    bool dropped;
    rx_xfer *x = frame_xfer(rx, c, h, &dropped);
    if (!x) return;
    if (h->type == CS_KVX_ABORT) {
        int32_t st;
        if (cs_kvx_status_decode(c->buf, (size_t)h->payload_len, &st, err, sizeof err)) {
            conn_fail(rx, c, CS_EBADMSG, err, true);
            return;
        }
        snprintf(err, sizeof err, "sender aborted the transfer (%s)", cs_strerror(st));
        xfer_end(rx, x, CS_ECANCELED, err, NULL, false);
        return;
    }
    /* TRAILER: every data frame came before it */
    cs_kvx_trailer_wire tw;
    if (cs_kvx_trailer_decode(c->buf, (size_t)h->payload_len, &tw, err, sizeof err)) {
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    if (x->trailer_seen || tw.t.total_pages != x->n_pages || x->described != x->n_pages) {
        snprintf(err, sizeof err,
                 "transfer %llu: trailer says %d pages, %d received of %d reserved",
                 (unsigned long long)x->id, tw.t.total_pages, x->described, x->n_pages);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    uint8_t mac[CS_KVX_MAC_BYTES];
    cs__kvx_trailer_mac(c->session, x->id, c->buf, mac);
    if (!cs_ct_equal(mac, tw.mac, sizeof mac)) {
        snprintf(err, sizeof err, "transfer %llu: the trailer's MAC does not match the session's",
                 (unsigned long long)x->id);
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    x->trailer_seen = true;
    x->tw = tw;
    try_complete(rx, x);
}

static void conn_read(cs_kvx_rx *rx, rx_conn *c) {
    cs_kvx_limits lim = {rx->p.layout.page_bytes, rx->p.max_frame_bytes, rx->pl->inline_pages};
    size_t budget = 16u << 20; /* per poll round, for fairness between channels */
    while (!c->closing && budget > 0) {
        ssize_t n;
        size_t want;
        if (c->hdr_len < CS_KVX_HDR_BYTES) {
            want = CS_KVX_HDR_BYTES - c->hdr_len;
            n = read(c->fd, c->hdr + c->hdr_len, want);
        } else if (c->pages) {
            want = (size_t)c->h.payload_len - c->pl_len;
            n = read_pages(rx, c);
        } else {
            want = (size_t)c->h.payload_len - c->pl_len;
            n = want ? read(c->fd, c->buf + c->pl_len, want) : 0;
        }
        if (want && n <= 0) {
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (n < 0 && errno == EINTR) continue;
            char m[160];
            if (c->hdr_len || c->pl_len)
                snprintf(m, sizeof m, "channel from %s closed inside a frame (truncated)",
                         c->name[0] ? c->name : c->addr);
            else
                snprintf(m, sizeof m, "sender %s closed the channel%s%s",
                         c->name[0] ? c->name : c->addr, n < 0 ? ": " : "",
                         n < 0 ? strerror(errno) : "");
            conn_fail(rx, c, CS_ECONNRESET, m, c->hdr_len || c->pl_len);
            return;
        }
        if (n > 0) {
            c->last_rx = cs__kvx_now_ms();
            budget = (size_t)n > budget ? 0 : budget - (size_t)n;
        }
        if (c->hdr_len < CS_KVX_HDR_BYTES) {
            c->hdr_len += (size_t)n;
            if (c->hdr_len < CS_KVX_HDR_BYTES) continue;
            char err[256];
            int r = cs_kvx_hdr_decode(c->hdr, &lim, &c->h, err, sizeof err);
            int first = c->challenged ? CS_KVX_AUTH : CS_KVX_HELLO;
            if (!r && !c->hello && c->h.type != first) { /* before any payload byte */
                r = CS_EPROTO;
                snprintf(err, sizeof err, "%s frame before %s", cs_kvx_frame_type_name(c->h.type),
                         cs_kvx_frame_type_name(first));
            }
            if (!r && c->h.type != CS_KVX_PAGES && c->h.payload_len > sizeof c->buf) {
                r = CS_EPROTO;
                snprintf(err, sizeof err, "%s frame from a sender",
                         cs_kvx_frame_type_name(c->h.type));
            }
            if (r) {
                conn_fail(rx, c, r, err, true);
                return;
            }
            c->pl_len = 0;
            if (c->h.type == CS_KVX_PAGES) {
                on_pages_header(rx, c);
                if (c->closing) return;
            }
        } else {
            c->pl_len += (size_t)n;
        }
        if (c->pl_len == c->h.payload_len) {
            if (c->pages)
                on_pages_end(rx, c);
            else
                on_frame(rx, c);
            c->hdr_len = 0;
            c->pl_len = 0;
        }
    }
}

static void run_events(cs_kvx_rx *rx) {
    rx_event *e = rx->ev_head;
    rx->ev_head = rx->ev_tail = NULL;
    pthread_mutex_unlock(&rx->mu);
    while (e) {
        rx_event *n = e->next;
        e->done(e->arg, e->id, e->status, e->msg, e->has_trailer ? &e->t : NULL);
        free(e);
        e = n;
    }
    pthread_mutex_lock(&rx->mu);
}

/* Before a newcomer from addr joins: connections that have not sent HELLO
 * are capped (max_pending in all, max_pending_per_addr from one address);
 * at a cap the oldest such connection goes, so idle or slow peers can
 * delay a real sender by one round trip but never lock it out. */
static void make_room(cs_kvx_rx *rx, const char *addr) {
    int all = 0, mine = 0;
    rx_conn *oldest = NULL, *oldest_mine = NULL;
    for (rx_conn *c = rx->conns; c; c = c->next) {
        if (c->hello || c->closing) continue;
        all++;
        if (!oldest || c->opened <= oldest->opened) oldest = c;
        if (!strcmp(c->addr, addr)) {
            mine++;
            if (!oldest_mine || c->opened <= oldest_mine->opened) oldest_mine = c;
        }
    }
    rx_conn *evict = mine >= rx->p.max_pending_per_addr ? oldest_mine
                     : all >= rx->p.max_pending         ? oldest
                                                        : NULL;
    if (evict) {
        rx->st.pending_evicted++;
        conn_fail(rx, evict, CS_ECONNRESET, "closed before its HELLO to make room", false);
    }
}

static void do_accept(cs_kvx_rx *rx) {
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(rx->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
        if (fd < 0) return;
        rx_conn *c = NULL; /* 64-byte aligned: the XXH3 state in it is */
        if (rx->n_conns < rx->p.max_conns && posix_memalign((void **)&c, 64, sizeof *c) == 0)
            memset(c, 0, sizeof *c);
        rx_slot *slots = c ? calloc((size_t)rx->p.n_slots, sizeof *slots) : NULL;
        int *order = c ? calloc((size_t)rx->p.n_slots, sizeof *order) : NULL;
        if (!c || !slots || !order || cs__kvx_set_socket_opts(fd) != 0) {
            CS_LOGW("kvx rx: refusing a channel (%d open)", rx->n_conns);
            free(c), free(slots), free(order);
            close(fd);
            continue;
        }
        c->fd = fd;
        c->slots = slots;
        c->order = order;
        char host[48] = "?";
        if (sa.ss_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, host, sizeof host);
        else if (sa.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, host, sizeof host);
        snprintf(c->addr, sizeof c->addr, "%s", host);
        c->last_rx = c->last_tx = c->opened = cs__kvx_now_ms();
        make_room(rx, c->addr);
        c->next = rx->conns;
        rx->conns = c;
        rx->n_conns++;
        rx->st.conns_opened++;
    }
}

static void *rx_thread(void *arg) {
    cs_kvx_rx *rx = arg;
    cs_log_set_role("kvx-rx");
    pthread_mutex_lock(&rx->mu);
    struct pollfd *pfds = NULL;
    rx_conn **pc = NULL;
    int cap = 0;
    while (!rx->stop) {
        int64_t now = cs__kvx_now_ms();
        int64_t wait = rx->p.keepalive_ms;
        bool busy = false;
        for (rx_xfer *x = rx->xfers, *nx; x; x = nx) {
            nx = x->next;
            if (x->fail)
                xfer_end(rx, x, x->fail, "canceled by the receiver", NULL, true);
            else if (now >= x->deadline)
                xfer_end(rx, x, CS_ETIMEDOUT, "receiver deadline expired", NULL, true);
            else if (x->deadline - now < wait)
                wait = x->deadline - now;
        }
        for (rx_conn **pp = &rx->conns; *pp;) {
            rx_conn *c = *pp;
            if (!c->closing && !c->hello && now - c->opened > rx->p.hello_timeout_ms) {
                char m[160];
                snprintf(m, sizeof m, "no HELLO from %s within %d ms", c->addr,
                         rx->p.hello_timeout_ms);
                conn_fail(rx, c, CS_ETIMEDOUT, m, true);
            }
            if (!c->closing && now - c->last_rx > rx->p.dead_ms) {
                char m[160];
                snprintf(m, sizeof m, "sender %s silent for %d ms", c->name[0] ? c->name : c->addr,
                         rx->p.dead_ms);
                conn_fail(rx, c, CS_ECONNRESET, m, false);
            }
            if (!c->closing && c->oom)
                conn_fail(rx, c, CS_ENOMEM, "the receiver ran out of memory for a frame", false);
            if (!c->closing && c->comm == COMM_OPENING) link_open(rx, c);
            if (!c->closing && c->link) link_poll(rx, c, now);
            if (c->closing) { /* the safe point: nothing refers to c any more */
                *pp = c->next;
                conn_free(rx, c);
                continue;
            }
            if (c->link && (c->comm != COMM_READY || c->ord_n || c->ihead)) busy = true;
            if (c->hello && !c->qhead && now - c->last_tx >= rx->p.keepalive_ms)
                queue_ctl(rx, c, CS_KVX_PING, 0, 0, NULL, 0);
            if (c->qhead) conn_write(rx, c);
            pp = &c->next;
        }
        /* report first: tearing a link down (ncclCommAbort, stream drain)
         * may take a while */
        if (rx->ev_head) {
            run_events(rx);
            continue;
        }
        if (rx->grave) {
            bury(rx);
            continue;
        }
        int n = 2;
        for (rx_conn *c = rx->conns; c; c = c->next)
            if (!c->hello && !c->closing && c->opened + rx->p.hello_timeout_ms - now < wait)
                wait = c->opened + rx->p.hello_timeout_ms - now;
        if (rx->n_conns + 2 > cap) {
            cap = 2 * (rx->n_conns + 2);
            pfds = realloc(pfds, (size_t)cap * sizeof *pfds);
            pc = realloc(pc, (size_t)cap * sizeof *pc);
            CS_ASSERT(pfds && pc);
        }
        pfds[0] = (struct pollfd){.fd = rx->wake[0], .events = POLLIN};
        pfds[1] = (struct pollfd){.fd = rx->lfd, .events = POLLIN};
        for (rx_conn *c = rx->conns; c; c = c->next) {
            pfds[n] = (struct pollfd){.fd = c->fd, .events = POLLIN | (c->qhead ? POLLOUT : 0)};
            pc[n++] = c;
        }
        pthread_mutex_unlock(&rx->mu);
        /* GPU work cannot wake poll(): while a link has work in flight, poll
         * it every 200 us. */
        struct timespec ts;
        if (busy)
            ts = (struct timespec){0, 200000};
        else
            ts = (struct timespec){(wait < 1 ? 1 : wait) / 1000,
                                   ((wait < 1 ? 1 : wait) % 1000) * 1000000L};
        int pr = ppoll(pfds, (nfds_t)n, &ts, NULL);
        pthread_mutex_lock(&rx->mu);
        if (pr < 0) continue;
        if (pfds[0].revents) cs__kvx_drain(rx->wake[0]);
        if (pfds[1].revents) do_accept(rx);
        for (int i = 2; i < n; i++) {
            rx_conn *c = pc[i];
            if (!pfds[i].revents || c->closing) continue;
            if (pfds[i].revents & (POLLIN | POLLERR | POLLHUP)) conn_read(rx, c);
            if (!c->closing && c->qhead) conn_write(rx, c);
        }
        run_events(rx);
    }
    pthread_mutex_unlock(&rx->mu);
    free(pfds);
    free(pc);
    return NULL;
}

int cs__kvx_rx_init_payload(const cs_kvx_rx_params *p, const cs__kvx_payload *pl, cs_kvx_rx **out) {
    *out = NULL;
    if (!p || !pl || p->layout.page_bytes == 0 || (!pl->inline_pages && p->layout.page_bytes % 8) ||
        p->keepalive_ms <= 0 || p->dead_ms <= p->keepalive_ms ||
        (p->max_frame_bytes && p->max_frame_bytes < p->layout.page_bytes) || p->max_conns < 1 ||
        p->port < 0 || p->port > 65535 || !p->pool.base || p->pool.n_pages < 1 ||
        p->pool.kind != pl->pool_kind || p->n_slots < 1 || p->n_slots > 64 ||
        p->init_timeout_ms <= 0 || p->op_timeout_ms <= 0 || p->hello_timeout_ms <= 0 ||
        p->max_pending < 1 || p->max_pending_per_addr < 1)
        return cs_fail(
            CS_EINVAL,
            "kvx rx: bad parameters (page_bytes (a multiple of 8 for NCCL), keepalive_ms < "
            "dead_ms, "
            "max_frame_bytes >= page_bytes, a pool of the payload's kind, n_slots, timeouts)");
    cs_kvx_rx *rx = calloc(1, sizeof *rx);
    if (!rx) return cs_fail(CS_ENOMEM, "kvx rx: out of memory");
    rx->p = *p;
    rx->pl = pl;
    rx->lfd = -1;
    snprintf(rx->host, sizeof rx->host, "%s", p->host ? p->host : "127.0.0.1");
    rx->p.host = rx->host;
    if (!rx->p.max_frame_bytes) rx->p.max_frame_bytes = pl->inline_pages ? 64u << 20 : 32u << 20;
    uint64_t per = rx->p.max_frame_bytes / p->layout.page_bytes;
    rx->slot_pages = per > (uint64_t)INT32_MAX ? INT32_MAX : (int32_t)per;
    rx->p.max_frame_bytes = (size_t)rx->slot_pages * p->layout.page_bytes;
    rx->fingerprint = cs_kvx_layout_fingerprint(&p->layout);
    rx->inc = cs__kvx_incarnation();
    int r = cs__kvx_key_set(&rx->key, p->secret, p->secret ? p->secret_len : 0);
    rx->p.secret = NULL;
    rx->scratch = r ? NULL : malloc(SCRATCH);
    if (r) goto fail_addr;
    if (!rx->scratch) {
        r = cs_fail(CS_ENOMEM, "kvx rx: out of memory");
        goto fail_addr;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port[16];
    snprintf(port, sizeof port, "%d", p->port);
    if (getaddrinfo(rx->host, port, &hints, &res) != 0) {
        r = cs_fail(CS_EINVAL, "kvx rx: cannot resolve %s", rx->host);
        goto fail_addr;
    }
    rx->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int one = 1;
    if (rx->lfd >= 0) setsockopt(rx->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (rx->lfd < 0 || bind(rx->lfd, res->ai_addr, res->ai_addrlen) != 0 ||
        listen(rx->lfd, 128) != 0) {
        r = cs_fail(-errno, "kvx rx: cannot listen on %s:%d: %s", rx->host, p->port,
                    strerror(errno));
        freeaddrinfo(res);
        goto fail_listen;
    }
    freeaddrinfo(res);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    getsockname(rx->lfd, (struct sockaddr *)&sa, &sl);
    rx->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                              : ((struct sockaddr_in *)&sa)->sin_port);
    r = cs__kvx_wake_init(rx->wake);
    if (r) {
        r = cs_fail(r, "kvx rx: eventfd: %s", cs_strerror(r));
        goto fail_listen;
    }
    pthread_mutex_init(&rx->mu, NULL);
    if (pthread_create(&rx->thread, NULL, rx_thread, rx) != 0) {
        r = cs_fail(CS_ENOMEM, "kvx rx: cannot start its thread");
        goto fail_thread;
    }
    *out = rx;
    return 0;
fail_thread:
    pthread_mutex_destroy(&rx->mu);
    close(rx->wake[0]);
fail_listen:
    if (rx->lfd >= 0) close(rx->lfd);
fail_addr:
    free(rx->scratch);
    memset(&rx->key, 0, sizeof rx->key);
    free(rx);
    return r;
}

int cs_kvx_rx_init(const cs_kvx_rx_params *p, cs_kvx_rx **out) {
    *out = NULL;
    const cs__kvx_payload *pl = p ? cs__kvx_payload_for_pool(p->pool.kind) : NULL;
    if (p && !pl)
        return cs_fail(
            p->pool.kind == CS_KVX_POOL_CUDA ? CS_ENOTSUP : CS_EINVAL,
            "kvx rx: no payload for a pool of kind %d in this build (CUDA pools need CUDA + NCCL)",
            p->pool.kind);
    return cs__kvx_rx_init_payload(p, pl, out);
}

void cs_kvx_rx_free(cs_kvx_rx *rx) {
    if (!rx) return;
    pthread_mutex_lock(&rx->mu);
    rx->stop = true;
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
    pthread_join(rx->thread, NULL);
    pthread_mutex_lock(&rx->mu);
    while (rx->xfers)
        xfer_end(rx, rx->xfers, CS_ECANCELED, "receiver shut down", NULL, false);
    while (rx->conns) {
        rx_conn *c = rx->conns;
        rx->conns = c->next;
        conn_free(rx, c);
    }
    bury(rx);
    CS_ASSERT(!rx->zombies); /* every in-flight write belonged to a link just torn down */
    run_events(rx);
    pthread_mutex_unlock(&rx->mu);
    pthread_mutex_destroy(&rx->mu);
    close(rx->lfd);
    close(rx->wake[0]);
    free(rx->scratch);
    free(rx);
}

int cs_kvx_rx_port(const cs_kvx_rx *rx) {
    return rx->port;
}
uint64_t cs_kvx_rx_incarnation(const cs_kvx_rx *rx) {
    return rx->inc;
}
int cs_kvx_rx_payload(const cs_kvx_rx *rx) {
    return rx->pl->kind;
}

int cs_kvx_rx_expect(cs_kvx_rx *rx, uint64_t xfer_id, const char *sender, const int32_t *page_ids,
                     int32_t n_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg) {
    if (!page_ids || n_pages < 1 || deadline_ms <= 0 || !done || xfer_id == 0)
        return cs_fail(CS_EINVAL,
                       "kvx rx: bad expectation (id != 0, n_pages >= 1, deadline_ms > 0, done)");
    for (int32_t i = 0; i < n_pages; i++)
        if (page_ids[i] < 0 || page_ids[i] >= rx->p.pool.n_pages)
            return cs_fail(CS_EINVAL,
                           "kvx rx: transfer %llu: page id %d outside the pool (%d pages)",
                           (unsigned long long)xfer_id, page_ids[i], rx->p.pool.n_pages);
    rx_xfer *x = calloc(1, sizeof *x);
    int32_t *ids = malloc((size_t)n_pages * sizeof *ids);
    if (x) x->ev = calloc(1, sizeof *x->ev);
    if (!x || !ids || !x->ev) {
        if (x) free(x->ev);
        free(x), free(ids);
        return cs_fail(CS_ENOMEM, "kvx rx: out of memory");
    }
    memcpy(ids, page_ids, (size_t)n_pages * sizeof *ids);
    x->id = xfer_id;
    if (sender) snprintf(x->sender, sizeof x->sender, "%s", sender);
    x->ids = ids;
    x->n_pages = n_pages;
    x->deadline = cs__kvx_now_ms() + deadline_ms;
    x->lease_ms = deadline_ms;
    x->done = done;
    x->arg = arg;
    x->all_sums = true;
    pthread_mutex_lock(&rx->mu);
    if (find_xfer(rx, xfer_id)) {
        pthread_mutex_unlock(&rx->mu);
        free(x->ev), free(ids), free(x);
        return cs_fail(CS_EEXIST, "kvx rx: transfer %llu already expected",
                       (unsigned long long)xfer_id);
    }
    x->next = rx->xfers;
    rx->xfers = x;
    rx->st.transfers_started++;
    rx->st.transfers_active++;
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
    return 0;
}

int cs_kvx_rx_cancel(cs_kvx_rx *rx, uint64_t xfer_id) {
    pthread_mutex_lock(&rx->mu);
    rx_xfer *x = find_xfer(rx, xfer_id);
    int r = 0;
    if (!x || x->fail)
        r = cs_fail(CS_ENOENT, "kvx rx: transfer %llu is not pending", (unsigned long long)xfer_id);
    else
        x->fail = CS_ECANCELED;
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
    return r;
}

void cs_kvx_rx_get_stats(cs_kvx_rx *rx, cs_kvx_stats *s) {
    pthread_mutex_lock(&rx->mu);
    *s = rx->st;
    pthread_mutex_unlock(&rx->mu);
}
