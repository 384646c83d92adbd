/* kvx_rx.c: the KV transport's receiver: the control plane for every
 * payload (the channels senders open are kvx_rx_chan.c's; kvx_rx-impl.h
 * draws the split). One I/O thread accepts senders' channels, validates every frame,
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
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kvx_rx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/secret.h"

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
void cs__rx_xfer_end(cs_kvx_rx *rx, rx_xfer *x, int status, const char *msg,
                     const cs_kvx_trailer *t, bool tell_peer) {
    for (rx_xfer **pp = &rx->xfers; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    for (rx_conn *c = rx->conns; c; c = c->next)
        if (c->px == x) c->px = NULL; /* the rest of its frame goes to scratch */
    if (tell_peer && x->conn)
        cs__rx_queue_status(rx, x->conn, status == 0 ? CS_KVX_DONE : CS_KVX_ABORT, x->id, status);
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

void cs__rx_zombie_release(cs_kvx_rx *rx, rx_xfer *x) {
    if (--x->inflight > 0) return;
    for (rx_xfer **pp = &rx->zombies; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    report(rx, x, x->end_status, x->end_msg, NULL);
}

/* Checks every frame of an accepted channel shares: HELLO first, the
 * channel's incarnation, the layout. false when c is closing. */
static bool frame_admissible(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h) {
    char err[256];
    if (!c->hello) {
        if (h->type == (c->challenged ? CS_KVX_AUTH : CS_KVX_HELLO)) return true;
        snprintf(err, sizeof err, "%s frame before %s", cs_kvx_frame_type_name(h->type),
                 c->challenged ? "AUTH" : "HELLO");
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
        return false;
    }
    if (h->epoch != c->peer_inc) {
        snprintf(err, sizeof err, "%s frame from incarnation %llx on a channel of incarnation %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->epoch,
                 (unsigned long long)c->peer_inc);
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
        return false;
    }
    if (h->fingerprint != rx->fingerprint) {
        snprintf(err, sizeof err, "%s frame with layout fingerprint %llx, expected %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->fingerprint,
                 (unsigned long long)rx->fingerprint);
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
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
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
        return NULL;
    }
    if (x && (!x->conn || x->conn == c)) {
        x->conn = c;
        return x;
    }
    if (!x) { /* ended here (deadline, cancel) while frames were in flight, or never expected */
        if (h->type != CS_KVX_ABORT)
            cs__rx_queue_status(rx, c, CS_KVX_ABORT, h->xfer_id, CS_ECANCELED);
        rx->st.stale_frames++;
        *dropped = true;
        return NULL;
    }
    snprintf(err, sizeof err, "%s frame for another channel's transfer %llu",
             cs_kvx_frame_type_name(h->type), (unsigned long long)h->xfer_id);
    cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
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
    cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
    return false;
}

static void try_complete(cs_kvx_rx *rx, rx_xfer *x) {
    if (!x->trailer_seen || x->landed != x->n_pages) return;
    if (x->all_sums && x->tw.xxh64 != x->digest) {
        char err[200];
        snprintf(err, sizeof err, "transfer %llu: checksum of all chunks mismatch",
                 (unsigned long long)x->id);
        cs__rx_conn_fail(rx, x->conn, CS_EBADMSG, err, true);
        return;
    }
    cs_kvx_trailer t = x->tw.t;
    cs__rx_xfer_end(rx, x, 0, NULL, &t, true);
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
        cs__rx_conn_fail(rx, c, CS_EBADMSG, "kvx: PAGES frame without the required checksum", true);
        return;
    }
    uint64_t sum = summed ? XXH3_64bits_digest(&c->hs) : 0;
    if (summed && sum != h->payload_xxh64) {
        char err[256];
        snprintf(err, sizeof err,
                 "kvx: PAGES frame payload checksum mismatch (transfer %llu, pages %u+%u)",
                 (unsigned long long)h->xfer_id, h->first_page, h->n_pages);
        cs__rx_conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    if (x) chunk_landed(rx, x, h->n_pages, h->payload_len, summed, sum);
}

/* -------------------------------------------------- linked (NCCL) pages */

static void on_desc(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h) {
    char err[256];
    if (c->comm == COMM_NONE) {
        cs__rx_conn_fail(rx, c, CS_EPROTO, "LINK_PAGES before LINK_ID", true);
        return;
    }
    rx_item *it = calloc(1, sizeof *it);
    if (!it) {
        cs__rx_conn_fail(rx, c, CS_ENOMEM, "the receiver ran out of memory", false);
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
        cs__rx_conn_fail(rx, c, r, err, true);
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

static void slot_done(cs_kvx_rx *rx, rx_conn *c, rx_slot *sl, uint64_t sum) {
    rx_xfer *x = sl->x;
    sl->busy = false;
    sl->x = NULL;
    if (!x) return; /* dropped bytes of an ended transfer */
    if (x->ended) {
        cs__rx_zombie_release(rx, x);
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
        cs__rx_conn_fail(rx, c, CS_EBADMSG, err, true);
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
        if (c->comm != COMM_READY) cs__rx_send_now(rx, c, CS_KVX_LINK_READY, CS_ECONNRESET, m);
        cs__rx_conn_fail(rx, c, CS_ECONNRESET, m, false);
        return;
    }
    if (c->comm == COMM_INIT) {
        if (r == 0) {
            uint8_t ack[CS_KVX_ACK_BYTES];
            cs_kvx_ack_encode(0, "ok", ack);
            cs__rx_queue_ctl(rx, c, CS_KVX_LINK_READY, 0, (uint32_t)rx->slot_pages, ack,
                             sizeof ack);
            c->comm = COMM_READY;
        } else if (now > c->init_deadline) {
            snprintf(m, sizeof m, "%s link with %s not ready after %d ms", rx->pl->name, c->name,
                     rx->p.init_timeout_ms);
            cs__rx_send_now(rx, c, CS_KVX_LINK_READY, CS_ETIMEDOUT, m);
            cs__rx_conn_fail(rx, c, CS_ETIMEDOUT, m, false);
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
            cs__rx_conn_fail(rx, c, CS_EIO, m, false);
            return;
        }
        if (r == 1) {
            if (now - sl->since > rx->p.op_timeout_ms) {
                snprintf(
                    m, sizeof m, "%s receive of a %llu-byte chunk from %s not complete after %d ms",
                    rx->pl->name, (unsigned long long)sl->d.bytes, c->name, rx->p.op_timeout_ms);
                cs__rx_conn_fail(rx, c, CS_ETIMEDOUT, m, false);
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
            cs__rx_conn_fail(rx, c, r == CS_ETIMEDOUT ? r : CS_ECONNRESET, m, false);
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
        cs__rx_conn_fail(rx, c, r, err, true);
        return;
    }
    rx->st.frames++;
    if (!frame_admissible(rx, c, h)) return;
    if (!c->hello) {
        if (h->type == CS_KVX_HELLO)
            cs__rx_on_hello(rx, c, h, c->buf);
        else
            cs__rx_on_auth(rx, c, h, c->buf);
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
            cs__rx_conn_fail(rx, c, CS_EPROTO, "unexpected LINK_ID on a channel", true);
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
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    bool dropped;
    rx_xfer *x = frame_xfer(rx, c, h, &dropped);
    if (!x) return;
    if (h->type == CS_KVX_ABORT) {
        int32_t st;
        if (cs_kvx_status_decode(c->buf, (size_t)h->payload_len, &st, err, sizeof err)) {
            cs__rx_conn_fail(rx, c, CS_EBADMSG, err, true);
            return;
        }
        snprintf(err, sizeof err, "sender aborted the transfer (%s)", cs_strerror(st));
        cs__rx_xfer_end(rx, x, CS_ECANCELED, err, NULL, false);
        return;
    }
    /* TRAILER: every data frame came before it */
    cs_kvx_trailer_wire tw;
    if (cs_kvx_trailer_decode(c->buf, (size_t)h->payload_len, &tw, err, sizeof err)) {
        cs__rx_conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    if (x->trailer_seen || tw.t.total_pages != x->n_pages || x->described != x->n_pages) {
        snprintf(err, sizeof err,
                 "transfer %llu: trailer says %d pages, %d received of %d reserved",
                 (unsigned long long)x->id, tw.t.total_pages, x->described, x->n_pages);
        cs__rx_conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    uint8_t mac[CS_KVX_MAC_BYTES];
    cs__kvx_trailer_mac(c->session, x->id, c->buf, mac);
    if (!cs_ct_equal(mac, tw.mac, sizeof mac)) {
        snprintf(err, sizeof err, "transfer %llu: the trailer's MAC does not match the session's",
                 (unsigned long long)x->id);
        cs__rx_conn_fail(rx, c, CS_EBADMSG, err, true);
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
            cs__rx_conn_fail(rx, c, CS_ECONNRESET, m, c->hdr_len || c->pl_len);
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
                cs__rx_conn_fail(rx, c, r, err, true);
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

/* A channel whose session key was rotated out is closed once no transfer
 * may still come over it: none bound to it, and none waiting unbound for its
 * sender (the sender may have begun it on this channel before it rotated
 * too); at the latest RETIRED_MAX_MS after the rotation (whoever holds the
 * dropped key cannot keep it open). */
#define RETIRED_MAX_MS 60000
static bool retired_busy(const cs_kvx_rx *rx, const rx_conn *c, int64_t now) {
    if (now - c->retired_at >= RETIRED_MAX_MS) return false;
    for (const rx_xfer *x = rx->xfers; x; x = x->next)
        if (x->conn == c || (!x->conn && (!x->sender[0] || !strcmp(x->sender, c->name))))
            return true;
    return false;
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
                cs__rx_xfer_end(rx, x, x->fail, "canceled by the receiver", NULL, true);
            else if (now >= x->deadline)
                cs__rx_xfer_end(rx, x, CS_ETIMEDOUT, "receiver deadline expired", NULL, true);
            else if (x->deadline - now < wait)
                wait = x->deadline - now;
        }
        for (rx_conn **pp = &rx->conns; *pp;) {
            rx_conn *c = *pp;
            if (!c->closing && !c->hello && now - c->opened > rx->p.hello_timeout_ms) {
                char m[160];
                snprintf(m, sizeof m, "no HELLO from %s within %d ms", c->addr,
                         rx->p.hello_timeout_ms);
                cs__rx_conn_fail(rx, c, CS_ETIMEDOUT, m, true);
            }
            if (!c->closing && now - c->last_rx > rx->p.dead_ms) {
                char m[160];
                snprintf(m, sizeof m, "sender %s silent for %d ms", c->name[0] ? c->name : c->addr,
                         rx->p.dead_ms);
                cs__rx_conn_fail(rx, c, CS_ECONNRESET, m, false);
            }
            if (!c->closing && c->oom)
                cs__rx_conn_fail(rx, c, CS_ENOMEM, "the receiver ran out of memory for a frame",
                                 false);
            if (!c->closing && c->retired && !retired_busy(rx, c, now)) {
                CS_LOGI("kvx rx: closing the channel from %s (%s): its cluster secret was "
                        "rotated out",
                        c->name[0] ? c->name : "?", c->addr);
                cs__rx_conn_fail(rx, c, CS_ECONNRESET, "cluster secret rotated", false);
            }
            if (!c->closing && c->comm == COMM_OPENING) cs__rx_link_open(rx, c);
            if (!c->closing && c->link) link_poll(rx, c, now);
            if (c->closing) { /* the safe point: nothing refers to c any more */
                *pp = c->next;
                cs__rx_conn_free(rx, c);
                continue;
            }
            if (c->link && (c->comm != COMM_READY || c->ord_n || c->ihead)) busy = true;
            if (c->hello && !c->qhead && now - c->last_tx >= rx->p.keepalive_ms)
                cs__rx_queue_ctl(rx, c, CS_KVX_PING, 0, 0, NULL, 0);
            if (c->qhead) cs__rx_conn_write(rx, c);
            pp = &c->next;
        }
        /* report first: tearing a link down (ncclCommAbort, stream drain)
         * may take a while */
        if (rx->ev_head) {
            run_events(rx);
            continue;
        }
        if (rx->grave) {
            cs__rx_bury(rx);
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
        if (pfds[1].revents) cs__rx_do_accept(rx);
        for (int i = 2; i < n; i++) {
            rx_conn *c = pc[i];
            if (!pfds[i].revents || c->closing) continue;
            if (pfds[i].revents & (POLLIN | POLLERR | POLLHUP)) conn_read(rx, c);
            if (!c->closing && c->qhead) cs__rx_conn_write(rx, c);
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
    cs__kvx_keys_set(&rx->keys, p->secret);
    rx->p.secret = NULL;
    rx->scratch = malloc(SCRATCH);
    int r;
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
    cs_secure_zero(&rx->keys, sizeof rx->keys);
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
        cs__rx_xfer_end(rx, rx->xfers, CS_ECANCELED, "receiver shut down", NULL, false);
    while (rx->conns) {
        rx_conn *c = rx->conns;
        rx->conns = c->next;
        cs__rx_conn_free(rx, c);
    }
    cs__rx_bury(rx);
    CS_ASSERT(!rx->zombies); /* every in-flight write belonged to a link just torn down */
    run_events(rx);
    pthread_mutex_unlock(&rx->mu);
    pthread_mutex_destroy(&rx->mu);
    close(rx->lfd);
    close(rx->wake[0]);
    free(rx->scratch);
    cs_secure_zero(&rx->keys, sizeof rx->keys);
    free(rx);
}

void cs_kvx_rx_set_secret(cs_kvx_rx *rx, const cs_secret *s) {
    pthread_mutex_lock(&rx->mu);
    cs__kvx_keys_set(&rx->keys, s);
    for (rx_conn *c = rx->conns; c; c = c->next)
        if (c->challenged && !c->retired && !cs__kvx_keys_have(&rx->keys, &c->key)) {
            c->retired = true;
            c->retired_at = cs__kvx_now_ms();
        }
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
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
