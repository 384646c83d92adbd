/* kvx_tx.c: the KV transport's sender (TCP). One I/O thread polls every
 * channel; API calls only queue work under the mutex and wake it, so the
 * engine's step never waits on the network. Checksums are computed on the
 * I/O thread as each frame reaches the head of its channel's queue. */
#define XXH_STATIC_LINKING_ONLY
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include "chunkserve/kvx.h"
#include "kvx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

enum chan_state { CH_IDLE, CH_CONNECTING, CH_OPEN };

typedef struct tx_chan {
    struct tx_chan *next;
    char host[256];
    int port;
    int fd;
    enum chan_state state;
    bool acked;            /* HELLO_ACK received */
    uint64_t peer_inc;     /* receiver incarnation from the ACK */
    kvx_out *qhead, *qtail;
    size_t queued_bytes;
    int64_t last_rx, last_tx;
    uint8_t in[CS_KVX_HDR_BYTES + CS_KVX_ACK_BYTES]; /* incoming control frame */
    size_t in_len;
    int n_xfers;
} tx_chan;

typedef struct tx_xfer {
    struct tx_xfer *next;
    uint64_t id;
    tx_chan *ch;
    int32_t total_pages, queued_pages;
    bool trailer_queued;
    int64_t deadline;
    int fail; /* pending failure set by an API call (abort) */
    cs_kvx_done_fn done;
    void *arg;
    XXH64_state_t hash; /* of all pages written so far, in order */
} tx_xfer;

typedef struct tx_send {
    int refs;
    cs_kvx_release_fn release;
    void *arg;
    const void **pages; /* owned copy of the pointer array, or NULL */
} tx_send;

/* A finished transfer or a released send, reported after unlocking. */
typedef struct tx_event {
    struct tx_event *next;
    cs_kvx_done_fn done;
    void *arg;
    uint64_t id;
    int status;
    char msg[160];
    cs_kvx_release_fn release;
    void *rel_arg;
} tx_event;

struct cs_kvx_tx {
    cs_kvx_tx_params p;
    char name[CS_KVX_NAME_MAX];
    uint64_t fingerprint;
    pthread_mutex_t mu;
    pthread_t thread;
    int wake[2];
    bool stop;
    tx_chan *chans;
    tx_xfer *xfers;
    tx_event *ev_head, *ev_tail;
    cs_kvx_stats st;
};

cs_kvx_tx_params cs_kvx_tx_params_default(void) {
    cs_kvx_tx_params p;
    memset(&p, 0, sizeof p);
    p.name = "prefill";
    p.checksum = true;
    p.max_frame_bytes = 4u << 20;
    p.max_queued_bytes = 256u << 20;
    p.keepalive_ms = 1000;
    p.dead_ms = 5000;
    return p;
}

static void push_event(cs_kvx_tx *tx, tx_event *e) {
    if (tx->ev_tail) tx->ev_tail->next = e;
    else tx->ev_head = e;
    tx->ev_tail = e;
}

static void send_unref(cs_kvx_tx *tx, tx_send *s) {
    if (--s->refs > 0) return;
    if (s->release) {
        tx_event *e = calloc(1, sizeof *e);
        if (e) {
            e->release = s->release;
            e->rel_arg = s->arg;
            push_event(tx, e);
        } else {
            s->release(s->arg); /* out of memory: release now rather than leak */
        }
    }
    free(s->pages);
    free(s);
}

static void free_out(cs_kvx_tx *tx, kvx_out *o) {
    if (o->owner) send_unref(tx, o->owner);
    free(o);
}

static void enqueue(tx_chan *ch, kvx_out *o) {
    o->next = NULL;
    if (ch->qtail) ch->qtail->next = o;
    else ch->qhead = o;
    ch->qtail = o;
    ch->queued_bytes += o->total;
}

/* Removes x from the table and reports status; drops its frames that have
 * not started (a started one finishes so the stream stays framed). */
static void xfer_end(cs_kvx_tx *tx, tx_xfer *x, int status, const char *msg) {
    for (tx_xfer **pp = &tx->xfers; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    tx_chan *ch = x->ch;
    kvx_out **pp = &ch->qhead, *prev = NULL;
    while (*pp) {
        kvx_out *o = *pp;
        if (o->xfer == x && o->off == 0) {
            *pp = o->next;
            ch->queued_bytes -= o->total;
            if (ch->qtail == o) ch->qtail = prev;
            free_out(tx, o);
        } else {
            if (o->xfer == x) o->xfer = NULL;
            prev = o;
            pp = &o->next;
        }
    }
    ch->n_xfers--;
    tx->st.transfers_active--;
    if (status == 0) tx->st.transfers_completed++;
    else tx->st.transfers_failed++;
    tx_event *e = calloc(1, sizeof *e);
    CS_ASSERT(e); /* a lost completion would hang the caller: fail loudly */
    e->done = x->done;
    e->arg = x->arg;
    e->id = x->id;
    e->status = status;
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "");
    push_event(tx, e);
    if (status) CS_LOGW("kvx tx: transfer %llu to %s:%d failed: %s (%s)", (unsigned long long)x->id, ch->host, ch->port,
                        cs_strerror(status), msg ? msg : "");
    free(x);
}

static void chan_close(cs_kvx_tx *tx, tx_chan *ch, int status, const char *msg) {
    if (ch->fd >= 0) {
        close(ch->fd);
        tx->st.conns_closed++;
    }
    ch->fd = -1;
    ch->state = CH_IDLE;
    ch->acked = false;
    ch->in_len = 0;
    for (tx_xfer *x = tx->xfers, *nx; x; x = nx) {
        nx = x->next;
        if (x->ch == ch) xfer_end(tx, x, status, msg);
    }
    while (ch->qhead) {
        kvx_out *o = ch->qhead;
        ch->qhead = o->next;
        free_out(tx, o);
    }
    ch->qtail = NULL;
    ch->queued_bytes = 0;
}

static tx_chan *find_chan(cs_kvx_tx *tx, const char *host, int port) {
    for (tx_chan *c = tx->chans; c; c = c->next)
        if (c->port == port && strcmp(c->host, host) == 0) return c;
    return NULL;
}

static tx_xfer *find_xfer(cs_kvx_tx *tx, uint64_t id) {
    for (tx_xfer *x = tx->xfers; x; x = x->next)
        if (x->id == id) return x;
    return NULL;
}

static void queue_ctl(cs_kvx_tx *tx, tx_chan *ch, int type, uint64_t xfer, const void *pl, size_t len, bool front) {
    kvx_out *o = calloc(1, sizeof *o);
    CS_ASSERT(o);
    cs__kvx_out_ctl(o, type, tx->p.incarnation, xfer, tx->fingerprint, pl, len);
    if (front && (!ch->qhead || ch->qhead->off == 0)) {
        o->next = ch->qhead;
        ch->qhead = o;
        if (!ch->qtail) ch->qtail = o;
        ch->queued_bytes += o->total;
    } else {
        enqueue(ch, o);
    }
}

/* Starts a non-blocking connect; the HELLO goes first in the queue. Called
 * without the lock held for the name lookup. */
static int chan_connect(cs_kvx_tx *tx, tx_chan *ch) {
    char host[256], port[16];
    snprintf(host, sizeof host, "%s", ch->host);
    snprintf(port, sizeof port, "%d", ch->port);
    pthread_mutex_unlock(&tx->mu);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    int gr = getaddrinfo(host, port, &hints, &res);
    int fd = -1, err = 0;
    if (gr != 0) {
        err = CS_ENOENT;
    } else {
        fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || cs__kvx_set_socket_opts(fd) != 0) err = -errno;
        else if (connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) err = -errno;
        freeaddrinfo(res);
    }
    pthread_mutex_lock(&tx->mu);
    if (err) {
        if (fd >= 0) close(fd);
        char m[300];
        snprintf(m, sizeof m, "cannot connect to %s:%s: %s", host, port, gr ? gai_strerror(gr) : cs_strerror(err));
        chan_close(tx, ch, gr ? CS_ENOENT : err, m);
        return err;
    }
    ch->fd = fd;
    ch->state = CH_CONNECTING;
    ch->last_rx = ch->last_tx = cs__kvx_now_ms();
    tx->st.conns_opened++;
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = tx->p.layout;
    snprintf(hello.name, sizeof hello.name, "%s", tx->name);
    uint8_t pl[CS_KVX_HELLO_BYTES];
    cs_kvx_hello_encode(&hello, pl);
    queue_ctl(tx, ch, CS_KVX_HELLO, 0, pl, sizeof pl, true);
    return 0;
}

/* Seals a page frame at the head of the queue: payload checksum, running
 * transfer checksum, header. Trailers take the transfer's digest. */
static void seal(cs_kvx_tx *tx, kvx_out *o) {
    tx_xfer *x = o->xfer;
    if (o->type == CS_KVX_PAGES) {
        XXH64_state_t st;
        XXH64_reset(&st, 0);
        for (int32_t i = 0; i < o->n_pages; i++) {
            const void *pg = o->pages ? o->pages[i] : o->data + (size_t)i * o->page_bytes;
            if (tx->p.checksum) XXH64_update(&st, pg, o->page_bytes);
            if (x) XXH64_update(&x->hash, pg, o->page_bytes);
        }
        if (tx->p.checksum) {
            o->h.flags |= CS_KVX_FLAG_CHECKSUM;
            o->h.payload_xxh64 = XXH64_digest(&st);
        }
    } else if (o->type == CS_KVX_TRAILER) {
        cs_kvx_trailer_wire tw;
        memset(&tw, 0, sizeof tw);
        tw.t.first_token = (int32_t)o->h.first_page; /* stashed by cs_kvx_tx_finish */
        tw.t.prompt_len = (int32_t)o->h.n_pages;
        tw.t.total_pages = (int32_t)o->h.payload_xxh64;
        tw.xxh64 = x ? XXH64_digest(&x->hash) : 0;
        uint64_t fp = o->h.fingerprint;
        cs__kvx_out_ctl(o, CS_KVX_TRAILER, tx->p.incarnation, o->xfer_id, fp, NULL, 0);
        cs_kvx_trailer_encode(&tw, o->ctl);
        o->h.payload_len = CS_KVX_TRAILER_BYTES;
        o->h.flags = CS_KVX_FLAG_CHECKSUM;
        o->h.payload_xxh64 = XXH64(o->ctl, CS_KVX_TRAILER_BYTES, 0);
        o->total = CS_KVX_HDR_BYTES + CS_KVX_TRAILER_BYTES;
    }
    cs_kvx_hdr_encode(&o->h, o->hdr);
    o->sealed = true;
}

static void chan_write(cs_kvx_tx *tx, tx_chan *ch) {
    while (ch->qhead) {
        kvx_out *o = ch->qhead;
        if (!o->sealed) seal(tx, o);
        size_t before = o->off;
        int r = cs__kvx_out_write(ch->fd, o);
        if (o->off != before) ch->last_tx = cs__kvx_now_ms();
        if (r < 0) {
            char m[128];
            snprintf(m, sizeof m, "write to %s:%d: %s", ch->host, ch->port, cs_strerror(r));
            chan_close(tx, ch, CS_ECONNRESET, m);
            return;
        }
        if (r == 0) return;
        ch->queued_bytes -= o->total;
        if (o->type == CS_KVX_PAGES) {
            tx->st.bytes += o->total - CS_KVX_HDR_BYTES;
        }
        tx->st.frames++;
        ch->qhead = o->next;
        if (!ch->qhead) ch->qtail = NULL;
        free_out(tx, o);
    }
}

static void chan_frame(cs_kvx_tx *tx, tx_chan *ch, const cs_kvx_hdr *h, const uint8_t *pl) {
    char err[200];
    if (h->type == CS_KVX_HELLO_ACK) {
        int32_t status;
        char msg[128];
        int r = cs_kvx_ack_decode(pl, (size_t)h->payload_len, &status, msg, sizeof msg);
        if (r || status) {
            snprintf(err, sizeof err, "receiver %s:%d refused the channel: %s", ch->host, ch->port,
                     r ? "bad HELLO_ACK" : msg);
            chan_close(tx, ch, r ? CS_EPROTO : CS_ECONNREFUSED, err);
            return;
        }
        ch->acked = true;
        ch->peer_inc = h->epoch;
        return;
    }
    if (!ch->acked || h->epoch != ch->peer_inc) {
        snprintf(err, sizeof err, "%s frame from receiver incarnation %llx on a channel of %llx",
                 cs_kvx_frame_type_name(h->type), (unsigned long long)h->epoch, (unsigned long long)ch->peer_inc);
        tx->st.protocol_errors++;
        chan_close(tx, ch, CS_EPROTO, err);
        return;
    }
    if (h->type == CS_KVX_PING) return;
    if (h->type == CS_KVX_DONE || h->type == CS_KVX_ABORT) {
        int32_t status;
        if (cs_kvx_status_decode(pl, (size_t)h->payload_len, &status, err, sizeof err)) {
            tx->st.protocol_errors++;
            chan_close(tx, ch, CS_EPROTO, err);
            return;
        }
        tx_xfer *x = find_xfer(tx, h->xfer_id);
        if (!x || x->ch != ch) return; /* already ended here */
        if (h->type == CS_KVX_DONE && status == 0 && !x->trailer_queued) status = CS_EPROTO;
        snprintf(err, sizeof err, "receiver %s the transfer", h->type == CS_KVX_DONE ? "ended" : "aborted");
        xfer_end(tx, x, h->type == CS_KVX_ABORT && status == 0 ? CS_ECANCELED : status, status ? err : NULL);
        return;
    }
    snprintf(err, sizeof err, "unexpected %s frame from the receiver", cs_kvx_frame_type_name(h->type));
    tx->st.protocol_errors++;
    chan_close(tx, ch, CS_EPROTO, err);
}

static void chan_read(cs_kvx_tx *tx, tx_chan *ch) {
    cs_kvx_limits lim = {tx->p.layout.page_bytes, CS_KVX_ACK_BYTES};
    for (;;) {
        size_t want = CS_KVX_HDR_BYTES;
        cs_kvx_hdr h;
        char err[200];
        if (ch->in_len >= CS_KVX_HDR_BYTES) {
            int r = cs_kvx_hdr_decode(ch->in, &lim, &h, err, sizeof err);
            if (!r && h.type == CS_KVX_PAGES) r = CS_EPROTO, snprintf(err, sizeof err, "PAGES frame from a receiver");
            if (r) {
                tx->st.protocol_errors++;
                chan_close(tx, ch, r, err);
                return;
            }
            want += (size_t)h.payload_len;
            if (ch->in_len == want) {
                if (cs_kvx_payload_check(&h, ch->in + CS_KVX_HDR_BYTES, false, err, sizeof err)) {
                    tx->st.protocol_errors++;
                    chan_close(tx, ch, CS_EBADMSG, err);
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
        char m[128];
        snprintf(m, sizeof m, "receiver %s:%d closed the channel%s%s", ch->host, ch->port, n < 0 ? ": " : "",
                 n < 0 ? strerror(errno) : "");
        chan_close(tx, ch, CS_ECONNRESET, m);
        return;
    }
}

static void run_events(cs_kvx_tx *tx) {
    tx_event *e = tx->ev_head;
    tx->ev_head = tx->ev_tail = NULL;
    pthread_mutex_unlock(&tx->mu);
    while (e) {
        tx_event *n = e->next;
        if (e->release) e->release(e->rel_arg);
        if (e->done) e->done(e->arg, e->id, e->status, e->msg, NULL);
        free(e);
        e = n;
    }
    pthread_mutex_lock(&tx->mu);
}

static void *tx_thread(void *arg) {
    cs_kvx_tx *tx = arg;
    cs_log_set_role("kvx-tx");
    pthread_mutex_lock(&tx->mu);
    struct pollfd *pfds = NULL;
    tx_chan **pch = NULL;
    int cap = 0;
    while (!tx->stop) {
        int64_t now = cs__kvx_now_ms();
        int64_t wait = tx->p.keepalive_ms;
        /* failures requested by API calls, deadlines */
        for (tx_xfer *x = tx->xfers, *nx; x; x = nx) {
            nx = x->next;
            if (x->fail) {
                if (x->fail == CS_ECANCELED && x->ch->fd >= 0) {
                    uint8_t pl[CS_KVX_STATUS_BYTES];
                    cs_kvx_status_encode(CS_ECANCELED, pl);
                    queue_ctl(tx, x->ch, CS_KVX_ABORT, x->id, pl, sizeof pl, false);
                }
                xfer_end(tx, x, x->fail, x->fail == CS_ECANCELED ? "aborted by the sender" : NULL);
            } else if (now >= x->deadline) {
                if (x->ch->fd >= 0) {
                    uint8_t pl[CS_KVX_STATUS_BYTES];
                    cs_kvx_status_encode(CS_ETIMEDOUT, pl);
                    queue_ctl(tx, x->ch, CS_KVX_ABORT, x->id, pl, sizeof pl, false);
                }
                xfer_end(tx, x, CS_ETIMEDOUT, "sender deadline expired");
            } else if (x->deadline - now < wait) {
                wait = x->deadline - now;
            }
        }
        int n = 1, nch = 0;
        for (tx_chan *c = tx->chans; c; c = c->next) nch++;
        if (nch + 1 > cap) {
            cap = 2 * (nch + 1);
            pfds = realloc(pfds, (size_t)cap * sizeof *pfds);
            pch = realloc(pch, (size_t)cap * sizeof *pch);
            CS_ASSERT(pfds && pch);
        }
        pfds[0].fd = tx->wake[0];
        pfds[0].events = POLLIN;
        for (tx_chan *c = tx->chans, *nc; c; c = nc) {
            nc = c->next;
            if (c->state == CH_IDLE && c->n_xfers > 0) chan_connect(tx, c);
            if (c->fd < 0) continue;
            if (now - c->last_rx > tx->p.dead_ms) {
                char m[128];
                snprintf(m, sizeof m, "receiver %s:%d silent for %d ms", c->host, c->port, tx->p.dead_ms);
                chan_close(tx, c, CS_ECONNRESET, m);
                continue;
            }
            if (c->state == CH_OPEN && !c->qhead && now - c->last_tx >= tx->p.keepalive_ms && c->acked)
                queue_ctl(tx, c, CS_KVX_PING, 0, NULL, 0, false);
            pfds[n].fd = c->fd;
            pfds[n].events = POLLIN | (c->state == CH_CONNECTING || c->qhead ? POLLOUT : 0);
            pch[n++] = c;
        }
        if (tx->ev_head) {
            run_events(tx);
            continue;
        }
        pthread_mutex_unlock(&tx->mu);
        int pr = poll(pfds, (nfds_t)n, (int)(wait < 1 ? 1 : wait));
        pthread_mutex_lock(&tx->mu);
        if (pr < 0) continue;
        if (pfds[0].revents) cs__kvx_drain(tx->wake[0]);
        for (int i = 1; i < n; i++) {
            tx_chan *c = pch[i];
            short rev = pfds[i].revents;
            if (!rev || c->fd != pfds[i].fd) continue;
            if (c->state == CH_CONNECTING && (rev & (POLLOUT | POLLERR | POLLHUP))) {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                if (soerr) {
                    char m[160];
                    snprintf(m, sizeof m, "cannot connect to %s:%d: %s", c->host, c->port, strerror(soerr));
                    chan_close(tx, c, CS_ECONNREFUSED, m);
                    continue;
                }
                c->state = CH_OPEN;
            }
            if (rev & (POLLIN | POLLERR | POLLHUP)) chan_read(tx, c);
            if (c->fd >= 0 && (rev & POLLOUT)) chan_write(tx, c);
        }
        run_events(tx);
    }
    pthread_mutex_unlock(&tx->mu);
    free(pfds);
    free(pch);
    return NULL;
}

int cs_kvx_tx_init(const cs_kvx_tx_params *p, cs_kvx_tx **out) {
    *out = NULL;
    if (!p || !p->name || !p->name[0] || strlen(p->name) >= CS_KVX_NAME_MAX || p->layout.page_bytes == 0 ||
        p->keepalive_ms <= 0 || p->dead_ms <= p->keepalive_ms)
        return cs_fail(CS_EINVAL, "kvx tx: bad parameters (name, page_bytes, keepalive_ms < dead_ms)");
    cs_kvx_tx *tx = calloc(1, sizeof *tx);
    if (!tx) return cs_fail(CS_ENOMEM, "kvx tx: out of memory");
    tx->p = *p;
    snprintf(tx->name, sizeof tx->name, "%s", p->name);
    tx->p.name = tx->name;
    if (tx->p.max_frame_bytes < p->layout.page_bytes) tx->p.max_frame_bytes = p->layout.page_bytes;
    if (!tx->p.incarnation) {
        /* Increases across restarts of one host's process: wall clock in
         * microseconds; the pid breaks ties. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        tx->p.incarnation = ((uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u) << 8 ^ (uint64_t)(getpid() & 0xff);
    }
    tx->fingerprint = cs_kvx_layout_fingerprint(&p->layout);
    int r = cs__kvx_wake_init(tx->wake);
    if (r) goto fail_wake;
    pthread_mutex_init(&tx->mu, NULL);
    if (pthread_create(&tx->thread, NULL, tx_thread, tx) != 0) {
        r = CS_ENOMEM;
        goto fail_thread;
    }
    *out = tx;
    return 0;
fail_thread:
    pthread_mutex_destroy(&tx->mu);
    close(tx->wake[0]);
fail_wake:
    free(tx);
    return cs_fail(r, "kvx tx: cannot start: %s", cs_strerror(r));
}

void cs_kvx_tx_free(cs_kvx_tx *tx) {
    if (!tx) return;
    pthread_mutex_lock(&tx->mu);
    tx->stop = true;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    pthread_join(tx->thread, NULL);
    pthread_mutex_lock(&tx->mu);
    while (tx->chans) {
        tx_chan *c = tx->chans;
        chan_close(tx, c, CS_ECANCELED, "sender shut down");
        tx->chans = c->next;
        free(c);
    }
    run_events(tx);
    pthread_mutex_unlock(&tx->mu);
    pthread_mutex_destroy(&tx->mu);
    close(tx->wake[0]);
    free(tx);
}

uint64_t cs_kvx_tx_incarnation(const cs_kvx_tx *tx) { return tx->p.incarnation; }

int cs_kvx_tx_begin(cs_kvx_tx *tx, const char *host, int port, uint64_t xfer_id, int32_t total_pages,
                    int32_t deadline_ms, cs_kvx_done_fn done, void *arg) {
    if (!host || strlen(host) >= 256 || port <= 0 || port > 65535 || total_pages < 1 || deadline_ms <= 0 || !done)
        return cs_fail(CS_EINVAL, "kvx tx: bad transfer (host, port, total_pages >= 1, deadline_ms > 0, done)");
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    if (find_xfer(tx, xfer_id)) {
        r = cs_fail(CS_EEXIST, "kvx tx: transfer %llu already open", (unsigned long long)xfer_id);
        goto out;
    }
    tx_chan *ch = find_chan(tx, host, port);
    if (!ch) {
        ch = calloc(1, sizeof *ch);
        if (!ch) {
            r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
            goto out;
        }
        snprintf(ch->host, sizeof ch->host, "%s", host);
        ch->port = port;
        ch->fd = -1;
        ch->next = tx->chans;
        tx->chans = ch;
    }
    tx_xfer *x = calloc(1, sizeof *x);
    if (!x) {
        r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
        goto out;
    }
    x->id = xfer_id;
    x->ch = ch;
    x->total_pages = total_pages;
    x->deadline = cs__kvx_now_ms() + deadline_ms;
    x->done = done;
    x->arg = arg;
    XXH64_reset(&x->hash, 0);
    x->next = tx->xfers;
    tx->xfers = x;
    ch->n_xfers++;
    tx->st.transfers_started++;
    tx->st.transfers_active++;
    cs__kvx_wake(tx->wake[1]);
out:
    pthread_mutex_unlock(&tx->mu);
    return r;
}

static int send_common(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages, const void *data,
                       const void *const *pagev, cs_kvx_release_fn release, void *arg) {
    int r = 0;
    tx_send *s = NULL;
    pthread_mutex_lock(&tx->mu);
    tx_xfer *x = find_xfer(tx, xfer_id);
    if (!x || x->fail || x->trailer_queued) {
        r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
        goto fail;
    }
    if (n_pages < 1 || first_page != x->queued_pages || n_pages > x->total_pages - x->queued_pages || (!data && !pagev)) {
        r = cs_fail(CS_EINVAL, "kvx tx: transfer %llu: pages %d+%d out of order (queued %d of %d)",
                     (unsigned long long)xfer_id, first_page, n_pages, x->queued_pages, x->total_pages);
        goto fail;
    }
    size_t pb = (size_t)tx->p.layout.page_bytes;
    if (x->ch->queued_bytes + (size_t)n_pages * pb > tx->p.max_queued_bytes && x->ch->queued_bytes > 0) {
        r = cs_fail(CS_EAGAIN, "kvx tx: channel to %s:%d full (%zu bytes queued)", x->ch->host, x->ch->port,
                     x->ch->queued_bytes);
        goto fail;
    }
    s = calloc(1, sizeof *s);
    if (!s) goto nomem;
    if (pagev) {
        s->pages = malloc((size_t)n_pages * sizeof *s->pages);
        if (!s->pages) goto nomem;
        memcpy(s->pages, pagev, (size_t)n_pages * sizeof *s->pages);
    }
    s->release = release;
    s->arg = arg;
    int32_t per = (int32_t)(tx->p.max_frame_bytes / pb);
    if (per < 1) per = 1;
    int32_t nfr = (n_pages + per - 1) / per;
    kvx_out **outs = calloc((size_t)nfr, sizeof *outs);
    if (!outs) goto nomem;
    for (int32_t i = 0; i < nfr; i++) {
        outs[i] = calloc(1, sizeof **outs);
        if (!outs[i]) {
            for (int32_t j = 0; j < i; j++) free(outs[j]);
            free(outs);
            goto nomem;
        }
    }
    for (int32_t i = 0; i < nfr; i++) {
        kvx_out *o = outs[i];
        int32_t p0 = i * per, np = n_pages - p0 < per ? n_pages - p0 : per;
        o->type = CS_KVX_PAGES;
        o->xfer_id = xfer_id;
        o->h.type = CS_KVX_PAGES;
        o->h.epoch = tx->p.incarnation;
        o->h.xfer_id = xfer_id;
        o->h.first_page = (uint32_t)(first_page + p0);
        o->h.n_pages = (uint32_t)np;
        o->h.fingerprint = tx->fingerprint;
        o->h.payload_len = (uint64_t)np * pb;
        if (s->pages) o->pages = (const void *const *)s->pages + p0;
        else o->data = (const uint8_t *)data + (size_t)p0 * pb;
        o->n_pages = np;
        o->page_bytes = pb;
        o->owner = s;
        o->xfer = x;
        o->total = CS_KVX_HDR_BYTES + (size_t)np * pb;
        s->refs++;
        enqueue(x->ch, o);
    }
    free(outs);
    x->queued_pages += n_pages;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    return 0;
nomem:
    r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
fail:
    pthread_mutex_unlock(&tx->mu);
    if (s) free(s->pages);
    free(s);
    if (release) release(arg);
    return r;
}

int cs_kvx_tx_send_pages(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages, const void *data,
                         cs_kvx_release_fn release, void *arg) {
    return send_common(tx, xfer_id, first_page, n_pages, data, NULL, release, arg);
}

int cs_kvx_tx_send_pagev(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages,
                         const void *const *pages, cs_kvx_release_fn release, void *arg) {
    return send_common(tx, xfer_id, first_page, n_pages, NULL, pages, release, arg);
}

int cs_kvx_tx_finish(cs_kvx_tx *tx, uint64_t xfer_id, const cs_kvx_trailer *t) {
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    tx_xfer *x = find_xfer(tx, xfer_id);
    if (!x || x->fail || x->trailer_queued) {
        r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
    } else if (!t || t->total_pages != x->total_pages || x->queued_pages != x->total_pages || t->first_token < 0 ||
               t->prompt_len < 0) {
        r = cs_fail(CS_EINVAL, "kvx tx: transfer %llu: trailer with %d pages after %d of %d queued",
                     (unsigned long long)xfer_id, t ? t->total_pages : -1, x->queued_pages, x->total_pages);
    } else {
        kvx_out *o = calloc(1, sizeof *o);
        if (!o) {
            r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
        } else {
            /* sealed on the I/O thread, once every page before it is hashed */
            o->type = CS_KVX_TRAILER;
            o->xfer_id = xfer_id;
            o->h.first_page = (uint32_t)t->first_token;
            o->h.n_pages = (uint32_t)t->prompt_len;
            o->h.payload_xxh64 = (uint64_t)t->total_pages;
            o->h.fingerprint = tx->fingerprint;
            o->xfer = x;
            o->total = CS_KVX_HDR_BYTES + CS_KVX_TRAILER_BYTES;
            enqueue(x->ch, o);
            x->trailer_queued = true;
            cs__kvx_wake(tx->wake[1]);
        }
    }
    pthread_mutex_unlock(&tx->mu);
    return r;
}

int cs_kvx_tx_abort(cs_kvx_tx *tx, uint64_t xfer_id) {
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    tx_xfer *x = find_xfer(tx, xfer_id);
    if (!x || x->fail) r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
    else x->fail = CS_ECANCELED;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    return r;
}

size_t cs_kvx_tx_queued_bytes(cs_kvx_tx *tx, const char *host, int port) {
    pthread_mutex_lock(&tx->mu);
    tx_chan *c = find_chan(tx, host, port);
    size_t n = c ? c->queued_bytes : 0;
    pthread_mutex_unlock(&tx->mu);
    return n;
}

void cs_kvx_tx_get_stats(cs_kvx_tx *tx, cs_kvx_stats *s) {
    pthread_mutex_lock(&tx->mu);
    *s = tx->st;
    pthread_mutex_unlock(&tx->mu);
}
