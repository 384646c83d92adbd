/* kvx_test.h: helpers for the KV transport tests: a waiter that collects
 * done callbacks (they run on the transport's I/O threads), host pools, and
 * raw frames written straight to a socket to play a misbehaving peer. */
#ifndef CS_KVX_TEST_H
#define CS_KVX_TEST_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "../unit/test.h"
#include "chunkserve/kvx.h"
#include "kvx_wire.h"
#include "kvx-impl.h"

#define MAXW 4096
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_done;
    uint64_t ids[MAXW];
    int status[MAXW];
    char msg[MAXW][96];
    cs_kvx_trailer t[MAXW];
} waiter;

static inline void waiter_init(waiter *w) {
    memset(w, 0, sizeof *w);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
}

static inline void waiter_done(void *arg, uint64_t id, int status, const char *msg,
                               const cs_kvx_trailer *t) {
    waiter *w = arg;
    pthread_mutex_lock(&w->mu);
    if (w->n_done < MAXW) {
        w->ids[w->n_done] = id;
        w->status[w->n_done] = status;
        snprintf(w->msg[w->n_done], sizeof w->msg[0], "%s", msg ? msg : "");
        if (t) w->t[w->n_done] = *t;
    }
    w->n_done++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static inline int64_t test_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until n callbacks arrived; returns false after timeout_ms. */
static inline int waiter_wait(waiter *w, int n, int timeout_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&w->mu);
    int ok = 1;
    while (w->n_done < n && ok)
        ok = pthread_cond_timedwait(&w->cv, &w->mu, &ts) == 0;
    ok = w->n_done >= n;
    pthread_mutex_unlock(&w->mu);
    return ok;
}

/* Status reported for id (1 when not reported). */
static inline int waiter_status(waiter *w, uint64_t id) {
    pthread_mutex_lock(&w->mu);
    int s = 1;
    for (int i = 0; i < w->n_done && i < MAXW; i++)
        if (w->ids[i] == id) s = w->status[i];
    pthread_mutex_unlock(&w->mu);
    return s;
}

static inline cs_kvx_pool host_pool(void *base, int32_t n_pages) {
    cs_kvx_pool p = {CS_KVX_POOL_HOST, 0, base, n_pages};
    return p;
}

/* Sends pages of a transfer, retrying while the channel is full. */
static inline int send_retry(cs_kvx_tx *tx, uint64_t id, int32_t first, int32_t n,
                             const int32_t *ids, cs_kvx_release_fn release, void *arg) {
    int r;
    while ((r = cs_kvx_tx_send_pages(tx, id, first, n, ids, release, arg)) == CS_EAGAIN)
        usleep(200);
    return r;
}

static inline int raw_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ_INT(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static inline void raw_write(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w <= 0) return; /* the peer may have closed on us: that is what is tested */
        b += w, n -= (size_t)w;
    }
}

/* Writes one frame; payload may be NULL with len 0. */
static inline void raw_frame(int fd, int type, uint64_t epoch, uint64_t xfer, uint32_t first,
                             uint32_t n_pages, uint64_t fp, const void *payload, size_t len,
                             bool checksum) {
    cs_kvx_hdr h = {0};
    h.type = (uint16_t)type;
    h.epoch = epoch;
    h.xfer_id = xfer;
    h.first_page = first;
    h.n_pages = n_pages;
    h.fingerprint = fp;
    h.payload_len = len;
    if (checksum && len)
        h.flags = CS_KVX_FLAG_CHECKSUM, h.payload_xxh64 = cs_kvx_payload_sum(payload, len);
    uint8_t hdr[CS_KVX_HDR_BYTES];
    cs_kvx_hdr_encode(&h, hdr);
    raw_write(fd, hdr, sizeof hdr);
    if (len) raw_write(fd, payload, len);
}

/* Reads one whole frame (header into h, payload into pl of cap bytes);
 * false on EOF, timeout or a frame that does not decode. */
static inline bool raw_read_frame(int fd, cs_kvx_hdr *h, uint8_t *pl, size_t cap) {
    uint8_t hb[CS_KVX_HDR_BYTES];
    size_t got = 0;
    while (got < sizeof hb) {
        ssize_t n = recv(fd, hb + got, sizeof hb - got, 0);
        if (n <= 0) return false;
        got += (size_t)n;
    }
    cs_kvx_limits lim = {1, 1 << 20, true}; /* inline (TCP) */
    if (cs_kvx_hdr_decode(hb, &lim, h, NULL, 0) != 0 || h->payload_len > cap) return false;
    for (got = 0; got < h->payload_len;) {
        ssize_t n = recv(fd, pl + got, (size_t)h->payload_len - got, 0);
        if (n <= 0) return false;
        got += (size_t)n;
    }
    return true;
}

/* A raw sender's handshake: HELLO, the receiver's CHALLENGE, AUTH proved
 * with key (len 0: the empty key of a receiver without a secret). session
 * (may be NULL) receives the session key. Returns true once AUTH is sent;
 * false when the receiver answered HELLO with something else (a refusal). */
/* Called (when set) between the receiver's CHALLENGE and our AUTH. */
static void (*raw_before_auth)(void *arg);
static void *raw_before_auth_arg;

static inline bool raw_hello_key(int fd, const cs_kvx_layout *l, const char *name, uint64_t inc,
                                 const void *key, size_t key_len, uint8_t session[32]) {
    cs_kvx_hello m;
    memset(&m, 0, sizeof m);
    m.layout = *l;
    snprintf(m.name, sizeof m.name, "%s", name);
    for (int i = 0; i < CS_KVX_NONCE_BYTES; i++)
        m.nonce[i] = (uint8_t)(inc * 31 + (uint64_t)i);
    uint8_t pl[CS_KVX_HELLO_BYTES];
    cs_kvx_hello_encode(&m, pl);
    uint64_t fp = cs_kvx_layout_fingerprint(l);
    raw_frame(fd, CS_KVX_HELLO, inc, 0, 0, 0, fp, pl, sizeof pl, true);
    cs_kvx_hdr h;
    uint8_t in[CS_KVX_CTRL_MAX_BYTES];
    if (!raw_read_frame(fd, &h, in, sizeof in) || h.type != CS_KVX_CHALLENGE) return false;
    kvx_transcript t;
    memset(&t, 0, sizeof t);
    memcpy(t.tx_nonce, m.nonce, sizeof t.tx_nonce);
    memcpy(t.rx_nonce, in, sizeof t.rx_nonce);
    t.tx_inc = inc, t.rx_inc = h.epoch, t.fingerprint = fp;
    snprintf(t.name, sizeof t.name, "%s", name);
    kvx_key k = {.len = key_len};
    if (key_len) memcpy(k.key, key, key_len);
    uint8_t proof[CS_KVX_AUTH_BYTES];
    cs__kvx_derive(&k, KVX_PROOF_TX, &t, proof);
    if (session) cs__kvx_derive(&k, KVX_SESSION, &t, session);
    if (raw_before_auth) raw_before_auth(raw_before_auth_arg);
    raw_frame(fd, CS_KVX_AUTH, inc, 0, 0, 0, fp, proof, sizeof proof, true);
    return true;
}

static inline void raw_hello(int fd, const cs_kvx_layout *l, const char *name, uint64_t inc) {
    (void)raw_hello_key(fd, l, name, inc, NULL, 0, NULL);
}

/* Reads until EOF (true) or timeout/error (false): the receiver closed us. */
static inline bool raw_closed_by_peer(int fd) {
    uint8_t buf[4096];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n == 0) return true;
        if (n < 0) return errno == ECONNRESET;
    }
}

#endif
