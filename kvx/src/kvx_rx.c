/* kvx_rx.c: the KV transport's receiver (TCP). One I/O thread accepts
 * senders' channels, validates every frame, imports pages into the reserved
 * page ids and reports each expected transfer exactly once. A bad frame
 * closes only its own channel (failing the transfers bound to it); a
 * transfer is bound to the channel of its first frame. */
#define XXH_STATIC_LINKING_ONLY
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "chunkserve/kvx.h"
#include "kvx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#define N_TOMB 4096 /* recently ended transfer ids: their late frames are dropped */
#define N_PEERS 1024

typedef struct rx_conn {
    struct rx_conn *next;
    int fd;
    bool hello;     /* HELLO accepted */
    bool closing;   /* closed at the next safe point */
    char name[CS_KVX_NAME_MAX];
    char addr[64];
    uint64_t peer_inc;
    uint8_t hdr[CS_KVX_HDR_BYTES];
    size_t hdr_len;
    cs_kvx_hdr h; /* header of the frame being read, valid once hdr_len == 64 */
    uint8_t *buf;
    size_t buf_cap, pl_len;
    kvx_out *qhead, *qtail;
    int64_t last_rx, last_tx;
} rx_conn;

typedef struct rx_xfer {
    struct rx_xfer *next;
    uint64_t id;
    int32_t *ids;
    int32_t n_pages, received;
    int64_t deadline;
    rx_conn *conn; /* bound on the first frame */
    int fail;      /* set by cs_kvx_rx_cancel */
    cs_kvx_done_fn done;
    void *arg;
    XXH64_state_t hash;
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

struct cs_kvx_rx {
    cs_kvx_rx_params p;
    char host[64];
    uint64_t fingerprint, inc;
    int lfd, port;
    pthread_mutex_t mu;
    pthread_t thread;
    int wake[2];
    bool stop;
    rx_conn *conns;
    int n_conns;
    rx_xfer *xfers;
    rx_event *ev_head, *ev_tail;
    uint64_t tomb[N_TOMB];
    int tomb_pos;
    struct {
        char name[CS_KVX_NAME_MAX];
        uint64_t inc;
    } peers[N_PEERS];
    int n_peers;
    cs_kvx_stats st;
};

cs_kvx_rx_params cs_kvx_rx_params_default(void) {
    cs_kvx_rx_params p;
    memset(&p, 0, sizeof p);
    p.host = "127.0.0.1";
    p.require_checksum = true;
    p.max_frame_bytes = 64u << 20;
    p.keepalive_ms = 1000;
    p.dead_ms = 5000;
    p.max_conns = 256;
    return p;
}

static void queue_ctl(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, const void *pl, size_t len) {
    if (c->fd < 0 || c->closing) return;
    kvx_out *o = calloc(1, sizeof *o);
    CS_ASSERT(o);
    cs__kvx_out_ctl(o, type, rx->inc, xfer, rx->fingerprint, pl, len);
    if (c->qtail) c->qtail->next = o;
    else c->qhead = o;
    c->qtail = o;
}

static void queue_status(cs_kvx_rx *rx, rx_conn *c, int type, uint64_t xfer, int status) {
    uint8_t pl[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(status, pl);
    queue_ctl(rx, c, type, xfer, pl, sizeof pl);
}

static void tomb_add(cs_kvx_rx *rx, uint64_t id) {
    rx->tomb[rx->tomb_pos] = id;
    rx->tomb_pos = (rx->tomb_pos + 1) % N_TOMB;
}

static bool tomb_has(cs_kvx_rx *rx, uint64_t id) {
    for (int i = 0; i < N_TOMB; i++)
        if (rx->tomb[i] == id && id != 0) return true;
    return false;
}

static rx_xfer *find_xfer(cs_kvx_rx *rx, uint64_t id) {
    for (rx_xfer *x = rx->xfers; x; x = x->next)
        if (x->id == id) return x;
    return NULL;
}

/* Reports x (removing it); tells the bound sender when the end is ours. */
static void xfer_end(cs_kvx_rx *rx, rx_xfer *x, int status, const char *msg, const cs_kvx_trailer *t,
                     bool tell_peer) {
    for (rx_xfer **pp = &rx->xfers; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    if (tell_peer && x->conn) queue_status(rx, x->conn, status == 0 ? CS_KVX_DONE : CS_KVX_ABORT, x->id, status);
    tomb_add(rx, x->id);
    rx->st.transfers_active--;
    if (status == 0) rx->st.transfers_completed++;
    else rx->st.transfers_failed++;
    rx_event *e = calloc(1, sizeof *e);
    CS_ASSERT(e);
    e->done = x->done;
    e->arg = x->arg;
    e->id = x->id;
    e->status = status;
    if (t) e->has_trailer = true, e->t = *t;
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "");
    if (rx->ev_tail) rx->ev_tail->next = e;
    else rx->ev_head = e;
    rx->ev_tail = e;
    if (status)
        CS_LOGW("kvx rx: transfer %llu failed: %s (%s)", (unsigned long long)x->id, cs_strerror(status), msg ? msg : "");
    free(x->ids);
    free(x);
}

/* Marks c for closing and fails the transfers bound to it. */
static void conn_fail(cs_kvx_rx *rx, rx_conn *c, int status, const char *msg, bool protocol) {
    if (c->closing) return;
    if (protocol) {
        rx->st.protocol_errors++;
        CS_LOGW("kvx rx: closing channel from %s (%s): %s", c->name[0] ? c->name : "?", c->addr, msg);
    }
    c->closing = true;
    for (rx_xfer *x = rx->xfers, *nx; x; x = nx) {
        nx = x->next;
        if (x->conn == c) xfer_end(rx, x, status, msg, NULL, false);
    }
}

static void conn_free(cs_kvx_rx *rx, rx_conn *c) {
    if (c->fd >= 0) close(c->fd);
    rx->st.conns_closed++;
    while (c->qhead) {
        kvx_out *o = c->qhead;
        c->qhead = o->next;
        free(o);
    }
    free(c->buf);
    free(c);
    rx->n_conns--;
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

/* Best effort: a refusal's reason reaches the sender before the close. */
static void send_now(cs_kvx_rx *rx, rx_conn *c, int type, const void *pl, size_t len) {
    kvx_out o;
    memset(&o, 0, sizeof o);
    cs__kvx_out_ctl(&o, type, rx->inc, 0, rx->fingerprint, pl, len);
    (void)cs__kvx_out_write(c->fd, &o);
}

static void on_hello(cs_kvx_rx *rx, rx_conn *c, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[256];
    cs_kvx_hello m;
    int r = cs_kvx_hello_decode(pl, (size_t)h->payload_len, &m, err, sizeof err);
    if (r) {
        conn_fail(rx, c, r, err, true);
        return;
    }
    const cs_kvx_layout *a = &m.layout, *b = &rx->p.layout;
    if (h->fingerprint != rx->fingerprint || a->n_layers != b->n_layers || a->n_kv_heads != b->n_kv_heads ||
        a->head_dim != b->head_dim || a->dtype != b->dtype || a->page_size != b->page_size ||
        a->page_bytes != b->page_bytes) {
        snprintf(err, sizeof err,
                 "layout mismatch: sender %d layers, %d kv heads, head_dim %d, dtype %d, page %d "
                 "(%llu bytes); receiver %d, %d, %d, %d, %d (%llu bytes)",
                 a->n_layers, a->n_kv_heads, a->head_dim, a->dtype, a->page_size,
                 (unsigned long long)a->page_bytes, b->n_layers, b->n_kv_heads, b->head_dim, b->dtype,
                 b->page_size, (unsigned long long)b->page_bytes);
        uint8_t ack[CS_KVX_ACK_BYTES];
        cs_kvx_ack_encode(CS_ECONNREFUSED, err, ack);
        send_now(rx, c, CS_KVX_HELLO_ACK, ack, sizeof ack);
        conn_fail(rx, c, CS_ECONNREFUSED, err, true);
        return;
    }
    /* Fencing: a newer incarnation of a sender replaces its older channel
     * (its half-open connection may not have seen EOF yet); an older
     * incarnation than one already seen is refused. */
    int slot = -1;
    for (int i = 0; i < rx->n_peers; i++)
        if (strcmp(rx->peers[i].name, m.name) == 0) slot = i;
    if (slot >= 0 && h->epoch < rx->peers[slot].inc) {
        snprintf(err, sizeof err, "stale incarnation %llx of sender %s (current %llx)", (unsigned long long)h->epoch,
                 m.name, (unsigned long long)rx->peers[slot].inc);
        uint8_t ack[CS_KVX_ACK_BYTES];
        cs_kvx_ack_encode(CS_ECONNREFUSED, err, ack);
        send_now(rx, c, CS_KVX_HELLO_ACK, ack, sizeof ack);
        conn_fail(rx, c, CS_ECONNREFUSED, err, true);
        return;
    }
    for (rx_conn *o = rx->conns; o; o = o->next)
        if (o != c && o->hello && !o->closing && strcmp(o->name, m.name) == 0) {
            snprintf(err, sizeof err, "sender %s reconnected (incarnation %llx replaces %llx)", m.name,
                     (unsigned long long)h->epoch, (unsigned long long)o->peer_inc);
            conn_fail(rx, o, CS_ECONNRESET, err, false);
        }
    if (slot < 0 && rx->n_peers < N_PEERS) slot = rx->n_peers++;
    if (slot < 0) slot = (int)(h->epoch % N_PEERS);
    snprintf(rx->peers[slot].name, sizeof rx->peers[slot].name, "%s", m.name);
    rx->peers[slot].inc = h->epoch;
    snprintf(c->name, sizeof c->name, "%s", m.name);
    c->peer_inc = h->epoch;
    c->hello = true;
    uint8_t ack[CS_KVX_ACK_BYTES];
    cs_kvx_ack_encode(0, "ok", ack);
    queue_ctl(rx, c, CS_KVX_HELLO_ACK, 0, ack, sizeof ack);
}

/* A complete frame (header c->h, payload c->buf). */
static void on_frame(cs_kvx_rx *rx, rx_conn *c) {
    const cs_kvx_hdr *h = &c->h;
    char err[256];
    int r = cs_kvx_payload_check(h, c->buf, rx->p.require_checksum && h->type == CS_KVX_PAGES, err, sizeof err);
    if (r) {
        conn_fail(rx, c, r, err, true);
        return;
    }
    rx->st.frames++;
    if (!c->hello) {
        if (h->type != CS_KVX_HELLO) {
            snprintf(err, sizeof err, "%s frame before HELLO", cs_kvx_frame_type_name(h->type));
            conn_fail(rx, c, CS_EPROTO, err, true);
            return;
        }
        on_hello(rx, c, h, c->buf);
        return;
    }
    if (h->epoch != c->peer_inc) {
        snprintf(err, sizeof err, "%s frame from incarnation %llx on a channel of incarnation %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->epoch, (unsigned long long)c->peer_inc);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    if (h->fingerprint != rx->fingerprint) {
        snprintf(err, sizeof err, "%s frame with layout fingerprint %llx, expected %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->fingerprint,
                 (unsigned long long)rx->fingerprint);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    switch (h->type) {
    case CS_KVX_PING: return;
    case CS_KVX_HELLO:
    case CS_KVX_HELLO_ACK:
    case CS_KVX_DONE:
        snprintf(err, sizeof err, "unexpected %s frame", cs_kvx_frame_type_name(h->type));
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    default: break;
    }
    rx_xfer *x = find_xfer(rx, h->xfer_id);
    if (!x || (x->conn && x->conn != c)) {
        if (!x && tomb_has(rx, h->xfer_id)) {
            /* ended here (deadline, cancel) while frames were in flight */
            if (h->type != CS_KVX_ABORT) queue_status(rx, c, CS_KVX_ABORT, h->xfer_id, CS_ECANCELED);
            return;
        }
        snprintf(err, sizeof err, "%s frame for %s transfer %llu", cs_kvx_frame_type_name(h->type),
                 x ? "another channel's" : "unknown", (unsigned long long)h->xfer_id);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    x->conn = c;
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
    if (h->type == CS_KVX_PAGES) {
        if (h->first_page != (uint32_t)x->received || h->n_pages > (uint32_t)(x->n_pages - x->received)) {
            snprintf(err, sizeof err, "transfer %llu: pages %u+%u, expected from %d of %d reserved",
                     (unsigned long long)x->id, h->first_page, h->n_pages, x->received, x->n_pages);
            conn_fail(rx, c, CS_EPROTO, err, true);
            return;
        }
        XXH64_update(&x->hash, c->buf, (size_t)h->payload_len);
        /* Import without the lock: only this thread ends transfers, so x
         * stays valid; cancel only flags it. */
        const int32_t *ids = x->ids + h->first_page;
        pthread_mutex_unlock(&rx->mu);
        r = rx->p.import(rx->p.import_arg, ids, (int32_t)h->n_pages, c->buf);
        pthread_mutex_lock(&rx->mu);
        if (r) {
            snprintf(err, sizeof err, "import of pages %u+%u failed: %s", h->first_page, h->n_pages, cs_strerror(r));
            xfer_end(rx, x, r < 0 ? r : CS_EIO, err, NULL, true);
            return;
        }
        x->received += (int32_t)h->n_pages;
        rx->st.bytes += h->payload_len;
        return;
    }
    /* TRAILER */
    cs_kvx_trailer_wire tw;
    if (cs_kvx_trailer_decode(c->buf, (size_t)h->payload_len, &tw, err, sizeof err)) {
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    if (tw.t.total_pages != x->n_pages || x->received != x->n_pages) {
        snprintf(err, sizeof err, "transfer %llu: trailer says %d pages, %d received of %d reserved",
                 (unsigned long long)x->id, tw.t.total_pages, x->received, x->n_pages);
        conn_fail(rx, c, CS_EPROTO, err, true);
        return;
    }
    if (tw.xxh64 != XXH64_digest(&x->hash)) {
        snprintf(err, sizeof err, "transfer %llu: checksum of all pages mismatch", (unsigned long long)x->id);
        conn_fail(rx, c, CS_EBADMSG, err, true);
        return;
    }
    xfer_end(rx, x, 0, NULL, &tw.t, true);
}

static void conn_read(cs_kvx_rx *rx, rx_conn *c) {
    cs_kvx_limits lim = {rx->p.layout.page_bytes, rx->p.max_frame_bytes};
    size_t budget = 16u << 20; /* per poll round, for fairness between channels */
    while (!c->closing && budget > 0) {
        uint8_t *dst;
        size_t want;
        if (c->hdr_len < CS_KVX_HDR_BYTES) {
            dst = c->hdr + c->hdr_len;
            want = CS_KVX_HDR_BYTES - c->hdr_len;
        } else {
            dst = c->buf + c->pl_len;
            want = (size_t)c->h.payload_len - c->pl_len;
        }
        ssize_t n = want ? read(c->fd, dst, want) : 0;
        if (want && n <= 0) {
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (n < 0 && errno == EINTR) continue;
            char m[160];
            if (c->hdr_len || c->pl_len)
                snprintf(m, sizeof m, "channel from %s closed inside a frame (truncated)", c->name[0] ? c->name : c->addr);
            else
                snprintf(m, sizeof m, "sender %s closed the channel%s%s", c->name[0] ? c->name : c->addr,
                         n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
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
            if (r) {
                conn_fail(rx, c, r, err, true);
                return;
            }
            if (c->h.payload_len > c->buf_cap) {
                uint8_t *nb = realloc(c->buf, (size_t)c->h.payload_len);
                if (!nb) {
                    conn_fail(rx, c, CS_ENOMEM, "out of memory for a frame", true);
                    return;
                }
                c->buf = nb;
                c->buf_cap = (size_t)c->h.payload_len;
            }
            c->pl_len = 0;
        } else {
            c->pl_len += (size_t)n;
        }
        if (c->pl_len == c->h.payload_len) {
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

static void do_accept(cs_kvx_rx *rx) {
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(rx->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
        if (fd < 0) return;
        rx_conn *c = rx->n_conns < rx->p.max_conns ? calloc(1, sizeof *c) : NULL;
        if (!c || cs__kvx_set_socket_opts(fd) != 0) {
            CS_LOGW("kvx rx: refusing a channel (%d open)", rx->n_conns);
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        char host[48] = "?";
        if (sa.ss_family == AF_INET) inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, host, sizeof host);
        else if (sa.ss_family == AF_INET6) inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, host, sizeof host);
        snprintf(c->addr, sizeof c->addr, "%s", host);
        c->last_rx = c->last_tx = cs__kvx_now_ms();
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
        for (rx_xfer *x = rx->xfers, *nx; x; x = nx) {
            nx = x->next;
            if (x->fail) xfer_end(rx, x, x->fail, "canceled by the receiver", NULL, true);
            else if (now >= x->deadline) xfer_end(rx, x, CS_ETIMEDOUT, "receiver deadline expired", NULL, true);
            else if (x->deadline - now < wait) wait = x->deadline - now;
        }
        for (rx_conn **pp = &rx->conns; *pp;) {
            rx_conn *c = *pp;
            if (!c->closing && now - c->last_rx > rx->p.dead_ms) {
                char m[160];
                snprintf(m, sizeof m, "sender %s silent for %d ms", c->name[0] ? c->name : c->addr, rx->p.dead_ms);
                conn_fail(rx, c, CS_ECONNRESET, m, false);
            }
            if (c->closing) { /* the safe point: nothing refers to c any more */
                *pp = c->next;
                conn_free(rx, c);
                continue;
            }
            if (c->hello && !c->qhead && now - c->last_tx >= rx->p.keepalive_ms)
                queue_ctl(rx, c, CS_KVX_PING, 0, NULL, 0);
            pp = &c->next;
        }
        if (rx->ev_head) {
            run_events(rx);
            continue;
        }
        int n = 2;
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
        int pr = poll(pfds, (nfds_t)n, (int)(wait < 1 ? 1 : wait));
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

int cs_kvx_rx_init(const cs_kvx_rx_params *p, cs_kvx_rx **out) {
    *out = NULL;
    if (!p || !p->import || p->layout.page_bytes == 0 || p->keepalive_ms <= 0 || p->dead_ms <= p->keepalive_ms ||
        p->max_frame_bytes < p->layout.page_bytes || p->max_conns < 1 || p->port < 0 || p->port > 65535)
        return cs_fail(CS_EINVAL, "kvx rx: bad parameters (import, page_bytes, keepalive_ms < dead_ms, max_frame_bytes)");
    cs_kvx_rx *rx = calloc(1, sizeof *rx);
    if (!rx) return cs_fail(CS_ENOMEM, "kvx rx: out of memory");
    rx->p = *p;
    snprintf(rx->host, sizeof rx->host, "%s", p->host ? p->host : "127.0.0.1");
    rx->p.host = rx->host;
    rx->fingerprint = cs_kvx_layout_fingerprint(&p->layout);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    rx->inc = ((uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u) << 8 ^ (uint64_t)(getpid() & 0xff);
    int r;
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
    if (rx->lfd < 0 || bind(rx->lfd, res->ai_addr, res->ai_addrlen) != 0 || listen(rx->lfd, 128) != 0) {
        r = cs_fail(-errno, "kvx rx: cannot listen on %s:%d: %s", rx->host, p->port, strerror(errno));
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
    free(rx);
    return r;
}

void cs_kvx_rx_free(cs_kvx_rx *rx) {
    if (!rx) return;
    pthread_mutex_lock(&rx->mu);
    rx->stop = true;
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
    pthread_join(rx->thread, NULL);
    pthread_mutex_lock(&rx->mu);
    while (rx->xfers) xfer_end(rx, rx->xfers, CS_ECANCELED, "receiver shut down", NULL, false);
    while (rx->conns) {
        rx_conn *c = rx->conns;
        rx->conns = c->next;
        conn_free(rx, c);
    }
    run_events(rx);
    pthread_mutex_unlock(&rx->mu);
    pthread_mutex_destroy(&rx->mu);
    close(rx->lfd);
    close(rx->wake[0]);
    free(rx);
}

int cs_kvx_rx_port(const cs_kvx_rx *rx) { return rx->port; }
uint64_t cs_kvx_rx_incarnation(const cs_kvx_rx *rx) { return rx->inc; }

int cs_kvx_rx_expect(cs_kvx_rx *rx, uint64_t xfer_id, const int32_t *page_ids, int32_t n_pages, int32_t deadline_ms,
                     cs_kvx_done_fn done, void *arg) {
    if (!page_ids || n_pages < 1 || deadline_ms <= 0 || !done || xfer_id == 0)
        return cs_fail(CS_EINVAL, "kvx rx: bad expectation (id != 0, n_pages >= 1, deadline_ms > 0, done)");
    rx_xfer *x = calloc(1, sizeof *x);
    int32_t *ids = malloc((size_t)n_pages * sizeof *ids);
    if (!x || !ids) {
        free(x), free(ids);
        return cs_fail(CS_ENOMEM, "kvx rx: out of memory");
    }
    memcpy(ids, page_ids, (size_t)n_pages * sizeof *ids);
    x->id = xfer_id;
    x->ids = ids;
    x->n_pages = n_pages;
    x->deadline = cs__kvx_now_ms() + deadline_ms;
    x->done = done;
    x->arg = arg;
    XXH64_reset(&x->hash, 0);
    pthread_mutex_lock(&rx->mu);
    if (find_xfer(rx, xfer_id)) {
        pthread_mutex_unlock(&rx->mu);
        free(ids), free(x);
        return cs_fail(CS_EEXIST, "kvx rx: transfer %llu already expected", (unsigned long long)xfer_id);
    }
    /* the id may be reused after it ended */
    for (int i = 0; i < N_TOMB; i++)
        if (rx->tomb[i] == xfer_id) rx->tomb[i] = 0;
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
    if (!x || x->fail) r = cs_fail(CS_ENOENT, "kvx rx: transfer %llu is not pending", (unsigned long long)xfer_id);
    else x->fail = CS_ECANCELED;
    cs__kvx_wake(rx->wake[1]);
    pthread_mutex_unlock(&rx->mu);
    return r;
}

void cs_kvx_rx_get_stats(cs_kvx_rx *rx, cs_kvx_stats *s) {
    pthread_mutex_lock(&rx->mu);
    *s = rx->st;
    pthread_mutex_unlock(&rx->mu);
}
