/* kvx_rx_chan.c: one sender's channel at the KV transport's receiver:
 * accepts it (bounded pending handshakes, per address too), runs the
 * receiver's side of the handshake (HELLO admitted and answered with a
 * CHALLENGE, AUTH verified: kvx_handshake.c; a newer incarnation of a sender
 * replaces the old one's channels), opens the payload link when LINK_ID
 * asks, writes the control frames back, and fails or frees a channel
 * (its transfers end, its link goes to its grave and is torn down without
 * the mutex). The transfers riding on channels are kvx_rx.c's. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx_rx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/secret.h"

void cs__rx_queue_ctl(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, uint32_t n_pages,
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

void cs__rx_queue_status(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, int status) {
    uint8_t pl[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(status, pl);
    cs__rx_queue_ctl(rx, c, type, xfer, 0, pl, sizeof pl);
}

/* Marks c for closing and fails the transfers bound to it. */
void cs__rx_conn_fail(cs_kvx_rx *rx, rx_conn *c, int status, const char *msg, bool protocol) {
    if (c->closing) return;
    if (protocol) {
        rx->st.protocol_errors++;
        CS_LOGW("kvx rx: closing channel from %s (%s): %s", c->name[0] ? c->name : "?", c->addr,
                msg);
    }
    c->closing = true;
    for (rx_xfer *x = rx->xfers, *nx; x; x = nx) {
        nx = x->next;
        if (x->conn == c) cs__rx_xfer_end(rx, x, status, msg, NULL, false);
    }
}

/* At the safe point: the link goes to the graveyard with its slots (their
 * transfers are reported once it is torn down). */
void cs__rx_conn_free(cs_kvx_rx *rx, rx_conn *c) {
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
    cs_secure_zero(&c->key, sizeof c->key);
    free(c);
    rx->n_conns--;
}

void cs__rx_bury(cs_kvx_rx *rx) {
    while (rx->grave) {
        rx_grave *g = rx->grave;
        rx->grave = g->next;
        pthread_mutex_unlock(&rx->mu);
        bool drained = rx->pl->close(g->link);
        pthread_mutex_lock(&rx->mu);
        if (!drained)
            CS_LOGE("kvx rx: a closed %s link did not drain: its staging is leaked", rx->pl->name);
        for (int i = 0; i < rx->p.n_slots; i++)
            if (g->slots[i].busy && g->slots[i].x) cs__rx_zombie_release(rx, g->slots[i].x);
        free(g->slots);
        free(g);
    }
}

void cs__rx_conn_write(cs_kvx_rx *rx, rx_conn *c) {
    while (c->qhead && !c->closing) {
        int r = cs__kvx_out_write(c->fd, c->qhead);
        if (r < 0) {
            cs__rx_conn_fail(rx, c, CS_ECONNRESET, "write to the sender failed", false);
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
void cs__rx_send_now(cs_kvx_rx *rx, rx_conn *c, int type, int32_t status, const char *msg) {
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
    cs__rx_send_now(rx, c, CS_KVX_HELLO_ACK, CS_ECONNREFUSED, err);
    cs__rx_conn_fail(rx, c, CS_ECONNREFUSED, err, true);
}

void cs__rx_on_hello(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[256];
    cs_kvx_hello m;
    int r = cs_kvx_hello_decode(pl, (size_t)h->payload_len, &m, err, sizeof err);
    if (r) {
        cs__rx_conn_fail(rx, c, r, err, true);
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
    c->key = rx->keys.k[0]; /* a receiver proves its first key */
    cs__kvx_hs_challenge(&c->key, &me, h, &m, &c->tr, pl2);
    c->challenged = true;
    cs__rx_queue_ctl(rx, c, CS_KVX_CHALLENGE, 0, 0, pl2, sizeof pl2);
}

/* The sender's AUTH: its proof of the secret over the transcript. Only then
 * does its HELLO count: fencing, the channel's name, the ACK. */
void cs__rx_on_auth(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[256];
    if (!cs__kvx_hs_verify(&c->key, &c->tr, h, pl, c->session)) {
        snprintf(err, sizeof err,
                 "authentication failed: the sender at %s (named %s) does not hold this "
                 "cluster's secret",
                 c->addr, c->tr.name);
        CS_LOGW("kvx rx: %s", err);
        cs__rx_send_now(rx, c, CS_KVX_HELLO_ACK, CS_ECONNREFUSED, "authentication failed");
        cs__rx_conn_fail(rx, c, CS_ECONNREFUSED, err, true);
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
            cs__rx_conn_fail(rx, o, CS_ECONNRESET, err, false);
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
    cs__rx_queue_ctl(rx, c, CS_KVX_HELLO_ACK, 0, 0, ack, sizeof ack);
}

/* Opens the link of a channel whose LINK_ID arrived (without the mutex:
 * staging allocation). */
void cs__rx_link_open(cs_kvx_rx *rx, rx_conn *c) {
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
        cs__rx_send_now(rx, c, CS_KVX_LINK_READY, r, m);
        cs__rx_conn_fail(rx, c, r, m, false);
        return;
    }
    c->link = link;
    c->grave = g;
    c->comm = COMM_INIT;
    c->init_deadline = cs__kvx_now_ms() + rx->p.init_timeout_ms;
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
        cs__rx_conn_fail(rx, evict, CS_ECONNRESET, "closed before its HELLO to make room", false);
    }
}

void cs__rx_do_accept(cs_kvx_rx *rx) {
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
