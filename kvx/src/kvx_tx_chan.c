/* kvx_tx_chan.c: one channel of the KV transport's sender: a TCP
 * connection to one receiver (host:port) and its payload link. Connects and
 * opens the link (HELLO, then LINK_ID when the payload has a handshake of
 * its own), answers the receiver's CHALLENGE (kvx_handshake.c checks it and
 * makes AUTH), writes the queued frames in order (before the CHALLENGE only
 * HELLO leaves), reads the receiver's frames and acts on them, and closes:
 * every transfer of the channel fails, the link goes to its grave and is
 * torn down without the mutex. The transfers riding on channels are
 * kvx_tx.c's. */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx_tx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

void cs__tx_enqueue(tx_chan *ch, kvx_out *o) {
    o->next = NULL;
    if (ch->qtail)
        ch->qtail->next = o;
    else
        ch->qhead = o;
    ch->qtail = o;
}

/* A frame for ch, or NULL with ch marked to close (ENOMEM) at the I/O
 * thread's next look at it: a frame is never silently lost. */
kvx_out *cs__tx_new_out(tx_chan *ch) {
    kvx_out *o = calloc(1, sizeof *o);
    if (!o) ch->oom = true;
    return o;
}

void cs__tx_queue_ctl(cs_kvx_tx *tx, tx_chan *ch, int type, uint64_t xfer, const void *pl,
                      size_t len) {
    kvx_out *o = cs__tx_new_out(ch);
    if (!o) return;
    cs__kvx_out_ctl(o, type, tx->p.incarnation, xfer, tx->fingerprint, pl, len);
    cs__tx_enqueue(ch, o);
}

/* Closes the TCP connection and the link (torn down later, without the
 * mutex), fails every transfer of the channel. */
void cs__tx_chan_close(cs_kvx_tx *tx, tx_chan *ch, int status, const char *msg) {
    if (ch->fd >= 0) {
        close(ch->fd);
        tx->st.conns_closed++;
    }
    ch->fd = -1;
    ch->state = CH_IDLE;
    ch->acked = ch->authed = false;
    memset(ch->session, 0, sizeof ch->session);
    cs_secure_zero(&ch->key, sizeof ch->key);
    ch->in_len = 0;
    for (tx_xfer *x = tx->xfers, *nx; x; x = nx) {
        nx = x->next;
        if (x->ch == ch) cs__tx_xfer_end(tx, x, status, msg);
    }
    while (ch->qhead) {
        kvx_out *o = ch->qhead;
        ch->qhead = o->next;
        free(o);
    }
    ch->qtail = NULL;
    tx_grave *g = ch->link ? ch->grave : NULL; /* made with the link */
    if (!g && ch->grave) free(ch->grave->sends), free(ch->grave);
    ch->grave = NULL;
    if (g) g->link = ch->link;
    /* Pages an asynchronous pack may still read stay held until the link is
     * torn down; the others are released now. */
    for (int i = 0; i < tx->p.n_slots; i++) {
        tx_slot *sl = &ch->slots[i];
        if (sl->send && g && sl->state == SL_PACKING && !tx->pl->inline_pages)
            g->sends[g->n_sends++] = sl->send;
        else
            cs__tx_send_unref(tx, sl->send);
        if (sl->item) sl->item->send = NULL; /* the slot held the item's reference */
        *sl = (tx_slot){0};
    }
    while (ch->ihead) {
        tx_item *it = ch->ihead;
        cs__tx_item_pop(ch);
        cs__tx_item_drop(tx, ch, it);
    }
    ch->queued_bytes = 0;
    if (g) {
        g->next = tx->grave;
        tx->grave = g;
    }
    ch->link = NULL;
    ch->local_ready = ch->peer_ready = false;
    ch->oom = false;
}

/* Tears closed links down without the mutex: ncclCommAbort and the wait for
 * their streams may take a while. */
void cs__tx_bury(cs_kvx_tx *tx) {
    while (tx->grave) {
        tx_grave *g = tx->grave;
        tx->grave = g->next;
        pthread_mutex_unlock(&tx->mu);
        bool drained = tx->pl->close(g->link);
        pthread_mutex_lock(&tx->mu);
        if (!drained)
            CS_LOGE("kvx tx: a closed %s link did not drain: its staging is leaked", tx->pl->name);
        for (int i = 0; i < g->n_sends; i++)
            cs__tx_send_unref(tx, g->sends[i]);
        free(g->sends);
        free(g);
    }
}

tx_chan *cs__tx_find_chan(cs_kvx_tx *tx, const char *host, int port) {
    for (tx_chan *c = tx->chans; c; c = c->next)
        if (!c->retired && c->port == port && strcmp(c->host, host) == 0) return c;
    return NULL;
}

/* Connects (non-blocking) and opens the channel's link (NCCL: a fresh
 * communicator id, rank 0's init started); HELLO (and LINK_ID) go first on
 * the connection. Called with the mutex, which it drops around the name
 * lookup and the link's allocation. */
int cs__tx_chan_connect(cs_kvx_tx *tx, tx_chan *ch) {
    char host[256], port[16];
    snprintf(host, sizeof host, "%s", ch->host);
    snprintf(port, sizeof port, "%d", ch->port);
    cs__kvx_link_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = 0;
    cfg.pool = tx->p.pool;
    cfg.page_bytes = (size_t)tx->p.layout.page_bytes;
    cfg.n_slots = tx->p.n_slots;
    cfg.slot_pages = tx->slot_pages;
    cfg.op_timeout_ms = tx->p.op_timeout_ms;
    snprintf(cfg.name, sizeof cfg.name, "kvx %s->%s:%d", tx->name, ch->host, ch->port);
    pthread_mutex_unlock(&tx->mu);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV; /* never DNS on the I/O thread */
    int gr = getaddrinfo(host, port, &hints, &res);
    int fd = -1, err = 0;
    char m[300] = "";
    uint8_t id[CS_KVX_LINK_ID_BYTES];
    cs__kvx_link *link = NULL;
    if (gr != 0) {
        err = CS_ENOENT;
        snprintf(m, sizeof m,
                 "%s:%s is not a numeric address (decode workers advertise one; names are not "
                 "resolved here): %s",
                 host, port, gai_strerror(gr));
    } else {
        fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || cs__kvx_set_socket_opts(fd) != 0)
            err = -errno;
        else if (connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS)
            err = -errno;
        freeaddrinfo(res);
        if (err) snprintf(m, sizeof m, "cannot connect to %s:%s: %s", host, port, cs_strerror(err));
    }
    if (!err) {
        char e[200] = "";
        if (tx->pl->unique_id) err = tx->pl->unique_id(&cfg, id, e, sizeof e);
        if (!err) err = tx->pl->open(&cfg, tx->pl->unique_id ? id : NULL, &link, e, sizeof e);
        if (err) snprintf(m, sizeof m, "%s link to %s:%s: %s", tx->pl->name, host, port, e);
    }
    pthread_mutex_lock(&tx->mu);
    if (!err && link) { /* its grave, so closing it never needs memory */
        tx_grave *g = calloc(1, sizeof *g);
        if (g) g->sends = calloc((size_t)tx->p.n_slots + 1, sizeof *g->sends);
        if (g && g->sends) {
            ch->grave = g;
        } else {
            if (g) free(g);
            tx->pl->close(link);
            link = NULL;
            err = CS_ENOMEM;
            snprintf(m, sizeof m, "%s link to %s:%s: out of memory", tx->pl->name, host, port);
        }
    }
    if (err) {
        if (fd >= 0) close(fd);
        cs__tx_chan_close(tx, ch, err, m);
        return err;
    }
    CS_ASSERT(!ch->qhead);
    ch->fd = fd;
    ch->state = CH_CONNECTING;
    ch->last_rx = ch->last_tx = cs__kvx_now_ms();
    ch->link = link;
    ch->local_ready = false;
    ch->peer_ready = !tx->pl->unique_id; /* no handshake: nothing to wait for */
    ch->init_deadline = cs__kvx_now_ms() + tx->p.init_timeout_ms;
    tx->st.conns_opened++;
    uint8_t pl[CS_KVX_HELLO_BYTES];
    cs__kvx_hs_hello(&tx->p.layout, tx->pl->kind, tx->name, ch->nonce, pl);
    kvx_out *o = cs__tx_new_out(ch);
    if (!o) return 0; /* closed at the next look */
    cs__kvx_out_ctl(o, CS_KVX_HELLO, tx->p.incarnation, 0, tx->fingerprint, pl, sizeof pl);
    cs__tx_enqueue(ch, o);
    if (tx->pl->unique_id) cs__tx_queue_ctl(tx, ch, CS_KVX_LINK_ID, 0, id, sizeof id);
    return 0;
}

bool cs__tx_link_ready(const tx_chan *ch) {
    return ch->link && ch->local_ready && ch->peer_ready && ch->authed;
}

/* Whether the head frame may go out: before the CHALLENGE is checked only
 * HELLO (and the AUTH that answers it) leave this side. */
bool cs__tx_head_writable(const tx_chan *ch) {
    const kvx_out *o = ch->qhead;
    return o && (ch->authed || o->off > 0 || o->type == CS_KVX_HELLO || o->type == CS_KVX_AUTH);
}

void cs__tx_chan_write(cs_kvx_tx *tx, tx_chan *ch) {
    while (cs__tx_head_writable(ch)) {
        kvx_out *o = ch->qhead;
        size_t before = o->off;
        int r = cs__kvx_out_write(ch->fd, o);
        if (o->off != before) ch->last_tx = cs__kvx_now_ms();
        if (r < 0) {
            char m[128];
            snprintf(m, sizeof m, "write to %s:%d: %s", ch->host, ch->port, cs_strerror(r));
            cs__tx_chan_close(tx, ch, CS_ECONNRESET, m);
            return;
        }
        if (r == 0) return;
        tx->st.frames++;
        ch->qhead = o->next;
        if (!ch->qhead) ch->qtail = NULL;
        tx_slot *sl = o->owner;
        free(o);
        if (sl) {
            cs__tx_post_send(tx, ch, sl); /* NCCL: the receiver posts the matching ncclRecv */
            if (ch->fd < 0) return;
        }
    }
}

/* The receiver's CHALLENGE: checks its proof of the secret, then answers
 * with this side's proof (AUTH, ahead of every frame queued since HELLO)
 * and keeps the session key (kvx_handshake.c). */
static void on_challenge(cs_kvx_tx *tx, tx_chan *ch, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[300], peer[300];
    snprintf(peer, sizeof peer, "%s:%d", ch->host, ch->port);
    cs__kvx_hs_sender me = {.incarnation = tx->p.incarnation,
                            .fingerprint = tx->fingerprint,
                            .payload = tx->pl->kind,
                            .name = tx->name,
                            .peer = peer};
    memcpy(me.nonce, ch->nonce, sizeof me.nonce);
    uint8_t proof[CS_KVX_AUTH_BYTES];
    int r = cs__kvx_hs_answer(&tx->keys, &me, h, pl, proof, ch->session, &ch->key, err, sizeof err);
    if (r) {
        tx->st.protocol_errors++;
        cs__tx_chan_close(tx, ch, r, err);
        return;
    }
    kvx_out *o = cs__tx_new_out(ch);
    if (!o) return;
    cs__kvx_out_ctl(o, CS_KVX_AUTH, tx->p.incarnation, 0, tx->fingerprint, proof, sizeof proof);
    CS_ASSERT(!ch->qhead || ch->qhead->off == 0); /* nothing but HELLO went out, whole */
    o->next = ch->qhead; /* first: the frames queued behind HELLO waited for it */
    ch->qhead = o;
    if (!ch->qtail) ch->qtail = o;
    ch->peer_inc = h->epoch;
    ch->authed = true;
}

static void chan_frame(cs_kvx_tx *tx, tx_chan *ch, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[300];
    if (h->type == CS_KVX_CHALLENGE && !ch->authed) {
        on_challenge(tx, ch, h, pl);
        return;
    }
    if (h->type == CS_KVX_HELLO_ACK && !ch->acked) {
        int32_t status;
        char msg[128];
        int r = cs_kvx_ack_decode(pl, (size_t)h->payload_len, &status, msg, sizeof msg);
        if (r || status) {
            snprintf(err, sizeof err, "receiver %s:%d refused the channel: %s", ch->host, ch->port,
                     r ? "bad HELLO_ACK" : msg);
            cs__tx_chan_close(tx, ch, r ? CS_EPROTO : CS_ECONNREFUSED, err);
            return;
        }
        if (!ch->authed || h->epoch != ch->peer_inc) {
            tx->st.protocol_errors++;
            cs__tx_chan_close(tx, ch, CS_EPROTO, "HELLO_ACK before the receiver's CHALLENGE");
            return;
        }
        ch->acked = true;
        CS_LOGI("kvx tx: channel to %s:%d open, %s payload", ch->host, ch->port, tx->pl->name);
        return;
    }
    if (!ch->acked || h->epoch != ch->peer_inc) {
        snprintf(err, sizeof err, "%s frame from receiver incarnation %llx on a channel of %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->epoch,
                 (unsigned long long)ch->peer_inc);
        tx->st.protocol_errors++;
        cs__tx_chan_close(tx, ch, CS_EPROTO, err);
        return;
    }
    if (h->type == CS_KVX_PING) return;
    if (h->type == CS_KVX_LINK_READY) {
        int32_t status;
        char msg[128];
        int r = cs_kvx_ack_decode(pl, (size_t)h->payload_len, &status, msg, sizeof msg);
        if (r || status) {
            snprintf(err, sizeof err, "receiver %s:%d could not open its %s link: %s", ch->host,
                     ch->port, tx->pl->name, r ? "bad LINK_READY" : msg);
            if (r) tx->st.protocol_errors++;
            cs__tx_chan_close(tx, ch, r ? CS_EPROTO : CS_ECONNREFUSED, err);
            return;
        }
        if (ch->peer_ready) {
            tx->st.protocol_errors++;
            cs__tx_chan_close(tx, ch, CS_EPROTO, "unexpected LINK_READY from the receiver");
            return;
        }
        if ((int64_t)h->n_pages < tx->slot_pages) {
            snprintf(err, sizeof err,
                     "receiver %s:%d takes chunks of at most %u pages, not %d (max_frame_bytes)",
                     ch->host, ch->port, h->n_pages, tx->slot_pages);
            cs__tx_chan_close(tx, ch, CS_ECONNREFUSED, err);
            return;
        }
        ch->peer_ready = true;
        return;
    }
    if (h->type == CS_KVX_DONE || h->type == CS_KVX_ABORT) {
        int32_t status;
        if (cs_kvx_status_decode(pl, (size_t)h->payload_len, &status, err, sizeof err)) {
            tx->st.protocol_errors++;
            cs__tx_chan_close(tx, ch, CS_EPROTO, err);
            return;
        }
        tx_xfer *x = cs__tx_find_xfer(tx, h->xfer_id);
        if (!x || x->ch != ch) return; /* already ended here */
        if (h->type == CS_KVX_DONE && status == 0 && !x->trailer_queued) status = CS_EPROTO;
        snprintf(err, sizeof err, "receiver %s the transfer",
                 h->type == CS_KVX_DONE ? "ended" : "aborted");
        cs__tx_xfer_end(tx, x, h->type == CS_KVX_ABORT && status == 0 ? CS_ECANCELED : status,
                        status ? err : NULL);
        return;
    }
    snprintf(err, sizeof err, "unexpected %s frame from the receiver",
             cs_kvx_frame_type_name(h->type));
    tx->st.protocol_errors++;
    cs__tx_chan_close(tx, ch, CS_EPROTO, err);
}

void cs__tx_chan_read(cs_kvx_tx *tx, tx_chan *ch) {
    cs_kvx_limits lim = {tx->p.layout.page_bytes, CS_KVX_ACK_BYTES, tx->pl->inline_pages};
    for (;;) {
        size_t want = CS_KVX_HDR_BYTES;
        cs_kvx_hdr h;
        char err[200];
        if (ch->in_len >= CS_KVX_HDR_BYTES) {
            int r = cs_kvx_hdr_decode(ch->in, &lim, &h, err, sizeof err);
            if (!r && (h.type == CS_KVX_PAGES || h.type == CS_KVX_LINK_PAGES ||
                       h.type == CS_KVX_LINK_ID)) {
                r = CS_EPROTO;
                snprintf(err, sizeof err, "%s frame from a receiver",
                         cs_kvx_frame_type_name(h.type));
            }
            if (r) {
                tx->st.protocol_errors++;
                cs__tx_chan_close(tx, ch, r, err);
                return;
            }
            want += (size_t)h.payload_len;
            if (ch->in_len == want) {
                if (cs_kvx_payload_check(&h, ch->in + CS_KVX_HDR_BYTES, false, err, sizeof err)) {
                    tx->st.protocol_errors++;
                    cs__tx_chan_close(tx, ch, CS_EBADMSG, err);
                    return;
                }
                ch->in_len = 0;
                chan_frame(tx, ch, &h, ch->in + CS_KVX_HDR_BYTES);
                if (ch->fd < 0) return;
                continue;
            }
        }
        ssize_t n = read(ch->fd, ch->in + ch->in_len, want - ch->in_len);
        if (n > 0) {
            ch->in_len += (size_t)n;
            ch->last_rx = cs__kvx_now_ms();
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n < 0 && errno == EINTR) continue;
        char m[160];
        snprintf(m, sizeof m, "receiver %s:%d closed the channel%s%s", ch->host, ch->port,
                 n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
        cs__tx_chan_close(tx, ch, CS_ECONNRESET, m);
        return;
    }
}
